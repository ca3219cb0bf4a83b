"""The decoder's layer layouts from its config: the one place a config becomes layouts."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

from kvbench.config.hf import LINEAR
from kvbench.layouts.base import Layouts
from kvbench.layouts.gated_deltanet import GatedDeltaNet
from kvbench.layouts.kinds import registered
from kvbench.layouts.kv_heads import KVHeads
from kvbench.layouts.kv_sharing import share_kv
from kvbench.layouts.latent import Latent


def build_layouts(model, attention, state_dtype: str = "float32") -> Layouts:
    """The layouts of ``model`` under ``attention``, a recurrent layer's state held in ``state_dtype``
    (``cache.state_dtype``), built once per triple and shared (they are immutable). The configs are
    mutable: the key is what they say now (their repr), not which objects they are."""
    key = (repr(model), repr(attention), state_dtype)
    if key not in _BUILT:
        layouts = _build(model, attention)
        _BUILT[key] = layouts if state_dtype == "float32" else holding_states_in(layouts, state_dtype)
        if len(_BUILT) > 16:
            _BUILT.popitem(last=False)
    return _BUILT[key]


_BUILT: "OrderedDict[tuple, Layouts]" = OrderedDict()


def holding_states_in(layouts: Layouts, state_dtype: str) -> Layouts:
    """``layouts`` with every layer that holds a recurrent state holding it in ``state_dtype`` (its
    ``state_dtype`` field); the others, and which layers share an object, as they were."""
    made = {id(layer): replace(layer, state_dtype=state_dtype) if layer.state is not None else layer
            for layer in layouts.unique()}
    if len(made) == 1:  # every layer alike (counted in C: a model may have 10^8)
        return Layouts((next(iter(made.values())),) * len(layouts))
    return Layouts(made[id(layer)] for layer in layouts)


def _build(model, attention) -> Layouts:
    """One layout per layer: Gated DeltaNet where layer_types says linear_attention, a registered kind
    that builds its own (``LayerKind.build``) where it names that kind's layers, else K/V heads or a
    latent with its window; then the last attention.kv_shared_layers read their donors' K/V. Layers of
    one kind and window share one layout object."""
    windows = attention.layer_windows(model.num_layers)
    kinds = attention.layer_kinds(model.num_layers)
    linear = model.linear_shape()
    rotary = None if model.rotary_dim == model.head_dim else model.rotary_dim

    own = {t: kind.build for kind in registered() if kind.build is not None for t in kind.layer_types}

    def layer(key):  # LINEAR, a layer type whose kind builds its own, or an attention layer's window
        if key == LINEAR:
            return GatedDeltaNet(None, **linear, num_heads=model.num_heads, head_dim=model.head_dim)
        if key in own:
            return own[key](model)
        if attention.latent:
            return Latent(key, model.num_heads, attention.q_lora_rank, attention.kv_lora_rank,
                          attention.qk_nope_head_dim, attention.qk_rope_head_dim, attention.v_head_dim,
                          attention.mla_decode == "absorbed", attention.index_n_heads or 0,
                          attention.index_head_dim or 0, attention.index_topk or 0)
        return KVHeads(key, model.num_heads, attention.num_kv_heads, model.head_dim, bool(attention.sinks),
                       output_gate=model.attn_output_gate, rotary=rotary)

    special = {LINEAR, *own}
    keys = [kind if kind in special else w for w, kind in zip(windows, kinds)] \
        if any(kind in special for kind in dict.fromkeys(kinds)) else windows
    if keys and keys.count(keys[0]) == len(keys):  # every layer alike (counted in C: a model may have 10^8)
        return Layouts(share_kv((layer(keys[0]),) * len(keys), attention.kv_shared_layers))
    made = {key: layer(key) for key in dict.fromkeys(keys)}
    layers = list(map(made.__getitem__, keys))
    return Layouts(share_kv(layers, attention.kv_shared_layers))
