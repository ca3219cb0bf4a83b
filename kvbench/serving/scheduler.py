"""Continuous batching over kvbench's decoder (vLLM's scheduler, reduced to what layouts differ in).

Every iteration:

1. requests whose arrival time has passed join the waiting queue (first come, first served);
2. each running request, oldest first, is given its next positions: a decode step (its one
   pending token) or the next chunk of its prefill (at most ``max_prefill_tokens`` prompt
   tokens per iteration in all). When the store has no block left for it, the newest running
   request is preempted (its blocks freed, it goes back to the head of the queue, and is later
   recomputed: its prompt and the tokens it had generated prefilled again);
3. waiting requests are admitted in order while the token budget, ``max_running`` and the
   store allow (a paged store first attaches the cached blocks of its prompt's prefix);
4. the decode steps run as one batched forward (each sequence at its own position, its blocks
   gathered into a padded K/V with a key mask), each prefill chunk as its own forward (split into
   several where the store saves a recurrent layer's state); a request whose last position was
   computed gets its next token (greedy), stamped with the iteration's end time.

The clock is injectable: :class:`WallClock` (``time.perf_counter``, sleeping until the next
arrival when idle) or :class:`FakeClock`, which advances by scripted costs of each iteration,
so a test gets an exact timeline. :func:`serve` returns the :class:`~kvbench.serving.trace.Timeline`.

Notation: B sequences in a batched decode, T new positions of a forward, V vocab.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, List, Optional, Sequence

import torch

from kvbench.serving.paged import PagedStore, SeqBlocks
from kvbench.serving.trace import Request, RequestTrace, Sample, Timeline


class WallClock:
    """Real time (``time.perf_counter``); an idle scheduler sleeps until the next arrival."""

    def now(self) -> float:
        return time.perf_counter()

    def sleep_until(self, t: float) -> None:
        delay = t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    def spent(self, prefill_tokens: int, decode_seqs: int) -> None:
        """Real time passes by itself while the forwards run."""


class FakeClock:
    """A scripted clock: each iteration costs ``step_s`` + ``prefill_s_per_token`` per prompt token
    prefilled + ``decode_s_per_seq`` per sequence decoded; idling jumps to the next arrival."""

    def __init__(self, step_s: float = 0.0, prefill_s_per_token: float = 0.0, decode_s_per_seq: float = 0.0):
        self.t, self.step_s = 0.0, step_s
        self.prefill_s_per_token, self.decode_s_per_seq = prefill_s_per_token, decode_s_per_seq

    def now(self) -> float:
        return self.t

    def sleep_until(self, t: float) -> None:
        self.t = max(self.t, t)

    def spent(self, prefill_tokens: int, decode_seqs: int) -> None:
        self.t += self.step_s + self.prefill_s_per_token * prefill_tokens + self.decode_s_per_seq * decode_seqs


@dataclass
class Running:
    """A request inside the scheduler: its tokens (prompt, then those generated), its blocks,
    and its trace. ``blocks.length`` positions have K/V; the rest of ``tokens`` are to compute."""

    request: Request
    tokens: List[int]
    trace: RequestTrace
    blocks: SeqBlocks = field(default_factory=SeqBlocks)

    @property
    def todo(self) -> int:
        return len(self.tokens) - self.blocks.length

    @property
    def generated(self) -> List[int]:
        return self.tokens[self.request.prompt_len:]


class Scheduler:
    """Continuous batching of ``requests`` on ``model`` over ``store``. ``observe``: a test seam called
    after every iteration. ``follow(request, tokens, t)``: when a request finishes, the request it
    releases and that one's prompt (a conversation's next turn), or None."""

    def __init__(self, model, store: PagedStore, requests: Sequence[Request], prompts: Sequence[List[int]],
                 max_prefill_tokens: int = 512, max_running: int = 64, clock=None,
                 observe: Optional[Callable[["Scheduler"], None]] = None,
                 progress: Optional[Callable[[], None]] = None,
                 follow: Optional[Callable[[Request, List[int], float], Optional[tuple]]] = None):
        if len(prompts) != len(requests):
            raise ValueError(f"{len(prompts)} prompts for {len(requests)} requests")
        self.model, self.store = model, store
        self.max_prefill_tokens, self.max_running = max_prefill_tokens, max_running
        self.clock = clock or WallClock()
        self.observe, self.progress, self.follow = observe, progress, follow
        for r, p in zip(requests, prompts):
            self._check(r, p)
        order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_s, requests[i].id))
        self.all = [Running(requests[i], list(prompts[i]), RequestTrace(requests[i]),
                            SeqBlocks(prompt_len=requests[i].prompt_len)) for i in order]
        self.pending: Deque[Running] = deque(self.all)
        self.waiting: Deque[Running] = deque()
        self.running: List[Running] = []
        self.samples: List[Sample] = []
        self.scheduled: List[tuple] = []  # this iteration's (request, positions)
        self.iterations = 0

    def _check(self, r: Request, prompt: List[int]) -> None:
        if len(prompt) != r.prompt_len:
            raise ValueError(f"request {r.id}: {len(prompt)} prompt tokens, prompt_len={r.prompt_len}")
        if r.prompt_len + r.output_len > self.model.config.max_seq_len:
            raise ValueError(f"request {r.id}: {r.prompt_len} + {r.output_len} positions exceed "
                             f"model.max_seq_len={self.model.config.max_seq_len}")
        unfit = self.store.unfit(r.prompt_len + r.output_len - 1, self.max_prefill_tokens)
        if unfit:
            raise ValueError(f"request {r.id} {unfit}")

    def _arrive(self, request: Request, prompt: List[int]) -> None:
        """A request released during the run joins the pending ones in arrival order."""
        self._check(request, prompt)
        s = Running(request, list(prompt), RequestTrace(request), SeqBlocks(prompt_len=request.prompt_len))
        self.all.append(s)
        at = next((i for i, p in enumerate(self.pending)
                   if (p.request.arrival_s, p.request.id) > (request.arrival_s, request.id)), len(self.pending))
        self.pending.insert(at, s)

    # ---- one iteration ----------------------------------------------------------------------

    def _preempt(self, victim: Running) -> None:
        self.store.release(victim.blocks)
        victim.trace.preemptions += 1
        self.waiting.appendleft(victim)

    def _schedule(self) -> List[tuple]:
        store, budget, out = self.store, self.max_prefill_tokens, []
        i, preempted = 0, False
        while i < len(self.running):
            s = self.running[i]
            T = 1 if s.todo == 1 else min(s.todo, budget)
            if T == 0:
                i += 1
                continue
            while not store.grow(s.blocks, s.blocks.length + T):
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                preempted = True
                if victim is s:
                    break
            else:
                out.append((s, T))
                budget -= T if s.todo > 1 else 0
                i += 1
        # as vLLM: nothing is admitted in an iteration that had to preempt (it would thrash)
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_running:
            s = self.waiting[0]
            hit = store.cached_prefix(s.blocks, s.tokens)
            T = min(s.todo, budget)
            if not store.grow(s.blocks, s.blocks.length + T):
                store.release(s.blocks)  # undo the prefix it attached; it waits for blocks
                break
            self.waiting.popleft()
            self.running.append(s)
            s.trace.prefix_hit_tokens += hit
            s.trace.prefix_query_tokens += len(s.tokens) if store.prefix_caching else 0
            if s.trace.scheduled_s is None:
                s.trace.scheduled_s, s.trace.first_hit_tokens = self.now(), hit
            out.append((s, T))
            budget -= T
        return out

    def _prefill(self, s: Running, T: int) -> int:
        """Positions ``length .. length + T - 1`` of ``s``, split where the store saves a recurrent
        layer's state (a state exists only where a forward ends); the greedy next token."""
        while True:
            limit = self.store.chunk_limit(s.blocks)
            step = T if limit is None else min(T, limit)
            token = self._forward([s], step)[0]
            T -= step
            if T == 0:
                return token

    def _forward(self, seqs: List[Running], T: int) -> List[int]:
        """Positions ``length .. length + T - 1`` of each of ``seqs`` in one forward; the greedy next
        token of each."""
        view = self.store.view([s.blocks for s in seqs], T)
        ids = torch.tensor([s.tokens[s.blocks.length:s.blocks.length + T] for s in seqs],
                           dtype=torch.long, device=self.model.device)  # (B, T)
        logits = self.model(ids, view, view.positions, last_only=True)  # (B, 1, V)
        self.store.written([s.blocks for s in seqs], T)
        for s in seqs:
            self.store.register(s.blocks, s.tokens)
        return logits[:, -1].argmax(-1).tolist()

    def now(self) -> float:
        return self.clock.now() - self.t0

    def step(self) -> None:
        """One iteration (the queue is not empty or something runs)."""
        self.scheduled = self._schedule()
        done: List[tuple] = []
        decodes = [s for s, T in self.scheduled if T == 1]
        if decodes:
            done += [(s, tok) for s, tok in zip(decodes, self._forward(decodes, 1))]
        prefill_tokens = 0
        for s, T in self.scheduled:
            if T > 1:
                prefill_tokens += T
                done.append((s, self._prefill(s, T)))
        self.clock.spent(prefill_tokens, len(decodes))
        t = self.now()
        for s, tok in done:
            if s.todo == 0:  # its last position was computed: the token is its next output
                s.tokens.append(tok)
                s.trace.token_s.append(t)
        self.iterations += 1
        self.samples.append(Sample(t, len(self.running), len(self.waiting), self.store.used_blocks,
                                   self.store.bytes_used, self.store.bytes_needed))
        if self.observe is not None:
            self.observe(self)
        for s in [s for s in self.running if s.trace.finished]:
            self.running.remove(s)
            s.trace.resumable_tokens = self.store.resumable(s.blocks)
            self.store.release(s.blocks)
            released = self.follow(s.request, s.tokens, t) if self.follow is not None else None
            if released is not None:
                self._arrive(*released)
            if self.progress is not None:
                self.progress()

    # ---- the run ------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self) -> Timeline:
        self.t0 = self.clock.now()
        while self.pending or self.waiting or self.running:
            now = self.now()
            while self.pending and self.pending[0].request.arrival_s <= now:
                self.waiting.append(self.pending.popleft())
            if not self.waiting and not self.running:
                self.clock.sleep_until(self.t0 + self.pending[0].request.arrival_s)
                continue
            self.step()
        traces = sorted((s.trace for s in self.all), key=lambda tr: tr.request.id)
        end = max((tr.token_s[-1] for tr in traces if tr.token_s), default=0.0)
        return Timeline(traces, self.samples, end, self.store.kind, self.store.block_size,
                        self.store.num_blocks, self.store.bytes_per_token, self.store.plan.waste_per_sequence)

    def outputs(self) -> dict:
        """Request id -> the tokens it generated."""
        return {s.request.id: s.generated for s in self.all}


def serve(model, store: PagedStore, requests: Sequence[Request], prompts: Sequence[List[int]],
          **kwargs) -> Timeline:
    """Run :class:`Scheduler` to the end; its :class:`~kvbench.serving.trace.Timeline`."""
    return Scheduler(model, store, requests, prompts, **kwargs).run()
