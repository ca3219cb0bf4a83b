"""A model's own multi-head latent attention shape (``model.preset_mla``, DeepSeek-V2/V3's names)
and the checks every latent shape passes, the model's or the run's (``attention=mla``); torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbench.config.errors import check, check_numbers, check_positive
from kvbench.config.indexer import check_indexer

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
