"""The serving stores: pools of fixed-size blocks shared by every running request, one pool (or
one share of a pool) per group of layers (:mod:`kvbench.serving.allocator`), each group run by the
manager of its page spec's class (:mod:`kvbench.serving.managers`).

- :class:`PagedStore` (``workload.store=paged``): blocks allocated on demand, a block table per
  sequence and K/V group (vLLM's PagedAttention layout). A local layer's blocks are freed as soon as
  no later query sees them. Full blocks are shared across requests by content (vLLM's automatic
  prefix caching): a block's key hashes its tokens and the chain before it, a freed block keeps its
  key until evicted (least recently freed first), and a new request starts from the longest cached
  chain every group can continue from (for a recurrent layer, a state saved at exactly that position).
- :class:`SlotStore` (``workload.store=slots``): the static cache, one slot per running request.

K/V are held per layer in :class:`~kvbench.kv_store.KVStore`'s (slots, H_kv, D), slot = block x
block size + offset, in ``cache.dtype``; a recurrent state per page, in ``cache.state_dtype``.
Under ``workload.allocator=unified`` all of them are views of one byte pool of the allocator's
pages (:class:`~kvbench.serving.managers.BytePool`): what is allocated is what is reserved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from kvbench.serving.allocator import Checkpoint, Plan, groups_of, make_plan, slot_plan
from kvbench.serving.batch import BatchView
from kvbench.serving.managers import BytePool, Manager, Misaligned, manager_for
from kvbench.serving.pool import BlockPool, Pages
from kvbench.serving.pool_manager import PoolManager  # noqa: F401  (serves a compressed pool's pages)


def bytes_per_token(model, cache_dtype: str = "auto") -> int:
    """KV bytes one token of one sequence holds in all layers (the formula at seq_len 1)."""
    return model.layouts.bytes_per_token(model.dtype.itemsize, cache_dtype)


def check_model(model, cache_dtype: str = "auto", store: str = "paged") -> None:
    """A one-line refusal of what a layer's layout does not run with in a serving store (its limits)."""
    model.layouts.check({"workload.store": store, "cache.dtype": cache_dtype})


def plan_for(model, num_blocks: int, block_size: int, cache_dtype: str = "auto", allocator: str = "per_kind",
             longest: Optional[int] = None, chunk: int = 1) -> Plan:
    """The pools of a budget of ``num_blocks`` blocks of every K/V layer (of one state without K/V)."""
    groups = groups_of(model.layouts, model.dtype.itemsize, cache_dtype)
    per_block = block_size * bytes_per_token(model, cache_dtype) or groups[-1].page_bytes(block_size)
    return make_plan(groups, allocator, block_size, num_blocks * per_block, longest or model.config.max_seq_len,
                     chunk)


@dataclass
class SeqBlocks:
    """One sequence's place in a store: a table of pages per group (a block per bs positions, None:
    released, no later query sees it; or its state page), and the content keys of its first
    ``len(keys)`` full blocks."""

    tables: Dict[int, List[Optional[int]]] = field(default_factory=dict)
    length: int = 0
    keys: List[int] = field(default_factory=list)
    prompt_len: int = 0  # the request's prompt (workload.state_checkpoint=prompt_end saves its state there)

    @property
    def table(self) -> List[Optional[int]]:
        """The first K/V group's table."""
        return next(iter(self.tables.values()), [])


class PagedStore:
    """A paged store for ``model``: a budget of ``num_blocks`` blocks of every K/V layer, or ``plan``."""

    kind = "paged"
    rings = False  # whether a table's one page keeps position p at p mod its positions (a slot)

    def __init__(self, model, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 cache_dtype: str = "auto", plan: Optional[Plan] = None, checkpoint: Optional[Checkpoint] = None):
        check_model(model, cache_dtype, self.kind)
        self.plan = plan or plan_for(model, num_blocks, block_size, cache_dtype)
        self.block_size = self.plan.block_size
        self.prefix_caching = prefix_caching and self.kind == "paged"
        self.checkpoint = checkpoint or Checkpoint()
        self.checkpoint.check(self.block_size, self.plan.allocator)
        self.layouts, self.device = model.layouts, model.device
        self.bytes_per_token = bytes_per_token(model, cache_dtype)
        self.evicted: List[int] = []  # content keys of the cached blocks evicted, in order (any group)
        shared = Pages(self.plan.pages[0], self.evicted) if self.plan.allocator == "unified" else None
        self.pools = [BlockPool(n, c, shared or Pages(n, self.evicted))
                      for n, c in zip(self.plan.capacity, self.plan.cost)]
        self.shared = None
        if shared is not None:  # the unified pool's pages as one byte pool, every group's tensors views of it
            self.shared = BytePool(self.plan.pages[0], self.plan.page_bytes[0] // self.plan.cost[0], model.device)
        try:
            self.managers = self._managers(model, cache_dtype)
        except Misaligned:  # a part a page cannot hold at its alignment: storage per group (allocated > reserved)
            self.shared = None
            self.managers = self._managers(model, cache_dtype)
        self.checkpoints_saved = self.checkpoint_bytes_max = 0

    def _managers(self, model, cache_dtype: str) -> List[Manager]:
        return [manager_for(model, group, n, self.plan.block_positions(g), pool, cache_dtype, self.kind, self.shared,
                            self.rings)
                for g, (group, n, pool) in enumerate(zip(self.plan.groups, self.plan.capacity, self.pools))]

    # ---- capacity -----------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Pages the store holds in all (per_kind: every pool's blocks; unified: the one pool's pages)."""
        return sum(p.total for p in {id(pool.pages): pool.pages for pool in self.pools}.values())

    @property
    def used_blocks(self) -> int:
        """Pages with a holder (a cached block nobody holds is reclaimable, so not in use)."""
        return sum(pool.in_use * pool.cost for pool in self.pools)

    @property
    def bytes_used(self) -> int:
        """Bytes the pages in use reserve."""
        return sum(pool.in_use * b for pool, b in zip(self.pools, self.plan.page_bytes))

    @property
    def bytes_needed(self) -> int:
        """The formula's bytes for the positions and states the blocks in use hold (a shared block once)."""
        return sum(m.needed_bytes() for m in self.managers)

    @property
    def saves_states(self) -> bool:
        """Whether some group saves what a sequence holds at a position (a recurrent state) for prefix caching."""
        return any(m.saves_states for m in self.managers)

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of the saved states nobody runs from (cached state pages)."""
        return sum(m.saved_pages() * self.plan.page_bytes[g] for g, m in enumerate(self.managers) if m.saves_states)

    @property
    def nbytes(self) -> int:
        """Bytes of K/V and state storage allocated (all pages; the byte pool once)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for m in self.managers for t in m.tensors()}
        return sum(storages.values())

    @property
    def storage_bytes(self) -> int:
        """The formula's bytes of what the store allocates: the byte pool's pages (what the unified
        allocator reserves), else each group's blocks of its layers (:attr:`Plan.storage_bytes`)."""
        return self.plan.reserved_bytes if self.shared is not None else self.plan.storage_bytes

    @property
    def prefix_step(self) -> int:
        """A cached prefix is continued only at a multiple of these positions: a block, or where some
        group's pages say (a compressed pool's entries are not split: a multiple of its rate too)."""
        return math.lcm(*(g.spec.prefix_step(self.block_size) for g in self.plan.groups))

    def blocks_for(self, length: int) -> int:
        """Blocks a sequence of ``length`` positions holds in a full layer."""
        return -(-length // self.block_size)

    def unfit(self, length: int, chunk: int) -> Optional[str]:
        """Why a request of ``length`` positions, prefilled ``chunk`` at a time, can never run alone
        (None: it can)."""
        for need, pool in zip(self.plan.need(length, chunk), {id(p.pages): p.pages for p in self.pools}.values()):
            if need > pool.total:
                return f"needs {need} blocks, the store has {pool.total}"
        return None

    def grow(self, seq: SeqBlocks, length: int) -> bool:
        """Pages for ``seq`` to hold ``length`` positions in every group (blocks, its state page);
        False, with nothing taken, if some group has too few."""
        taken = []
        blocks = self.blocks_for(length)
        for g, (manager, pool) in enumerate(zip(self.managers, self.pools)):
            table = seq.tables.setdefault(g, [])
            for _ in range(manager.table_len(blocks) - len(table)):
                block = pool.take()
                if block is None:
                    for g2 in reversed(taken):
                        self.pools[g2].free(seq.tables[g2].pop())
                    return False
                taken.append(g)
                manager.taken(block)
                table.append(block)
        return True

    def release(self, seq: SeqBlocks) -> None:
        """Give back ``seq``'s pages (finished or preempted); cached blocks stay findable."""
        for g, table in seq.tables.items():
            for block in reversed(table):  # a chain's tail is evicted before its head
                if block is not None:
                    self.pools[g].free(block)
        seq.tables, seq.length, seq.keys = {}, 0, []

    # ---- prefix cache ---------------------------------------------------------------------

    def _key(self, parent: Optional[int], tokens: Sequence[int]) -> int:
        return hash((parent, tuple(tokens)))

    def cached_prefix(self, seq: SeqBlocks, tokens: Sequence[int]) -> int:
        """Attach to ``seq`` the longest cached prefix of ``tokens`` that every group can continue
        from, at most ``len(tokens) - 1`` positions (the last token is computed for its logits, as
        vLLM does); returns the positions found."""
        if not self.prefix_caching:
            return 0
        bs, keys, parent = self.block_size, [], None
        for i in range((len(tokens) - 1) // bs):
            parent = self._key(parent, tokens[i * bs:(i + 1) * bs])
            keys.append(parent)
        for m in range(len(keys), 0, -1):
            found = self._found(keys, m)
            if found is not None:
                break
        else:
            return 0
        for g, pages in found.items():  # held first: taking a state's own page below may evict what is not
            seq.tables[g] = self.managers[g].attach(pages)
        seq.length, seq.keys = m * bs, keys[:m]
        if not all(self.managers[g].own(table) for g, table in seq.tables.items()):
            self.release(seq)  # no page for its state: it starts from the beginning
            return 0
        return seq.length

    def resumable(self, seq: SeqBlocks) -> Optional[int]:
        """The longest prefix of ``seq``'s own positions a new sequence could continue from now: every
        group holds what it needs there (blocks findable by content, a recurrent layer's state saved at
        exactly that position); None without a prefix cache. What a conversation's next turn can find
        of its history if nothing is evicted meanwhile."""
        if not self.prefix_caching:
            return None
        for m in range(len(seq.keys), 0, -1):
            # the state groups (last) first: a position with no saved state fails in one lookup
            if all(manager.found(seq.keys, m) is not None for manager in reversed(self.managers)):
                return m * self.block_size
        return 0

    def _found(self, keys: List[int], m: int) -> Optional[dict]:
        """Per group, the cached pages (blocks, a saved state) to continue from position
        m x block_size, or None where some group lacks them."""
        found = {}
        for g, manager in enumerate(self.managers):
            found[g] = manager.found(keys, m)
            if found[g] is None:
                return None
        return found

    def register(self, seq: SeqBlocks, tokens: Sequence[int]) -> None:
        """After a forward of ``seq``: make its newly full blocks findable by content, save its state
        where the checkpoint policy says, then release the blocks no later query sees."""
        if self.prefix_caching:
            self._register(seq, tokens)
        self.release_behind(seq)

    def _register(self, seq: SeqBlocks, tokens: Sequence[int]) -> None:
        bs = self.block_size
        while len(seq.keys) < seq.length // bs:
            i = len(seq.keys)
            seq.keys.append(self._key(seq.keys[-1] if seq.keys else None, tokens[i * bs:(i + 1) * bs]))
            for g, table in seq.tables.items():
                self.managers[g].register(table, i, seq.keys[i])
        if seq.keys and self.checkpoint.saves(seq.length, bs, seq.prompt_len):
            for g, table in seq.tables.items():
                if self.managers[g].save(table, seq.keys[-1]):
                    self.checkpoints_saved += 1
                    self.checkpoint_bytes_max = max(self.checkpoint_bytes_max, self.checkpoint_bytes)

    def chunk_limit(self, seq: SeqBlocks) -> Optional[int]:
        """The most positions the next forward of ``seq`` may add: up to the next saved state of a
        recurrent layer (None: no limit)."""
        if not self.prefix_caching or not self.saves_states:
            return None
        stop = self.checkpoint.next_save(seq.length, self.block_size, seq.prompt_len)
        return None if stop is None else stop - seq.length

    # ---- reading and writing --------------------------------------------------------------

    def view(self, seqs: Sequence[SeqBlocks], T: int) -> BatchView:
        """The :class:`BatchView` of a forward that adds ``T`` positions to each of ``seqs``."""
        return BatchView(self, seqs, T)

    def written(self, seqs: Sequence[SeqBlocks], T: int) -> None:
        """After the forward: each sequence holds ``T`` more positions (:meth:`register` follows)."""
        for s in seqs:
            for g, table in s.tables.items():
                self.managers[g].written(table, s.length, T)
            s.length += T

    def release_behind(self, seq: SeqBlocks) -> None:
        """Free ``seq``'s blocks that no later query sees (a window's, as its spec says)."""
        for g, table in seq.tables.items():
            for i in self.managers[g].behind(table, seq.length):
                if table[i] is not None:
                    self.pools[g].free(table[i])
                    table[i] = None


class SlotStore(PagedStore):
    """The static cache: ``num_slots`` slots of ``slot_len`` positions, taken whole on admission, never
    shared. A window's slot is a ring of W - 1 + ``chunk`` positions where that is shorter (forwards
    add at most ``chunk`` positions: the scheduler's ``max_prefill_tokens``)."""

    kind = "slots"
    rings = True

    def __init__(self, model, num_slots: int, slot_len: int, cache_dtype: str = "auto", chunk: int = 512):
        plan = slot_plan(groups_of(model.layouts, model.dtype.itemsize, cache_dtype), slot_len, num_slots, chunk)
        super().__init__(model, num_slots, slot_len, False, cache_dtype, plan)

    def unfit(self, length: int, chunk: int) -> Optional[str]:
        if length > self.block_size:
            return f"needs {length} positions, a slot holds {self.block_size} (workload.slot_len)"
        return super().unfit(length, chunk)

    def blocks_for(self, length: int) -> int:
        if length > self.block_size:
            raise ValueError(f"{length} positions do not fit a slot of {self.block_size} (workload.slot_len)")
        return 1 if length > 0 else 0

    def release_behind(self, seq: SeqBlocks) -> None:
        """A slot is taken whole: nothing is released before the request ends."""
