"""A DeepSeek-V4 layer's cache in a serving store's forward: its pages (the store's
:class:`~kvbench.layouts.pages.CompressedPool`, one byte row per page) read into a
:class:`~kvbench.layouts.compressed_attention.CompressedCache` of one sequence, the sequence run
through it at its own position, and what the forward wrote put back in the pages.

A page is a block of bs ring positions (D each), of bs pooled entries (the compressor's D then the
indexer's D_i, CSA), or a part of the buffer (the compressors' tensors of the < m tokens not yet
folded and CSA's overlap, float32 parts first so that each starts at its alignment). The store's
manager (:mod:`kvbench.serving.pool_manager`) says which page of a sequence is which.

Notation: bs positions (or entries) per page, W window, m rate, D head_dim, D_i index_head_dim.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from kvbench.layouts.compressed_attention import CompressedCache
from kvbench.layouts.compressed_layout import Compressed

# one sequence's pages of one layer: its ring blocks by position block (None: released), its pool blocks
# by entry block, its buffer's pages
Row = Tuple[Sequence[Optional[int]], Sequence[int], Sequence[int]]


class CompressedPages:
    """One V4 layer's cache for a forward adding ``T`` tokens to each sequence at ``starts``: ``pages``
    (pages, page bytes) uint8, ``rows`` each sequence's :data:`Row`. The attention runs sequence by
    sequence (:meth:`row`, then :meth:`keep`)."""

    def __init__(self, layout: Compressed, pages: torch.Tensor, rows: Sequence[Row], starts: Sequence[int], T: int,
                 block_size: int, dtype: torch.dtype):
        self.layout, self.pages, self.rows, self.starts, self.T = layout, pages, rows, list(starts), T
        self.bs, self.dtype = block_size, dtype
        self.element = torch.empty((), dtype=dtype).element_size()

    def _blocks(self, width: int) -> torch.Tensor:
        """The pages as (pages, bs, width x element) bytes: a block of bs rows of ``width`` elements."""
        return self.pages[:, :self.bs * width * self.element].view(self.pages.shape[0], self.bs, -1)

    def _where(self, table: Sequence, items: range) -> Tuple[torch.Tensor, torch.Tensor]:
        """The page and the row in it of each of ``items`` (positions or entries) of the blocks ``table``."""
        pages = [table[i // self.bs] for i in items]
        rows = [i % self.bs for i in items]
        device = self.pages.device
        return torch.tensor(pages, dtype=torch.long, device=device), torch.tensor(rows, dtype=torch.long, device=device)

    def _read(self, width: int, table: Sequence, items: range) -> torch.Tensor:
        """Items ``items`` of the blocks ``table`` as (n, width) in the dtype."""
        return self._blocks(width)[self._where(table, items)].view(self.dtype)

    def _write(self, width: int, table: Sequence, items: range, values: torch.Tensor) -> None:
        self._blocks(width)[self._where(table, items)] = values.contiguous().view(torch.uint8)

    @staticmethod
    def carried(cache: CompressedCache) -> List[torch.Tensor]:
        """The buffer's tensors of one sequence, widest element first (the order its pages hold them)."""
        parts = [t for name, pool in cache.pools.items() for t in pool.tensors()[1:]]
        return sorted(parts, key=lambda t: -t.element_size())

    def row(self, b: int) -> CompressedCache:
        """Sequence ``b``'s cache: the ring positions its new tokens may see, its entries and its buffer."""
        lay, start, (ring, pool, buffer) = self.layout, self.starts[b], self.rows[b]
        cache = CompressedCache(lay, 1, start + self.T, self.dtype, self.pages.device)
        cache.length = start
        held = range(max(0, start - lay.window + 1), start)
        if len(held):
            cache.ring[0, torch.tensor(list(held)) % lay.window] = self._read(lay.head_dim, ring, held)
        n = lay.entries(start)
        if n:
            entries = self._read(lay.entry_width, pool, range(n))
            cache.pools["compressor"].entries[0, :n] = entries[:, :lay.head_dim]
            if lay.indexed:
                cache.pools["indexer"].entries[0, :n] = entries[:, lay.head_dim:]
        if start and buffer:  # a fresh sequence's buffer is empty (its pages hold a former holder's bytes)
            raw = self.pages[torch.tensor(list(buffer), dtype=torch.long)].reshape(-1)
            used = 0
            for t in self.carried(cache):
                t.view(-1).view(torch.uint8).copy_(raw[used:used + t.nbytes])
                used += t.nbytes
        return cache

    def keep(self, b: int, cache: CompressedCache) -> None:
        """What sequence ``b``'s forward wrote into ``cache`` put in its pages: the new ring positions
        (the last W of them), the new entries, the buffer."""
        lay, start, end, (ring, pool, buffer) = self.layout, self.starts[b], self.starts[b] + self.T, self.rows[b]
        new = range(max(start, end - lay.window), end)
        self._write(lay.head_dim, ring, new, cache.ring[0, torch.tensor(list(new)) % lay.window])
        made = range(lay.entries(start), lay.entries(end))
        if len(made):
            parts = [pool_.entries[0, made.start:made.stop] for pool_ in cache.pools.values()]
            self._write(lay.entry_width, pool, made, torch.cat(parts, -1))
        if buffer:
            raw = torch.cat([t.reshape(-1).view(torch.uint8) for t in self.carried(cache)])
            width = self.pages.shape[1]
            padded = raw.new_zeros(len(buffer) * width)
            padded[:raw.numel()] = raw
            self.pages[torch.tensor(list(buffer), dtype=torch.long)] = padded.view(len(buffer), width)
