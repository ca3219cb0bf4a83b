"""The dense SwiGLU MLP: every layer's MLP in a dense model, the dense layers and the shared expert
of a mixture of experts."""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """SwiGLU feed-forward: w_down(silu(w_gate x) * w_up x), ``ffn_dim`` wide (default the model's)."""

    def __init__(self, cfg, ffn_dim: Optional[int] = None):
        super().__init__()
        width = cfg.ffn_dim if ffn_dim is None else ffn_dim
        self.w_gate = nn.Linear(cfg.d_model, width, bias=False)
        self.w_up = nn.Linear(cfg.d_model, width, bias=False)
        self.w_down = nn.Linear(width, cfg.d_model, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
