"""Greedy generation as small verbs: :func:`prefill`, :func:`decode_step` and
:func:`greedy_generate`, the loop of them (gpt-fast's shape, so compilation can target the step).

A timer, when given, brackets the regions ``prefill`` (time to first token) and ``decode``
(one per step); anything with a ``region(name)`` context manager will do
(:class:`kvbench.measure.timing.RegionTimer`).

Notation: B batch, P prompt length, N decode steps, V vocab.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch

from kvbench.cache import KVCache


@dataclass
class Generation:
    """Greedy output. ``tokens`` (B, N + 1): the token chosen after the prefill, then one per
    decode step. ``logits`` (B, N + 1, V) float32 when kept, aligned with ``tokens``."""

    tokens: torch.Tensor
    logits: Optional[torch.Tensor] = None


def _region(timer, name: str):
    return timer.region(name) if timer is not None else nullcontext()


def prefill(model, prompt: torch.Tensor, cache: KVCache, start_pos: int = 0) -> torch.Tensor:
    """Run ``prompt`` (B, P) whose first token sits at ``start_pos``; logits of its last token (B, V)."""
    return model(prompt, cache, start_pos, last_only=True)[:, -1]


def decode_step(model, token: torch.Tensor, cache: KVCache, pos: int) -> torch.Tensor:
    """One new token (B, 1) at position ``pos`` against the cached keys; its logits (B, V)."""
    return model(token, cache, pos)[:, -1]


@torch.inference_mode()
def greedy_generate(model, prompt: torch.Tensor, gen_len: int, cache: KVCache,
                    timer=None, keep_logits: bool = False, start_pos: int = 0,
                    step=decode_step) -> Generation:
    """Prefill ``prompt`` (B, P), then ``gen_len`` decode steps, each feeding the previous token.

    ``start_pos``: position of the prompt's first token, when the cache already holds the
    positions before it (a later turn of a chat). With a cache that keeps no history
    (``none``) every step re-runs the whole sequence, as a server without a KV cache would.
    ``step`` replaces :func:`decode_step` (a compiled one, say).
    """
    B, P = prompt.shape
    if start_pos and not cache.stores_history:
        raise ValueError(f"cache.impl={cache.impl!r} keeps no history: start_pos must be 0, got {start_pos}")
    with _region(timer, "prefill"):
        logits = prefill(model, prompt, cache, start_pos)  # (B, V)
        token = logits.argmax(-1, keepdim=True)  # (B, 1)
    tokens, kept = [token], [logits.float()] if keep_logits else None
    seq = prompt
    for i in range(gen_len):
        with _region(timer, "decode"):
            if cache.stores_history:
                logits = step(model, token, cache, start_pos + P + i)
            else:
                seq = torch.cat([seq, token], dim=1)  # (B, P + i + 1)
                logits = prefill(model, seq, cache, 0)
            token = logits.argmax(-1, keepdim=True)
        tokens.append(token)
        if keep_logits:
            kept.append(logits.float())
    return Generation(torch.cat(tokens, dim=1), torch.stack(kept, dim=1) if keep_logits else None)
