"""One manager per page spec class (vLLM v1's ``SingleTypeKVCacheManager`` per ``KVCacheSpec``): a
group's storage in a serving store, the pages a sequence's table takes to hold a length, the
cached pages a new sequence may continue from, and the group's layers' caches in a forward. The
store (:mod:`kvbench.serving.paged`) runs every group through its manager and never asks what
kind a layer is.

A sequence's table in a group is a list of block ids: a block per bs positions (None: released,
no later query sees it), or one state page. With a pool of its own a group's storage is indexed by
its block ids; under the unified allocator every group's tensors are views of one
:class:`BytePool`, and a block holds one page of it per layer of its group (its ``page_ids``), so
what is allocated is what the allocator reserves.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Callable, Dict, List, Optional, Sequence, Type

import torch

from kvbench.core.errors import ConfigError
from kvbench.kv_store import KVStore
from kvbench.layouts.pages import Blocks, Chunks, PageSpec, Ring, StatePage
from kvbench.serving.allocator import Group
from kvbench.serving.batch import GroupView, PagedLayer, PagedStateLayer
from kvbench.serving.pool import BlockPool
from kvbench.state_cache import STATE_DTYPES


class Misaligned(ValueError):
    """A layer's tensors do not fit a page of the byte pool at their dtypes' alignment."""


class BytePool:
    """The unified allocator's one byte pool: ``pages`` pages of ``page_bytes`` (one layer's block,
    or one layer's state), from which every layer's tensors are carved as views."""

    def __init__(self, pages: int, page_bytes: int, device):
        self.pages, self.page_bytes = pages, page_bytes
        self.buffer = torch.zeros(pages * page_bytes, dtype=torch.uint8, device=device)

    def carver(self, rows: int) -> Callable[[tuple, torch.dtype], torch.Tensor]:
        """Views of one layer's tensors, placed one after another within each of a page's ``rows``
        (a K/V layer: a row per position of the block; a state: the page whole). Each view is
        (pages x rows, ...) in its dtype; a part that would straddle its dtype's alignment or a row's
        end raises :class:`Misaligned`."""
        if self.page_bytes % rows:
            raise Misaligned(f"a page of {self.page_bytes} bytes is not {rows} rows")
        width, used = self.page_bytes // rows, [0]
        table = self.buffer.view(self.pages * rows, width)

        def carve(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
            size = torch.empty((), dtype=dtype).element_size()
            n = math.prod(shape[1:]) * size
            if used[0] % size or width % size or used[0] + n > width or shape[0] != self.pages * rows:
                raise Misaligned(f"{tuple(shape)} {dtype} at byte {used[0]} of a row of {width}")
            view = table[:, used[0]:used[0] + n].view(dtype).view(shape)
            used[0] += n
            return view
        return carve


class Manager(ABC):
    """The pages of ``group`` in ``pool``: ``capacity`` blocks of ``block_size`` positions, in storage
    of the group's own or carved from ``shared`` (a block there holds a page per layer)."""

    commits = False  # whether its layers' caches write back when a forward commits
    saves_states = False  # whether it saves what a sequence holds at a position (prefix caching of a state)

    def __init__(self, model, group: Group, capacity: int, block_size: int, pool: BlockPool, cache_dtype: str,
                 shared: Optional[BytePool] = None, ring: bool = False):
        self.group, self.block_size, self.pool, self.shared, self.ring = group, block_size, pool, shared, ring
        self.rows = capacity if shared is None else shared.pages  # the pages its tensors index

    def carve(self, rows: int):
        """Where a layer's tensors live: allocations of its own (None), or views of the byte pool."""
        return None if self.shared is None else self.shared.carver(rows)

    def page(self, block: int, j: int) -> int:
        """The page holding layer ``j``'s part of ``block``: the block itself in the group's own storage."""
        return block if self.shared is None else self.pool.page_ids[block][j]

    def pages_of(self, tables: Sequence[List[Optional[int]]], j: int) -> List[List[Optional[int]]]:
        return [[None if b is None else self.page(b, j) for b in t] for t in tables]

    @abstractmethod
    def tensors(self) -> List[torch.Tensor]:
        """Every tensor the group's storage holds (what the store's bytes are counted from)."""

    @abstractmethod
    def table_len(self, blocks: int) -> int:
        """Pages a table holds once its sequence holds ``blocks`` blocks of positions."""

    def taken(self, page: int) -> None:
        """``page`` was just taken for a sequence (a state starts from zero)."""
        return None  # nothing to do for most kinds of page

    def needed_bytes(self) -> int:
        """The formula's bytes for what the pages in use hold (a shared page once)."""
        return sum(self.group.filled_bytes(f) for f, r in zip(self.pool.filled, self.pool.ref) if r)

    def written(self, table: List[Optional[int]], start: int, T: int) -> None:
        """A forward wrote positions ``start`` .. ``start + T - 1`` of the sequence of ``table``."""
        return None  # nothing to do for most kinds of page

    def behind(self, table: List[Optional[int]], length: int) -> List[int]:
        """The indices of ``table`` no query at ``length`` or later sees (the store frees them)."""
        return list(range(self.group.spec.first_kept(length) // self.block_size))

    @abstractmethod
    def found(self, keys: Sequence[int], m: int) -> Optional[List[Optional[int]]]:
        """The cached pages to continue from position m x block_size (``keys``: the content keys of
        the blocks), or None where this group lacks one."""

    def attach(self, pages: List[Optional[int]]) -> List[Optional[int]]:
        """Hold the cached ``pages`` (:meth:`found`) for a sequence: its table."""
        for page in pages:
            if page is not None:
                self.pool.attach(page)
        return list(pages)

    def own(self, table: List[Optional[int]]) -> bool:
        """Make what ``table`` attached the sequence's own to write (False: no page for it)."""
        return True

    def register(self, table: List[Optional[int]], i: int, key: int) -> None:
        """Block ``i`` of the sequence is full: make what this group holds of it findable by ``key``."""
        return None  # nothing to do for most kinds of page

    def saved_pages(self) -> int:
        """Pages of saved copies nobody runs from (what a recurrent state's prefix caching costs)."""
        return self.pool.cached_blocks

    def save(self, table: List[Optional[int]], key: int) -> bool:
        """Save what the sequence holds at this position under ``key`` (True: a page was saved)."""
        return False

    @abstractmethod
    def caches(self, tables: Sequence[List[Optional[int]]], starts: Sequence[int], T: int, positions,
               device) -> Dict[int, object]:
        """Each layer's cache of a forward adding ``T`` positions to sequences at ``starts``."""


class BlockManager(Manager):
    """Positions in blocks (:class:`~kvbench.layouts.pages.Blocks`): each layer's K/V in a
    :class:`KVStore` of (pages x bs, H_kv, D), slot = block x bs + offset, in ``cache.dtype``."""

    def __init__(self, model, group, capacity, block_size, pool, cache_dtype, shared=None, ring=False):
        super().__init__(model, group, capacity, block_size, pool, cache_dtype, shared, ring)
        self.stores = []
        for i in group.layers:
            carve = self.carve(block_size)  # a row per position: K's codes and scales, then V's
            self.stores.append([KVStore((self.rows * block_size, model.layouts[i].stored[0], w), cache_dtype,
                                        model.dtype, model.device, axis=0, carve=carve)
                                for w in model.layouts[i].stored[1]])

    def tensors(self):
        return [t for stores in self.stores for s in stores for t in s.tensors()]

    def table_len(self, blocks):
        return blocks

    def written(self, table, start, T):
        bs, filled = self.block_size, self.pool.filled
        for pos in range(start, start + T):
            b = table[0 if self.ring else pos // bs]
            filled[b] = max(filled[b], pos % bs + 1)  # a ring's page, once it wraps: full

    def found(self, keys, m):
        behind = self.group.spec.first_kept(m * self.block_size) // self.block_size
        blocks = [None] * behind + [self.pool.lookup(k) for k in keys[behind:m]]
        return None if any(b is None for b in blocks[behind:]) else blocks

    def register(self, table, i, key):
        if table[i] is not None:
            self.pool.register(table[i], key)

    def caches(self, tables, starts, T, positions, device):
        view = GroupView(tables, starts, T, self.block_size, self.group.keeps, positions, device, self.ring)
        return {layer: PagedLayer(view, stores, view.slots if self.shared is None else
                                  view.slots_of(self.pages_of(tables, j)))
                for j, (layer, stores) in enumerate(zip(self.group.layers, self.stores))}


class RingManager(BlockManager):
    """A window's ring (:class:`~kvbench.layouts.pages.Ring`): blocks as :class:`BlockManager`'s,
    each freed by the store once its every position falls out of the window (the spec's
    ``first_kept``); a cached prefix needs only the blocks the window still sees."""


class StateManager(Manager):
    """A state per sequence (:class:`~kvbench.layouts.pages.StatePage`): per layer, its convolution's
    last inputs (pages, C, K - 1) in the compute dtype and its recurrent state (pages, ...) in
    ``state_dtype``; a state saved for prefix caching is a page nobody runs from, copied into a
    fresh one when a sequence continues from it."""

    commits = True
    saves_states = True

    def __init__(self, model, group, capacity, block_size, pool, cache_dtype, shared=None, ring=False):
        super().__init__(model, group, capacity, block_size, pool, cache_dtype, shared, ring)
        self.states = []
        for i in group.layers:
            s, carve = model.layouts[i].state, self.carve(1)
            carve = carve or (lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=model.device))
            parts = {"conv": ((self.rows, s.conv_channels, s.conv_tail), model.dtype),
                     "recurrent": ((self.rows,) + s.recurrent, STATE_DTYPES[s.state_dtype])}
            # the wider dtype first, so that each part starts at its alignment within the page
            order = sorted(parts, key=lambda name: -torch.empty((), dtype=parts[name][1]).element_size())
            made = {name: carve(*parts[name]) for name in order}
            self.states.append((made["conv"], made["recurrent"]))

    def tensors(self):
        return [t for pair in self.states for t in pair]

    def table_len(self, blocks):
        return 1

    def _copy(self, to: int, source: int) -> None:
        for j, (conv, recurrent) in enumerate(self.states):
            conv[self.page(to, j)].copy_(conv[self.page(source, j)])
            recurrent[self.page(to, j)].copy_(recurrent[self.page(source, j)])

    def taken(self, page):
        for j, (conv, recurrent) in enumerate(self.states):
            conv[self.page(page, j)].zero_()
            recurrent[self.page(page, j)].zero_()

    def found(self, keys, m):
        saved = self.pool.lookup(keys[m - 1])
        return None if saved is None else [saved]

    def own(self, table):
        page = self.pool.take()
        if page is None:  # no page for its state: the saved one is let go with the rest
            return False
        self._copy(page, table[0])
        self.pool.free(table[0])
        table[0] = page
        return True

    def save(self, table, key):
        if self.pool.lookup(key) is not None:
            return False
        page = self.pool.take()
        if page is None:  # no page free of a holder: the state is not saved
            return False
        self._copy(page, table[0])
        self.pool.register(page, key)
        self.pool.free(page)  # nobody runs from it: cached, evictable
        return True

    def caches(self, tables, starts, T, positions, device):
        return {layer: PagedStateLayer(conv, recurrent, torch.tensor([self.page(t[0], j) for t in tables],
                                                                     dtype=torch.long, device=device))
                for j, (layer, (conv, recurrent)) in enumerate(zip(self.group.layers, self.states))}


# the manager of each spec class (the class itself, not a subclass: a new spec says how it is served)
# (a chunk's blocks are a ring's, freed by their spec's first_kept: at each chunk boundary)
MANAGERS: Dict[Type[PageSpec], Type[Manager]] = {Blocks: BlockManager, Ring: RingManager, Chunks: RingManager,
                                                 StatePage: StateManager}


def manager_for(model, group: Group, capacity: int, block_size: int, pool: BlockPool, cache_dtype: str,
                kind: str = "paged", shared: Optional[BytePool] = None, ring: bool = False) -> Manager:
    """The manager of ``group``'s spec class; a spec no manager serves is one line naming it (``kind``:
    the store's ``workload.store``; ``ring``: a table holds one page, position p at p mod ``block_size``)."""
    manager = MANAGERS.get(type(group.spec))
    if manager is None:
        raise ConfigError(f"workload.store={kind}: layers {', '.join(map(str, group.layers))} need "
                          f"{type(group.spec).__name__} pages ({group.spec.layers_text()}), which no serving store "
                          "manager serves yet; use workload=decode")
    return manager(model, group, capacity, block_size, pool, cache_dtype, shared, ring)
