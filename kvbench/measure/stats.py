"""How samples become headline numbers: order statistics, 95% confidence intervals, sample
sufficiency, the KV cost as a slope, and paired ratios of interleaved variants. One method each,
stated in :data:`METHODS` and written into every record that uses it. Decode steps get a block
bootstrap because they are autocorrelated (a descheduled thread slows several in a row); the KV
cost a Theil-Sen fit because it is robust to preempted steps.

The rule for every interval (:func:`min_interval_samples`): a 95% interval of the ``q`` quantile
needs at least the ``n`` samples whose [min, max] covers that quantile with 95% probability (6 for a
median, 29 for p90, 299 for p99). Below it a bootstrap only echoes the few values it was given (3
trials gave a ratio of 0.8035 the interval [0.8035, 0.8068]); an interval with an end at its
estimate is degenerate the same way. Either way the interval is null and ``<name>_ci_reason`` says why.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from kvbench.metrics import Metric, record_methods

# scipy.stats is imported by the functions that use it (~1 s of CPU at import), after their checks of n:
# a kvbench process that computes no interval (task=inspect, a config error, the parent of an isolated job,
# a job of fewer trials than an interval needs) never pays for it.

CONFIDENCE = 0.95
N_RESAMPLES = 2000
SEED = 0
PERCENTILE_METHOD = "linear"

Interval = Tuple[Optional[float], Optional[float]]

METHODS: Dict[str, str] = {
    "percentiles": f"numpy percentile, method={PERCENTILE_METHOD!r} (Hyndman & Fan type 7)",
    "ci_trials": f"{CONFIDENCE:.0%} percentile bootstrap over timed trials (scipy.stats.bootstrap, "
                 f"{N_RESAMPLES} resamples, seed {SEED}); null with fewer than 2 trials",
    "ci_steps": f"{CONFIDENCE:.0%} moving-block bootstrap over decode steps within trials (blocks of "
                f"round(n^(1/3)) consecutive steps, {N_RESAMPLES} resamples, seed {SEED})",
    "kv_cost": f"Theil-Sen fit of decode step ms against the context length each step attends "
               f"(scipy.stats.theilslopes, {CONFIDENCE:.0%} interval of the slope)",
    "ci_seeds": f"{CONFIDENCE:.0%} Student t-interval of the mean over training seeds (mean +- t(n-1) s / sqrt(n), "
                f"clipped to the metric's range); null with fewer than {2} seeds. Not a bootstrap: with 3-5 "
                "seeds a percentile bootstrap has at most a few dozen distinct resamples and covers too little",
    "diff_seeds": f"difference of two means over seeds, {CONFIDENCE:.0%} Welch t-interval (unequal variances: "
                  "scipy.stats.ttest_ind(equal_var=False)); null with fewer than 2 seeds on either side",
    "solved_seeds": f"seeds that solve a condition (accuracy >= the task's threshold) of all seeds, with the "
                    f"{CONFIDENCE:.0%} Clopper-Pearson interval of the fraction of seeds that solve it (exact "
                    "binomial: scipy.stats.binomtest(k, n).proportion_ci(method='exact')), valid at any n >= 1",
    "paired_ratio": f"median(B) / median(A) over interleaved rounds, {CONFIDENCE:.0%} paired percentile "
                    f"bootstrap over rounds ({N_RESAMPLES} resamples, seed {SEED})",
}


def _array(values: Sequence[float]) -> np.ndarray:
    return np.asarray(list(values), dtype=np.float64)


def median(values: Sequence[float]) -> float:
    """The median (mean of the two middle values for an even count)."""
    return float(np.median(_array(values)))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by :data:`PERCENTILE_METHOD`."""
    return float(np.percentile(_array(values), 100 * q, method=PERCENTILE_METHOD))


def min_samples(q: float) -> int:
    """Fewest samples for which the ``q`` quantile is not just the maximum: ``ceil(1 / (1 - q))``
    above the median (p99 needs 100), ``ceil(1 / q)`` below it."""
    tail = min(q, 1 - q)
    return max(2, math.ceil(1 / tail - 1e-9)) if tail > 0 else 1


def min_interval_samples(q: float = 0.5) -> int:
    """Fewest samples a :data:`CONFIDENCE` interval of the ``q`` quantile can rest on: the least ``n``
    with ``1 - q**n - (1 - q)**n >= CONFIDENCE``, the coverage of [min, max] of ``n`` samples."""
    n = 1
    while 1 - q ** n - (1 - q) ** n < CONFIDENCE - 1e-12:
        n += 1
    return n


def interval_reason(n: int, q: float = 0.5, what: str = "samples") -> Optional[str]:
    """Why an interval of the ``q`` quantile of ``n`` samples is null, or None when it may exist."""
    need = min_interval_samples(q)
    if n < need:
        return (f"{n} {what}: a {CONFIDENCE:.0%} interval of the {q:.0%} quantile needs at least {need} "
                f"(raise runtime.repeats, the workload length or runtime.min_time_s)")
    return None


def degenerate(estimate: Optional[float], low: Optional[float], high: Optional[float], varies: bool) -> bool:
    """An interval with an end at its own estimate although the samples differ: the resamples took
    too few distinct values for it to mean anything (a BCa or percentile interval of 3 rounds)."""
    if not varies or None in (estimate, low, high):
        return False
    return low == estimate or high == estimate


def bootstrap_ci(samples: Sequence[float], statistic: Callable = np.median) -> Interval:
    """Percentile-bootstrap interval of ``statistic`` over independent samples (trials); ``(None,
    None)`` with fewer than :func:`min_interval_samples` samples."""
    x = _array(samples)
    if x.size < max(2, min_interval_samples(0.5)):
        return None, None
    if np.all(x == x[0]):
        return float(x[0]), float(x[0])
    from scipy import stats as sps

    res = sps.bootstrap((x,), lambda a, axis: statistic(a, axis=axis), n_resamples=N_RESAMPLES,
                        confidence_level=CONFIDENCE, method="percentile", vectorized=True,
                        rng=np.random.default_rng(SEED))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def block_length(steps_per_trial: int) -> int:
    return max(1, round(steps_per_trial ** (1 / 3)))


def block_starts(sizes: Sequence[int], block: int) -> np.ndarray:
    """Indices into the concatenated trials where a block of ``block`` steps may start without
    running into the next trial."""
    offsets = np.cumsum([0, *sizes[:-1]])
    parts = [off + np.arange(n - block + 1) for off, n in zip(offsets, sizes) if n >= block]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def block_bootstrap_ci(trials: Sequence[Sequence[float]], q: float, block: Optional[int] = None) -> Interval:
    """Moving-block bootstrap interval of the ``q`` quantile of all steps of all trials; a block
    (default ``round(n ** (1/3))`` steps of the shortest trial) never spans two trials."""
    series = [_array(t) for t in trials if len(t)]
    total = sum(s.size for s in series)
    if total < max(2, min_interval_samples(q)):
        return None, None
    flat = np.concatenate(series)
    if np.all(flat == flat[0]):
        return float(flat[0]), float(flat[0])
    block = block or block_length(min(s.size for s in series))
    starts = block_starts([s.size for s in series], block)
    if starts.size == 0:  # every trial shorter than a block: plain bootstrap of single steps
        starts, block = np.arange(total), 1
    rng = np.random.default_rng(SEED)
    n_blocks = math.ceil(total / block)
    stats = np.empty(N_RESAMPLES)
    chunk = max(1, 4_000_000 // (n_blocks * block))  # bound the index array's memory
    for lo in range(0, N_RESAMPLES, chunk):
        hi = min(N_RESAMPLES, lo + chunk)
        first = rng.choice(starts, size=(hi - lo, n_blocks))
        idx = (first[:, :, None] + np.arange(block)).reshape(hi - lo, -1)[:, :total]
        stats[lo:hi] = np.percentile(flat[idx], 100 * q, axis=1, method=PERCENTILE_METHOD)
    alpha = (1 - CONFIDENCE) / 2
    return float(np.quantile(stats, alpha)), float(np.quantile(stats, 1 - alpha))


def kv_cost_fit(context: Sequence[float], step_ms: Sequence[float]) -> Dict[str, Optional[float]]:
    """Theil-Sen fit of step time against context length: ``at_ctx0_ms`` and ``us_per_1k_ctx`` with
    the slope's interval; None with fewer than 3 distinct context lengths."""
    x, y = _array(context), _array(step_ms)
    out: Dict[str, Optional[float]] = {"at_ctx0_ms": None, "us_per_1k_ctx": None, "us_per_1k_ctx_ci_low": None,
                                       "us_per_1k_ctx_ci_high": None, "n": int(x.size), "ci_reason": None}
    if np.unique(x).size < 3:
        return out
    from scipy import stats as sps

    res = sps.theilslopes(y, x, alpha=CONFIDENCE)
    per_1k = 1e6  # ms per position -> µs per 1,000 positions
    out.update(at_ctx0_ms=float(res.intercept), us_per_1k_ctx=float(res.slope) * per_1k)
    out["ci_reason"] = interval_reason(int(x.size), 0.5, "points")
    if out["ci_reason"] is None:
        low, high = float(res.low_slope) * per_1k, float(res.high_slope) * per_1k
        if degenerate(out["us_per_1k_ctx"], low, high, bool(np.unique(y).size > 1)):
            out["ci_reason"] = "degenerate interval (an end at the estimate): too few distinct slopes"
        else:
            out.update(us_per_1k_ctx_ci_low=low, us_per_1k_ctx_ci_high=high)
    return out


def preload() -> None:
    """Import what the intervals import on first use (scipy.stats: 61 MiB of resident set), so that a
    memory baseline taken after this does not count it against the first span measured after the
    first interval (issue 59: every capacity probe after the first paired TPOT counted it)."""
    from scipy import stats  # noqa: F401


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> Tuple[float, Optional[float], Optional[float]]:
    """``median(b) / median(a)`` over paired rounds and its paired-bootstrap interval."""
    x, y = _array(a), _array(b)
    if x.size != y.size or x.size == 0:
        raise ValueError(f"paired samples must have the same, non-zero length: {x.size} vs {y.size}")
    ratio = float(np.median(y) / np.median(x))
    if interval_reason(int(x.size)) is not None or x.size < 2:
        return ratio, None, None
    from scipy import stats as sps

    def stat(xa, yb, axis):
        return np.median(yb, axis=axis) / np.median(xa, axis=axis)

    res = sps.bootstrap((x, y), stat, paired=True, n_resamples=N_RESAMPLES, confidence_level=CONFIDENCE,
                        method="percentile", vectorized=True, rng=np.random.default_rng(SEED))
    low, high = (None if math.isnan(v) else float(v) for v in res.confidence_interval)
    if degenerate(ratio, low, high, bool(np.unique(y / x).size > 1)):
        return ratio, None, None
    return ratio, low, high


def paired_ratio_reason(n_rounds: int, ratio: float, low: Optional[float]) -> Optional[str]:
    """Why :func:`paired_ratio` gave no interval (None when it gave one)."""
    if low is not None:
        return None
    return interval_reason(n_rounds, 0.5, "rounds") or "degenerate interval (an end at the estimate)"


MIN_SEEDS = 2  # a t-interval needs a standard deviation


def t_interval(samples: Sequence[float], bounds: Tuple[float, float] = (-math.inf, math.inf)) -> Interval:
    """Student t-interval of the mean of ``samples`` (independent seeds), clipped to ``bounds``."""
    x = _array(samples)
    if x.size < MIN_SEEDS:
        return None, None
    from scipy import stats as sps

    half = float(sps.t.ppf(0.5 + CONFIDENCE / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
    mean = float(x.mean())
    return max(bounds[0], mean - half), min(bounds[1], mean + half)


def welch_interval(a: Sequence[float], b: Sequence[float]) -> Tuple[float, Optional[float], Optional[float]]:
    """``mean(b) - mean(a)`` and its Welch t-interval."""
    x, y = _array(a), _array(b)
    diff = float(y.mean() - x.mean())
    if min(x.size, y.size) < MIN_SEEDS:
        return diff, None, None
    if x.std() == 0 and y.std() == 0:
        return diff, diff, diff
    from scipy import stats as sps

    ci = sps.ttest_ind(y, x, equal_var=False).confidence_interval(CONFIDENCE)
    return diff, float(ci.low), float(ci.high)


def proportion_interval(k: int, n: int) -> Interval:
    """Clopper-Pearson (exact binomial) interval of ``k / n``: valid at any ``n`` (1 of 1 gives
    [0.025, 1])."""
    if n < 1:
        return None, None
    from scipy import stats as sps

    ci = sps.binomtest(k, n).proportion_ci(CONFIDENCE, method="exact")
    return float(ci.low), float(ci.high)


# A training seed "solves" a task at this accuracy. MQAR is learnt in a jump (the loss sits near
# ln(values), then falls to ~0 within a few dozen steps), so a seed's accuracy is near 1 or well
# short of it, and the count of seeds past the jump reads such a split sample honestly.
SOLVED_AT = 0.9


def seed_summary(per_seed: Sequence[float]) -> Dict[str, Optional[float]]:
    """An accuracy over training seeds: its mean with the t-interval, and the seeds that solved it
    (>= SOLVED_AT) with the Clopper-Pearson interval of their fraction."""
    low, high = t_interval(per_seed, (0.0, 1.0))
    n = len(per_seed)
    solved = sum(acc >= SOLVED_AT for acc in per_seed)
    solved_low, solved_high = proportion_interval(solved, n)
    return {"accuracy": sum(per_seed) / n, "ci_low": low, "ci_high": high, "seeds": n, "solved": solved,
            "solved_rate": solved / n, "solved_rate_ci_low": solved_low, "solved_rate_ci_high": solved_high}


def overlap(a: Interval, b: Interval) -> Optional[bool]:
    """Whether two intervals overlap (None when either is unknown): overlapping intervals mean the
    difference is not significant at this confidence."""
    if None in (*a, *b):
        return None
    return a[0] <= b[1] and b[0] <= a[1]


# ---- record metrics -----------------------------------------------------------------------------
# How a workload turns its samples into record fields: the statistic, its interval, its sample
# count and, when the count is too small for the quantile, a warning that says so.

STEP_QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
STEP_CI = ("p50", "p99")  # the step quantiles that get an interval (each a block bootstrap)


def _sufficiency(name: str, q: float, n: int) -> Dict[str, Optional[object]]:
    """``<name>_n`` and, when ``n`` is below :func:`min_samples`, ``<name>_warning``."""
    out: Dict[str, Optional[object]] = {f"{name}_n": n}
    need = min_samples(q)
    if n < need:
        out[f"{name}_warning"] = (f"{name} from {n} sample{'s' if n != 1 else ''}: the {q:.0%} quantile needs "
                                  f"at least {need} (raise runtime.repeats, workload length or runtime.min_time_s)")
    return out


def trial_metric(name: str, per_trial: Sequence[float], what: str = "timed trials") -> Dict[str, Optional[object]]:
    """``name``: the median over timed trials, its bootstrap interval, the trial count and warning."""
    low, high = bootstrap_ci(per_trial)
    estimate = median(per_trial)
    reason = interval_reason(len(per_trial), 0.5, what)
    if reason is None and degenerate(estimate, low, high, len(set(per_trial)) > 1):
        low = high = None
        reason = "degenerate interval (an end at the estimate)"
    return {name: estimate, f"{name}_ci_low": low, f"{name}_ci_high": high, f"{name}_ci_reason": reason,
            **_sufficiency(name, 0.5, len(per_trial))}


def step_metrics(trials: Sequence[Sequence[float]], prefix: str = "decode_ms") -> Dict[str, Optional[object]]:
    """Quantiles and the mean of every step of every trial, with intervals for :data:`STEP_CI`."""
    steps = [ms for trial in trials for ms in trial]
    out: Dict[str, Optional[object]] = {}
    for tag, q in STEP_QUANTILES.items():
        name = f"{prefix}_{tag}"
        out[name] = percentile(steps, q)
        if tag in STEP_CI:
            low, high = block_bootstrap_ci(trials, q)
            reason = interval_reason(len(steps), q, "decode steps")
            if reason is None and degenerate(out[name], low, high, len(set(steps)) > 1):
                low = high = None
                reason = "degenerate interval (an end at the estimate)"
            out[f"{name}_ci_low"], out[f"{name}_ci_high"], out[f"{name}_ci_reason"] = low, high, reason
        out.update(_sufficiency(name, q, len(steps)))
    out[f"{prefix}_mean"] = float(np.mean(_array(steps)))
    return out


def _interval_metrics(name: str, unit: str, method: str) -> List[Metric]:
    return [Metric(f"{name}_ci_low", unit, f"low end of the {CONFIDENCE:.0%} interval of {name}: {METHODS[method]}"),
            Metric(f"{name}_ci_high", unit, f"high end of the {CONFIDENCE:.0%} interval of {name} (as {name}_ci_low)"),
            Metric(f"{name}_ci_reason", "text", f"why {name}_ci_low/_ci_high are null: fewer samples than the "
                                                "interval needs (measure/stats.py min_interval_samples) or a "
                                                "degenerate interval; null when the interval is given")]


def _count_metrics(name: str, what: str, q: float) -> List[Metric]:
    return [Metric(f"{name}_n", "count", f"{what} {name} is computed from"),
            Metric(f"{name}_warning", "text", f"present when {name}_n < {min_samples(q)} (too few samples for the "
                                              f"{q:.0%} quantile to be more than an extreme value)")]


def trial_metric_metrics(name: str, unit: str) -> List[Metric]:
    """The fields :func:`trial_metric` adds beside ``name``."""
    return [*_interval_metrics(name, unit, "ci_trials"), *_count_metrics(name, "timed trials", 0.5)]


def step_metric_metrics(prefix: str = "decode_ms") -> List[Metric]:
    """The fields :func:`step_metrics` adds beside the quantiles."""
    out: List[Metric] = []
    for tag, q in STEP_QUANTILES.items():
        name = f"{prefix}_{tag}"
        if tag in STEP_CI:
            out += _interval_metrics(name, "ms", "ci_steps")
        out += _count_metrics(name, "decode steps (all timed trials)", q)
    return out


def trial_metric_methods(name: str, unit: str) -> Dict[str, str]:
    """Methods of the fields :func:`trial_metric` adds beside ``name``."""
    return record_methods(trial_metric_metrics(name, unit))


def step_metric_methods(prefix: str = "decode_ms") -> Dict[str, str]:
    """Methods of the fields :func:`step_metrics` adds beside the quantiles."""
    return record_methods(step_metric_metrics(prefix))


def step_rate(steps: Dict[str, Optional[object]], batch_size: int, prefix: str = "decode_ms",
              name: str = "tokens_per_s") -> Dict[str, Optional[object]]:
    """Tokens per second from :func:`step_metrics`' output, so the two can never disagree (a median
    over whole trials would let one stalled trial of three halve tokens/s while the median step
    moved 8 %)."""
    p50, mean = steps[f"{prefix}_p50"], steps[f"{prefix}_mean"]
    low, high = steps.get(f"{prefix}_p50_ci_low"), steps.get(f"{prefix}_p50_ci_high")
    rate = (lambda ms: batch_size * 1e3 / ms if ms else None)  # noqa: E731 — one formula, three uses
    return {name: rate(p50), f"{name}_ci_low": rate(high), f"{name}_ci_high": rate(low),
            f"{name}_ci_reason": steps.get(f"{prefix}_p50_ci_reason"), f"{name}_n": steps.get(f"{prefix}_p50_n"),
            f"{name}_mean": rate(mean)}


def step_rate_metrics(prefix: str = "decode_ms", name: str = "tokens_per_s") -> List[Metric]:
    """The fields :func:`step_rate` reports."""
    return [Metric(name, "tokens/s", f"batch_size x 1000 / {prefix}_p50: the rate at the median decode step"),
            Metric(f"{name}_ci_low", "tokens/s", f"batch_size x 1000 / {prefix}_p50_ci_high (the median step's "
                                                 "interval, inverted)"),
            Metric(f"{name}_ci_high", "tokens/s", f"batch_size x 1000 / {prefix}_p50_ci_low"),
            Metric(f"{name}_ci_reason", "text", f"as {prefix}_p50_ci_reason"),
            Metric(f"{name}_n", "count", f"decode steps behind {prefix}_p50"),
            Metric(f"{name}_mean", "tokens/s", f"batch_size x 1000 / {prefix}_mean: every generated token over all "
                                               "decode time, stalls included")]


def step_rate_methods(prefix: str = "decode_ms", name: str = "tokens_per_s") -> Dict[str, str]:
    """Methods of the fields :func:`step_rate` reports."""
    return record_methods(step_rate_metrics(prefix, name))
