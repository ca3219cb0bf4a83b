"""The latency half of a ``task=capacity`` probe: a batch's decode (or chat) timed, and the paired
steps of its filled cache against one sequence's (``slo.tpot_x_batch1``). The memory half and the
judging are :mod:`kvbench.tasks.capacity`'s."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

import torch

from kvbench.cache import Cache, cache_for
from kvbench.config.bench import BenchConfig
from kvbench.generate import decode_step, greedy_generate
from kvbench.measure.host import rss_status
from kvbench.measure.stats import median
from kvbench.measure.timing import RegionTimer
from kvbench.model import Decoder
from kvbench.tasks.capacity_search import latency_judged
from kvbench.workloads.decode import summarize_decode, time_decode
from kvbench.workloads.multiturn import ChatSession, chat_prompts, time_chat

# the warm-up's sequence: a few positions through the prefill and the decode step
WARM_PROMPT, WARM_STEPS = 8, 2
# A probe that no latency target judges, its cache's positions all allocated up front (static), decodes at
# most this many steps: its memory peaks at the first (what later steps add is time, not bytes), and a
# median step of its tokens_per_s needs a few. At batch 256 the 64 steps of workload.gen_len took 85 s.
MEMORY_PROBE_STEPS = 8


class Stepper:
    """More decode steps of a filled cache: positions ``start .. end - 1`` (where a probe's last
    decode steps wrote), again and again, rolled back to ``start`` when they run out. It feeds a
    fixed token: what a step costs depends on the shapes, not on the token."""

    def __init__(self, model: Decoder, cache: Cache, start: int, end: int, step=decode_step):
        if not (cache.stores_history and 0 <= start < end <= cache.length):
            raise ValueError(f"cannot step positions {start}..{end - 1} of a {cache.impl} cache holding "
                             f"{cache.length}")
        self.model, self.cache, self.start, self.end, self.step = model, cache, start, end, step
        self.pos = end  # the first call rolls back
        self.token = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=cache.device)

    @property
    def batch(self) -> int:
        return self.cache.batch_size

    def ready(self) -> None:
        """Roll back when the positions ran out (outside the timed step)."""
        if self.pos == self.end:
            self.cache.rewind(self.start)
            self.pos = self.start

    def __call__(self) -> None:
        self.step(self.model, self.token, self.cache, self.pos)
        self.pos += 1


def time_pairs(probe: Stepper, reference: Stepper, pairs: int,
               device: torch.device) -> Tuple[List[float], List[float]]:
    """``pairs`` decode steps of ``probe`` and as many of ``reference``, interleaved one by one (which
    goes first alternates), so that what the machine does meanwhile falls on both alike: their ratio
    spread 1.09-1.13x where separate runs spread 1.33-1.53x (experiments/results/tpot_pairing.md)."""
    timer = RegionTimer(device)
    with torch.inference_mode():
        for i in range(pairs):
            for name, stepper in (("probe", probe), ("reference", reference))[::1 if i % 2 == 0 else -1]:
                stepper.ready()
                with timer.region(name):
                    stepper()
    return timer.ms("probe"), timer.ms("reference")


@dataclass
class Latency:
    """What a probe's trials took (ms); ``stepper``: its filled cache, ready to step again."""

    ttft_ms: List[float]
    step_ms: List[float]
    tokens_per_s: Optional[float]  # None: no decode steps (a one-token reply)
    stepper: Optional[Stepper] = None


def copies_prompts(cfg: BenchConfig, batch: int, context: int) -> bool:
    """Whether a probe of ``batch`` prompts of ``context`` tokens prefills one and copies it
    (``capacity.copy_prompts``): never where a TTFT target judges the batch's prefill, its cache does
    not hold every row from the start (cache.impl=concat), nothing is chunked, or the prompts fit in
    the batch's one forward (nothing before it to copy: the batch's TTFT is measured)."""
    c = cfg.capacity
    return (c.copy_prompts and batch > 1 and cfg.slo.ttft_ms is None and c.prefill_chunk is not None
            and cfg.cache.impl == "static" and context > max(1, c.prefill_chunk // batch))


def probe_decode_steps(cfg: BenchConfig) -> Optional[int]:
    """:data:`MEMORY_PROBE_STEPS` where no latency target judges a probe and its cache allocates every
    position up front (static, a decode: a chat's grows turn by turn); else None: workload.gen_len."""
    if latency_judged(cfg) or cfg.cache.impl != "static" or cfg.workload.name == "multiturn":
        return None
    return MEMORY_PROBE_STEPS


def decode_latency(cfg: BenchConfig, model: Decoder, device: torch.device, context: int, batch: int,
                   steps: Optional[int] = None) -> Latency:
    """``batch`` prompts of ``context`` seeded tokens, prefilled in forwards of at most
    ``capacity.prefill_chunk`` tokens over the batch (an engine's chunked prefill: its working set
    bounded by the chunk, not by batch x context), then decoded ``workload.gen_len`` steps. Where
    :func:`copies_prompts`, the first prompt's history is copied into the others' rows and only the last
    chunk runs over the batch: no TTFT then (``ttft_ms`` empty), it would not be the batch's. ``steps``:
    fewer decode steps than ``workload.gen_len`` (the cache still holds all of its positions)."""
    rt = cfg.runtime
    generator = torch.Generator().manual_seed(rt.seed)
    prompt = torch.randint(0, cfg.model.vocab_size, (batch, context), generator=generator).to(device)
    cache = cache_for(model, cfg.cache.impl, batch, context + cfg.workload.gen_len)
    copied = copies_prompts(cfg, batch, context)
    steps = cfg.workload.gen_len if steps is None else min(steps, cfg.workload.gen_len)
    timings = time_decode(model, prompt, steps, cache, rt.warmup, rt.repeats, device,
                          prefill_tokens=cfg.capacity.prefill_chunk, copied=copied)
    stepper = Stepper(model, cache, context, cache.length) if cache.stores_history and cache.length > context else None
    return Latency([] if copied else timings.prefill_ms, [ms for trial in timings.decode_ms for ms in trial],
                   summarize_decode(timings, batch)["tokens_per_s"], stepper)


def chat_latency(cfg: BenchConfig, model: Decoder, device: torch.device, context: int, batch: int,
                 steps: Optional[int] = None) -> Latency:
    """``batch`` conversations of the workload's chat (``context``: the positions each holds at the end);
    every turn whole (``steps`` is a decode probe's: a chat's cache grows with its turns)."""
    w, rt = replace(cfg.workload, batch_size=batch), cfg.runtime
    system, users = chat_prompts(w, cfg.model.vocab_size, rt.seed, device)
    session = ChatSession(model, system, batch, cfg.cache.shared, cfg.cache.impl, context)
    trials = time_chat(session, users, w.reply_len, rt.warmup, rt.repeats, device)
    steps = [[ms for turn in trial for ms in turn.decode_ms] for trial in trials]
    held, last_turn = session.cache.length, w.reply_len - 1  # the last turn's decode steps wrote the end
    stepper = (Stepper(model, session.cache, held - last_turn, held, session.step)
               if session.cache.stores_history and last_turn > 0 else None)
    return Latency([turn.ttft_ms for trial in trials for turn in trial], [ms for s in steps for ms in s],
                   median([batch * len(s) / (sum(s) / 1e3) for s in steps]) if all(steps) else None, stepper)


def warm_up(cfg: BenchConfig, model: Decoder, device: torch.device) -> None:
    """One untimed decode of a short sequence before the first probe: what the runtime sets up once on
    first use (kernels' code pages, thread pools, the allocator's state: 9-17 MB of resident set on
    the small models) is then part of every probe's baseline, the first one's too."""
    prompt = torch.zeros(1, WARM_PROMPT, dtype=torch.long, device=device)
    cache = cache_for(model, cfg.cache.impl, 1, WARM_PROMPT + WARM_STEPS)
    greedy_generate(model, prompt, WARM_STEPS, cache, prefill_tokens=cfg.capacity.prefill_chunk)


class OverBudget(Exception):
    """A probe's resident set passed the memory budget mid-run: its memory verdict is in, and the
    rest of its prefill and decode would only take time."""


class Guarded:
    """``model`` whose every forward ends by reading the process's peak resident set (VmHWM): past
    ``limit`` (bytes; None: never) it raises :class:`OverBudget`, so that a CPU probe over the budget
    stops at the forward that crossed it instead of finishing a prefill of batch x context tokens (at
    the failing probe above each answer, the largest prefill of a search). Anything else is the model's."""

    def __init__(self, model: Decoder, limit: Optional[int]):
        self.model, self.limit, self.forwards = model, limit, 0

    def __call__(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        self.forwards += 1
        if self.limit is not None and rss_status()[1] > self.limit:
            raise OverBudget(f"stopped after {self.forwards} forwards: the resident set passed the budget")
        return out

    def __getattr__(self, name: str):
        return getattr(self.model, name)
