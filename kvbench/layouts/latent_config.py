"""The latent kind's config block (multi-head latent attention, DeepSeek-V2/V3's names, + DSA's
lightning indexer of DeepSeek-V3.2, ``attention.index_topk``): a model's own shape
(``model.preset_mla``), the ``attention.*`` fields it owns, the checks every latent shape passes,
the model's or the run's (``attention=mla``), and the indexer a config asks for defaulted; torch-free
(the layout: :mod:`kvbench.layouts.latent`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

from kvbench.core.errors import check, check_numbers, check_positive

INDEX_FIELDS = ("index_n_heads", "index_head_dim", "index_topk")  # DSA's indexer (DeepSeek-V3.2), with mla only
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", *INDEX_FIELDS)


@dataclass
class MLAShape:
    """A model's own multi-head latent attention layout (DeepSeek's names; what its weights are
    shaped by). ``q_lora_rank`` 0: queries by one full-rank projection (DeepSeek-V2-Lite's null)."""

    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0  # DSA: each query attends its top index_topk tokens (0: no indexer)

    def __post_init__(self) -> None:
        check_mla_dims("model.preset_mla", self)
        check_indexer("model.preset_mla", self)


def check_mla_dims(prefix: str, dims: Any) -> None:
    """Latent ranks and head widths: counts, the rotary part even (it rotates pairs)."""
    check_numbers(prefix, dims)
    check(dims.q_lora_rank >= 0, f"{prefix}.q_lora_rank", dims.q_lora_rank, "must be >= 0 (0: a full-rank q)")
    check_positive(prefix, dims, ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"))
    check(dims.qk_rope_head_dim >= 2 and dims.qk_rope_head_dim % 2 == 0, f"{prefix}.qk_rope_head_dim",
           dims.qk_rope_head_dim, "must be even and >= 2 (rotary embeddings rotate pairs of dimensions)")



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
