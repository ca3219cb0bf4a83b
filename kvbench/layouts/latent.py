"""Latent layers: multi-head latent attention (DeepSeek-V2/V3, ``attention=mla``), as
transformers' DeepseekV3Attention, and DeepSeek Sparse Attention (DSA, DeepSeek-V3.2:
``attention.index_topk``), as its DeepseekV32Attention.

Each token's keys and values come from one latent c (R = kv_lora_rank, RMS-normed) through
``wkv_b``, plus one rotary key (d_rope) shared by all heads; the cache holds [c, k_rope]
(B, 1, S, R + d_rope). With DSA a lightning indexer also caches one key of ``index_head_dim``
per token, scores every cached token for each query (``index_n_heads`` ReLU'd dot products,
weighted per token) and each query attends only the ``index_topk`` best of those it may see: a
decode step reads every index key but only k latents. The attention itself is
:mod:`kvbench.layouts.latent_attention` (the indexer: :mod:`kvbench.layouts.latent_indexer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple

from kvbench.config.dtypes import element_bytes
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
    # DSA's lightning indexer, DeepSeek-V3.2's names (index_topk 0: none, every visible token attended)
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0

    kind = "latent"

    @property
    def stored(self) -> Tuple[int, Tuple[int, ...]]:
        # with an indexer, its key is a second tensor per position (what the cache calls V)
        return 1, (self.kv_lora_rank + self.qk_rope_head_dim,) + ((self.index_head_dim,) if self.index_topk else ())

    def attended(self, context: float) -> float:
        """Latents one decode step of one sequence attends at ``context`` positions."""
        held = self.positions_held(context)
        return min(held, self.index_topk) if self.index_topk else held

    def read_bytes(self, context: float, element: int, cache_dtype: str = "auto") -> float:
        if not self.index_topk:
            return super().read_bytes(context, element, cache_dtype)
        # every index key, but only the k selected latents
        latent, index = (element_bytes(w, element, cache_dtype) for w in self.stored[1])
        return self.positions_held(context) * index + self.attended(context) * latent

    @property
    def rotary_dim(self) -> int:
        return self.qk_rope_head_dim

    def step_flops(self, context: float) -> float:
        # the absorbed form: each head's query against R + d_rope latent elements, its output over R;
        # the indexer: each of its heads' query against every index key, and the weighted sum over heads
        latents = 2.0 * self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim) * self.attended(context)
        return latents + 2.0 * self.index_n_heads * (self.index_head_dim + 1) * self.positions_held(context) \
            if self.index_topk else latents

    def as_mha(self) -> LayerLayout:
        return KVHeads(self.index, None, self.num_heads, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim,
                       v_head_dim=self.v_head_dim)

    def fields(self) -> Dict[str, Any]:
        return {"kv_lora_rank": self.kv_lora_rank, **super().fields(),
                **({"index_topk": self.index_topk} if self.index_topk else {})}

    def limits(self):
        own = (Limit("kv_conversion", ("none",), "converting K/V heads to or from a latent is not built"),)
        if self.index_topk:
            why = f"attention.index_topk={self.index_topk} (DSA's top-k selection) is not built for"
            own += (Limit("cache.shared", (False, None), f"{why} a shared prefix; use cache.shared=false"),
                    Limit("runtime.compile", ("false", "default"), f"{why} the fixed-shape step; use false or default"))
        return super().limits() + own

