"""What a run does to the model. Scenarios time regions through a timer; they never log.

Notation: B batch, P prompt length, N decode steps, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from kvbench.cache import KVCache
from kvbench.measure.timing import NullTimer, RegionTimer, step_percentiles


@dataclass
class Generation:
    """Greedy output. ``tokens`` (B, N + 1): the token chosen after the prefill, then one per
    decode step. ``logits`` (B, N + 1, V) float32 when kept, aligned with ``tokens``."""

    tokens: torch.Tensor
    logits: Optional[torch.Tensor] = None


@torch.inference_mode()
def greedy_generate(model, prompt: torch.Tensor, gen_len: int, cache: KVCache,
                    timer=None, keep_logits: bool = False, start_pos: int = 0) -> Generation:
    """Prefill ``prompt`` (B, P), then ``gen_len`` decode steps, each feeding the previous token.

    ``start_pos``: position of the prompt's first token, when the cache already holds the
    positions before it (a later turn of a chat). Regions timed: ``prefill`` (time to first
    token) and one ``decode`` per step. With a cache that keeps no history (``none``) every
    step re-runs the whole sequence, as a server without a KV cache would.
    """
    timer = timer or NullTimer()
    B, P = prompt.shape
    if start_pos and not cache.stores_history:
        raise ValueError(f"cache.impl={cache.impl!r} keeps no history: start_pos must be 0, got {start_pos}")
    with timer.region("prefill"):
        logits = model(prompt, cache, start_pos, last_only=True)[:, -1]  # (B, V)
        token = logits.argmax(-1, keepdim=True)  # (B, 1)
    tokens, kept = [token], [logits.float()] if keep_logits else None
    seq = prompt
    for step in range(gen_len):
        with timer.region("decode"):
            if cache.stores_history:
                logits = model(token, cache, start_pos + P + step)[:, -1]
            else:
                seq = torch.cat([seq, token], dim=1)  # (B, P + step + 1)
                logits = model(seq, cache, 0, last_only=True)[:, -1]
            token = logits.argmax(-1, keepdim=True)
        tokens.append(token)
        if keep_logits:
            kept.append(logits.float())
    return Generation(torch.cat(tokens, dim=1), torch.stack(kept, dim=1) if keep_logits else None)


@dataclass
class DecodeTimings:
    """Per-trial timings of the decode workload, in milliseconds."""

    prefill_ms: List[float]  # one per timed trial
    decode_ms: List[List[float]]  # per trial, one per decode step


def time_decode(model, prompt: torch.Tensor, gen_len: int, cache: KVCache, warmup: int,
                repeats: int, device, progress=None) -> DecodeTimings:
    """``warmup`` untimed then ``repeats`` timed runs of :func:`greedy_generate` on a reset cache.

    ``progress``, if given, is called once per finished trial (for a progress bar).
    """
    prefill, decode = [], []
    for trial in range(warmup + repeats):
        cache.reset()
        timer = RegionTimer(device)
        greedy_generate(model, prompt, gen_len, cache, timer)
        if trial >= warmup:
            prefill.extend(timer.ms("prefill"))
            decode.append(timer.ms("decode"))
        if progress is not None:
            progress()
    return DecodeTimings(prefill, decode)


def summarize_decode(t: DecodeTimings, batch_size: int) -> Dict[str, float]:
    """Latency metrics (units and methods in :data:`kvbench.results.METRIC_METHODS`)."""
    per_trial_decode = torch.tensor([sum(trial) for trial in t.decode_ms], dtype=torch.float64)
    prefill = torch.tensor(t.prefill_ms, dtype=torch.float64)
    gen_len = len(t.decode_ms[0])
    return {
        "prefill_ms": prefill.median().item(),
        "ttft_ms": prefill.median().item(),
        **step_percentiles([ms for trial in t.decode_ms for ms in trial]),
        "tokens_per_s": (batch_size * gen_len / (per_trial_decode / 1e3)).median().item(),
        "e2e_ms": (prefill + per_trial_decode).median().item(),
    }
