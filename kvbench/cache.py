"""KV caches behind one interface: a model's cache is one :class:`LayerCache` per decoder layer
(made by that layer's layout, :mod:`kvbench.layouts`), and every one of them answers

    update(k, v, pos) -> Attend(k, v, mask, causal, prefix)

``k``, ``v``: the new keys and values of T tokens, (B, H_kv, T, D) (``v`` None: the layout stores
one tensor, MLA); ``pos``: their :class:`Positions`. The result is what the layer attends over:
keys and values (B, H_kv, S, D), the mask over them (None: every key; ``causal``: SDPA's causal
path, the keys being exactly the new tokens) and a batch-1 prefix every sequence attends first.
Prefill, decode, a shared prefix, the fixed-shape compiled step and the serving store's batches
all go through it; every mask is :func:`visible`'s, the rule of the layer's layout. A layer that
reads another layer's K/V (cross-layer sharing) has a :class:`~kvbench.shared_kv.SharedLayer`,
which answers with its donor's answer. A layer that holds a constant state instead of K/V
(Gated DeltaNet) has a :class:`~kvbench.state_cache.StateLayer`, the same question answered
for a recurrence: ``update(x, pos) -> Carry`` (what it continues from).

``cache.impl``:
- ``static``: per layer a preallocated (B, H_kv, S_max, D) K and V (:class:`~kvbench.kv_store.KVStore`,
  also int8 / float8 codes) written in place, a ring where a layer keeps fewer positions (:class:`RingLayer`);
  a decode step allocates nothing (gpt-fast's layout, torchtune's overflow errors). It lends a
  fixed-shape view for a compiled step (:meth:`Cache.fixed`).
- ``concat``: grows with ``torch.cat`` every step (a baseline); ``none``: holds nothing (recomputed).
:class:`~kvbench.shared_prefix.SharedPrefixCache` puts a prefix held once (a system prompt) before
a static or concat cache of each conversation's own history.

Notation: B batch, T new tokens, S keys attended, H_kv KV heads, D width, P a prefix, R a ring's positions.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from kvbench.core.dtypes import CACHE_IMPLS
from kvbench.core.hooks import resolve
from kvbench.kv_store import KVStore
from kvbench.shared_kv import SharedLayer, link
from kvbench.state_cache import StateLayer

Runs = Sequence[Tuple[int, int]]  # runs of key positions, (first, count) each, in the order of the keys


class Positions:
    """The positions of T new tokens. ``ids`` is always a tensor, (T,) or (B, T) (rotary rows,
    masks, index writes); ``start``, the first of them as a Python int, where the host knows it
    (eager steps slice the cache with it), None in a fixed-shape step, where the position is data
    and nothing may depend on its value."""

    __slots__ = ("start", "T", "device", "_ids")

    def __init__(self, start: Optional[int], T: int, device: torch.device | str = "cpu",
                 ids: Optional[torch.Tensor] = None):
        self.start, self.T, self.device, self._ids = start, T, device, ids

    @classmethod
    def of(cls, ids: torch.Tensor) -> "Positions":
        """Positions given as a tensor only (a compiled step's, a serving batch's (B, T))."""
        return cls(None, ids.shape[-1], ids.device, ids)

    @property
    def ids(self) -> torch.Tensor:
        if self._ids is None:  # made on demand: a plain decode step never needs it
            self._ids = torch.arange(self.start, self.start + self.T, device=self.device)
        return self._ids

    @property
    def end(self) -> int:
        return self.start + self.T

    @property
    def rows(self):
        """Which rows of the rotary tables the tokens take: a slice (a view, no gather) unless the
        positions were given as a tensor."""
        return slice(self.start, self.end) if self._ids is None else self._ids

    def shifted(self, offset: int) -> "Positions":
        return Positions(self.start + offset, self.T, self.device)


class Attend(NamedTuple):
    """What one layer attends over (see the module's docstring)."""

    k: torch.Tensor
    v: Optional[torch.Tensor]
    mask: Optional[torch.Tensor] = None
    causal: bool = False
    prefix: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = None


def sees(layout, query, key):
    """Whether a query at position ``query`` sees the key at ``key`` (numbers or tensors): the
    rule of ``layout`` (:meth:`~kvbench.layouts.base.LayerLayout.sees`); None: every key at or
    before it."""
    return key <= query if layout is None else layout.sees(query, key)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, layout=None) -> torch.Tensor:
    """(..., T, S) bool, True = attend: which keys each query sees by :func:`sees`.
    q_pos (..., T), k_pos (..., S)."""
    return sees(layout, q_pos[..., :, None], k_pos[..., None, :])


def causal_mask(T: int, S: int, device, layout=None, key_start: Optional[int] = None,
                query_start: Optional[int] = None) -> torch.Tensor:
    """(T, S) :func:`visible` for keys at positions ``key_start`` .. + S - 1 and queries at
    ``query_start`` .. + T - 1 (default: keys 0..S-1, the queries the last T of them: bottom-right
    causal, new token i at key index S - T + i)."""
    key_start = 0 if key_start is None else key_start
    query_start = key_start + S - T if query_start is None else query_start
    return visible(torch.arange(query_start, query_start + T, device=device),
                   torch.arange(key_start, key_start + S, device=device), layout)


def mask_over(pos: Positions, runs: Runs, layout=None) -> Tuple[Optional[torch.Tensor], bool]:
    """(mask, causal) for queries at ``pos`` over keys at the positions ``runs``: no mask where
    every key is visible to every query (a decode step), SDPA's causal path where the keys are
    exactly the queries and the layout keeps every position, else :func:`visible`'s (T, S) mask."""
    first, last = min(s for s, _ in runs), max(s + n - 1 for s, n in runs)
    if sees(layout, pos.start, last) and sees(layout, pos.end - 1, first):  # the nearest and the farthest pair
        return None, False
    if (layout is None or layout.keeps_every_position) and len(runs) == 1 and runs[0] == (pos.start, pos.T):
        return None, True
    keys = torch.cat([torch.arange(s, s + n, device=pos.device) for s, n in runs])
    return visible(torch.arange(pos.start, pos.end, device=pos.device), keys, layout), False


class LayerCache:
    """One layer's cache. :meth:`store` keeps the new K/V and returns the keys to attend over
    with the runs of their positions; :meth:`update` adds the mask, by the rule of ``layout`` (the
    layer's :class:`~kvbench.layouts.base.LayerLayout`; None: every earlier key)."""

    layout = None

    def update(self, k: torch.Tensor, v: Optional[torch.Tensor], pos: Positions) -> Attend:
        keys, values, runs = self.store(k, v, pos)
        return Attend(keys, values, *mask_over(pos, runs, self.layout))

    def store(self, k, v, pos: Positions):
        raise NotImplementedError

    def tensors(self) -> List[torch.Tensor]:
        return []

    def truncate(self, length: int, held: int) -> None:
        """Forget positions >= ``length`` of the ``held`` ones."""

    def fixed_view(self, length: int) -> "FixedLayer":
        """This layer as a fixed-shape step reads it: its first ``length`` positions."""
        raise ValueError("cache.impl has no fixed-shape view (its keys are not preallocated); use cache.impl=static")


class Uncached(LayerCache):
    """No history: the tokens attend to each other (``cache.impl=none``, a forward without a
    cache). ``mask``: one given by the caller instead of the causal one (an ablation)."""

    def __init__(self, layout=None, mask: Optional[torch.Tensor] = None):
        self.layout, self.mask = layout, mask

    def update(self, k, v, pos):
        if self.mask is not None:
            return Attend(k, v, self.mask)
        return super().update(k, v, pos)

    def store(self, k, v, pos):
        return k, v, [(pos.start, pos.T)]


class StaticLayer(LayerCache):
    """Positions 0..S_max-1 preallocated, written in place; a read is a view (auto) of the
    positions held."""

    def __init__(self, stores: List[KVStore], layout=None):
        self.stores, self.layout = stores, layout  # K and V, or the layout's one stored tensor

    def store(self, k, v, pos):
        out = []
        for store, x in zip(self.stores, (k, v)):
            store.write(pos.start, x)
            out.append(store.read(pos.end, k.shape[0]))
        return out[0], out[1] if len(out) > 1 else None, [(0, pos.end)]

    def tensors(self):
        return [t for s in self.stores for t in s.tensors()]

    def fixed_view(self, length):
        return FixedLayer(self.stores, length)


class RingLayer(StaticLayer):
    """A layer that keeps only its last R positions: position p lives at index p % R. A decode step
    reads the slots of the keys it sees (a full window's ring whole, in any order; a chunk's from slot 0); a
    prompt of T > 1 tokens reads the held positions its first query still sees (the layout's
    ``first_kept(start)`` .. start - 1), in order before its own T keys, gathered before they are
    overwritten."""

    def store(self, k, v, pos):
        R, B, T, start, end = self.stores[0].length, k.shape[0], pos.T, pos.start, pos.end
        new = (k, v)[:len(self.stores)]
        if T == 1:
            for store, x in zip(self.stores, new):  # one position: a slice write, no index tensor
                store.write(start % R, x)
            held = end - self.layout.first_kept(start)  # a window's min(end, R); a chunk's own, from slot 0
            out = [store.read(held, B) for store in self.stores]
            runs = [(end - held, held)]
        else:
            first = self.layout.first_kept(start)
            earlier = torch.arange(first, start, device=k.device) % R
            old = [store.gather(earlier, B) for store in self.stores]
            kept = min(T, R)  # of a prompt longer than R only its last R positions stay
            slots = torch.arange(end - kept, end, device=k.device) % R
            for store, x in zip(self.stores, new):
                store.write(slots, x[:, :, T - kept:])
            out = [torch.cat([o, x], dim=2) for o, x in zip(old, new)]  # (B, H_kv, S, D), S <= R - 1 + T
            runs = [(first, end - first)]
        return out[0], out[1] if len(out) > 1 else None, runs

    def fixed_view(self, length):
        raise ValueError("a ring cache (a local layer's) has no fixed-shape view (its rings are read whole); "
                         "use runtime.compile=false|default")

    def refusal(self, length, held) -> Optional[str]:
        """A ring keeps only R positions: rolling back is refused where a later position
        overwrote one the next step must see (p is lost once p + R was written)."""
        R, first = self.stores[0].length, self.layout.first_kept(length)
        return (f"cannot truncate to {length}: a ring of {R} positions already overwrote position {first} ({held} "
                "written); only reset() or a roll back within the ring works") if length and first + R < held else None


class ConcatLayer(LayerCache):
    """The naive cache: every step allocates a new, one-longer K and V with ``torch.cat``."""

    def __init__(self, heads: int, widths: Sequence[int], layout=None):
        self.heads, self.widths = heads, tuple(widths)  # what a position of each tensor holds
        self.layout = layout
        self.held: List[Optional[torch.Tensor]] = [None] * len(widths)

    def store(self, k, v, pos):
        for i, x in enumerate((k, v)[:len(self.held)]):
            old = self.held[i]
            # After a roll back the stored tensors can be longer than the start.
            self.held[i] = x if pos.start == 0 or old is None else torch.cat([old[:, :, :pos.start], x], dim=2)
        return self.held[0], self.held[1] if len(self.held) > 1 else None, [(0, pos.end)]

    def truncate(self, length, held):
        self.held = [None if t is None else t[:, :, :length].clone() for t in self.held]

    def tensors(self):
        return [t for t in self.held if t is not None]


class FixedLayer(LayerCache):
    """A static layer as a fixed-shape decode step sees it: K/V written at a position given as a
    tensor, and always the first ``length`` positions read, those after the position masked.

    Only ``length`` is a Python value, fixed per context bucket; the position is data. So a step
    compiled for a bucket has the same shapes and constants at every position of it: one graph (on
    a GPU one CUDA graph) per bucket, reading ``length`` positions per KV head (the roofline counts
    those, not the context). ``prefix``: a shared prefix's K/V (1, H_kv, P, D), attended first;
    positions are then absolute and the storage holds position p at index p - P."""

    def __init__(self, stores: List[KVStore], length: int, prefix=None):
        self.stores, self.length, self.prefix = stores, length, prefix
        self.offset = 0 if prefix is None else prefix[0].shape[2]

    def update(self, k, v, pos):
        index = pos.ids - self.offset if self.offset else pos.ids
        out = []
        for store, x in zip(self.stores, (k, v)):
            store.write(index, x)
            out.append(store.codes[:, :, :self.length])
        mask = visible(pos.ids, torch.arange(self.offset + self.length, device=pos.ids.device))  # (1, P + length)
        return Attend(out[0], out[1] if len(out) > 1 else None, mask, False, self.prefix)


def bucket_length(end: int, bucket: int, capacity: int) -> int:
    """Positions a fixed-shape step reads when ``end`` positions are held: the first multiple of
    ``bucket`` that holds them, at most ``capacity`` (the cache's length)."""
    return min(capacity, -(-end // bucket) * bucket)


class Cache:
    """A model's cache: its layers' caches, the batch and positions they hold, and the checks a
    forward's positions must pass before any layer writes (:meth:`begin`)."""

    def __init__(self, impl: str, layers: List[LayerCache], batch_size: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", cache_dtype: str = "auto"):
        self.impl, self.layers, self.batch_size, self.max_seq_len = impl, layers, batch_size, max_seq_len
        self.dtype, self.device = dtype, torch.device(device)  # what attention reads
        self.cache_dtype = cache_dtype  # how K/V are stored (cache.dtype)
        self.length = 0  # positions held
        self._fixed_views = {}

    @property
    def stores_history(self) -> bool:
        """False: the generator must re-feed the whole sequence."""
        return self.impl != "none"

    def begin(self, pos: Positions, batch_size: int) -> List[LayerCache]:
        """The layers' caches for a forward of ``batch_size`` sequences at ``pos``, its bounds checked."""
        if batch_size > self.batch_size:
            raise ValueError(f"batch of {batch_size} sequences exceeds the cache's batch_size={self.batch_size}")
        if pos.end > self.max_seq_len:
            raise ValueError(f"KV cache overflow: positions {pos.start}..{pos.end - 1} do not fit in "
                             f"max_seq_len={self.max_seq_len}")
        if pos.start > self.length:
            raise ValueError(f"KV cache gap: writing at position {pos.start} but only "
                             f"{self.length} positions are held")
        if not self.stores_history and pos.start != 0:
            raise ValueError("cache.impl='none' keeps no history: feed the whole sequence from position 0")
        return self.layers

    def commit(self, pos: Positions) -> None:
        """After the forward: the positions up to ``pos``'s last are held."""
        if self.stores_history:
            self.length = pos.end

    def truncate(self, length: int) -> None:
        """Forget positions >= ``length`` (roll back); the next write starts there."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate to {length}: the cache holds {self.length} positions")
        # every layer's refusal (a ring's, a state's) first: a refused roll back changes no layer's positions
        why = next(filter(None, (getattr(layer, "refusal", lambda *_: None)(length, self.length)
                                 for layer in self.layers)), None)
        if why:
            raise ValueError(why)
        for layer in self.layers:
            layer.truncate(length, self.length)
        self.length = length

    def reset(self) -> None:
        self.truncate(0)

    def rewind(self, length: int) -> None:
        """Move back to ``length`` positions to repeat steps whose cost, not their output, is
        timed: a roll back where every layer allows one; a ring that a later position already
        overwrote still reads as many keys at the repeated positions (min(position + 1, R)), so
        there only the held length moves back."""
        try:
            self.truncate(length)
        except ValueError:
            self.length = length

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage this cache holds right now."""
        return sum(t.untyped_storage().nbytes() for t in self.tensors())

    def tensors(self) -> List[torch.Tensor]:
        return [t for layer in self.layers for t in layer.tensors()]

    def fixed(self, start_pos: int, batch_size: int, bucket: int) -> "FixedCache":
        """The :class:`FixedCache` a fixed-shape decode step of ``batch_size`` sequences at
        ``start_pos`` writes and reads (the first multiple of ``bucket`` positions that holds it,
        at most ``max_seq_len``); the position counts as held from here on."""
        self._check_fixed(batch_size)
        fixed = self._fixed(bucket_length(start_pos + 1, bucket, self.max_seq_len))
        self.begin(Positions(start_pos, 1), batch_size)
        self.length = start_pos + 1
        return fixed

    def _check_fixed(self, batch_size: int) -> None:
        if self.impl != "static":
            raise ValueError(f"cache.impl={self.impl!r} has no fixed-shape view (its keys are not "
                             "preallocated); use cache.impl=static")
        if self.cache_dtype != "auto":
            raise ValueError(f"cache.dtype={self.cache_dtype!r} has no fixed-shape view (a compiled step "
                             "would write unquantized K/V into its codes); use cache.dtype=auto")
        if batch_size != self.batch_size:
            raise ValueError(f"a fixed-shape step writes all {self.batch_size} sequences of the cache, "
                             f"got a batch of {batch_size}")

    def _fixed(self, length: int) -> "FixedCache":
        # One view per length: a compiled step then sees the same object at every step.
        if length not in self._fixed_views:
            self._fixed_views[length] = FixedCache([layer.fixed_view(length) for layer in self.layers], length)
        return self._fixed_views[length]


class FixedCache:
    """A static cache as a fixed-shape step sees it: :class:`FixedLayer` views of one context
    bucket; bounds and the held length were settled by :meth:`Cache.fixed`."""

    stores_history = True

    def __init__(self, layers: List[FixedLayer], length: int):
        self.layers, self.length = layers, length

    def begin(self, pos: Positions, batch_size: int) -> List[LayerCache]:
        return self.layers

    def commit(self, pos: Positions) -> None:
        pass


def make_cache(impl: str, layouts: Sequence, batch_size: int, max_seq_len: int,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               cache_dtype: str = "auto") -> Cache:
    """The cache named ``impl`` (static | concat | none) for ``layouts`` (the decoder's layer
    layouts: each makes its own layer's cache), storing K/V in ``cache_dtype`` (auto: ``dtype``;
    int8 / float8_e4m3fn: static only)."""
    if impl not in CACHE_IMPLS:
        raise ValueError(f"cache.impl={impl!r}: must be one of {', '.join(CACHE_IMPLS)}")
    if cache_dtype != "auto" and impl != "static":
        raise ValueError(f"cache.dtype={cache_dtype!r} needs a preallocated cache: cache.impl={impl!r} "
                         "stores K/V as given; use cache.impl=static")
    device = torch.device(device)
    layers = link(layouts, [layer_cache(layout, impl, batch_size, max_seq_len, dtype, device, cache_dtype)
                            for layout in layouts])
    return Cache(impl, layers, batch_size, max_seq_len, dtype, device, cache_dtype)


def layer_cache(layout, impl: str, batch_size: int, max_seq_len: int, dtype: torch.dtype,
                device: torch.device, cache_dtype: str = "auto") -> LayerCache:
    """One layer's cache of ``impl`` for what its layout stores per position: a ring where it keeps fewer
    positions than the cache holds, else every position (static) or a growing tensor (concat); none holds
    nothing. A layer with a constant state holds it; one whose layout names its own CACHE class, that."""
    layout.check({"cache.impl": impl, "cache.dtype": cache_dtype})
    heads, widths = layout.stored
    if impl == "none" or layout.kv_source is not None:
        return uncached(layout)
    if getattr(layout, "CACHE", ""):  # a layer that keeps more than K/V positions (a ring beside a pool): its own
        return resolve(layout.CACHE)(layout, batch_size, max_seq_len, dtype, device)
    if layout.state is not None:
        return StateLayer(layout.state, batch_size, dtype, device)
    if impl == "concat":
        return ConcatLayer(heads, widths, layout)
    ring = layout.keeps_ring(max_seq_len)
    length = layout.positions_held(max_seq_len) if ring else max_seq_len
    stores = [KVStore((batch_size, heads, length, w), cache_dtype, dtype, device) for w in widths]
    return (RingLayer if ring else StaticLayer)(stores, layout)


def uncached(layout, mask: Optional[torch.Tensor] = None) -> LayerCache | StateLayer:
    """A layer's cache that holds nothing (``cache.impl=none``, a forward without a cache); ``mask``
    as :class:`Uncached`'s (a recurrent layer reads no keys: it does not apply there)."""
    if layout.kv_source is not None:
        return SharedLayer()  # its donor's, once linked (:func:`kvbench.shared_kv.link`)
    return Uncached(layout, mask) if layout.state is None else StateLayer(layout.state, 0, torch.float32,
                                                                                  "cpu", held=False)


def uncached_layers(layouts: Sequence, mask: Optional[torch.Tensor] = None) -> List:
    """Every layer's :func:`uncached` cache, shared layers reading their donors' (a forward without a cache)."""
    return link(layouts, [uncached(layout, mask) for layout in layouts])


def cache_for(model, impl: str, batch_size: int, max_seq_len: int, cache_dtype: str = "auto") -> Cache:
    """A cache shaped for ``model`` (a :class:`kvbench.model.Decoder`) in its dtype and device."""
    return make_cache(impl, model.layouts, batch_size, max_seq_len, model.dtype, model.device, cache_dtype)
