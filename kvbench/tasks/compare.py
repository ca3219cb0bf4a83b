"""``task=compare``: the interleaved comparison: attention variants of one model timed in one
process, alternating trial by trial, so that whatever the machine does meanwhile (another job, a
clock change) falls on every variant alike and their ratios can be paired round by round.

The variants share weights: the first is built from the seeded model with one KV head per query
head (MHA), every other by :func:`~kvbench.checkpoint.convert_kv_heads` from it (mean-pooled to
fewer KV heads), so only the K/V projections and the cache differ between them.

A trial is one variant's pass over ``compare.contexts``: at each context C, ``compare.steps``
decode steps at position C (the static cache filled to C by one prefill per variant, rolled back
to C before each step), so no step depends on the thousands of decode steps it would take to
get there. A round is one trial of every variant, in alternating order (ABC, CBA, ABC ...); the
order is recorded in ``tables.trials``. Each (round, variant, context) is summarised by the median
of its steps; the statistics of :mod:`kvbench.measure.stats` then run over rounds.

Notation: B batch, C context (positions in the cache when a step runs), H query heads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from kvbench.cache import cache_for, kv_cache_bytes
from kvbench.checkpoint import convert_kv_heads
from kvbench.config import DTYPE_BYTES, BenchConfig
from kvbench.generate import decode_step, prefill
from kvbench.measure import stats
from kvbench.measure.timing import RegionTimer, timing_method
from kvbench.metrics import Metric, metric_table, record_methods
from kvbench.model import Decoder
from kvbench.model_config import AttentionConfig
from kvbench.results import RunResult
from kvbench.tasks.common import JOB_METHODS, Progress, build_model

Tick = Callable[..., None]

# Units and methods of what this task reports; ``<v>`` is a variant's label (``mha_kv16``),
# ``<C>`` the longest context. Every ratio is the variant's over the first variant's.
METRICS: Dict[str, Metric] = metric_table(
    Metric("tables.trials", "", "one row per (round, turn, variant, context) in the order run: the decode step times "
                     "(ms) at that context and their median; rounds alternate the variants' order (ABC, CBA, ...)"),
    Metric("tables.compare", "",
           "one row per variant: the metrics below without the variant prefix, and step_ms_ctx<C> "
                      "(with _ci_low/_ci_high) and step_ratio_ctx<C> at every context"),
    Metric("<v>_step_ms_ctx<C>", "ms", "decode step at context C: median over rounds of each round's median step, "
                          "95% interval by bootstrap over rounds (see methods.ci_trials)"),
    Metric("<v>_decode_us_per_1k_ctx", "µs per 1,000 tokens of context",
           "the KV cost: Theil-Sen slope of the per-round "
                                "median step time against the context, over all rounds (see methods.kv_cost)"),
    Metric("<v>_decode_ms_at_ctx0", "ms",
           "the intercept of the same fit: the step without context (weights, overhead)"),
    Metric("<v>_kv_share_ctx<C>", "fraction", "slope x C / step at C: the part of the step at the longest context that "
                           "the context costs"),
    Metric("<v>_kv_bytes_per_token", "bytes",
           "K and V of one position of one sequence: 2 * layers * kv_heads * head_dim "
                              "* bytes_per_element"),
    Metric("<v>_kv_bytes_ratio", "ratio", "kv_bytes_per_token over the first variant's: the slope ratio if the KV cost "
                          "were all bytes read"),
    Metric("<v>_slope_ratio", "ratio",
           "median over rounds of the variant's per-round slope over the median of the first "
                       "variant's, paired bootstrap interval over rounds (see methods.paired_ratio); null with "
                       "fewer than 3 contexts"),
    Metric("<v>_step_ratio_ctx<C>", "ratio", "step at the longest context over the first variant's, paired over rounds "
                             "(see methods.paired_ratio)"),
    Metric("rounds", "count", "timed rounds (runtime.repeats), each one trial of every variant"),
    Metric("<v>_<metric>_ci_reason", "text", "why <v>_<metric>_ci_low/_ci_high are null: fewer rounds (or points) "
                                             "than a 95% interval needs (measure/stats.py min_interval_samples: 6), "
                                             "or a degenerate interval; null when the interval is given"),
    *(Metric(k, "", stats.METHODS[k]) for k in ("ci_trials", "kv_cost", "paired_ratio")),
)
METHODS: Dict[str, str] = record_methods(METRICS)


@dataclass
class Variant:
    """One attention variant of the comparison: its label, KV-head count and model."""

    label: str
    num_kv_heads: int
    model: Decoder


def label(attention: AttentionConfig) -> str:
    """``gqa_kv4``: the attention type and KV-head count, as metric prefixes name a variant."""
    return f"{attention.type}_kv{attention.num_kv_heads}"


def variants(cfg: BenchConfig, base: Decoder) -> List[Variant]:
    """``compare.variants`` of ``base`` (a model with one KV head per query head): ``base`` itself
    for MHA, a copy with mean-pooled K/V projections for fewer KV heads."""
    if base.num_kv_heads != base.config.num_heads:
        raise ValueError(f"the base model must be MHA ({base.config.num_heads} KV heads), has {base.num_kv_heads}")
    out = []
    for attention in cfg.compare.attentions(cfg.model):
        kv = attention.num_kv_heads
        model = base if kv == base.num_kv_heads else convert_kv_heads(base, kv).eval()
        out.append(Variant(label(attention), kv, model))
    return out


def round_order(n_variants: int, round_index: int) -> List[int]:
    """Indices of the variants in the order round ``round_index`` runs them: forward in even
    rounds, reversed in odd ones, so no variant always runs first or last."""
    order = list(range(n_variants))
    return order if round_index % 2 == 0 else order[::-1]


@torch.inference_mode()
def time_trial(model: Decoder, cache, token: torch.Tensor, contexts: Sequence[int], steps: int,
               device) -> Dict[int, List[float]]:
    """``steps`` decode steps at each context C (the cache set to hold C positions before each):
    their times in ms by context. The cache must hold the longest context already (a prefill)."""
    if max(contexts) > cache.length:
        raise ValueError(f"the cache holds {cache.length} positions, fewer than context {max(contexts)}")
    written = cache.length
    timer = RegionTimer(device)
    for c in contexts:
        for _ in range(steps):
            # Every position below ``written`` was written (by the prefill, or a step since), so the
            # length may move forward as well as back: the step reads c keys and writes the (c+1)-th.
            cache.length = c
            with timer.region(str(c)):
                decode_step(model, token, cache, c)
    cache.length = written
    return {c: timer.ms(str(c)) for c in contexts}


def run_trials(cfg: BenchConfig, base: Decoder, device: torch.device, result: RunResult,
               tick: Optional[Tick] = None) -> None:
    """Time ``compare.variants`` of ``base`` in alternating trials and write the comparison into
    ``result`` (metrics, ``tables.trials``, ``tables.compare``); metrics and units in :data:`METHODS`."""
    c, rt = cfg.compare, cfg.runtime
    B, contexts = cfg.workload.batch_size, sorted(c.contexts)
    result.methods.update(METHODS)
    runs = variants(cfg, base)
    gen = torch.Generator().manual_seed(rt.seed)
    vocab = base.config.vocab_size
    prompt = torch.randint(vocab, (B, contexts[-1]), generator=gen).to(device)
    token = torch.randint(vocab, (B, 1), generator=gen).to(device)
    caches = []
    with torch.inference_mode():
        for v in runs:  # one prefill per variant fills its cache to the longest context
            cache = cache_for(v.model, "static", B, contexts[-1] + 1)
            prefill(v.model, prompt, cache)
            caches.append(cache)
    trials = result.tables.setdefault("trials", [])
    for r in range(rt.warmup + rt.repeats):
        for turn, i in enumerate(round_order(len(runs), r - rt.warmup)):  # timed round 0 forward
            times = time_trial(runs[i].model, caches[i], token, contexts, c.steps, device)
            if r >= rt.warmup:
                trials.extend({"round": r - rt.warmup, "turn": turn, "variant": runs[i].label, "context": ctx,
                               "step_ms": stats.median(ms), "steps_ms": ms} for ctx, ms in times.items())
            if tick is not None:
                tick()
    dtype_bytes = DTYPE_BYTES[rt.dtype]
    per_token = {v.label: kv_cache_bytes(base.config.num_layers, v.num_kv_heads, base.config.head_dim, 1, 1,
                                         dtype_bytes) for v in runs}
    rows = summarize(trials, [v.label for v in runs], contexts, per_token)
    result.tables["compare"] = rows
    result.metrics["rounds"] = rt.repeats
    # The record's metrics: the whole rows at the longest context; the other contexts stay in the table.
    table_only = {"variant"} | {f"{name}_ctx{ctx}{end}" for name in ("step_ms", "step_ratio")
                                for ctx in contexts[:-1] for end in ("", "_ci_low", "_ci_high", "_ci_reason")}
    for row in rows:
        result.metrics.update({f"{row['variant']}_{k}": v for k, v in row.items() if k not in table_only})


def run(cfg: BenchConfig, device: torch.device, out_dir: Path, result: RunResult, progress: Progress) -> None:
    """``task=compare``: ``compare.variants`` of one seeded MHA model (or the checkpoint, its KV
    heads repeated to MHA, exactly) in alternating trials in this process (:func:`run_trials`)."""
    result.metrics["timing_method"] = timing_method(device)
    result.methods["timing_method"] = JOB_METHODS["timing_method"]
    h = cfg.model.num_heads
    base = build_model(replace(cfg, attention=AttentionConfig.for_heads(h, h)), device)
    total = (cfg.runtime.warmup + cfg.runtime.repeats) * len(cfg.compare.variants)
    with progress("compare " + ",".join(cfg.compare.variants), total) as tick:
        run_trials(cfg, base, device, result, tick)


def per_round(trials: Sequence[Dict], variant: str, context: int) -> List[float]:
    """The per-round median steps of ``variant`` at ``context``, in round order."""
    rows = sorted((t for t in trials if t["variant"] == variant and t["context"] == context), key=lambda t: t["round"])
    return [t["step_ms"] for t in rows]


def summarize(trials: Sequence[Dict], labels: Sequence[str], contexts: Sequence[int],
              kv_bytes_per_token: Dict[str, int]) -> List[Dict]:
    """One row per variant from the trials table (see :data:`METHODS`): steps per context with
    intervals, the KV cost slope, and ratios to ``labels[0]`` paired over rounds."""
    longest = contexts[-1]
    # (variant, context) -> per-round medians; the rounds are the same for every variant.
    rounds = {(v, ctx): per_round(trials, v, ctx) for v in labels for ctx in contexts}
    n_rounds = len(rounds[labels[0], contexts[0]])

    def slopes(v: str) -> List[Optional[float]]:
        return [stats.kv_cost_fit(contexts, [rounds[v, ctx][r] for ctx in contexts])["us_per_1k_ctx"]
                for r in range(n_rounds)]

    base_slopes = slopes(labels[0])
    out = []
    for v in labels:
        row: Dict = {"variant": v}
        for ctx in contexts:
            fields = stats.trial_metric(f"step_ms_ctx{ctx}", rounds[v, ctx], "rounds")
            row.update({k: fields[k] for k in fields if not k.endswith(("_n", "_warning"))})
        fit = stats.kv_cost_fit([ctx for ctx in contexts for _ in range(n_rounds)],
                                [ms for ctx in contexts for ms in rounds[v, ctx]])
        row.update({"decode_us_per_1k_ctx": fit["us_per_1k_ctx"],
                    "decode_us_per_1k_ctx_ci_low": fit["us_per_1k_ctx_ci_low"],
                    "decode_us_per_1k_ctx_ci_high": fit["us_per_1k_ctx_ci_high"],
                    "decode_us_per_1k_ctx_ci_reason": fit["ci_reason"],
                    "decode_ms_at_ctx0": fit["at_ctx0_ms"],
                    f"kv_share_ctx{longest}": (None if fit["us_per_1k_ctx"] is None else
                                               fit["us_per_1k_ctx"] * longest / 1e6 / row[f"step_ms_ctx{longest}"]),
                    "kv_bytes_per_token": kv_bytes_per_token[v],
                    "kv_bytes_ratio": kv_bytes_per_token[v] / kv_bytes_per_token[labels[0]]})
        for ctx in contexts:
            ratio, low, high = stats.paired_ratio(rounds[labels[0], ctx], rounds[v, ctx])
            row.update({f"step_ratio_ctx{ctx}": ratio, f"step_ratio_ctx{ctx}_ci_low": low,
                        f"step_ratio_ctx{ctx}_ci_high": high,
                        f"step_ratio_ctx{ctx}_ci_reason": stats.paired_ratio_reason(n_rounds, ratio, low)})
        ratio = low = high = None
        mine = slopes(v)
        if None not in base_slopes and None not in mine:
            ratio, low, high = stats.paired_ratio(base_slopes, mine)
        row.update({"slope_ratio": ratio, "slope_ratio_ci_low": low, "slope_ratio_ci_high": high,
                    "slope_ratio_ci_reason": ratio and stats.paired_ratio_reason(n_rounds, ratio, low)})
        out.append(row)
    return out
