"""What every kind of layer layout answers, and :class:`Layouts`, the list a decoder is built from.

A :class:`LayerLayout` is one layer's attention as data: what its cache stores per position, the bytes it
holds and reads, its FLOPs per decode step, labels, what it does not run with (:class:`Limit`), how it splits
over ranks (:mod:`~kvbench.layouts.sharding`). Every byte figure is a :class:`Layouts` total. No torch here.

Notation: B batch, S positions held or read, H query heads, H_kv KV heads, W a window.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple

from kvbench.core.dtypes import CACHE_DTYPES, DTYPE_BYTES, FP4_BLOCK, STORED_AS, block_refusal, element_bytes
from kvbench.core.errors import ConfigError, check_choice
from kvbench.core.task import Asked
from kvbench.layouts.sharding import Sharding
from kvbench.units import human_bytes, index_text


@dataclass(frozen=True)
class Limit:
    """Something a layer does not run with: ``key`` must be one of ``allowed`` (None: any) and none of
    ``refuses``, else the refusal reads ``key=value: why`` (``names: why`` when it names the layout's
    own key instead). ``refuses`` leaves a value no layer knows to the key's own check."""

    key: str
    allowed: Optional[Tuple[Any, ...]]
    why: str
    names: Optional[str] = None
    refuses: Tuple[Any, ...] = ()

    def excludes(self, value: Any) -> bool:
        return (self.allowed is not None and value not in self.allowed) or value in self.refuses


@dataclass(frozen=True)
class State:
    """What a recurrent layer holds per sequence at any length: its convolution's last ``conv_tail`` inputs
    (compute dtype) and a ``recurrent`` state in ``state_dtype``: float32 as transformers keeps it (it accumulates
    over every token), or half that as vLLM's ``mamba_ssm_cache_dtype`` allows (computed in float32 all the same)."""

    conv_channels: int
    conv_tail: int
    recurrent: Tuple[int, ...]
    state_dtype: str = "float32"

    def __post_init__(self):
        check_choice("cache.state_dtype", self.state_dtype, tuple(DTYPE_BYTES))

    def nbytes(self, element: int) -> int:
        return self.conv_channels * self.conv_tail * element + math.prod(self.recurrent) * DTYPE_BYTES[self.state_dtype]


@dataclass(frozen=True)
class LayerLayout(Sharding):
    """One layer's attention layout; subclasses set ``kind`` and ``stored`` (heads per position,
    the width of each stored tensor) and the byte formulas follow. A layout does not know its
    position: layers of one shape share one (immutable) object, so a model of a million layers
    holds a few layouts and a tuple of references."""

    window: Optional[int] = None  # W: the layer attends, and keeps, only the last W positions
    # the layer whose cache this one reads instead of keeping its own (kvbench.layouts.kv_sharing)
    kv_source: Optional[int] = field(default=None, kw_only=True)

    kind: ClassVar[str] = ""
    width_names: ClassVar[Tuple[str, ...]] = ("head_dim", "v_head_dim")  # what the config calls each of ``stored``
    reads_shared_kv: ClassVar[bool] = False  # whether its attention can attend a donor's cache instead of its own
    prefill_piece: ClassVar[Optional[int]] = None  # positions of each sequence its chunked prefill works on at once

    @property
    def stored(self) -> Tuple[int, Tuple[int, ...]]:
        raise NotImplementedError

    @property
    def rotary_dim(self) -> int:
        """The width rotary embeddings rotate in this layer's queries and keys (0: none)."""
        raise NotImplementedError

    @property
    def state(self) -> Optional[State]:
        """The constant state a sequence holds here (None for K/V layers; see state_cache.StateLayer)."""
        return None

    # ---- bytes -------------------------------------------------------------------------------

    def positions_held(self, seq_len: float) -> float:
        """Positions of a sequence of ``seq_len`` the layer's cache holds (and a step reads)."""
        return seq_len if self.window is None else min(seq_len, self.window)

    def bytes_per_position(self, element: int, cache_dtype: str = "auto") -> int:
        """Bytes one cached position takes (0 where the layer reads another layer's cache)."""
        return 0 if self.kv_source is not None else self.position_bytes(element, cache_dtype)

    def position_bytes(self, element: int, cache_dtype: str = "auto") -> int:
        """Bytes of one position of what the layer attends over, wherever it is held."""
        heads, widths = self.stored
        return heads * sum(element_bytes(w, element, cache_dtype) for w in widths)

    def state_bytes(self, element: int, cache_dtype: str = "auto") -> int:
        """Bytes a sequence holds whatever its length (a recurrent state); none for K/V layers."""
        return 0 if self.state is None else self.state.nbytes(element)

    def sequence_bytes(self, seq_len: float, element: int, cache_dtype: str = "auto") -> float:
        """Bytes one sequence of ``seq_len`` positions holds in this layer."""
        return self.positions_held(seq_len) * self.bytes_per_position(element, cache_dtype) + \
            self.state_bytes(element, cache_dtype)

    def read_bytes(self, context: float, element: int, cache_dtype: str = "auto") -> float:
        """Bytes a decode step of one sequence reads at ``context`` positions, its new token's included."""
        return self.positions_held(context) * self.position_bytes(element, cache_dtype) + \
            self.state_bytes(element, cache_dtype)

    def step_flops(self, context: float) -> float:
        """Attention FLOPs (QK^T and PV; projections are the model's) of one decode step at ``context``."""
        raise NotImplementedError

    # ---- what a layer keeps of a sequence ----

    @property
    def retention(self) -> Tuple[int, ...]:
        """Which positions the layer keeps, as a key that groups layers (a serving store's group) and
        sorts full attention first: (0,) every position, (1, W) the last W."""
        return (0,) if self.window is None else (1, self.window)

    @property
    def keeps_every_position(self) -> bool:
        """Whether every query sees every earlier key (no window cuts them: SDPA's causal rule)."""
        return self.window is None

    def sees(self, query: Any, key: Any) -> Any:
        """Whether query position ``query`` sees key position ``key``: k <= q, and with a window W
        also k > q - W (transformers' ``sliding_window_overlay``)."""
        seen = key <= query
        return seen if self.window is None else seen & (key > query - self.window)

    def first_kept(self, length: int) -> int:
        """The first position a query at ``length`` or later still sees (window W: length - W + 1)."""
        return 0 if self.window is None else max(0, length - self.window + 1)

    def most_kept(self, length: int, chunk: int = 1) -> int:
        """Most positions held while a sequence grows to ``length`` in forwards of ``chunk``: all, or W - 1 + chunk."""
        return length if self.window is None else min(length, self.window - 1 + chunk)

    def keeps_ring(self, max_seq_len: int) -> bool:
        """Whether a static cache of ``max_seq_len`` keeps this layer's positions in a ring (slot p % W)."""
        return self.window is not None and self.window < max_seq_len

    def layers_text(self) -> str:
        """How a group of layers that keep what this one keeps is named in a sentence."""
        return "full layers" if self.window is None else f"layers of window {self.window}"

    # ---- what it is and what it runs with ----------------------------------------------------

    def fields(self) -> Dict[str, Any]:
        """The fields that name the layer (its label's parts, table columns)."""
        return {**({} if self.window is None else {"window": self.window}),
                **({} if self.kv_source is None else {"kv_source": self.kv_source})}

    def as_mha(self) -> "LayerLayout":
        """The same layer as full MHA (a K and V head per query head, no window): what ratios compare to."""
        raise NotImplementedError

    def check(self, settings: Mapping[str, Any]) -> None:
        """Refuse a setting this layer does not run with (:func:`check_limits`)."""
        check_limits([self], settings)

    def limits(self, index: Optional[int] = None) -> Tuple[Limit, ...]:
        """What the layer does not run with (each :class:`Limit` says why), as layer ``index`` of its model."""
        return (self._window_limits() + (() if self.kv_source is None else self._shared_limits(index))
                + self._precision_limits())

    def _precision_limits(self) -> Tuple[Limit, ...]:
        """A 4-bit cache.dtype whose blocks (or rotation) do not fit a stored width: one Limit each,
        so the refusal names the dtype asked and the width."""
        refused = {}
        for dtype in FP4_BLOCK:
            whys = [block_refusal(w, dtype, name) for w, name in zip(self.stored[1], self.width_names)]
            refused[dtype] = next((why for why in whys if why), "")
        fits = [d for d in CACHE_DTYPES if d != "auto" and not refused.get(d)]
        return tuple(Limit("cache.dtype", None, f"{why}; use cache.dtype={_one_of(fits or ['auto'])}",
                           refuses=(dtype,))
                     for dtype, why in refused.items() if why)

    def _shared_limits(self, index: Optional[int]) -> Tuple[Limit, ...]:
        why = (f"{'a layer' if index is None else f'layer {index}'} reads layer {self.kv_source}'s K/V "
               "(attention.kv_shared_layers): cross-layer KV sharing is not built for")
        return (Limit("runtime.compile", ("false", "default"), f"{why} the fixed-shape step; use false or default"),
                Limit("cache.shared", (False, None), f"{why} a shared prefix; use cache.shared=false"))

    def _window_limits(self) -> Tuple[Limit, ...]:
        if self.window is None:
            return ()
        W = self.window
        return (Limit("cache.impl", ("static", "none"),
                      f"keeps every position; with attention.window={W} use cache.impl=static (a ring of W "
                      "positions per local layer) or none"),
                Limit("runtime.compile", ("false", "default"),
                      f"is not supported with a sliding window (attention.window={W}): the fixed-shape step reads "
                      "a context bucket, a ring is read whole; use false or default"))

    # ---- what the tasks ask of it ----

    # attention.* keys beyond the model's shape that size weights and cache (a memory refusal names them)
    size_keys: ClassVar[Tuple[str, ...]] = ()
    # a decode step's forms of the same arithmetic (the first decodes, fidelity steps the second after it)
    decode_forms: ClassVar[Tuple[str, ...]] = ()

    # ---- how inspect describes it ----

    note: ClassVar[str] = ""  # said once beside inspect's table of kinds of layer when one is present

    def table_name(self) -> str:
        """The layer's row name in inspect's table of kinds of layer."""
        return "global" if self.window is None else f"local W={self.window}"

    def in_words(self) -> str:
        """The layer's layout in a few words (inspect's name for a model's own layout)."""
        raise NotImplementedError

    def describe_layers(self, layers: "Layouts", attention: Any, seq_len: int, batch_size: int) -> List[str]:
        """Lines naming the attention of ``layers`` (led by this kind), then its cache formula."""
        raise NotImplementedError

    def memory_lines(self, layers: "Layouts", dtype: str, element: int) -> List[str]:
        """Lines of this kind of layer after inspect's memory table (in ``dtype``, ``element`` bytes)."""
        return []

    def closing_lines(self, layers: "Layouts", seq_len: int, dtype: str, element: int) -> List[str]:
        """Lines of this kind of layer at the end of inspect's text."""
        return []


def check_limits(layers: Sequence[LayerLayout], settings: Mapping[str, Any]) -> None:
    """Refuse, in one line naming key and value, the first setting a layer's :class:`Limit`s exclude.
    Each layout object is asked once, as the first layer that has it (layers of one shape share it)."""
    for index, layer in first_of_each(layers):
        for limit in layer.limits(index):
            if limit.key not in settings:
                continue
            asked = settings[limit.key]
            if not isinstance(asked, Asked):
                asked = Asked(asked, f"{limit.key}={asked!r}")
            if limit.excludes(asked.value):
                instead = asked.instead and f"; {asked.instead}"
                raise ConfigError(f"{limit.names or asked.named}: {limit.why}{instead}")


def first_of_each(layers: Sequence[LayerLayout]) -> List[Tuple[int, LayerLayout]]:
    """``(position, layout)`` of each layout object's first layer, in order."""
    if isinstance(layers, Layouts):
        return [(index, layer) for index, layer, _ in layers.distinct]
    first: Dict[int, Tuple[int, LayerLayout]] = {}
    for index, layer in enumerate(layers):
        first.setdefault(id(layer), (index, layer))
    return list(first.values())


class Layouts(tuple):
    """The decoder's layers' layouts, in order, with the totals over them (each layout object's
    figure times the number of layers that have it)."""

    @cached_property
    def distinct(self) -> Tuple[Tuple[int, LayerLayout, int], ...]:
        """``(first position, layout, layers)`` of each layout object, in order of first position."""
        if self and self.count(self[0]) == len(self):  # every layer alike (compared by identity first)
            return ((0, self[0], len(self)),)
        counts = Counter(map(id, self))
        first: Dict[int, int] = {}
        for index, layer in enumerate(self):  # until every object has been seen once
            if first.setdefault(id(layer), index) == index and len(first) == len(counts):
                break
        return tuple((index, self[index], counts[key]) for key, index in first.items())

    def unique(self) -> Tuple[LayerLayout, ...]:
        """Each layout object once, in order of its first layer."""
        return tuple(layer for _, layer, _ in self.distinct)

    def _total(self, figure) -> Any:
        """The sum over the layers of ``figure(layer)``."""
        return sum(n * figure(layer) for _, layer, n in self.distinct)

    def kinds(self) -> Tuple[str, ...]:
        return tuple(dict.fromkeys(layer.kind for layer in self.unique()))

    @property
    def windows(self) -> Tuple[Optional[int], ...]:
        return tuple(layer.window for layer in self)

    def cache_bytes(self, seq_len: float, batch_size: int, element: int, cache_dtype: str = "auto") -> int:
        """Bytes ``batch_size`` sequences of ``seq_len`` hold: 2 · layers · kv_heads · head_dim · seq_len ·
        batch · bytes, each layer with its own positions (a window's W) and widths (MLA's latent)."""
        return int(batch_size * self._total(lambda layer: layer.sequence_bytes(seq_len, element, cache_dtype)))

    def bytes_per_token(self, element: int, cache_dtype: str = "auto") -> int:
        """Bytes one more token adds while no window is full (past it a local layer adds nothing)."""
        return self._total(lambda layer: layer.bytes_per_position(element, cache_dtype))

    def state_bytes(self, element: int, cache_dtype: str = "auto") -> int:
        """Bytes a sequence holds whatever its length."""
        return self._total(lambda layer: layer.state_bytes(element, cache_dtype))

    def step_flops(self, context: float) -> float:
        """Attention FLOPs of one decode step of one sequence at ``context`` positions."""
        return self._total(lambda layer: layer.step_flops(context))

    def read_bytes(self, context: float, batch_size: int, element: int, cache_dtype: str = "auto") -> int:
        """Bytes one decode step of ``batch_size`` sequences reads from their caches at ``context``."""
        return int(batch_size * self._total(lambda layer: layer.read_bytes(context, element, cache_dtype)))

    def check(self, settings: Mapping[str, Any]) -> None:
        """Refuse a setting some layer does not run with (:func:`check_limits`)."""
        check_limits(self, settings)

    def as_mha(self) -> "Layouts":
        mha = {id(layer): layer.as_mha() for layer in self.unique()}
        return Layouts(mha[id(layer)] for layer in self)

    def rotary_dim(self) -> int:
        """Width of the decoder's one rotary table: the widest any layer rotates (0: none does)."""
        return max((layer.rotary_dim for layer in self.unique()), default=0)

    def smallest_window(self) -> Optional[int]:
        return min((layer.window for layer in self.unique() if layer.window is not None), default=None)

    def accepts(self, settings: Mapping[str, Any]) -> bool:
        """Whether every layer runs with ``settings`` (:meth:`check` would refuse nothing)."""
        try:
            self.check(settings)
        except ConfigError:
            return False
        return True

    # ---- what the tasks ask of them ----

    def converts_kv_heads(self) -> bool:
        """Whether every layer takes a checkpoint's K/V heads repeated or mean-pooled (its ``kv_conversion``
        Limit: checkpoint.convert_kv_heads)."""
        return self.accepts({"kv_conversion": "mean-pool"})

    def size_keys(self) -> Tuple[str, ...]:
        return tuple(dict.fromkeys(key for layer in self.unique() for key in layer.size_keys))

    def decode_forms(self) -> Tuple[str, ...]:
        """The forms some layer's decode step has (:func:`kvbench.layouts.attention.decode_form`); () for none."""
        return next((layer.decode_forms for layer in self.unique() if layer.decode_forms), ())

    def caps_positions(self) -> bool:
        """Whether some layer's cache stops growing (a ring of W), so bytes per token fall with length."""
        return self.smallest_window() is not None

    # ---- how inspect describes them ----

    def precision_text(self, cache_dtype: str, dtype: str) -> str:
        """Which layers ``cache.dtype`` quantizes (those holding K/V) and which keep a state in its own
        dtype (a recurrent layer's: its ``state_dtype``, its convolution inputs in ``dtype``), in one line."""
        kv = [i for i, layer in enumerate(self) if layer.state is None and layer.kv_source is None]
        state = [i for i, layer in enumerate(self) if layer.state is not None]
        if cache_dtype == "auto":
            text = f"cache.dtype=auto: K/V in the compute dtype ({dtype}), nothing quantized"
        else:
            text = (f"cache.dtype={cache_dtype}: layers {index_text(kv)} ({len(kv)} of {len(self)}) store K/V as "
                    f"{STORED_AS[cache_dtype]}")
        if state:
            kinds = " / ".join(dict.fromkeys(self[i].kind for i in state))
            text += (f"; the {len(state)} {kinds} layers ({index_text(state)}) keep their state unquantized: "
                     f"recurrent state {' / '.join(dict.fromkeys(self[i].state.state_dtype for i in state))}, "
                     f"convolution inputs {dtype}")
        return text

    def describe(self, attention: Any, seq_len: int, batch_size: int) -> List[str]:
        """The attention's line and cache formula, said by the first layer that attends."""
        lead = next((layer for layer in self if layer.state is None), self[0])
        return lead.describe_layers(self, attention, seq_len, batch_size)

    def in_words(self) -> Optional[str]:
        """The attention in a few words (``4 KV heads``); None when no layer attends."""
        lead = next((layer for layer in self if layer.state is None), None)
        return None if lead is None else lead.in_words()

    def _leads(self) -> List[LayerLayout]:
        """One layer of each kind, those holding a state first."""
        leads: Dict[type, LayerLayout] = {}
        for layer in sorted(self.unique(), key=lambda layer: layer.state is None):
            leads.setdefault(type(layer), layer)
        return list(leads.values())

    def memory_lines(self, seq_len: int, dtype: str, element: int) -> List[str]:
        """inspect's lines after its memory table: each kind's, then what a ring does to per token."""
        lines = [line for lead in self._leads() for line in lead.memory_lines(self, dtype, element)]
        if self.caps_positions() and not self.state_bytes(element):
            lines.append(f"per token (at {seq_len}): per sequence / {seq_len}; a local layer holds at most W of the "
                         f"positions, so it falls as seq_len grows (a position before any window fills: "
                         f"{bytes_cell(self.bytes_per_token(element))} in {dtype})")
        return lines

    def kind_notes(self) -> List[str]:
        """What inspect says before its table of kinds of layer (none: no such table)."""
        shared = sum(layer.kv_source is not None for layer in self)
        return ((["sliding window: a local layer holds min(seq_len, W) positions (a ring of W)"]  # not a chunk's
                 if any(layer.retention[0] == 1 for layer in self.unique()) else [])
                + ([f"cross-layer KV sharing: the last {shared} layers read the K/V of the last earlier layer of their "
                    "kind and hold none"] if shared else [])
                + list(dict.fromkeys(layer.note for layer in self if layer.note)))

    def closing_lines(self, seq_len: int, dtype: str, element: int) -> List[str]:
        return [line for lead in self._leads() for line in lead.closing_lines(self, seq_len, dtype, element)]


# ---- how inspect writes a layout's numbers ----

def bytes_cell(n: float) -> str:
    """``1536`` -> ``1.50 KiB (1,536)``; under 1 KiB ``512 B``; a mean of whole bytes (a windowed
    layout's per token) to the nearest byte, ``≈74,638`` (no tenth of a byte)."""
    whole = isinstance(n, int) or float(n).is_integer()
    exact = f"{int(n):,}" if whole else f"≈{round(n):,}"
    return f"{exact} B" if n < 1024 else f"{human_bytes(n)} ({exact})"


def _one_of(names: Sequence[str]) -> str:
    """``a, b or c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def fp4_bytes_lines(layers: "Layouts") -> List[str]:
    """The 4-bit cache.dtypes' bytes, for the layers that take them (inspect's formula lines)."""
    fits = [d for d in FP4_BLOCK if layers.accepts({"cache.dtype": d})]
    blocks = " / ".join(f"{FP4_BLOCK[d]} ({d})" for d in fits)
    return [f"cache.dtype {' / '.join(fits)}: bytes = 1/2 per element (two E2M1 codes a byte) + a 1-byte scale per "
            f"{blocks} values, K and V each"] if fits else []


def si(n: float) -> str:
    """``33554432`` -> ``33.6 M``: a count in decimal units, three significant digits."""
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:g}"


def elements_line(per_token: int, seq_len: int, batch_size: int, what: str = "K+V") -> str:
    """K and V (or latent) elements of one layer's cache per token, sequence and batch, before dtype bytes."""
    per_sequence = per_token * seq_len
    return (f"elements per layer ({what}): per token {per_token:,} · per sequence ({seq_len}) {per_sequence:,} "
            f"≈ {si(per_sequence)} · per batch (x{batch_size}) {per_sequence * batch_size:,} "
            f"≈ {si(per_sequence * batch_size)}")
