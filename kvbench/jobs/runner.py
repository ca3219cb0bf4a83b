"""One job, start to finish: config -> device and threads (once) -> the task -> results.json.

A job never raises for a bad value or an out-of-memory: it records ``invalid`` / ``oom`` with the
message and every metric measured before the failure. A job stopped from outside is recorded
``interrupted`` and the interruption raised again with ``exc.record`` set. A job is ``ok`` only when
its task returned with finite metrics.
"""

from __future__ import annotations

import difflib
import re
import signal
import socket
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kvbench.config.bench import BenchConfig, objective_metric
from kvbench.core.errors import ConfigError, one_line
from kvbench.footprint import check_fits
from kvbench.jobs.device import resolve_device
from kvbench.jobs.interrupts import Interrupted, describe_stop, interruptible, launcher_stop, stop_error
from kvbench.jobs.job_config import to_bench_config
from kvbench.jsonio import name_the_file, write_text_atomic
from kvbench.measure.env import LOAD_METHODS, LOAD_METRICS, collect_env, load_average, noisy, usable_cpus
from kvbench.measure.memory import is_oom
from kvbench.measure.plausibility import flag_implausible
from kvbench.metrics import Metric, record_methods
from kvbench.parallel.launch import run_ranks
from kvbench.parallel.plan import runs_as_ranks
from kvbench.parallel.tensor import current as current_ranks
from kvbench.progress import Progress, guarded, no_progress
from kvbench.results import RunResult, lookup, nonfinite_metrics, record_config, save, utc_now
from kvbench.tasks import bench, capacity, compare, train
from kvbench.tasks import eval as eval_task
from kvbench.tasks import recall as recall_task
from kvbench.tasks.common import JOB_METHODS, job_kv_conversion

MAX_TRACEBACK_CHARS = 200_000  # error.txt: the head and the tail of a traceback longer than this

# torch's own thread count in this process, before any job set one: runtime.threads=null
# means this, not whatever an earlier job of the same process left behind.
DEFAULT_THREADS = torch.get_num_threads()
_jobs_run = 0  # jobs whose task ran in this process (runtime.isolate=false runs several)

# What each task reads of the config is declared in kvbench.config.bench.TASKS.
TASKS = {"bench": bench, "capacity": capacity, "compare": compare, "train": train, "eval": eval_task,
         "recall": recall_task}


def task_metrics(task: str, workload: str = "decode") -> Dict[str, Metric]:
    """Every metric a job of ``task`` (for task=bench: of ``workload``) may record."""
    return {**LOAD_METRICS, **(TASKS[task].metrics(workload) if task in TASKS else {})}


def job_units(result: RunResult) -> Dict[str, str]:
    """The unit of each metric the record's ``methods`` declares, so that sinks read units as data."""
    task, workload = result.config.get("task"), lookup(result.config, "workload.name")
    declared = task_metrics(task if isinstance(task, str) else "bench",
                            workload if isinstance(workload, str) else "decode")
    return {name: metric.unit for name, metric in declared.items() if name in result.methods}


def task_methods(task: str, workload: str = "decode") -> Dict[str, str]:
    """:func:`task_metrics` as a record's ``methods`` holds them: name -> ``unit; method``."""
    return record_methods(task_metrics(task, workload))


def objective_metrics(task: str, workload: str = "decode") -> List[str]:
    """The metrics an ``objective`` may name: numbers, not text, series or tables (patterns such as
    ``<v>_step_ms_ctx<C>`` stay patterns)."""
    return sorted(name for name, metric in task_metrics(task, workload).items()
                  if "." not in name and metric.unit not in ("text", "bool"))


def check_objective(objective: Optional[str], caps: Dict[str, float], task: str, workload: str = "decode") -> None:
    """Raise :class:`ConfigError` when ``objective`` or ``caps`` names a metric that ``task`` never
    records (before any job runs: a typo would fail every trial)."""
    known = objective_metrics(task, workload)
    patterns = [re.compile("".join(r"\w+" if part.startswith("<") else re.escape(part)
                                   for part in re.split(r"(<[^>]+>)", n))) for n in known if "<" in n]
    named = [("objective", objective, objective_metric(objective)[0])] if objective else []
    named += [(f"objective_caps.{n}", caps[n], n) for n in caps]
    for key, value, metric in named:
        if metric not in known and not any(p.fullmatch(metric) for p in patterns):
            close = difflib.get_close_matches(metric, known, n=3)
            raise ConfigError(f"{key}={value!r}: task={task}" + (f" workload={workload}" if task == "bench" else "")
                              + f" records no metric {metric!r}"
                              + (f" (did you mean {', '.join(close)}?)" if close else ""))


def run_job(cfg: DictConfig | BenchConfig, out_dir: Path | str,
            overrides: Optional[List[str]] = None, progress: Progress = no_progress) -> RunResult:
    """Run one job in this process and write ``results.json`` into ``out_dir``; returns the record."""
    global _jobs_run
    out_dir = Path(out_dir)
    progress = guarded(progress)  # a display that cannot be written never costs the measurement
    # "interrupted" until the task returns: whatever ends it early is never recorded ok.
    result = RunResult(status="interrupted", config=record_config(_as_given(cfg)), overrides=list(overrides or []),
                       started_at=utc_now(),
                       env={"hostname": socket.gethostname()})  # even a job that fails early says where
    stopped: Optional[BaseException] = None
    with interruptible() as stops:
        try:
            job = to_bench_config(cfg)  # a BenchConfig (the CLI types a job once) passes as it is
            check_objective(job.objective, job.objective_caps, job.task, job.workload.name)
            # with derived values (head_dim, num_kv_heads) filled in, and only the keys the task reads
            result.config = record_config(asdict(job))
            result.kv_conversion = job_kv_conversion(job)
            # Device and threads are resolved here, once per job; every task receives them.
            device = resolve_device(job.runtime.device)
            torch.set_num_threads(job.runtime.threads or DEFAULT_THREADS)
            result.env = {**collect_env(device), "device": str(device)}  # what it ran with
            if job.task not in TASKS:
                raise ConfigError(f"task={job.task!r}: runs no job here (task=inspect prints, it records nothing)")
            if job.runtime.tensor_parallel > 1 and runs_as_ranks(job) and current_ranks() is None:  # each rank runs it
                result = run_ranks(job, out_dir, list(overrides or []), run_job, device)
                return result  # rank 0's record, every rank's figures in it; saved again below
            check_fits(job, device)  # sizes from the config, before anything is built
            earlier_jobs = _jobs_run
            _jobs_run += 1
            result.methods.update(LOAD_METHODS)
            result.metrics.update(usable_cpus=usable_cpus(), load_avg_before=load_average())
            TASKS[job.task].run(job, device, out_dir, result, progress)
            if earlier_jobs:
                _not_this_jobs_peak(result)
            result.status = "ok"
            nonfinite = nonfinite_metrics(result.metrics)
            if nonfinite:  # NaN compares unequal to everything: such a run can only mislead
                result.status = "error"
                result.error = one_line("metrics are not finite numbers: " + ", ".join(
                    f"{k}={v}" for k, v in nonfinite.items()) + " (overflow or divergence; null in results.json)")
        except ConfigError as exc:  # bounded to one line where it is raised
            result.status, result.error = "invalid", str(exc)
        except Exception as exc:  # noqa: BLE001 — every failure becomes data, never a lost record
            if launcher_stop(exc):  # submitit ending the job on SLURM's time-limit warning: raised again
                result.status, result.error = "interrupted", describe_stop(exc)
                stopped = exc
            else:
                result.status = "oom" if is_oom(exc) else "error"
                if isinstance(exc, OSError):
                    name_the_file(exc)  # a checkpoint, a GPU lock: the file a full disk refused
                result.error = one_line(f"{type(exc).__name__}: {exc}")
                try:
                    write_text_atomic(out_dir / "error.txt", _bounded(traceback.format_exc(), MAX_TRACEBACK_CHARS))
                except OSError as unsaved:  # a full disk: the record says so (or is printed if it cannot be written)
                    result.error = one_line(f"{result.error} (traceback not saved: cannot write "
                                            f"{out_dir / 'error.txt'}: {unsaved.strerror or unsaved})")
        except BaseException as exc:  # noqa: BLE001 — Ctrl-C, SIGTERM, SystemExit: recorded, then raised again
            result.status, result.error = "interrupted", stop_error(exc, result.metrics)
            stopped = exc
        finally:
            stops.hold()  # a signal during the write waits for it: the record is the point
            if "load_avg_before" in result.metrics:  # the task started: how busy the machine was around it
                _record_load(result.metrics)
            result.units = job_units(result)
            try:  # every figure against the machine's physical bounds (measure/plausibility.py)
                flag_implausible(result)
            except Exception as exc:  # noqa: BLE001 — a check that fails must not lose the record
                result.implausible = [{"metric": None, "value": None, "bound": None,
                                       "reason": one_line(f"plausibility check failed: {type(exc).__name__}: {exc}")}]
            result.finished_at = utc_now()
            save(result, out_dir)
    if stopped is None and stops.held:
        stopped = Interrupted(stops.held, f"interrupted by {signal.Signals(stops.held).name} "
                                          "after the job finished")
    if stopped is not None:
        stopped.record = result
        raise stopped
    return result


def _record_load(metrics: Dict[str, object]) -> None:
    metrics["load_avg_after"] = load_average()
    if "noisy" in metrics:  # a task that timed nothing said so (capacity.plan): the load cannot make it noisy
        return
    metrics["noisy"], metrics["noisy_reason"] = noisy(metrics["load_avg_before"], metrics["load_avg_after"],
                                                      metrics["usable_cpus"])


def _not_this_jobs_peak(result: RunResult) -> None:
    # getrusage's peak RSS is the process's since it started: after another job in the same
    # process it is that job's peak as much as this one's.
    if result.metrics.get("peak_rss_bytes") is not None:
        result.metrics["peak_rss_bytes"] = None
        result.metrics["peak_rss_reason"] = ("runtime.isolate=false and an earlier job ran in this process: "
                                             "its peak RSS would count as this job's")
        result.methods["peak_rss_reason"] = JOB_METHODS["peak_rss_reason"]


def _as_given(cfg: DictConfig | BenchConfig) -> Dict:
    """The job's config for its record before it is validated: resolved where it resolves (an
    interpolation to a missing key is recorded as written, and the job is ``invalid``)."""
    if isinstance(cfg, BenchConfig):
        return asdict(cfg)
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException:
        return OmegaConf.to_container(cfg, resolve=False)


def _bounded(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n… [{len(text) - limit:,} characters cut] …\n{text[-half:]}"

