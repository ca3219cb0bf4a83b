"""``task=bench``: the workload ``workload.name`` (kvbench/workloads/) on the decoder."""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import torch

from kvbench.checkpoint import kv_conversion
from kvbench.config.bench import BenchConfig
from kvbench.config.serving import ServingWorkload
from kvbench.measure.timing import timing_method
from kvbench.metrics import Metric
from kvbench.parallel.tensor import RANK_METRICS
from kvbench.progress import Progress
from kvbench.results import RunResult
from kvbench.tasks.common import JOB_METHODS, JOB_METRICS, build_model, job_variant_label, weight_metrics
from kvbench.workloads import conversations, decode, multiturn, serving

# Each workload's config is kvbench.config.workload.WORKLOADS.
WORKLOADS = {"decode": decode, "multiturn": multiturn, "serving": serving, "conversations": conversations}


def metrics(workload: str = "decode") -> Dict[str, Metric]:
    """Every metric a task=bench job of ``workload`` may record."""
    return {**JOB_METRICS, **(WORKLOADS[workload].RECORDED if workload in WORKLOADS else {}),
            **(RANK_METRICS if workload == "decode" else {})}  # runtime.tensor_parallel > 1


def run(cfg: BenchConfig, device: torch.device, out_dir: Path, result: RunResult, progress: Progress) -> None:
    """``task=bench``: the workload ``cfg.workload.name`` on the decoder."""
    result.metrics["timing_method"] = timing_method(device)
    result.methods.update(JOB_METHODS)
    # serving: its requests and KV budget, checked before the model is built or progress shown
    requests = serving.check_requests(cfg) if isinstance(cfg.workload, ServingWorkload) else None
    model = build_model(cfg, device)
    result.metrics.update(weight_metrics(model))
    if cfg.model.path:
        result.metrics["kv_heads_conversion"] = (kv_conversion(cfg.model.preset_kv_heads, cfg.attention.num_kv_heads)
                                                 if model.layouts.converts_kv_heads() else "none")
    label = job_variant_label(cfg)
    if cfg.workload.name == "multiturn":
        label += f" shared={cfg.cache.shared}"
    if requests is not None:
        w = cfg.workload
        label += (f" {w.store} {'trace' if w.arrival == 'trace' else f'rate={w.rate:g}'}"
                  f"{serving.arrival_note(requests)}")
    # serving: one tick per finished request; the others one per trial
    total = (serving.progress_total(cfg, requests) if requests is not None
             else cfg.runtime.warmup + cfg.runtime.repeats)
    with progress(label, total) as tick:
        WORKLOADS[cfg.workload.name].run(cfg, model, device, result, tick)
