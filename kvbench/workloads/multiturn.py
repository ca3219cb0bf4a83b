"""The multi-turn chat workload (``workload=multiturn``): B conversations after one system
prompt, served with or without a KV cache shared across turns (``cache.shared``).

Each turn is a user message of U tokens and a greedy reply of R tokens. The reply's first
token comes from the prefill (time to first token); R - 1 decode steps give the rest, so the
last reply token is fed at the start of the next turn, as a server does with the last token it
sent. Token ids are drawn from the seed.

Notation: B conversations, P system_len, U user_len, R reply_len, N turns, V vocab.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from kvbench.cache import cache_for
from kvbench.config.bench import BenchConfig
from kvbench.config.workload import MultiturnWorkload
from kvbench.generate import (
    COMPILE_METRICS,
    Generation,
    compile_phase,
    compiled_graphs,
    compiled_step,
    decode_step,
    greedy_generate,
    prefill,
)
from kvbench.measure.memory import MemoryMonitor
from kvbench.measure.stats import METHODS as STATS_METHODS
from kvbench.measure.stats import (
    median,
    step_metric_metrics,
    step_metrics,
    step_rate,
    step_rate_metrics,
    trial_metric,
    trial_metric_metrics,
)
from kvbench.measure.timing import RegionTimer
from kvbench.metrics import Metric, metric_table, record_methods
from kvbench.results import RunResult
from kvbench.shared_prefix import SharedPrefixCache, shared_cache_for

Tick = Callable[..., None]

# A chat's turn{k}_ttft_ms, one per turn, is declared as it is measured: here as a pattern.
TURN_TTFT = Metric("turn<k>_ttft_ms", "ms", "this turn's prefill + argmax of its first reply token, median over "
                   "timed trials (turn 1 with cache.shared=true includes the one batch-1 system-prompt prefill)")
METRICS: Dict[str, Metric] = metric_table(
    Metric("mean_ttft_ms_turns_2_n", "ms", "per timed chat the mean TTFT of turns 2..N, median over chats: the "
                                           "statistic its interval is of (null for a 1-turn chat)"),
    Metric("total_prefill_tokens", "tokens", "K/V rows computed by the prefills of all turns, summed over the batch"),
    Metric("total_reused_tokens", "tokens", "context positions read from the cache instead of recomputed, all turns, "
                           "summed over the batch (per turn: prefill_tokens + reused_tokens = B * context_tokens)"),
    Metric("kv_cache_bytes", "bytes",
           "storage held by the cache tensors at the end of the chat (untyped_storage().nbytes())"),
    Metric("kv_cache_bytes_formula", "bytes", "2 * layers * kv_heads * (head_dim * bytes_per_element + scale bytes) * "
                              "positions held at the end of the chat (system prompt once if cache.shared else B "
                              "times, history B times); cache.dtype int8/float8: 1 byte + a 4-byte scale; "
                              "4-bit: half a byte + a byte per block of 16 (nvfp4) or 32 (mxfp4) values"),
    Metric("e2e_ms", "ms", "prefills + decode steps of all turns of a chat, median over timed trials"),
    Metric("tables.turns", "",
           "one row per turn: ttft_ms (median over trials) with ttft_ms_ci_low/_ci_high (percentile "
                    "bootstrap over trials, null below 6 trials with ttft_ms_ci_reason), prefill_tokens, "
                    "reused_tokens, "
                    "context_tokens (per conversation), decode_ms_p50 (that turn's steps, all timed trials), "
                    "kv_cache_bytes (allocated) and kv_cache_bytes_formula (held) after the turn"),
    Metric("decode_ms_p50", "ms",
           "per-token decode step latency, 50th percentile over every step of every turn of every "
                     f"timed trial ({STATS_METHODS['percentiles']})"),
    Metric("decode_ms_p90", "ms", "per-token decode step latency, 90th percentile (as decode_ms_p50)"),
    Metric("decode_ms_p99", "ms", "per-token decode step latency, 99th percentile (as decode_ms_p50)"),
    Metric("decode_ms_mean", "ms", "mean per-token decode step latency (as decode_ms_p50)"),
    Metric("series.decode_ms", "ms", "every decode step of every turn of the last timed trial, in order"),
    *step_metric_metrics(),
    *trial_metric_metrics("turn1_ttft_ms", "ms"),
    *trial_metric_metrics("mean_ttft_ms_turns_2_n", "ms"),
    *step_rate_metrics(),
    Metric("trials_run", "count",
           "timed chats actually run: runtime.repeats, or more until runtime.min_time_s of timed "
                  "chats had passed"),
    Metric("compile_s", "s", "runtime.compile=default|graph: one untimed chat through the compiled model or step, "
                 "excluded from every trial"),
    *COMPILE_METRICS.values(),
)
METHODS: Dict[str, str] = record_methods(METRICS)
RECORDED = metric_table(*METRICS.values(), TURN_TTFT)  # what a record may hold: the turns' too


@dataclass
class Segment:
    """A span of a conversation: ``role`` system | user | assistant, its ``turn`` (0 for the system
    prompt) and its tokens ``start .. end - 1``, which are also its rotary positions (the cache knows
    only positions)."""

    role: str
    turn: int
    start: int
    end: int


def chat_prompts(w: MultiturnWorkload, vocab_size: int, seed: int,
                 device: torch.device | str = "cpu") -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """The system prompt (P,) and one user message (B, U) per turn, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, vocab_size, (w.system_len,), generator=g)
    users = [torch.randint(0, vocab_size, (w.batch_size, w.user_len), generator=g) for _ in range(w.turns)]
    return system.to(device), [u.to(device) for u in users]


@dataclass
class TurnStats:
    """What one turn cost. Token counts: ``context_tokens`` per conversation; ``prefill_tokens``
    (K/V computed) and ``reused_tokens`` (read from the cache) summed over the batch."""

    turn: int
    ttft_ms: float
    decode_ms: List[float]
    prefill_tokens: int
    reused_tokens: int
    context_tokens: int
    kv_cache_bytes: int
    kv_cache_bytes_formula: int


class ChatSession:
    """B conversations after one system prompt, served turn by turn.

    ``shared=True``: a :class:`SharedPrefixCache` holds the system prompt's K/V once (batch 1) and
    each conversation's history; a turn prefills only what the cache lacks (the previous reply's last
    token and the new message). ``shared=False``: a stateless server; every turn re-prefills system
    prompt + history + message for each conversation.
    """

    def __init__(self, model, system: torch.Tensor, batch_size: int, shared: bool, impl: str, max_len: int,
                 step=decode_step, cache_dtype: str = "auto"):
        self.model, self.system, self.shared, self.step = model, system, shared, step
        self.batch_size, self.prefix_len = batch_size, system.shape[0]
        self.cache = (shared_cache_for(model, impl, batch_size, self.prefix_len, max_len, cache_dtype) if shared
                      else cache_for(model, impl, batch_size, max_len, cache_dtype))
        self.reset()

    def reset(self) -> None:
        """Forget everything, the system prompt's K/V included (a cold start)."""
        self.cache.reset()
        self.segments: List[Segment] = []
        self.new_conversation()

    def new_conversation(self) -> None:
        """Start B new conversations; a shared cache keeps the system prompt's K/V for them."""
        if self.shared and self.cache.length:
            self.cache.truncate(self.prefix_len)
        self.segments = [s for s in self.segments if s.role == "system"]
        self.tokens = self.system.expand(self.batch_size, -1)  # (B, L): the conversation so far
        self.turn_starts: List[int] = []  # position of each turn's user message

    def _mark(self, role: str, turn: int, start: int, end: int) -> Segment:
        """Record that positions ``start .. end - 1`` are ``role``'s span of ``turn``, without gap or
        overlap (mixing their boundaries corrupts the context)."""
        last = self.segments[-1].end if self.segments else 0
        if start != last or end <= start:
            raise ValueError(f"segment {role} {turn} at {start}..{end - 1} does not follow the last one "
                             f"(ends at {last})")
        self.segments.append(Segment(role, turn, start, end))
        return self.segments[-1]

    @property
    def turns(self) -> int:
        return len(self.turn_starts)

    def ask(self, user: torch.Tensor, reply_len: int, timer=None,
            keep_logits: bool = False) -> Tuple[Generation, TurnStats]:
        """One turn: ``user`` (B, U) then a greedy reply of ``reply_len`` tokens. The TTFT is the sum
        of the ``prefill`` regions (turn 1 with sharing: the system prompt's, then the message's)."""
        timer = timer or RegionTimer(self.cache.device)
        B, U = user.shape
        start, computed = self.tokens.shape[1], 0
        if self.shared:
            if self.cache.length == 0:  # the system prompt, once for all B conversations
                with timer.region("prefill"):  # prefill runs without autograd (generate.prefill)
                    prefill(self.model, self.system[None], self.cache, 0)
                self.segments = []
                self._mark("system", 0, 0, self.prefix_len)
                computed = self.prefix_len
            held = self.cache.length
        else:
            self.cache.reset()
            held = 0
        new = torch.cat([self.tokens[:, held:], user], dim=1)  # (B, L - held + U)
        gen = greedy_generate(self.model, new, reply_len - 1, self.cache, timer, keep_logits, start_pos=held,
                              step=self.step)
        self.tokens = torch.cat([self.tokens, user, gen.tokens], dim=1)
        self.turn_starts.append(start)
        if self.shared:
            self._mark("user", self.turns, start, start + U)
            self._mark("assistant", self.turns, start + U, start + U + reply_len)
        computed += B * new.shape[1]
        return gen, TurnStats(
            turn=self.turns, ttft_ms=sum(timer.ms("prefill")), decode_ms=timer.ms("decode"),
            prefill_tokens=computed, reused_tokens=B * (start + U) - computed, context_tokens=start + U,
            kv_cache_bytes=self.cache.nbytes, kv_cache_bytes_formula=self.kv_bytes_formula())

    def rollback(self) -> None:
        """Forget the last turn (its message and reply), as if it had never been asked."""
        if not self.turn_starts:
            raise ValueError("no turn to roll back")
        start = self.turn_starts.pop()
        self.tokens = self.tokens[:, :start]
        self.segments = [s for s in self.segments if s.start < start]
        if self.shared:
            self.cache.truncate(min(self.cache.length, start))

    def kv_bytes_formula(self) -> int:
        """Bytes the positions the cache holds need (the system prompt once when shared, else B times)."""
        c = self.cache
        held = lambda positions, batch: self.model.layouts.cache_bytes(  # noqa: E731
            positions, batch, c.dtype.itemsize, c.cache_dtype)
        if isinstance(c, SharedPrefixCache):
            return held(min(c.length, c.prefix_len), 1) + held(c.history.length, c.batch_size)
        return held(c.length, c.batch_size)

    def describe(self) -> str:
        """One line per segment: tokens (= rotary positions), where its K/V lives, how much is held."""
        c = self.cache
        if isinstance(c, SharedPrefixCache):
            lines = [f"{'segment':<13} {'tokens = positions':<19} {'K/V stored at':<40} held"]
            for s in self.segments:
                name = s.role if s.role == "system" else f"{s.role} {s.turn}"
                held = min(max(c.length - s.start, 0), s.end - s.start)
                lines.append(f"{name:<13} {f'{s.start}-{s.end - 1}':<19} {c.storage_of(s.start, s.end):<40} "
                             f"{held}/{s.end - s.start}")
            return "\n".join(lines)
        return (f"cache.shared=false: no segments are kept; each turn re-prefills positions "
                f"0-{self.tokens.shape[1] - 1} for each of {self.batch_size} conversations")


def time_chat(session: ChatSession, users: Sequence[torch.Tensor], reply_len: int, warmup: int,
              repeats: int, device, tick: Optional[Tick] = None, min_time_s: float = 0.0,
              clock: Callable[[], float] = time.perf_counter) -> List[List[TurnStats]]:
    """``warmup`` untimed then timed chats from a cold cache, as :func:`~kvbench.workloads.decode.time_decode`
    times decodes; per timed trial, one :class:`TurnStats` per turn."""
    trials = []
    trial, started = 0, None
    while trial < warmup + repeats or (started is not None and clock() - started < min_time_s):
        if trial == warmup:
            started = clock()
        session.reset()
        turns = [session.ask(user, reply_len, RegionTimer(device))[1] for user in users]
        if trial >= warmup:
            trials.append(turns)
        if tick is not None:
            tick()
        trial += 1
    return trials


def summarize_turns(trials: List[List[TurnStats]]) -> List[Dict[str, Any]]:
    """One row per turn: medians over trials for times, the last trial's counts and bytes (the same in
    every trial)."""
    rows = []
    for k, last in enumerate(trials[-1]):
        steps = [ms for trial in trials for ms in trial[k].decode_ms]
        ttft = [t[k].ttft_ms for t in trials]
        ttft_fields = {k: v for k, v in trial_metric("ttft_ms", ttft).items() if not k.endswith(("_n", "_warning"))}
        rows.append({"turn": last.turn, **ttft_fields,
                     "prefill_tokens": last.prefill_tokens, "reused_tokens": last.reused_tokens,
                     "context_tokens": last.context_tokens,
                     "decode_ms_p50": median(steps) if steps else None,
                     "kv_cache_bytes": last.kv_cache_bytes,
                     "kv_cache_bytes_formula": last.kv_cache_bytes_formula})
    return rows


def chat_metrics(rows: List[Dict[str, Any]], trials: List[List[TurnStats]], batch_size: int) -> Dict[str, Any]:
    """Scalar totals of a chat for ``metrics`` (units in :data:`METHODS`)."""
    m: Dict[str, Any] = {f"turn{r['turn']}_ttft_ms": r["ttft_ms"] for r in rows}
    m.update(trial_metric("turn1_ttft_ms", [t[0].ttft_ms for t in trials]))
    later = len(rows) - 1
    m["mean_ttft_ms_turns_2_n"] = None
    if later:  # one statistic, estimate and interval: the per-chat mean over turns 2..N, median over chats
        # (the mean of per-turn medians beside this interval read 22.28 outside [20.94, 21.78])
        per_chat = [sum(turn.ttft_ms for turn in t[1:]) / later for t in trials]
        m.update(trial_metric("mean_ttft_ms_turns_2_n", per_chat))
    m["total_prefill_tokens"] = sum(r["prefill_tokens"] for r in rows)
    m["total_reused_tokens"] = sum(r["reused_tokens"] for r in rows)
    m["kv_cache_bytes"] = rows[-1]["kv_cache_bytes"]
    m["kv_cache_bytes_formula"] = rows[-1]["kv_cache_bytes_formula"]
    per_trial_steps = [[ms for turn in t for ms in turn.decode_ms] for t in trials]
    if per_trial_steps[0]:
        steps = step_metrics(per_trial_steps)
        m.update(steps)
        m.update(step_rate(steps, batch_size))  # tokens/s from the same steps: they cannot disagree
    m["e2e_ms"] = median([sum(turn.ttft_ms + sum(turn.decode_ms) for turn in t) for t in trials])
    m["trials_run"] = len(trials)
    return m


def run(cfg: BenchConfig, model, device: torch.device, result: RunResult, tick: Optional[Tick] = None) -> None:
    """The chat ``warmup`` + ``repeats`` times from a cold cache; per-turn rows in ``tables.turns``."""
    w, rt = cfg.workload, cfg.runtime
    metrics = result.metrics
    system, users = chat_prompts(w, cfg.model.vocab_size, rt.seed, device)
    # The chat's last reply token is never fed, so total_len - 1 positions are ever held.
    run_model, step = compiled_step(rt.compile, model, device, rt.graph_bucket)
    session = ChatSession(run_model, system, w.batch_size, cfg.cache.shared, cfg.cache.impl, w.total_len - 1, step,
                          cfg.cache.dtype)
    if rt.compile != "false":  # one untimed chat compiles every shape (and context bucket) it meets
        metrics.update(compile_phase(lambda: time_chat(session, users, w.reply_len, 1, 0, device), device,
                                     rt.compile))
        graphs = compiled_graphs()
    # Warm-up outside the monitor, as in workloads/decode.py: memory and energy of the timed chats only.
    time_chat(session, users, w.reply_len, rt.warmup, 0, device, tick)
    with MemoryMonitor(device, rt.nvml_interval_ms) as monitor:
        trials = time_chat(session, users, w.reply_len, 0, rt.repeats, device, tick, rt.min_time_s)
    if rt.compile != "false":
        metrics["recompiles"] = compiled_graphs() - graphs
    metrics.update(monitor.result())
    rows = summarize_turns(trials)
    result.tables["turns"] = rows
    metrics.update(chat_metrics(rows, trials, w.batch_size))
    result.series["decode_ms"] = [ms for turn in trials[-1] for ms in turn.decode_ms]
    result.methods.update(METHODS)
    result.methods.update({f"turn{r['turn']}_ttft_ms": TURN_TTFT.text for r in rows})
