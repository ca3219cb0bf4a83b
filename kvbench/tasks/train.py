"""``task=train``: a decoder trained on ``data`` (kvbench/quality/train.py), its loss curve and checkpoint."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Dict

import torch

from kvbench.config.bench import BenchConfig
from kvbench.config.conversion import kv_layout_change
from kvbench.metrics import Metric
from kvbench.progress import Progress
from kvbench.quality.train import TRAIN_METHODS, TRAIN_METRICS, run_train
from kvbench.results import RunResult

METRICS = TRAIN_METRICS

def metrics(workload: str = "decode") -> Dict[str, Metric]:
    """Every metric a job of this task may record."""
    return METRICS



def run(cfg: BenchConfig, device: torch.device, out_dir: Path, result: RunResult, progress: Progress) -> None:
    """``task=train``: the loss curve goes into the record as it is logged, so a failure keeps it."""
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
