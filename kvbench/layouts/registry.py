"""The registry of layer kinds: one :class:`LayerKind` per kind of decoder layer, registered by the
kind's home (``KIND = register(LayerKind(...))`` in ``kvbench/layouts/<kind>.py``) and found here by
everything else, so that nothing outside a kind's home names it.

:mod:`kvbench.layouts.kinds` imports every home (one registry line per kind); ask it, not this
module, for the registered kinds (importing this module alone registers none).

A kind's facets, each optional where the kind has nothing to say:

- ``layout``: its :class:`~kvbench.layouts.base.LayerLayout` class (bytes held and read, FLOPs,
  limits, label words, inspect text) and ``module``: the torch module that runs it, as
  ``"package.module:Class"`` (resolved by :mod:`kvbench.layouts.attention`, above the torch layers).
- ``layer_types``: the names transformers' ``layer_types`` (and kvbench's ``attention.layer_types``)
  give its layers; ``recurrent``: a per-sequence state instead of positions.
- ``label`` and ``letters``: the word a variant label shows, and compare's letters (``mla:r64``) with
  the ``attention.*`` field each sets.
- ``record_keys``: the ``attention.*`` keys a record keeps for it.
- ``examples``: Hydra overrides that build a small decoder using it, one per form the conformance
  suite (``tests/test_layer_kinds.py``) checks.
- hooks (``None``: nothing to do): ``hf_fields(cfg, arch) -> dict`` (the ModelConfig fields its
  config.json keys give), ``unfuse(tensors, layout, prefix)`` (a checkpoint's fused projections to
  the module's), ``param_count(layout, model) -> int`` (its parameters per layer).
- ``build(model) -> LayerLayout``: its layers' layout in a ModelConfig (its shape in
  ``model.layer_shapes[name]``, what its home's ``hf_fields`` writes there).
- ``hf_architectures``: the transformers classes whose whole config.json its home reads (a model
  that is not a Llama-form decoder with this kind beside it, as Nemotron-H is): ``hf_fields(cfg, arch)``
  gives every ModelConfig field, and ``hf_names(cfg)`` a function from each tensor name of the
  checkpoint to the name a Llama-form checkpoint gives it (``model.layers.L.self_attn.q_proj.weight``;
  the kind's own under its module's ``HF_MODULE``), None for one the decoder does not read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from kvbench.config.errors import ConfigError


@dataclass(frozen=True)
class LayerKind:
    name: str  # the layout's ``kind`` ("kv_heads", "latent", "gated_deltanet", ...)
    layout: type
    module: str = ""  # "kvbench.layouts.<kind>_attention:Class"
    layer_types: Tuple[str, ...] = ()
    recurrent: bool = False
    label: str = ""
    letters: Mapping[str, str] = field(default_factory=dict)
    record_keys: Tuple[str, ...] = ()
    examples: Mapping[str, Tuple[str, ...]] = field(default_factory=dict)
    hf_fields: Optional[Callable[..., Dict[str, Any]]] = None
    unfuse: Optional[Callable[..., None]] = None
    param_count: Optional[Callable[..., int]] = None
    build: Optional[Callable[..., Any]] = None
    hf_architectures: Tuple[str, ...] = ()
    hf_names: Optional[Callable[..., Callable[[str], Optional[str]]]] = None


_KINDS: Dict[str, LayerKind] = {}


def register(kind: LayerKind) -> LayerKind:
    """Add ``kind`` (once per name; a second kind of the same name, or one claiming another's layer
    type or compare letter, is a programming error named in one line)."""
    if kind.name in _KINDS and _KINDS[kind.name] is not kind:
        raise ValueError(f"layer kind {kind.name!r} is registered twice")
    for other in _KINDS.values():
        if other.name == kind.name:
            continue
        clash = (set(other.layer_types) & set(kind.layer_types)) | (set(other.letters) & set(kind.letters))
        if clash:
            raise ValueError(f"layer kind {kind.name!r} claims {sorted(clash)}, already {other.name!r}'s")
    _KINDS[kind.name] = kind
    return kind


def registered() -> Tuple[LayerKind, ...]:
    """Every registered kind, in registration order."""
    return tuple(_KINDS.values())


def kind_of(layout: Any) -> LayerKind:
    """The registered kind of a layer ``layout`` (by its class, nearest first)."""
    for cls in type(layout).__mro__:
        for kind in _KINDS.values():
            if kind.layout is cls:
                return kind
    raise KeyError(f"no layer kind is registered for {type(layout).__name__}")


def by_layer_type(name: str) -> LayerKind:
    """The kind whose layers ``layer_types`` names ``name``; a ConfigError naming the value and
    the accepted names otherwise."""
    for kind in _KINDS.values():
        if name in kind.layer_types:
            return kind
    accepted = [t for kind in _KINDS.values() for t in kind.layer_types]
    raise ConfigError(f"attention.layer_types: {name!r} is not a layer type (one of {', '.join(accepted)})")


def by_architecture(arch: Optional[str]) -> Optional[LayerKind]:
    """The kind whose home reads the whole config.json of transformers' class ``arch`` (None: none)."""
    return next((kind for kind in _KINDS.values() if arch in kind.hf_architectures), None)


def hf_renaming(cfg: Mapping[str, Any]) -> Callable[[str], Optional[str]]:
    """How a checkpoint of the config.json contents ``cfg`` names its tensors in Llama's form: the
    ``hf_names`` of the kind whose home reads its architecture, else each name as it is."""
    archs = cfg.get("architectures")
    kind = next((k for a in archs if (k := by_architecture(a))), None) if isinstance(archs, list) else None
    return kind.hf_names(cfg) if kind is not None and kind.hf_names is not None else (lambda name: name)


def layer_type_names() -> Tuple[str, ...]:
    """Every registered kind's ``layer_types`` names, in registration order."""
    return tuple(t for kind in _KINDS.values() for t in kind.layer_types)


def recurrent_layer_types() -> Tuple[str, ...]:
    """The ``layer_types`` names of every kind that keeps a per-sequence state."""
    return tuple(t for kind in _KINDS.values() if kind.recurrent for t in kind.layer_types)
