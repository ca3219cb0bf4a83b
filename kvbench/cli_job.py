"""One Hydra job, around :func:`kvbench.jobs.isolation.launch_job`: inspect, or claim the job
directory, then skip it (resume: an ok record of the same config) or run it, and record, track and
print it; what the job returns to a search sweeper is its ``objective`` read from the record.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import hydra.core.utils
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from rich.text import Text

from kvbench.config.bench import BenchConfig
from kvbench.config.layer_pattern import job_variant_label
from kvbench.core.errors import ConfigError, one_line
from kvbench.jobs.claim import claim_holder, claim_job, resume_check
from kvbench.jobs.isolation import launch_job
from kvbench.jobs.job_config import to_bench_config, unread_overrides
from kvbench.jobs.outcome import EXIT_CODES, OUTCOME
from kvbench.jobs.sweep import override_list
from kvbench.jsonio import os_error_line, real_dir, write_text_atomic
from kvbench.results import CHECKPOINT_NAME, RESULTS_FILE, RecordError, objective_value, read_record
from kvbench.sinks.console import (
    conversation_turns_table,
    progress_bar,
    run_table,
    stderr,
    stdout,
    turns_table,
    variants_table,
)
from kvbench.sinks.report import MD_FILE, write_report
from kvbench.sinks.tracking import track


def _save_hydra_file(cfg, filename: str, output_dir: Path) -> None:
    """Hydra's ``.hydra/*.yaml`` written as kvbench writes its own files: a symlink planted at
    ``.hydra`` or a file's name is replaced, never written through (Hydra's ``open(path, "w")``
    would). Hydra has no setting for this; it looks the function up by name as each job starts, so
    it is installed by this module, which every process that runs jobs imports (the joblib and
    submitit workers too, which do not import kvbench.cli)."""
    write_text_atomic(real_dir(output_dir) / filename, OmegaConf.to_yaml(cfg))


hydra.core.utils._save_config = _save_hydra_file


def _job_context() -> tuple[Path, bool, List[str], Optional[int]]:
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    return Path(hc.runtime.output_dir), multirun, override_list(hc.overrides.task), hc.job.get("num")


# A single run's config as kvbench.cli_sweep.check_run_start typed it, before Hydra made the run's
# directory; its job takes it rather than typing the same text again (~0.1 s each time).
_typed_at_start: Dict[str, BenchConfig] = {}


def typed_at_start(cfg: DictConfig, job: BenchConfig) -> None:
    """Hand ``job``, the typed ``cfg``, to the job that runs ``cfg`` (a single run)."""
    _typed_at_start.clear()
    _typed_at_start[OmegaConf.to_yaml(cfg)] = job


def typed_job(cfg: DictConfig) -> Tuple[Optional[BenchConfig], Optional[str]]:
    """The job's config typed once, for every later step of the job; or None and why it is invalid."""
    job = _typed_at_start.pop(OmegaConf.to_yaml(cfg), None) if _typed_at_start else None
    if job is not None:
        return job, None
    try:
        return to_bench_config(cfg), None
    except ConfigError as exc:
        return None, str(exc)


def job_line(num: int, total: str, overrides: List[str], job: Optional[BenchConfig]) -> Text:
    """``kvbench job 3/12: attention=mqa workload.prompt_len=[64] (mqa kv=1)``: the
    overrides as written (text, not markup: a list's brackets stay) and the variant as the job's
    progress line and tables name it (none for an invalid config)."""
    line = Text.assemble(("kvbench", "bold"), f" job {num + 1}/{total}: {' '.join(overrides) or '(defaults)'}")
    if job is not None:
        line.append(f" ({job_variant_label(job)})")
    return line


def hydra_job(cfg: DictConfig) -> Optional[float]:
    """One Hydra job; returns the job's ``objective`` read from its record (what a search sweeper
    optimises), or None."""
    out_dir, multirun, overrides, num = _job_context()
    guard_log_files()
    if OmegaConf.select(cfg, "task", throw_on_resolution_failure=False) == "inspect":
        OUTCOME.job_ended(_inspect(cfg))
        if not multirun:
            _remove_inspect_dir(out_dir)
        return None
    job, invalid = typed_job(cfg)
    if multirun:
        stderr.print(job_line(num, os.environ.get("KVBENCH_SWEEP_TOTAL", "?"), overrides, job))
    for line in unread_overrides(job, overrides) if job is not None else ():
        stderr.print(f"kvbench: {line}", markup=False, soft_wrap=True)
    try:
        claim = claim_job(out_dir)
    except OSError as exc:  # a full disk refuses the claim file: the job cannot run here
        stderr.print(f"kvbench: {one_line(os_error_line(exc))} (the job was not run)", markup=False, soft_wrap=True)
        if not multirun:
            OUTCOME.job_ended(EXIT_CODES["error"])
        return _objective(cfg, job, invalid, None)
    if claim is None:
        # Another kvbench (or a job process a killed sweep left behind) is running this job.
        stderr.print(f"  skipped: {out_dir} is being run by {claim_holder(out_dir) or 'another process'} "
                     "(a job never runs twice at once)", markup=False, soft_wrap=True)
        if not multirun:
            OUTCOME.job_ended(EXIT_CODES["error"])
        return _objective(cfg, job, invalid, None)
    with claim:
        done, untrusted = (resume_check(out_dir, asdict(job), overrides) if multirun and job is not None
                           and not job.rerun else (None, None))
        if done is not None:
            # A re-run into the same sweep dir finishes only what is missing; the sweep table
            # at the end reads this job's record from disk like any other.
            stderr.print(f"  skipped: {out_dir / RESULTS_FILE} is already ok for this config "
                         "(rerun=true runs it again)", markup=False, soft_wrap=True)
            return _objective(cfg, job, invalid, out_dir)
        if untrusted is not None:
            stderr.print(f"  measured again: the ok record in {out_dir / RESULTS_FILE} is not trusted: {untrusted}",
                         markup=False, soft_wrap=True)
        try:
            # an invalid config as given: the job records it invalid, with its one line
            result = launch_job(cfg if job is None else job, out_dir, overrides, progress=progress_bar)
        except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: show what was recorded, then stop
            if getattr(exc, "record", None) is not None:
                _after_job(exc.record, out_dir, multirun)
            raise
        wandb_dir = _track(result, out_dir, multirun)
        _after_job(result, out_dir, multirun)
    if not multirun:
        OUTCOME.job_ended(EXIT_CODES["error"] if result.unsaved else EXIT_CODES[result.status])
        # summary.csv / summary.md beside results.json (and why a single run draws no plot)
        report(out_dir, announce=False)
        if wandb_dir is not None and result.status != "invalid":  # an invalid value: one line, no more
            stdout.print(f"wandb: {wandb_dir}", markup=False, soft_wrap=True)
    return _objective(cfg, job, invalid, out_dir)


def _objective(cfg: DictConfig, job: Optional[BenchConfig], invalid: Optional[str],
               out_dir: Optional[Path]) -> Optional[float]:
    """The job's ``objective``, read from the results.json in ``out_dir`` (the job's own process wrote
    it), or None and one line saying why, unless the job's own line did (a search sweeper records None
    as a failed trial)."""
    objective = job.objective if job is not None else OmegaConf.select(cfg, "objective",
                                                                        throw_on_resolution_failure=False)
    if objective is None:
        return None
    # A job that was not run, or whose record is not ok, has had its one line (job invalid, job error,
    # skipped, the job directory): an objective line would say it again.
    value, why, said = None, invalid, True
    if job is not None and out_dir is not None:
        try:
            record = read_record(out_dir)
            value, why = objective_value(record, job.objective, job.objective_caps)
            said = record.status != "ok"
        except RecordError as exc:
            value, why, said = None, str(exc), False
    if value is None and not said:
        stderr.print(f"  objective: none, {why} (a failed trial for a search sweeper)", markup=False, soft_wrap=True)
    elif value is not None:
        stdout.print(f"  objective {job.objective}: {value:.6g}", markup=False, soft_wrap=True)
    return value


def guard_log_files() -> None:
    """A log file Hydra's logging writes that the disk refuses is one line naming it, then left out:
    logging would print a traceback for every record."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and not getattr(handler, "kvbench_guarded", False):
            handler.handleError = functools.partial(_log_file_failed, handler)
            handler.kvbench_guarded = True


def _log_file_failed(handler: logging.FileHandler, record: logging.LogRecord) -> None:
    exc = sys.exc_info()[1]
    logging.getLogger().removeHandler(handler)
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
    stderr.print(f"kvbench: cannot write {handler.baseFilename}: {why} (its log lines are left out from here on)",
                 markup=False, soft_wrap=True)


def _track(result, out_dir: Path, multirun: bool) -> Optional[Path]:
    """The job's W&B run; None when the record could not be written (a run is the record's copy)."""
    if result.unsaved:
        return None
    sweep_dir = HydraConfig.get().sweep.dir if multirun else None
    # The record's copy: validated for a valid job, as given (never raising) for an invalid one.
    wandb_cfg = result.config.get("wandb")
    return track(result, wandb_cfg if isinstance(wandb_cfg, dict) else {}, out_dir, sweep_dir,
                 str(result.config.get("task", "bench")))


def report(directory: Path, announce: bool = True, plots: bool = True,
            records: Optional[List[Dict[str, Any]]] = None) -> None:
    """Write the local report of ``records`` (default: every job under ``directory``); never fails the run."""
    try:
        write_report(directory, plots=plots, records=records)
        if announce:
            stdout.print(f"report: {Path(directory) / MD_FILE}", markup=False, soft_wrap=True)
    except Exception as exc:  # noqa: BLE001 — the records are on disk; kvbench-report can redo this
        why = os_error_line(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        stderr.print(f"kvbench: report failed: {one_line(why)} (run kvbench-report {directory})",
                     markup=False, soft_wrap=True)


def _after_job(result, out_dir: Path, multirun: bool) -> None:
    """Print the job's outcome; a record that could not be written goes to stderr as one line of JSON."""
    where = result.written_to or out_dir / RESULTS_FILE
    if result.written_to is not None and result.written_to.name != RESULTS_FILE:
        stderr.print(f"kvbench: {out_dir / RESULTS_FILE} keeps the earlier ok record; this run's {result.status} "
                     f"record is {result.written_to}", markup=False, soft_wrap=True)
    if result.unsaved:
        stderr.print(f"kvbench: {result.unsaved}; the record follows on stderr as JSON", markup=False,
                     soft_wrap=True)
        print(json.dumps(result.to_dict(), default=str), file=sys.stderr, flush=True)
        where = "(not written)"
    if result.status == "invalid" and not multirun:
        stderr.print(f"kvbench: invalid config: {result.error} (recorded in {where})", markup=False, soft_wrap=True)
        return
    if result.status != "ok":
        stderr.print(f"kvbench: job {result.status}: {result.error}", markup=False, soft_wrap=True)
    if not multirun:
        stdout.print(run_table(result.to_dict()))
        if result.tables.get("turns"):
            stdout.print(turns_table(result.to_dict()))
        if result.tables.get("compare"):
            stdout.print(variants_table(result.to_dict()))
        if result.tables.get("conversation_turns"):
            stdout.print(conversation_turns_table(result.to_dict()))
    stdout.print(f"results: {where}", markup=False, soft_wrap=True)
    if result.config.get("task") == "train" and (out_dir / CHECKPOINT_NAME).is_file():
        stdout.print(f"checkpoint: {out_dir / CHECKPOINT_NAME}", markup=False, soft_wrap=True)


# What Hydra leaves in a single run's directory before its job writes anything: its saved config and
# the job's log file (task=inspect logs nothing: it prints).
_HYDRA_FILES = {"config.yaml", "hydra.yaml", "overrides.yaml"}


def _remove_inspect_dir(out_dir: Path) -> None:
    """task=inspect records nothing: the run directory Hydra made for it (its saved config and an
    empty log) is removed, and the folders above it that this leaves empty, up to the working
    directory. A directory holding anything else, or holding the working directory, is kept."""
    cwd, run = Path.cwd().resolve(), out_dir.resolve()
    try:
        entries = {p.name: p for p in run.iterdir()}
        hydra = {p.name for p in entries[".hydra"].iterdir()} if ".hydra" in entries else set()
        logs = [p for name, p in entries.items() if name != ".hydra"]
        if (run == cwd or cwd.is_relative_to(run) or not hydra <= _HYDRA_FILES
                or any(not p.is_file() or p.is_symlink() or p.suffix != ".log" or p.stat().st_size for p in logs)):
            return
        for path in [*(entries[".hydra"] / name for name in hydra), *logs]:
            path.unlink()
        if ".hydra" in entries:
            entries[".hydra"].rmdir()
        run.rmdir()
        for parent in run.parents:  # outputs/<date>/ and outputs/ where nothing else is in them
            if parent == cwd or not parent.is_relative_to(cwd) or any(parent.iterdir()):
                break
            parent.rmdir()
    except OSError:  # a directory in use or not ours to remove: it stays, as before
        return


def _inspect(cfg: DictConfig) -> int:
    """Print the head→group map and the KV-memory table; runs no model."""
    from kvbench.tasks.inspect import describe  # torch (a meta model): only when task=inspect

    job, invalid = typed_job(cfg)  # a single run's: typed as it started
    try:
        if job is None:
            raise ConfigError(invalid)
        stdout.print(describe(job, stdout.width), markup=False, soft_wrap=True)
    except ConfigError as exc:
        stderr.print(f"kvbench: invalid config: {exc}", markup=False, soft_wrap=True)
        return EXIT_CODES["invalid"]
    return 0
