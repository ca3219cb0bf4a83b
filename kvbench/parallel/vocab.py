"""The embedding and the LM head split over tensor-parallel ranks by vocabulary, as Megatron's
VocabParallelEmbedding and ColumnParallelLinear (vLLM's VocabParallelEmbedding and ParallelLMHead) split
them: each of N ranks holds ceil(V / N) rows of the table (the last rank what is left). A token looks up
its row on the rank holding it and zeros elsewhere, and the ranks' sum (an all-reduce) is the whole
table's lookup; each rank's head gives the logits of its rows, and the ranks' parts gathered in rank
order (an all-gather, each padded to ceil(V / N)) are the whole head's. Exact: a lookup adds zeros, a
logit is one rank's dot product. The rank group is duck-typed (``rank``, ``ranks``, ``all_reduce``,
``all_gather``: :class:`kvbench.parallel.tensor.RankGroup`); None: the part alone (a rank's weights
counted on the meta device)."""

from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.nn.functional as F
from torch import nn


def vocab_rows(vocab: int, rank: int, ranks: int) -> Tuple[int, int]:
    """``(first, rows)``: the rows of a table of ``vocab`` rows that rank ``rank`` of ``ranks`` holds."""
    per = -(-vocab // ranks)  # ceil: every rank but the last holds as many
    first = min(vocab, rank * per)
    return first, min(vocab, first + per) - first


class VocabEmbedding(nn.Module):
    """Rows ``[first, first + rows)`` of a ``vocab``-row embedding; its forward the whole table's lookup once
    the ranks' parts are summed (by ``group``)."""

    def __init__(self, whole: nn.Embedding, rank: int, ranks: int, group: Any = None):
        super().__init__()
        self.first, rows = vocab_rows(whole.num_embeddings, rank, ranks)
        self.weight = nn.Parameter(whole.weight.detach().narrow(0, self.first, rows).clone(),
                                   requires_grad=whole.weight.requires_grad)
        self.group = group

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])  # another rank's rows
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0)
        return x if self.group is None else self.group.all_reduce(x)


class VocabHead(nn.Module):
    """Rows ``[first, first + rows)`` of a ``vocab``-row LM head; its forward the whole head's logits
    (B, T, V), the ranks' parts gathered (by ``group``) in rank order."""

    def __init__(self, whole: nn.Linear, rank: int, ranks: int, group: Any = None):
        super().__init__()
        self.vocab, self.per = whole.out_features, -(-whole.out_features // ranks)
        first, rows = vocab_rows(self.vocab, rank, ranks)
        self.weight = nn.Parameter(whole.weight.detach().narrow(0, first, rows).clone(),
                                   requires_grad=whole.weight.requires_grad)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)  # (B, T, rows): this rank's
        if self.group is None:
            return logits
        logits = F.pad(logits, (0, self.per - logits.shape[-1]))  # the last rank's short part, to the others' size
        return self.group.all_gather(logits)[..., :self.vocab]
