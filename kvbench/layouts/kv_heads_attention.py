"""The attention of a KV-head layer (:class:`kvbench.layouts.kv_heads.KVHeads`).

K/V are never expanded to ``num_heads`` copies: prefill uses SDPA's causal path with
``enable_gqa`` for every head count, and a decode step folds the G query heads of a group into the
query rows, so one SDPA call over (B, H_kv, G, D) queries reads each KV head once
(:func:`grouped_attention`).

Sinks are computed inside SDPA by one more key dimension: each query gets ``sink_h / scale``
there, the keys 0, and one extra key with a 1 there and a zero value, so that key's logit is the
sink and every other logit is unchanged (its weight goes to nothing).

Notation: B batch, T new tokens, S keys attended, H query heads, H_kv KV heads, G = H / H_kv,
D head_dim, P a shared prefix's positions.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from kvbench.cache import causal_mask
from kvbench.layouts.kv_heads import KVHeads
from kvbench.layouts.nope_attention import query_key_norms
from kvbench.norm import RMSNorm, unscaled_rms_norm
from kvbench.rope import apply_rope


class KVHeadsAttention(nn.Module):
    """The attention of a :class:`KVHeads` layer; :data:`HF_NAMES` maps transformers' names under ``HF_MODULE``."""

    HF_MODULE = "self_attn"
    HF_NAMES = {"q_proj.": "wq.", "k_proj.": "wk.", "v_proj.": "wv.", "o_proj.": "wo.", "q_norm.": "q_norm.",
                "k_norm.": "k_norm.", "sinks": "sinks"}

    def __init__(self, cfg, layout: KVHeads):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = layout.num_heads, layout.num_kv_heads, layout.head_dim
        H, H_kv, D = self.num_heads, self.num_kv_heads, self.head_dim
        self.gated = layout.output_gate
        self.wq = nn.Linear(cfg.d_model, H * D * (2 if self.gated else 1), bias=cfg.qkv_bias)  # per head [q | gate]
        self.shared = layout.kv_source is not None  # attends another layer's K/V: no K/V weights of its own
        if not self.shared:
            self.wk = nn.Linear(cfg.d_model, H_kv * D, bias=cfg.qkv_bias)
            self.wv = nn.Linear(cfg.d_model, H_kv * D, bias=cfg.qkv_bias)
        self.wo = nn.Linear(H * D, cfg.d_model, bias=cfg.o_bias)
        # Qwen3: each query and key head normalised over D before rotary (one weight for all heads).
        norm = cfg.norm_zero_centered
        self.q_norm = RMSNorm(D, cfg.norm_eps, norm) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(D, cfg.norm_eps, norm) if cfg.qk_norm and not self.shared else nn.Identity()
        self.sinks = nn.Parameter(torch.zeros(H)) if layout.sinks else None
        # Granite's attention_multiplier replaces 1/sqrt(D) as the logits' scale: the query takes the ratio,
        # so that every attention path (SDPA's own scale, sinks, a shared prefix) stays as it is
        scale = getattr(getattr(cfg, "multipliers", None), "attention_multiplier", None)
        self.q_scale = 1.0 if scale is None else scale * D ** 0.5
        self.v_norm, self.eps = getattr(cfg, "v_norm", False), cfg.norm_eps  # Gemma 4: values RMS-normed, no weight
        # Llama 4 (model.nope): an L2 norm after rotary, or (no rotary) a query temperature by position
        self.rotary, (self.l2_norm, self.temperature) = layout.rotary_dim, query_key_norms(cfg, layout)

    def forward(self, x, cos, sin, cache, pos):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.num_heads, -1)  # (B, T, H, D), or (B, T, H, 2D): [query | gate]
        gate = None
        if self.gated:
            q, gate = q.chunk(2, dim=-1)
        if not self.rotary:  # a layer without rotary embeddings (NoPE, Llama 4's)
            cos, sin = cos[..., :0], sin[..., :0]
        q = self.l2_norm(apply_rope(self.q_norm(q).transpose(1, 2), cos, sin))  # (B, H, T, D): its first dims
        if self.temperature is not None:
            q = self.temperature(q, pos)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = v = None  # (B, H_kv, T, D) each; a shared layer's cache answers with its donor's
        if not self.shared:
            k = self.k_norm(self.wk(x).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
            k = self.l2_norm(apply_rope(k, cos, sin))
            v = self.wv(x).view(B, T, self.num_kv_heads, self.head_dim)
            v = (unscaled_rms_norm(v, self.eps) if self.v_norm else v).transpose(1, 2)
        att = cache.update(k, v, pos)  # what to attend over: (B, H_kv, S, D), its mask
        out = grouped_attention(q, att.k, att.v, att.mask, att.prefix, self.sinks).transpose(1, 2)  # (B, T, H, D)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.wo(out.reshape(B, T, -1))


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None,
                      prefix: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                      sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention where query head h reads KV head h // G, without copying K/V per query head.

    q (B, H, T, D); k, v (B, H_kv, S, D); mask bool (T, S) or (B, T, S), True = attend, None =
    causal. ``prefix``: K/V (1, H_kv, P, D) every sequence attends before its own keys (a shared
    system prompt; the mask then covers P + S). ``sinks`` (H,). Returns (B, H, T, D).

    Three paths, chosen by shape, never by a variant name:
    - decode (T = 1): a group's G query heads fold into the query rows, (B, H_kv, G, D), so one
      SDPA call reads each KV head once.
    - causal prefill (no mask, S = T): SDPA's ``is_causal`` path (it skips the masked half) with
      ``enable_gqa``, for every KV-head count alike.
    - anything else: SDPA with the (T, S) mask broadcast over heads and ``enable_gqa``.
    Folding a T > 1 prompt too would lose the causal path: prefill would slow as KV heads fall
    (MQA 2x MHA at T = 2048).
    """
    B, H, T, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    G = H // H_kv
    if prefix is not None:
        if mask is None and T > 1:
            mask = causal_mask(T, prefix[0].shape[2] + S, q.device)
        return prefix_attention(q.reshape(B, H_kv, G * T, D), k, v, mask, *prefix, sinks).reshape(B, H, T, D)
    causal = mask is None and T > 1 and S == T
    if mask is None and T > 1 and not causal:
        mask = causal_mask(T, S, q.device)
    scale = None
    if sinks is not None:
        q, k, v, mask, scale = _with_sink_key(q, k, v, mask, causal, sinks)
        causal = False
    if T == 1:
        if mask is not None and mask.dim() == 3:
            mask = mask[:, None]  # (B, 1, 1, S): the same keys for all heads and rows
        out = F.scaled_dot_product_attention(q.reshape(B, H_kv, G, -1), k, v, attn_mask=mask, scale=scale)
    elif causal:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=G > 1)  # (B, H, T, D)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None] if mask.dim() == 3 else mask,
                                             enable_gqa=G > 1, scale=scale)
    # reshape, not view: CUDA's fused SDPA kernels return (B, H_kv, M, D) laid out as
    # (B, M, H_kv, D) in memory, where H_kv and G cannot merge without a copy.
    return out[..., :D].reshape(B, H, T, D)


# SDPA's fused kernels take head widths in multiples of 8: the sink's extra dimension pads to one.
_SINK_PAD = 8


def _with_sink_key(q, k, v, mask, causal, sinks):
    """q, k, v, mask and scale for SDPA with each query head's sink logit as one more key."""
    B, H, T, D = q.shape
    scale = D ** -0.5
    s = (sinks.to(q.dtype) / scale).view(1, H, 1, 1).expand(B, H, T, 1)
    q = torch.cat([q, s, q.new_zeros(B, H, T, _SINK_PAD - 1)], -1)  # (B, H, T, D + 8)
    sink = k.new_zeros(k.shape[0], k.shape[1], 1, D + _SINK_PAD)
    sink[..., D] = 1
    k = torch.cat([F.pad(k, (0, _SINK_PAD)), sink], 2)  # (B, H_kv, S + 1, D + 8)
    v = F.pad(v, (0, _SINK_PAD, 0, 1))  # the sink's value: zeros
    S = k.shape[2] - 1
    if causal:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    if mask is not None:
        mask = torch.cat([mask, mask.new_ones(*mask.shape[:-1], 1)], -1)  # the sink is always attended
    return q, k, v, mask, scale


def prefix_attention(q, k, v, mask, k_prefix, v_prefix, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One softmax over a batch-1 prefix's keys and each sequence's own keys (and a sink column).

    q (B, H_kv, M, D), M = G*T folded rows (row g*T + t: query head kv*G + g at token t); k, v
    (B, H_kv, S, D); k_prefix, v_prefix (1, H_kv, P, D); mask None, (T, P + S) or (B, T, P + S),
    broadcast over a row block's G heads. The B sequences fold into the query rows for the prefix,
    so it is read once, never expanded to B copies. Returns (B, H_kv, M, D).
    """
    B, H_kv, M, D = q.shape
    P = k_prefix.shape[2]
    rows = q.transpose(0, 1).reshape(1, H_kv, B * M, D)  # row b*M + m is sequence b's row m
    s_prefix = (rows @ k_prefix.transpose(-1, -2)).view(H_kv, B, M, P).transpose(0, 1)  # (B, H_kv, M, P)
    scores = torch.cat([s_prefix, q @ k.transpose(-1, -2)], dim=-1) * D ** -0.5  # (B, H_kv, M, P + S)
    if mask is not None:
        T = mask.shape[-2]
        blocks = scores.view(B, H_kv, M // T, T, P + k.shape[2])  # (B, H_kv, G, T, P + S)
        blocks.masked_fill_(~(mask if mask.dim() == 2 else mask[:, None, None]), float("-inf"))
    if sinks is not None:  # (H,) = (H_kv, G): one column per row's head
        T = M // (sinks.numel() // H_kv)
        column = sinks.to(scores.dtype).view(1, H_kv, -1, 1).repeat_interleave(T, 2).expand(B, -1, -1, -1)
        scores = torch.cat([scores, column], -1)
    # Softmax in float32 as SDPA's math path does, so half precision matches the plain path.
    probs = scores.float().softmax(-1).to(q.dtype)[..., :P + k.shape[2]]
    p_prefix = probs[..., :P].transpose(0, 1).reshape(1, H_kv, B * M, P)
    out_prefix = (p_prefix @ v_prefix).view(H_kv, B, M, D).transpose(0, 1)  # (B, H_kv, M, D)
    return (probs[..., P:] @ v).add_(out_prefix)  # in place: keeps the contiguous layout view() needs
