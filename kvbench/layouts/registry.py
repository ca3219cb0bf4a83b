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
  the ``attention.*`` field each sets; a letter of ``layer_types`` is the kind's ``pattern``:
  ``pattern(count, num_layers)`` gives the layer types of its count for a model of that many layers.
- ``architectures``: the transformers architectures whose layers of this kind it reads from a
  ``config.json`` (``hf_fields``), each with the ModelConfig switches that architecture's attention
  needs; :data:`kvbench.config.hf.HF_ARCHITECTURES` takes them in.
- ``attention_types``: the ``attention.type`` values whose attention layers are this kind (a kind
  with none is chosen by its ``layer_types`` alone); ``title``: its name in a sentence.
- ``shape_keys``: the ``attention.*`` fields that shape its weights (null for every other type,
  and a checkpoint's own: asked otherwise, refused); ``record_keys``: the ``attention.*`` keys a
  record keeps for it (left out of a record that does not use it, so it reads as one written before
  they existed); ``options``: its :class:`LayerOption` s (a variant's label, record and checks
  learn them from :data:`kvbench.config.layer_options.LAYER_OPTIONS`).
- ``beside_latent``: a recurrent kind whose layers a model may have beside latent attention layers
  (Kimi Linear's KDA beside MLA); the others' are refused there, as not built.
- ``examples``: Hydra overrides that build a small decoder using it, one per form the conformance
  suite (``tests/test_layer_kinds.py``) checks; ``decode_examples``: forms that suite does not run yet
  (the kind's home says why) but that decode, which the checks of a decoder's whole decode (tensor
  parallel ranks token-equal to one process, ``tests/test_parallel.py``) run beside ``examples``.
- hooks (``None``: nothing to do): ``build(model, attention, window) -> LayerLayout`` (its layout
  for a layer of ``model`` under a resolved ``attention``, ``window`` the layer's own or None; a kind
  whose shape a checkpoint gives takes it from ``model.layer_shapes[name]`` and may ignore the rest;
  a ``named`` kind's also takes the layer's type),
  ``check_model(model)`` (its own ``model.*`` fields checked, each refusal naming its key),
  ``hf_fields(cfg, arch, keys) -> dict`` (the ModelConfig fields the config.json contents ``cfg`` of
  one of its ``architectures`` give, each field's key added to ``keys`` as
  :func:`kvbench.config.hf.model_fields` keeps them; values read by :func:`kvbench.core.hf_read.get`),
  ``unfuse(layout, name, w) -> {part: tensor}`` (a checkpoint's fused projection ``name``, one the
  module's ``HF_FUSED`` declares, as the module's parts; a callable or, for a hook in a torch module
  above the layouts, ``"package.module:function"``: :func:`resolve`), ``param_count(layout, model)
  -> int`` (its parameters per layer), ``remake(layers, model, attention) -> layers`` (the built
  layers with those of this kind that another kind's build made in its place: a model's global layers of
  a shape of their own, :mod:`kvbench.layouts.global_heads`; each layout object replaced once).
- ``named``: its layers are chosen by their layer type alone, whatever ``attention.type`` (a
  recurrent kind's are too); ``claims``: another kind's layer types it builds in a pattern that
  names one of its own (DeepSeek-V4's sliding_attention beside its compressed layers).
- ``hf_architectures``: the transformers classes whose WHOLE config.json its home reads (a model that
  is not a Llama-form decoder with this kind beside it, as Nemotron-H is; ``architectures`` is for a
  kind's own keys inside a Llama-form file): ``hf_model_fields(cfg, arch)`` gives every ModelConfig
  field, and ``hf_names(cfg)`` a function from each tensor name of the checkpoint to the name a
  Llama-form checkpoint gives it (``model.layers.L.self_attn.q_proj.weight``; the kind's own under
  its module's ``HF_MODULE``), None for one the decoder does not read; ``hf_tied``: such a file without
  ``tie_word_embeddings`` ties its head to its embedding (transformers' default for the class: Gemma's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

from kvbench.core.errors import ConfigError
from kvbench.core.hooks import resolve  # noqa: F401  (asked for here by the kinds' users)
from kvbench.jsonio import as_int


@dataclass(frozen=True)
class LayerOption:
    """One optional layer property (learned sinks, DSA's top-k, K/V shared across layers): an
    ``attention.<key>`` field, null: the model's own. ``label``: its part of a variant's label,
    formatted with the value (``" topk={}"``); ``off``: the value that means none, of the option's
    type (bool or int); ``preset``: the ModelConfig field holding the model's own (None: it is part
    of a layout's shape, resolved and compared with it, as DSA's top-k is with its indexer's fields);
    ``kv_heads_only``: why a layer without K/V heads cannot have it, its error when asked there (None:
    any layer may have it); ``every_position``: why it is not built where a layer keeps only its last
    positions (None: it is); ``positions``: its value counts positions, so a run may ask at most
    ``model.max_seq_len`` of them; ``with_keys``: the ``attention.*`` keys a record keeps only while it
    is on (the shape of what it adds); ``values``: the only values that mean on, where not every one of
    its type but ``off`` (K=V: 1, a flag kept as an int for compare's letter ``v1``); ``sets_window``: its
    value is also the window of the layers it applies to (a chunk is its local layers' locality, so a
    variant with ``chunk=C`` has ``window`` C and is labelled ``w=C ... chunk=C``)."""

    key: str
    label: str
    off: Any
    preset: Optional[str] = None
    kv_heads_only: Optional[str] = None
    every_position: Optional[str] = None
    positions: bool = False
    with_keys: Tuple[str, ...] = ()
    values: Tuple[Any, ...] = ()
    sets_window: bool = False

    def on(self, value: Any) -> Any:
        """``value`` when it is of this option's type and on, else None (a record's value as a
        variant reads it: anything else there is not this option)."""
        if type(self.off) is bool:
            return value if value is True else None
        is_int = as_int(value) is not None
        return value if is_int and value != self.off and (not self.values or value in self.values) else None

    def own(self, value: Any) -> Any:
        """A resolved layer's ``value`` as the model's preset field holds it (null: off)."""
        return type(self.off)(value or self.off)

    def part(self, value: Any) -> str:
        """This option's part of a variant's label: empty when ``value`` is off (or null)."""
        return self.label.format(value) if value else ""


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
    decode_examples: Mapping[str, Tuple[str, ...]] = field(default_factory=dict)
    hf_fields: Optional[Callable[..., Dict[str, Any]]] = None
    unfuse: Union[None, str, Callable[..., Dict[str, Any]]] = None
    param_count: Optional[Callable[..., int]] = None
    attention_types: Tuple[str, ...] = ()
    title: str = ""
    shape_keys: Tuple[str, ...] = ()
    preset: str = ""  # the ModelConfig field holding a model's own shape of this kind ("": none has one)
    options: Tuple[LayerOption, ...] = ()
    build: Optional[Callable[..., Any]] = None
    architectures: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    check_model: Optional[Callable[[Any], None]] = None
    hf_architectures: Tuple[str, ...] = ()
    hf_model_fields: Optional[Callable[..., Dict[str, Any]]] = None
    hf_names: Optional[Callable[..., Callable[[str], Optional[str]]]] = None
    hf_tied: bool = False  # its whole-file architectures tie the head to the embedding unless the file says
    remake: Optional[Callable[..., Any]] = None
    beside_latent: bool = False
    named: bool = False
    claims: Tuple[str, ...] = ()
    pattern: Optional[Callable[[int, int], Any]] = None  # its letter's count -> layer_types (see letters)


_KINDS: Dict[str, LayerKind] = {}


def register(kind: LayerKind) -> LayerKind:
    """Add ``kind`` (once per name; a second kind of the same name, or one claiming another's layer
    type, compare letter or an architecture whose whole config.json another reads, is a programming
    error named in one line)."""
    if kind.name in _KINDS and _KINDS[kind.name] is not kind:
        raise ValueError(f"layer kind {kind.name!r} is registered twice")
    for other in _KINDS.values():
        if other.name == kind.name:
            continue
        clash = (set(other.layer_types) & set(kind.layer_types)) | (set(other.letters) & set(kind.letters))
        # a whole config.json has one reader; a Llama-form one may have several kinds' keys read from it
        clash |= set(kind.hf_architectures) & {*other.hf_architectures, *other.architectures}
        clash |= set(other.hf_architectures) & set(kind.architectures)
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


def recurrent_layer_types() -> Tuple[str, ...]:
    """The ``layer_types`` names of every kind that keeps a per-sequence state."""
    return tuple(t for kind in _KINDS.values() if kind.recurrent for t in kind.layer_types)


def named_layer_types() -> Tuple[str, ...]:
    """The ``layer_types`` names of every kind chosen by its layer type alone (recurrent or ``named``),
    each a word of a variant's label."""
    return tuple(t for kind in _KINDS.values() if kind.recurrent or kind.named for t in kind.layer_types)


def layer_types() -> Tuple[str, ...]:
    """Every ``layer_types`` name a registered kind takes, in registration order."""
    return tuple(t for kind in _KINDS.values() for t in kind.layer_types)


def recurrent_in(types: Optional[Sequence[str]]) -> bool:
    """True when the ``layer_types`` list ``types`` names a layer that keeps a per-sequence state."""
    return bool(types) and not set(types).isdisjoint(recurrent_layer_types())


def attention_kind(type_: Optional[str]) -> Optional[LayerKind]:
    """The kind whose attention layers ``attention.type`` ``type_`` names (None: none claims it,
    as ``type=model`` before it is resolved)."""
    return next((kind for kind in _KINDS.values() if type_ in kind.attention_types), None)


def layer_kind(attention: Any, layer_type: str) -> LayerKind:
    """The kind of a layer that ``layer_types`` calls ``layer_type`` under a resolved ``attention``:
    a recurrent or ``named`` kind by its name alone, one that ``claims`` it where the pattern names
    that kind's own layers, an attention layer's by ``attention.type`` (a latent or K/V-head layer
    may both be full or sliding)."""
    kind = by_layer_type(layer_type)
    if kind.recurrent or kind.named:
        return kind
    pattern = set(getattr(attention, "layer_types", None) or ())
    owner = next((k for k in _KINDS.values() if layer_type in k.claims and pattern & set(k.layer_types)), None)
    return owner or attention_kind(attention.type) or kind
