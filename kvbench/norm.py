"""RMSNorm, as Llama, DeepSeek and Qwen use it (their weights load into it unchanged)."""

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
