"""The decoder's layer layouts from its config: the one place a config becomes layouts."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

from kvbench.layouts.base import Layouts
from kvbench.layouts.kinds import layer_kind, registered
from kvbench.layouts.kv_sharing import share_kv
from kvbench.layouts.nope import without_rope


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
    """One layout per layer, its kind's (:func:`~kvbench.layouts.registry.layer_kind`: a recurrent
    kind where layer_types names one, else the kind attention.type names) with its window; then the
    layers model.nope names rotate nothing; then the last attention.kv_shared_layers read their donors' K/V.
    Layers of one kind and window share one layout object; a kind that remakes layers another kind built
    (``LayerKind.remake``) does so before the sharing."""
    windows = attention.layer_windows(model.num_layers)
    types = attention.layer_kinds(model.num_layers)
    kinds = {t: layer_kind(attention, t) for t in dict.fromkeys(types)}
    by_name = {kind.name: kind for kind in kinds.values()}
    only = next(iter(by_name.values())) if len(by_name) == 1 else None
    if only is not None and not only.named:  # one kind: a layer's key is its window (no pass over 10^8 layers)
        keys, layer = windows, lambda window: only.build(model, attention, window)
    else:  # (the kind's name, the window, a named kind's layer type); a recurrent kind's layers have no window
        keys = [(kinds[t].name, w, t if kinds[t].named else None) for t, w in zip(types, windows)]
        layer = lambda key: by_name[key[0]].build(model, attention, key[1], *key[2:] if key[2] else ())  # noqa: E731
    if keys and keys.count(keys[0]) == len(keys):  # every layer alike (counted in C: a model may have 10^8)
        layers = without_rope((layer(keys[0]),) * len(keys), model)
    else:
        made = {key: layer(key) for key in dict.fromkeys(keys)}
        layers = without_rope(list(map(made.__getitem__, keys)), model)
    for kind in registered():
        if kind.remake is not None:
            layers = kind.remake(layers, model, attention)
    return Layouts(share_kv(layers, attention.kv_shared_layers))
