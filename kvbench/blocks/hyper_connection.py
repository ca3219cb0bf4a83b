"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual as ``hc_mult`` parallel
streams, as transformers' DeepseekV4HyperConnection and DeepseekV4HyperHead compute them.

Before each attention or MLP sub-block, the N streams (B, T, N, C), flattened and RMS-normed
without a weight, are projected (``fn``) to three sets of weights, each scaled (``scale``) and
shifted (``base``):

    pre  = sigmoid(.) + eps        (N)     collapses the streams into the sub-block's input
    post = 2 sigmoid(.)            (N)     spreads its output back over the streams
    comb = Sinkhorn(softmax(.))    (N, N)  mixes the streams, doubly stochastic so no stream grows

and the streams after it are ``post x out + comb^T streams`` (:func:`residual`). The model's last
streams collapse through :class:`HyperHead` (a ``pre`` only) before the final norm. All in float32,
as transformers keeps these modules; the streams stay in the compute dtype.

Notation: B batch, T tokens, N streams (hc_mult), C d_model.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from kvbench.norm import Float32Params


def _unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(Float32Params):
    """The weights one sub-block mixes the streams with (transformers' parameter names: ``fn``,
    ``base``, ``scale``); ``sinkhorn_iters`` alternating row and column normalisations of comb."""

    def __init__(self, d_model: int, streams: int, sinkhorn_iters: int, eps: float, norm_eps: float):
        super().__init__()
        N = streams
        self.N, self.iters, self.eps, self.norm_eps = N, sinkhorn_iters, eps, norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + N) * N, N * d_model))
        self.base = nn.Parameter(torch.zeros((2 + N) * N))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams (B, T, N, C) -> post (B, T, N), comb (B, T, N, N) in float32, and the collapsed
        input of the sub-block (B, T, C) in the streams' dtype."""
        B, T, N = streams.shape[0], streams.shape[1], self.N
        mixes = F.linear(_unweighted_rms(streams.reshape(B, T, -1).float(), self.norm_eps), self.fn.float())
        pre, post, comb = mixes.split([N, N, N * N], dim=-1)
        pre_b, post_b, comb_b = self.base.split([N, N, N * N])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post * post_s + post_b)
        comb = torch.softmax(comb.view(B, T, N, N) * comb_s + comb_b.view(N, N), dim=-1) + self.eps
        # Sinkhorn-Knopp towards doubly stochastic: columns first, then rows and columns in turn
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed


def residual(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The streams after a sub-block: its output ``out`` (B, T, C) spread by ``post`` plus the
    streams mixed by comb transposed (stream k takes sum_j comb[j, k] x stream j; comb is not
    symmetric), in the streams' dtype."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(Float32Params):
    """The last streams collapsed to one (transformers' DeepseekV4HyperHead: ``hc_fn``, ``hc_base``,
    ``hc_scale``), before the model's final norm."""

    def __init__(self, d_model: int, streams: int, eps: float, norm_eps: float):
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(streams, streams * d_model))
        self.hc_base = nn.Parameter(torch.zeros(streams))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = _unweighted_rms(streams.flatten(2).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn.float()) * self.hc_scale.float() + self.hc_base.float())
        pre = pre + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)


def expand(x: torch.Tensor, streams: int) -> torch.Tensor:
    """The embeddings (B, T, C) as the first streams (B, T, N, C): each a copy."""
    return x.unsqueeze(2).expand(-1, -1, streams, -1).contiguous()
