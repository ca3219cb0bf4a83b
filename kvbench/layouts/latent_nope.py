"""Latent layers without rotary embeddings: Kimi Linear's full layers (transformers'
KimiLinearAttention), multi-head latent attention whose shared key part (qk_rope_head_dim wide,
one per token beside the latent, as DeepSeek's) is never rotated: positions enter its model
through the KDA layers' recurrence and convolutions only.

What a layer caches, reads and spends is :class:`~kvbench.layouts.latent.Latent`'s, [c, k_rope]
(R + d_rope) per token; only the rotation differs, so the decoder builds no rotary tables for it
(:attr:`LatentNoPE.rotary_dim` 0) and its attention rotates nothing
(:mod:`kvbench.layouts.latent_nope_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from kvbench.config.errors import ConfigError
from kvbench.layouts.latent import Latent


@dataclass(frozen=True)
class LatentNoPE(Latent):
    """A :class:`Latent` layer whose shared key part is not rotated (DeepSeek's names)."""

    @property
    def rotary_dim(self) -> int:
        return 0  # the qk_rope_head_dim part is held and read unrotated

    def in_words(self) -> str:
        return "multi-head latent attention without rotary embeddings"


def _count(cfg: Mapping[str, Any], key: str, default: int, least: int = 1) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{key}={value!r}: must be an integer >= {least}")
    return value


def kimi_latent_from_hf(cfg: Mapping[str, Any]) -> LatentNoPE:
    """The full layers' layout of a KimiLinearForCausalLM config.json (KimiLinearConfig's defaults
    for absent keys); what kvbench's latent attention cannot run refused in one line naming its key."""
    if cfg.get("attention_bias"):  # KimiLinearAttention's kv_a_proj_with_mqa and o_proj would have biases
        raise ConfigError(f"attention_bias={cfg['attention_bias']!r}: a latent layer has no projection biases "
                          "(use false)")
    heads = _count(cfg, "num_attention_heads", 32)
    kv_heads = cfg.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        # every head expands its own key from the latent: transformers' module fails on fewer K/V heads
        raise ConfigError(f"num_key_value_heads={kv_heads!r}: must equal num_attention_heads={heads} in a latent "
                          "layer (each head's key comes from the latent)")
    q_rank = cfg.get("q_lora_rank")
    return LatentNoPE(None, num_heads=heads, q_lora_rank=0 if q_rank is None else _count(cfg, "q_lora_rank", 0),
                      kv_lora_rank=_count(cfg, "kv_lora_rank", 512),
                      qk_nope_head_dim=_count(cfg, "qk_nope_head_dim", 128),
                      qk_rope_head_dim=_count(cfg, "qk_rope_head_dim", 64, least=0),
                      v_head_dim=_count(cfg, "v_head_dim", 128))
