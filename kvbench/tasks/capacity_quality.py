"""``task=capacity``'s quality figure, measured on a model of the variant's own layout or not at all.

The figure is the KL and top-1 agreement of the MHA model of the same weights (or of ``model.path``)
with its K/V heads mean-pooled to the variant's count (:func:`kvbench.quality.fidelity.kv_pool_fidelity`).
Pooling makes K/V heads and masks windows; it cannot make a recurrent state or a compressed cache of its own. So the
pooled model's layer layouts are compared with the variant's, layer by layer: where they differ, the
figure would be another model's under this one's label (issue 59: a Gated DeltaNet hybrid scored as
GQA-2, its figures identical to GQA-2's), and the record holds null with the reason instead.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from kvbench.checkpoint import convert_kv_heads, with_layer_pattern
from kvbench.config.bench import BenchConfig
from kvbench.config.model import AttentionConfig
from kvbench.layouts.base import Layouts
from kvbench.layouts.registry import kind_of
from kvbench.metrics import Metric, metric_table, record_methods
from kvbench.model import Decoder
from kvbench.quality.fidelity import KV_POOL_METRICS, kv_pool_fidelity
from kvbench.tasks.capacity_search import contexts
from kvbench.tasks.common import build_model

# the quality_source of a figure pooled from random weights, and of one pooled from a checkpoint
POOLED = "pooled: the MHA model of the same random weights, K/V heads mean-pooled, the variant's layer layouts"
NOT_UPTRAINED = ("pooled, not uptrained: the checkpoint's K/V heads mean-pooled (no training after), the variant's "
                 "layer layouts")

QUALITY_METRICS: Dict[str, Metric] = metric_table(
    *KV_POOL_METRICS.values(),
    Metric("quality_source", "text", "what kv_pool_kl_nats and kv_pool_top1_agreement were measured on: '" + POOLED
           + "' (no model.path), '" + NOT_UPTRAINED + "' (model.path); null when no figure was measured "
           "(quality_none_reason)"),
    Metric("quality_none_reason", "text", "why the record holds no pooled quality: a layer of the variant is not "
           "one pooling the MHA model's K/V heads can make (a recurrent state, a compressed cache), each such layer "
           "kind and the layers it holds named; a model of that layout measures it (task=train or task=recall "
           "jobs of the variant in the sweep, or task=eval of a checkpoint of it)"),
)
QUALITY_METHODS: Dict[str, str] = record_methods(QUALITY_METRICS)


def _named(layers: Dict[str, list]) -> str:
    return "; ".join(f"the variant's {kind} layers {', '.join(map(str, at))} are not what pooling the MHA model's "
                     "K/V heads makes" for kind, at in layers.items())


def _by_kind(variant: Sequence[Any], indices: Sequence[int], measured: Sequence[Any] = ()) -> Dict[str, list]:
    """The ``indices`` of ``variant``'s layers by kind title, each with the fields in which it differs
    from ``measured``'s layer where both are of one class (a window, learned sinks, a donor's cache)."""
    out: Dict[str, list] = {}
    for index in indices:
        kind = kind_of(variant[index])
        theirs = variant[index]
        ours = measured[index] if index < len(measured) else None
        where = ""
        if type(ours) is type(theirs) and is_dataclass(theirs):
            names = [f.name for f in fields(theirs) if getattr(ours, f.name) != getattr(theirs, f.name)]
            where = f" ({', '.join(names)})"
        out.setdefault(kind.title or kind.name, []).append(f"{index}{where}")
    return out


def layout_mismatch(measured: Sequence[Any], variant: Sequence[Any]) -> Optional[str]:
    """None when ``measured`` (the layer layouts of the model a figure came from) is ``variant``'s,
    layer by layer; else which of the variant's layers it is not, by kind, in one line."""
    if tuple(measured) == tuple(variant):
        return None
    if len(measured) != len(variant):
        return f"the pooled model has {len(measured)} layers, the variant {len(variant)}"
    return _named(_by_kind(variant, [i for i, (a, b) in enumerate(zip(measured, variant)) if a != b], measured))


def pooled_model(cfg: BenchConfig, device: torch.device) -> Tuple[Decoder, Decoder]:
    """(reference, pooled): the MHA model of the same weights (``model.path``'s, brought to MHA) and
    that model with its K/V heads mean-pooled to the variant's count and the variant's layer pattern,
    the model the figure is measured on."""
    h = cfg.model.num_heads
    reference = build_model(replace(cfg, attention=AttentionConfig.for_heads(h, h)), device)
    return reference, with_layer_pattern(convert_kv_heads(reference, cfg.attention.num_kv_heads),
                                         cfg.attention).eval()


def source(cfg: BenchConfig) -> str:
    """What a pooled figure of ``cfg``'s variant was measured on (its ``quality_source``)."""
    kv = cfg.attention.num_kv_heads
    if kv == cfg.model.num_heads:
        return "MHA itself (the reference)"
    if cfg.model.path:
        return "the checkpoint's own K/V heads" if kv == cfg.model.preset_kv_heads else NOT_UPTRAINED
    return POOLED


def variant_quality(cfg: BenchConfig, variant: Layouts, device: torch.device) -> Dict[str, Any]:
    """The pooled quality figures of ``cfg``'s variant (``variant``: its model's layer layouts) with
    their source, or null figures and the reason (:func:`layout_mismatch`)."""
    none = {"kv_pool_kl_nats": None, "kv_pool_top1_agreement": None, "quality_source": None}
    if not variant.converts_kv_heads():  # a layer whose cache is not K/V heads: nothing to pool
        refused = [i for i, layer in enumerate(variant) if not Layouts([layer]).converts_kv_heads()]
        return {**none, "quality_none_reason": _named(_by_kind(variant, refused))}
    reference, pooled = pooled_model(cfg, device)
    reason = layout_mismatch(pooled.layouts, variant)
    if reason is not None:
        return {**none, "quality_none_reason": reason}
    length = min(max(contexts(cfg)), 256)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, length),
                           generator=torch.Generator().manual_seed(cfg.runtime.seed)).to(device)
    return {**kv_pool_fidelity(reference, cfg.attention.num_kv_heads, tokens, cfg.attention, pooled=pooled),
            "quality_source": source(cfg)}
