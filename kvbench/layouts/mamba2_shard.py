"""How a Mamba-2 layer (:class:`~kvbench.layouts.mamba2.Mamba2`) splits over tensor-parallel ranks, as
vLLM's MambaMixer2 does: each rank runs 1 / ranks of the heads (their state, their x channels of the
convolution, their gate z and dt); the groups of B and C split alike where the ranks divide them, and
where there are fewer groups than ranks each is replicated on the ranks its heads run on (a copy of its
B and C channels each), its gated norm then summing its squares across those ranks. Torch-free."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional


class Mamba2Sharding:
    """The tensor-parallel facet of a Mamba-2 layout (a base of it): its ``shard`` and refusals."""

    def shard(self: Any, ranks: int) -> Any:
        G = self.n_groups
        return replace(self, mamba_num_heads=self.mamba_num_heads // ranks, n_groups=max(1, G // ranks),
                       group_ranks=self.group_ranks * max(1, ranks // G))

    def tensor_refusal(self: Any, ranks: int) -> Optional[str]:
        G = self.n_groups
        if G % ranks and ranks % G:
            return (f"its {G} groups of B and C split over ranks in whole groups only, or each is replicated on "
                    f"ranks / {G} ranks; use a divisor or a multiple of {G}")
        return super().tensor_refusal(ranks)  # type: ignore[misc]  (its heads: Recurrent's)
