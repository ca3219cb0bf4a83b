"""A prefix held once before many sequences' own histories: the shared multi-turn cache (a
system prompt every conversation starts with), behind the one cache interface of
:mod:`kvbench.cache`.

Notation: B conversations, P the prefix's positions, H_kv KV heads, D width.
"""

from __future__ import annotations

from typing import List

from kvbench.cache import Attend, Cache, ConcatLayer, FixedLayer, LayerCache, cache_for, mask_over
from kvbench.kv_store import KVStore


class PrefixLayer(LayerCache):
    """A prefix held once with batch 1 (the positions the layer's layout keeps of its P) before each
    sequence's own history."""

    def __init__(self, history: LayerCache, prefix: List[KVStore], prefix_len: int):
        self.history, self.prefix_stores, self.prefix_len = history, prefix, prefix_len
        self.layout = history.layout
        self.kept = prefix[0].length

    def update(self, k, v, pos):
        P, kept = self.prefix_len, self.kept
        if pos.start < P:  # the prefix itself, written whole (SharedPrefixCache.begin checks it)
            for store, x in zip(self.prefix_stores, (k, v)):
                store.write(0, x[:, :, P - kept:])
            if kept == P:  # read back: with cache.dtype int8 the prompt attends what later tokens read
                k, v = self.read_prefix()
            return Attend(k, v, *mask_over(pos, [(0, P)], self.layout))
        keys, values, runs = self.history.store(k, v, pos.shifted(-P))
        runs = [(P - kept, kept)] + [(s + P, n) for s, n in runs]
        mask, _ = mask_over(pos, runs, self.layout)
        return Attend(keys, values, mask, False, self.read_prefix())

    def read_prefix(self):
        out = [store.read(self.kept, 1) for store in self.prefix_stores]
        return out[0], out[1] if len(out) > 1 else None

    def tensors(self):
        return [t for s in self.prefix_stores for t in s.tensors()] + self.history.tensors()

    def fixed_view(self, length):
        return FixedLayer(self.history.fixed_view(length).stores, length, self.read_prefix())


class SharedPrefixCache(Cache):
    """B conversations after one shared prefix (a system prompt), its K/V held once with batch 1;
    each conversation's own history in ``history`` (a static or concat cache).

    Positions are absolute: the prefix holds 0..P-1 and position p sits at index p - P of
    ``history``. A forward at position 0 with batch 1 writes the whole prefix; every conversation
    reads it without a copy and never reads another's history."""

    def __init__(self, history: Cache, prefix_len: int):
        if not history.stores_history:
            raise ValueError(f"cache.impl={history.impl!r} keeps no history to share; use static or concat")
        self.history, self.prefix_len = history, prefix_len
        layers = [PrefixLayer(layer, self._prefix_stores(layer, history), prefix_len) for layer in history.layers]
        super().__init__("shared", layers, history.batch_size, prefix_len + history.max_seq_len, history.dtype,
                         history.device, history.cache_dtype)

    def _prefix_stores(self, layer: LayerCache, history: Cache) -> List[KVStore]:
        kept = layer.layout.positions_held(self.prefix_len)
        if isinstance(layer, ConcatLayer):
            heads, widths = layer.heads, layer.widths
        else:
            heads, widths = layer.stores[0].shape[1], [s.shape[3] for s in layer.stores]
        return [KVStore((1, heads, kept, w), history.cache_dtype, history.dtype, history.device) for w in widths]

    def begin(self, pos, batch_size):
        P = self.prefix_len
        if pos.start < P:
            if pos.start != 0 or batch_size != 1 or pos.T != P or self.length not in (0, P):
                raise ValueError(f"the shared prefix is written whole and once, with batch 1: got batch "
                                 f"{batch_size} at positions {pos.start}..{pos.end - 1} "
                                 f"(prefix_len={P}, {self.length} positions held)")
            return self.layers
        if self.length < P:
            raise ValueError(f"write the shared prefix (positions 0..{P - 1}) before position {pos.start}")
        self.history.begin(pos.shifted(-P), batch_size)
        return self.layers

    def commit(self, pos):
        self.length = pos.end
        if pos.start >= self.prefix_len:
            self.history.commit(pos.shifted(-self.prefix_len))

    def fixed(self, start_pos, batch_size, bucket):
        P = self.prefix_len
        if start_pos < P or self.length < P:
            raise ValueError(f"a fixed-shape step decodes after the shared prefix of {P} positions "
                             f"(position {start_pos}, {self.length} held)")
        history = self.history.fixed(start_pos - P, batch_size, bucket)  # static only: its checks
        self.length = start_pos + 1
        return self._fixed(history.length)

    def truncate(self, length):
        """Roll back to ``length`` positions: 0 forgets everything, P keeps only the prefix."""
        if 0 < length < self.prefix_len:
            raise ValueError(f"cannot truncate to {length}: inside the shared prefix of {self.prefix_len}")
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate to {length}: the cache holds {self.length} positions")
        self.history.truncate(max(0, length - self.prefix_len) if length else 0)
        self.length = length

    def rewind(self, length):
        self.history.rewind(length - self.prefix_len)
        self.length = length

    def storage_of(self, start: int, end: int) -> str:
        """Where the K/V of positions ``start .. end - 1`` live, as text."""
        B, P = self.batch_size, self.prefix_len
        if end <= P:
            return f"prefix[0:{P}], once for {B} conversations"
        return f"history[0:{B}, {start - P}:{end - P}]"


def shared_cache_for(model, impl: str, batch_size: int, prefix_len: int, max_seq_len: int,
                     cache_dtype: str = "auto") -> SharedPrefixCache:
    """A :class:`SharedPrefixCache` for ``model``: a prefix of ``prefix_len`` positions held once,
    and ``batch_size`` histories of ``impl`` up to ``max_seq_len`` positions in all."""
    model.layouts.check({"cache.shared": True})  # a layer whose cache is not K/V refuses here, in one line
    return SharedPrefixCache(cache_for(model, impl, batch_size, max_seq_len - prefix_len, cache_dtype), prefix_len)
