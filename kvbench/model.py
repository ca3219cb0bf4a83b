"""The one decoder kvbench measures: Llama-style (RMSNorm, rotary embeddings, SwiGLU), with the
switches that make it Qwen2 (q/k/v biases) or Qwen3 (per-head q/k RMSNorm) as config fields.

Attention is MHA, GQA or MQA purely by ``num_kv_heads``; nothing in ``forward`` branches on a
variant name. Query head h reads KV head h // G (contiguous groups, the Llama-checkpoint
convention). K/V are never expanded to ``num_heads`` copies: the G query heads of a group are
folded into the query-length dimension, so one SDPA call over (B, H_kv, G*T, D) queries reads
each KV head once.

Notation: B batch, T new tokens, S keys attended (cached + new), H query heads,
H_kv KV heads, G = H / H_kv query heads per KV head, D head_dim, V vocab.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvbench.config import DTYPE_BYTES
from kvbench.model_config import AttentionConfig, ModelConfig


def torch_dtype(name: str) -> torch.dtype:
    """``runtime.dtype`` (float32 | float16 | bfloat16) as a torch dtype."""
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype={name!r}: must be one of {', '.join(DTYPE_BYTES)}")
    return getattr(torch, name)


def kv_group_map(num_heads: int, num_kv_heads: int) -> List[int]:
    """KV head read by each query head: ``map[h] = h // (num_heads // num_kv_heads)``."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
    group = num_heads // num_kv_heads
    return [h // group for h in range(num_heads)]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as Llama does: half-precision sums of squares lose accuracy.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.type_as(x)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies (D/2,) in float64, scaled by ``cfg.rope_type`` as transformers'
    rope type of that name: ``linear`` divides all by ``rope_factor``; ``llama3`` divides those
    whose wavelength exceeds ``rope_original_max_seq_len / rope_low_freq_factor``, keeps those
    below ``rope_original_max_seq_len / rope_high_freq_factor`` and blends linearly in between
    (the clamp of the blend weight to [0, 1] is transformers' three-way ``where``)."""
    D = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    if cfg.rope_type == "linear":
        return inv_freq / cfg.rope_factor
    if cfg.rope_type == "llama3":
        wavelen = 2 * math.pi / inv_freq
        low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        keep = ((cfg.rope_original_max_seq_len / wavelen - low) / (high - low)).clamp(0, 1)
        return (1 - keep) * inv_freq / cfg.rope_factor + keep * inv_freq
    return inv_freq


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (max_seq_len, D), in the rotate-half layout of HF Llama checkpoints."""
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), rope_inv_freq(cfg))
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x (B, heads, T, D); cos/sin (T, D) or (B, T, D) broadcast over heads
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def fold_mask(mask: torch.Tensor, group: int) -> torch.Tensor:
    """Repeat a (T, S) or (B, T, S) mask for the folded query rows of :func:`grouped_attention`:
    (G*T, S) or (B, 1, G*T, S). Done once per forward, not once per layer."""
    return mask.repeat(group, 1) if mask.dim() == 2 else mask.repeat(1, group, 1)[:, None]


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: Optional[torch.Tensor],
                      prefix: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """Attention where query head h reads KV head h // G, without copying K/V per query head.

    q (B, H, T, D); k, v (B, H_kv, S, D); mask None or bool, already folded by
    :func:`fold_mask` (True = attend). ``prefix``: K/V (1, H_kv, P, D) that all B sequences
    attend before their own S keys (a shared system prompt); the mask then covers P + S keys.
    Returns (B, H, T, D).
    """
    B, H, T, D = q.shape
    H_kv = k.shape[1]
    q = q.reshape(B, H_kv, (H // H_kv) * T, D)  # row g*T + t is query head kv*G + g at token t
    if prefix is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H_kv, G*T, D)
    else:
        out = prefix_attention(q, k, v, mask, *prefix)
    # reshape, not view: CUDA's fused SDPA kernels return (B, H_kv, G*T, D) laid out as
    # (B, G*T, H_kv, D) in memory, where H_kv and G cannot merge without a copy.
    return out.reshape(B, H, T, D)


def prefix_attention(q, k, v, mask, k_prefix, v_prefix) -> torch.Tensor:
    """One softmax over a batch-1 prefix's keys and each sequence's own keys.

    q (B, H_kv, M, D) with M = G*T folded rows; k, v (B, H_kv, S, D); k_prefix, v_prefix
    (1, H_kv, P, D); mask None, (M, P + S) or (B, 1, M, P + S). The B sequences are folded
    into the query rows for the prefix, as the G heads are, so the prefix is read once and
    never expanded to B copies. Returns (B, H_kv, M, D).
    """
    B, H_kv, M, D = q.shape
    P = k_prefix.shape[2]
    rows = q.transpose(0, 1).reshape(1, H_kv, B * M, D)  # row b*M + m is sequence b's row m
    s_prefix = (rows @ k_prefix.transpose(-1, -2)).view(H_kv, B, M, P).transpose(0, 1)  # (B, H_kv, M, P)
    scores = torch.cat([s_prefix, q @ k.transpose(-1, -2)], dim=-1) * D ** -0.5  # (B, H_kv, M, P + S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    # Softmax in float32 as SDPA's math path does, so half precision matches the plain path.
    probs = scores.float().softmax(-1).to(q.dtype)
    p_prefix = probs[..., :P].transpose(0, 1).reshape(1, H_kv, B * M, P)
    out_prefix = (p_prefix @ v_prefix).view(H_kv, B, M, D).transpose(0, 1)  # (B, H_kv, M, D)
    return (probs[..., P:] @ v).add_(out_prefix)  # in place: keeps the contiguous layout view() needs


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, num_kv_heads: int, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, num_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.d_model, num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.d_model, num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.d_model, bias=False)
        # Qwen3: each query and key head normalised over D before rotary (one weight for all heads).
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()

    def forward(self, x, cos, sin, mask, cache, start_pos: int):
        B, T, _ = x.shape
        q = self.q_norm(self.wq(x).view(B, T, self.num_heads, self.head_dim)).transpose(1, 2)  # (B, H, T, D)
        k = self.k_norm(self.wk(x).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)  # (B, H_kv, T, D)
        v = self.wv(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        prefix = None
        if cache is not None:
            k, v = cache.update(self.layer, start_pos, k, v)  # (B, H_kv, S, D)
            prefix = cache.shared_prefix(self.layer, start_pos)  # None or (1, H_kv, P, D) K/V
        out = grouped_attention(q, k, v, mask, prefix)  # (B, H, T, D)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: w_down(silu(w_gate x) * w_up x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w_up = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, num_kv_heads: int, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, num_kv_heads, layer)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache, start_pos):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache, start_pos)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """Token embedding, ``num_layers`` blocks, final RMSNorm and LM head.

    ``forward(tokens, cache, start_pos)`` runs T new tokens whose first position is ``start_pos``;
    with a cache the keys of earlier positions come from it, without one the tokens attend only
    to each other (a full recompute passes the whole sequence with ``start_pos=0``).
    """

    def __init__(self, model: ModelConfig, attention: Optional[AttentionConfig] = None):
        super().__init__()
        attention = (attention or AttentionConfig(type="mha")).resolved(model)
        self.config, self.attention = model, attention
        self.num_kv_heads = attention.num_kv_heads
        self.embed = nn.Embedding(model.vocab_size, model.d_model)
        self.blocks = nn.ModuleList(Block(model, self.num_kv_heads, i) for i in range(model.num_layers))
        self.norm = RMSNorm(model.d_model, model.norm_eps)
        self.lm_head = nn.Linear(model.d_model, model.vocab_size, bias=False)
        cos, sin = rope_tables(model)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def kv_groups(self) -> List[int]:
        return kv_group_map(self.config.num_heads, self.num_kv_heads)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def num_params(self) -> int:
        """Parameters, a tied tensor counted once."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: torch.Tensor, cache=None, start_pos: int | torch.Tensor = 0,
                positions: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None,
                last_only: bool = False) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V), or (B, 1, V) for the last token with ``last_only``
        (a prefill needs only that one; all T would cost B*T*V floats).

        ``positions`` (T,) or (B, T) overrides the rotary positions (default start_pos..+T);
        ``mask`` (T, S) or (B, T, S) overrides the causal mask over the S keys attended.
        ``start_pos`` as a (1,) tensor is a fixed-shape decode step (T = 1): ``cache`` is then a
        :class:`~kvbench.cache.FixedWindow`, which masks its keys itself, and nothing here
        depends on the position's value, so one compiled graph serves every position.
        """
        B, T = tokens.shape
        if isinstance(start_pos, torch.Tensor):  # bounds were checked when the window was lent
            positions = start_pos if positions is None else positions
            mask = cache.mask(start_pos) if mask is None else mask
        else:
            end = start_pos + T
            if end > self.config.max_seq_len:
                raise ValueError(f"sequence of {end} positions exceeds model.max_seq_len="
                                 f"{self.config.max_seq_len}")
            if positions is None:
                positions = slice(start_pos, end)  # a view of the tables, no gather
            if mask is None and T > 1:
                # Causal: new token i (at start_pos + i) sees the S - T keys held before it and
                # new keys up to itself. Without a cache the keys are the T new tokens alone.
                S = end if cache is not None else T
                mask = torch.ones(T, S, dtype=torch.bool, device=tokens.device).tril(S - T)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        if mask is not None:
            mask = fold_mask(mask, self.config.num_heads // self.num_kv_heads)
        x = self.embed(tokens)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, mask, cache, start_pos)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x))
