"""The manager of :class:`~kvbench.layouts.pages.CompressedPool` pages: a window's ring plus a
growing pool of pooled entries plus the compressors' buffer per sequence, per layer (served for
the kind whose layouts ask for that spec; the layer's cache in a forward is its layout's ``PAGED``
class, which reads and writes the pages).

A sequence's table in the group is one list of block ids of one page size, in an order fixed by the
number of blocks of positions it holds (so that a table grows by appending, whatever the forwards'
lengths): the buffer's pages first, then each ring block followed by the pool blocks its entries
start. Ring blocks are freed as a window's; pool blocks and the buffer stay to the sequence's end.

Prefix caching: a full ring block is found by its content key as a window's; a full pool block by
the key of the block of positions that fills it; a prefix is continued only at a multiple of the
rate (:meth:`~kvbench.layouts.pages.CompressedPool.prefix_step`), from the buffer and the partly
filled pool block saved there (copies nobody runs from, each copied again into pages of the
sequence's own when one continues from them, as a recurrent state is).

Notation: k buffer pages, bs positions per block, m the rate, P a prefix's positions.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from kvbench.core.hooks import resolve
from kvbench.layouts.pages import CompressedPool
from kvbench.serving.managers import MANAGERS, Manager


class PoolManager(Manager):
    """:class:`CompressedPool` pages: per layer a byte row per page (its own storage or the byte
    pool's), read and written by the layout's ``PAGED`` cache."""

    saves_states = True  # a buffer saved where a prefix may be continued

    def __init__(self, model, group, capacity, block_size, pool, cache_dtype, shared=None, ring=False):
        super().__init__(model, group, capacity, block_size, pool, cache_dtype, shared, ring)
        self.spec: CompressedPool = group.spec
        self.k, self.rate, self.dtype = self.spec.buffer_pages(block_size), self.spec.rate, model.dtype
        self.layouts = [model.layouts[i] for i in group.layers]
        self.pages = []
        for s in group.specs:
            shape, carve = (self.rows, s.page_bytes(block_size)), self.carve(1)
            self.pages.append(torch.zeros(shape, dtype=torch.uint8, device=model.device) if carve is None
                              else carve(shape, torch.uint8))
        self.role: Dict[int, str] = {}  # block -> what it holds ("ring", "pool", "buffer"), as last written
        # a table's positions written (its blocks may run ahead: grown for a chunk a prefill splits)
        self.length_of: Dict[int, int] = {}

    # ---- a table's order ----

    def _pool_blocks(self, blocks: int) -> int:
        """Pool blocks a table of ``blocks`` blocks of positions holds."""
        return self.spec.pool_blocks(blocks * self.block_size, self.block_size)

    def table_len(self, blocks):
        return self.k + blocks + self._pool_blocks(blocks)

    def ring_index(self, j: int) -> int:
        return self.k + j + self._pool_blocks(j)

    def pool_index(self, q: int) -> int:
        # pool block q is taken with the first block of positions whose entries reach past q x bs entries
        bs = self.block_size
        return self.k + -(-self.rate * (q * bs + 1) // bs) + q

    def blocks_of(self, table: Sequence) -> int:
        """The blocks of positions a table holds (the inverse of :meth:`table_len`)."""
        low, high = 0, len(table)
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.table_len(mid) <= len(table) else (low, mid - 1)
        return low

    def behind(self, table, length):
        return [self.ring_index(j) for j in range(self.spec.first_kept(length) // self.block_size)]

    def _rows(self, table: Sequence) -> tuple:
        blocks = self.blocks_of(table)
        return ([table[self.ring_index(j)] for j in range(blocks)],
                [table[self.pool_index(q)] for q in range(self._pool_blocks(blocks))], list(table[:self.k]))

    # ---- pages ----

    def tensors(self):
        return list(self.pages)

    def _copy(self, to: int, source: int) -> None:
        for j, pages in enumerate(self.pages):
            pages[self.page(to, j)].copy_(pages[self.page(source, j)])
        self.pool.filled[to], self.role[to] = self.pool.filled[source], self.role.get(source, "")

    def needed_bytes(self):
        per = {"ring": sum(s.position_bytes for s in self.group.specs),
               "pool": sum(s.entry_bytes for s in self.group.specs)}
        buffer = sum(s.buffer_bytes for s in self.group.specs)
        return sum(buffer if self.role.get(b) == "buffer" else f * per.get(self.role.get(b), 0)
                   for b, (f, r) in enumerate(zip(self.pool.filled, self.pool.ref)) if r and f)

    def written(self, table, start, T):
        # filled: the positions (entries) written in a block, each once: a ring block of a forward longer
        # than the window has its first positions unwritten, and is not registered for a prefix
        bs, filled, (ring, pool, buffer) = self.block_size, self.pool.filled, self._rows(table)
        self.length_of[id(table)] = start + T
        for pos in range(max(start, start + T - self.spec.window), start + T):
            b = ring[pos // bs]
            filled[b], self.role[b] = filled[b] + 1, "ring"
        for e in range(self.spec.entries(start), self.spec.entries(start + T)):
            b = pool[e // bs]
            filled[b], self.role[b] = filled[b] + 1, "pool"
        if buffer:  # the first of its pages counts the buffer's bytes; the others are its room
            filled[buffer[0]], self.role[buffer[0]] = 1, "buffer"
            for b in buffer[1:]:
                filled[b], self.role[b] = 0, "buffer"

    # ---- prefix caching ----

    def _saved(self, key: int, blocks: int) -> List:
        """The content keys of what is saved at a prefix of ``blocks`` blocks ending in ``key``: the
        buffer's pages, then the partly filled pool block if any."""
        part = self.spec.entries(blocks * self.block_size) % self.block_size
        return [(key, "buffer", i) for i in range(self.k)] + ([(key, "part")] if part else [])

    def _saved_at(self, blocks: int) -> List[int]:
        """The table indices of what :meth:`_saved` names."""
        part = self.spec.entries(blocks * self.block_size)
        return list(range(self.k)) + ([self.pool_index(part // self.block_size)] if part % self.block_size else [])

    def found(self, keys, m):
        bs, length = self.block_size, m * self.block_size
        if length % self.spec.prefix_step(bs):
            return None
        table: List[Optional[int]] = [None] * self.table_len(m)
        need = {self.ring_index(j): keys[j] for j in range(self.spec.first_kept(length) // bs, m)}
        # full pool blocks, by the block of positions that filled each; the saved buffer and partial block
        need.update({self.pool_index(q): (keys[(q + 1) * self.rate - 1], "pool")
                     for q in range(self.spec.entries(length) // bs)})
        need.update(zip(self._saved_at(m), self._saved(keys[m - 1], m)))
        for i, key in need.items():
            table[i] = self.pool.lookup(key)
            if table[i] is None:
                return None
        return table

    def saved_pages(self):
        # its cached pages are also full ring and pool blocks, found by content as a window's are
        return sum(1 for b, key in self.pool.key_of.items() if not self.pool.ref[b] and isinstance(key, tuple)
                   and key[1] in ("buffer", "part"))

    def own(self, table):
        for i in self._saved_at(self.blocks_of(table)):  # the saved copies: into pages of its own
            page = self.pool.take()
            if page is None:
                return False
            self._copy(page, table[i])
            self.pool.free(table[i])
            table[i] = page
        return True

    def register(self, table, i, key):
        ring = table[self.ring_index(i)]
        if ring is not None and self.pool.filled[ring] == self.block_size:  # every position in it written
            self.pool.register(ring, key)
        if self.rate and (i + 1) % self.rate == 0:  # the block of positions that fills pool block (i + 1) / m - 1
            self.pool.register(table[self.pool_index((i + 1) // self.rate - 1)], (key, "pool"))

    def save(self, table, key):
        blocks = self.length_of.get(id(table), 0) // self.block_size
        if (blocks * self.block_size) % self.spec.prefix_step(self.block_size) or not self.k:
            return False
        saved = self._saved(key, blocks)
        if self.pool.lookup(saved[0]) is not None:
            return False
        copies = []
        for i in self._saved_at(blocks):
            page = self.pool.take()
            if page is None:  # no page free of a holder: nothing is saved
                for taken in copies:
                    self.pool.free(taken)
                return False
            self._copy(page, table[i])
            copies.append(page)
        for page, name in zip(copies, saved):
            self.pool.register(page, name)
            self.pool.free(page)  # nobody runs from it: cached, evictable
        return True

    def caches(self, tables, starts, T, positions, device):
        rows = [self._rows(t) for t in tables]
        return {layer: resolve(lay.PAGED)(lay, pages, [tuple([None if b is None else self.page(b, j) for b in part]
                                                             for part in row) for row in rows],
                                          starts, T, self.block_size, self.dtype)
                for j, (layer, lay, pages) in enumerate(zip(self.group.layers, self.layouts, self.pages))}


MANAGERS[CompressedPool] = PoolManager
