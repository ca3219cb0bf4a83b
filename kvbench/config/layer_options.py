"""The optional properties an attention layer may have beside its layout, declared once: learned
attention sinks (GPT-OSS), DSA's top-k (DeepSeek-V3.2) and K/V shared across layers (Gemma 3n).

Each is an ``attention.<key>`` field (null: the model's own) that is off at ``off`` (False, 0).
Everything that names them reads :data:`LAYER_OPTIONS`: a config's resolution (:func:`resolve_options`),
a variant's label and its view (``kvbench.views.Variant``), the record (kept only when on, so a record
without one reads as one written before it existed), and a checkpoint (asked other than its own:
refused). A new one is its layout module, its attention field (+ the model's preset field), its YAML
and an entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from kvbench.config.errors import check
from kvbench.jsonio import as_int


@dataclass(frozen=True)
class LayerOption:
    """One optional layer property. ``key``: its AttentionConfig field (``attention.<key>``);
    ``label``: its part of a variant's label, formatted with the value (``" topk={}"``); ``off``: the
    value that means none, of the option's type (bool or int); ``preset``: the ModelConfig field
    holding the model's own (None: it is part of a layout's shape, resolved and compared with it,
    as DSA's top-k is with MLA's indexer fields); ``kv_heads_only``: why a layer without K/V heads
    (attention=mla) cannot have it, its error when asked there (None: any layer may have it);
    ``every_position``: why it is not built where a layer keeps only its last positions (None: it is)."""

    key: str
    label: str
    off: Any
    preset: Optional[str] = None
    kv_heads_only: Optional[str] = None
    every_position: Optional[str] = None

    def on(self, value: Any) -> Any:
        """``value`` when it is of this option's type and on, else None (a record's value as a
        variant reads it: anything else there is not this option)."""
        if type(self.off) is bool:
            return value if value is True else None
        is_int = as_int(value) is not None
        return value if is_int and value != self.off else None

    def own(self, value: Any) -> Any:
        """A resolved layer's ``value`` as the model's preset field holds it (null: off)."""
        return type(self.off)(value or self.off)

    def part(self, value: Any) -> str:
        """This option's part of a variant's label: empty when ``value`` is off (or null)."""
        return self.label.format(value) if value else ""


# In the order a variant's label names them (``gqa kv=8 w=128 1:1 sinks``, ``mla r=512 topk=2048``,
# ``gqa kv=2 w=512 4:1 kvshare=15``).
LAYER_OPTIONS = (
    LayerOption("sinks", " sinks", False, preset="preset_sinks",
                kv_heads_only="are a logit per query head of K/V-head attention; attention=mla has none"),
    LayerOption("index_topk", " topk={}", 0,  # its model's own: model.preset_mla (kvbench.config.indexer)
                every_position="selects among every cached token"),
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
