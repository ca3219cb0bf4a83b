"""Rotary position embeddings in the rotate-half layout of transformers' Llama-family checkpoints:
the tables (with linear, llama3 and yarn scaling, as transformers computes them) and their
application to query and key heads."""

from __future__ import annotations

import math
import re
from typing import Any, Dict, Optional

import torch

# A ``cfg`` or ``model`` here is a kvbench.config.model.ModelConfig (its rope_* fields, head_dim, max_seq_len):
# named, not imported, so that the attention modules below the config can use these tables.


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched ``scale`` times (transformers' formula)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(cfg: Any) -> float:
    """What cos and sin are multiplied by: 1, or yarn's attention factor (given, else transformers' formula)."""
    if cfg.rope_type != "yarn":
        return 1.0
    if cfg.rope_attention_factor is not None:
        return cfg.rope_attention_factor
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return yarn_mscale(cfg.rope_factor, cfg.rope_mscale) / yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
    return yarn_mscale(cfg.rope_factor)


def rope_inv_freq(cfg: Any, dim: Optional[int] = None) -> torch.Tensor:
    """Rotary inverse frequencies (D/2,) in float64, scaled as transformers' rope type ``cfg.rope_type``:
    ``linear`` divides all by ``rope_factor``; ``llama3`` divides long wavelengths, keeps short ones
    and blends linearly in between (the clamp is transformers' three-way ``where``); ``yarn`` blends
    over a ramp between the dimensions that turn ``rope_beta_fast`` and ``rope_beta_slow`` times in
    the pretraining context. ``dim``: the rotated width (default head_dim; MLA: qk_rope_head_dim)."""
    D = cfg.head_dim if dim is None else dim  # 0: no layer rotates, an empty table
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    if cfg.rope_type == "yarn":
        def turns_dim(turns: float) -> float:  # the dimension whose wavelength fits `turns` times
            return D * math.log(cfg.rope_original_max_seq_len / (turns * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))
        low, high = turns_dim(cfg.rope_beta_fast), turns_dim(cfg.rope_beta_slow)
        if cfg.rope_truncate:  # whole dimensions (transformers' default; GPT-OSS keeps the fractions)
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, D - 1)
        high = high + 0.001 if low == high else high  # transformers' guard against a zero-width ramp
        keep = 1 - ((torch.arange(D // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        return inv_freq / cfg.rope_factor * (1 - keep) + inv_freq * keep
    if cfg.rope_type == "linear":
        return inv_freq / cfg.rope_factor
    if cfg.rope_type == "llama3":
        wavelen = 2 * math.pi / inv_freq
        low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        keep = ((cfg.rope_original_max_seq_len / wavelen - low) / (high - low)).clamp(0, 1)
        return (1 - keep) * inv_freq / cfg.rope_factor + keep * inv_freq
    return inv_freq


def rope_tables(cfg: Any, dim: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (max_seq_len, D), rotate-half layout, times yarn's attention factor."""
    inv_freq = rope_inv_freq(cfg, dim)
    if inv_freq.numel() == 0:  # nothing rotates (NoPE): no positions' table, whatever max_seq_len is
        return torch.empty(cfg.max_seq_len, 0), torch.empty(cfg.max_seq_len, 0)
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    factor = rope_attention_factor(cfg)
    return (angles.cos() * factor).float(), (angles.sin() * factor).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, D) rotated by cos/sin (T, R) or (B, T, R): the first R <= D dims rotate-half,
    the rest pass (partial rotary, transformers' order)."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    R = cos.shape[-1]
    if R == 0:  # a layer without rotary embeddings (NoPE)
        return x
    if R < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :R], cos, sin), x[..., R:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def deinterleave_rope(tensors: Dict[str, torch.Tensor], model: Any, attention: Any) -> None:
    """DeepSeek rotates its rope dimensions in interleaved pairs (x0, x1), (x2, x3), ...; the
    decoder rotates halves. Reordering the rows that produce them (evens, then odds) makes the
    decoder's rotate-half compute what transformers' ``rope_interleave`` does (V3: the same
    values; V2's complex rotation: the same dot products, its dimensions in pair order). ``tensors``:
    a checkpoint's weights by the decoder's names, reordered in place for ``attention``'s shape. Llama 4
    (K/V heads, complex rotation) too: each query and key head's rows (and biases), whole."""
    if model.preset_mla is None:
        D = model.head_dim
        order = torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)])
        for name in [k for k in tensors if re.fullmatch(r"blocks\.\d+\.attn\.w[qk]\.(weight|bias)", k)]:
            w = tensors[name]
            tensors[name] = w.view(-1, D, *w.shape[1:])[:, order].reshape(w.shape)  # (heads, D, C) rows per head
        return
    d_rope, d_qk = attention.qk_rope_head_dim, attention.qk_nope_head_dim + attention.qk_rope_head_dim
    order = torch.cat([torch.arange(0, d_rope, 2), torch.arange(1, d_rope, 2)])
    for i in range(model.num_layers):
        q = f"blocks.{i}.attn.wq.{'2.' if attention.q_lora_rank else ''}weight"
        w = tensors[q].view(model.num_heads, d_qk, -1)  # (H, d_nope + d_rope, C) rows per head
        tensors[q] = torch.cat([w[:, :-d_rope], w[:, -d_rope:][:, order]], 1).reshape(tensors[q].shape)
        kv = f"blocks.{i}.attn.wkv_a.weight"  # (R + d_rope, C): the rotary key's rows last
        tensors[kv] = torch.cat([tensors[kv][:-d_rope], tensors[kv][-d_rope:][order]])
