"""The one decoder kvbench measures: Llama-style (RMSNorm, rotary embeddings, SwiGLU), with the
switches that make it Qwen2 (q/k/v biases) or Qwen3 (per-head q/k RMSNorm) as config fields.

Attention is MHA, GQA or MQA purely by ``num_kv_heads``; nothing in ``forward`` branches on a
variant name. Query head h reads KV head h // G (contiguous groups, the Llama-checkpoint
convention). K/V are never expanded to ``num_heads`` copies: prefill uses SDPA's causal path
with ``enable_gqa`` for every layout, and a decode step folds the G query heads of a group into
the query rows, so one SDPA call over (B, H_kv, G, D) queries reads each KV head once
(:func:`grouped_attention`).

Notation: B batch, T new tokens, S keys attended (cached + new), H query heads,
H_kv KV heads, G = H / H_kv query heads per KV head, D head_dim, V vocab.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvbench.attention import (  # noqa: F401 (re-exported: the attention paths)
    causal_mask,
    grouped_attention,
    latent_attention,
    prefix_attention,
    window_mask,
)
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


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched ``scale`` times (transformers' formula)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by: 1, or yarn's attention factor (given, else from
    rope_factor, rope_mscale and rope_mscale_all_dim, as transformers' yarn computes it)."""
    if cfg.rope_type != "yarn":
        return 1.0
    if cfg.rope_attention_factor is not None:
        return cfg.rope_attention_factor
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return yarn_mscale(cfg.rope_factor, cfg.rope_mscale) / yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
    return yarn_mscale(cfg.rope_factor)


def rope_inv_freq(cfg: ModelConfig, dim: Optional[int] = None) -> torch.Tensor:
    """Rotary inverse frequencies (D/2,) in float64, scaled by ``cfg.rope_type`` as transformers'
    rope type of that name: ``linear`` divides all by ``rope_factor``; ``llama3`` divides those
    whose wavelength exceeds ``rope_original_max_seq_len / rope_low_freq_factor``, keeps those
    below ``rope_original_max_seq_len / rope_high_freq_factor`` and blends linearly in between
    (the clamp of the blend weight to [0, 1] is transformers' three-way ``where``); ``yarn``
    blends interpolated and original frequencies over a ramp between the dimensions that turn
    ``rope_beta_fast`` and ``rope_beta_slow`` times in the pretraining context. ``dim``: the
    rotated width (default head_dim; MLA rotates only qk_rope_head_dim)."""
    D = dim or cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    if cfg.rope_type == "yarn":
        def turns_dim(turns: float) -> float:  # the dimension whose wavelength fits `turns` times
            return D * math.log(cfg.rope_original_max_seq_len / (turns * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))
        low = max(math.floor(turns_dim(cfg.rope_beta_fast)), 0)
        high = min(math.ceil(turns_dim(cfg.rope_beta_slow)), D - 1)
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


def rope_tables(cfg: ModelConfig, dim: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (max_seq_len, D), in the rotate-half layout of HF Llama checkpoints
    (times yarn's attention factor); ``dim`` as in :func:`rope_inv_freq`."""
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), rope_inv_freq(cfg, dim))
    angles = torch.cat([angles, angles], dim=-1)
    factor = rope_attention_factor(cfg)
    return (angles.cos() * factor).float(), (angles.sin() * factor).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x (B, heads, T, D); cos/sin (T, D) or (B, T, D) broadcast over heads
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """MHA, GQA or MQA by ``num_kv_heads``; a local layer (``window`` W) attends only the last W
    positions."""

    def __init__(self, cfg: ModelConfig, num_kv_heads: int, layer: int, window: Optional[int] = None):
        super().__init__()
        self.layer, self.window = layer, window
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
        if self.window is not None and mask is None:
            mask = window_mask(self.window, start_pos, T, k.shape[2], x.device,
                               0 if prefix is None else prefix[0].shape[2], getattr(cache, "prefix_len", 0))
        out = grouped_attention(q, k, v, mask, prefix)  # (B, H, T, D)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3), as transformers' DeepseekV3Attention.

    Each token's keys and values come from one latent c (R = kv_lora_rank, RMS-normed) through
    ``wkv_b``, plus one rotary key (d_rope) shared by all heads; the cache holds [c, k_rope]
    (B, 1, S, R + d_rope). Expanded form (prefill, and the reference decode): K = [c W_UK^T,
    k_rope] and V = c W_UV^T per head. Absorbed form (a decode step): q_nope W_UK is a query in
    latent space, so every head attends [c, k_rope] directly (MQA over one R + d_rope wide head,
    values c) and W_UV maps the result to d_v afterwards; the two agree to rounding."""

    def __init__(self, cfg: ModelConfig, attention: AttentionConfig, layer: int, window: Optional[int] = None):
        super().__init__()
        a, C, H = attention, cfg.d_model, cfg.num_heads
        self.layer, self.num_heads, self.absorbed = layer, H, a.mla_decode == "absorbed"
        self.window = window  # a local layer: its cache is a ring of W latents, it attends the last W
        self.r, self.d_nope = a.kv_lora_rank, a.qk_nope_head_dim
        self.d_rope, self.d_v = a.qk_rope_head_dim, a.v_head_dim
        d_qk = self.d_nope + self.d_rope
        if a.q_lora_rank:  # DeepSeek's latent norms use RMSNorm's default eps, not rms_norm_eps
            self.wq = nn.Sequential(nn.Linear(C, a.q_lora_rank, bias=False), RMSNorm(a.q_lora_rank, 1e-6),
                                    nn.Linear(a.q_lora_rank, H * d_qk, bias=False))
        else:
            self.wq = nn.Linear(C, H * d_qk, bias=False)
        self.wkv_a = nn.Linear(C, self.r + self.d_rope, bias=False)
        self.kv_norm = RMSNorm(self.r, 1e-6)
        self.wkv_b = nn.Linear(self.r, H * (self.d_nope + self.d_v), bias=False)
        self.wo = nn.Linear(H * self.d_v, C, bias=False)
        self.scale = mla_softmax_scale(cfg, d_qk)

    def forward(self, x, cos, sin, mask, cache, start_pos):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.num_heads, -1).transpose(1, 2)  # (B, H, T, d_nope + d_rope)
        q_nope, q_rope = q.split([self.d_nope, self.d_rope], dim=-1)
        c, k_rope = self.wkv_a(x).split([self.r, self.d_rope], dim=-1)  # (B, T, R), (B, T, d_rope)
        # (B, 1, T, R + d_rope): what the cache holds
        latent = torch.cat([self.kv_norm(c)[:, None], apply_rope(k_rope[:, None], cos, sin)], -1)
        q_rope = apply_rope(q_rope, cos, sin)
        prefix = None
        if cache is not None:
            latent, _ = cache.update(self.layer, start_pos, latent, None)  # (B, 1, S, R + d_rope)
            prefix = cache.shared_prefix(self.layer, start_pos)  # None or ((1, 1, P, R + d_rope), None)
        causal = False
        if mask is None and self.window is not None:  # None where every key is in the window (a ring's step)
            mask = window_mask(self.window, start_pos, T, latent.shape[2], x.device,
                               0 if prefix is None else prefix[0].shape[2], getattr(cache, "prefix_len", 0))
        elif mask is None and T > 1:  # causal: SDPA's causal path when the keys are the new tokens
            S = latent.shape[2] + (0 if prefix is None else prefix[0].shape[2])
            causal = prefix is None and S == T
            mask = None if causal else causal_mask(T, S, x.device)  # (T, P + S), bottom-right
        elif mask is not None and mask.dim() == 3:
            mask = mask[:, None]  # (B, 1, T, S): the same for every head
        form = self._absorbed if T == 1 and self.absorbed else self._expanded
        out = form(q_nope, q_rope, latent, mask, None if prefix is None else prefix[0], causal)  # (B, H, T, d_v)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))

    def _up(self, latent):
        """Latents (b, 1, S, R + d_rope) -> K (b, H, S, d_nope + d_rope), V (b, H, S, d_v)."""
        b, _, S, _ = latent.shape
        c, k_rope = latent[:, 0].split([self.r, self.d_rope], dim=-1)
        kv = self.wkv_b(c).view(b, S, self.num_heads, -1).transpose(1, 2)  # (b, H, S, d_nope + d_v)
        k_nope, v = kv.split([self.d_nope, self.d_v], dim=-1)
        return torch.cat([k_nope, k_rope[:, None].expand(b, self.num_heads, S, self.d_rope)], -1), v

    def _expanded(self, q_nope, q_rope, latent, mask, prefix, causal=False):
        k, v = self._up(latent)
        return latent_attention(torch.cat([q_nope, q_rope], -1), k, v, mask, self.scale,
                                None if prefix is None else self._up(prefix), causal)

    def _absorbed(self, q_nope, q_rope, latent, mask, prefix, causal=False):  # one query: never causal
        B, H, T, _ = q_nope.shape
        w = self.wkv_b.weight.view(H, self.d_nope + self.d_v, self.r)
        q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w[:, :self.d_nope])  # (B, H, T, R): W_UK absorbed
        q = torch.cat([q_latent, q_rope], -1).reshape(B, 1, H * T, -1)  # row h*T + t; one latent head
        out = latent_attention(q, latent, latent[..., :self.r], mask, self.scale,
                               None if prefix is None else (prefix, prefix[..., :self.r]))  # (B, 1, H*T, R)
        return torch.einsum("bhtr,hvr->bhtv", out.reshape(B, H, T, self.r), w[:, self.d_nope:])  # W_UV


def mla_softmax_scale(cfg: ModelConfig, qk_head_dim: int) -> float:
    """DeepSeek's softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 when the
    rope is scaled (transformers' yarn_apply_mscale)."""
    scale = qk_head_dim ** -0.5
    if cfg.rope_type != "default" and cfg.rope_mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


@contextmanager
def mla_decode(model: "Decoder", form: str):
    """Decode steps of ``model``'s latent attention in ``form`` (absorbed | expanded) inside the block."""
    layers = [b.attn for b in model.blocks if isinstance(b.attn, LatentAttention)]
    before = [a.absorbed for a in layers]
    for a in layers:
        a.absorbed = form == "absorbed"
    try:
        yield model
    finally:
        for a, was in zip(layers, before):
            a.absorbed = was


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
    def __init__(self, cfg: ModelConfig, num_kv_heads: int, layer: int, window: Optional[int] = None,
                 attention: Optional[AttentionConfig] = None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        latent = attention is not None and attention.latent
        self.attn = (LatentAttention(cfg, attention, layer, window) if latent
                     else Attention(cfg, num_kv_heads, layer, window))
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
        self.layer_windows = attention.layer_windows(model.num_layers)  # per layer: W, or None (global)
        # On the meta device (parameter counts, footprints, checkpoint loads) a tensor holds no values:
        # nothing is initialised or computed there (normal_ or arange on meta loads torch._dynamo, ~1.3 s of CPU).
        meta = torch.empty(0).is_meta
        self.embed = nn.Embedding(model.vocab_size, model.d_model,
                                  _weight=torch.empty(model.vocab_size, model.d_model) if meta else None)
        self.blocks = nn.ModuleList(Block(model, self.num_kv_heads, i, w, attention)
                                    for i, w in enumerate(self.layer_windows))
        self.norm = RMSNorm(model.d_model, model.norm_eps)
        self.lm_head = nn.Linear(model.d_model, model.vocab_size, bias=False)
        # MLA rotates only its qk_rope_head_dim and reads the mask unfolded (its heads are not groups)
        self.rope_dim = attention.qk_rope_head_dim if attention.latent else model.head_dim
        if meta:  # rope_tables' shapes and dtype, no values
            cos, sin = (torch.empty(model.max_seq_len, self.rope_dim, dtype=torch.float32) for _ in range(2))
        else:
            cos, sin = rope_tables(model, self.rope_dim)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def kv_dims(self) -> tuple[int, int, bool]:
        """(heads, width, latent) the cache stores per token and layer (AttentionConfig.kv_dims)."""
        return self.attention.kv_dims(self.config)

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
        ``mask`` (T, S) or (B, T, S) overrides the causal (and window) mask over the S keys attended.
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
            # mask None: causal, which each attention call builds for the keys it reads (or
            # hands to SDPA's causal path when they are exactly the new tokens).
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x = self.embed(tokens)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, mask, cache, start_pos)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x))
