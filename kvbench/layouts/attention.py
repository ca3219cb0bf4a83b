"""Each kind of layer's attention module: the one table from a layout to the module that runs it."""

from __future__ import annotations

import importlib
from contextlib import contextmanager

from torch import nn

from kvbench.layouts.base import LayerLayout
from kvbench.layouts.gated_deltanet import GatedDeltaNet
from kvbench.layouts.gated_deltanet_attention import GatedDeltaNetAttention
from kvbench.layouts.kinds import kind_of
from kvbench.layouts.kv_heads import KVHeads
from kvbench.layouts.kv_heads_attention import KVHeadsAttention
from kvbench.layouts.latent import Latent
from kvbench.layouts.latent_attention import LatentAttention

MODULES = {KVHeads: KVHeadsAttention, Latent: LatentAttention, GatedDeltaNet: GatedDeltaNetAttention}


def module_class(layout: LayerLayout) -> type:
    """The torch module class that runs ``layout``'s layers: :data:`MODULES`', else its registered
    kind's ``module`` (``"package.module:Class"``, imported here, above every torch layer)."""
    cls = MODULES.get(type(layout))
    if cls is None:
        where, name = kind_of(layout).module.split(":")
        cls = MODULES[type(layout)] = getattr(importlib.import_module(where), name)
    return cls


def attention_module(model, layout: LayerLayout) -> nn.Module:
    """The attention module of ``layout``'s layer in ``model`` (a ModelConfig)."""
    return module_class(layout)(model, layout)


@contextmanager
def decode_form(model, form: str):
    """Decode steps of ``model``'s layers that have two forms of the same arithmetic
    (``LayerLayout.decode_forms``: MLA's absorbed | expanded) in ``form`` inside the block."""
    layers = [block.attn for block, layout in zip(model.blocks, model.layouts) if form in layout.decode_forms]
    before = [attn.form for attn in layers]
    for attn in layers:
        attn.form = form
    try:
        yield model
    finally:
        for attn, was in zip(layers, before):
            attn.form = was
