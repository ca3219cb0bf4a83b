"""Every registered layer kind: importing this module imports each kind's home, which registers it
(:mod:`kvbench.layouts.registry`). A new kind is its home plus one line here."""

from __future__ import annotations

from kvbench.layouts import gated_deltanet, kv_heads, latent, mamba2  # noqa: F401  (each registers its kind)
from kvbench.layouts.registry import LayerKind, by_layer_type, kind_of, recurrent_layer_types, registered

__all__ = ["LayerKind", "by_layer_type", "kind_of", "recurrent_layer_types", "registered"]
