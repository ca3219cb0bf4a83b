"""What every recurrent layer kind shares (Gated DeltaNet, Mamba-2, KDA): nothing per position, a
state per sequence, and the settings such a state cannot take yet, refused in the same words."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple

from kvbench.layouts.base import LayerLayout, Limit
from kvbench.layouts.pages import StatePage


@dataclass(frozen=True)
class Recurrent(LayerLayout):
    """A layer that keeps a state per sequence, not K/V per position; ``title`` names it in its
    refusals. ``cache.dtype`` is not refused: it applies to the layers that keep K/V, and a state
    keeps ``cache.state_dtype``."""

    title: ClassVar[str] = ""

    @property
    def stored(self) -> Tuple[int, Tuple[int, ...]]:
        return 0, ()  # nothing per position

    @property
    def rotary_dim(self) -> int:
        return 0  # positions enter through the recurrence and the convolution, not a rotation

    def positions_held(self, seq_len: float) -> float:
        return 0

    def page_spec(self, element: int, cache_dtype: str = "auto") -> StatePage:
        """A page per sequence: the convolution's tail in the compute dtype, the recurrent state in
        its own (``cache.state_dtype``; ``cache.dtype`` is for K/V)."""
        s = self.state
        return StatePage(conv_bytes=s.conv_channels * s.conv_tail * element, recurrent_elements=math.prod(s.recurrent),
                         state_dtype=s.state_dtype)

    def limits(self, index: Optional[int] = None) -> Tuple[Limit, ...]:
        return super().limits(index) + (
            Limit("cache.shared", (False, None), f"a shared prefix holds K/V once for many sequences; a {self.title} "
                  "layer's state is each sequence's own (prefix caching for state layers is not built); use "
                  "cache.shared=false"),
            Limit("runtime.compile", ("false", "default"), "the fixed-shape step reads a context bucket of K/V; a "
                  f"{self.title} layer's state has no such view (not built); use false or default"))

    def table_name(self) -> str:
        return self.kind

    def tensor_refusal(self, ranks: int) -> Optional[str]:
        # its state's heads are its query heads too: a head on two ranks would add its output twice
        heads = self.held_heads()
        return (f"its {heads} state heads split over ranks in whole heads only (each is also a query head, "
                f"summed once); use a divisor of {heads}") if heads % ranks else None
