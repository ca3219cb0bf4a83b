"""How a layer splits over tensor-parallel ranks, as every layout answers it (:class:`Sharding`, a base
of :class:`~kvbench.layouts.base.LayerLayout`).

A layer's cache is cut by its heads, as an engine's attention is: ``ranks`` ranks each hold
``heads / ranks`` whole heads; a layer with fewer heads than ranks (MQA's one K/V head, MLA's one
latent, DeepSeek-V4's one compressed head) is not cut further, and each of its heads is held on
``ranks / heads`` ranks, a copy each (vLLM's ``num_kv_heads_per_rank = max(1, H_kv // tp)``). A
recurrent layer's state is cut by its heads the same way, but never replicated: its state heads are
its query heads too (:class:`~kvbench.layouts.recurrent.Recurrent` refuses ranks they do not divide).
Nothing here names a kind: the heads are the layout's own ``stored`` count, or its state's leading
dimension; what one rank runs is the kind's ``shard``.
"""

from __future__ import annotations

from typing import Any, Optional


class Sharding:
    """What a layer layout answers about tensor parallelism; a kind whose torch module can run one
    rank's part overrides :meth:`shard` (None: it runs whole only)."""

    def held_heads(self) -> int:
        """The heads the layer's cache (or state) is made of: what tensor parallelism cuts."""
        heads = self.stored[0]  # type: ignore[attr-defined]
        state = self.state  # type: ignore[attr-defined]
        return heads or (state.recurrent[0] if state is not None else 1)

    def tensor_parts(self, ranks: int) -> int:
        """Into how many distinct parts ``ranks`` ranks cut the layer's cache: each rank holds one,
        1 / parts of the layer's bytes, and each part is held by ranks / parts ranks (the
        replication; 1 while there are at least as many heads as ranks)."""
        return max(1, min(self.held_heads(), ranks))

    def tensor_refusal(self, ranks: int) -> Optional[str]:
        """Why ``ranks`` ranks cannot cut this layer into whole heads (None: they can)."""
        heads = self.held_heads()
        if heads % ranks and ranks % heads:
            return f"the layer's {heads} heads split over ranks in whole heads only, or each is replicated on " \
                   f"ranks / {heads} ranks; use a divisor or a multiple of {heads}"
        return None

    def shard(self, ranks: int) -> Optional[Any]:
        """The layout one of ``ranks`` ranks runs (its query heads, its part of the cache), or None
        where the kind's module runs whole only."""
        return None
