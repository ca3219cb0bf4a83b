"""``task=compare``: the interleaved comparison: attention variants of one model timed in one
process, alternating trial by trial, so that whatever the machine does meanwhile (another job, a
clock change) falls on every variant alike and their ratios can be paired round by round.

The variants share weights: one seeded model with one KV head per query head (MHA) is the source,
and every variant holds its embedding, norms, MLPs and LM head (the same tensors, not copies); a
variant with fewer KV heads has K/V projections mean-pooled from it
(:func:`~kvbench.checkpoint.convert_kv_heads`), a windowed one (``mha:w1024:g6``) the projections
of its head count (a window is only a mask and a ring cache), and a variant of another kind
(``mla``) its projections drawn from the seed (there is no conversion from MHA to it), so only
attention and cache differ between them.

A windowed variant's cache holds a ring of W positions per local layer; a step at context C reads
min(C + 1, W) keys there and C + 1 in a global layer, as a real step at C does (the ring's slots
hold other positions after the roll back, which a step's cost does not depend on). Its KV cost is
then fitted below and past W as well (``_below_w``, ``_past_w``): past W only the global layers
still grow, so the slope flattens to their share, which the KV formula gives beside it.

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
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from kvbench.cache import cache_for
from kvbench.checkpoint import build_decoder, convert_kv_heads, kv_conversion, with_layer_pattern
from kvbench.config.bench import BenchConfig
from kvbench.config.layer_pattern import variant_key, variant_label
from kvbench.config.model import AttentionConfig
from kvbench.core.dtypes import DTYPE_BYTES
from kvbench.generate import decode_step, prefill
from kvbench.layouts.build import build_layouts
from kvbench.layouts.kinds import layer_kind, recurrent_layer_types
from kvbench.measure import stats
from kvbench.measure.timing import RegionTimer, timing_method
from kvbench.metrics import Metric, metric_table, record_methods
from kvbench.model import Decoder
from kvbench.progress import Progress
from kvbench.results import RunResult
from kvbench.tasks.common import JOB_METHODS, JOB_METRICS, build_model

Tick = Callable[..., None]

# Units and methods of what this task reports; ``<v>`` is a variant's label (``mha_kv16``,
# ``mla_r256``, ``mha_kv16_w1024_5to1``: config.model.variant_key), ``<C>`` the longest context.
# Every ratio is the variant's over the first variant's.
METRICS: Dict[str, Metric] = metric_table(
    Metric("tables.trials", "", "one row per (round, turn, variant, context) in the order run: the decode step times "
                     "(ms) at that context and their median; rounds alternate the variants' order (ABC, CBA, ...)"),
    Metric("tables.compare", "",
           "one row per variant: the metrics below without the variant prefix, step_ms_ctx<C> "
                      "(with _ci_low/_ci_high), step_ratio_ctx<C> and kv_bytes_ctx<C> at every context, layout "
                      "(the variant's name in tables and plots: config.model.variant_label) and weights (how its "
                      "attention weights relate to the MHA model's: mha's, K/V mean-pooled from mha's, or drawn "
                      "from runtime.seed for MLA)"),
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
           "what the cache stores for one position of one sequence in every layer "
                              "(the layer layouts' formula at one position): 2 * layers * kv_heads * head_dim "
                              "* bytes_per_element, or MLA's layers * (kv_lora_rank + qk_rope_head_dim) * "
                              "bytes_per_element"),
    Metric("<v>_kv_bytes_ctx<C>", "bytes", "the KV formula for one sequence holding C positions (a local layer "
                                           "holds min(C, W)); the table has every context"),
    Metric("<v>_kv_state_bytes", "bytes", "what one sequence holds whatever its context (each recurrent layer's "
                                          "state and convolution tail; 0 for K/V layers), inside kv_bytes_ctx<C>"),
    Metric("<v>_kv_bytes_per_1k_ctx", "bytes per 1,000 tokens of context",
           "what the KV formula adds per 1,000 positions from the shortest context to the longest: the bytes "
           "beside the time slope (only layers that hold positions grow; past W a local layer stops)"),
    Metric("<v>_kv_cache_bytes", "bytes", "allocated: the storage of the variant's timed cache (batch_size "
                                          "sequences, longest context + 1 positions; a ring of W per local layer)"),
    Metric("<v>_kv_cache_bytes_formula", "bytes", "the KV formula for that cache's shape"),
    Metric("<v>_kv_step_note", "text", "only where a layer's step moves more than the bytes it holds: what it moves "
                                       "and why (a K=V layer derives its keys each step), which the KV bytes ratio "
                                       "does not count"),
    Metric("<v>_kv_bytes_ratio", "ratio", "kv_bytes_ctx<C> over the first variant's at the longest context: the "
                          "slope ratio if the KV cost were all bytes read"),
    Metric("window_split_ctx", "positions", "only when a variant has a window: the smallest window W among them, "
                                            "where the _below_w and _past_w fits of every variant meet"),
    Metric("<v>_decode_us_per_1k_ctx_below_w", "µs per 1,000 tokens of context",
           "the KV cost over the contexts <= window_split_ctx only (Theil-Sen as decode_us_per_1k_ctx, "
           "with its interval; null with fewer than 3 such contexts)"),
    Metric("<v>_decode_us_per_1k_ctx_past_w", "µs per 1,000 tokens of context",
           "the same over the contexts >= window_split_ctx: a windowed variant's flattens to its global layers'"),
    Metric("<v>_kv_bytes_per_1k_ctx_below_w", "bytes per 1,000 tokens of context",
           "what the KV formula adds per 1,000 positions from the shortest context to the longest <= window_split_ctx"),
    Metric("<v>_kv_bytes_per_1k_ctx_past_w", "bytes per 1,000 tokens of context",
           "the same from the shortest context >= window_split_ctx to the longest (past W only global layers grow)"),
    Metric("<v>_slope_ratio_past_w", "ratio",
           "slope_ratio over the contexts >= window_split_ctx only: the variant's per-round slope past W over "
           "the first variant's, paired over rounds (a 5:1 hybrid against MHA: 1/6 of the bytes grow there)"),
    Metric("<v>_past_w_slope_ratio", "ratio",
           "median over rounds of the per-round slope past window_split_ctx over the median of the "
           "per-round slope below it, paired bootstrap interval over rounds; the KV formula's ratio is "
           "kv_bytes_per_1k_ctx_past_w / kv_bytes_per_1k_ctx_below_w"),
    Metric("<v>_slope_ratio", "ratio",
           "median over rounds of the variant's per-round slope over the median of the first "
                       "variant's, paired bootstrap interval over rounds (see methods.paired_ratio); null with "
                       "fewer than 3 contexts"),
    Metric("<v>_step_ratio_ctx<C>", "ratio", "step at the longest context over the first variant's, paired over rounds "
                             "(see methods.paired_ratio)"),
    Metric("rounds", "count", "timed rounds (runtime.repeats), each one trial of every variant; in an interrupted "
                              "record, the rounds complete by then, which every figure is over (partial)"),
    Metric("partial", "bool", "only in an interrupted record: true when it keeps the figures of the rounds "
                              "complete before the interruption (rounds says how many)"),
    Metric("partial_reason", "text", "how many of the planned rounds the partial figures are over"),
    Metric("<v>_<metric>_ci_reason", "text", "why <v>_<metric>_ci_low/_ci_high are null: fewer rounds (or points) "
                                             "than a 95% interval needs (measure/stats.py min_interval_samples: 6), "
                                             "or a degenerate interval; null when the interval is given"),
    *(Metric(k, "", stats.METHODS[k]) for k in ("ci_trials", "kv_cost", "paired_ratio")),
)
METHODS: Dict[str, str] = record_methods(METRICS)

# Positions per prefill call. A signal is handled between torch ops, and a stopped job's process has
# 30 s to write its record (jobs/isolation.py GRACE_S): experiment=layouts' 4096-token prefills in one
# call were killed, record and all, by a Ctrl-C. Chunks fill the same cache (every layout continues
# from a start position, as a chat's turns do).
PREFILL_CHUNK = 512


def metrics(workload: str = "decode") -> Dict[str, Metric]:
    """Every metric a job of this task may record."""
    return {"timing_method": JOB_METRICS["timing_method"], **METRICS}



@dataclass
class VariantModel:
    """The model of one attention variant of the comparison: its label (metric prefix), attention
    config and model, and what its attention weights are (``weights``: mha's, mean-pooled from
    them, or drawn). The variant as a record names it is :class:`kvbench.sinks.views.Variant`."""

    label: str
    attention: AttentionConfig
    model: Decoder
    weights: str

    @property
    def num_kv_heads(self) -> int:
        return self.attention.num_kv_heads


def label(attention: AttentionConfig, num_layers: Optional[int] = None) -> str:
    """``gqa_kv4``, ``mla_r256``, ``mha_kv16_w1024_5to1``: :func:`variant_label` as a metric prefix."""
    return variant_key(variant_label(attention, num_layers=num_layers))


def variant_model(base: Decoder, attention: AttentionConfig, seed: int) -> Tuple[Decoder, str]:
    """``attention``'s model of ``base`` (MHA, no window) and what its attention weights are. Every
    tensor outside attention is ``base``'s own (shared, not copied); K/V projections mean-pooled for
    fewer KV heads; the attention of a variant of another kind (MLA), and a recurrent layer's, drawn
    from ``seed`` (there is no conversion to either)."""
    layouts = build_layouts(base.config, attention, base.state_dtype)
    if layouts == base.layouts:  # every layer as base's: the variant is base
        return base, "mha's"
    shared = {k: t for k, t in base.state_dict().items() if ".attn." not in k}
    recurrent = [t for t in dict.fromkeys(attention.layer_types or ()) if t in recurrent_layer_types()]
    pooled = layouts.converts_kv_heads()  # else its attention has no MHA source
    drawn = {}
    if not pooled or recurrent:
        torch.manual_seed(seed)
        with base.device:
            model = Decoder(base.config, attention, base.state_dtype)
        drawn = {k: t.to(base.dtype) for k, t in model.state_dict().items() if ".attn." in k}
        del model
    if not pooled:
        own, how = drawn, "drawn from runtime.seed (no MHA -> MLA conversion); the rest mha's"
    else:
        conversion = kv_conversion(base.num_kv_heads, attention.num_kv_heads)
        source = base if conversion == "none" else convert_kv_heads(base, attention.num_kv_heads)
        with torch.device("meta"):  # a layer that reads another's K/V has no K/V weights to keep
            kept = {k: t.shape for k, t in Decoder(base.config, attention, base.state_dtype).state_dict().items()}
        own = {k: t for k, t in source.state_dict().items() if ".attn." in k and kept.get(k) == t.shape}
        how = "mha's" if conversion == "none" else "K/V mean-pooled from mha's"
        other = [k for k in kept if ".attn." in k and k not in own]  # a layer of another shape than base's
        if other and not recurrent:  # (Gemma 4's sliding layers beside its global heads, K=V or not)
            torch.manual_seed(seed)
            with base.device:
                model = Decoder(base.config, attention, base.state_dtype)
            own.update({k: t.to(base.dtype) for k, t in model.state_dict().items() if k in other})
            how += "; the layers of another shape than mha's drawn from runtime.seed"
            del model
        if recurrent:  # the full layers' K/V as above; the recurrent layers' own weights drawn
            own = {k: own[k] if k in own and own[k].shape == t.shape else t for k, t in drawn.items()}
            how += "".join(f"; {layer_kind(attention, t).title} layers drawn from runtime.seed" for t in recurrent)
    return build_decoder(base.config, attention, {**shared, **own}, device=base.device).eval(), how


def variants(cfg: BenchConfig, base: Decoder) -> List[VariantModel]:
    """``compare.variants`` of ``base`` (a model with one KV head per query head): :func:`variant_model`
    of each. A checkpoint's own window is left out of ``base``: each variant names its own."""
    H = base.config.num_heads
    if base.num_kv_heads != H or not base.layouts.converts_kv_heads():
        raise ValueError(f"the base model must be MHA ({H} KV heads), has {variant_label(base.attention)}")
    base = with_layer_pattern(base, base.attention.without_pattern())
    return [VariantModel(label(a, cfg.model.num_layers), a, *variant_model(base, a, cfg.runtime.seed))
            for a in cfg.compare.attentions(cfg.model)]


def window_split(runs: Sequence[VariantModel]) -> Optional[int]:
    """The smallest window of any variant's local layer (None: no variant has one)."""
    return min((w for v in runs if (w := v.model.layouts.smallest_window()) is not None), default=None)


def round_order(n_variants: int, round_index: int) -> List[int]:
    """Indices of the variants in the order round ``round_index`` runs them: forward in even
    rounds, reversed in odd ones, so no variant always runs first or last."""
    order = list(range(n_variants))
    return order if round_index % 2 == 0 else order[::-1]


def held(cache, length: int) -> None:
    """Set ``cache`` to hold ``length`` positions, in each layer that keeps a length of its own too (its
    ``rewind``: a compressed pool, every entry below written), for steps whose cost alone is timed."""
    cache.length = length
    for layer in cache.layers:
        getattr(layer, "rewind", lambda _: None)(length)


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
            held(cache, c)
            with timer.region(str(c)):
                decode_step(model, token, cache, c)
    held(cache, written)
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
    tick = tick or (lambda description=None: None)
    caches = []
    with torch.inference_mode():
        for n, v in enumerate(runs, 1):  # one prefill per variant fills its cache to the longest context
            cache = cache_for(v.model, "static", B, contexts[-1] + 1)
            for start in range(0, contexts[-1], PREFILL_CHUNK):
                prefill(v.model, prompt[:, start:start + PREFILL_CHUNK], cache, start)
            caches.append(cache)
            # minutes at long contexts on a CPU: shown, so that a preset is never silent before its rounds
            tick(description=f"compare: prefill {n}/{len(runs)} ({v.label}, {contexts[-1]} positions)")
    trials = result.tables.setdefault("trials", [])
    try:
        for r in range(rt.warmup + rt.repeats):
            for turn, i in enumerate(round_order(len(runs), r - rt.warmup)):  # timed round 0 forward
                times = time_trial(runs[i].model, caches[i], token, contexts, c.steps, device)
                if r >= rt.warmup:
                    trials.extend({"round": r - rt.warmup, "turn": turn, "variant": runs[i].label, "context": ctx,
                                   "step_ms": stats.median(ms), "steps_ms": ms} for ctx, ms in times.items())
                tick(description=f"compare: warm-up {r + 1}/{rt.warmup}" if r < rt.warmup else
                     f"compare: round {r - rt.warmup + 1}/{rt.repeats}")
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM: the rounds complete by then are kept, marked partial
        done = len(trials) // (len(runs) * len(contexts))  # rounds with a row for every variant and context
        if done > 0:
            _summarize_into(result, cfg, runs, caches, [t for t in trials if t["round"] < done], done)
            result.metrics.update(partial=True, partial_reason=(
                f"interrupted after {done} of {rt.repeats} timed rounds: every figure is over those {done} "
                "rounds only (tables.trials keeps every trial measured)"))
        raise
    _summarize_into(result, cfg, runs, caches, trials, rt.repeats)


def _summarize_into(result: RunResult, cfg: BenchConfig, runs: Sequence[VariantModel], caches: Sequence,
                    trials: Sequence[Dict], n_rounds: int) -> None:
    """The comparison of ``n_rounds`` complete rounds of ``trials`` into ``result``: ``tables.compare``
    and the metrics at the longest context (see :data:`METHODS`)."""
    rt, B, contexts = cfg.runtime, cfg.workload.batch_size, sorted(cfg.compare.contexts)
    dtype_bytes = DTYPE_BYTES[rt.dtype]
    # One position, every context, and the shape the timed cache has, for one sequence unless said
    kv = {v.label: {"kv_bytes_per_token": v.model.layouts.bytes_per_token(dtype_bytes),
                    "kv_state_bytes": v.model.layouts.state_bytes(dtype_bytes),
                    **{f"kv_bytes_ctx{ctx}": v.model.layouts.cache_bytes(ctx, 1, dtype_bytes) for ctx in contexts},
                    "kv_cache_bytes": cache.nbytes,
                    "kv_cache_bytes_formula": v.model.layouts.cache_bytes(cache.max_seq_len, B, dtype_bytes),
                    **_step_note(v.model.layouts)}
          for v, cache in zip(runs, caches)}
    split = window_split(runs)
    rows = summarize(trials, [v.label for v in runs], contexts, kv, split)
    for row, v in zip(rows, runs):
        row.update(layout=variant_label(v.attention, num_layers=v.model.config.num_layers), weights=v.weights)
    result.tables["compare"] = rows
    result.metrics["rounds"] = n_rounds
    if split is not None:
        result.metrics["window_split_ctx"] = split
    # The record's metrics: the whole rows at the longest context; the other contexts stay in the table.
    table_only = {"variant", "layout", "weights"} | {f"kv_bytes_ctx{ctx}" for ctx in contexts[:-1]} | {
        f"{name}_ctx{ctx}{end}" for name in ("step_ms", "step_ratio")
        for ctx in contexts[:-1] for end in ("", "_ci_low", "_ci_high", "_ci_reason")}
    for row in rows:
        result.metrics.update({f"{row['variant']}_{k}": v for k, v in row.items() if k not in table_only})


def _step_note(layouts) -> Dict[str, str]:
    """``kv_step_note``: what a step of these layers moves beyond the bytes they hold, as each layout that
    does says it (``step_note``: a K=V layer's key pass); {} where none does, so such a record reads as before."""
    notes = sorted({note for layer in layouts if (note := getattr(layer, "step_note", ""))})
    return {"kv_step_note": "; ".join(notes)} if notes else {}


def run(cfg: BenchConfig, device: torch.device, out_dir: Path, result: RunResult, progress: Progress) -> None:
    """``task=compare``: ``compare.variants`` of one seeded MHA model, every layer full attention
    (or the checkpoint, its KV heads repeated to MHA, exactly, its own window left out; its Gated
    DeltaNet layers, if any, cannot be: refused) in alternating trials in this process
    (:func:`run_trials`)."""
    result.metrics["timing_method"] = timing_method(device)
    result.methods["timing_method"] = JOB_METHODS["timing_method"]
    h = cfg.model.num_heads
    base = build_model(replace(cfg, attention=AttentionConfig.for_heads(h, h).without_pattern()), device)
    # a tick per variant's prefill, then one per trial (a variant's pass over the contexts)
    total = (1 + cfg.runtime.warmup + cfg.runtime.repeats) * len(cfg.compare.variants)
    with progress("compare " + ",".join(cfg.compare.variants), total) as tick:
        run_trials(cfg, base, device, result, tick)


def per_round(trials: Sequence[Dict], variant: str, context: int) -> List[float]:
    """The per-round median steps of ``variant`` at ``context``, in round order."""
    rows = sorted((t for t in trials if t["variant"] == variant and t["context"] == context), key=lambda t: t["round"])
    return [t["step_ms"] for t in rows]


def _fit_fields(rounds: Dict, v: str, contexts: Sequence[int], n_rounds: int, suffix: str = "") -> Dict:
    """The KV cost fit of ``v`` over ``contexts`` (all rounds' points), as row fields."""
    fit = stats.kv_cost_fit([ctx for ctx in contexts for _ in range(n_rounds)],
                            [ms for ctx in contexts for ms in rounds[v, ctx]])
    name = f"decode_us_per_1k_ctx{suffix}"
    return {name: fit["us_per_1k_ctx"], f"{name}_ci_low": fit["us_per_1k_ctx_ci_low"],
            f"{name}_ci_high": fit["us_per_1k_ctx_ci_high"],
            f"{name}_ci_reason": fit["ci_reason"] if fit["us_per_1k_ctx"] is not None
            else f"fewer than 3 contexts ({len(contexts)}) to fit"}


def _paired(name: str, a: List[Optional[float]], b: List[Optional[float]], n_rounds: int) -> Dict:
    """``name``: median(b) / median(a) paired over rounds, with its interval (null where a round
    has no value, or a side has no fit: a window past every context leaves none past it)."""
    ratio = low = high = None
    if a and b and None not in a and None not in b:
        ratio, low, high = stats.paired_ratio(a, b)
    return {name: ratio, f"{name}_ci_low": low, f"{name}_ci_high": high,
            f"{name}_ci_reason": ratio and stats.paired_ratio_reason(n_rounds, ratio, low)}


def summarize(trials: Sequence[Dict], labels: Sequence[str], contexts: Sequence[int],
              kv: Dict[str, Dict[str, int]], split: Optional[int] = None) -> List[Dict]:
    """One row per variant from the trials table (see :data:`METHODS`): steps per context with
    intervals, the KV cost slope, and ratios to ``labels[0]`` paired over rounds; ``kv``: each
    variant's KV formula fields (``kv_bytes_per_token``, ``kv_bytes_ctx<C>``, ...), copied into its
    row. ``split`` (a window W): the slope below and past it too, and what the formula adds there."""
    longest = contexts[-1]
    # (variant, context) -> per-round medians; the rounds are the same for every variant.
    rounds = {(v, ctx): per_round(trials, v, ctx) for v in labels for ctx in contexts}
    n_rounds = len(rounds[labels[0], contexts[0]])
    below = [ctx for ctx in contexts if split is not None and ctx <= split]
    past = [ctx for ctx in contexts if split is not None and ctx >= split]

    def slopes(v: str, over: Sequence[int]) -> List[Optional[float]]:
        return [stats.kv_cost_fit(over, [rounds[v, ctx][r] for ctx in over])["us_per_1k_ctx"]
                for r in range(n_rounds)]

    def bytes_per_1k(v: str, start: int, end: int) -> Optional[float]:
        if end <= start:
            return None
        return (kv[v][f"kv_bytes_ctx{end}"] - kv[v][f"kv_bytes_ctx{start}"]) / (end - start) * 1e3

    base_slopes = slopes(labels[0], contexts)
    bytes_key = f"kv_bytes_ctx{longest}" if f"kv_bytes_ctx{longest}" in kv[labels[0]] else "kv_bytes_per_token"
    out = []
    for v in labels:
        row: Dict = {"variant": v}
        for ctx in contexts:
            fields = stats.trial_metric(f"step_ms_ctx{ctx}", rounds[v, ctx], "rounds")
            row.update({k: fields[k] for k in fields if not k.endswith(("_n", "_warning"))})
        row.update(_fit_fields(rounds, v, contexts, n_rounds))
        fit = stats.kv_cost_fit([ctx for ctx in contexts for _ in range(n_rounds)],
                                [ms for ctx in contexts for ms in rounds[v, ctx]])
        slope = row["decode_us_per_1k_ctx"]
        row.update({"decode_ms_at_ctx0": fit["at_ctx0_ms"],
                    f"kv_share_ctx{longest}": (None if slope is None else
                                               slope * longest / 1e6 / row[f"step_ms_ctx{longest}"]),
                    **kv[v], "kv_bytes_ratio": kv[v][bytes_key] / kv[labels[0]][bytes_key]})
        if f"kv_bytes_ctx{contexts[0]}" in kv[v]:
            row["kv_bytes_per_1k_ctx"] = bytes_per_1k(v, contexts[0], longest)
        for ctx in contexts:
            ratio, low, high = stats.paired_ratio(rounds[labels[0], ctx], rounds[v, ctx])
            row.update({f"step_ratio_ctx{ctx}": ratio, f"step_ratio_ctx{ctx}_ci_low": low,
                        f"step_ratio_ctx{ctx}_ci_high": high,
                        f"step_ratio_ctx{ctx}_ci_reason": stats.paired_ratio_reason(n_rounds, ratio, low)})
        row.update(_paired("slope_ratio", base_slopes, slopes(v, contexts), n_rounds))
        if split is not None:
            row.update({**_fit_fields(rounds, v, below, n_rounds, "_below_w"),
                        **_fit_fields(rounds, v, past, n_rounds, "_past_w"),
                        "kv_bytes_per_1k_ctx_below_w": bytes_per_1k(v, below[0], below[-1]) if below else None,
                        "kv_bytes_per_1k_ctx_past_w": bytes_per_1k(v, past[0], longest) if past else None})
            row.update(_paired("past_w_slope_ratio", slopes(v, below) if len(below) >= 3 else [],
                               slopes(v, past) if len(past) >= 3 else [], n_rounds))
            row.update(_paired("slope_ratio_past_w", slopes(labels[0], past) if len(past) >= 3 else [],
                               slopes(v, past) if len(past) >= 3 else [], n_rounds))
        out.append(row)
    return out
