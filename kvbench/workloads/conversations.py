"""The conversation workload (``workload=conversations``): multi-turn chats served as
``workload=serving`` serves requests, each turn a request whose prompt is the whole history and a
new message, sent a think time after the previous answer. The record adds per-turn figures: cached
against evicted histories (:mod:`kvbench.serving.turn_metrics`).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from kvbench.config.bench import BenchConfig
from kvbench.metrics import Metric, metric_table, record_methods
from kvbench.results import RunResult
from kvbench.serving import turn_metrics
from kvbench.serving.record import timeline_from_record
from kvbench.serving.tokenize import tokenizer_name
from kvbench.workloads import serving

METRICS: Dict[str, Metric] = metric_table(
    *serving.METRICS.values(), *turn_metrics.METRICS.values(),
    Metric("sharegpt_tokenizer", "text", "with workload.sharegpt: how its text became tokens, the checkpoint's "
                                         "tokenizer.json (model.path, transformers' AutoTokenizer) or UTF-8 bytes"))
METHODS: Dict[str, str] = record_methods(METRICS)
RECORDED = METRICS  # what a record may hold


def run(cfg: BenchConfig, model, device: torch.device, result: RunResult,
        tick: Optional[serving.Tick] = None) -> None:
    """Serve the conversations, then add the per-turn figures from the timeline the record holds."""
    serving.run(cfg, model, device, result, tick)
    result.methods.update(METHODS)
    timeline = timeline_from_record(result.tables, result.metrics)
    # the recurrent kinds' names (Gated DeltaNet, KDA ...), empty without such a layer
    recurrent = " and ".join(dict.fromkeys(layer.title for layer in model.layouts if layer.state is not None))
    result.tables["conversation_turns"] = turn_metrics.turn_rows(timeline, recurrent)
    result.metrics.update(turn_metrics.conversation_metrics(timeline, recurrent))
    if cfg.workload.sharegpt is not None:
        result.metrics["sharegpt_tokenizer"] = tokenizer_name(cfg.model.path)
