"""How a serving store's memory budget becomes blocks: the groups of layers a store keeps apart,
the two allocators (``workload.allocator``) and the bytes each reserves, as formulas (torch-free,
so a config is checked against them before any model is built).

A **group** is the layers whose pages come and go together: those whose layouts ask for equal
page specs (:mod:`kvbench.layouts.pages`: positions in blocks, a window's ring of the same W, a
per-sequence state, a compressed pool). Every figure of a group is its spec's, summed over its
layers; nothing here asks what kind a layer is. A layer that reads another layer's K/V holds
nothing.

- ``per_kind`` (kvbench's pools): a pool per group, of its own block size in bytes; the budget is
  split in proportion to what the longest request holds at its worst in each while it *decodes*,
  after setting aside once what a prefill chunk holds beyond that (a window's ring holds W - 1 +
  chunk positions while a chunk is prefilled, W while it decodes): a forward prefills at most
  ``chunk`` positions in all, so that room is needed once, not once per sequence.
- ``unified`` (vLLM's hybrid allocator): one pool of equal pages, a page being one layer's block or
  one layer's state; the attention block is raised until its page holds a state
  (:func:`unified_block_size`). A group's block takes one page per layer of the group.

Notation: L positions of a sequence, bs tokens per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from kvbench.config.serving import ALLOCATORS, CHECKPOINTS
from kvbench.core.errors import ConfigError
from kvbench.layouts.base import LayerLayout
from kvbench.layouts.pages import PageSpec


@dataclass(frozen=True)
class Group:
    """Layers whose pages come and go together. ``keeps``: its first layer's layout (the rule a
    forward masks by); ``specs``: each layer's page spec, all of one :attr:`PageSpec.paging`."""

    layers: Tuple[int, ...]
    keeps: LayerLayout
    specs: Tuple[PageSpec, ...]

    @property
    def spec(self) -> PageSpec:
        """The group's paging rule (its first layer's spec: every layer's pages the same way)."""
        return self.specs[0]

    @property
    def position_bytes(self) -> int:
        """Bytes one position takes in all the group's layers (0: it keeps none)."""
        return sum(s.position_bytes for s in self.specs)

    def page_bytes(self, block_size: int) -> int:
        """Bytes one block of the group (a page in each of its layers) takes."""
        return sum(s.page_bytes(block_size) for s in self.specs)

    def layer_page_bytes(self, block_size: int) -> int:
        """The largest one layer's page."""
        return max(s.page_bytes(block_size) for s in self.specs)

    def least_bytes(self) -> int:
        """The formula's bytes of a block in use at its least (one position, or the states)."""
        return sum(s.least_bytes() for s in self.specs)

    def filled_bytes(self, filled: int) -> int:
        """The formula's bytes of a block in use with ``filled`` positions written."""
        return sum(s.filled_bytes(filled) for s in self.specs)


def groups_of(layouts: Sequence, element: int, cache_dtype: str = "auto") -> Tuple[Group, ...]:
    """The store's groups, by each layer's page spec: full attention first, then each window, the
    states, the pools (:attr:`PageSpec.paging`)."""
    by_paging = {}
    for index, layout in enumerate(layouts):
        spec = layout.page_spec(element, cache_dtype)
        if spec is not None:
            by_paging.setdefault(spec.paging, []).append((index, layout, spec))
    return tuple(Group(tuple(i for i, _, _ in ls), ls[0][1], tuple(s for _, _, s in ls))
                 for _, ls in sorted(by_paging.items(), key=lambda item: item[0]))


def blocks_held(group: Group, length: int, bs: int) -> int:
    """Blocks one sequence of ``length`` positions holds in ``group`` between forwards: from the one
    holding the first position the next query sees; one page for a state."""
    return group.spec.blocks_held(length, bs)


def worst_blocks(group: Group, length: int, bs: int, chunk: int = 1) -> int:
    """The most blocks a sequence of up to ``length`` positions holds in ``group`` while it grows by
    forwards of at most ``chunk`` positions (what its spec keeps, at the worst block alignment)."""
    return group.spec.worst_blocks(length, bs, chunk)


def unified_block_size(groups: Sequence[Group], block_size: int) -> int:
    """The attention block of the unified pool: the first multiple of ``block_size`` whose page
    (that many positions of the smallest layer that keeps positions) holds the largest layer's
    page that is not positions (a state: vLLM raises it so; 528 tokens for Qwen3.5 in bfloat16
    with blocks of 16)."""
    state = max((s.page_bytes(block_size) for g in groups for s in g.specs if not s.position_bytes), default=0)
    per_position = min((g.position_bytes // len(g.layers) for g in groups if g.position_bytes), default=0)
    if not state or not per_position:
        return block_size
    return -(-state // (per_position * block_size)) * block_size


@dataclass(frozen=True)
class Plan:
    """A store's groups and pools. ``page_bytes``: the bytes one block of each group reserves;
    ``capacity``: blocks each group's storage has; ``cost``: pages a group's block takes."""

    allocator: str
    block_size: int
    groups: Tuple[Group, ...]
    page_bytes: Tuple[int, ...]
    cost: Tuple[int, ...]
    capacity: Tuple[int, ...]
    pages: Tuple[int, ...]  # per_kind: one per group; unified: one
    # pages of each pool a prefill chunk holds beyond a decoding sequence's worst (a window's ring grows
    # by the chunk), room kept once: per_kind sets them aside in its pools, unified keeps them free
    reserve: Tuple[int, ...] = ()
    # positions a block of each group holds: a slot store's window keeps a ring shorter than its
    # slot (empty: block_size each)
    positions: Tuple[int, ...] = ()

    def block_positions(self, g: int) -> int:
        """Positions a block of group ``g`` holds."""
        return self.positions[g] if self.positions else self.block_size

    @property
    def reserved_bytes(self) -> int:
        """Bytes the pools set aside of the budget (whole blocks, whole pages)."""
        if self.allocator == "per_kind":
            return sum(n * b for n, b in zip(self.pages, self.page_bytes))
        return self.pages[0] * self.page_bytes[0] // self.cost[0]

    @property
    def storage_bytes(self) -> int:
        """Bytes the layouts' formula gives for what the groups' storage holds."""
        return sum(n * g.page_bytes(self.block_positions(i))
                   for i, (g, n) in enumerate(zip(self.groups, self.capacity)))

    @property
    def waste_per_sequence(self) -> int:
        """The most bytes one running sequence's pages reserve beyond the formula: a last block with one
        position filled in each K/V group, a page's room beyond its state in the state group (as each spec
        says: :meth:`~kvbench.layouts.pages.PageSpec.most_waste`)."""
        # each page it may hold partly filled, and where a page is raised past its layer's, that room too
        bs = self.block_size
        return sum((b - g.page_bytes(bs)) * g.spec.open_pages(bs) + sum(s.most_waste(bs) for s in g.specs)
                   for g, b in zip(self.groups, self.page_bytes))

    def sequence_bytes(self, length: int) -> int:
        """Bytes one running sequence of ``length`` positions reserves (nothing shared)."""
        return sum(blocks_held(g, length, self.block_size) * b for g, b in zip(self.groups, self.page_bytes))

    def worst_sequence_bytes(self, length: int, chunk: int = 1) -> int:
        """Bytes one sequence of up to ``length`` positions reserves at its worst while it grows by ``chunk``."""
        return sum(worst_blocks(g, length, self.block_size, chunk) * b for g, b in zip(self.groups, self.page_bytes))

    def sequences_fit(self, length: int, chunk: int = 1) -> int:
        """How many sequences of ``length`` positions the pools hold at once, each at its worst (nothing
        shared), beside the room set aside for a prefill chunk: the scarcest pool decides."""
        reserve = self.reserve or (0,) * len(self.pages)
        return min((p - r) // n for p, r, n in zip(self.pages, reserve, self.need(length, chunk)) if n)

    def need(self, length: int, chunk: int) -> Tuple[int, ...]:
        """Pages a request of ``length`` positions needs at its worst, per pool."""
        per_group = [worst_blocks(g, length, self.block_size, chunk) * c for g, c in zip(self.groups, self.cost)]
        return tuple(per_group) if self.allocator == "per_kind" else (sum(per_group),)


def budget_bytes(kv_budget_mb: Optional[float], kv_budget_blocks: Optional[int], block_size: int,
                 groups: Sequence[Group]) -> float:
    """The budget in bytes: ``workload.kv_budget_mb`` x 1e6, or ``workload.kv_budget_blocks`` x a
    block of ``block_size`` positions of every K/V layer (of a model without K/V: x one state)."""
    if kv_budget_blocks is None:
        return kv_budget_mb * 1e6
    per_block = block_size * sum(g.position_bytes for g in groups) or sum(g.page_bytes(block_size) for g in groups)
    return kv_budget_blocks * per_block


def make_plan(groups: Sequence[Group], allocator: str, block_size: int, budget_bytes: float, longest: int,
              chunk: int = 1) -> Plan:
    """The pools ``allocator`` makes of ``budget_bytes`` (``longest`` and ``chunk`` set per_kind's split:
    sized for sequences of ``longest`` that decode, plus once the room a prefill chunk adds)."""
    if allocator not in ALLOCATORS:
        raise ConfigError(f"workload.allocator={allocator!r}: must be one of {', '.join(ALLOCATORS)}")
    groups = tuple(groups)
    if allocator == "per_kind":
        page = tuple(g.page_bytes(block_size) for g in groups)
        decode = [worst_blocks(g, longest, block_size) for g in groups]
        reserve = tuple(worst_blocks(g, longest, block_size, chunk) - n for g, n in zip(groups, decode))
        left = max(0.0, budget_bytes - sum(r * b for r, b in zip(reserve, page)))
        weight = [n * b for n, b in zip(decode, page)]
        pages = tuple(r + int(left * w // sum(weight) // b) for r, w, b in zip(reserve, weight, page))
        return Plan(allocator, block_size, groups, page, (1,) * len(groups), pages, pages, reserve)
    bs = unified_block_size(groups, block_size)
    one = max(g.layer_page_bytes(bs) for g in groups)  # a page: one layer's block (or state)
    cost = tuple(len(g.layers) for g in groups)
    total = usable_pages(int(budget_bytes // one), cost)
    # nothing set aside: a prefill chunk's room is any free page, kept out of the sequences that fit
    reserve = sum((worst_blocks(g, longest, bs, chunk) - worst_blocks(g, longest, bs)) * c
                  for g, c in zip(groups, cost))
    return Plan(allocator, bs, groups, tuple(c * one for c in cost), cost, tuple(total // c for c in cost), (total,),
                (reserve,))


def usable_pages(pages: int, cost: Sequence[int]) -> int:
    """The most of ``pages`` that blocks costing ``cost`` pages each can fill together: the pool makes
    no more (a 3-layer group's blocks never use the last page of 1,000; it was counted as reserved).

    The smallest sum of costs in each residue modulo the cheapest cost (a shortest path over the
    residues), then the largest total at most ``pages`` in the best residue."""
    m = min(cost)
    reach = [0] + [math.inf] * (m - 1)
    changed = True
    while changed:
        changed = False
        for r in (r for r in range(m) if reach[r] < math.inf):
            for c in cost:
                s = reach[r] + c
                if s < reach[s % m]:
                    reach[s % m], changed = s, True
    return max(pages - (pages - x) % m for x in reach if x <= pages)


def slot_plan(groups: Sequence[Group], slot_len: int, num_slots: int, chunk: int) -> Plan:
    """The static cache's pools: ``num_slots`` slots of ``slot_len`` positions in every group, one per
    running request; a window's slot is a ring of W - 1 + ``chunk`` positions where that is shorter
    (a forward adds at most ``chunk``)."""
    groups = tuple(groups)
    positions = tuple(g.spec.slot_positions(slot_len, chunk) for g in groups)
    pages = tuple(num_slots * g.spec.slot_pages(slot_len, chunk) for g in groups)  # a compressed pool's: several
    return Plan("per_kind", slot_len, groups, tuple(g.page_bytes(p) for g, p in zip(groups, positions)),
                (1,) * len(groups), pages, pages, positions=positions)


def slot_bytes(group: Group, slot_len: int, chunk: int) -> int:
    """Bytes one slot of ``slot_len`` positions (a window's ring, a state) takes in ``group``."""
    return group.page_bytes(group.spec.slot_positions(slot_len, chunk)) * group.spec.slot_pages(slot_len, chunk)


class Checkpoint:
    """Where a recurrent layer's state is saved for prefix caching (``workload.state_checkpoint``). A
    state is reused only at the position it was saved at, and K/V in whole blocks: a save off a block
    boundary could never be hit."""

    def __init__(self, policy: str = "block", every: int = 0):
        if policy not in CHECKPOINTS:
            raise ConfigError(f"workload.state_checkpoint={policy!r}: must be one of {', '.join(CHECKPOINTS)}")
        self.policy, self.every = policy, every

    def check(self, block_size: int, allocator: str) -> None:
        if self.policy == "every_n" and (self.every < 1 or self.every % block_size):
            raise ConfigError(f"workload.state_checkpoint_tokens={self.every}: with workload.state_checkpoint=every_n "
                              f"it must be a positive multiple of the attention block ({block_size} tokens with "
                              f"workload.allocator={allocator}): a state is reused only at a block boundary")

    def saves(self, position: int, block_size: int, prompt_len: int) -> bool:
        """Whether the state after ``position`` positions is saved."""
        if position <= 0 or position % block_size:
            return False
        if self.policy == "block":
            return True
        if self.policy == "every_n":
            return position % self.every == 0
        return position == prompt_len // block_size * block_size

    def next_save(self, length: int, block_size: int, prompt_len: int) -> Optional[int]:
        """The first position after ``length`` whose state is saved (a prefill chunk ends there)."""
        if self.policy == "prompt_end":
            end = prompt_len // block_size * block_size
            return end if end > length else None
        step = block_size if self.policy == "block" else self.every
        return (length // step + 1) * step
