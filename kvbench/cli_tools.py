"""The console scripts ``kvbench-report`` and ``kvbench-dashboard``: they read a run's or a sweep's
records and write a report or a W&B workspace. They import the sinks and the record reader, never
torch or the jobs layer, so they start in a fraction of the time ``kvbench`` takes
(``tests/test_cli_tools.py`` checks it)."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Optional, Sequence

from kvbench.core.errors import one_line
from kvbench.jsonio import os_error_line
from kvbench.results import RESULTS_FILE
from kvbench.sinks.dashboard import PublishError, publish, write_dashboard
from kvbench.sinks.report import collect, write_report
from kvbench.units import count


def _seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0 (``nan``, ``inf`` and ``0`` are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number of seconds > 0")
    return value


def report_main(argv: Optional[Sequence[str]] = None) -> int:
    """Console script ``kvbench-report DIR [--out OUT]``."""
    parser = argparse.ArgumentParser(
        prog="kvbench-report",
        description="Summarise a kvbench run or sweep directory: summary.csv, summary.md and PNG plots.")
    parser.add_argument("dir", help="a run directory (outputs/...) or a sweep (multirun/<date>/<time>)")
    parser.add_argument("--out", help="where to write the report (default: DIR)")
    parser.add_argument("--no-plots", action="store_true", help="only summary.csv and summary.md")
    args = parser.parse_args(argv)
    try:
        report = write_report(args.dir, args.out, plots=not args.no_plots)
    except (FileNotFoundError, ValueError) as exc:
        print(f"kvbench-report: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # --out read-only, a file in the way, a full disk
        print(f"kvbench-report: {one_line(os_error_line(exc))}", file=sys.stderr)
        return 1
    counts = ", ".join(f"{n} {s}" for s, n in report.counts().items())
    print(f"{count(len(report.records), 'job')} ({counts}) under {report.root}")
    for path in report.files:
        print(f"  {path}")
    for name, why in report.skipped_plots.items():
        print(f"  ({name}.png not drawn: {why})")
    return 0


def dashboard_main(argv: Optional[Sequence[str]] = None) -> int:
    """Console script ``kvbench-dashboard DIR``: rebuild the sweep's W&B workspace and create it on W&B."""
    parser = argparse.ArgumentParser(
        prog="kvbench-dashboard",
        description="Build the W&B workspace of a kvbench sweep from its records and save it to W&B "
                    "(upload the runs first: wandb sync DIR/*/wandb/offline-run-*).")
    parser.add_argument("dir", help="a sweep directory (multirun/<date>/<time>)")
    parser.add_argument("--entity", help="W&B entity (default: the runs' wandb.entity, else your default entity)")
    parser.add_argument("--no-publish", action="store_true", help="only write workspace.json and workspace.md")
    parser.add_argument("--timeout", type=_seconds, default=30.0, help="seconds to wait for W&B (default 30)")
    args = parser.parse_args(argv)
    try:
        records = collect(args.dir)
        if not records:
            raise ValueError(f"no {RESULTS_FILE} under {args.dir}")
        board = write_dashboard(args.dir, records, entity=args.entity)
    except (OSError, ValueError) as exc:
        print(f"kvbench-dashboard: {exc}", file=sys.stderr)
        return 2
    print(f"workspace: {board.files[-1]} ({len(board.panels())} panels; spec {board.files[0]})")
    if args.no_publish:
        return 0
    try:
        print(f"workspace: {publish(board, args.timeout)}")
    except PublishError as exc:
        print(f"kvbench-dashboard: not created on W&B: {exc} (the spec is in {board.files[0]}; "
              "after `wandb login`, run this again)", file=sys.stderr)
        return 1
    return 0
