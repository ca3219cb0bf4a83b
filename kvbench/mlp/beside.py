"""A mixture of experts beside the dense MLP (Gemma 4 26B-A4B: transformers' Gemma4TextDecoderLayer with
``enable_moe_block``), and which MLP each layer of the decoder has (:func:`mlp_module`).

Every token goes through both: the dense GeGLU of ``model.ffn_dim`` on the block's normed input, and
the routed GeGLU experts on the residual stream normed by a norm of their own; each output is normed
again before the two are summed (the block then norms the sum, as it norms any MLP's). The router reads
the stream too: RMS-normed without a weight, times a learned scale and 1/sqrt(C), then a softmax over
the experts, the top k renormalised to sum 1 and each weight times its expert's learned scale
(Gemma4TextRouter).

Notation: B batch, T tokens, N = B*T, C d_model, E experts, k experts per token.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kvbench.mlp.dense import MLP
from kvbench.mlp.experts import Experts, MoE
from kvbench.mlp.experts import mlp_module as _experts_or_dense
from kvbench.mlp.router import route
from kvbench.norm import RMSNorm, unscaled_rms_norm


def mlp_module(cfg, layer: int) -> nn.Module:
    """Layer ``layer``'s MLP in ``cfg`` (a ModelConfig): the dense MLP with experts beside it
    (``model.moe.beside_dense``), else :func:`kvbench.mlp.experts.mlp_module`'s."""
    if cfg.moe is not None and cfg.moe.beside_dense and cfg.moe.sparse(layer):
        return DenseBesideExperts(cfg)
    return _experts_or_dense(cfg, layer)


class GeGLUExperts(Experts):
    """Experts whose gate goes through gelu (tanh form) in silu's place (Gemma4TextExperts)."""

    def _swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh") * up


class DenseBesideExperts(MoE):
    """The dense MLP (``w_gate``, ``w_up``, ``w_down``: where a dense layer's are) and the routed
    experts beside it, each output normed (``dense_post_norm``, ``experts_post_norm``), the experts'
    input normed by ``experts_norm``; the router's input scale ``router_scale`` (C,) and each expert's
    weight scale ``per_expert_scale`` (E,). Reads the block's normed input and its residual stream."""

    reads_stream = True  # the block passes the residual stream beside the normed input

    def __init__(self, cfg):
        super().__init__(cfg)
        moe, C = cfg.moe, cfg.d_model
        self.experts = GeGLUExperts(C, moe, True)
        dense = MLP(cfg)
        self.w_gate, self.w_up, self.w_down = dense.w_gate, dense.w_up, dense.w_down
        self.act = partial(F.gelu, approximate="tanh")
        self.dense_post_norm, self.experts_norm, self.experts_post_norm = (
            RMSNorm(C, cfg.norm_eps) for _ in range(3))
        self.router_scale = nn.Parameter(torch.ones(C))
        self.per_expert_scale = nn.Parameter(torch.ones(moe.num_experts))
        self.eps = cfg.norm_eps

    def forward(self, x: torch.Tensor, stream: torch.Tensor, tokens=None) -> torch.Tensor:
        """x (B, T, C): the block's normed input (the dense MLP's); ``stream`` (B, T, C): the residual
        stream, which the router and the experts norm themselves."""
        B, T, C = x.shape
        dense = self.dense_post_norm(self.w_down(self.act(self.w_gate(x)) * self.w_up(x)))
        flat = stream.reshape(B * T, C)
        logits = self.router(unscaled_rms_norm(flat, self.eps) * self.router_scale * C ** -0.5)  # (N, E)
        weights, chosen = route(self.moe, logits)  # softmax, top k renormalised (model.moe.norm_topk_prob)
        out, distinct = self.experts(self.experts_norm(flat), weights * self.per_expert_scale[chosen], chosen)
        if self.log is not None:
            self.log.append(distinct)
        return dense + self.experts_post_norm(out.view(B, T, C))
