"""The optional properties an attention layer may have beside its layout, declared once: learned
attention sinks (GPT-OSS), K/V shared across layers (Gemma 3n) and those a layer kind declares
(``LayerKind.options``: a top-k of the cached tokens).

Each is an ``attention.<key>`` field (null: the model's own) that is off at ``off`` (False, 0).
Everything that names them reads :data:`LAYER_OPTIONS`: a config's resolution (:func:`resolve_options`),
a variant's label and its view (``kvbench.sinks.views.Variant``), the record (kept only when on, so a record
without one reads as one written before it existed), and a checkpoint (asked other than its own:
refused). A new one is its layout module, its attention field (+ the model's preset field), its YAML
and an entry here (or in its kind's ``options``).
"""

from __future__ import annotations

from typing import Any, Dict

from kvbench.core.errors import check
from kvbench.layouts.kinds import LayerOption, registered

# In the order a variant's label names them (``gqa kv=8 w=128 1:1 sinks``, ``mla r=512 topk=2048``,
# ``gqa kv=2 w=512 4:1 kvshare=15``).
# Learned sinks and KV sharing are any layer layout's; a kind's own options (LayerKind.options) come between.
LAYER_OPTIONS = (
    LayerOption("sinks", " sinks", False, preset="preset_sinks",
                kv_heads_only="are a logit per query head of K/V-head attention; attention=mla has none"),
    *(option for kind in registered() for option in kind.options),
    LayerOption("kv_shared_layers", " kvshare={}", 0, preset="preset_kv_shared_layers"),
)
# Those a model sets by a preset field of its own: resolved, saved and compared one by one.
PRESET_OPTIONS = tuple(o for o in LAYER_OPTIONS if o.preset)


def resolve_options(attention: Any, model: Any, kv_heads: bool) -> Dict[str, Any]:
    """The :data:`PRESET_OPTIONS` of ``attention`` (an AttentionConfig) resolved against ``model``
    (a ModelConfig): each null one the model's own. Without ``kv_heads`` (MLA) an option only K/V-head
    layers have is refused when asked, and off otherwise (a K/V-head model's own does not carry over)."""
    out = {}
    for option in PRESET_OPTIONS:
        asked = getattr(attention, option.key)
        if not kv_heads and option.kv_heads_only:
            check(not asked, f"attention.{option.key}", asked, option.kv_heads_only)
            out[option.key] = option.off
        else:
            out[option.key] = getattr(model, option.preset) if asked is None else asked
    return out
