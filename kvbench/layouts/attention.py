"""Each kind of layer's attention module: a layout's kind names the module that runs it
(``LayerKind.module``, ``"package.module:Class"``), imported here when first asked for, so a new kind
needs no line in this module."""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from kvbench.layouts.base import LayerLayout
from kvbench.layouts.kinds import kind_of, resolve


def module_class(layout: LayerLayout) -> type:
    """The torch module class that runs ``layout``'s layer (its kind's ``module``); it declares the
    layer's transformers names (``HF_MODULE``, ``HF_NAMES``, ``HF_FUSED``)."""
    return resolve(kind_of(layout).module)


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
