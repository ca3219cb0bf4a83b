"""Cross-layer KV sharing (Gemma 3n, Gemma 4's E-models: ``attention.kv_shared_layers``): the last
N layers compute queries only and attend the keys and values of an earlier layer of the same kind.

Transformers' rule (``Gemma3nTextConfig.kv_sharing_modes``): layers L - N .. L - 1 share; each
reads the last layer before L - N of its own kind (here: the same layout kind and window, so a
shared local layer reads a local layer's ring of W). A shared layer stores nothing, and a decode
step reads its donor's cache a second time (:class:`kvbench.shared_kv.SharedLayer`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from kvbench.config.errors import ConfigError
from kvbench.layouts.base import LayerLayout


def kv_donor(layers: Sequence[LayerLayout], layer: LayerLayout, first_shared: int) -> Optional[int]:
    """The last layer before ``first_shared`` of ``layer``'s kind and window (None: there is none)."""
    return next((d.index for d in reversed(layers[:first_shared])
                 if d.kind == layer.kind and d.window == layer.window), None)


def share_kv(layers: Sequence[LayerLayout], shared: Optional[int]) -> list:
    """``layers`` with the last ``shared`` of them reading their donors' caches (:func:`kv_donor`)."""
    if not shared:
        return list(layers)
    key, L = f"attention.kv_shared_layers={shared}", len(layers)
    if not 0 < shared < L:
        raise ConfigError(f"{key}: must be 0 (none) or fewer than the {L} layers (a shared layer reads an "
                          "earlier layer that keeps its own K/V)")
    first = L - shared
    out = list(layers)
    for layer in layers[first:]:
        if not layer.reads_shared_kv:
            raise ConfigError(f"{key}: layer {layer.index} is a {layer.kind} layer; reading another layer's cache "
                              "is built for K/V-head layers only")
        donor = kv_donor(layers, layer, first)
        if donor is None:
            kind = layer.kind if layer.window is None else f"{layer.kind} layer of window {layer.window}"
            raise ConfigError(f"{key}: layer {layer.index} ({kind}) has no layer of its kind before layer "
                              f"{first} to read K/V from")
        out[layer.index] = replace(layer, kv_source=donor)
    return out
