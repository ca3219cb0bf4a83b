"""``model.multipliers``: constant scalings of a decoder's embedding, residual branches, attention
logits and output logits, as Granite 3 and 4 (transformers' GraniteMoeHybrid) train with them; no
torch. Null: none (every one 1, the attention's 1/sqrt(head_dim))."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvbench.core.errors import check


@dataclass
class Multipliers:
    """config.json's names: the embedding is multiplied by ``embedding_multiplier``, each block's
    attention and MLP outputs by ``residual_multiplier`` before they join the residual, the attention
    logits q·k by ``attention_multiplier`` (null: 1/sqrt(head_dim)) and the logits are divided by
    ``logits_scaling``."""

    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: Optional[float] = None
    logits_scaling: float = 1.0

    def __post_init__(self) -> None:
        for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
            value = getattr(self, key)
            check(value is None and key == "attention_multiplier" or
                  isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf"),
                  f"model.multipliers.{key}", value, "must be a finite number > 0")
