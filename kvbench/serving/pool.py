"""Blocks and the pages they cost: the bookkeeping under a serving store, torch-free.

A :class:`BlockPool` counts who holds each of one group's blocks; a block whose holders are gone
keeps its content key (prefix caching finds it) until evicted. Blocks are paid for in
:class:`Pages`, a pool's own or shared by every group (``unified``): a block holds ``cost`` page ids
from the time it is taken until it is unused again (freed without a key, or evicted), so groups
sharing one byte pool never hold the same page. A new block takes a page never cached first, then
evicts the least recently freed cached block.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Hashable, List, Optional, Tuple


class Pages:
    """``total`` pages; ``used``: held or cached; ``cached``: (pool, block) by time freed; ``evicted``:
    the content key of every cached block evicted, in order (for tests and studies of evictions)."""

    def __init__(self, total: int, evicted: Optional[List[Hashable]] = None):
        self.total, self.used = total, 0
        self.cached: "OrderedDict[Tuple[BlockPool, int], None]" = OrderedDict()
        self.evicted = [] if evicted is None else evicted
        self.free_ids: List[int] = list(range(total - 1, -1, -1))  # page ids no block holds: the next one last

    def grab(self, n: int) -> List[int]:
        """``n`` free page ids (room was made for them)."""
        self.used += n
        return [self.free_ids.pop() for _ in range(n)]

    def give(self, ids: List[int]) -> None:
        self.used -= len(ids)
        self.free_ids.extend(reversed(ids))

    def make_room(self, pool: "BlockPool") -> bool:
        """Evict cached blocks until ``pool`` has an id never cached and its cost in free pages."""
        while not pool.unused:
            own = next((key for key in self.cached if key[0] is pool), None)
            if own is None:
                return False
            self.evict(own)
        while self.total - self.used < pool.cost:
            if not self.cached:
                return False
            self.evict(next(iter(self.cached)))
        return True

    def evict(self, key: Tuple["BlockPool", int]) -> None:
        del self.cached[key]
        pool, block = key
        self.evicted.append(pool.key_of[block])
        del pool.block_of[pool.key_of.pop(block)]
        pool.unused.append(block)
        self.give(pool.page_ids[block])


class BlockPool:
    """``capacity`` block ids of one group, each costing ``cost`` of ``pages``."""

    def __init__(self, capacity: int, cost: int, pages: Pages):
        self.capacity, self.cost, self.pages = capacity, cost, pages
        self.ref = [0] * capacity
        self.filled = [0] * capacity  # positions written in each block (K/V groups)
        self.unused: List[int] = list(range(capacity - 1, -1, -1))  # free and never cached: the next one last
        self.key_of: Dict[int, Hashable] = {}  # block -> content key (cached or shared)
        self.block_of: Dict[Hashable, int] = {}
        self.in_use = 0  # blocks with a holder
        self.page_ids: List[List[int]] = [[] for _ in range(capacity)]  # block -> the ids of the pages it holds

    def take(self) -> Optional[int]:
        """A fresh block with one holder, or None when no page can be freed for it."""
        if not self.pages.make_room(self):
            return None
        block = self.unused.pop()
        self.ref[block], self.filled[block] = 1, 0
        self.in_use += 1
        self.page_ids[block] = self.pages.grab(self.cost)
        return block

    def attach(self, block: int) -> None:
        """One more holder of ``block`` (a cached block is no longer evictable)."""
        if self.ref[block] == 0:
            del self.pages.cached[(self, block)]
            self.in_use += 1
        self.ref[block] += 1

    def free(self, block: int) -> None:
        """One holder fewer; a block nobody holds stays cached if it has a key, else is unused."""
        self.ref[block] -= 1
        if self.ref[block]:
            return
        self.in_use -= 1
        if block in self.key_of:
            self.pages.cached[(self, block)] = None
        else:
            self.unused.append(block)
            self.pages.give(self.page_ids[block])

    def register(self, block: int, key: Hashable) -> None:
        """Make ``block`` findable by ``key`` (the first block of a content keeps it)."""
        if key not in self.block_of and block not in self.key_of:
            self.block_of[key], self.key_of[block] = block, key

    def lookup(self, key: Hashable) -> Optional[int]:
        return self.block_of.get(key)

    @property
    def cached_blocks(self) -> int:
        """Blocks nobody holds that keep a key."""
        return len(self.key_of) - sum(1 for b in self.key_of if self.ref[b])
