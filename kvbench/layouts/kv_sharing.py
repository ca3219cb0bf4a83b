"""Cross-layer KV sharing (Gemma 3n, Gemma 4's E-models: ``attention.kv_shared_layers``): the last
N layers compute queries only and attend the keys and values of an earlier layer of the same kind.

Transformers' rule (``Gemma3nTextConfig.kv_sharing_modes``): layers L - N .. L - 1 share; each
reads the last layer before L - N of its own kind (here: the same layout kind, window and rotation, so a
shared local layer reads a local layer's ring of W, and a layer without rotary embeddings (NoPE) reads
unrotated keys, never a rotated layer's). A shared layer stores nothing, and a decode
step reads its donor's cache a second time (:class:`kvbench.shared_kv.SharedLayer`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, Optional, Sequence, Tuple

from kvbench.core.errors import ConfigError
from kvbench.layouts.base import LayerLayout


def _donor_key(layer: LayerLayout) -> Tuple[str, Optional[int], Optional[int]]:
    """What a reader and its donor must agree on: kind, window and how many key dims are rotated (keys
    cached rotated cannot serve a NoPE layer, nor the reverse)."""
    return layer.kind, layer.window, getattr(layer, "rotary_dim", None)


def kv_donors(layers: Sequence[LayerLayout], first_shared: int) -> Dict[Tuple[str, Optional[int], Optional[int]], int]:
    """For each kind, window and rotation, the last layer before ``first_shared`` that has it (one pass)."""
    return {_donor_key(d): i for i, d in enumerate(layers[:first_shared])}


def share_kv(layers: Sequence[LayerLayout], shared: Optional[int]) -> Sequence[LayerLayout]:
    """``layers`` with the last ``shared`` of them reading their donors' caches (:func:`kv_donors`);
    the layers reading one donor share one layout, as the others do."""
    if not shared:
        return layers
    key, L = f"attention.kv_shared_layers={shared}", len(layers)
    if not 0 < shared < L:
        raise ConfigError(f"{key}: must be 0 (none) or fewer than the {L} layers (a shared layer reads an "
                          "earlier layer that keeps its own K/V)")
    first = L - shared
    donors = kv_donors(layers, first)
    out, readers = list(layers), {}
    for index in range(first, L):
        layer = layers[index]
        if not layer.reads_shared_kv:
            raise ConfigError(f"{key}: layer {index} is a {layer.kind} layer; reading another layer's cache "
                              "is built for K/V-head layers only")
        donor = donors.get(_donor_key(layer))
        if donor is None:
            kind = layer.kind if layer.window is None else f"{layer.kind} layer of window {layer.window}"
            kind += "" if getattr(layer, "rotary_dim", 1) else ", without rotary embeddings"
            raise ConfigError(f"{key}: layer {index} ({kind}) has no layer of its kind before layer "
                              f"{first} to read K/V from")
        out[index] = readers.setdefault((id(layer), donor), replace(layer, kv_source=donor))
    return out
