"""What every task shares: the progress callback it is handed, the decoder it builds and the
fields every model-running job records."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from kvbench.checkpoint import kv_conversion, load_llama_dir, to_layout
from kvbench.config.bench import TASKS, BenchConfig
from kvbench.config.conversion import kv_layout_change, own_kind
from kvbench.config.layer_pattern import job_variant_label, variant_label  # noqa: F401 (re-exported)
from kvbench.layouts.build import build_layouts
from kvbench.measure.memory import MEMORY_METRICS, weight_bytes
from kvbench.metrics import Metric, metric_table, record_methods
from kvbench.model import Decoder, torch_dtype
from kvbench.parallel.tensor import current as current_ranks
from kvbench.parallel.tensor import shard_decoder
from kvbench.quant_weights import checkpoint_bytes

JOB_METRICS: Dict[str, Metric] = metric_table(
    Metric("peak_rss_reason", "text",
           "only when peak_rss_bytes is null: why (runtime.isolate=false, and an earlier job ran "
                       "in the same process, whose peak would count as this job's)"),
    Metric("weight_bytes", "bytes", "parameters and persistent buffers (numel * element_size), tied tensors once"),
    Metric("num_params", "count", "parameters of the decoder, tied tensors once"),
    Metric("weight_bytes_stored", "bytes", "model.weights_stored only: weight_bytes as the checkpoint stores them (FP8 "
                                           "a byte per weight + block scales, MXFP4/NVFP4 half a byte + scales), what "
                                           "an engine reading that format holds; kvbench holds the dequantized "
                                           "weight_bytes"),
    Metric("timing_method", "text", "cuda_events (synchronised once after the trial) on CUDA, perf_counter on CPU"),
    Metric("kv_heads_conversion", "text", "model.path only: none | repeat | mean-pool, how the checkpoint's KV heads "
                           "(model.preset_kv_heads) were brought to attention.num_kv_heads (repeat is exact)"),
    *MEMORY_METRICS.values(),
)
JOB_METHODS: Dict[str, str] = record_methods(JOB_METRICS)


def build_model(cfg: BenchConfig, device: torch.device) -> Decoder:
    """The decoder for ``cfg``, seeded so every variant of a sweep draws the same weights wherever
    their shapes agree; with ``model.path`` the checkpoint's weights brought to the asked layout."""
    dtype = torch_dtype(cfg.runtime.dtype)
    if cfg.model.path:
        model, _ = load_llama_dir(cfg.model.path, torch.float32, device)
        model, _ = to_layout(model, cfg.attention)
        return _rank_part(model.hold_states_in(cfg.cache.state_dtype).to(dtype).eval())
    torch.manual_seed(cfg.runtime.seed)
    with device:
        model = Decoder(cfg.model, cfg.attention, cfg.cache.state_dtype)
    return _rank_part(model.to(dtype).eval())


def _rank_part(model: Decoder) -> Decoder:
    """This rank's part of ``model`` where the job runs as tensor-parallel ranks (kvbench.parallel): every
    rank builds the whole from the same seed, then keeps its part."""
    group = current_ranks()
    return model if group is None else shard_decoder(model, group.ranks, group.rank, group.expert_parallel, group)


def job_kv_conversion(cfg: BenchConfig) -> Optional[Dict[str, Any]]:
    """The record's ``kv_conversion``: null for the model's own layout, and for a task whose record
    keeps no attention (task=compare) or whose shape is its checkpoint's (task=eval says it later)."""
    task = TASKS[cfg.task]
    if task.own_shape or "attention" not in task.reads:
        return None
    if cfg.task == "train" and cfg.train.init_from:
        return None  # the checkpoint's count is known once it is loaded (tasks/train.py)
    method = "random-init"
    # a checkpoint's K/V heads are repeated or mean-pooled only where both layouts hold K/V heads
    if cfg.model.path and own_kind(cfg.model) is None and build_layouts(cfg.model, cfg.attention).converts_kv_heads():
        method = kv_conversion(cfg.model.preset_kv_heads, cfg.attention.num_kv_heads)
    return kv_layout_change(cfg.model, cfg.attention, method)


def weight_metrics(model: Decoder) -> Dict[str, Any]:
    """What a job records of its model's weights: weight_bytes, num_params, and for a quantized checkpoint
    (model.weights_stored) weight_bytes_stored."""
    stored = model.config.weights_stored
    return {"weight_bytes": weight_bytes(model), "num_params": model.num_params(),
            **({"weight_bytes_stored": checkpoint_bytes(model, stored)} if stored else {})}
