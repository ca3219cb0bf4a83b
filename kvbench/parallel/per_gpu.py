"""Capacity per GPU: for each split of a node (:func:`~kvbench.parallel.plan.node_splits`), what one
rank holds of a sequence's cache and of the weights, the replication, and the sequences that fit per
GPU and per node (:func:`~kvbench.parallel.plan.per_gpu`). The KV figures are the layouts' formula
cut as each layer cuts (:func:`~kvbench.parallel.plan.rank_kv`); the weights those of the decoder cut as
the ranks run it (:func:`~kvbench.parallel.tensor.rank_weight_bytes`, on the meta device: no memory), as the
checkpoint stores them where it is quantized (``model.weights_stored``). Activations are left out.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from kvbench.core.dtypes import DTYPE_BYTES
from kvbench.layouts.base import Layouts
from kvbench.layouts.build import build_layouts
from kvbench.metrics import Metric, metric_table
from kvbench.model import Decoder, torch_dtype
from kvbench.parallel.plan import Split, node_splits, per_gpu, rank_kv
from kvbench.parallel.tensor import rank_weight_bytes
from kvbench.units import human_bytes

TABLE = Metric("tables.per_gpu", "", "per split of a node of capacity.gpus_per_node GPUs (TP: tensor-parallel ranks "
               "per copy of the model, DP: copies, EP: ranks the routed experts are split over by expert) and "
               "context: kv_bytes_per_token_rank and kv_bytes_per_sequence_rank (the layouts' formula, each "
               "layer's part as it cuts: heads split, a layout of fewer heads than ranks replicated), "
               "kv_replication (what the TP ranks hold together over one copy's), weight_bytes_rank (the decoder "
               "cut as the ranks run it, on the meta device; a quantized checkpoint's as stored), kv_budget_bytes_gpu "
               "(the budget less those weights; activations left out), sequences_per_node (budget // per-rank "
               "sequence bytes, times the node's TP groups) and sequences_per_gpu (that over the node's GPUs)")


# A job's own split (runtime.tensor_parallel / expert_parallel) where it gives figures, not ranks: task=capacity
# (experiment=choose's table) and workload=serving record them (kvbench.parallel.plan.FIGURE_TASKS)
SPLIT_METRICS: Dict[str, Metric] = metric_table(
    Metric("gpu_split", "text", "runtime.tensor_parallel and runtime.expert_parallel as a split of GPUs (TP=8, TP=8 "
                                "EP=8): the figures below are one GPU's under it, by formula (kvbench/parallel/)"),
    Metric("kv_bytes_per_token_gpu", "bytes", "one GPU's part of what a token of a sequence adds to the cache: each "
                                              "layer's part as its layout cuts it over the TP ranks (heads split, a "
                                              "layout of fewer heads than ranks replicated)"),
    Metric("kv_sequence_bytes_gpu", "bytes", "one GPU's part of a sequence at the context its other capacity figures "
                                             "are at (task=capacity: the longest; serving: kv_sequence_positions)"),
    Metric("kv_replication_gpus", "ratio", "what the TP ranks hold of a sequence together over one copy's (1: the "
                                           "heads split evenly; TP for a layout of one cached head)"),
    Metric("weight_bytes_gpu", "bytes", "one GPU's weights under the split: heads, widths, experts and vocabulary "
                                        "cut as the ranks run them (on the meta device), as the checkpoint stores "
                                        "them"),
    Metric("sequences_per_gpu", "count", "sequences at that context a GPU holds its part of: task=capacity, the "
                                         "memory budget less weight_bytes_gpu; serving, its KV budget (as each "
                                         "GPU's); // kv_sequence_bytes_gpu, over the TP group's GPUs"),
)


def split_metrics(model: Any, attention: Any, split: Split, dtype: str, cache_dtype: str, context: int,
                  gpu_bytes: int, less_weights: bool) -> Dict[str, Any]:
    """:data:`SPLIT_METRICS` of ``split`` at ``context``: ``gpu_bytes`` a GPU's budget, its weights taken off it
    where ``less_weights`` (a memory budget; a KV budget is KV's alone)."""
    kv = rank_kv(build_layouts(model, attention), split.tp, context, DTYPE_BYTES[dtype], cache_dtype)
    weights = rank_weights(model, attention, split, dtype)
    row = per_gpu(kv, split, weights if less_weights else 0, gpu_bytes, split.gpus)
    return {"gpu_split": split.name(), "kv_bytes_per_token_gpu": kv.per_token, "kv_sequence_bytes_gpu": kv.per_sequence,
            "kv_replication_gpus": kv.replication, "weight_bytes_gpu": weights,
            "sequences_per_gpu": row["sequences_per_gpu"]}


def job_split_metrics(job: Any, context: int, gpu_bytes: int, less_weights: bool) -> Dict[str, Any]:
    """:func:`split_metrics` of a job's (a BenchConfig's) own split, runtime.tensor_parallel ranks with the experts
    over runtime.expert_parallel; none where it runs on one GPU."""
    rt = job.runtime
    if rt.tensor_parallel == 1 and rt.expert_parallel == 1:
        return {}
    return split_metrics(job.model, job.attention, Split(rt.tensor_parallel, 1, rt.expert_parallel), rt.dtype,
                         job.cache.dtype, context, gpu_bytes, less_weights)


def rank_weights(model: Any, attention: Any, split: Split, dtype: str) -> int:
    """Bytes of weights one rank of ``split`` holds of ``model`` (a ModelConfig) under ``attention``."""
    with torch.device("meta"):
        decoder = Decoder(model, attention).to(torch_dtype(dtype))
    return rank_weight_bytes(decoder, split, model.weights_stored)


def per_gpu_table(model: Any, attention: Any, dtype: str, cache_dtype: str, seq_lens: Sequence[int],
                  gpu_bytes: int, gpus_per_node: int, splits: Optional[List[Split]] = None) -> List[Dict[str, Any]]:
    """One row per split (default: :func:`node_splits`) and length of ``seq_lens``."""
    layouts = build_layouts(model, attention)
    rows = []
    for split in splits if splits is not None else node_splits(model, layouts, gpus_per_node):
        weights = rank_weights(model, attention, split, dtype)
        for seq_len in seq_lens:
            kv = rank_kv(layouts, split.tp, seq_len, DTYPE_BYTES[dtype], cache_dtype)
            rows.append({"context": seq_len, **per_gpu(kv, split, weights, gpu_bytes, gpus_per_node)})
    return rows


def split_lines(model: Any, attention: Any, layouts: Layouts, split: Split, dtype: str, cache_dtype: str,
                seq_len: int) -> List[str]:
    """What task=inspect prints of a job's ``runtime.tensor_parallel`` / ``expert_parallel`` split: one rank's
    KV bytes per token and per sequence of ``seq_len`` (the per-GPU formula), the replication and which
    layers make it (a layer of fewer heads than ranks, each held by several), and one rank's weights."""
    kv = rank_kv(layouts, split.tp, seq_len, DTYPE_BYTES[dtype], cache_dtype)
    weights = rank_weights(model, attention, split, dtype)
    cuts = []
    for _, layer, n in layouts.distinct:
        parts = layer.tensor_parts(split.tp)
        how = f"split {parts} ways" if parts == split.tp else \
            f"{parts} part{'s' * (parts > 1)}, each on {split.tp // parts} ranks (replicated)"
        cuts.append(f"{n} x {layer.in_words() or layer.kind}: {how}")
    return [f"per GPU under {split.name()} (runtime.tensor_parallel={split.tp}, runtime.expert_parallel={split.ep}): "
            f"KV {kv.per_token:,.0f} B per token a GPU, {human_bytes(kv.per_sequence)} ({kv.per_sequence:,.0f} B) per "
            f"sequence of {seq_len}; replication {kv.replication:.3g}x (what the {split.tp} ranks hold of a sequence "
            f"together over one copy's); weights {human_bytes(weights)} a GPU ({dtype}; heads, widths, experts and "
            f"the vocabulary split); by layer: {'; '.join(cuts)}"]
