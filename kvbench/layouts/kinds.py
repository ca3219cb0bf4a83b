"""Every registered layer kind: importing this module imports each kind's home, which registers it
(:mod:`kvbench.layouts.registry`). A new kind is its home plus one line here."""

from __future__ import annotations

# each registers its kind, in the order every list of them shows: attention layers, then recurrent ones
from kvbench.layouts import kv_heads, latent  # noqa: F401

# isort: split
from kvbench.layouts import gated_deltanet  # noqa: F401
from kvbench.layouts.registry import (
                                      LayerKind,
                                      LayerOption,
                                      attention_kind,
                                      by_layer_type,
                                      kind_of,
                                      layer_kind,
                                      layer_types,
                                      recurrent_in,
                                      recurrent_layer_types,
                                      registered,
                                      resolve,
)

__all__ = ["LayerKind", "LayerOption", "attention_kind", "by_layer_type", "kind_of", "layer_kind", "layer_types",
           "recurrent_in", "recurrent_layer_types", "registered", "resolve"]
