"""The serving workload (``workload=serving``): requests arrive open-loop (Poisson, gamma with a
burstiness, or a trace file; :mod:`kvbench.serving.arrivals`) and a continuous-batching scheduler
(:mod:`kvbench.serving.scheduler`) serves them from a KV store of a fixed memory budget, paged
blocks of ``cache.block_size`` tokens or one static slot per request (:mod:`kvbench.serving.paged`).

The same ``workload.seed`` gives every variant the same requests and the budget in bytes is the
same too, so a layout with a smaller K/V per token gets more blocks, runs more requests at once and
preempts fewer. The record holds the whole timeline, so its metrics can be recomputed from it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence

import torch

from kvbench.config.bench import BenchConfig
from kvbench.config.serving import duration_text, kv_budget_note
from kvbench.core.dtypes import DTYPE_BYTES
from kvbench.core.errors import ConfigError
from kvbench.layouts.build import build_layouts
from kvbench.metrics import Metric, metric_table, record_methods
from kvbench.parallel.per_gpu import SPLIT_METRICS, job_split_metrics
from kvbench.results import RunResult
from kvbench.serving import metrics as serving_metrics
from kvbench.serving.allocator import Checkpoint, budget_bytes, groups_of, make_plan, slot_bytes, slot_plan
from kvbench.serving.allocator import Plan as StorePlan
from kvbench.serving.arrivals import make_requests, request_tokens
from kvbench.serving.conversations import Plan, make_chats
from kvbench.serving.paged import PagedStore, SlotStore, check_model
from kvbench.serving.rate_search import METRICS as SEARCH_METRICS
from kvbench.serving.rate_search import curve_rows, max_rate_under_slo, search_metrics
from kvbench.serving.record import timeline_scalars, timeline_tables
from kvbench.serving.scheduler import FakeClock, Scheduler
from kvbench.serving.tokenize import byte_ids, checkpoint_encoder
from kvbench.serving.trace import Request

Tick = Callable[..., None]

OWN_METRICS: Dict[str, Metric] = metric_table(
    Metric("kv_budget_bytes", "bytes", "the KV memory the store may hold: workload.kv_budget_mb x 1e6, or "
                                       "workload.kv_budget_blocks x the bytes of a block"),
    Metric("kv_bytes_per_token", "bytes", "the KV formula's bytes for one token of one sequence, all layers "
                                          "(the layer layouts' formula at seq_len 1)"),
    Metric("kv_store_bytes", "bytes", "K/V storage the store allocated (untyped_storage().nbytes(), all blocks)"),
    Metric("kv_block_tokens", "tokens", "positions per block of the store: cache.block_size, or, under "
           "workload.allocator=unified on a model that keeps a state, raised until one layer's block fills a page as "
           "large as one layer's state, as vLLM raises the attention block to the recurrent state's page (528 "
           "tokens for Qwen3.5); a prefix is cached in whole blocks, so a raised block caches less of a shared prefix "
           "shorter than it (prefix_hit_rate)"),
    Metric("kv_prefix_step_tokens", "tokens", "a cached prefix is continued only at a multiple of these positions: "
           "kv_block_tokens, or where a layer's pages ask more, its least common multiple with theirs (a "
           "compressed pool's rate m: an entry is never split, and its buffer is saved there); a shared prefix is "
           "found to the last such multiple within it (prefix_hit_rate)"),
    Metric("kv_store_bytes_formula", "bytes", "the layouts' formula for the store's groups: each K/V group's blocks "
                                              "x the positions a block holds (block_size; a slot store's local "
                                              "layers: a ring of W - 1 + workload.max_prefill_tokens) of its layers, "
                                              "each state page x the states "
                                              "of the recurrent layers; with workload.allocator=unified, its one "
                                              "byte pool: its pages x a page's bytes"),
    Metric("kv_reserved_bytes", "bytes", "what the allocator sets aside of the budget: per_kind, each pool's whole "
                                         "blocks x its block's bytes; unified, its pages x the page's bytes"),
    Metric("kv_allocator", "text", "workload.allocator: per_kind (a pool per group of layers) or unified (one "
                                   "pool of equal pages)"),
    Metric("kv_sequence_positions", "tokens", "the longest request's positions (prompt + output - 1): the context "
                                              "the capacity figures below are at"),
    Metric("kv_sequence_bytes_formula", "bytes", "the layouts' formula for one sequence at kv_sequence_positions "
                                                 "(the positions each layer holds, a constant state once)"),
    Metric("kv_sequences_fit_formula", "count", "kv_budget_bytes // kv_sequence_bytes_formula"),
    Metric("kv_sequence_reserved_bytes", "bytes", "what one sequence at kv_sequence_positions reserves under the "
                                                  "allocator at its worst while it decodes (block rounding, a "
                                                  "local layer's ring blocks kept whole, a state page): the plan's "
                                                  "formula"),
    Metric("kv_sequences_fit", "count", "sequences at kv_sequence_positions the allocator's pools hold at once, "
                                        "each at its worst while it decodes, beside the room one prefill chunk of "
                                        "workload.max_prefill_tokens adds to a window's ring (the scarcest pool "
                                        "decides): the plan's formula"),
    Metric("state_checkpoints_saved", "count", "recurrent states saved for prefix caching "
                                               "(workload.state_checkpoint)"),
    Metric("state_checkpoint_bytes_max", "bytes", "most bytes the saved states nobody ran from held at once "
                                                  "(cached state pages x their page's bytes)"),
    Metric("iterations", "count", "scheduler iterations (one batched decode and the prefill chunks each)"),
    Metric("timeline_rate", "requests/s", "the arrival rate of the run whose timeline the record holds: "
                                          "workload.rate, or with workload.search.enabled the search's answer (else "
                                          "the highest rate that passed, else the lowest tried)"),
    Metric("tables.serving_requests", "", "one row per request: id, arrival_s, prompt_len, output_len, prefix_id, "
                                          "prefix_len, scheduled_s (first admission), first_token_s, last_token_s, "
                                          "output_tokens, preemptions, prefix_hit_tokens, prefix_query_tokens, "
                                          "first_hit_tokens (found at the first admission), resumable_tokens "
                                          "(when it finished, the longest prefix of its positions the store could "
                                          "continue from: blocks findable, a recurrent state saved there; null "
                                          "without a prefix cache); a conversation's turn: conversation, turn"),
    Metric("tables.serving_tokens", "s", "every output token's time since the run's start (request, t_s)"),
    Metric("tables.serving_samples", "", "the scheduler after each iteration: t_s, running, waiting, "
                                         "kv_blocks_used, kv_bytes_used, kv_bytes_needed (the formula's bytes "
                                         "for the positions held)"),
)
METRICS: Dict[str, Metric] = metric_table(*serving_metrics.METRICS.values(), *OWN_METRICS.values(),
                                          *SEARCH_METRICS.values(), *SPLIT_METRICS.values())
METHODS: Dict[str, str] = record_methods(METRICS)
RECORDED = METRICS  # what a record may hold
WARMUP_REQUESTS = 2


def slot_len_for(w, requests: Sequence[Request]) -> int:
    """Positions per slot: ``workload.slot_len``, or the longest request's (prompt + output - 1:
    the last output token is never fed back)."""
    longest = max(r.prompt_len + r.output_len - 1 for r in requests)
    if w.slot_len is None:
        return longest
    if w.slot_len < longest:
        raise ConfigError(f"workload.slot_len={w.slot_len}: a request needs {longest} positions; raise it or "
                          "use workload.slot_len=null (the longest request's)")
    return w.slot_len


def store_plan(w, block_size: int, requests: Sequence[Request], layouts, element: int, cache_dtype: str) -> StorePlan:
    """The pools of the store ``w`` asks for, as many blocks (or slots) as the budget holds; a budget
    that cannot hold the largest request is a one-line :class:`ConfigError` naming its key."""
    groups = groups_of(layouts, element, cache_dtype)
    longest = max(r.prompt_len + r.output_len - 1 for r in requests)
    largest = max(requests, key=lambda r: r.prompt_len + r.output_len)
    if w.store == "slots":
        size = slot_len_for(w, requests)
        slot = sum(slot_bytes(g, size, w.max_prefill_tokens) for g in groups)
        n = w.kv_budget_blocks if w.kv_budget_blocks is not None else int(w.kv_budget_mb * 1e6 // slot)
        if n < 1:
            raise ConfigError(f"{kv_budget_note(w.kv_budget_mb, w.kv_budget_blocks)}: holds 0 slots of {size} "
                              f"positions ({slot:,} bytes each for this layout); request {largest.id} (prompt "
                              f"{largest.prompt_len} + output {largest.output_len} tokens) needs 1; raise it")
        return slot_plan(groups, size, n, w.max_prefill_tokens)
    budget = budget_bytes(w.kv_budget_mb, w.kv_budget_blocks, block_size, groups)
    plan = make_plan(groups, w.allocator, block_size, budget, longest, w.max_prefill_tokens)
    Checkpoint(w.state_checkpoint, w.state_checkpoint_tokens).check(plan.block_size, w.allocator)
    for g, (pages, need) in enumerate(zip(plan.pages, plan.need(longest, w.max_prefill_tokens))):
        if need > pages:
            unit = _unit(plan, g)
            raise ConfigError(f"{kv_budget_note(w.kv_budget_mb, w.kv_budget_blocks)}: holds {pages} {unit}; request "
                              f"{largest.id} (prompt {largest.prompt_len} + output {largest.output_len} tokens) "
                              f"needs {need}; raise it")
    return plan


def sequence_capacity(plan: StorePlan, layouts, element: int, cache_dtype: str, requests: Sequence[Request],
                      budget: float) -> Dict:
    """How many sequences at the longest request's positions fit ``budget``, by the layouts' formula
    and by the allocator's plan."""
    length = max(r.prompt_len + r.output_len - 1 for r in requests)
    formula = layouts.cache_bytes(length, 1, element, cache_dtype)
    return {"kv_sequence_positions": length, "kv_sequence_bytes_formula": formula,
            "kv_sequences_fit_formula": int(budget // formula) if formula else None,
            "kv_sequence_reserved_bytes": plan.worst_sequence_bytes(length),
            "kv_sequences_fit": plan.sequences_fit(length)}


def _unit(plan: StorePlan, g: int) -> str:
    """What pool ``g`` of ``plan`` counts, for error lines."""
    if plan.allocator == "unified":
        return (f"pages ({plan.page_bytes[0] // plan.cost[0]:,} bytes each: one layer's block of {plan.block_size} "
                "tokens or one layer's state)")
    spec = plan.groups[g].spec
    where = "" if len(plan.groups) == 1 else f" of its {spec.layers_text()}"
    return f"{spec.unit(plan.block_size)} ({plan.page_bytes[g]:,} bytes each for this layout{where})"


def build_store(model, w, block_size: int, requests: Sequence[Request], cache_dtype: str = "auto") -> PagedStore:
    """The store ``w`` asks for (:func:`store_plan`) on ``model``."""
    plan = store_plan(w, block_size, requests, model.layouts, model.dtype.itemsize, cache_dtype)
    if w.store == "slots":
        return SlotStore(model, plan.pages[0], plan.block_size, cache_dtype, w.max_prefill_tokens)
    return PagedStore(model, 0, block_size, w.prefix_caching, cache_dtype, plan,
                      Checkpoint(w.state_checkpoint, w.state_checkpoint_tokens))


def check_requests(cfg: BenchConfig) -> List[Request]:
    """The run's requests (a conversation's every turn), checked against the model's config and the
    KV budget before anything is built or any progress shown."""
    requests = _checked_plan(cfg, cfg.workload).requests
    store_plan(cfg.workload, cfg.cache.block_size, requests,
               build_layouts(cfg.model, cfg.attention, cfg.cache.state_dtype), DTYPE_BYTES[cfg.runtime.dtype],
               cfg.cache.dtype)
    return requests


def _plan(cfg: BenchConfig, w) -> Plan:
    """What ``w`` serves: its requests and their prompts; a conversation's later turns are
    released as the run goes (:mod:`kvbench.serving.conversations`)."""
    if w.name == "conversations":
        return make_chats(w, cfg.model.vocab_size, checkpoint_encoder(cfg.model.path) or byte_ids).plan()
    requests = make_requests(w)
    return Plan(requests, requests, [request_tokens(r, cfg.model.vocab_size, w.seed) for r in requests])


def _checked_plan(cfg: BenchConfig, w) -> Plan:
    plan = _plan(cfg, w)
    longest = max(plan.requests, key=lambda r: r.prompt_len + r.output_len)
    if longest.prompt_len + longest.output_len > cfg.model.max_seq_len:
        key = ("workload.trace" if w.arrival == "trace" else "workload.sharegpt" if getattr(w, "sharegpt", None)
               else "workload.prompt")
        what = f"request {longest.id}" if longest.conversation is None else \
            f"conversation {longest.conversation}'s turn {longest.turn} (its whole history)"
        raise ConfigError(f"{key}: {what} needs {longest.prompt_len} + {longest.output_len} positions, "
                          f"more than model.max_seq_len={cfg.model.max_seq_len}")
    return plan


def arrival_note(requests: Sequence[Request]) -> str:
    """`` (arrivals over ~12 min)`` when the requests arrive over a minute or more, so that a run
    that waits for them says so as it starts; empty otherwise."""
    span = max(r.arrival_s for r in requests)
    return f" (arrivals over ~{duration_text(span)})" if span >= 60 else ""


def requests_and_prompts(cfg: BenchConfig, rate: Optional[float] = None) -> tuple[List[Request], List[List[int]]]:
    """The run's first requests at ``rate`` and their prompt token ids. The same seed at another rate
    gives the same requests with every gap scaled (numpy draws gaps as scale x a standard draw)."""
    plan = plan_at(cfg, rate)
    return plan.arrivals, plan.prompts


def plan_at(cfg: BenchConfig, rate: Optional[float] = None) -> Plan:
    """The :class:`~kvbench.serving.conversations.Plan` of the run at ``rate`` (default ``workload.rate``)."""
    return _checked_plan(cfg, cfg.workload if rate is None else replace(cfg.workload, rate=rate))


def progress_total(cfg: BenchConfig, requests: Sequence[Request]) -> int:
    """Ticks a run of ``requests`` gives: one per finished request (a rate search: of every probe, at most)."""
    probes = cfg.workload.search.max_probes if cfg.workload.search.enabled else 1
    return probes * len(requests)


def warm_up(model, cfg: BenchConfig, requests: Sequence[Request], prompts: Sequence[List[int]]) -> None:
    """Serve the first requests untimed on a scratch store (a fake clock: nothing waits)."""
    first = [replace(r, arrival_s=0.0) for r in requests[:WARMUP_REQUESTS]]
    blocks = sum(-(-(r.prompt_len + r.output_len) // cfg.cache.block_size) for r in first)
    for _ in range(cfg.runtime.warmup):
        for _ in range(64):  # the least doubling of the budget in blocks whose every pool holds the first requests
            w = replace(cfg.workload, kv_budget_mb=None, kv_budget_blocks=blocks, prefix_caching=False, slot_len=None)
            try:
                store = build_store(model, w, cfg.cache.block_size, first, cfg.cache.dtype)
                break
            except ConfigError:
                if blocks > 2**40:
                    raise
                blocks *= 2
        Scheduler(model, store, first, prompts[:WARMUP_REQUESTS], cfg.workload.max_prefill_tokens,
                  cfg.workload.max_running, FakeClock()).run()


def serve_at(cfg: BenchConfig, model, rate: Optional[float] = None, progress=None) -> tuple:
    """One serving run at ``rate`` (default ``workload.rate``) on a fresh store: (scheduler, timeline, store)."""
    w = cfg.workload
    plan = plan_at(cfg, rate)
    store = build_store(model, w, cfg.cache.block_size, plan.requests, cfg.cache.dtype)
    scheduler = Scheduler(model, store, plan.arrivals, plan.prompts, w.max_prefill_tokens, w.max_running,
                          progress=progress, follow=plan.follow)
    return scheduler, scheduler.run(), store


def run(cfg: BenchConfig, model, device: torch.device, result: RunResult, tick: Optional[Tick] = None) -> None:
    """Serve the arrivals (at ``workload.rate``, or at each rate of a rate search) and record the
    timeline and its metrics."""
    w, metrics = cfg.workload, result.metrics
    result.methods.update(METHODS)
    check_model(model, cfg.cache.dtype)
    plan = plan_at(cfg)
    # checked before the build (check_requests)
    store = build_store(model, w, cfg.cache.block_size, plan.requests, cfg.cache.dtype)
    budget = budget_bytes(w.kv_budget_mb, w.kv_budget_blocks, cfg.cache.block_size, store.plan.groups)
    metrics.update(kv_budget_bytes=int(budget),
                   kv_store_bytes=store.nbytes, kv_store_bytes_formula=store.storage_bytes,
                   kv_reserved_bytes=store.plan.reserved_bytes, kv_allocator=store.plan.allocator,
                   kv_block_tokens=store.plan.block_size, kv_prefix_step_tokens=store.prefix_step)
    metrics.update(sequence_capacity(store.plan, model.layouts, model.dtype.itemsize,
                                     cfg.cache.dtype, plan.requests, budget))
    # under runtime.tensor_parallel / expert_parallel, a GPU's part by formula, the KV budget each GPU's
    metrics.update(job_split_metrics(cfg, metrics["kv_sequence_positions"], int(budget), less_weights=False))
    del store
    warm_up(model, cfg, plan.arrivals, plan.prompts)
    progress = (lambda: tick()) if tick is not None else None
    runs: Dict[float, tuple] = {}
    if w.search.enabled:
        def measure(rate: float) -> Dict:
            runs[rate] = serve_at(cfg, model, rate, progress)[:2]
            return serving_metrics.timeline_metrics(runs[rate][1], cfg.slo, intervals=False)

        s = w.search
        search = max_rate_under_slo(measure, cfg.slo, s.lo, s.hi, s.growth, s.rel_tol, s.max_probes, s.check_above)
        result.tables["serving_rate_curve"] = curve_rows(search)
        metrics.update(search_metrics(search))
        rate = search.max_rate or search.at_least or s.lo
        scheduler, timeline = runs[rate]
    else:
        rate = w.rate
        scheduler, timeline, _ = serve_at(cfg, model, None, progress)
    metrics["timeline_rate"] = rate
    metrics["iterations"] = scheduler.iterations
    store = scheduler.store
    if store.saves_states:
        metrics.update(state_checkpoints_saved=store.checkpoints_saved,
                       state_checkpoint_bytes_max=store.checkpoint_bytes_max)
    metrics.update(timeline_scalars(timeline))
    result.tables.update(timeline_tables(timeline))
    metrics.update(serving_metrics.timeline_metrics(timeline, cfg.slo))
    result.series.update(serving_metrics.timeline_series(timeline))
