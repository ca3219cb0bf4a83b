"""Latent layers: multi-head latent attention (DeepSeek-V2/V3, ``attention=mla``), as
transformers' DeepseekV3Attention.

Each token's keys and values come from one latent c (R = kv_lora_rank, RMS-normed) through
``wkv_b``, plus one rotary key (d_rope) shared by all heads; the cache holds [c, k_rope]
(B, 1, S, R + d_rope). The attention itself is :mod:`kvbench.layouts.latent_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple

from kvbench.layouts.base import LayerLayout, Limit
from kvbench.layouts.kv_heads import KVHeads


@dataclass(frozen=True)
class Latent(LayerLayout):
    """A layer that caches one latent of ``kv_lora_rank`` plus a rotary key per token."""

    num_heads: int = 1
    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    absorbed: bool = True  # attention.mla_decode: how a decode step reads the latents

    kind = "latent"

    @property
    def stored(self) -> Tuple[int, Tuple[int, ...]]:
        return 1, (self.kv_lora_rank + self.qk_rope_head_dim,)

    @property
    def rotary_dim(self) -> int:
        return self.qk_rope_head_dim

    def step_flops(self, context: float) -> float:
        # the absorbed form: each head's query against R + d_rope latent elements, its output over R
        return 2.0 * self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim) * self.positions_held(context)

    def as_mha(self) -> LayerLayout:
        return KVHeads(self.index, None, self.num_heads, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim,
                       v_head_dim=self.v_head_dim)

    def fields(self) -> Dict[str, Any]:
        return {"kv_lora_rank": self.kv_lora_rank, **super().fields()}

    def limits(self):
        return super().limits() + (
            Limit("kv_conversion", ("none",), "converting K/V heads to or from a latent is not built"),)
