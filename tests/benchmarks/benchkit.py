"""Shared set-up of the pytest-benchmark suite: small shapes, pinned threads, an optional
injected slowdown (the gate's self-test), and the config recorded in each report.

A plain module, not a ``conftest.py``: a second conftest would take the module name
``conftest`` that ``tests/*.py`` import helpers from. Test modules import the fixtures here.

Under the default ``python -m pytest`` (``--benchmark-disable`` in pyproject) every benchmark
body runs once as a plain test; ``scripts/bench_gate.py`` runs them timed.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict
from typing import Callable, Dict

import pytest
import torch
from kv_formula import kv_cache_bytes

from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.model import Decoder

# Shapes: a decode step attends over 128 cached positions (~0.5 ms on one core); a prefill or
# a cache-less step stays near 3.5 ms. Short calls keep a timed run to ~13 s, and calls much
# longer than the scheduler's time slice are the ones other users' jobs inflate most (wall
# median/min measured ~2.5x at 40 ms vs ~1.15x at 0.4 ms on 2 shared cores).
BATCH_SIZE = 2
PROMPT_LEN = 128
VARIANTS = {"mha": 8, "gqa": 2, "mqa": 1}  # attention.type -> num_kv_heads for 8 query heads

SLOWDOWN_ENV = "KVBENCH_BENCH_SLOWDOWN"
THREADS_ENV = "KVBENCH_BENCH_THREADS"


def bench_model_config(max_seq_len: int = 512) -> ModelConfig:
    """The decoder every benchmark times: 2 layers, d_model 128, 8 heads of 16 dims."""
    return ModelConfig(name="bench", num_layers=2, d_model=128, num_heads=8, preset_kv_heads=8,
                       ffn_dim=352, vocab_size=512, max_seq_len=max_seq_len)


def bench_decoder(variant: str, max_seq_len: int = 512, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    attention = AttentionConfig(type=variant, num_kv_heads=VARIANTS[variant])
    return Decoder(bench_model_config(max_seq_len), attention).eval()


ATOL = 1e-4  # float32, 2 layers: cached vs recomputed logits agree to ~1e-6


def formula_bytes(model, seq_len: int) -> int:
    c = model.config
    return kv_cache_bytes(c.num_layers, model.num_kv_heads, c.head_dim, seq_len, BATCH_SIZE, 4)


def prompt_for(model) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, model.config.vocab_size, (BATCH_SIZE, PROMPT_LEN), generator=gen)


@torch.inference_mode()
def recompute_last_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Reference: the whole sequence through the model without a cache, last position."""
    return model(tokens)[:, -1]


def record_config(benchmark, model: Decoder, **fields) -> Dict:
    """Write the model/attention config and the workload fields into ``extra_info`` so the
    JSON report says what was timed."""
    info = {"model": asdict(model.config), "attention": asdict(model.attention),
            "dtype": str(model.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), **fields}
    benchmark.extra_info.update(info)
    return info


def slowdown_fraction() -> float:
    raw = os.environ.get(SLOWDOWN_ENV, "0")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{SLOWDOWN_ENV}={raw!r}: must be a number >= 0 (0.4 = 40% slower)")
    return value


def spin(cpu_seconds: float) -> None:
    """Busy work until this process has used ``cpu_seconds`` more CPU time: real work that,
    like the step it lengthens, costs the same CPU time however loaded the machine is."""
    end = time.process_time() + cpu_seconds
    while time.process_time() < end:
        pass


def inject_slowdown(step: Callable, fraction: float, calibration_calls: int = 15) -> Callable:
    """``step`` made ``fraction`` slower: after each call, extra busy work lasting ``fraction``
    of the step's own CPU time (the median of ``calibration_calls`` untimed calls, the
    statistic the gate compares)."""
    if fraction == 0:
        return step
    times = []
    for _ in range(calibration_calls):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    extra = fraction * statistics.median(times)

    def slowed():
        out = step()
        spin(extra)
        return out

    return slowed


@pytest.fixture
def slowdown():
    """The injected-slowdown wrapper for decode steps, read from ``KVBENCH_BENCH_SLOWDOWN``."""
    fraction = slowdown_fraction()
    return lambda step: inject_slowdown(step, fraction)


def bench_threads() -> int:
    raw = os.environ.get(THREADS_ENV, "1")
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{THREADS_ENV}={raw!r}: must be an integer >= 1")
    return int(raw)


@pytest.fixture(autouse=True)
def pinned_threads():
    # One intra-op thread by default: on a shared machine a second thread competes with other
    # users' jobs and turns timings bimodal; the gate compares like with like either way.
    before = torch.get_num_threads()
    torch.set_num_threads(bench_threads())
    yield
    torch.set_num_threads(before)
