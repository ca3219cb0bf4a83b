"""Llama 4's treatment of a K/V-head layer's queries and keys (``model.nope``, :mod:`kvbench.config.nope`):
an L2 norm of each head after rotary on the layers that rotate, and a query temperature by position on
those that do not (NoPE), as transformers' Llama4TextAttention computes them.

Notation: B batch, H heads, T new tokens, D head_dim.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn


class L2Norm(nn.Module):
    """Each head over its width, without weight: x / sqrt(mean(x²) + eps), in float32 (Llama4TextL2Norm)."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = x.float()
        return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


class QueryTemperature(nn.Module):
    """A NoPE layer's queries scaled by 1 + attn_scale · log(1 + floor((p + 1) / floor_scale)) at position p."""

    def __init__(self, floor_scale: float, attn_scale: float):
        super().__init__()
        self.floor_scale, self.attn_scale = floor_scale, attn_scale

    def forward(self, q: torch.Tensor, pos) -> torch.Tensor:
        """q (B, H, T, D) at ``pos`` (a :class:`~kvbench.cache.Positions`: ids (T,) or (B, T))."""
        ids = pos.ids.float()
        scale = torch.log1p(torch.floor((ids + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        scale = scale.view(1, 1, -1, 1) if ids.dim() == 1 else scale[:, None, :, None]  # (1 or B, 1, T, 1)
        return (q * scale).to(q.dtype)


def query_key_norms(cfg, layout) -> Tuple[nn.Module, Optional[QueryTemperature]]:
    """The L2 norm a layer of ``layout`` in ``cfg`` (a ModelConfig) applies to its rotated queries and keys
    (identity where it has none), and the temperature of a NoPE layer's queries (None where it has none)."""
    nope = getattr(cfg, "nope", None)
    if nope is None:
        return nn.Identity(), None
    if layout.rotary_dim:
        return (L2Norm(cfg.norm_eps) if nope.qk_l2_norm else nn.Identity()), None
    return nn.Identity(), QueryTemperature(nope.floor_scale, nope.attn_scale) if nope.temperature_tuning else None
