"""The attention of a latent layer (:class:`kvbench.layouts.latent.Latent`), as transformers'
DeepseekV3Attention.

Expanded form (prefill, and the reference decode): K = [c W_UK^T, k_rope] and V = c W_UV^T per
head. Absorbed form (a decode step): q_nope W_UK is a query in latent space, so every head
attends [c, k_rope] directly (MQA over one R + d_rope wide head, values c) and W_UV maps the
result to d_v afterwards; the two agree to rounding.

With DSA's indexer (:mod:`kvbench.layouts.latent_indexer`) the cache holds an index key beside
each latent and, past ``index_topk`` cached tokens, each query attends only its selected ones:
a decode step gathers those k latents first, so either form reads k latents, not S.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvbench.layouts.latent import Latent
from kvbench.layouts.latent_indexer import Indexer
from kvbench.norm import RMSNorm
from kvbench.rope import apply_rope, yarn_mscale


def mla_softmax_scale(cfg, qk_head_dim: int) -> float:
    """DeepSeek's softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 when the
    rope is scaled (transformers' yarn_apply_mscale)."""
    scale = qk_head_dim ** -0.5
    if cfg.rope_type != "default" and cfg.rope_mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


class LatentAttention(nn.Module):
    """The attention of a :class:`Latent` layer; :data:`HF_NAMES` maps transformers' names under ``HF_MODULE``."""

    HF_MODULE = "self_attn"
    HF_NAMES = {"q_proj.": "wq.", "q_a_proj.": "wq.0.", "q_a_layernorm.": "wq.1.", "q_b_proj.": "wq.2.",
                "kv_a_proj_with_mqa.": "wkv_a.", "kv_a_layernorm.": "kv_norm.", "kv_b_proj.": "wkv_b.",
                "o_proj.": "wo.", "indexer.": "indexer."}

    def __init__(self, cfg, a: Latent):
        super().__init__()
        C, H = cfg.d_model, a.num_heads
        self.num_heads, self.absorbed = H, a.absorbed
        self.r, self.d_nope = a.kv_lora_rank, a.qk_nope_head_dim
        self.d_rope, self.d_v = a.qk_rope_head_dim, a.v_head_dim
        self.rotary = a.rotary
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
        self.indexer = Indexer(cfg, a) if a.index_topk else None

    @property
    def form(self) -> str:
        """How a decode step reads the latents: absorbed | expanded (``Latent.decode_forms``)."""
        return "absorbed" if self.absorbed else "expanded"

    @form.setter
    def form(self, form: str) -> None:
        self.absorbed = form == "absorbed"

    def forward(self, x, cos, sin, cache, pos):
        B, T, _ = x.shape
        if not self.rotary:  # whatever tables the decoder hands it (rotary layers beside): width 0 rotates nothing
            cos, sin = cos[..., :0], sin[..., :0]
        q_latent = self.wq[:2](x) if self.indexer is not None else None  # (B, T, q_lora_rank): the indexer reads it
        q = (self.wq(x) if q_latent is None else self.wq[2](q_latent)).view(B, T, self.num_heads, -1).transpose(1, 2)
        q_nope, q_rope = q.split([self.d_nope, self.d_rope], dim=-1)  # (B, H, T, d_nope), (B, H, T, d_rope)
        c, k_rope = self.wkv_a(x).split([self.r, self.d_rope], dim=-1)  # (B, T, R), (B, T, d_rope)
        # (B, 1, T, R + d_rope): what the cache holds (with an indexer, also its (B, 1, T, D_i) keys)
        latent = torch.cat([self.kv_norm(c)[:, None], apply_rope(k_rope[:, None], cos, sin)], -1)
        att = cache.update(latent, None if self.indexer is None else self.indexer.key(x, cos, sin), pos)
        keys, mask, causal = att.k, att.mask, att.causal  # keys: (B, 1, S, R + d_rope)
        if self.indexer is not None and keys.shape[2] > self.indexer.topk:
            (keys, mask), causal = self.indexer.select(x, q_latent, cos, sin, att), False
        mask = mask[:, None] if mask is not None and mask.dim() == 3 else mask  # the same for all heads
        form = self._absorbed if T == 1 and self.absorbed else self._expanded
        out = form(q_nope, apply_rope(q_rope, cos, sin), keys, mask, att.prefix, causal)  # (B, H, T, d_v)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))

    def _up(self, latent):
        """Latents (b, 1, S, R + d_rope) -> K (b, H, S, d_nope + d_rope), V (b, H, S, d_v)."""
        b, _, S, _ = latent.shape
        c, k_rope = latent[:, 0].split([self.r, self.d_rope], dim=-1)
        kv = self.wkv_b(c).view(b, S, self.num_heads, -1).transpose(1, 2)  # (b, H, S, d_nope + d_v)
        k_nope, v = kv.split([self.d_nope, self.d_v], dim=-1)
        return torch.cat([k_nope, k_rope[:, None].expand(b, self.num_heads, S, self.d_rope)], -1), v

    def _expanded(self, q_nope, q_rope, latent, mask, prefix, causal):
        k, v = self._up(latent)
        return latent_attention(torch.cat([q_nope, q_rope], -1), k, v, mask, self.scale,
                                None if prefix is None else self._up(prefix[0]), causal)

    def _absorbed(self, q_nope, q_rope, latent, mask, prefix, causal):  # one query: never causal
        B, H, T, _ = q_nope.shape
        w = self.wkv_b.weight.view(H, self.d_nope + self.d_v, self.r)
        q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w[:, :self.d_nope])  # (B, H, T, R): W_UK absorbed
        q = torch.cat([q_latent, q_rope], -1).reshape(B, 1, H * T, -1)  # row h*T + t; one latent head
        p = None if prefix is None else (prefix[0], prefix[0][..., :self.r])
        out = latent_attention(q, latent, latent[..., :self.r], mask, self.scale, p)  # (B, 1, H*T, R)
        return torch.einsum("bhtr,hvr->bhtv", out.reshape(B, H, T, self.r), w[:, self.d_nope:])  # W_UV


def latent_attention(q, k, v, mask, scale: float, prefix=None, causal: bool = False) -> torch.Tensor:
    """Softmax(q k^T * scale) v with K and V of their own widths, and a batch-1 ``prefix``
    (k_p, v_p) every sequence attends before its own keys (read once, B folded into its rows).

    q (B, H_k, M, Dk); k (B, H_k, S, Dk); v (B, H_k, S, Dv); prefix (1, H_k, P, Dk), (1, H_k, P, Dv);
    mask None or bool broadcasting to (B, H_k, M, P + S); ``causal`` (no prefix, M = S, no mask):
    SDPA's causal path. Returns (B, H_k, M, Dv)."""
    if prefix is None:
        Dk, Dv = q.shape[-1], v.shape[-1]
        if q.shape[-2] > 1 and Dk != Dv:
            # SDPA's fused kernels need one head width for q, k and v; with two it takes the math path,
            # which holds every head's (M, S) scores (4x a prefill's memory at 256 tokens). Zero columns
            # change no dot product and no output column (vLLM pads MLA's prefill the same way).
            D = max(Dk, Dv)
            q, k, v = (F.pad(t, (0, D - t.shape[-1])) for t in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=causal)[..., :Dv]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=causal)
    (k_p, v_p), (B, H_k, M, Dk), P = prefix, q.shape, prefix[0].shape[2]
    rows = q.transpose(0, 1).reshape(1, H_k, B * M, Dk)  # row b*M + m is sequence b's row m
    s_prefix = (rows @ k_p.transpose(-1, -2)).view(H_k, B, M, P).transpose(0, 1)  # (B, H_k, M, P)
    scores = torch.cat([s_prefix, q @ k.transpose(-1, -2)], dim=-1) * scale  # (B, H_k, M, P + S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.float().softmax(-1).to(q.dtype)
    p_prefix = probs[..., :P].transpose(0, 1).reshape(1, H_k, B * M, P)
    out_prefix = (p_prefix @ v_p).view(H_k, B, M, -1).transpose(0, 1)  # (B, H_k, M, Dv)
    return probs[..., P:] @ v + out_prefix
