"""One job, start to finish: config -> device and threads (once) -> the task -> results.json.

A job never raises for a bad value or an out-of-memory: it records ``invalid`` / ``oom`` with
the message, keeps every metric measured before the failure, and writes the record
atomically. A job stopped from outside (Ctrl-C, SIGTERM, a launcher's exit on preemption) is
recorded ``interrupted`` with what was complete by then, and the interruption is raised again
with the record attached (``exc.record``): a job is ``ok`` only when its task returned with
finite metrics (NaN or infinity makes it an ``error``). Only the CLI decides what a status means
for the exit code, and only the CLI builds progress bars: it hands :func:`run_job` a factory for
them.
"""

from __future__ import annotations

import datetime as dt
import difflib
import re
import signal
import socket
import traceback
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, ContextManager, Dict, List, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kvbench.checkpoint import convert_kv_heads, kv_conversion, load_llama_dir
from kvbench.config import (
    AttentionConfig,
    BenchConfig,
    ConfigError,
    kv_layout_change,
    objective_metric,
    one_line,
    record_view,
    to_bench_config,
)
from kvbench.device import resolve_device
from kvbench.interrupts import Interrupted, describe_stop, interruptible
from kvbench.measure.env import LOAD_METHODS, collect_env, load_average, noisy, usable_cpus
from kvbench.measure.memory import MEMORY_METHODS, is_oom, weight_bytes
from kvbench.measure.plausibility import flag_implausible
from kvbench.measure.timing import timing_method
from kvbench.model import Decoder, torch_dtype
from kvbench.quality.fidelity import KV_POOL_METHODS, kv_pool_fidelity
from kvbench.quality.train import EVAL_METHODS, TRAIN_METHODS, checkpoint_for_eval, run_eval, run_train
from kvbench.results import RESULTS_FILE, RunResult, nonfinite_metrics
from kvbench.workloads import capacity, decode, interleaved, multiturn

# progress(label, total) -> a context manager yielding tick(description=None), called once per
# trial or training step; the CLI passes rich progress bars, the default shows nothing.
Progress = Callable[[str, int], ContextManager[Optional[Callable[..., None]]]]

# Methods of the fields every model-running job records.
JOB_METHODS: Dict[str, str] = {
    "peak_rss_reason": "text; only when peak_rss_bytes is null: why (runtime.isolate=false, and an earlier job ran "
                       "in the same process, whose peak would count as this job's)",
    "weight_bytes": "bytes; parameters and persistent buffers (numel * element_size), tied tensors once",
    "num_params": "count; parameters of the decoder, tied tensors once",
    "timing_method": "cuda_events (synchronised once after the trial) on CUDA, perf_counter on CPU",
    "kv_heads_conversion": "model.path only: none | repeat | mean-pool, how the checkpoint's KV heads "
                           "(model.preset_kv_heads) were brought to attention.num_kv_heads (repeat is exact)",
    **MEMORY_METHODS,
}

WORKLOADS = {"decode": decode.run, "multiturn": multiturn.run}
MAX_TRACEBACK_CHARS = 200_000  # error.txt: the head and the tail of a traceback longer than this

# torch's own thread count in this process, before any job set one: runtime.threads=null
# means this, not whatever an earlier job of the same process left behind.
DEFAULT_THREADS = torch.get_num_threads()
_jobs_run = 0  # jobs whose task ran in this process (runtime.isolate=false runs several)

@contextmanager
def no_progress(label: str, total: int):
    yield None


def build_model(cfg: BenchConfig, device: torch.device) -> Decoder:
    """The decoder for ``cfg``, seeded so every variant of a sweep draws the same weights
    wherever their shapes agree; with ``model.path`` the checkpoint's weights, brought to
    ``attention.num_kv_heads`` when that differs from the checkpoint's own count (repeated,
    exactly, to more heads; mean-pooled to fewer)."""
    dtype = torch_dtype(cfg.runtime.dtype)
    if cfg.model.path:
        model, _ = load_llama_dir(cfg.model.path, torch.float32, device)
        if kv_conversion(model.num_kv_heads, cfg.attention.num_kv_heads) != "none":
            model = convert_kv_heads(model, cfg.attention.num_kv_heads)
        return model.to(dtype).eval()
    torch.manual_seed(cfg.runtime.seed)
    with device:
        model = Decoder(cfg.model, cfg.attention)
    return model.to(dtype).eval()


def bench(cfg: BenchConfig, device: torch.device, out_dir: Path, result: RunResult, progress: Progress) -> None:
    """``task=bench``: the workload ``cfg.workload.name`` on the decoder."""
    result.metrics["timing_method"] = timing_method(device)
    result.methods.update(JOB_METHODS)
    model = build_model(cfg, device)
    result.metrics["weight_bytes"] = weight_bytes(model)
    result.metrics["num_params"] = model.num_params()
    if cfg.model.path:
        result.metrics["kv_heads_conversion"] = kv_conversion(cfg.model.preset_kv_heads, cfg.attention.num_kv_heads)
    label = f"{cfg.attention.type} kv={cfg.attention.num_kv_heads}"
    if cfg.workload.name == "multiturn":
        label += f" shared={cfg.cache.shared}"
    with progress(label, cfg.runtime.warmup + cfg.runtime.repeats) as tick:
        WORKLOADS[cfg.workload.name](cfg, model, device, result, tick)


def train(cfg: BenchConfig, device: torch.device, out_dir: Path, result: RunResult, progress: Progress) -> None:
    """``task=train``: the loss curve goes into the record as it is logged (so a failure keeps
    it), the final metrics at the end, the checkpoint into the job directory."""
    curve = result.tables.setdefault("curve", [])

    def on_log(step: int, point: Dict[str, float]) -> None:
        curve.append({"step": step, **point})
        result.series["train_step"] = [p["step"] for p in curve]
        result.series["train_loss"] = [p["train_loss"] for p in curve]

    result.methods.update(TRAIN_METHODS)
    with progress("train", cfg.train.steps) as tick:
        result.metrics.update(run_train(cfg, device, out_dir, on_log, tick))
    if "init_num_kv_heads" in result.metrics:  # train.init_from: its checkpoint's count is the model's own
        own = replace(cfg.model, preset_kv_heads=result.metrics["init_num_kv_heads"])
        result.kv_conversion = kv_layout_change(own, cfg.attention, result.metrics["kv_heads_conversion"])


def evaluate(cfg: BenchConfig, device: torch.device, out_dir: Path, result: RunResult, progress: Progress) -> None:
    """``task=eval``: perplexity of ``train.checkpoint`` on ``data``; the record's model and
    attention are the checkpoint's shape as evaluated, not the preset's."""
    result.methods.update(EVAL_METHODS)
    loaded = checkpoint_for_eval(cfg, device)
    result.config["model"], result.config["attention"] = asdict(loaded[0].config), asdict(loaded[0].attention)
    result.metrics.update(run_eval(cfg, device, loaded))
    saved, how = loaded[2]["checkpoint_num_kv_heads"], loaded[2]["kv_heads_conversion"]
    result.kv_conversion = kv_layout_change(replace(loaded[0].config, preset_kv_heads=saved), loaded[0].attention, how)


def capacity_search(cfg: BenchConfig, device: torch.device, out_dir: Path, result: RunResult,
                    progress: Progress) -> None:
    """``task=capacity``: the largest batch per context under the memory budget and the SLOs
    (kvbench/workloads/capacity.py); what the process held before the model is the baseline."""
    result.metrics["timing_method"] = timing_method(device)
    result.methods.update(JOB_METHODS)
    baseline = capacity.baseline_bytes(device)
    model = build_model(cfg, device)
    result.metrics["weight_bytes"] = weight_bytes(model)
    result.metrics["num_params"] = model.num_params()
    label = f"capacity {cfg.attention.type} kv={cfg.attention.num_kv_heads}"
    if cfg.workload.name == "multiturn":
        label += f" chat shared={cfg.cache.shared}"
    expected = len(capacity.contexts(cfg)) * capacity.probes_expected(cfg.capacity.max_batch,
                                                                          cfg.capacity.batch_step)
    with progress(label, expected) as tick:
        capacity.run(cfg, model, device, result, baseline, tick)
    if cfg.runtime.fidelity:  # quality of this KV-head count, after the probes (its models are not theirs)
        del model
        result.methods.update(KV_POOL_METHODS)
        h = cfg.model.num_heads
        reference = build_model(replace(cfg, attention=AttentionConfig.for_heads(h, h)), device)
        length = min(max(capacity.contexts(cfg)), 256)
        tokens = torch.randint(0, cfg.model.vocab_size, (2, length),
                               generator=torch.Generator().manual_seed(cfg.runtime.seed)).to(device)
        result.metrics.update(kv_pool_fidelity(reference, cfg.attention.num_kv_heads, tokens))


def compare_variants(cfg: BenchConfig, device: torch.device, out_dir: Path, result: RunResult,
                     progress: Progress) -> None:
    """``task=compare``: ``compare.variants`` of one seeded MHA model (or the checkpoint, its KV
    heads repeated to MHA, exactly) in alternating trials in this process (workloads/interleaved.py)."""
    result.metrics["timing_method"] = timing_method(device)
    result.methods["timing_method"] = JOB_METHODS["timing_method"]
    h = cfg.model.num_heads
    base = build_model(replace(cfg, attention=AttentionConfig.for_heads(h, h)), device)
    total = (cfg.runtime.warmup + cfg.runtime.repeats) * len(cfg.compare.variants)
    with progress("compare " + ",".join(cfg.compare.variants), total) as tick:
        interleaved.run(cfg, base, device, result, tick)


TASKS = {"bench": bench, "train": train, "eval": evaluate, "capacity": capacity_search,
         "compare": compare_variants}
# A chat's turn{k}_ttft_ms, one per turn, is declared as it is measured: here as a pattern.
WORKLOAD_METHODS = {"decode": decode.METHODS,
                    "multiturn": {**multiturn.METHODS, "turn<k>_ttft_ms": multiturn.TURN_TTFT_METHOD}}


def task_methods(task: str, workload: str = "decode") -> Dict[str, str]:
    """Every metric a job of ``task`` (for task=bench: of ``workload``) may record -> its unit
    and method: the ``*_METHODS`` tables the task's code merges into its records."""
    per_task = {"bench": {**JOB_METHODS, **WORKLOAD_METHODS.get(workload, {})},
                "train": TRAIN_METHODS, "eval": EVAL_METHODS,
                "capacity": {**JOB_METHODS, **capacity.METHODS, **KV_POOL_METHODS},
                "compare": {"timing_method": JOB_METHODS["timing_method"], **interleaved.METHODS}}
    return {**LOAD_METHODS, **per_task.get(task, {})}


def objective_metrics(task: str, workload: str = "decode") -> List[str]:
    """The metrics of :func:`task_methods` an ``objective`` may name: numbers, not text, series
    or tables. Names declared as patterns (task=compare's ``<v>_step_ms_ctx<C>``) stay patterns."""
    return sorted(name for name, method in task_methods(task, workload).items()
                  if "." not in name and method.split(";")[0].strip() != "text")


def check_objective(objective: Optional[str], caps: Dict[str, float], task: str, workload: str = "decode") -> None:
    """Raise :class:`ConfigError` when ``objective`` or a key of ``caps`` names a metric that a
    job of ``task`` never records (before any job runs: a typo would fail every trial)."""
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
    """Run one job in this process and write ``results.json`` into ``out_dir``; returns the
    record. An interruption is recorded, then raised again with ``exc.record`` set."""
    global _jobs_run
    out_dir = Path(out_dir)
    # "interrupted" until the task returns: whatever ends it early is never recorded ok.
    result = RunResult(status="interrupted", config=record_view(_as_given(cfg)), overrides=list(overrides or []),
                       started_at=utc_now(),
                       env={"hostname": socket.gethostname()})  # even a job that fails early says where
    stopped: Optional[BaseException] = None
    with interruptible() as stops:
        try:
            job = to_bench_config(cfg)
            check_objective(job.objective, job.objective_caps, job.task, job.workload.name)
            # with derived values (head_dim, num_kv_heads) filled in, and only the keys the task reads
            result.config = record_view(asdict(job))
            result.kv_conversion = job_kv_conversion(job)
            # Device and threads are resolved here, once per job; every task receives them.
            device = resolve_device(job.runtime.device)
            torch.set_num_threads(job.runtime.threads or DEFAULT_THREADS)
            result.env = {**collect_env(device), "device": str(device)}  # what it ran with
            if job.task not in TASKS:
                raise ConfigError(f"task={job.task!r}: runs no job here (task=inspect prints, it records nothing)")
            earlier_jobs = _jobs_run
            _jobs_run += 1
            result.methods.update(LOAD_METHODS)
            result.metrics.update(usable_cpus=usable_cpus(), load_avg_before=load_average())
            TASKS[job.task](job, device, out_dir, result, progress)
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
            result.status = "oom" if is_oom(exc) else "error"
            result.error = one_line(f"{type(exc).__name__}: {exc}")
            try:
                (out_dir / "error.txt").parent.mkdir(parents=True, exist_ok=True)
                (out_dir / "error.txt").write_text(_bounded(traceback.format_exc(), MAX_TRACEBACK_CHARS))
            except OSError:
                pass  # a full disk: the record below says what failed, or is printed if it cannot be written
        except BaseException as exc:  # noqa: BLE001 — Ctrl-C, SIGTERM, SystemExit: recorded, then raised again
            result.status, result.error = "interrupted", describe_stop(exc)
            stopped = exc
        finally:
            stops.hold()  # a signal during the write waits for it: the record is the point
            if "load_avg_before" in result.metrics:  # the task started: how busy the machine was around it
                _record_load(result.metrics)
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


def save(result: RunResult, out_dir: Path) -> None:
    """Write the record; when the file system refuses (a full disk), keep the reason in
    ``result.unsaved`` so the CLI can print the record instead of losing it."""
    try:
        result.write(out_dir)
    except OSError as exc:
        result.unsaved = f"cannot write {Path(out_dir) / RESULTS_FILE}: {exc.strerror or exc}"


def job_kv_conversion(cfg: BenchConfig) -> Optional[Dict[str, object]]:
    """What the record's ``kv_conversion`` says for a job whose attention is resolved against
    its model (task=eval says it once the checkpoint is read; task=compare compares variants of
    one model, each named in its columns): null for the model's own KV-head count."""
    if cfg.task in ("eval", "compare"):
        return None
    if cfg.task == "train" and cfg.train.init_from:
        return None  # the checkpoint's count is known once it is loaded (init_num_kv_heads, kv_heads_conversion)
    method = (kv_conversion(cfg.model.preset_kv_heads, cfg.attention.num_kv_heads) if cfg.model.path
              else "random-init")
    return kv_layout_change(cfg.model, cfg.attention, method)


def _record_load(metrics: Dict[str, object]) -> None:
    metrics["load_avg_after"] = load_average()
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


def utc_now() -> str:
    """The time a record is stamped with: UTC, ISO 8601, to the second."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")

