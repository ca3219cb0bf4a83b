"""DeepSeek-V4's block (:class:`HyperBlock`, chosen by ``model.hyper_connections``): the residual as
N parallel streams (B, T, N, C), collapsed before the attention and before the MLP and spread back
after each by their hyper-connections (:mod:`kvbench.blocks.hyper_connection`), as transformers'
DeepseekV4DecoderLayer; the decoder expands its embeddings into the streams and collapses the last
through :class:`~kvbench.blocks.hyper_connection.HyperHead` before its final norm.

Notation: B batch, T new tokens, N streams, C d_model.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kvbench.blocks.hyper_connection import HyperConnection, residual
from kvbench.layouts.attention import attention_module
from kvbench.mlp.experts import MoE, mlp_module
from kvbench.norm import Float32RMSNorm


class HyperBlock(nn.Module):
    """Pre-norm attention then MLP, each between its hyper-connection's collapse and spread
    (transformers' names: ``attn_hc``, ``ffn_hc``); a hash-routed MLP is given the tokens."""

    def __init__(self, cfg, layout, index: int):
        super().__init__()
        hc, C = cfg.hyper_connections, cfg.d_model
        # transformers' input_layernorm and post_attention_layernorm: float32 weights, as its norms'
        self.attn_norm = Float32RMSNorm(C, cfg.norm_eps)
        self.attn = attention_module(cfg, layout)
        self.mlp_norm = Float32RMSNorm(C, cfg.norm_eps)
        self.mlp = mlp_module(cfg, index)
        self.attn_hc, self.ffn_hc = (HyperConnection(C, hc.streams, hc.sinkhorn_iters, hc.eps, cfg.norm_eps)
                                     for _ in range(2))
        self.hashed = isinstance(self.mlp, MoE) and self.mlp.tid2eid is not None

    def forward(self, x, cos, sin, cache, pos, per_layer_input=None, tokens: Optional[torch.Tensor] = None):
        """x (B, T, N, C): the streams -> the streams after the block."""
        post, comb, h = self.attn_hc(x)
        x = residual(x, self.attn(self.attn_norm(h), cos, sin, cache, pos), post, comb)
        post, comb, h = self.ffn_hc(x)
        out = self.mlp(self.mlp_norm(h), tokens) if self.hashed else self.mlp(self.mlp_norm(h))
        return residual(x, out, post, comb)
