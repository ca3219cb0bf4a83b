"""One job, start to finish: config -> model -> scenario under measurement -> results.json.

A job never raises for a bad value or an out-of-memory: it records ``invalid`` / ``oom`` with
the message, keeps every metric measured before the failure, and writes the record
atomically. Only the CLI decides what a status means for the exit code.
"""

from __future__ import annotations

import datetime as dt
import socket
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from kvbench.cache import cache_for, kv_cache_bytes
from kvbench.cluster import resolve_device
from kvbench.config import BenchConfig, ConfigError, dtype_bytes
from kvbench.console import progress_bar
from kvbench.measure.env import collect_env
from kvbench.measure.memory import MEMORY_METHODS, MemoryMonitor, weight_bytes
from kvbench.measure.roofline import ROOFLINE_METHODS, machine_peaks, roofline_metrics
from kvbench.measure.timing import METHOD_CPU, METHOD_CUDA, sync
from kvbench.model import Decoder
from kvbench.multiturn import run_multiturn
from kvbench.results import RunResult
from kvbench.scenarios import greedy_generate, summarize_decode, time_decode

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# A scenario fills ``metrics`` in place as it measures, so a failure part-way keeps them.
Scenario = Callable[[BenchConfig, Decoder, torch.device, Dict[str, Any], RunResult], None]


def to_bench_config(cfg: DictConfig | BenchConfig) -> BenchConfig:
    """Typed, validated config (raises :class:`ConfigError` naming the bad key)."""
    return cfg if isinstance(cfg, BenchConfig) else OmegaConf.to_object(cfg)


def build_model(cfg: BenchConfig, device: torch.device) -> Decoder:
    """The decoder for ``cfg``, seeded so every variant of a sweep draws the same weights
    wherever their shapes agree; with ``model.path`` the checkpoint's weights, mean-pooled to
    ``attention.num_kv_heads`` when that differs from the checkpoint's own count."""
    dtype = DTYPES[cfg.runtime.dtype]
    if cfg.model.path:
        from kvbench.checkpoint import convert_kv_heads, load_llama_dir

        model, _ = load_llama_dir(cfg.model.path, torch.float32, device)
        if model.num_kv_heads != cfg.attention.num_kv_heads:
            model = convert_kv_heads(model, cfg.attention.num_kv_heads)
        return model.to(dtype).eval()
    torch.manual_seed(cfg.runtime.seed)
    with device:
        model = Decoder(cfg.model, cfg.attention)
    return model.to(dtype).eval()


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def run_decode(cfg: BenchConfig, model: Decoder, device: torch.device, metrics: Dict[str, Any],
               result: RunResult) -> None:
    """Prefill then ``gen_len`` decode steps, ``warmup`` + ``repeats`` times; latency and memory."""
    w, rt = cfg.workload, cfg.runtime
    seq_len = w.prompt_len + w.gen_len
    generator = torch.Generator().manual_seed(rt.seed)
    prompt = torch.randint(0, cfg.model.vocab_size, (w.batch_size, w.prompt_len), generator=generator)
    prompt = prompt.to(device)
    metrics["kv_cache_bytes_formula"] = kv_cache_bytes(
        cfg.model.num_layers, cfg.attention.num_kv_heads, cfg.model.head_dim, seq_len, w.batch_size,
        dtype_bytes(rt.dtype))
    cache = cache_for(model, cfg.cache.impl, w.batch_size, seq_len)
    eager = model
    if rt.compile:
        model = compile_model(model, device, prompt, cache, metrics)
    with progress_bar(f"{cfg.attention.type} kv={cfg.attention.num_kv_heads}", rt.warmup + rt.repeats) as tick, \
            MemoryMonitor(device, rt.nvml_interval_ms) as monitor:
        timings = time_decode(model, prompt, w.gen_len, cache, rt.warmup, rt.repeats, device, tick)
    metrics.update(monitor.result())
    metrics["kv_cache_bytes"] = cache.nbytes
    metrics.update(summarize_decode(timings, w.batch_size))
    result.series["decode_ms"] = timings.decode_ms[-1]
    peak, gflops, metrics["peak_method"] = machine_peaks(device, rt.peak_gb_per_s)
    metrics.update(roofline_metrics(model, w.batch_size, w.prompt_len, w.gen_len,
                                    metrics["decode_ms_p50"], peak, gflops))
    if rt.fidelity:
        metrics.update(fidelity(eager, prompt, w.gen_len, cfg.cache.impl, rt.dtype))


def fidelity(model: Decoder, prompt: torch.Tensor, gen_len: int, impl: str, dtype: str) -> Dict[str, Any]:
    """Quality of what was timed, on up to 2 sequences and 16 steps (cheap next to the trials):
    cached decode vs a full recompute, and for half precision vs float32 with the same weights."""
    from kvbench.quality import cache_fidelity, dtype_fidelity

    prompt, steps = prompt[:2], min(gen_len, 16)
    out = cache_fidelity(model, prompt, steps, impl)
    if dtype != "float32":
        out.update(dtype_fidelity(model, None, prompt, steps))
    return out


def compile_model(model: Decoder, device: torch.device, prompt: torch.Tensor, cache,
                  metrics: Dict[str, Any]) -> Decoder:
    """``torch.compile`` the decoder (dynamic shapes: the KV length grows every step) and run
    one short generation so compilation is done, and timed as ``compile_s``, before any trial."""
    import time

    compiled = torch.compile(model, dynamic=True)
    t0 = time.perf_counter()
    try:
        greedy_generate(compiled, prompt, 3, cache)
    except Exception as exc:  # noqa: BLE001 — inductor raises many types; the message is what matters
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"runtime.compile=True: torch.compile is unavailable here ({first})") from exc
    sync(device)
    metrics["compile_s"] = time.perf_counter() - t0
    cache.reset()
    return compiled


SCENARIOS: Dict[str, Scenario] = {"decode": run_decode, "multiturn": run_multiturn}


def run_training(cfg: BenchConfig, out_dir: Path, metrics: Dict[str, Any], result: RunResult) -> None:
    """``task=train``: the loss curve goes into the record as it is logged (so a failure keeps
    it), the final metrics at the end, the checkpoint into the job directory."""
    from kvbench.quality import run_train

    curve = result.tables.setdefault("curve", [])

    def on_log(step: int, point: Dict[str, float]) -> None:
        curve.append({"step": step, **point})
        result.series["train_step"] = [p["step"] for p in curve]
        result.series["train_loss"] = [p["train_loss"] for p in curve]

    metrics.update(run_train(cfg, out_dir, on_log))


def run_evaluation(cfg: BenchConfig, out_dir: Path, metrics: Dict[str, Any], result: RunResult) -> None:
    """``task=eval``: perplexity of ``train.checkpoint`` on ``data``."""
    from kvbench.quality import run_eval

    metrics.update(run_eval(cfg, out_dir))


QUALITY_TASKS = {"train": run_training, "eval": run_evaluation}


def run_job(cfg: DictConfig | BenchConfig, out_dir: Path | str,
            overrides: Optional[List[str]] = None) -> RunResult:
    """Run one job and write ``results.json`` into ``out_dir``; returns the record."""
    out_dir = Path(out_dir)
    raw = cfg if isinstance(cfg, BenchConfig) else OmegaConf.to_container(cfg, resolve=True)
    result = RunResult(status="ok", config=asdict(raw) if isinstance(raw, BenchConfig) else raw,
                       overrides=list(overrides or []), started_at=_now(),
                       env={"hostname": socket.gethostname()})  # even a job that fails early says where
    metrics: Dict[str, Any] = {}
    try:
        bench = to_bench_config(cfg)
        result.config = asdict(bench)  # with derived values (head_dim, num_kv_heads) filled in
        device = resolve_device(bench.runtime.device)
        result.env = collect_env(device)
        if bench.runtime.threads:
            torch.set_num_threads(bench.runtime.threads)
        if bench.task in QUALITY_TASKS:
            QUALITY_TASKS[bench.task](bench, out_dir, metrics, result)
        else:
            metrics["timing_method"] = METHOD_CUDA if device.type == "cuda" else METHOD_CPU
            model = build_model(bench, device)
            metrics["weight_bytes"] = weight_bytes(model)
            metrics["num_params"] = sum(p.numel() for p in model.parameters())
            SCENARIOS[bench.workload.name](bench, model, device, metrics, result)
    except ConfigError as exc:
        result.status, result.error = "invalid", str(exc)
    except Exception as exc:  # noqa: BLE001 — every failure becomes data, never a lost record
        result.status = "oom" if is_oom(exc) else "error"
        result.error = f"{type(exc).__name__}: {exc}"
        (out_dir / "error.txt").parent.mkdir(parents=True, exist_ok=True)
        (out_dir / "error.txt").write_text(traceback.format_exc())
    finally:
        result.metrics = metrics
        result.methods.update(MEMORY_METHODS)
        result.methods.update(ROOFLINE_METHODS)
        result.finished_at = _now()
        result.write(out_dir)
    return result


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
