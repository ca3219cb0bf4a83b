"""RMSNorm, as Llama, DeepSeek and Qwen use it (their weights load into it unchanged), and the float32
keeping of DeepSeek-V4's (:class:`Float32Params`, :class:`Float32RMSNorm`)."""

from typing import Tuple

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``zero_centered`` (Qwen3.5, Qwen3-Next, Gemma): the weight is stored around 0 and scales by
    (1 + weight), multiplied in float32 before the cast back (Llama casts first, then multiplies)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as Llama does: half-precision sums of squares lose accuracy.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (xf * (1.0 + self.weight.float())).type_as(x)
        return self.weight * xf.type_as(x)


def unscaled_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last dim without a weight, in float32 (Gemma 4's value norm: transformers'
    Gemma4RMSNorm(with_scale=False), x * (mean(x^2) + eps)^-1/2)."""
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).type_as(x)


class Float32Params(nn.Module):
    """A module whose own parameters (not its children's) stay float32 whatever dtype the model is
    moved to, as transformers keeps DeepSeek-V4's hyper-connections, norms, sinks and position biases
    (its ``_keep_in_fp32_modules_strict``): in bfloat16 they are not rounded, and what they multiply
    is computed in float32. ``FLOAT32_BUFFERS``: its buffers kept so too."""

    FLOAT32_BUFFERS: Tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for p in self.parameters(recurse=False):
            if p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
        for name in self.FLOAT32_BUFFERS:
            if getattr(self, name, None) is not None:
                setattr(self, name, getattr(self, name).float())
        return self


class Float32RMSNorm(Float32Params):
    """RMSNorm with a float32 weight, multiplied in float32 and cast back once (transformers'
    DeepseekV4RMSNorm); in float32 it is :class:`kvbench.norm.RMSNorm` exactly."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)
