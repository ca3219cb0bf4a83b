"""The record's ``kv_conversion``: what a run measures of a named model's attention, beside the
model's own (its KV-head count, or its own shape of another kind, ``LayerKind.preset``)."""

from __future__ import annotations

from typing import Any, Dict, Optional

from kvbench.config.model import AttentionConfig, ModelConfig, attention_type
from kvbench.layouts.kinds import LayerKind, attention_kind, registered

_CONVERSION_WORDS = {"repeat": "its K/V heads repeated (exact)",
                     "mean-pool": "its K/V heads mean-pooled per group (an approximation of the model)",
                     "random-init": "random weights drawn in the asked layout",
                     "shape": "the arithmetic of the asked layout, not of the published model"}


def own_kind(model: ModelConfig) -> Optional[LayerKind]:
    """The kind whose own shape ``model`` holds (None: K/V heads, told by ``preset_kv_heads``)."""
    return next((kind for kind in registered() if kind.preset and getattr(model, kind.preset) is not None), None)


def _in_words(kind: LayerKind, attention: AttentionConfig) -> str:
    """A kind's attention in words, sized by its first compare letter's field (``kv_lora_rank 512``)."""
    key = next(iter(kind.letters.values()), None)
    return f"{kind.title} ({key} {getattr(attention, key)})" if key else kind.title


def kv_layout_change(model: ModelConfig, attention: AttentionConfig, method: str) -> Optional[Dict[str, Any]]:
    """The record's ``kv_conversion``: null when the run measures the model's own KV-head count
    (``model.preset_kv_heads``) or its own shape of another kind, else ``{from_kv_heads, to_kv_heads,
    method, text}``; ``method`` says what was done to the weights (``repeat`` exact, ``mean-pool``
    approximate, ``random-init`` a preset's shape drawn with random weights in the asked layout,
    ``shape`` task=inspect's arithmetic)."""
    own, asked_kind = own_kind(model), attention_kind(attention.type)
    if own is not None or (asked_kind is not None and asked_kind.preset):  # not a KV-head count
        if own is asked_kind:
            return None
        held = own.title if own is not None else f"{model.preset_kv_heads} KV heads"
        measured = (_in_words(asked_kind, attention) if asked_kind is not None and asked_kind.preset
                    else f"{attention.num_kv_heads} KV heads ({attention.type})")
        text = (f"attention converted: model {model.name} has {held}; this run measures {measured}, "
                f"{_CONVERSION_WORDS.get(method, method)}")
        return {"from_kv_heads": model.preset_kv_heads, "to_kv_heads": attention.num_kv_heads, "method": method,
                "text": text}
    old, new = model.preset_kv_heads, attention.num_kv_heads
    if new is None or old == new:
        return None
    text = (f"attention converted: model {model.name} has {old} KV heads "
            f"({attention_type(model.num_heads, old)}); this run measures {new} "
            f"({attention_type(model.num_heads, new)}), {_CONVERSION_WORDS.get(method, method)}")
    return {"from_kv_heads": old, "to_kv_heads": new, "method": method, "text": text}
