"""Page specs: what one layer keeps of a sequence in a serving store, as data (vLLM v1's
``KVCacheSpec``): its bytes, how many pages a sequence holds at a length, and which positions no
later query sees. A layer's layout says which spec it needs (its ``page_spec``); the store keeps
the layers of equal :attr:`PageSpec.paging` together and runs each group by the manager of its
spec's class (:mod:`kvbench.serving.managers`). Torch-free: a config is checked against these
before any model is built.

- :class:`Blocks`: positions in blocks of bs tokens (full attention): a block of bs positions.
- :class:`Ring`: a window's ring, at most W positions per sequence; a block is freed as soon as
  every position in it falls out of the window.
- :class:`Chunks`: a chunked layer's positions (Llama 4's local layers): every block of a chunk is
  freed at the chunk's end, when no later query sees any of its positions.
- :class:`StatePage`: a per-sequence recurrent state, one page whatever the length, its recurrent
  part in ``state_dtype`` (``cache.state_dtype``: float32, or half as vLLM's
  ``mamba_ssm_cache_dtype`` allows).
- :class:`CompressedPool`: DeepSeek-V4's ring of W positions plus one pooled entry per m tokens
  and its compressors' buffers, per layer (:mod:`kvbench.layouts.compressed`): pages of one size,
  ring blocks, pool blocks and the buffer's pages (:mod:`kvbench.serving.pool_manager` serves them).

Notation: L positions of a sequence, bs tokens per block (a pool block: bs entries), W a window,
m the compression rate.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Tuple

from kvbench.core.dtypes import DTYPE_BYTES
from kvbench.core.errors import check_choice


def _blocks(positions: int, bs: int) -> int:
    return -(-positions // bs)


@dataclass(frozen=True)
class PageSpec(ABC):
    """What a layer keeps of a sequence. ``position_bytes``: bytes one position takes in a block (0:
    none); a spec's figures are one layer's, a group's are summed over its layers."""

    position_bytes: int = 0

    @property
    @abstractmethod
    def paging(self) -> Tuple:
        """Layers whose specs give equal keys come and go together (one group of a store); the key
        sorts full attention first, then each window, the states, the pools."""

    @abstractmethod
    def page_bytes(self, block_size: int) -> int:
        """Bytes one page (one block, one state) of this layer takes."""

    def least_bytes(self) -> int:
        """Bytes the formula gives for a page in use at its least (one position filled, or the state)."""
        return self.position_bytes

    def filled_bytes(self, filled: int) -> int:
        """Bytes the formula gives for a page in use with ``filled`` positions written."""
        return filled * self.position_bytes

    def most_waste(self, block_size: int) -> int:
        """The most bytes one sequence's pages of this layer reserve beyond the formula."""
        return self.page_bytes(block_size) - self.least_bytes()

    def open_pages(self, block_size: int) -> int:
        """Pages one sequence may hold partly filled (its last block)."""
        return 1

    @abstractmethod
    def sequence_bytes(self, length: int) -> int:
        """The formula's bytes one sequence of ``length`` positions holds here (the layout's figure)."""

    def first_kept(self, length: int) -> int:
        """The first position a query at ``length`` or later still sees."""
        return 0

    def blocks_held(self, length: int, bs: int) -> int:
        """Pages a sequence of ``length`` positions holds between forwards: from the one holding the
        first position the next query sees."""
        return _blocks(length, bs) - self.first_kept(length) // bs

    def worst_blocks(self, length: int, bs: int, chunk: int = 1) -> int:
        """The most pages a sequence of up to ``length`` positions holds while it grows by forwards
        of at most ``chunk`` positions."""
        return _blocks(length, bs)

    def reserved_bytes(self, length: int, bs: int) -> int:
        """Bytes the pages a sequence of ``length`` positions holds between forwards reserve."""
        return self.blocks_held(length, bs) * self.page_bytes(bs)

    def slot_positions(self, slot_len: int, chunk: int) -> int:
        """Positions a static slot of ``slot_len`` keeps of one sequence growing by forwards of at most
        ``chunk`` positions (a ring wraps: position p at p mod this)."""
        return slot_len

    def prefix_step(self, block_size: int) -> int:
        """The positions a cached prefix is continued at multiples of (whole blocks)."""
        return block_size

    def slot_pages(self, slot_len: int, chunk: int) -> int:
        """Pages of :meth:`slot_positions` positions one static slot takes."""
        return 1

    def unit(self, block_size: int) -> str:
        """What a pool of these pages counts, for error lines."""
        return f"blocks of {block_size} tokens"

    @abstractmethod
    def layers_text(self) -> str:
        """How a group of layers with this spec is named in a sentence."""


@dataclass(frozen=True)
class Blocks(PageSpec):
    """Every position of a sequence, in blocks of bs: a block is bs · ``position_bytes``."""

    @property
    def paging(self) -> Tuple:
        return (0,)

    def page_bytes(self, block_size: int) -> int:
        return block_size * self.position_bytes

    def sequence_bytes(self, length: int) -> int:
        return length * self.position_bytes

    def layers_text(self) -> str:
        return "full layers"


@dataclass(frozen=True)
class Ring(Blocks):
    """The last ``window`` positions: a query at L sees L - W + 1 .. L, so a block whose every
    position is older is freed; a sequence holds at most ceil((W - 1 + chunk) / bs) + 1 blocks."""

    window: int = 0

    @property
    def paging(self) -> Tuple:
        return (1, self.window)

    def sequence_bytes(self, length: int) -> int:
        return min(length, self.window) * self.position_bytes

    def first_kept(self, length: int) -> int:
        return max(0, length - self.window + 1)

    def worst_blocks(self, length: int, bs: int, chunk: int = 1) -> int:
        # W - 1 kept positions and a chunk, at the worst alignment
        every, kept = _blocks(length, bs), min(length, self.window - 1 + chunk)
        return every if kept >= length else min(every, _blocks(kept + bs - 1, bs))

    def slot_positions(self, slot_len: int, chunk: int) -> int:
        # a forward of T positions reads the W - 1 before it and writes T: W - 1 + T distinct slots
        return min(slot_len, self.window - 1 + chunk)

    def layers_text(self) -> str:
        return f"layers of window {self.window}"


@dataclass(frozen=True)
class Chunks(Ring):
    """The positions of the current chunk of ``window`` = C (:mod:`kvbench.layouts.chunked`): a query at L
    sees floor(L / C)·C .. L, so at each boundary every block before it is freed; while a sequence grows
    by forwards of ``chunk`` it holds at most C - 1 + chunk positions, as a ring of C would."""

    @property
    def paging(self) -> Tuple:
        return (1, self.window, "chunk")

    def first_kept(self, length: int) -> int:
        return length // self.window * self.window

    def worst_blocks(self, length: int, bs: int, chunk: int = 1) -> int:
        # a chunk that starts on a block (C a multiple of bs) holds no block of the one before
        if self.window % bs:
            return super().worst_blocks(length, bs, chunk)
        return min(_blocks(length, bs), _blocks(self.window - 1 + chunk, bs))

    def layers_text(self) -> str:
        return f"layers of chunk {self.window}"


@dataclass(frozen=True)
class StatePage(PageSpec):
    """One page per sequence whatever its length: ``conv_bytes`` (a convolution's last inputs, in the
    compute dtype) and ``recurrent_elements`` in ``state_dtype``."""

    conv_bytes: int = 0
    recurrent_elements: int = 0
    state_dtype: str = "float32"

    def __post_init__(self):
        check_choice("cache.state_dtype", self.state_dtype, tuple(DTYPE_BYTES))

    @property
    def state_bytes(self) -> int:
        return self.conv_bytes + self.recurrent_elements * DTYPE_BYTES[self.state_dtype]

    @property
    def paging(self) -> Tuple:
        return (2,)

    def page_bytes(self, block_size: int) -> int:
        return self.state_bytes

    def least_bytes(self) -> int:
        return self.state_bytes

    def filled_bytes(self, filled: int) -> int:
        return self.state_bytes

    def sequence_bytes(self, length: int) -> int:
        return self.state_bytes

    def blocks_held(self, length: int, bs: int) -> int:
        return 1

    def worst_blocks(self, length: int, bs: int, chunk: int = 1) -> int:
        return 1

    def unit(self, block_size: int) -> str:
        return "states"

    def layers_text(self) -> str:
        return "recurrent layers"


@dataclass(frozen=True)
class CompressedPool(Ring):
    """A ring of ``window`` positions (``position_bytes`` each) plus one pooled entry of ``entry_bytes``
    per ``rate`` tokens and the compressors' ``buffer_bytes`` per sequence (``rate`` 0: the ring alone,
    a sliding layer beside compressed ones, served by the same manager). Its pages are of one size, a
    block of bs ring positions or of bs entries, whichever is larger: ring blocks (freed as a window's),
    pool blocks (bs entries, bs · m tokens; taken as the whole blocks of positions a sequence holds
    call for them) and the buffer's pages (:meth:`buffer_pages`), all kept to the sequence's end. A
    prefix is continued only at a multiple of m (:meth:`prefix_step`), where its buffer was saved."""

    entry_bytes: int = 0
    rate: int = 0
    buffer_bytes: int = 0

    @property
    def paging(self) -> Tuple:
        return (3, self.window, self.rate)

    def entries(self, length: int) -> int:
        return length // self.rate if self.rate else 0

    def page_bytes(self, block_size: int) -> int:
        return block_size * max(self.position_bytes, self.entry_bytes)

    def buffer_pages(self, block_size: int) -> int:
        """Pages the buffer of one sequence takes (its bytes in whole pages)."""
        return _blocks(self.buffer_bytes, self.page_bytes(block_size))

    def sequence_bytes(self, length: int) -> int:
        return super().sequence_bytes(length) + self.entries(length) * self.entry_bytes + self.buffer_bytes

    def most_waste(self, block_size: int) -> int:
        # a ring block with one position filled, a pool block with none yet (taken with the block of
        # positions whose entries will start it), the buffer's last page partly empty
        page = self.page_bytes(block_size)
        pool = page if self.rate else 0
        return page - self.position_bytes + pool + self.buffer_pages(block_size) * page - self.buffer_bytes

    def open_pages(self, block_size: int) -> int:
        return 1 + bool(self.rate) + self.buffer_pages(block_size)

    def pool_blocks(self, length: int, bs: int) -> int:
        """Pool blocks a sequence of ``length`` positions holds: those the entries of its whole blocks
        of positions fill (a block of positions is taken whole, its entries' block with it)."""
        return _blocks(self.entries(_blocks(length, bs) * bs), bs)

    def blocks_held(self, length: int, bs: int) -> int:
        return super().blocks_held(length, bs) + self.pool_blocks(length, bs) + self.buffer_pages(bs)

    def worst_blocks(self, length: int, bs: int, chunk: int = 1) -> int:
        return super().worst_blocks(length, bs, chunk) + self.pool_blocks(length, bs) + self.buffer_pages(bs)

    def prefix_step(self, block_size: int) -> int:
        """The positions a cached prefix is continued at multiples of: whole blocks that end a window
        of m (an entry is not split and the buffer holds no token then)."""
        return math.lcm(block_size, self.rate or 1)

    def slot_positions(self, slot_len: int, chunk: int) -> int:
        return slot_len  # its pooled entries grow with the length: no ring of its ring's size holds them

    def slot_pages(self, slot_len: int, chunk: int) -> int:
        # a slot is a block of every position, the pool block of their entries and the buffer's pages
        return self.blocks_held(slot_len, slot_len)

    def layers_text(self) -> str:
        rate = f" and rate {self.rate}" if self.rate else ""
        return f"compressed layers of window {self.window}{rate}"


def positions_spec(layout, element: int, cache_dtype: str = "auto"):
    """The spec of a layer that keeps positions (K/V heads, a latent): a ring with a window, else
    blocks; None where it keeps none (it reads another layer's K/V)."""
    per_position = layout.bytes_per_position(element, cache_dtype)
    if not per_position:
        return None
    return Blocks(per_position) if layout.window is None else Ring(per_position, layout.window)
