"""Entry points: ``kvbench`` (Hydra) and ``kvbench-report``. This module wires config, runner and
sinks; nothing imports it back.

Exit codes: 0 ok; 2 a single run with an invalid value (one line on stderr naming the key);
3 out of memory; 1 an internal error. A multirun records invalid and oom jobs as data and
exits non-zero only when some job hit an internal error.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kvbench.config import CONF_DIR, RENAMED_KEYS, ConfigError, register_configs, to_bench_config
from kvbench.inspection import describe
from kvbench.quality.train import CHECKPOINT_NAME
from kvbench.results import RESULTS_FILE, completed_record
from kvbench.runner import run_job
from kvbench.sinks.console import progress_bar, run_table, stderr, stdout, sweep_tables, turns_table
from kvbench.sinks.report import MD_FILE, collect, write_report
from kvbench.sinks.tracking import track

EXIT_CODES = {"ok": 0, "invalid": 2, "oom": 3, "error": 1}
_exit_code = 0

register_configs()


def _job_context() -> tuple[Path, bool, List[str], Optional[int]]:
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    return Path(hc.runtime.output_dir), multirun, list(hc.overrides.task), hc.job.get("num")


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    # Launchers (submitit, joblib) pickle this function by value, with the globals it names:
    # it names only an importable function, which is pickled by reference.
    hydra_job(cfg)


def hydra_job(cfg: DictConfig) -> None:
    """One Hydra job: inspect, skip (resume), or run, record, track and print."""
    global _exit_code
    out_dir, multirun, overrides, num = _job_context()
    if cfg.task == "inspect":
        _exit_code = _inspect(cfg)
        return
    if multirun:
        total = os.environ.get("KVBENCH_SWEEP_TOTAL", "?")
        stderr.print(f"[bold]kvbench[/] job {num + 1}/{total}: {' '.join(overrides) or '(defaults)'}")
        if not cfg.rerun and _already_done(out_dir, cfg):
            # A re-run into the same sweep dir finishes only what is missing; the sweep table
            # at the end reads this job's record from disk like any other.
            stderr.print(f"  skipped: {out_dir / RESULTS_FILE} is already ok for this config "
                         "(rerun=true runs it again)", markup=False, soft_wrap=True)
            return
    result = run_job(cfg, out_dir, overrides, progress=progress_bar)
    wandb_dir = _track(cfg, result, out_dir, multirun)
    _after_job(result, out_dir, multirun)
    if not multirun:
        _exit_code = EXIT_CODES[result.status]
        # summary.csv / summary.md beside results.json (and why a single run draws no plot)
        _report(out_dir, announce=False)
        if wandb_dir is not None and result.status != "invalid":  # an invalid value: one line, no more
            stdout.print(f"wandb: {wandb_dir}", markup=False, soft_wrap=True)


def _already_done(out_dir: Path, cfg: DictConfig) -> bool:
    try:
        config = asdict(to_bench_config(cfg))
    except ConfigError:
        return False
    return completed_record(out_dir, config) is not None


def _track(cfg: DictConfig, result, out_dir: Path, multirun: bool) -> Optional[Path]:
    """The job's W&B run (after results.json is written; a W&B failure is only a warning)."""
    sweep_dir = HydraConfig.get().sweep.dir if multirun else None
    return track(result, OmegaConf.to_container(cfg.wandb, resolve=True), out_dir, sweep_dir, cfg.task)


def _report(directory: Path, announce: bool = True) -> None:
    """Write the local report (summary.csv, summary.md, plots); never fails the run."""
    try:
        write_report(directory)
        if announce:
            stdout.print(f"report: {Path(directory) / MD_FILE}", markup=False, soft_wrap=True)
    except Exception as exc:  # noqa: BLE001 — the records are on disk; kvbench-report can redo this
        stderr.print(f"kvbench: report failed: {type(exc).__name__}: {exc} (run kvbench-report {directory})",
                     markup=False, soft_wrap=True)


def _after_job(result, out_dir: Path, multirun: bool) -> None:
    """Print the job's outcome; in a single run an invalid value is one line on stderr."""
    where = out_dir / RESULTS_FILE
    if result.status == "invalid" and not multirun:
        stderr.print(f"kvbench: invalid config: {result.error} (recorded in {where})", markup=False, soft_wrap=True)
        return
    if result.status != "ok":
        stderr.print(f"kvbench: job {result.status}: {result.error}", markup=False, soft_wrap=True)
    if not multirun:
        stdout.print(run_table(result.to_dict()))
        if result.tables.get("turns"):
            stdout.print(turns_table(result.to_dict()))
    stdout.print(f"results: {where}", markup=False, soft_wrap=True)
    if result.config.get("task") == "train" and (out_dir / CHECKPOINT_NAME).is_file():
        stdout.print(f"checkpoint: {out_dir / CHECKPOINT_NAME}", markup=False, soft_wrap=True)


def _inspect(cfg: DictConfig) -> int:
    """Print the head→group map and the KV-memory table; runs no model."""
    try:
        stdout.print(describe(to_bench_config(cfg)), markup=False, soft_wrap=True)
    except ConfigError as exc:
        stderr.print(f"kvbench: invalid config: {exc}", markup=False, soft_wrap=True)
        return EXIT_CODES["invalid"]
    return 0


def sweep_size(config: DictConfig) -> Optional[int]:
    """Number of jobs a basic-sweeper multirun will launch (CLI sweeps x preset sweeper params)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    params: Dict[str, int] = {}
    preset = OmegaConf.select(config, "hydra.sweeper.params") or {}
    for key, value in preset.items():
        for o in parser.parse_overrides([f"{key}={value}"]):
            params[o.get_key_element()] = len(list(o.sweep_string_iterator())) if o.is_sweep_override() else 1
    for o in parser.parse_overrides(list(config.hydra.overrides.task)):
        params[o.get_key_element()] = len(list(o.sweep_string_iterator())) if o.is_sweep_override() else 1
    return math.prod(params.values()) if params else 1


def sweep_records(sweep_dir: Path) -> List[Dict[str, Any]]:
    """Every job of ``sweep_dir`` (the report's rows: a killed job is ``missing``), in job order."""
    return collect(sweep_dir)


class SweepRefused(BaseException):
    """A sweep stopped before its first job. Not an ``Exception``: Hydra turns what a callback
    raises into a warning and goes on, and this must reach :func:`main` (one line, exit 2)."""


# Overrides that do not make another sweep: how jobs are scheduled or recorded.
_NOT_SWEEP = ("rerun=", "wandb=", "wandb.", "hydra/launcher=")


def check_sweep_start(config: DictConfig) -> None:
    """Refuse, before any job starts, a sweep that cannot run or would overwrite another:
    a SLURM launcher without SLURM, or a ``hydra.sweep.dir`` that holds a sweep with other
    overrides (its jobs would be renumbered and overwritten). Raises :class:`ConfigError`."""
    target = str(OmegaConf.select(config, "hydra.launcher._target_") or "")
    if target.endswith("SlurmLauncher") and not (shutil.which("sbatch") and shutil.which("srun")):
        raise ConfigError("hydra/launcher=slurm: no SLURM on this machine (sbatch and srun are not on PATH); "
                          "submit from the cluster's login node, or try the sweep here with hydra/launcher=local")
    sweep_dir = Path(config.hydra.sweep.dir)
    try:
        before = OmegaConf.select(OmegaConf.load(sweep_dir / "multirun.yaml"), "hydra.overrides.task") or []
    except (OSError, OmegaConfBaseException, ValueError):
        return  # a new directory, or one no sweep finished starting in
    if _sweep_overrides(before) != _sweep_overrides(config.hydra.overrides.task):
        raise ConfigError(f"hydra.sweep.dir={str(sweep_dir)!r}: holds another sweep "
                          f"({' '.join(_sweep_overrides(before))}); give this one a new hydra.sweep.dir "
                          "(a sweep resumes only with the same overrides)")


def _sweep_overrides(overrides) -> List[str]:
    return [str(o) for o in overrides if not str(o).startswith(_NOT_SWEEP)]


class SweepCallback(Callback):
    """Counts a sweep's jobs at the start; at the end prints a table of every job's record and
    sets the exit code. Jobs never raise (failures are records), so Hydra always reaches
    ``on_multirun_end``."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            check_sweep_start(config)
        except ConfigError as exc:
            raise SweepRefused(str(exc)) from None
        try:
            os.environ["KVBENCH_SWEEP_TOTAL"] = str(sweep_size(config))
        except Exception:  # noqa: BLE001 — a count is a nicety; never stop a sweep for it
            os.environ["KVBENCH_SWEEP_TOTAL"] = "?"

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global _exit_code
        if config.get("task") == "inspect":
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        records = sweep_records(sweep_dir)
        for table in sweep_tables(f"kvbench sweep {sweep_dir}", records):  # the variants side by side last
            stdout.print(table)
        counts = {s: sum(r["status"] == s for r in records)
                  for s in dict.fromkeys([*EXIT_CODES, *(r["status"] for r in records)])}
        stdout.print(", ".join(f"{n} {s}" for s, n in counts.items() if n) + f" — results under {sweep_dir}",
                     markup=False, soft_wrap=True)
        _report(sweep_dir)
        if counts["error"]:
            _exit_code = EXIT_CODES["error"]


def config_error_line(exc: BaseException) -> str:
    """One line for an error Hydra or OmegaConf raised while composing the config: the key and
    what is wrong with it (a renamed key names its new name)."""
    chain: List[BaseException] = []
    node: Optional[BaseException] = exc
    while node is not None and node not in chain:
        chain.append(node)
        node = node.__cause__ or node.__context__
    for err in chain:
        key = getattr(err, "full_key", None)
        if key:
            if key in RENAMED_KEYS:
                return f"{key}: renamed to {RENAMED_KEYS[key]}"
            msg = str(getattr(err, "msg", None) or err).strip().splitlines()[0]
            return f"{key}: {msg}"
    lines = [line.strip() for err in chain[:1] for line in str(err).split("Config search path")[0].splitlines()
             if line.strip()]
    text = " ".join(lines) or type(exc).__name__
    for old, new in RENAMED_KEYS.items():
        if f"'{old}'" in text:
            return f"{old}: renamed to {new}"
    return text if len(text) <= 400 else text[:399] + "…"


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
    except (ConfigError, HydraException, OmegaConfBaseException) as exc:
        if full_error:
            raise
        stderr.print(f"kvbench: invalid config: {config_error_line(exc)}", markup=False, soft_wrap=True)
        sys.exit(EXIT_CODES["invalid"])
    sys.exit(_exit_code)


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
    counts = ", ".join(f"{n} {s}" for s, n in report.counts().items())
    print(f"{len(report.records)} jobs ({counts}) under {report.root}")
    for path in report.files:
        print(f"  {path}")
    for name, why in report.skipped_plots.items():
        print(f"  ({name}.png not drawn: {why})")
    return 0


if __name__ == "__main__":
    # `python -m kvbench.cli`: run the importable module's copy, so that what launchers pickle
    # refers to kvbench.cli, not to __main__ (which a worker process cannot import).
    from kvbench import cli

    cli.main()
