"""``task=eval``: perplexity of a checkpoint on ``data`` (kvbench/quality/train.py)."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Dict

import torch

from kvbench.config.bench import BenchConfig
from kvbench.config.conversion import kv_layout_change
from kvbench.config.record import attention_record, model_record
from kvbench.metrics import Metric
from kvbench.progress import Progress
from kvbench.quality.train import EVAL_METHODS, EVAL_METRICS, checkpoint_for_eval, run_eval
from kvbench.results import RunResult

METRICS = EVAL_METRICS

def metrics(workload: str = "decode") -> Dict[str, Metric]:
    """Every metric a job of this task may record."""
    return METRICS



def run(cfg: BenchConfig, device: torch.device, out_dir: Path, result: RunResult, progress: Progress) -> None:
    """``task=eval``: perplexity of ``train.checkpoint`` on ``data``; the record's model and
    attention are the checkpoint's shape as evaluated, not the preset's."""
    result.methods.update(EVAL_METHODS)
    loaded = checkpoint_for_eval(cfg, device)
    result.config["model"] = model_record(asdict(loaded[0].config))
    result.config["attention"] = attention_record(asdict(loaded[0].attention))
    result.metrics.update(run_eval(cfg, device, loaded))
    saved, how = loaded[2]["checkpoint_num_kv_heads"], loaded[2]["kv_heads_conversion"]
    own = replace(loaded[0].config, preset_kv_heads=saved)  # the checkpoint's own count
    result.kv_conversion = kv_layout_change(own, loaded[0].attention, how)
