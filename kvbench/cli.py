"""Hydra entry points. This module wires config, runner and sinks; nothing imports it back.

Exit codes: 0 ok; 2 a single run with an invalid value (one line on stderr naming the key);
3 out of memory; 1 an internal error. A multirun records invalid and oom jobs as data and
exits non-zero only when some job hit an internal error.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from kvbench.config import ConfigError, register_configs

CONF_DIR = Path(__file__).resolve().parent / "conf"
EXIT_CODES = {"ok": 0, "invalid": 2, "oom": 3, "error": 1}
_exit_code = 0

register_configs()


def _job_context() -> tuple[Path, bool, List[str], Optional[int]]:
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    return Path(hc.runtime.output_dir), multirun, list(hc.overrides.task), hc.job.get("num")


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    global _exit_code
    out_dir, multirun, overrides, num = _job_context()
    if cfg.task == "inspect":
        _exit_code = _inspect(cfg)
        return
    from kvbench.runner import run_job

    if multirun:
        total = os.environ.get("KVBENCH_SWEEP_TOTAL", "?")
        from kvbench.console import stderr
        stderr.print(f"[bold]kvbench[/] job {num + 1}/{total}: {' '.join(overrides) or '(defaults)'}")
        from kvbench.cluster import completed_record
        if not cfg.rerun and completed_record(out_dir, cfg) is not None:
            # A re-run into the same sweep dir finishes only what is missing; the sweep table
            # at the end reads this job's record from disk like any other.
            stderr.print(f"  skipped: {out_dir / 'results.json'} is already ok for this config "
                         "(rerun=true runs it again)", markup=False, soft_wrap=True)
            return
    result = run_job(cfg, out_dir, overrides)
    wandb_dir = _track(cfg, result, out_dir, multirun)
    _after_job(result, out_dir, multirun)
    if not multirun:
        _exit_code = EXIT_CODES[result.status]
        _report(out_dir, plots=False)  # summary.csv / summary.md beside results.json
        if wandb_dir is not None:
            from kvbench.console import stdout
            stdout.print(f"wandb: {wandb_dir}", markup=False, soft_wrap=True)


def _track(cfg: DictConfig, result, out_dir: Path, multirun: bool) -> Optional[Path]:
    """The job's W&B run (after results.json is written; a W&B failure is only a warning)."""
    from kvbench.tracking import track

    sweep_dir = HydraConfig.get().sweep.dir if multirun else None
    return track(result, OmegaConf.to_container(cfg.wandb, resolve=True), out_dir, sweep_dir, cfg.task)


def _report(directory: Path, plots: bool = True) -> None:
    """Write the local report (summary.csv, summary.md, plots); never fails the run."""
    from kvbench.console import stderr, stdout

    try:
        from kvbench.report import MD_FILE, write_report

        write_report(directory, plots=plots)
        if plots:
            stdout.print(f"report: {Path(directory) / MD_FILE}", markup=False, soft_wrap=True)
    except Exception as exc:  # noqa: BLE001 — the records are on disk; kvbench-report can redo this
        stderr.print(f"kvbench: report failed: {type(exc).__name__}: {exc} (run kvbench-report {directory})",
                     markup=False, soft_wrap=True)


def _after_job(result, out_dir: Path, multirun: bool) -> None:
    """Print the job's outcome; in a single run an invalid value is one line on stderr."""
    from kvbench.console import run_table, stderr, stdout

    where = out_dir / "results.json"
    if result.status == "invalid" and not multirun:
        stderr.print(f"kvbench: invalid config: {result.error}", markup=False, soft_wrap=True)
        stderr.print(f"(recorded in {where})", markup=False)
        return
    if result.status != "ok":
        stderr.print(f"kvbench: job {result.status}: {result.error}", markup=False, soft_wrap=True)
    if not multirun:
        stdout.print(run_table(result.to_dict()))
        if result.tables.get("turns"):
            from kvbench.console import turns_table
            stdout.print(turns_table(result.to_dict()))
    stdout.print(f"results: {where}", markup=False, soft_wrap=True)


def _inspect(cfg: DictConfig) -> int:
    """Print the head→group map and the KV-memory table; runs no model."""
    from kvbench.console import stderr, stdout
    from kvbench.inspection import describe

    try:
        stdout.print(describe(OmegaConf.to_object(cfg)), markup=False, soft_wrap=True)
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


class SweepCallback(Callback):
    """Counts a sweep's jobs at the start; at the end prints a table of every job's record and
    sets the exit code. Jobs never raise (failures are records), so Hydra always reaches
    ``on_multirun_end``."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            os.environ["KVBENCH_SWEEP_TOTAL"] = str(sweep_size(config))
        except Exception:  # noqa: BLE001 — a count is a nicety; never stop a sweep for it
            os.environ["KVBENCH_SWEEP_TOTAL"] = "?"

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global _exit_code
        from kvbench.console import results_table, stdout
        from kvbench.results import find_results

        import json

        sweep_dir = Path(config.hydra.sweep.dir)
        records = []
        for path in find_results(sweep_dir):
            rec = json.loads(path.read_text())
            rec["job"] = str(path.parent.relative_to(sweep_dir))
            records.append(rec)
        if config.get("task") == "inspect":
            return
        stdout.print(results_table(f"kvbench sweep {sweep_dir}", records))
        from kvbench.console import ttft_comparison_table
        comparison = ttft_comparison_table(records)  # multi-turn jobs swept over cache.shared
        if comparison is not None:
            stdout.print(comparison)
        counts = {s: sum(r["status"] == s for r in records) for s in EXIT_CODES}
        stdout.print(", ".join(f"{n} {s}" for s, n in counts.items() if n) + f" — results under {sweep_dir}",
                     markup=False, soft_wrap=True)
        _report(sweep_dir)
        if counts["error"]:
            _exit_code = EXIT_CODES["error"]


def main() -> None:
    """Console script ``kvbench``."""
    _hydra_main()
    sys.exit(_exit_code)


if __name__ == "__main__":
    main()
