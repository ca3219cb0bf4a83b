"""Every registered layer kind: importing this module imports each kind's home, which registers it
(:mod:`kvbench.layouts.registry`). A new kind is its home plus one line here, in the order every list
of them shows (the attention layers' kinds, then the recurrent ones)."""

from __future__ import annotations

from kvbench.layouts import global_heads, kv_heads, latent  # noqa: F401  (each registers its kind)

# isort: split
from kvbench.layouts import compressed  # noqa: F401  (DeepSeek-V4's, after the K/V-head and latent kinds)
from kvbench.layouts.registry import (
    LayerKind,
    LayerOption,
    attention_kind,
    by_architecture,
    by_layer_type,
    hf_renaming,
    kind_of,
    layer_kind,
    layer_types,
    named_layer_types,
    recurrent_in,
    recurrent_layer_types,
    registered,
    resolve,
)

# isort: split
from kvbench.layouts import gated_deltanet, kda, mamba2  # noqa: F401  (the recurrent kinds)

__all__ = ["LayerKind", "LayerOption", "attention_kind", "by_architecture", "by_layer_type", "hf_renaming", "kind_of",
           "layer_kind", "layer_types", "named_layer_types", "recurrent_in", "recurrent_layer_types", "registered",
           "resolve"]
