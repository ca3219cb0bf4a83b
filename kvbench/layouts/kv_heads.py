"""KV-head layers: MHA, GQA or MQA purely by ``num_kv_heads``; optionally a sliding window,
learned attention sinks, an output gate and rotary embeddings over part of each head.

Query head h reads KV head h // G (contiguous groups, the Llama-checkpoint convention), G = H / H_kv.
Sinks (GPT-OSS): one learned logit per query head joins every softmax as a column with no value,
so a head can put weight on "nothing"; they cost no cache. The attention itself is
:mod:`kvbench.layouts.kv_heads_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

from kvbench.layouts.base import LayerLayout


def kv_group_map(num_heads: int, num_kv_heads: int) -> List[int]:
    """KV head read by each query head: ``map[h] = h // (num_heads // num_kv_heads)``."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
    group = num_heads // num_kv_heads
    return [h // group for h in range(num_heads)]


@dataclass(frozen=True)
class KVHeads(LayerLayout):
    """A layer of ``num_kv_heads`` K and V heads of ``head_dim`` each."""

    num_heads: int = 1
    num_kv_heads: int = 1
    head_dim: int = 2
    sinks: bool = False
    v_head_dim: Optional[int] = None  # values of another width than keys (an MLA model's heads as MHA)
    # Qwen3.5 / Qwen3-Next: the query projection also emits a gate per head that scales the output
    # (sigmoid) before o_proj; rotary embeddings turn only the first ``rotary`` dimensions of a head.
    # Neither changes what is cached or read per position.
    output_gate: bool = False
    rotary: Optional[int] = None  # None: every dimension of the head

    kind = "kv_heads"
    reads_shared_kv = True

    @property
    def stored(self) -> Tuple[int, Tuple[int, ...]]:
        return self.num_kv_heads, (self.head_dim, self.head_dim if self.v_head_dim is None else self.v_head_dim)

    def as_mha(self) -> "KVHeads":
        return replace(self, num_kv_heads=self.num_heads, window=None, sinks=False, kv_source=None)

    @property
    def rotary_dim(self) -> int:
        return self.head_dim if self.rotary is None else self.rotary

    def step_flops(self, context: float) -> float:
        # a multiply-add per element of each K and V vector read, for every query head
        return 2.0 * self.num_heads * sum(self.stored[1]) * self.positions_held(context)

    def fields(self) -> Dict[str, Any]:
        return {"num_kv_heads": self.num_kv_heads, **super().fields(), **({"sinks": True} if self.sinks else {})}
