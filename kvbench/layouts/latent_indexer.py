"""DSA's lightning indexer (DeepSeek-V3.2, :class:`kvbench.layouts.latent.Latent` with
``index_topk``), as transformers' DeepseekV32Indexer computes it, and the top-k selection the
latent attention then attends.

Per token the indexer caches one key k_s = rope(LayerNorm(W_k x_s)) of ``index_head_dim`` (the
cache's second tensor). A query t scores every cached token s it may see:

    I(t, s) = sum_h w_{t,h} · ReLU(q_{t,h} · k_s / sqrt(D_i)),   w_t = W_w x_t / sqrt(H_i)

with q_{t,h} from the query latent and rope on the first qk_rope_head_dim dimensions (rotate-half,
not the latent attention's interleaved pairs), in float32, and attends its ``index_topk``
best-scored tokens. Where kvbench differs from transformers in form, not in result:

- a decode step gathers the k selected latents instead of masking all S keys, so it reads k
  latents, not S; a prompt (T > 1) uses the mask, as transformers does.
- a prompt's scores are taken in blocks of query rows (:data:`SCORE_ELEMENTS`), not as one
  (B, T, H_i, S) float32 tensor (4 GB per sequence at T = S = 4096 with 64 heads).
- ties go to the earlier token (a stable sort), so a decode step selects what a recompute
  selects; transformers' ``topk`` breaks them in an order that depends on the call's shape. Exact
  ties at the k-th place are common only with few heads and random weights (a token whose every
  head's ReLU is 0 scores exactly 0).
- ``weights_proj`` runs in the model's dtype (transformers keeps it in float32 under half
  precision); its output is cast to float32 before the sum, as there.

Notation: B batch, T new tokens, S cached tokens, H_i indexer heads, D_i their width, k index_topk.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from kvbench.cache import Attend, causal_mask
from kvbench.rope import apply_rope

# (query, head, token) index scores a prompt computes at a time
SCORE_ELEMENTS = 2**26


class Indexer(nn.Module):
    """The lightning indexer of one DSA layer (transformers' parameter names)."""

    def __init__(self, cfg, a):
        super().__init__()
        self.n_heads, self.head_dim, self.d_rope, self.topk = a.index_n_heads, a.index_head_dim, \
            a.qk_rope_head_dim, a.index_topk
        self.wq_b = nn.Linear(a.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.d_model, self.n_heads, bias=False)

    def _rotate(self, x, cos, sin):
        """Rope on the first d_rope dimensions of x (B, heads, T, D_i), the rest unrotated."""
        return torch.cat([apply_rope(x[..., :self.d_rope], cos, sin), x[..., self.d_rope:]], -1)

    def key(self, x, cos, sin) -> torch.Tensor:
        """The new tokens' index keys, (B, 1, T, D_i): what the cache holds beside the latents."""
        return self._rotate(self.k_norm(self.wk(x))[:, None], cos, sin)

    def select(self, x, q_latent, cos, sin, att: Attend) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The latents (B, 1, S', R + d_rope) the new tokens attend and their mask: a decode step's k
        gathered latents, or a prompt's S with (B, T, S) = visible and selected. ``att``: the cache's
        answer (latents as keys, index keys as values); called only when S > k."""
        B, T, _ = x.shape
        latents, S = att.k, att.k.shape[2]
        visible = causal_mask(T, S, x.device) if att.mask is None and att.causal else att.mask
        top = self.top(x, q_latent, cos, sin, att.v, visible)  # (B, T, k)
        if T == 1:
            keys = latents.gather(2, top.view(B, 1, self.topk, 1).expand(-1, -1, -1, latents.shape[-1]))
            return keys, None if visible is None else visible.expand(B, 1, S).gather(-1, top)
        chosen = torch.zeros(B, T, S, dtype=torch.bool, device=x.device).scatter_(-1, top, True)
        return latents, chosen if visible is None else chosen & visible

    def top(self, x, q_latent, cos, sin, keys, visible) -> torch.Tensor:
        """(B, T, k) indices of the cached tokens each query scores highest among those it sees
        (``visible`` (T, S) or (B, T, S), None: all); keys (B, 1, S, D_i)."""
        B, T, _ = x.shape
        S = keys.shape[2]
        q = self._rotate(self.wq_b(q_latent).view(B, T, self.n_heads, -1).transpose(1, 2), cos, sin)
        q = q.transpose(1, 2).float()  # (B, T, H_i, D_i), as transformers lays it out
        k = keys[:, 0].float().transpose(-1, -2).unsqueeze(1)  # (B, 1, D_i, S)
        w = self.weights_proj(x).float() * self.n_heads ** -0.5  # (B, T, H_i)
        rows = max(1, SCORE_ELEMENTS // (self.n_heads * S))
        out = []
        for t in range(0, T, rows):
            scores = F.relu(torch.matmul(q[:, t:t + rows], k) * self.head_dim ** -0.5)  # (B, t', H_i, S)
            index = torch.matmul(w[:, t:t + rows].unsqueeze(-2), scores).squeeze(-2)  # (B, t', S)
            if visible is not None:
                index = index.masked_fill(~visible[..., t:t + rows, :], float("-inf"))
            # a stable sort, not topk: ties go to the earlier token whatever the call's shape
            out.append(index.sort(dim=-1, descending=True, stable=True).indices[..., :self.topk])
        return torch.cat(out, 1)
