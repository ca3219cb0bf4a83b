"""Greedy generation as small verbs (gpt-fast's shape, so compilation can target the step):
:func:`prefill`, :func:`decode_step` and :func:`greedy_generate`, the loop of them.
:class:`FixedShapeStep` is ``decode_step`` with shapes fixed from step to step (gpt-fast's
``decode_one_token``): what ``runtime.compile=graph`` compiles, with CUDA graphs on GPUs.
A timer, when given, brackets the regions ``prefill`` and ``decode`` (one per step).

Notation: B batch, P prompt length, N decode steps, V vocab.
"""

from __future__ import annotations

import time
import weakref
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch

from kvbench.cache import Cache, Positions, bucket_length
from kvbench.core.errors import ConfigError
from kvbench.measure.timing import sync
from kvbench.metrics import Metric, metric_table, record_methods


@dataclass
class Generation:
    """Greedy output. ``tokens`` (B, N + 1): the token chosen after the prefill, then one per
    decode step. ``logits`` (B, N + 1, V) float32 when kept, aligned with ``tokens``."""

    tokens: torch.Tensor
    logits: Optional[torch.Tensor] = None


def _region(timer, name: str):
    return timer.region(name) if timer is not None else nullcontext()


@torch.inference_mode()  # a cache must never hold autograd's graph of the prompt, whoever calls
def prefill(model, prompt: torch.Tensor, cache: Cache, start_pos: int = 0) -> torch.Tensor:
    """Run ``prompt`` (B, P) from ``start_pos``; logits of its last token (B, V). Without autograd, or
    the cache's K/V would keep the prefill's graph alive as long as the cache (30 MB more peak for a
    192-token prompt on the small model); ``decode_step``, the hot path, relies on its callers'."""
    return model(prompt, cache, start_pos, last_only=True)[:, -1]


def copy_rows(cache: Cache, rows: int) -> None:
    """Sequences ``rows``.. of ``cache``'s batch take what sequences 0..``rows`` - 1 hold, cycled (K/V,
    rings, states, pools: every tensor, its first dimension the batch), in doubling copies; a cache
    whose layers hold every row from the start (``static``) only."""
    B, tensors = cache.batch_size, cache.tensors()
    wrong = next((tuple(t.shape) for t in tensors if t.shape[0] != B), None)
    if cache.impl != "static" or wrong is not None or not 1 <= rows <= B:
        raise ValueError(f"cannot copy {rows} rows through a {cache.impl} cache of batch {B}"
                         + (f" (it holds a tensor of shape {wrong})" if wrong else ""))
    for t in tensors:
        held = rows
        while held < B:
            n = min(held, B - held)
            t[held:held + n].copy_(t[:n])
            held += n


def chunked_prefill(model, prompt: torch.Tensor, cache: Cache, start_pos: int = 0,
                    tokens: Optional[int] = None, copied: bool = False) -> torch.Tensor:
    """:func:`prefill` of ``prompt`` (B, P) in forwards of at most ``tokens`` prompt tokens over the
    batch (``max(1, tokens // B)`` positions of every sequence each), so that its working set is
    bounded by the chunk, not by B x P; the last position's logits (B, V). None, or a cache that keeps
    no history: one forward.

    ``copied`` (a ``static`` cache, whose rows are all allocated up front): the positions before
    the batch's last forward are prefilled for the first sequence alone, in forwards of ``tokens`` of
    its positions, and copied into the other sequences' rows (:func:`copy_rows`); the last
    ``tokens // B`` positions run over the whole batch in one forward, each sequence its own tokens
    (a full chunk, the working set of every forward of a prefill of every prompt, not a remainder's).
    The cache then holds as many bytes as B prefills leave, every forward at most ``tokens`` tokens,
    for about 1/B of the compute: what a capacity probe's memory and decode steps need, not its time
    to first token."""
    B, P = prompt.shape
    if tokens is None or not cache.stores_history:
        return prefill(model, prompt, cache, start_pos)
    if tokens < 1:
        raise ValueError(f"prefill chunk of {tokens} tokens: must be >= 1")
    step, first = max(1, tokens // B), 0
    if copied and B > 1 and cache.impl == "static":
        first = max(0, P - step)  # the batch's last forward: a full chunk, as every prompt's prefill holds
        if first:
            chunked_prefill(model, prompt[:1, :first], cache, start_pos, tokens)
            copy_rows(cache, 1)
    for i in range(first, P, step):
        logits = prefill(model, prompt[:, i:i + step], cache, start_pos + i)
    return logits


def decode_step(model, token: torch.Tensor, cache: Cache, pos: int) -> torch.Tensor:
    """One new token (B, 1) at position ``pos`` against the cached keys; its logits (B, V)."""
    return model(token, cache, pos)[:, -1]


def _fixed_step(model, token: torch.Tensor, view, pos: torch.Tensor) -> torch.Tensor:
    # The compiled unit: its inputs are tensors and a fixed view whose one Python value (its length)
    # is fixed per context bucket, so it compiles once per bucket and never per position.
    return model(token, view, Positions.of(pos))[:, -1]


class FixedShapeStep:
    """:func:`decode_step` with fixed shapes, for compilation and CUDA graphs.

    The position is a (1,) tensor updated in place (no host-to-device copy, no new input); the
    cache is read through a :class:`~kvbench.cache.FixedCache` of the first multiple of ``bucket``
    positions that holds the step, and the Python bookkeeping stays outside, in ``cache.fixed``.
    ``mode``: None eager; ``"graph"`` ``fullgraph=True`` with static shapes, plus
    ``mode="reduce-overhead"`` (CUDA graphs) on a GPU.
    """

    def __init__(self, bucket: int = 256, mode: Optional[str] = None, device: torch.device | str = "cpu"):
        if bucket < 1:
            raise ValueError(f"bucket={bucket}: must be >= 1 positions")
        self.bucket, self.device = bucket, torch.device(device)
        self.cuda_graphs = mode == "graph" and self.device.type == "cuda"
        self.fn = _fixed_step
        if mode == "graph":
            # One graph per context bucket and model, all entries of _fixed_step's cache: past
            # dynamo's default limit of 8 it would fall back to eager without a word.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self.fn = torch.compile(_fixed_step, fullgraph=True, dynamic=False,
                                    mode="reduce-overhead" if self.cuda_graphs else None)
        elif mode is not None:
            raise ValueError(f"mode={mode!r}: must be None (eager) or 'graph'")
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self._static = weakref.WeakSet()  # caches whose storage CUDA graphs may keep addresses of

    def lengths(self, cache: Cache, positions) -> list[int]:
        """Keys each step at ``positions`` reads (prefix included): what the roofline counts."""
        prefix = getattr(cache, "prefix_len", 0)
        return [prefix + bucket_length(p + 1 - prefix, self.bucket, cache.max_seq_len - prefix) for p in positions]

    def __call__(self, model, token: torch.Tensor, cache: Cache, pos: int) -> torch.Tensor:
        if pos >= model.config.max_seq_len:
            raise ValueError(f"position {pos} exceeds model.max_seq_len={model.config.max_seq_len}")
        view = cache.fixed(pos, token.shape[0], self.bucket)
        if self.cuda_graphs:
            if cache not in self._static:
                # The cache is written in place every step: a CUDA graph must read and write its
                # storage where it is, not through copies of it (HF's StaticCache does the same).
                for t in cache.tensors() + [self.pos]:
                    torch._dynamo.mark_static_address(t)
                self._static.add(cache)
            torch.compiler.cudagraph_mark_step_begin()
        self.pos.fill_(pos)
        logits = self.fn(model, token, view, self.pos)
        # A CUDA graph's outputs are overwritten by its next replay: hand out a copy.
        return logits.clone() if self.cuda_graphs else logits


@torch.inference_mode()
def greedy_generate(model, prompt: torch.Tensor, gen_len: int, cache: Cache,
                    timer=None, keep_logits: bool = False, start_pos: int = 0,
                    step=decode_step, prefill_tokens: Optional[int] = None, copied: bool = False) -> Generation:
    """Prefill ``prompt`` (B, P), then ``gen_len`` decode steps, each feeding the previous token.

    ``start_pos``: where the prompt starts when the cache holds earlier positions (a later chat
    turn). With cache ``none`` every step re-runs the whole sequence, as a server without a KV
    cache would. ``prefill_tokens``: at most this many prompt tokens per forward over the batch
    (:func:`chunked_prefill`), as an engine bounds a prefill's working set; None: one forward;
    ``copied``: the prompt's history copied from its first sequence (:func:`chunked_prefill`).
    """
    B, P = prompt.shape
    if start_pos and not cache.stores_history:
        raise ValueError(f"cache.impl={cache.impl!r} keeps no history: start_pos must be 0, got {start_pos}")
    with _region(timer, "prefill"):
        logits = chunked_prefill(model, prompt, cache, start_pos, prefill_tokens, copied)  # (B, V)
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


# ---- runtime.compile -------------------------------------------------------------------------

COMPILE_METRICS: Dict[str, Metric] = metric_table(
    Metric("compiled_graphs", "count",
           "graphs torch.compile compiled during compile_s (graph: one per context bucket)"),
    Metric("recompiles", "count", "graphs torch.compile compiled during the timed trials (dynamo's unique_graphs "
                  "counter); 0 means every timed step ran a graph compiled beforehand"),
)
COMPILE_METHODS: Dict[str, str] = record_methods(COMPILE_METRICS)


def compiled_step(mode: str, model, device: torch.device, bucket: int = 256):
    """(model, step) under ``runtime.compile=mode``: ``default`` compiles the model with dynamic shapes
    (the KV length grows every step); ``graph`` a :class:`FixedShapeStep` (prefill stays eager)."""
    if mode == "default":
        return torch.compile(model, dynamic=True), decode_step
    if mode == "graph":
        return model, FixedShapeStep(bucket, "graph", device)
    return model, decode_step


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process (a rise during timed trials is a recompile)."""
    from torch._dynamo.utils import counters  # dynamo loads only when compiling is asked for

    return counters["stats"]["unique_graphs"]


def compile_phase(generate: Callable[[], Any], device: torch.device, mode: str) -> Dict[str, Any]:
    """Run ``generate`` once so compilation is done, and timed as ``compile_s``, before any trial; a
    machine where compile cannot work is a one-line ConfigError naming ``runtime.compile``."""
    graphs = compiled_graphs()
    t0 = time.perf_counter()
    try:
        generate()
    except Exception as exc:  # noqa: BLE001 — inductor raises many types; the message is what matters
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"runtime.compile={mode}: torch.compile is unavailable here ({first})") from exc
    sync(device)
    return {"compile_s": time.perf_counter() - t0, "compiled_graphs": compiled_graphs() - graphs}
