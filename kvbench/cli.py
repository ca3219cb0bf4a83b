"""Entry points: ``kvbench`` (Hydra), ``kvbench-report`` and ``kvbench-dashboard``. This module wires config, runner and
sinks; nothing imports it back.

Exit codes: 0 ok; 2 a single run with an invalid value (one line on stderr naming the key),
or a command line Hydra cannot compose (an unknown group option, bad override syntax);
3 out of memory; 1 an internal error, or a record that could not be written; 128 + the signal
when interrupted (130 for Ctrl-C, 143 for SIGTERM). A multirun records invalid and oom jobs as
data and exits 1 when a job of this sweep errored, was interrupted or has no readable record.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import shutil
import signal
import sys
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kvbench.config import (
    CONF_DIR,
    RENAMED_KEYS,
    ConfigError,
    one_line,
    register_configs,
    schema_defaults,
    to_bench_config,
)
from kvbench.inspection import describe
from kvbench.isolation import launch_job
from kvbench.quality.train import CHECKPOINT_NAME
from kvbench.results import (
    RESULTS_FILE,
    RecordError,
    claim_holder,
    claim_job,
    completed_record,
    find_results,
    objective_value,
    read_record,
)
from kvbench.runner import check_objective
from kvbench.sinks.console import compare_table, progress_bar, run_table, stderr, stdout, sweep_tables, turns_table
from kvbench.sinks.dashboard import PublishError, online, publish, publish_commands, tracked, write_dashboard
from kvbench.sinks.report import MD_FILE, collect, write_report
from kvbench.sinks.tracking import new_sweep, track
from kvbench.sweep import job_overrides, sweep_records, sweep_size

EXIT_CODES = {"ok": 0, "invalid": 2, "oom": 3, "error": 1, "interrupted": 128 + signal.SIGINT}
# Rows of a sweep's end table that mean a job of the sweep has no result: the sweep exits 1.
MULTIRUN_FILE = "multirun.yaml"  # the sweep's config, in its directory
FAILED_ROWS = ("error", "interrupted", "unreadable", "missing", "not run")
_exit_code = 0
_sweep_config: Optional[DictConfig] = None  # the running multirun's config, for an interrupted end

register_configs()


def _job_context() -> tuple[Path, bool, List[str], Optional[int]]:
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    return Path(hc.runtime.output_dir), multirun, list(hc.overrides.task), hc.job.get("num")


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> Optional[float]:
    # Launchers (submitit, joblib) pickle this function by value, with the globals it names:
    # it names only an importable function, which is pickled by reference.
    return hydra_job(cfg)


def hydra_job(cfg: DictConfig) -> Optional[float]:
    """One Hydra job: inspect, or claim the job directory, then skip (resume) or run, record,
    track and print. Returns the job's ``objective`` read from its record (what a search
    sweeper optimises): None without an objective, and for a job with no value for it."""
    global _exit_code
    out_dir, multirun, overrides, num = _job_context()
    if OmegaConf.select(cfg, "task", throw_on_resolution_failure=False) == "inspect":
        _exit_code = _inspect(cfg)
        return None
    if multirun:
        total = os.environ.get("KVBENCH_SWEEP_TOTAL", "?")
        stderr.print(f"[bold]kvbench[/] job {num + 1}/{total}: {' '.join(overrides) or '(defaults)'}")
    claim = claim_job(out_dir)
    if claim is None:
        # Another kvbench (or a job process a killed sweep left behind) is running this job.
        stderr.print(f"  skipped: {out_dir} is being run by {claim_holder(out_dir) or 'another process'} "
                     "(a job never runs twice at once)", markup=False, soft_wrap=True)
        if not multirun:
            _exit_code = EXIT_CODES["error"]
        return _objective(cfg, None, "the job was not run here (another process holds it)")
    with claim:
        if multirun and _already_done(out_dir, cfg):
            # A re-run into the same sweep dir finishes only what is missing; the sweep table
            # at the end reads this job's record from disk like any other.
            stderr.print(f"  skipped: {out_dir / RESULTS_FILE} is already ok for this config "
                         "(rerun=true runs it again)", markup=False, soft_wrap=True)
            return _objective(cfg, out_dir)
        try:
            result = launch_job(cfg, out_dir, overrides, progress=progress_bar)
        except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: show what was recorded, then stop
            if getattr(exc, "record", None) is not None:
                _after_job(exc.record, out_dir, multirun)
            raise
        wandb_dir = _track(cfg, result, out_dir, multirun)
        _after_job(result, out_dir, multirun)
    if not multirun:
        _exit_code = EXIT_CODES["error"] if result.unsaved else EXIT_CODES[result.status]
        # summary.csv / summary.md beside results.json (and why a single run draws no plot)
        _report(out_dir, announce=False)
        if wandb_dir is not None and result.status != "invalid":  # an invalid value: one line, no more
            stdout.print(f"wandb: {wandb_dir}", markup=False, soft_wrap=True)
    return _objective(cfg, out_dir)


def _objective(cfg: DictConfig, out_dir: Optional[Path], why_not: str = "") -> Optional[float]:
    """The job's ``objective``, read from the results.json in ``out_dir`` (the one the job's own
    process wrote when it ran isolated), or None and one line saying why: a search sweeper
    records None as a failed trial. None without a line when no objective is set."""
    if OmegaConf.select(cfg, "objective", throw_on_resolution_failure=False) is None:
        return None
    try:
        job = to_bench_config(cfg)
        value, why = (None, why_not) if out_dir is None else objective_value(
            read_record(out_dir), job.objective, job.objective_caps)
    except (ConfigError, RecordError) as exc:
        value, why = None, str(exc)
    if value is None:
        stderr.print(f"  objective: none, {why} (a failed trial for a search sweeper)", markup=False, soft_wrap=True)
    else:
        stdout.print(f"  objective {job.objective}: {value:.6g}", markup=False, soft_wrap=True)
    return value


def _already_done(out_dir: Path, cfg: DictConfig) -> bool:
    try:
        job = to_bench_config(cfg)
    except ConfigError:
        return False
    return not job.rerun and completed_record(out_dir, asdict(job)) is not None


def _track(cfg: DictConfig, result, out_dir: Path, multirun: bool) -> Optional[Path]:
    """The job's W&B run (after results.json is written; a W&B failure is only a warning)."""
    sweep_dir = HydraConfig.get().sweep.dir if multirun else None
    # The record's copy: validated for a valid job, as given (never raising) for an invalid one.
    wandb_cfg = result.config.get("wandb")
    return track(result, wandb_cfg if isinstance(wandb_cfg, dict) else {}, out_dir, sweep_dir,
                 str(result.config.get("task", "bench")))


def _report(directory: Path, announce: bool = True, plots: bool = True,
            records: Optional[List[Dict[str, Any]]] = None) -> None:
    """Write the local report (summary.csv, summary.md, plots) of ``records`` (default: every
    job under ``directory``); never fails the run."""
    try:
        write_report(directory, plots=plots, records=records)
        if announce:
            stdout.print(f"report: {Path(directory) / MD_FILE}", markup=False, soft_wrap=True)
    except Exception as exc:  # noqa: BLE001 — the records are on disk; kvbench-report can redo this
        stderr.print(f"kvbench: report failed: {type(exc).__name__}: {exc} (run kvbench-report {directory})",
                     markup=False, soft_wrap=True)


def _after_job(result, out_dir: Path, multirun: bool) -> None:
    """Print the job's outcome; in a single run an invalid value is one line on stderr. A record
    that could not be written goes to stderr as one line of JSON, after one line saying why."""
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
            stdout.print(compare_table(result.to_dict()))
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


def sweep_end(config: DictConfig, interrupted: bool = False) -> int:
    """Print the table of this sweep's jobs, write its report; the exit code for them. Never
    raises for what it finds on disk: a part that fails is one line saying so."""
    sweep_dir = Path(config.hydra.sweep.dir)
    try:
        if _basic_sweeper(config):
            rows = sweep_records(sweep_dir, config)
        else:  # another sweeper chooses its jobs as it goes: every job directory on disk
            rows = collect(sweep_dir)
    except Exception as exc:  # noqa: BLE001 — the records stay on disk; kvbench-report can read them
        stderr.print(f"kvbench: cannot list the sweep's jobs: {type(exc).__name__}: {exc}", markup=False)
        return EXIT_CODES["error"]
    title = f"kvbench sweep {sweep_dir}" + (" (interrupted)" if interrupted else "")
    try:
        for table in sweep_tables(title, rows):  # the attention variants side by side last
            stdout.print(table)
    except Exception as exc:  # noqa: BLE001 — an odd record must not cost the counts and the report
        stderr.print(f"kvbench: a table could not be drawn: {type(exc).__name__}: {exc}", markup=False)
    counts: Dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    stdout.print(", ".join(f"{n} {s}" for s, n in counts.items()) + f" — results under {sweep_dir}",
                 markup=False, soft_wrap=True)
    if rows:
        _report(sweep_dir, plots=not interrupted, records=rows)  # after Ctrl-C: quickly, no plots
        if not interrupted and counts.get("ok"):  # nothing to publish without a measurement
            _dashboard(sweep_dir, rows)
    code, why = sweep_exit(counts)
    if why:
        stderr.print(f"kvbench: {why}", markup=False, soft_wrap=True)
    return code


def sweep_exit(counts: Dict[str, int]) -> tuple[int, Optional[str]]:
    """A sweep's exit code for the statuses of its jobs, and the line that says why it is not 0.
    0 only when every job is accounted for and at least one measured: a sweep whose jobs were
    all invalid (a typo in a swept key) is 2, as a single invalid run is; one with a job that
    failed, has no record or is still being run by another process is 1."""
    total = sum(counts.values())
    if not total:
        return EXIT_CODES["error"], "the sweep has no jobs"
    if any(counts.get(s) for s in FAILED_ROWS):
        return EXIT_CODES["error"], None  # the table says which (the job lines said why)
    if counts.get("running"):
        return EXIT_CODES["error"], (f"{counts['running']} of {total} jobs are being run by another process: "
                                     "their results are not in this table (run the sweep again when they finish)")
    if not counts.get("ok"):
        if counts.get("invalid") == total:
            return EXIT_CODES["invalid"], "every job of the sweep is invalid (their records say why)"
        return EXIT_CODES["error"], "no job of the sweep measured anything (" + ", ".join(
            f"{n} {s}" for s, n in counts.items()) + ")"
    return 0, None


def _dashboard(sweep_dir: Path, rows: List[Dict[str, Any]]) -> None:
    """The sweep's W&B workspace: its spec beside the report, created on W&B when the sweep's
    runs went online; the commands that publish it later otherwise. Never fails the sweep."""
    try:
        if not tracked(rows):
            return
        board = write_dashboard(sweep_dir, rows)
    except Exception as exc:  # noqa: BLE001 — the records and the report are on disk
        stderr.print(f"kvbench: W&B workspace not written: {type(exc).__name__}: {exc} "
                     f"(run kvbench-dashboard {sweep_dir})", markup=False, soft_wrap=True)
        return
    stdout.print(f"workspace: {board.files[-1]}", markup=False, soft_wrap=True)
    runs_online = online(rows, sweep_dir)
    if runs_online:
        try:
            stdout.print(f"workspace: {publish(board)}", markup=False, soft_wrap=True)
            return
        except PublishError as exc:
            stderr.print(f"kvbench: W&B workspace not created: {exc}", markup=False, soft_wrap=True)
    stdout.print("publish it to W&B with: " + " && ".join(publish_commands(sweep_dir, runs_online)),
                 markup=False, soft_wrap=True)


class SweepRefused(BaseException):
    """A sweep stopped before its first job. Not an ``Exception``: Hydra turns what a callback
    raises into a warning and goes on, and this must reach :func:`main` (one line, exit 2)."""




def _basic_sweeper(config: DictConfig) -> bool:
    """Hydra's grid sweeper, whose jobs kvbench can list from the config (kvbench.sweep); a search
    sweeper (Optuna) chooses its jobs as it goes."""
    return str(OmegaConf.select(config, "hydra.sweeper._target_")).endswith(".BasicSweeper")


def check_sweep_start(config: DictConfig) -> None:
    """Refuse, before any job starts, a sweep that cannot run or would overwrite another:
    a SLURM launcher without SLURM, an ``objective`` no job of the task records (or none for
    a search sweeper), or a ``hydra.sweep.dir`` that holds a sweep with other overrides (its
    jobs would be renumbered and overwritten) or any sweep for a search (its trials depend
    on the values measured, so job N of a second search is another job). Raises
    :class:`ConfigError`."""
    target = str(OmegaConf.select(config, "hydra.launcher._target_") or "")
    if target.endswith("SlurmLauncher") and not (shutil.which("sbatch") and shutil.which("srun")):
        raise ConfigError("hydra/launcher=slurm: no SLURM on this machine (sbatch and srun are not on PATH); "
                          "submit from the cluster's login node, or try the sweep here with hydra/launcher=local")
    objective = OmegaConf.select(config, "objective")
    basic = _basic_sweeper(config)
    if objective is None and not basic:
        raise ConfigError("objective=null: a search sweeper (hydra.sweeper._target_="
                          f"{OmegaConf.select(config, 'hydra.sweeper._target_')}) needs a metric to optimise "
                          "(e.g. objective=tokens_per_s, or objective=-decode_ms_p50 to minimise)")
    direction = OmegaConf.select(config, "hydra.sweeper.direction")
    if not basic and direction is not None and getattr(direction, "name", direction) != "maximize":
        raise ConfigError(f"hydra.sweeper.direction={getattr(direction, 'name', direction)}: kvbench's objective is "
                          "maximised (hydra.sweeper.direction=maximize); objective=-name minimises name")
    caps = OmegaConf.select(config, "objective_caps") or {}
    check_objective(None if objective is None else str(objective), dict(caps), str(config.get("task", "bench")),
                    str(OmegaConf.select(config, "workload.name", default="decode")))
    sweep_dir = Path(config.hydra.sweep.dir)
    if not basic and ((sweep_dir / MULTIRUN_FILE).exists() or find_results(sweep_dir)):
        raise ConfigError(f"hydra.sweep.dir={str(sweep_dir)!r}: holds jobs already, and a search does not "
                          "resume (the trials it would choose depend on the values measured, so its job "
                          "numbers would overwrite other jobs); give it a new hydra.sweep.dir")
    try:
        before = OmegaConf.select(OmegaConf.load(sweep_dir / MULTIRUN_FILE), "hydra.overrides.task") or []
    except (OSError, OmegaConfBaseException, ValueError):
        return  # a new directory, or one no sweep finished starting in
    if job_overrides(before) != job_overrides(config.hydra.overrides.task):
        raise ConfigError(f"hydra.sweep.dir={str(sweep_dir)!r}: holds another sweep "
                          f"({' '.join(job_overrides(before))}); give this one a new hydra.sweep.dir "
                          "(a sweep resumes only with the same overrides)")


class SweepCallback(Callback):
    """Counts a sweep's jobs at the start; at the end prints a table of this sweep's jobs and
    sets the exit code. Jobs never raise (failures are records), so Hydra always reaches
    ``on_multirun_end``, unless the sweep is interrupted: then :func:`main` ends it."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _sweep_config
        _sweep_config = config
        try:
            check_sweep_start(config)
        except ConfigError as exc:
            raise SweepRefused(str(exc)) from None
        if not _basic_sweeper(config):
            # Hydra's basic sweeper saves the sweep's config as it starts, Optuna's does not: saved
            # here, it makes a later sweep into this directory a refused one (check_sweep_start).
            Path(config.hydra.sweep.dir).mkdir(parents=True, exist_ok=True)
            OmegaConf.save(config, Path(config.hydra.sweep.dir) / MULTIRUN_FILE)
        new_sweep(config.hydra.sweep.dir)
        try:
            # a search runs hydra.sweeper.n_trials jobs (Optuna's sweeper; "?" for another)
            total = sweep_size(config) if _basic_sweeper(config) else OmegaConf.select(
                config, "hydra.sweeper.n_trials", default="?")
            os.environ["KVBENCH_SWEEP_TOTAL"] = str(total)
        except Exception:  # noqa: BLE001 — a count is a nicety; never stop a sweep for it
            os.environ["KVBENCH_SWEEP_TOTAL"] = "?"

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global _exit_code, _sweep_config
        _sweep_config = None
        if config.get("task") == "inspect":
            return
        _exit_code = max(_exit_code, sweep_end(config))


def config_error_line(exc: BaseException) -> str:
    """One line for an error Hydra or OmegaConf raised while composing the config: the key (or
    the override) and what is wrong with it (a renamed key names its new name)."""
    chain: List[BaseException] = []
    node: Optional[BaseException] = exc
    while node is not None and node not in chain:
        chain.append(node)
        node = node.__cause__ or node.__context__
    for err in chain:
        if isinstance(err, MissingConfigException) and err.missing_cfg_file:
            group, _, option = err.missing_cfg_file.rpartition("/")
            return one_line(f"{group}={option}: no such option in {group}/"
                            + (f" (available: {', '.join(err.options)})" if err.options else ""))
        if isinstance(err, OverrideParseException):
            return one_line(f"{err.override}: {err.message}")
        key = getattr(err, "full_key", None)
        if key:
            if key in RENAMED_KEYS:
                return f"{key}: renamed to {RENAMED_KEYS[key]}"
            msg = str(getattr(err, "msg", None) or err).strip().splitlines()[0]
            if "not in struct" in msg and "." not in key:
                return one_line(f"{_override_being_composed(exc) or key}: {_unknown_top_key(key)}")
            return one_line(f"{key}: {msg}")
    lines = [line.strip() for err in chain[:1] for line in str(err).split("Config search path")[0].splitlines()
             if line.strip()]
    text = " ".join(lines) or type(exc).__name__
    for old, new in RENAMED_KEYS.items():
        if f"'{old}'" in text:
            return f"{old}: renamed to {new}"
    override = _override_being_composed(exc)
    return one_line(f"{override}: {text}" if override and override not in text else text)


def _unknown_top_key(key: str) -> str:
    """What to say of a top-level name that is neither a config group nor a key (``atention=mha``):
    the nearest group or key."""
    groups = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
    keys = sorted(OmegaConf.to_container(schema_defaults()).keys())
    close = difflib.get_close_matches(key, groups + keys, n=1)
    if close:
        return f"no such config group or key (did you mean {close[0]}?)"
    return f"no such config group or key (groups: {', '.join(groups)})"


def _override_being_composed(exc: BaseException) -> Optional[str]:
    # Some of Hydra's errors do not say which override they are about (``attention=null``:
    # "Config group override must be a string or a list"); the frame that raised holds it.
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        line = getattr(frame.f_locals.get("override"), "input_line", None)
        if isinstance(line, str):
            return line
    return None


def _is_composition_error(exc: BaseException) -> bool:
    """An error in the command line or the config files rather than in kvbench: Hydra's and
    OmegaConf's own types, a ConfigError, and the ValueErrors Hydra's code raises itself."""
    if isinstance(exc, (ConfigError, HydraException, OmegaConfBaseException)):
        return True
    frames = list(traceback.walk_tb(exc.__traceback__))
    return (isinstance(exc, ValueError) and bool(frames)
            and frames[-1][0].f_code.co_filename.startswith(os.path.dirname(hydra.__file__) + os.sep))


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
    except OSError as exc:  # outside any job: an output directory that cannot be made, say
        if full_error:
            raise
        stderr.print(f"kvbench: {one_line(_os_error_line(exc))}", markup=False, soft_wrap=True)
        if _sweep_config is not None:
            sweep_end(_sweep_config)
        sys.exit(EXIT_CODES["error"])
    except Exception as exc:
        if _sweep_config is not None and not full_error and not _is_composition_error(exc):
            # The sweeper failed after its jobs (Optuna's, when no trial has a value): what the
            # jobs recorded is still this sweep's table and report.
            stderr.print(f"kvbench: the sweeper failed: {one_line(f'{type(exc).__name__}: {exc}')}",
                         markup=False, soft_wrap=True)
            sweep_end(_sweep_config)
            sys.exit(EXIT_CODES["error"])
        if full_error or not _is_composition_error(exc):
            raise
        stderr.print(f"kvbench: invalid config: {config_error_line(exc)}", markup=False, soft_wrap=True)
        sys.exit(EXIT_CODES["invalid"])
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM (runner.Interrupted): what finished, then 128 + signal
        signum = getattr(exc, "signum", signal.SIGINT)
        if _sweep_config is not None and _sweep_config.get("task") != "inspect":
            sweep_end(_sweep_config, interrupted=True)
        stderr.print(f"kvbench: interrupted by {signal.Signals(signum).name}", markup=False)
        sys.exit(128 + signum)
    sys.exit(_exit_code)


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
