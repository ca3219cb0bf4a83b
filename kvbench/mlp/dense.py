"""The dense SwiGLU MLP: every layer's MLP in a dense model, the dense layers and the shared expert
of a mixture of experts."""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """SwiGLU feed-forward: w_down(silu(w_gate x) * w_up x), ``ffn_dim`` wide (default the model's, with
    ``model.mlp_bias``'s biases; a shared expert's has none). ``model.mlp_act=relu2`` (Nemotron-H):
    w_down(relu(w_up x)^2), no gate; ``gelu_tanh`` (Gemma's GeGLU): gelu (tanh form) in silu's place.
    :data:`HF_FUSED`: a checkpoint's gate and up rows in one tensor (Granite's shared_mlp.input_linear,
    as its home names it), gate rows first."""

    HF_FUSED = {"gate_up_proj.weight": ("w_gate.weight", "w_up.weight")}

    def __init__(self, cfg, ffn_dim: Optional[int] = None, limit: Optional[float] = None):
        super().__init__()
        self.limit = limit  # DeepSeek-V4's shared expert: gate clamped above, up to +-limit
        width, bias = (cfg.ffn_dim, cfg.mlp_bias) if ffn_dim is None else (ffn_dim, False)
        act = getattr(cfg, "mlp_act", "silu")
        self.gated, self.act = act != "relu2", partial(F.gelu, approximate="tanh") if act == "gelu_tanh" else F.silu
        if self.gated:
            self.w_gate = nn.Linear(cfg.d_model, width, bias=bias)
        self.w_up = nn.Linear(cfg.d_model, width, bias=bias)
        self.w_down = nn.Linear(width, cfg.d_model, bias=bias)

    def forward(self, x):
        if not self.gated:
            return self.w_down(F.relu(self.w_up(x)).square())
        if self.limit is None:
            return self.w_down(self.act(self.w_gate(x)) * self.w_up(x))
        gate, up = self.w_gate(x).clamp(max=self.limit), self.w_up(x).clamp(min=-self.limit, max=self.limit)
        return self.w_down(self.act(gate) * up)
