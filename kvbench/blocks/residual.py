"""Gemma 4's residual stream beyond Llama's (``model.residual``: :class:`kvbench.config.residual.ResidualForm`),
as transformers' Gemma4TextModel and Gemma4TextDecoderLayer compute it: the per-layer inputs (PLE) and
the branch of each block that reads its slice of them.

Per-layer inputs (the model's): a token's row of a table of L x P, times sqrt(P), and a projection of
the (scaled) embedding to L x P, times 1 / sqrt(C) and RMS-normed per layer slice; their sum times
1 / sqrt(2). A block's branch: norm(project(gelu(gate(x)) * its slice)), added to the stream after
the MLP's.

Notation: B batch, T tokens, L layers, P per_layer_input_dim, C d_model.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kvbench.norm import RMSNorm


def activation(cfg):
    """The MLP's gate activation (``model.mlp_act``): gelu (tanh form) or silu."""
    return partial(F.gelu, approximate="tanh") if cfg.mlp_act == "gelu_tanh" else F.silu


class PerLayerInputs(nn.Module):
    """The per-layer inputs of every layer, (B, T, L, P), from the tokens and their embedding."""

    def __init__(self, cfg):
        super().__init__()
        form = cfg.residual
        self.L, self.P = cfg.num_layers, form.per_layer_input_dim
        vocab, width = form.per_layer_vocab_size or cfg.vocab_size, self.L * self.P
        meta = torch.empty(0).is_meta  # nothing initialised on the meta device (as the decoder's own embedding)
        self.embed = nn.Embedding(vocab, width, _weight=torch.empty(vocab, width) if meta else None)
        self.project = nn.Linear(cfg.d_model, width, bias=False)
        self.norm = RMSNorm(self.P, cfg.norm_eps, cfg.norm_zero_centered)
        self.embed_scale, self.project_scale = self.P ** 0.5, cfg.d_model ** -0.5

    def forward(self, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        B, T = tokens.shape
        table = self.embed(tokens) * torch.tensor(self.embed_scale, dtype=self.embed.weight.dtype)
        projected = self.norm((self.project(x) * self.project_scale).view(B, T, self.L, self.P))
        return (projected + table.view(B, T, self.L, self.P)) * 2 ** -0.5


class PerLayerBranch(nn.Module):
    """A block's third branch: its slice (B, T, P) of the per-layer inputs, gated by the stream."""

    def __init__(self, cfg):
        super().__init__()
        P = cfg.residual.per_layer_input_dim
        self.gate = nn.Linear(cfg.d_model, P, bias=False)
        self.project = nn.Linear(P, cfg.d_model, bias=False)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_zero_centered)
        self.act = activation(cfg)

    def forward(self, x: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        return self.norm(self.project(self.act(self.gate(x)) * inputs))
