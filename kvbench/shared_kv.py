"""The caches of cross-layer KV sharing (:mod:`kvbench.layouts.kv_sharing`): a shared layer's
``update(None, None, pos)`` returns what its donor's update returned for the same positions in
this forward, so it attends exactly its donor's keys (prefill and decode, ring or full) and holds
nothing. A :class:`Donor` keeps its last answer only until every reader has read it, so a
recompute's K/V do not outlive the forward.
"""

from __future__ import annotations

from typing import List, Sequence


class Donor:
    """A layer cache (``inner``) whose last update ``readers`` shared layers read."""

    def __init__(self, inner, readers: int):
        self.inner, self.readers = inner, readers
        self._last, self._left = None, 0

    def update(self, k, v, pos):
        att = self.inner.update(k, v, pos)
        self._last, self._left = ((pos.start, pos.T), att), self.readers
        return att

    def read(self, pos):
        """The donor's answer for ``pos``, which it must have just given."""
        if self._last is None or self._last[0] != (pos.start, pos.T):
            raise RuntimeError(f"a shared layer read positions {pos.start}..+{pos.T} before its donor layer wrote them")
        att = self._last[1]
        self._left -= 1
        if not self._left:
            self._last = None
        return att

    def __getattr__(self, name):  # everything else is the donor's cache's own (layout, store, stores, tensors, ...)
        return getattr(self.inner, name)


class SharedLayer:
    """A layer that attends another layer's cache (:class:`Donor`, set by :func:`link`) and stores nothing."""

    def __init__(self):
        self.donor = None

    def update(self, k, v, pos):
        return self.donor.read(pos)

    def tensors(self) -> List:
        return []

    def truncate(self, length: int, held: int) -> None:
        """Nothing of its own: its donor rolls back."""

    def fixed_view(self, length: int):
        raise ValueError("a layer that reads another layer's K/V has no fixed-shape view (not built); "
                         "use runtime.compile=false|default")


def link(layouts: Sequence, caches: List) -> List:
    """``caches`` (one per layout, a :class:`SharedLayer` where the layout reads another layer's)
    with each donor wrapped and each shared layer pointed at it."""
    readers = {}
    for layout in layouts:
        if layout.kv_source is not None:
            readers[layout.kv_source] = readers.get(layout.kv_source, 0) + 1
    caches = list(caches)
    for index, count in readers.items():
        caches[index] = Donor(caches[index], count)
    for layout, cache in zip(layouts, caches):
        if layout.kv_source is not None:
            cache.donor = caches[layout.kv_source]
    return caches
