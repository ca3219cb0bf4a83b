"""Which layers of a decoder are local (a sliding window), recurrent (a kind that keeps a state per
sequence) or full attention, as transformers' ``layer_types`` names them (the registered kinds'
names: :mod:`kvbench.layouts.kinds`), and the one name of a variant built from its layout and that
pattern (:func:`variant_label`). Torch-free: configs are checked with it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from kvbench.config.layer_options import LAYER_OPTIONS
from kvbench.core.errors import check
from kvbench.jsonio import as_int
from kvbench.layouts.chunked import chunk_window
from kvbench.layouts.kinds import attention_kind, by_layer_type, recurrent_in, recurrent_layer_types, registered
from kvbench.layouts.kinds import layer_types as kind_layer_types

# transformers' name of a layer that attends every position; a recurrent kind's layers become it when
# asked for none (attention.full_attention_interval=0), and every layer is one without a pattern
FULL = "full_attention"


def variant_label(attention: Any, cache_dtype: Optional[str] = None, num_layers: Optional[int] = None,
                  state_dtype: Optional[str] = None) -> str:
    """The one name of a variant, in progress lines, tables, plots, reports and (as
    :func:`variant_key`) task=compare's metric prefixes: ``gqa kv=4``, ``mla r=256``, a window W on
    its local layers ``mha kv=16 w=1024`` and, when some layers are global, their local:global
    counts ``gqa kv=4 w=1024 5:1`` (Gemma 3's pattern over 6 layers; with ``num_layers`` unknown,
    global_every k reads (k-1):1), each layer option that is on, in the order of
    :data:`~kvbench.config.layer_options.LAYER_OPTIONS` (learned sinks ``gqa kv=8 w=128 1:1 sinks``
    (GPT-OSS), DSA's top-k ``mla r=512 topk=2048``, KV shared by the last N layers ``gqa kv=2 w=512
    4:1 kvshare=15`` (Gemma 3n)), a recurrent kind's layers by its label (``LayerKind.label``) and
    their recurrent:full counts ``gqa kv=4 <label> 3:1`` (Qwen3.5's; the label alone: every layer
    recurrent) and their state's dtype where it is not float32 ``gqa kv=4 <label> 3:1 state=bfloat16``,
    a cache dtype other than the compute dtype ``mha kv=8 int8``. A kind's first compare letter (``LayerKind.letters``)
    names its size after its type (``mla r=256``), K/V heads their count.
    ``attention``: a resolved AttentionConfig or a record's attention mapping."""
    get = attention.get if isinstance(attention, Mapping) else lambda key: getattr(attention, key, None)
    type_ = get("type")
    kind = attention_kind(type_)
    letter, key = next(iter(kind.letters.items())) if kind is not None and kind.letters else ("kv", "num_kv_heads")
    label = f"{type_} {letter}={get(key)}"
    window = pattern_window(get)
    if window:
        label += f" w={window}"
        ratio = local_global_layers(window, get("global_every"), get("layer_types"), num_layers)
        if ratio and ratio[1]:
            label += f" {ratio[0]}:{ratio[1]}"
    for option in LAYER_OPTIONS:
        label += option.part(get(option.key))
    types = get("layer_types")
    for name in recurrent_layer_types():  # each recurrent kind's layers, by its label
        ratio = linear_full_layers(types, name)
        if ratio:
            word = by_layer_type(name).label or name
            label += f" {word} {ratio[0]}:{ratio[1]}" if ratio[1] else f" {word}"
    for kind in registered():  # a kind chosen by its layer types alone (DeepSeek-V4's): its word, each type's count
        if kind.named and not kind.recurrent and types and not set(kind.layer_types).isdisjoint(types):
            label += f" {kind.label} " + ":".join(str(list(types).count(t)) for t in kind.layer_types)
    if linear_full_layers(types) and state_dtype not in (None, "float32"):  # only a recurrent layer holds one
        label += f" state={state_dtype}"
    return label if cache_dtype in (None, "auto") else f"{label} {cache_dtype}"


def job_variant_label(job: Any) -> str:
    """A job's (a BenchConfig's) :func:`variant_label`: its resolved attention, its cache and state dtypes
    and its layer count, as its progress line, its sweep line, inspect and its record's tables name it."""
    return variant_label(job.attention, job.cache.dtype, job.model.num_layers, job.cache.state_dtype)


def local_global_layers(window: Optional[int], global_every: Optional[int], layer_types: Optional[Sequence[str]],
                        num_layers: Optional[int] = None) -> Optional[Tuple[int, int]]:
    """The local:global ratio of the layers, reduced (Gemma 3's 5:1); (1, 0) when every layer is
    local; None without a window. ``global_every`` k counts the layers when ``num_layers`` is known
    (12 layers, k=6: 10 local, 2 global), else reads (k-1):1."""
    if not window:
        return None
    if layer_types is not None:  # among the attention layers (a recurrent layer has no window)
        recurrent = recurrent_layer_types()
        local, total = sum(t == "sliding_attention" for t in layer_types), sum(t not in recurrent for t in layer_types)
    elif global_every and num_layers:
        local, total = sum(1 for i in range(num_layers) if (i + 1) % global_every), num_layers
    elif global_every:
        local, total = global_every - 1, global_every
    else:
        return (1, 0)
    g = math.gcd(local, total - local) or 1
    return (local // g, (total - local) // g)


def linear_full_layers(layer_types: Optional[Sequence[str]], name: Optional[str] = None) -> Optional[Tuple[int, int]]:
    """The recurrent:other ratio of the layers (Qwen3.5's 3:1), reduced, counting the layers
    ``layer_types`` calls ``name`` (None: any recurrent kind's); None without such a layer."""
    names = recurrent_layer_types() if name is None else (name,)
    if not layer_types or set(names).isdisjoint(layer_types):
        return None
    recurrent = sum(t in names for t in layer_types)
    g = math.gcd(recurrent, len(layer_types) - recurrent)
    return (recurrent // g, (len(layer_types) - recurrent) // g)


def interval_layer_types(k: int, num_layers: int, name: Optional[str] = None) -> Optional[List[str]]:
    """transformers' full_attention_interval k: layers k-1, 2k-1, ... full attention, the others
    ``name`` (a recurrent kind's layer type; None: the kind that ``attention.full_attention_interval``
    belongs to, whose compare letter sets it first in ``LayerKind.letters``); None when no layer is
    recurrent (k 0 or 1)."""
    name = name or _interval_layer_type()
    types = [name if k and (i + 1) % k else FULL for i in range(num_layers)]
    return types if name in types else None


def _interval_layer_type() -> str:
    """The layer type of the recurrent kind that owns ``attention.full_attention_interval`` (the
    kind whose letters set it)."""
    return next(t for t in recurrent_layer_types()
                if "full_attention_interval" in by_layer_type(t).letters.values())


# The attention keys of a layer pattern. Their None is a value (no window; every layer full
# attention), not "left to its default": a table tells GQA from its windowed or Gated DeltaNet
# hybrid by them. The jobs table shows the first two as columns (key, header).
PATTERN_KEYS = ("window", "global_every", "layer_types")
PATTERN_COLUMNS = (("window", "W"), ("global_every", "global every"))


def pattern_window(get: Callable[[str], Any]) -> Any:
    """The window of the local layers of an attention (``get``: its value of a key): ``window``, or the
    value of an option that is on and is its layers' window (a chunk, :attr:`LayerOption.sets_window`),
    which resolution copies to ``window``: an unresolved config (an invalid job's record) says it too."""
    return get("window") or next((get(o.key) for o in LAYER_OPTIONS if o.sets_window and o.on(get(o.key))), None)


def unused_pattern_keys(attention: Mapping[str, Any]) -> Tuple[str, ...]:
    """The pattern keys that mean nothing in ``attention`` (a resolved config as a mapping): without
    a window (:func:`pattern_window`), which layers are local, and layer_types too unless some are linear."""
    if pattern_window(attention.get) is not None:
        return ()
    return ("window", "global_every") + ("layer_types",) * (linear_full_layers(attention.get("layer_types")) is None)


@dataclass(frozen=True)
class LayerPattern:
    """Which layers are local (a window W on them), global or linear, as a record names them (any
    value of another type reads as absent); ``num_layers`` counts a global_every pattern's layers
    (12 layers, every 6: 5:1)."""

    window: Optional[int] = None
    global_every: Optional[int] = None
    layer_types: Optional[Tuple[str, ...]] = None
    num_layers: Optional[int] = None

    @classmethod
    def read(cls, get: Callable[[str], Any], num_layers: Any = None) -> "LayerPattern":
        """The pattern of the values ``get`` gives for each of :data:`PATTERN_KEYS`; a config as a user
        wrote it (an invalid job's record, never resolved) may say its layers by
        ``full_attention_interval`` instead, read as resolution reads it."""
        types, k = get("layer_types"), as_int(get("full_attention_interval"))
        if not isinstance(types, (list, tuple)) and k and as_int(num_layers):
            types = interval_layer_types(k, as_int(num_layers))
        return cls(window=as_int(get("window")) or None, global_every=as_int(get("global_every")),
                   layer_types=tuple(types) if isinstance(types, (list, tuple)) else None,
                   num_layers=as_int(num_layers))

    def fields(self) -> Dict[str, Any]:
        return {key: getattr(self, key) for key in PATTERN_KEYS}

    def local_global(self) -> Optional[Tuple[int, int]]:
        return local_global_layers(self.window, self.global_every, self.layer_types, self.num_layers)

    @property
    def has_local(self) -> bool:
        """True when some layer keeps only its last W positions."""
        return bool(self.window) and self.local_global() != (0, 1)

    @property
    def has_linear(self) -> bool:
        """True when some layer keeps a fixed-size recurrent state (a recurrent kind's), not its tokens' K/V."""
        return linear_full_layers(self.layer_types) is not None

    @property
    def named(self) -> bool:
        """True when a label names the pattern: a window (even one no layer applies) or linear layers."""
        return bool(self.window) or self.has_linear

    @property
    def order(self) -> Tuple[int, int, int]:
        """All global first, then hybrids (larger window first), then all local."""
        ratio = self.local_global() if self.has_local else None
        return (0, 0, 0) if ratio is None else (1, 1 if ratio[1] == 0 else 0, -(self.window or 0))


def variant_key(label: str) -> str:
    """:func:`variant_label` as a metric prefix: ``gqa_kv4``, ``mla_r256``, ``gqa_kv4_w1024_5to1``."""
    return label.replace("=", "").replace(":", "to").replace(" ", "_")


def check_window_pattern(prefix: str, window: Optional[int], global_every: Optional[int],
                         layer_types: Optional[List[str]], num_layers: Optional[int] = None) -> None:
    """A window is 0 (none) or >= 1 positions; global_every >= 0; layer_types names each layer
    (``num_layers`` of them, when known) by a registered kind's layer type (sliding_attention,
    full_attention, a recurrent or a named kind's); not both patterns; a window with layer_types applies to
    some sliding_attention layer."""
    check(window is None or window >= 0, f"{prefix}window", window, "must be >= 1 positions, 0 (no window) or null")
    check(global_every is None or global_every >= 0, f"{prefix}global_every", global_every,
          "must be >= 0 (0: no global layer; k: every k-th layer global) or null")
    if layer_types is None:
        return
    check(global_every is None, f"{prefix}global_every", global_every,
          f"and {prefix}layer_types both say which layers are local; give one")
    check(all(t in kind_layer_types() for t in layer_types), f"{prefix}layer_types", layer_types,
          f"each entry must be one of {', '.join(kind_layer_types())}")
    check(num_layers is None or len(layer_types) == num_layers, f"{prefix}layer_types", layer_types,
          f"must name each of model.num_layers={num_layers} layers")
    check(not window or "sliding_attention" in layer_types, f"{prefix}window", window,
          f"applies to the sliding_attention layers of {prefix}layer_types, and it lists none")


def check_within_context(key: str, value: Optional[int], model: Any, why: str) -> None:
    """A count of positions a layer keeps or attends (a window, a top-k of the cached positions)
    asked of a run is at most ``model.max_seq_len``: a larger one changes nothing a run could measure
    (``why`` says what it would do), so it is a typo (1e12 for 1024), refused as one."""
    check(value is None or value <= model.max_seq_len, key, value,
          f"must be <= model.max_seq_len={model.max_seq_len} ({why})")


def resolve_layer_pattern(attention: Any, model: Any) -> Dict[str, Any]:
    """An AttentionConfig's window, global_every and layer_types against ``model`` (a
    ModelConfig): each null one is the model's own, checked against its layer count. Recurrent
    layers are layer_types' entries of a recurrent kind (:func:`_linear_layers`)."""
    check_within_context("attention.window", attention.window, model,
                         "a window that long drops no position; 0: no window")
    check_within_context("attention.chunk", attention.chunk, model, "a chunk that long never resets; 0: none")
    window = model.preset_window if attention.window is None else attention.window
    window = chunk_window(attention, model, window)  # a chunk is its local layers' window (kvbench.layouts.chunked)
    if attention.layer_types is not None or attention.global_every is not None:
        global_every, layer_types = attention.global_every, attention.layer_types
    else:
        global_every, layer_types = model.preset_global_every, model.preset_layer_types
        if window == 0 and layer_types:
            layer_types = _unwindowed(layer_types)
    layer_types = _linear_layers(attention, model, window, layer_types)
    check_window_pattern("attention.", window, global_every, layer_types, model.num_layers)
    if window is None:
        # a pattern with no window to apply it to would be dropped from the run: refused, unless
        # its layers are full or linear (none sliding), which needs none
        linear = layer_types is not None and "sliding_attention" not in layer_types
        for key in ("global_every",) if linear else ("layer_types", "global_every"):
            check(getattr(attention, key) is None, f"attention.{key}", getattr(attention, key),
                  f"says which layers are local, but there is no window: model {model.name} has none and "
                  "attention.window is null; set attention.window=W")
        return {"layer_types": layer_types} if linear else {}
    return {"window": window, "global_every": global_every, "layer_types": layer_types}


def _unwindowed(layer_types: List[str]) -> Optional[List[str]]:
    """A model's own ``layer_types`` with no window asked (attention.window=0): as its sliding layers attend
    every position, so do the layers of a kind chosen by its layer type that keep a window (DeepSeek-V4's
    compressed layers, each with its ring, and the sliding ones it builds beside them): full attention.
    None where every layer is then full."""
    present = set(layer_types)
    windowed = {t for kind in registered() if kind.named and not kind.recurrent and present & set(kind.layer_types)
                for t in (*kind.layer_types, *kind.claims)}
    types = [FULL if t in windowed else t for t in layer_types]
    return None if windowed and set(types) == {FULL} else types


def _linear_layers(attention: Any, model: Any, window: Optional[int],
                   layer_types: Optional[List[str]]) -> Optional[List[str]]:
    """``layer_types`` with the recurrent layers asked for: attention.full_attention_interval's,
    else those it lists, else the model's own. A window pattern given without them over a model
    that has them would drop them silently: refused, as is an interval beside a window."""
    k = attention.full_attention_interval
    if k is None:
        own = [t for t in recurrent_layer_types() if t in (model.preset_layer_types or ())]
        check(attention.global_every is None or not own,
              "attention.global_every", attention.global_every, f"would replace model {model.name}'s layer pattern, "
              f"which has {' and '.join(own)} layers; list each layer in attention.layer_types")
        return layer_types
    check(attention.layer_types is None or (k == 0 and not recurrent_in(attention.layer_types)),
          "attention.full_attention_interval", k,
          "and attention.layer_types both say which layers are linear; give one")
    if k == 0:  # no recurrent layer: the model's own become full attention
        recurrent = recurrent_layer_types()
        types = [FULL if t in recurrent else t for t in layer_types or ()]
        return types if "sliding_attention" in types else None
    check(not window, "attention.full_attention_interval", k, f"beside a window (attention.window={window}): list "
          "which layers are sliding, full and linear in attention.layer_types (or set attention.window=0)")
    return interval_layer_types(k, model.num_layers, attention.interval_type)
