"""Entry points: ``kvbench`` (Hydra), ``kvbench-report`` and ``kvbench-dashboard``. With
:mod:`kvbench.cli_job` (one Hydra job) and :mod:`kvbench.cli_sweep` (the sweep around its jobs) it wires
the Hydra app to the jobs layer (kvbench/jobs/) and the sinks; nothing imports them back.

Exit codes: 0 ok; 2 a single run with an invalid value (one line on stderr naming the key),
or a command line Hydra cannot compose (an unknown group option, bad override syntax);
3 out of memory; 1 an internal error, or a record that could not be written; 128 + the signal
when interrupted (130 for Ctrl-C, 143 for SIGTERM). A multirun records invalid and oom jobs as
data and exits 1 when a job of this sweep errored, was interrupted or has no readable record.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from typing import Optional, Sequence

import hydra
from omegaconf import DictConfig, OmegaConf

from kvbench.cli_job import hydra_job
from kvbench.cli_sweep import SweepRefused, sweep_end
from kvbench.config import CONF_DIR, register_configs, schema_defaults
from kvbench.config_errors import config_error_line, is_composition_error, one_line
from kvbench.jobs.outcome import EXIT_CODES, OUTCOME
from kvbench.results import RESULTS_FILE
from kvbench.sinks.console import stderr
from kvbench.sinks.dashboard import PublishError, publish, write_dashboard
from kvbench.sinks.report import collect, write_report

register_configs()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> Optional[float]:
    # Launchers (submitit, joblib) pickle this function by value, with the globals it names:
    # it names only an importable function, which is pickled by reference.
    return hydra_job(cfg)


def main() -> None:
    """Console script ``kvbench``."""
    # Let Hydra's composition errors reach us (instead of its multi-line report and exit 1):
    # a bad value is the user's input, so one line naming the key and exit 2. A user who set
    # HYDRA_FULL_ERROR=1 gets the traceback, as Hydra documents.
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        _hydra_main()
    except SweepRefused as exc:
        stderr.print(f"kvbench: invalid config: {exc}", markup=False, soft_wrap=True)
        sys.exit(EXIT_CODES["invalid"])
    except Exception as exc:
        if isinstance(exc, OSError) and not full_error and not is_composition_error(exc):
            # outside any job: an output directory that cannot be made, say (Hydra's missing
            # config option is an OSError too, and a composition error: below)
            stderr.print(f"kvbench: {one_line(_os_error_line(exc))}", markup=False, soft_wrap=True)
            if OUTCOME.sweep is not None:
                sweep_end(OUTCOME.sweep)
            sys.exit(EXIT_CODES["error"])
        if OUTCOME.sweep is not None and not full_error and not is_composition_error(exc):
            # The sweeper failed after its jobs (Optuna's, when no trial has a value): what the
            # jobs recorded is still this sweep's table and report.
            stderr.print(f"kvbench: the sweeper failed: {one_line(f'{type(exc).__name__}: {exc}')}",
                         markup=False, soft_wrap=True)
            sweep_end(OUTCOME.sweep)
            sys.exit(EXIT_CODES["error"])
        if full_error or not is_composition_error(exc):
            raise
        stderr.print(f"kvbench: invalid config: {config_error_line(exc, _top_level_names())}", markup=False,
                     soft_wrap=True)
        sys.exit(EXIT_CODES["invalid"])
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM (runner.Interrupted): what finished, then 128 + signal
        signum = getattr(exc, "signum", signal.SIGINT)
        if OUTCOME.sweep is not None and OUTCOME.sweep.get("task") != "inspect":
            sweep_end(OUTCOME.sweep, interrupted=True)
        stderr.print(f"kvbench: interrupted by {signal.Signals(signum).name}", markup=False)
        sys.exit(128 + signum)
    sys.exit(OUTCOME.exit_code)


def _top_level_names() -> list:
    """The config groups (conf/ folders) and top-level keys a command line may name."""
    groups = [p.name for p in CONF_DIR.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))]
    return sorted(set(groups) | set(OmegaConf.to_container(schema_defaults()).keys()))


def _os_error_line(exc: OSError) -> str:
    """``cannot write PATH: reason`` for an OSError that names its file, its text otherwise."""
    if exc.filename is not None:
        return f"cannot write {exc.filename}: {exc.strerror or exc}"
    return f"{type(exc).__name__}: {exc}"


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
        print(f"kvbench-report: {one_line(_os_error_line(exc))}", file=sys.stderr)
        return 1
    counts = ", ".join(f"{n} {s}" for s, n in report.counts().items())
    print(f"{len(report.records)} jobs ({counts}) under {report.root}")
    for path in report.files:
        print(f"  {path}")
    for name, why in report.skipped_plots.items():
        print(f"  ({name}.png not drawn: {why})")
    return 0


def dashboard_main(argv: Optional[Sequence[str]] = None) -> int:
    """Console script ``kvbench-dashboard DIR``: rebuild the sweep's W&B workspace from its
    records (``workspace.json``, ``workspace.md``) and create it on W&B."""
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


if __name__ == "__main__":
    # `python -m kvbench.cli`: run the importable module's copy, so that what launchers pickle
    # refers to kvbench.cli, not to __main__ (which a worker process cannot import).
    from kvbench import cli

    cli.main()
