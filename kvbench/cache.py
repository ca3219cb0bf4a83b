"""KV caches behind one interface, chosen by name (``cache.impl``).

- ``static``: per layer a preallocated (B, H_kv, S_max, D) K and V written in place at explicit
  positions; a decode step allocates nothing (gpt-fast's layout, torchtune's overflow errors).
- ``concat``: the textbook cache that grows with ``torch.cat`` every step (a baseline).
- ``none``: holds nothing; the caller recomputes the whole sequence every step.

Any of them (and the shared prefix) is a latent cache for MLA (``latent``): one tensor per layer,
(B, 1, S, R + d_rope), holding each token's latent and rotary key; ``update``'s ``v`` is None.

``update(layer, start_pos, k, v)`` stores the new keys/values of one layer at positions
``start_pos .. start_pos + T`` and returns the keys/values to attend over, (B, H_kv, S, D).

``cache.dtype`` (static caches and a shared prefix): ``auto`` stores K/V in the compute dtype;
``int8`` and ``float8_e4m3fn`` store codes with a float32 scale per (sequence, KV head, position),
quantized on write (:func:`quantize`) and dequantized on read (:func:`dequantize`); see
:class:`KVStore`.

A static cache (alone or under a shared prefix) also lends a :class:`FixedWindow` for a
fixed-shape decode step (``window``): the step's position is a tensor and the keys it reads a
fixed bucket of positions, so one compiled graph (one CUDA graph) serves every step of a bucket.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from kvbench.config import CACHE_DTYPE_BYTES, CACHE_IMPLS
from kvbench.kv_store import SCALE_BYTES, KVStore, dequantize, quantize, storage_dtype  # noqa: F401 (re-exported)


def kv_cache_bytes(num_layers: int, num_kv_heads: int, head_dim: int, seq_len: int,
                   batch_size: int, bytes_per_element: int, cache_dtype: str = "auto",
                   windows: Optional[Sequence[Optional[int]]] = None, *,
                   latent: bool = False, v_head_dim: Optional[int] = None) -> int:
    """The one KV-bytes formula (inspect, the record, capacity and the roofline all call it):
    kv_heads · batch · Σ over the stored tensors of (width · bytes per element + scale bytes) · the
    sum over layers of min(seq_len, W_layer). K and V of ``head_dim`` each (V of ``v_head_dim`` when
    it differs: MLA's heads expanded), or with ``latent`` one tensor of ``head_dim`` =
    kv_lora_rank + qk_rope_head_dim and ``num_kv_heads`` = 1 (MLA's cache).

    ``cache_dtype`` auto: elements of ``bytes_per_element`` (the compute dtype), no scales;
    int8 / float8_e4m3fn: 1-byte codes and one float32 scale per (sequence, head, position).
    ``windows``: per layer the window W of a local layer (its ring holds at most W positions) or
    None for a global one; None: every layer global."""
    widths = [head_dim] if latent else [head_dim, head_dim if v_head_dim is None else v_head_dim]
    if cache_dtype == "auto":
        per_head = sum(widths) * bytes_per_element
    else:
        per_head = sum(widths) * CACHE_DTYPE_BYTES[cache_dtype] + SCALE_BYTES * len(widths)
    windows = [None] * num_layers if windows is None else windows
    if len(windows) != num_layers:
        raise ValueError(f"{len(windows)} layer windows for {num_layers} layers")
    positions = sum(seq_len if w is None else min(seq_len, w) for w in windows)
    return num_kv_heads * positions * batch_size * per_head


def layer_capacity(max_seq_len: int, window: Optional[int]) -> int:
    """Positions a layer's cache allocates: all ``max_seq_len``, or a local layer's W (a ring)."""
    return max_seq_len if window is None else min(max_seq_len, window)


def bucket_length(end: int, bucket: int, capacity: int) -> int:
    """Positions a fixed-shape step reads when ``end`` positions are held: the first multiple of
    ``bucket`` that holds them, at most ``capacity`` (the cache's length)."""
    return min(capacity, -(-end // bucket) * bucket)


class KVCache:
    """Common bookkeeping: shape, the number of positions held, bytes held."""

    impl = "base"
    stores_history = True  # False: the generator must re-feed the whole sequence

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 max_seq_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", cache_dtype: str = "auto",
                 windows: Optional[Sequence[Optional[int]]] = None, latent: bool = False):
        # latent: one tensor per layer (MLA's [c, k_rope], head_dim wide, one head); update's v is None
        self.latent = latent
        self.num_layers, self.batch_size, self.num_kv_heads = num_layers, batch_size, num_kv_heads
        # per layer: a local layer's window W (its cache keeps the last W positions) or None
        self.windows = list(windows) if windows is not None else [None] * num_layers
        if len(self.windows) != num_layers:
            raise ValueError(f"{len(self.windows)} layer windows for {num_layers} layers")
        if any(w is not None for w in self.windows) and self.impl not in ("static", "none", "shared"):
            raise ValueError(f"cache.impl={self.impl!r} keeps every position; a sliding window needs "
                             "cache.impl=static (a ring of W positions per local layer) or none")
        self.head_dim, self.max_seq_len = head_dim, max_seq_len
        self.dtype, self.device = dtype, torch.device(device)
        self.cache_dtype = cache_dtype  # how K/V are stored (cache.dtype); dtype: what attention reads
        if cache_dtype != "auto" and self.impl not in ("static", "shared"):
            raise ValueError(f"cache.dtype={cache_dtype!r} needs a preallocated cache: cache.impl={self.impl!r} "
                             "stores K/V as given; use cache.impl=static")
        self.length = 0  # positions held (after the last layer's update)
        self._windows: Dict[int, FixedWindow] = {}

    def _check(self, layer: int, start_pos: int, k: torch.Tensor) -> int:
        return self._check_positions(layer, start_pos, k.shape[0], k.shape[2])

    def _check_positions(self, layer: int, start_pos: int, B: int, T: int) -> int:
        end = start_pos + T
        if B > self.batch_size:
            raise ValueError(f"batch of {B} sequences exceeds the cache's batch_size={self.batch_size}")
        if end > self.max_seq_len:
            raise ValueError(f"KV cache overflow: positions {start_pos}..{end - 1} do not fit in "
                             f"max_seq_len={self.max_seq_len} (layer {layer})")
        if start_pos > self.length:
            raise ValueError(f"KV cache gap: writing at position {start_pos} but only "
                             f"{self.length} positions are held (layer {layer})")
        return end

    def _written(self, layer: int, end: int) -> None:
        if layer == self.num_layers - 1:
            self.length = end

    def truncate(self, length: int) -> None:
        """Forget positions >= ``length`` (roll back); the next write starts there."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate to {length}: the cache holds {self.length} positions")
        self.length = length

    def reset(self) -> None:
        self.truncate(0)

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage this cache holds right now."""
        return sum(t.untyped_storage().nbytes() for t in self.tensors())

    def tensors(self) -> List[torch.Tensor]:
        return []

    def shared_prefix(self, layer: int, start_pos: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """K/V (1, H_kv, P, D) every sequence attends before its own keys; None: no such prefix."""
        return None

    def window(self, start_pos: int, batch_size: int, bucket: int) -> "FixedWindow":
        """The :class:`FixedWindow` a fixed-shape decode step of ``batch_size`` sequences at
        ``start_pos`` writes and reads (the first multiple of ``bucket`` positions that holds it,
        at most ``max_seq_len``); the position counts as held from here on."""
        raise ValueError(f"cache.impl={self.impl!r} has no fixed-shape window (its keys are not "
                         "preallocated); use cache.impl=static")

    def _window(self, length: int, k, v, prefix=None) -> "FixedWindow":
        # One window object per length: a compiled step then sees the same object at every step.
        if length not in self._windows:
            self._windows[length] = FixedWindow(k, v, length, prefix)
        return self._windows[length]


class StaticKVCache(KVCache):
    """Preallocated (B, H_kv, S_max, D) per layer; in-place writes, views on read."""

    impl = "static"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        shape = (self.batch_size, self.num_kv_heads, self.max_seq_len, self.head_dim)
        # A local layer whose window is shorter than the cache holds a ring of W positions.
        self.rings = [w if w is not None and w < self.max_seq_len else None for w in self.windows]
        lengths = [layer_capacity(self.max_seq_len, w) for w in self.rings]
        store = lambda: KVStore(self.num_layers, shape, self.cache_dtype, self.dtype, self.device,  # noqa: E731
                                lengths)
        self.k_store, self.v_store = store(), None if self.latent else store()  # a latent cache: one store
        self.k = self.k_store.codes  # per layer (B, H_kv, S_max or W, D)
        self.v = None if self.v_store is None else self.v_store.codes

    def update(self, layer, start_pos, k, v):
        end = self._check(layer, start_pos, k)
        B = k.shape[0]
        W = self.rings[layer]
        if W is not None:
            return self._update_ring(layer, W, start_pos, end, k, v)
        self.k_store.write(layer, start_pos, k)
        if v is not None:
            self.v_store.write(layer, start_pos, v)
        self._written(layer, end)
        return self.k_store.read(layer, B, end), None if v is None else self.v_store.read(layer, B, end)

    def _update_ring(self, layer, W, start_pos, end, k, v):
        """A local layer: position p lives at index p % W. A decode step reads the whole ring (its
        W keys are exactly the step's window, in any order); a prompt of T > 1 tokens reads the
        held positions its first query still sees, max(0, start_pos - W + 1) .. start_pos - 1, in
        order before its own T keys, gathered before they are overwritten."""
        B, T = k.shape[0], k.shape[2]
        stores = [(self.k_store, k)] + ([] if v is None else [(self.v_store, v)])  # a latent ring: one store
        if T == 1:
            for store, new in stores:  # one position: a slice write, no index tensor on the decode step
                store.write(layer, start_pos % W, new)
            self._written(layer, end)
            held = min(end, W)  # before the ring fills, slots 0..end-1 hold positions 0..end-1
            out = [store.read(layer, B, held) for store, _ in stores]
        else:
            earlier = torch.arange(max(0, start_pos - W + 1), start_pos, device=k.device) % W
            old = [store.gather(layer, B, earlier) for store, _ in stores]
            kept = min(T, W)  # of a prompt longer than W only its last W positions stay
            slots = torch.arange(end - kept, end, device=k.device) % W
            for store, new in stores:
                store.write_slots(layer, slots, new[:, :, T - kept:])
            self._written(layer, end)
            out = [torch.cat([o, new], dim=2) for o, (_, new) in zip(old, stores)]  # (B, H_kv, S, D), S <= W - 1 + T
        return out[0], out[1] if len(out) > 1 else None

    def tensors(self):
        return self.k_store.tensors() + (self.v_store.tensors() if self.v_store else [])

    def truncate(self, length):
        """Roll back to ``length`` positions. A ring keeps only W positions: rolling back is refused
        where a later position overwrote one the next step must see (p is lost once p + W was
        written)."""
        for W in {w for w in self.rings if w is not None}:
            if length and max(0, length - W + 1) + W < self.length:
                raise ValueError(f"cannot truncate to {length}: a window of {W} positions already overwrote "
                                 f"position {max(0, length - W + 1)} ({self.length} written); only reset() "
                                 "or a roll back within the ring works")
        super().truncate(length)

    def window(self, start_pos, batch_size, bucket):
        if any(w is not None for w in self.rings):
            raise ValueError("a sliding-window cache has no fixed-shape window (its rings are read whole); "
                             "use runtime.compile=false|default")
        if self.cache_dtype != "auto":
            raise ValueError(f"cache.dtype={self.cache_dtype!r} has no fixed-shape window (a compiled step "
                             "would write unquantized K/V into its codes); use cache.dtype=auto")
        if batch_size != self.batch_size:
            raise ValueError(f"a fixed-shape step writes all {self.batch_size} sequences of the cache, "
                             f"got a batch of {batch_size}")
        end = self._check_positions(self.num_layers - 1, start_pos, batch_size, 1)
        self._written(self.num_layers - 1, end)
        return self._window(bucket_length(end, bucket, self.max_seq_len), self.k, self.v)


class FixedWindow:
    """A static cache as a fixed-shape decode step sees it: K/V written at a position given as a
    tensor, and always the first ``length`` positions read, those after the position masked.

    Only ``length`` is a Python value, fixed per window (a context bucket); the position is data.
    So a step compiled for a window has the same shapes and constants at every position of its
    bucket: one graph, and on a GPU one CUDA graph, per bucket, reading ``length`` positions per
    KV head (the roofline counts those, not the context). ``prefix``: a shared prefix's K/V lists
    (1, H_kv, P, D) per layer, attended first; positions are then absolute and the storage holds
    position p at index p - P.
    """

    def __init__(self, k: List[torch.Tensor], v: List[torch.Tensor], length: int,
                 prefix: Optional[Tuple[List[torch.Tensor], List[torch.Tensor]]] = None):
        self.k, self.v, self.length, self.prefix = k, v, length, prefix
        self.offset = 0 if prefix is None else prefix[0][0].shape[2]

    def update(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, H_kv, 1, D) at ``pos`` (1,); the window's keys/values (B, H_kv, length, D)."""
        index = pos - self.offset if self.offset else pos
        self.k[layer].index_copy_(2, index, k)
        if v is None:  # a latent cache: one tensor
            return self.k[layer][:, :, :self.length], None
        self.v[layer].index_copy_(2, index, v)
        return self.k[layer][:, :, :self.length], self.v[layer][:, :, :self.length]

    def shared_prefix(self, layer: int, pos: torch.Tensor):
        if self.prefix is None:
            return None
        return self.prefix[0][layer], None if self.prefix[1] is None else self.prefix[1][layer]

    def mask(self, pos: torch.Tensor) -> torch.Tensor:
        """(1, P + length) bool: key j holds position j (prefix first) and is attended up to ``pos``."""
        return (torch.arange(self.offset + self.length, device=pos.device) <= pos)[None]


class ConcatKVCache(KVCache):
    """The naive cache: every step allocates a new, one-longer K and V with ``torch.cat``."""

    impl = "concat"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.k: List[Optional[torch.Tensor]] = [None] * self.num_layers
        self.v: List[Optional[torch.Tensor]] = [None] * self.num_layers

    def update(self, layer, start_pos, k, v):
        end = self._check(layer, start_pos, k)
        old_k, old_v = self.k[layer], self.v[layer]
        if start_pos == 0 or old_k is None:
            new_k, new_v = k, v
        else:
            # After a roll back the stored tensors can be longer than start_pos.
            new_k = torch.cat([old_k[:, :, :start_pos], k], dim=2)
            new_v = None if v is None else torch.cat([old_v[:, :, :start_pos], v], dim=2)
        self.k[layer], self.v[layer] = new_k, new_v
        self._written(layer, end)
        return new_k, new_v

    def truncate(self, length):
        super().truncate(length)
        self.k = [None if t is None else t[:, :, :length].clone() for t in self.k]
        self.v = [None if t is None else t[:, :, :length].clone() for t in self.v]

    def tensors(self):
        return [t for t in self.k + self.v if t is not None]


class NoKVCache(KVCache):
    """Holds nothing: every step recomputes K/V of the whole sequence."""

    impl = "none"
    stores_history = False

    def _check(self, layer, start_pos, k):
        if start_pos != 0:
            raise ValueError("cache.impl='none' keeps no history: feed the whole sequence from position 0")
        return super()._check(layer, start_pos, k)

    def update(self, layer, start_pos, k, v):
        self._check(layer, start_pos, k)
        return k, v


_IMPLS = {c.impl: c for c in (StaticKVCache, ConcatKVCache, NoKVCache)}


def make_cache(impl: str, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
               max_seq_len: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", cache_dtype: str = "auto",
               windows: Optional[Sequence[Optional[int]]] = None, latent: bool = False) -> KVCache:
    """The cache named ``impl`` (static | concat | none) for the given shape, storing K/V in
    ``cache_dtype`` (auto: ``dtype``; int8 / float8_e4m3fn: static only); ``windows``: per layer
    a local layer's W (static: a ring of W positions) or None; ``latent``: one tensor per layer
    instead of K and V (MLA)."""
    if impl not in _IMPLS:
        raise ValueError(f"cache.impl={impl!r}: must be one of {', '.join(CACHE_IMPLS)}")
    storage_dtype(cache_dtype, dtype)  # a clear error for an unknown cache.dtype
    return _IMPLS[impl](num_layers, batch_size, num_kv_heads, head_dim, max_seq_len, dtype, device, cache_dtype,
                        windows, latent)


def cache_for(model, impl: str, batch_size: int, max_seq_len: int, cache_dtype: str = "auto") -> KVCache:
    """A cache shaped for ``model`` (a :class:`kvbench.model.Decoder`: K/V heads, or MLA's latent)
    in its dtype and device, with a ring for each of its local layers."""
    heads, width, latent = model.kv_dims()
    return make_cache(impl, model.config.num_layers, batch_size, heads, width, max_seq_len, model.dtype,
                      model.device, cache_dtype, getattr(model, "layer_windows", None), latent)


class SharedPrefixCache(KVCache):
    """B conversations after one shared prefix (a system prompt): the prefix's K/V is held once
    with batch 1, each conversation's own history in ``history`` (a static or concat cache).

    Positions are absolute in the conversation: the prefix holds 0..P-1 and history position p
    sits at index p - P of ``history``. An update at position 0 with batch 1 writes the whole
    prefix; later updates write history, and :meth:`shared_prefix` hands the prefix to the
    attention, so every conversation reads it without a copy and never reads another's
    history. ``segments`` records what each span of positions is (see :meth:`describe`).
    """

    impl = "shared"

    def __init__(self, history: KVCache, prefix_len: int):
        if not history.stores_history:
            raise ValueError(f"cache.impl={history.impl!r} keeps no history to share; use static or concat")
        super().__init__(history.num_layers, history.batch_size, history.num_kv_heads, history.head_dim,
                         prefix_len + history.max_seq_len, history.dtype, history.device, history.cache_dtype,
                         history.windows, history.latent)
        self.history, self.prefix_len = history, prefix_len
        shape = (1, self.num_kv_heads, prefix_len, self.head_dim)
        # The prefix is stored like the history (cache.dtype, one tensor if latent), once for every
        # conversation; a local layer keeps only its last W positions, the only ones a later token can still see.
        self.prefix_lengths = [layer_capacity(prefix_len, w) for w in self.windows]
        store = lambda: KVStore(self.num_layers, shape, self.cache_dtype, self.dtype, self.device,  # noqa: E731
                                self.prefix_lengths)
        self.prefix_k_store, self.prefix_v_store = store(), None if self.latent else store()
        self.prefix_k = self.prefix_k_store.codes
        self.prefix_v = None if self.prefix_v_store is None else self.prefix_v_store.codes

    def update(self, layer, start_pos, k, v):
        P = self.prefix_len
        if start_pos < P:
            if start_pos != 0 or k.shape[0] != 1 or k.shape[2] != P or self.length not in (0, P):
                raise ValueError(f"the shared prefix is written whole and once, with batch 1: got batch "
                                 f"{k.shape[0]} at positions {start_pos}..{start_pos + k.shape[2] - 1} "
                                 f"(prefix_len={P}, {self.length} positions held)")
            kept = self.prefix_lengths[layer]
            self.prefix_k_store.write(layer, 0, k[:, :, P - kept:])
            if v is not None:
                self.prefix_v_store.write(layer, 0, v[:, :, P - kept:])
            self._written(layer, P)
            if kept == P:  # read back: with cache.dtype int8 the prompt attends what later tokens read
                return self.shared_prefix(layer, P)
            return k, v  # a local layer keeps its last W: the prompt attends all of itself, masked
        if self.length < P:
            raise ValueError(f"write the shared prefix (positions 0..{P - 1}) before position {start_pos}")
        k, v = self.history.update(layer, start_pos - P, k, v)  # (B, H_kv, S - P, D)
        self._written(layer, P + self.history.length)
        return k, v

    def shared_prefix(self, layer, start_pos):
        if start_pos < self.prefix_len:
            return None
        kept = self.prefix_lengths[layer]  # positions P - kept .. P - 1
        v = None if self.prefix_v_store is None else self.prefix_v_store.read(layer, 1, kept)
        return self.prefix_k_store.read(layer, 1, kept), v

    def window(self, start_pos, batch_size, bucket):
        P = self.prefix_len
        if start_pos < P or self.length < P:
            raise ValueError(f"a fixed-shape step decodes after the shared prefix of {P} positions "
                             f"(position {start_pos}, {self.length} held)")
        history = self.history.window(start_pos - P, batch_size, bucket)  # static only
        self._written(self.num_layers - 1, start_pos + 1)
        return self._window(history.length, history.k, history.v, (self.prefix_k, self.prefix_v))

    def truncate(self, length):
        """Roll back to ``length`` positions: 0 forgets everything, P keeps only the prefix."""
        if 0 < length < self.prefix_len:
            raise ValueError(f"cannot truncate to {length}: inside the shared prefix of {self.prefix_len}")
        super().truncate(length)
        self.history.truncate(max(0, length - self.prefix_len) if length else 0)

    def storage_of(self, start: int, end: int) -> str:
        """Where the K/V of positions ``start .. end - 1`` live, as text."""
        B, P = self.batch_size, self.prefix_len
        if end <= P:
            return f"prefix[0:{P}], once for {B} conversations"
        return f"history[0:{B}, {start - P}:{end - P}]"

    def tensors(self):
        v = self.prefix_v_store.tensors() if self.prefix_v_store else []
        return self.prefix_k_store.tensors() + v + self.history.tensors()


def shared_cache_for(model, impl: str, batch_size: int, prefix_len: int, max_seq_len: int,
                     cache_dtype: str = "auto") -> SharedPrefixCache:
    """A :class:`SharedPrefixCache` for ``model``: a prefix of ``prefix_len`` positions held once,
    and ``batch_size`` histories of ``impl`` up to ``max_seq_len`` positions in all."""
    return SharedPrefixCache(cache_for(model, impl, batch_size, max_seq_len - prefix_len, cache_dtype),
                             prefix_len)
