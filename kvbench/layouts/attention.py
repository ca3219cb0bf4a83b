"""Each kind of layer's attention module: the one table from a layout to the module that runs it."""

from __future__ import annotations

from torch import nn

from kvbench.layouts.base import LayerLayout
from kvbench.layouts.gated_deltanet import GatedDeltaNet
from kvbench.layouts.gated_deltanet_attention import GatedDeltaNetAttention
from kvbench.layouts.kv_heads import KVHeads
from kvbench.layouts.kv_heads_attention import KVHeadsAttention
from kvbench.layouts.latent import Latent
from kvbench.layouts.latent_attention import LatentAttention

MODULES = {KVHeads: KVHeadsAttention, Latent: LatentAttention, GatedDeltaNet: GatedDeltaNetAttention}


def attention_module(model, layout: LayerLayout) -> nn.Module:
    """The attention module of ``layout``'s layer in ``model`` (a ModelConfig)."""
    return MODULES[type(layout)](model, layout)
