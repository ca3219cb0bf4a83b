"""One forward's view of a serving store, passed to the decoder as its cache: each layer's cache
answers the cache's one question over the sequences' pages, made by its group's manager
(:mod:`kvbench.serving.managers`). A K/V layer gathers the keys its queries may see, padded to the
longest sequence and masked by its layout; a recurrent layer reads each sequence's state page and
writes it back when the forward commits.

Notation: B sequences, T new tokens each, S keys gathered, H_kv KV heads, D width.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from kvbench.cache import Attend, LayerCache, Positions, mask_over, visible
from kvbench.kv_store import KVStore
from kvbench.shared_kv import SharedLayer, link
from kvbench.state_cache import Carry


class Slots:
    """Where one layer's positions of this forward are: ``write`` (B*T,) the slots the new positions go
    to, ``read`` (B, S) the slots gathered (padding reads slot 0, hidden by the mask)."""

    def __init__(self, write: torch.Tensor, read: torch.Tensor):
        self.write, self.read, self.flat_read = write, read, read.reshape(-1)

    def gather(self, store: KVStore) -> torch.Tensor:
        # index_select of the flat (B*S,) index: ~15x faster on a CPU than advanced indexing, for the same copy
        B, S = self.read.shape
        return store.gather(self.flat_read).view(B, S, *store.shape[1:]).transpose(1, 2)


class GroupView:
    """A K/V group's keys for this forward: which positions each sequence reads (a window's from its
    first visible one) under the mask, and their :class:`Slots` in the group's blocks (``slots``), or
    in any table of pages that holds the same blocks (:meth:`slots_of`: a layer's pages in a pool
    shared by every group). ``ring``: each table is one page of ``bs`` positions, position p at p mod
    bs (a slot store's window)."""

    def __init__(self, tables: Sequence[List], starts: Sequence[int], T: int, bs: int, layout, positions: Positions,
                 device, ring: bool = False):
        ends = [s + T for s in starts]
        firsts = [layout.first_kept(s) for s in starts]
        S = max(e - f for e, f in zip(ends, firsts))
        if ring and S > bs:  # two positions read would share a slot: the newer overwrote the older
            raise ValueError(f"a forward of {T} positions reads {S} keys of a layer whose slot is a ring of {bs}: "
                             "forwards may add at most the chunk the slot store was sized for")
        keys = torch.tensor(firsts)[:, None] + torch.arange(S)[None]  # (B, S) key positions
        self.bs, self.device, self.valid = bs, device, keys < torch.tensor(ends)[:, None]
        at = torch.zeros_like(keys) if ring else torch.where(self.valid, keys // bs, torch.zeros_like(keys))
        self.at, self.offset = at, keys % bs
        new = torch.tensor(starts)[:, None] + torch.arange(T)[None]  # (B, T)
        self.new = new - torch.tensor(firsts)[:, None]  # the new positions among the S read
        self.slots = self.slots_of(tables)
        if len(starts) == 1:  # no padding: the plain rule over positions firsts[0]..ends[0]-1
            self.mask, self.causal = mask_over(positions, [(firsts[0], S)], layout)
        else:  # a padded key sits past its sequence's end, so the causal rule hides it
            self.mask, self.causal = visible(positions.ids, keys.to(device), layout), False  # (B, T, S)

    def slots_of(self, tables: Sequence[List]) -> Slots:
        """The slots (page x bs + offset) of the positions read and written, by ``tables`` of pages."""
        width = max(len(t) for t in tables)
        table = torch.tensor([[-1 if b is None else b for b in t] + [-1] * (width - len(t)) for t in tables],
                             dtype=torch.long)  # (B, blocks); -1: released or beyond the sequence
        pages = table.gather(1, self.at)
        # padding reads the sequence's first key (column 0: always held), never a slot another layer
        # or group may hold (in a shared byte pool, any bytes: masked, but NaN x 0 is NaN)
        read = torch.where(self.valid & (pages >= 0), pages * self.bs + self.offset, pages[:, :1] * self.bs +
                           self.offset[:, :1])
        return Slots(read.gather(1, self.new).reshape(-1).to(self.device), read.to(self.device))


class PagedLayer(LayerCache):
    """One K/V layer of a :class:`BatchView`: its ``slots`` under its group's ``view``'s mask."""

    def __init__(self, view: GroupView, stores: List[KVStore], slots: Slots):
        self.view, self.stores, self.slots = view, stores, slots

    def update(self, k, v, pos):
        out = []
        for store, x in zip(self.stores, (k, v)):
            B, H, T, D = x.shape
            store.write(self.slots.write, x.transpose(1, 2).reshape(B * T, H, D))
            out.append(self.slots.gather(store))  # (B, H_kv, S, D)
        return Attend(out[0], out[1] if len(out) > 1 else None, self.view.mask, self.view.causal)


class PagedStateLayer:
    """One recurrent layer of a :class:`BatchView`: the sequences' state pages (B,), read as a batch
    and written back at :meth:`commit` (the layer advances the state it was handed in place)."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor, pages: torch.Tensor):
        self.conv, self.recurrent, self.pages = conv, recurrent, pages
        self.state = None

    def update(self, x: torch.Tensor, pos) -> Carry:
        tail = self.conv.shape[-1]
        inputs = torch.cat([self.conv.index_select(0, self.pages), x], -1)  # (B, C, K - 1 + T)
        if tail:
            self.conv.index_copy_(0, self.pages, inputs[..., inputs.shape[-1] - tail:])
        self.state = self.recurrent.index_select(0, self.pages)
        return Carry(inputs, self.state)

    def commit(self) -> None:
        if self.state is not None:
            self.recurrent.index_copy_(0, self.pages, self.state)
            self.state = None


class BatchView:
    """The cache of one forward that adds ``T`` positions to each of ``seqs`` in ``store`` (their
    blocks grown to hold them)."""

    stores_history = True

    def __init__(self, store, seqs: Sequence, T: int):
        dev = store.device
        starts = [s.length for s in seqs]
        new = torch.tensor(starts)[:, None] + torch.arange(T)[None]  # (B, T) positions written
        self.positions = Positions(starts[0], T, dev) if len(seqs) == 1 else Positions.of(new.to(dev))
        layers: List = [None] * len(store.layouts)
        self.commits: List[PagedStateLayer] = []  # the caches that write back when the forward commits
        for g, manager in enumerate(store.managers):  # each group's caches, by its spec's manager
            caches = manager.caches([s.tables[g] for s in seqs], starts, T, self.positions, dev)
            for layer, cache in caches.items():
                layers[layer] = cache
            self.commits += list(caches.values()) if manager.commits else []
        for i, layout in enumerate(store.layouts):
            if layout.kv_source is not None:
                layers[i] = SharedLayer()
        self.layers = link(store.layouts, layers)

    def begin(self, pos: Positions, batch_size: int) -> List:
        return self.layers

    def commit(self, pos: Positions) -> None:
        for layer in self.commits:  # the store counts the positions written (PagedStore.written)
            layer.commit()
