"""``task=bench``: the workload ``workload.name`` (kvbench/workloads/) on the decoder."""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import torch

from kvbench.checkpoint import kv_conversion
from kvbench.config import BenchConfig
from kvbench.measure.memory import weight_bytes
from kvbench.measure.timing import timing_method
from kvbench.results import RunResult
from kvbench.tasks.common import JOB_METHODS, Progress, build_model
from kvbench.workloads import decode, multiturn

WORKLOADS = {"decode": decode.run, "multiturn": multiturn.run}
# A chat's turn{k}_ttft_ms, one per turn, is declared as it is measured: here as a pattern.
WORKLOAD_METHODS = {"decode": decode.METHODS,
                    "multiturn": {**multiturn.METHODS, "turn<k>_ttft_ms": multiturn.TURN_TTFT_METHOD}}


def methods(workload: str = "decode") -> Dict[str, str]:
    """Every metric a task=bench job of ``workload`` may record -> its unit and method."""
    return {**JOB_METHODS, **WORKLOAD_METHODS.get(workload, {})}


def run(cfg: BenchConfig, device: torch.device, out_dir: Path, result: RunResult, progress: Progress) -> None:
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
