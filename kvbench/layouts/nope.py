"""Layers without rotary embeddings (NoPE, ``model.nope.layers``: Llama 4's global layers): their layout
rotates none of a head (``rotary`` 0), so their attention skips rotary embeddings and, with
``model.nope.temperature_tuning``, scales each query by its position's temperature instead
(:mod:`kvbench.layouts.nope_attention`). What they cache and read is a K/V-head layer's."""

from __future__ import annotations

from dataclasses import replace
from typing import List, Sequence

from kvbench.core.errors import check
from kvbench.layouts.base import LayerLayout


def without_rope(layers: Sequence[LayerLayout], model) -> Sequence[LayerLayout]:
    """``layers`` with those ``model.nope.layers`` names rotating nothing (layers of one layout share
    one NoPE layout); ``layers`` itself when there are none."""
    if model.nope is None or not model.nope.layers:
        return layers
    out: List[LayerLayout] = list(layers)
    made = {}
    for i in model.nope.layers:
        layer = out[i]
        check(hasattr(layer, "rotary"), "model.nope.layers", model.nope.layers,
              f"names layer {i}, a {layer.kind} layer; a layer without rotary embeddings is a K/V-head layer")
        out[i] = made.setdefault(id(layer), replace(layer, rotary=0))
    return out
