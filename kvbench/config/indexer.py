"""DSA's lightning indexer (DeepSeek-V3.2, ``attention.index_topk``) as config: its fields of an MLA
shape checked, and the shape an MLA config asks for defaulted (the layer itself:
:mod:`kvbench.layouts`)."""

from __future__ import annotations

from typing import Any, Dict

from kvbench.config.errors import check


def check_indexer(prefix: str, dims: Any) -> None:
    """DSA's indexer fields of a resolved MLA shape: index_topk 0 (none) or >= 1 with >= 1 heads
    whose keys hold the rotary part, and a compressed query to read (q_lora_rank)."""
    check(dims.index_topk >= 0, f"{prefix}.index_topk", dims.index_topk, "must be >= 0 (0: no indexer)")
    if not dims.index_topk:
        return
    check(dims.index_n_heads >= 1, f"{prefix}.index_n_heads", dims.index_n_heads, "must be >= 1 with an indexer")
    check(dims.index_head_dim >= dims.qk_rope_head_dim and dims.index_head_dim % 2 == 0, f"{prefix}.index_head_dim",
          dims.index_head_dim, f"must be even and >= qk_rope_head_dim={dims.qk_rope_head_dim} (the indexer rotates "
          "that many of its dimensions)")
    check(dims.q_lora_rank >= 1, f"{prefix}.q_lora_rank", dims.q_lora_rank,
          f"must be >= 1 with {prefix}.index_topk={dims.index_topk}: the indexer's queries come from the "
          "compressed query")


def indexer_defaults(own: Any, asked: Any, num_heads: int) -> Dict[str, int]:
    """The indexer shape an MLA config asks for (null: the model's own, else DeepSeek-V3.2's
    ratios: index_n_heads H / 2, index_head_dim 2 x qk_rope_head_dim, a compressed query of 3 x
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
