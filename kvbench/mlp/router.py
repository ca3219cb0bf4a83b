"""Routing a token to its top-k experts, as transformers' routers of each family compute it
(the kinds of :data:`kvbench.core.moe.ROUTERS`).

Notation: N tokens, E experts, k experts per token, G groups of E / G experts.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def route(moe, logits: torch.Tensor, correction_bias: Optional[torch.Tensor] = None,
          hashed: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """logits (N, E) -> (weights (N, k), experts (N, k)); ``correction_bias`` (E,): the sigmoid
    and sqrtsoftplus routers' bias on the choice, not on the weights; ``hashed`` (N, k): the experts
    a token-id table chose (DeepSeek-V4's hash layers), weighed by the scores all the same."""
    k = moe.top_k
    if moe.router == "softmax_topk":  # GPT-OSS: the softmax over the k best logits only
        top, experts = logits.topk(k, dim=-1)
        return top.softmax(dim=-1) * moe.routed_scaling_factor, experts
    if moe.router == "sigmoid_topk":  # Llama 4: each of the k best logits through a sigmoid, in float32
        top, experts = logits.topk(k, dim=-1)
        return top.float().sigmoid().to(logits.dtype) * moe.routed_scaling_factor, experts
    if moe.router == "sigmoid":  # DeepSeek-V3: in float32, its router's precision
        scores = logits.float().sigmoid()
        choice = scores + correction_bias.float()
    elif moe.router == "sqrtsoftplus":  # DeepSeek-V4: in its logits' dtype, as transformers scores them,
        scores = F.softplus(logits).sqrt()  # the choice with its float32 bias added (in float32)
        choice = scores if hashed is not None else scores + correction_bias
    else:
        scores = choice = logits.softmax(dim=-1, dtype=torch.float32)
    if moe.n_group > 1:
        choice = _best_groups(moe, choice)
    experts = hashed if hashed is not None else choice.topk(k, dim=-1)[1]
    weights = scores.gather(1, experts)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * moe.routed_scaling_factor
    # Qwen, DeepSeek-V2 and V4 weigh in the logits' dtype; DeepSeek-V3 keeps its router's float32.
    return (weights if moe.router == "sigmoid" else weights.to(logits.dtype)), experts


def _best_groups(moe, choice: torch.Tensor) -> torch.Tensor:
    """``choice`` with the experts outside each token's ``topk_group`` best groups at -inf; a group
    scores by its best expert (softmax: DeepSeek-V2) or its two best summed (sigmoid: DeepSeek-V3)."""
    N, E = choice.shape
    grouped = choice.view(N, moe.n_group, E // moe.n_group)  # (N, G, E / G)
    if moe.router == "sigmoid":
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    best = group_scores.topk(moe.topk_group, dim=-1, sorted=False)[1]  # (N, topk_group)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # (N, G)
    return choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(N, E), float("-inf"))
