"""A sweep around its jobs (``hydra.callbacks.sweep`` in conf/config.yaml): refuse one that cannot
run or would overwrite another before its first job (:func:`check_sweep_start`), count its jobs,
and at its end print the table of its jobs, write its report and W&B workspace and give the exit
code (:func:`sweep_end`). A single run's config is typed, and the run refused when it would replace
another run's ``ok`` record, before Hydra makes anything for it (:func:`check_run_start`).
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from kvbench.cli_job import report, typed_at_start
from kvbench.core.errors import ConfigError, one_line
from kvbench.jobs.claim import sweep_lock
from kvbench.jobs.job_config import to_bench_config
from kvbench.jobs.outcome import EXIT_CODES, OUTCOME
from kvbench.jobs.sweep import job_overrides, override_list, sweep_records, sweep_size
from kvbench.jsonio import os_error_line, write_text_atomic
from kvbench.results import RecordError, distrust, find_results, read_record
from kvbench.sinks.console import stderr, stdout, sweep_tables
from kvbench.sinks.dashboard import PublishError, online, publish, publish_commands, tracked, write_dashboard
from kvbench.sinks.report import collect
from kvbench.sinks.tracking import new_sweep

MULTIRUN_FILE = "multirun.yaml"  # the sweep's config, in its directory
# Rows of a sweep's end table that mean a job of the sweep has no result: the sweep exits 1.
FAILED_ROWS = ("error", "interrupted", "unreadable", "missing", "not run")


def sweep_end(config: DictConfig, interrupted: bool = False, failure: Optional[str] = None) -> int:
    """Print the table of this sweep's jobs, write its report; the exit code for them. Never
    raises for what it finds on disk: a part that fails is one line saying so. ``failure``: why the
    sweeper itself failed, the sweep's last line unless its jobs' statuses say why (every trial
    invalid: one line, not that and the sweeper's "no trials are completed")."""
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
        report(sweep_dir, plots=not interrupted, records=rows)  # after Ctrl-C: quickly, no plots
        if not interrupted and counts.get("ok"):  # nothing to publish without a measurement
            _dashboard(sweep_dir, rows)
    code, why = sweep_exit(counts)
    if failure is not None and why is None:
        code, why = code or EXIT_CODES["error"], failure
    if why:
        stderr.print(f"kvbench: {why}", markup=False, soft_wrap=True)
    return code


def sweep_exit(counts: Dict[str, int]) -> tuple[int, Optional[str]]:
    """A sweep's exit code for the statuses of its jobs, and why it is not 0: 0 only when every job is
    accounted for and at least one measured; every job invalid (a typo in a swept key) is 2."""
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
    """The sweep's W&B workspace, created on W&B when the runs went online; never fails the sweep."""
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
    stdout.print(publish_text(sweep_dir, runs_online), markup=False, soft_wrap=True)


def publish_text(sweep_dir: Path, runs_online: bool) -> str:
    """How to publish the sweep: a command a line (one line joined by && was 135 columns)."""
    return "\n".join(["publish it to W&B with:", *(f"  {c}" for c in publish_commands(sweep_dir, runs_online))])


class SweepRefused(BaseException):
    """A run or a sweep stopped before anything was made for it. Not an ``Exception``: Hydra turns
    what a callback raises into a warning and goes on, and this must reach :func:`main` (one line,
    exit ``code``: 2 for a config that cannot run, 1 for a file that cannot be written)."""

    def __init__(self, message: str, code: int = EXIT_CODES["invalid"]):
        super().__init__(message)
        self.code = code

    def line(self) -> str:
        return f"kvbench: invalid config: {self}" if self.code == EXIT_CODES["invalid"] else f"kvbench: {self}"


def check_run_start(config: DictConfig) -> None:
    """Type a single run's config before Hydra makes its directory (and before anything imports
    torch), so a bad value is one line and nothing is created. (A sweep types each job as it runs:
    one bad job is that job's record.)"""
    HydraConfig.instance().set_config(config)  # a value may read ${hydra:...}, as the job will
    job = copy.deepcopy(config)
    with open_dict(job):
        del job["hydra"]
    typed_at_start(job, to_bench_config(job))
    check_run_dir(config)


def _basic_sweeper(config: DictConfig) -> bool:
    """Hydra's grid sweeper, whose jobs kvbench can list from the config (kvbench.jobs.sweep); a search
    sweeper (Optuna) chooses its jobs as it goes."""
    return str(OmegaConf.select(config, "hydra.sweeper._target_")).endswith(".BasicSweeper")


def check_sweep_start(config: DictConfig) -> None:
    """Refuse, before any job starts, a sweep that cannot run or would overwrite another (a directory
    holding a sweep of other overrides, or any sweep for a search, whose job N depends on the values
    measured)."""
    target = str(OmegaConf.select(config, "hydra.launcher._target_") or "")
    if target.endswith("SlurmLauncher") and not (shutil.which("sbatch") and shutil.which("srun")):
        raise ConfigError("hydra/launcher=slurm: no SLURM on this machine (sbatch and srun are not on PATH); "
                          "submit from the cluster's login node, or try the sweep here with hydra/launcher=local")
    objective = OmegaConf.select(config, "objective")
    basic = _basic_sweeper(config)
    if not basic:
        _quiet_failed_trials()
    if objective is None and not basic:
        raise ConfigError("objective=null: a search sweeper (hydra.sweeper._target_="
                          f"{OmegaConf.select(config, 'hydra.sweeper._target_')}) needs a metric to optimise "
                          "(e.g. objective=tokens_per_s, or objective=-decode_ms_p50 to minimise)")
    direction = OmegaConf.select(config, "hydra.sweeper.direction")
    if not basic and direction is not None and getattr(direction, "name", direction) != "maximize":
        raise ConfigError(f"hydra.sweeper.direction={getattr(direction, 'name', direction)}: kvbench's objective is "
                          "maximised (hydra.sweeper.direction=maximize); objective=-name minimises name")
    caps = OmegaConf.select(config, "objective_caps") or {}
    if objective is not None or caps:  # without either there is no metric name to check
        # The metric registry is the tasks' tables (torch): imported only for a sweep that names metrics.
        from kvbench.jobs.runner import check_objective

        check_objective(None if objective is None else str(objective), dict(caps), str(config.get("task", "bench")),
                        str(OmegaConf.select(config, "workload.name", default="decode")))
    sweep_dir = Path(config.hydra.sweep.dir)
    # Whose the directory is, is decided and written down under one lock: two sweeps started at the
    # same instant would both find no multirun.yaml (Hydra's sweeper writes it later) and both run.
    with sweep_lock(sweep_dir):
        _claim_sweep_dir(config, sweep_dir, basic)


# Optuna's sweeper logs a trial that returned no objective as "Failed experiment: Return value must be
# float-castable. Got 'None'.", a second line for what kvbench's own line (objective: none, why) says.
_OPTUNA_LOG = "hydra_plugins.hydra_optuna_sweeper._impl"


class _NoObjectiveFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "float-castable. Got 'None'" not in record.getMessage()


def _quiet_failed_trials() -> None:
    logger = logging.getLogger(_OPTUNA_LOG)
    if not any(isinstance(f, _NoObjectiveFilter) for f in logger.filters):
        logger.addFilter(_NoObjectiveFilter())


def _claim_sweep_dir(config: DictConfig, sweep_dir: Path, basic: bool) -> None:
    """Refuse ``sweep_dir`` when it holds another sweep (any sweep, for a search), else write this
    sweep's config into its multirun.yaml."""
    if not basic and ((sweep_dir / MULTIRUN_FILE).exists() or find_results(sweep_dir)):
        raise ConfigError(f"hydra.sweep.dir={str(sweep_dir)!r}: holds jobs already, and a search does not "
                          "resume (the trials it would choose depend on the values measured, so its job "
                          "numbers would overwrite other jobs); give it a new hydra.sweep.dir")
    saved = sweep_dir / MULTIRUN_FILE
    before = None  # a new directory, or one no sweep finished starting in
    # A link planted there is replaced by the write below, never read through; a FIFO would block the read.
    if saved.is_file() and not saved.is_symlink():
        try:
            before = OmegaConf.select(OmegaConf.load(saved), "hydra.overrides.task")
        except (OSError, OmegaConfBaseException, ValueError):
            before = None
    if before is None:
        if sweep_dir.is_dir():
            write_text_atomic(sweep_dir / MULTIRUN_FILE, OmegaConf.to_yaml(config))
        return
    if job_overrides(override_list(before)) != job_overrides(override_list(config.hydra.overrides.task)):
        raise ConfigError(f"hydra.sweep.dir={str(sweep_dir)!r}: holds another sweep "
                          f"({' '.join(job_overrides(override_list(before)))}); give this one a new "
                          "hydra.sweep.dir (a sweep resumes only with the same overrides)")


def check_run_dir(config: DictConfig) -> None:
    """Refuse, before Hydra writes anything into it, a single run into a ``hydra.run.dir`` holding the
    ``ok`` record of other overrides, which this run would replace. The same overrides measure the
    same job again."""
    run_dir = Path(str(config.hydra.run.dir))
    try:
        record = read_record(run_dir)
    except RecordError:
        return  # nothing measured there (or nothing readable): nothing to lose
    if record.status != "ok" or distrust(record) is not None:
        return
    before, now = job_overrides(record.overrides) or [], job_overrides(config.hydra.overrides.task) or []
    if sorted(before) != sorted(now):
        had, has = [o for o in before if o not in now], [o for o in now if o not in before]
        raise ConfigError(f"hydra.run.dir={str(run_dir)!r}: holds the ok record of another run, which this one "
                          f"would replace (that run had {' '.join(had) or 'no other override'}, this one has "
                          f"{' '.join(has) or 'no other override'}); give this run a new hydra.run.dir")


# What Hydra's sweepers write into a sweep's directory (BasicSweeper, Optuna's), with open(path, "w")
# that follows a link: a link planted there is removed before the sweep starts.
SWEEPER_FILES = (MULTIRUN_FILE, "optimization_results.yaml")


BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher"


class SweepCallback(Callback):
    """Checks a run or a sweep before anything is made for it, and ends a sweep. Jobs never raise
    (failures are records), so Hydra always reaches ``on_multirun_end`` unless the sweep is
    interrupted: then :func:`main` ends it."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Each job's own line names its overrides and its variant (cli_job.job_line); the basic
        # launcher's "#0 : <every override>" said the same on one line of any length.
        logging.getLogger(BASIC_LAUNCHER).setLevel(logging.WARNING)
        OUTCOME.sweep_started(config)
        try:
            check_sweep_start(config)
        except ConfigError as exc:
            raise SweepRefused(str(exc)) from None
        except OSError as exc:  # multirun.yaml refused (a full disk): not a warning and a sweep that fails later
            raise SweepRefused(one_line(os_error_line(exc)), EXIT_CODES["error"]) from None
        for name in SWEEPER_FILES:
            if (Path(config.hydra.sweep.dir) / name).is_symlink():
                (Path(config.hydra.sweep.dir) / name).unlink()  # the link goes, its target is untouched
        if not _basic_sweeper(config):
            # Hydra's basic sweeper saves the sweep's config as it starts, Optuna's does not: saved
            # here, it makes a later sweep into this directory a refused one (check_sweep_start).
            write_text_atomic(Path(config.hydra.sweep.dir) / MULTIRUN_FILE, OmegaConf.to_yaml(config))
        new_sweep(config.hydra.sweep.dir)
        try:
            # a search runs hydra.sweeper.n_trials jobs (Optuna's sweeper; "?" for another)
            total = sweep_size(config) if _basic_sweeper(config) else OmegaConf.select(
                config, "hydra.sweeper.n_trials", default="?")
            os.environ["KVBENCH_SWEEP_TOTAL"] = str(total)
        except Exception:  # noqa: BLE001 — a count is a nicety; never stop a sweep for it
            os.environ["KVBENCH_SWEEP_TOTAL"] = "?"

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            check_run_start(config)
        except ConfigError as exc:
            raise SweepRefused(str(exc)) from None

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.get("task") == "inspect":
            OUTCOME.sweep = None
            return
        OUTCOME.sweep_ended(sweep_end(config))
