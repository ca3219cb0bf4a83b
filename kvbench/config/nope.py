"""``model.nope``: Llama 4's attention beside its chunked layers (transformers' Llama4TextAttention), no
torch. Null: none of it.

- ``layers``: the layers without rotary embeddings (NoPE; config.json's ``no_rope_layers`` holds a 0 for
  each, every ``no_rope_layer_interval``-th by default): positions reach them only through the causal
  mask, so they attend every position however far (Llama 4's global layers).
- on those, with ``temperature_tuning`` (``attn_temperature_tuning``), each query at position p is scaled
  by 1 + ``attn_scale`` · log(1 + floor((p + 1) / ``floor_scale``)), sharpening attention at long range
  (arXiv 2501.19399);
- ``qk_l2_norm`` (``use_qk_norm``): on the other layers, each query and key head L2-normalised over its
  width after rotary (an RMSNorm without weight: x / sqrt(mean(x²) + norm_eps)).

Llama 4's checkpoints rotate complex pairs of dimensions (x0, x1), (x2, x3), ...; their query and key
rows are read reordered for the decoder's rotate-half (:func:`kvbench.rope.deinterleave_rope`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List

from kvbench.core.errors import check


@dataclass
class NoPE:
    """Layers without rotary embeddings and what goes with them (the module docstring); config.json's
    names in the comments."""

    layers: List[int] = field(default_factory=list)  # the 0s of no_rope_layers
    temperature_tuning: bool = True  # attn_temperature_tuning
    floor_scale: float = 8192.0  # floor_scale
    attn_scale: float = 0.1  # attn_scale
    qk_l2_norm: bool = True  # use_qk_norm: on the layers with rotary embeddings

    def __post_init__(self) -> None:
        check(all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.layers)
              and len(set(self.layers)) == len(self.layers), "model.nope.layers", self.layers,
              "must be distinct layer indices >= 0")
        for key in ("floor_scale", "attn_scale"):
            value = getattr(self, key)
            check(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")
                  and (value > 0 or key == "attn_scale"), f"model.nope.{key}", value,
                  "must be a finite number > 0" if key == "floor_scale" else "must be a finite number >= 0")

    def scale(self, position: float) -> float:
        """What a NoPE layer multiplies a query at ``position`` by (1 without temperature tuning)."""
        if not self.temperature_tuning:
            return 1.0
        return 1.0 + self.attn_scale * math.log1p(math.floor((position + 1) / self.floor_scale))
