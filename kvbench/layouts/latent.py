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
from kvbench.config.errors import check
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
                    Limit("runtime.compile", ("false", "default"), f"{why} the fixed-shape step; use false or default"),
                    Limit("workload.store", (None,),
                          f"{why} workload=serving's KV stores yet; use attention.index_topk=0"))
        return super().limits() + own


def check_indexer(prefix: str, dims: Any, window: Any = None) -> None:
    """DSA's indexer fields of a resolved MLA shape: index_topk 0 (none) or >= 1 with >= 1 heads
    whose keys hold the rotary part, a query latent to read (q_lora_rank), and no window."""
    check(dims.index_topk >= 0, f"{prefix}.index_topk", dims.index_topk, "must be >= 0 (0: no indexer)")
    if not dims.index_topk:
        return
    check(dims.index_n_heads >= 1, f"{prefix}.index_n_heads", dims.index_n_heads, "must be >= 1 with an indexer")
    check(dims.index_head_dim >= dims.qk_rope_head_dim and dims.index_head_dim % 2 == 0, f"{prefix}.index_head_dim",
          dims.index_head_dim, f"must be even and >= qk_rope_head_dim={dims.qk_rope_head_dim} (the indexer rotates "
          "that many of its dimensions)")
    check(dims.q_lora_rank >= 1, f"{prefix}.q_lora_rank", dims.q_lora_rank,
          f"must be >= 1 with {prefix}.index_topk={dims.index_topk}: the indexer's queries come from the query latent")
    check(not window, f"{prefix}.index_topk", dims.index_topk, f"selects among every cached token; with a window "
          f"({window}) it is not built (use attention.window=0)")


def indexer_defaults(own: Any, asked: Any, num_heads: int) -> Dict[str, int]:
    """The indexer shape an MLA config asks for (null: the model's own, else DeepSeek-V3.2's
    ratios: index_n_heads H / 2, index_head_dim 2 x qk_rope_head_dim, a query latent of 3 x
    kv_lora_rank where the model has none), where ``asked.index_topk`` turns an indexer on."""
    topk = own.index_topk if asked.index_topk is None else asked.index_topk
    if not topk:
        for name in ("index_n_heads", "index_head_dim"):
            check(not getattr(asked, name), f"attention.{name}", getattr(asked, name),
                  "is a DSA indexer's shape; set attention.index_topk >= 1 too (0: no indexer)")
        return {"index_topk": 0, "index_n_heads": 0, "index_head_dim": 0}

    def pick(name: str, default: int) -> int:
        value = getattr(asked, name)
        return value if value is not None else getattr(own, name) or default

    out = {"index_topk": topk, "index_n_heads": pick("index_n_heads", max(1, num_heads // 2)),
           "index_head_dim": pick("index_head_dim", 2 * pick("qk_rope_head_dim", 2))}
    if asked.q_lora_rank is None and not own.q_lora_rank:
        out["q_lora_rank"] = 3 * pick("kv_lora_rank", 1)
    return out
