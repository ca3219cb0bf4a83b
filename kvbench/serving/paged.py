"""The serving stores of K/V: a pool of fixed-size blocks shared by every running request.

- :class:`PagedStore` (``workload.store=paged``): blocks of ``cache.block_size`` tokens allocated
  on demand as a sequence grows, freed when it finishes or is preempted; each sequence has a
  block table (vLLM's PagedAttention layout). Full blocks are shared across requests by content
  (vLLM's automatic prefix caching): a block's key is the hash of its tokens and of the block
  chain before it, a freed block keeps its key until it is reallocated (least recently freed
  first), and a new request starts from the longest chain of cached full blocks of its prompt.
- :class:`SlotStore` (``workload.store=slots``): the static cache, one slot of ``slot_len``
  positions per running request, taken whole when it is admitted.

Both hold per layer what its layout stores per position (K and V (slots, H_kv, D), MLA's one
latent (slots, 1, R + d_rope)) in :class:`~kvbench.kv_store.KVStore`'s, slots = blocks x block
size, so the bytes allocated equal the layouts' KV formula for that many positions.
:class:`BatchView` is the cache the decoder sees for one forward: each sequence's new K/V
written into its blocks and the K/V of all its positions gathered back, padded to the longest,
with a key mask.

Notation: B sequences, T new tokens each, S keys (positions) attended, H_kv KV heads, D width.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from kvbench.cache import Attend, LayerCache, Positions, mask_over, visible
from kvbench.config.errors import ConfigError
from kvbench.kv_store import KVStore


def bytes_per_token(model) -> int:
    """KV bytes one token of one sequence holds in all layers (the formula at seq_len 1)."""
    return model.layouts.bytes_per_token(model.dtype.itemsize)


def check_model(model, cache_dtype: str = "auto", store: str = "paged") -> None:
    """A one-line refusal of what the serving stores do not hold: what a layer's layout does not
    run with in a serving store (its limits), and quantized K/V."""
    model.layouts.check({"workload.store": store})
    if cache_dtype != "auto":
        raise ConfigError(f"cache.dtype={cache_dtype!r}: workload=serving stores K/V in the compute dtype; "
                          "use cache.dtype=auto")


@dataclass
class SeqBlocks:
    """One sequence's place in a store: its block table and the positions whose K/V it holds;
    ``hashed``: how many of its leading blocks are registered (full, with a chain key)."""

    table: List[int] = field(default_factory=list)
    length: int = 0
    hashed: int = 0
    chain: Optional[int] = None  # the key of its last registered block


class PagedStore:
    """A pool of ``num_blocks`` blocks of ``block_size`` tokens for ``model``'s KV layout."""

    kind = "paged"

    def __init__(self, model, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching and self.kind == "paged"
        self.bytes_per_token = bytes_per_token(model)
        slots = num_blocks * block_size
        # per layer, per stored tensor (K and V, or one latent): (slots, H_kv, D); slot = block * block_size + offset
        self.layers = [[KVStore((slots, layout.stored[0], width), "auto", model.dtype, model.device, axis=0)
                        for width in layout.stored[1]] for layout in model.layouts]
        self.device = model.device
        self.ref = [0] * num_blocks
        self.filled = [0] * num_blocks  # positions written in each block
        # free blocks, the next to reuse first: uncached ones, then cached ones least recently freed
        self.free: "OrderedDict[int, None]" = OrderedDict((b, None) for b in range(num_blocks))
        self.key_of: Dict[int, int] = {}  # block -> chain key (a cached full block)
        self.block_of: Dict[int, int] = {}  # chain key -> block

    # ---- capacity -----------------------------------------------------------------------

    def blocks_for(self, length: int) -> int:
        """Blocks a sequence of ``length`` positions holds."""
        return -(-length // self.block_size)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def bytes_used(self) -> int:
        """Bytes of the blocks in use (a cached free block is reclaimable, so not in use)."""
        return self.used_blocks * self.block_size * self.bytes_per_token

    @property
    def bytes_needed(self) -> int:
        """The formula's bytes for the positions the blocks in use hold (a shared block once)."""
        return sum(self.filled[b] for b in range(self.num_blocks) if self.ref[b]) * self.bytes_per_token

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage allocated (all blocks)."""
        return sum(t.untyped_storage().nbytes() for stores in self.layers for s in stores for t in s.tensors())

    def can_grow(self, seq: SeqBlocks, length: int) -> bool:
        return self.blocks_for(length) - len(seq.table) <= len(self.free)

    def grow(self, seq: SeqBlocks, length: int) -> bool:
        """Blocks for ``seq`` to hold ``length`` positions; False (nothing taken) if too few are free."""
        if not self.can_grow(seq, length):
            return False
        while len(seq.table) < self.blocks_for(length):
            seq.table.append(self._take())
        return True

    def _take(self) -> int:
        block, _ = self.free.popitem(last=False)
        key = self.key_of.pop(block, None)
        if key is not None:  # evicted from the prefix cache
            del self.block_of[key]
        self.ref[block], self.filled[block] = 1, 0
        return block

    def release(self, seq: SeqBlocks) -> None:
        """Give back ``seq``'s blocks (finished or preempted); cached full blocks stay findable."""
        for block in reversed(seq.table):  # a chain's tail is evicted before its head
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free[block] = None
                if block not in self.key_of:
                    self.free.move_to_end(block, last=False)
        seq.table, seq.length, seq.hashed, seq.chain = [], 0, 0, None

    # ---- prefix cache ---------------------------------------------------------------------

    def _key(self, parent: Optional[int], tokens: Sequence[int]) -> int:
        return hash((parent, tuple(tokens)))

    def cached_prefix(self, seq: SeqBlocks, tokens: Sequence[int]) -> int:
        """Attach to ``seq`` (empty) the longest chain of cached full blocks of ``tokens``, at most
        ``len(tokens) - 1`` positions (the last token is computed for its logits, as vLLM does);
        returns the positions found."""
        if not self.prefix_caching:
            return 0
        bs, parent = self.block_size, None
        for i in range((len(tokens) - 1) // bs):
            key = self._key(parent, tokens[i * bs:(i + 1) * bs])
            block = self.block_of.get(key)
            if block is None:
                break
            if self.ref[block] == 0:
                del self.free[block]
            self.ref[block] += 1
            seq.table.append(block)
            parent = key
        seq.length = seq.hashed = len(seq.table)
        seq.length *= bs
        seq.chain = parent
        return seq.length

    def register(self, seq: SeqBlocks, tokens: Sequence[int]) -> None:
        """Make ``seq``'s newly full blocks findable by content (``tokens``: its token ids)."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        while seq.hashed < seq.length // bs:
            i = seq.hashed
            key = self._key(seq.chain, tokens[i * bs:(i + 1) * bs])
            block = seq.table[i]
            if key not in self.block_of and block not in self.key_of:
                self.block_of[key], self.key_of[block] = block, key
            seq.chain, seq.hashed = key, i + 1

    # ---- reading and writing --------------------------------------------------------------

    def view(self, seqs: Sequence[SeqBlocks], T: int) -> "BatchView":
        """The :class:`BatchView` of a forward that adds ``T`` positions to each of ``seqs``
        (their blocks already grown to hold them)."""
        return BatchView(self, seqs, T)

    def written(self, seqs: Sequence[SeqBlocks], T: int) -> None:
        """After the forward: each sequence holds ``T`` more positions."""
        bs = self.block_size
        for s in seqs:
            for pos in range(s.length, s.length + T):
                b = s.table[pos // bs]
                self.filled[b] = max(self.filled[b], pos % bs + 1)
            s.length += T


class SlotStore(PagedStore):
    """The static cache: ``num_slots`` slots of ``slot_len`` positions, one per running request,
    taken whole on admission (a block of ``slot_len`` tokens), never shared."""

    kind = "slots"

    def __init__(self, model, num_slots: int, slot_len: int):
        super().__init__(model, num_slots, slot_len, prefix_caching=False)

    def blocks_for(self, length: int) -> int:
        if length > self.block_size:
            raise ValueError(f"{length} positions do not fit a slot of {self.block_size} (workload.slot_len)")
        return 1 if length > 0 else 0


class BatchView:
    """One forward's view of a store, passed to the decoder as its cache: each layer writes the
    new K/V (B, H_kv, T, D) of every sequence at its own positions and reads the K/V of all its
    positions (B, H_kv, S, D), S the longest sequence's, shorter ones padded (the mask hides the
    padding: a query sees the keys at positions up to its own)."""

    def __init__(self, store: PagedStore, seqs: Sequence[SeqBlocks], T: int):
        self.store, self.T = store, T
        bs, dev = store.block_size, store.device
        ends = [s.length + T for s in seqs]
        S = max(ends)
        width = store.blocks_for(S) if store.kind == "paged" else 1
        table = torch.tensor([s.table + [0] * (width - len(s.table)) for s in seqs], dtype=torch.long)  # (B, blocks)
        pos = torch.arange(S)
        read = table[:, pos // bs] * bs + pos % bs  # (B, S) slots; padding reads slot of block 0
        valid = pos[None] < torch.tensor(ends)[:, None]  # (B, S)
        read = torch.where(valid, read, torch.zeros_like(read))
        starts = torch.tensor([s.length for s in seqs])
        new = starts[:, None] + torch.arange(T)[None]  # (B, T) positions written
        self.write = read.gather(1, new).reshape(-1).to(dev)  # (B*T,)
        self.read = read.to(dev)
        self.flat_read = self.read.reshape(-1)
        if len(seqs) == 1:  # no padding: the plain causal rule over positions 0..S-1
            self.positions = Positions(seqs[0].length, T, dev)
            self.mask, self.causal = mask_over(self.positions, [(0, S)])
        else:
            self.positions = Positions.of(new.to(dev))  # (B, T) rotary positions
            self.mask, self.causal = visible(self.positions.ids, pos.to(dev)), False  # (B, T, S)
        self.layers = [PagedLayer(self, stores) for stores in store.layers]

    def begin(self, pos: Positions, batch_size: int) -> List[LayerCache]:
        return self.layers

    def commit(self, pos: Positions) -> None:
        pass  # the store counts what was written (PagedStore.written)

    def gather(self, store: KVStore) -> torch.Tensor:
        # index_select of the flat (B*S,) index: ~15x faster on a CPU than advanced indexing, for the same copy
        B, S = self.read.shape
        return store.gather(self.flat_read).view(B, S, *store.codes.shape[1:]).transpose(1, 2)


class PagedLayer(LayerCache):
    """One layer of a :class:`BatchView`."""

    def __init__(self, view: BatchView, stores: List[KVStore]):
        self.view, self.stores = view, stores

    def update(self, k, v, pos):
        out = []
        for store, x in zip(self.stores, (k, v)):
            B, H, T, D = x.shape
            store.write(self.view.write, x.transpose(1, 2).reshape(B * T, H, D))
            out.append(self.view.gather(store))  # (B, H_kv, S, D)
        return Attend(out[0], out[1] if len(out) > 1 else None, self.view.mask, self.view.causal)
