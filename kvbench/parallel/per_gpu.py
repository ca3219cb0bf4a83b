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
from kvbench.metrics import Metric
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
