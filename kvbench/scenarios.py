"""What a run does to the model. Scenarios time regions through a timer; they never log.

Notation: B batch, P prompt length, N decode steps, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvbench.cache import KVCache
from kvbench.measure.timing import NullTimer


@dataclass
class Generation:
    """Greedy output. ``tokens`` (B, N + 1): the token chosen after the prefill, then one per
    decode step. ``logits`` (B, N + 1, V) float32 when kept, aligned with ``tokens``."""

    tokens: torch.Tensor
    logits: Optional[torch.Tensor] = None


@torch.inference_mode()
def greedy_generate(model, prompt: torch.Tensor, gen_len: int, cache: KVCache,
                    timer=None, keep_logits: bool = False) -> Generation:
    """Prefill ``prompt`` (B, P), then ``gen_len`` decode steps, each feeding the previous token.

    Regions timed: ``prefill`` (time to first token) and one ``decode`` per step. With a cache
    that keeps no history (``none``) every step re-runs the whole sequence, as a server
    without a KV cache would.
    """
    timer = timer or NullTimer()
    B, P = prompt.shape
    with timer.region("prefill"):
        logits = model(prompt, cache, 0)[:, -1]  # (B, V)
        token = logits.argmax(-1, keepdim=True)  # (B, 1)
    tokens, kept = [token], [logits.float()] if keep_logits else None
    seq = prompt
    for step in range(gen_len):
        with timer.region("decode"):
            if cache.stores_history:
                logits = model(token, cache, P + step)[:, -1]
            else:
                seq = torch.cat([seq, token], dim=1)  # (B, P + step + 1)
                logits = model(seq, cache, 0)[:, -1]
            token = logits.argmax(-1, keepdim=True)
        tokens.append(token)
        if keep_logits:
            kept.append(logits.float())
    return Generation(torch.cat(tokens, dim=1), torch.stack(kept, dim=1) if keep_logits else None)
