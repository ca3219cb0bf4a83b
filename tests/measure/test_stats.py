"""The statistics behind every headline number, against independent computations: order statistics
by hand, bootstrap intervals against the asymptotic theory of known distributions, the KV-cost fit
against synthetic steps with a known slope."""

import math

import numpy as np
import pytest

from kvbench.measure import stats


def by_hand_percentile(values, q):
    """Hyndman & Fan type 7, written out: h = (n - 1) q, interpolate between its neighbours."""
    x = sorted(values)
    h = (len(x) - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, len(x) - 1)
    return x[lo] + (h - lo) * (x[hi] - x[lo])


def test_the_median_of_an_even_count_is_the_mean_of_the_middle_two():
    assert stats.median([1.0, 2.0, 3.0, 10.0]) == 2.5  # torch.median said 2.0 (the lower one)
    assert stats.median([5.0, 1.0, 3.0]) == 3.0


@pytest.mark.parametrize("q", [0.5, 0.9, 0.99, 0.1])
def test_percentiles_follow_one_documented_method(q):
    values = [3.1, 0.2, 7.7, 1.5, 9.9, 4.4, 2.0, 8.8, 6.3, 5.05, 0.7]
    assert stats.percentile(values, q) == pytest.approx(by_hand_percentile(values, q), rel=1e-12)


def test_sample_sufficiency_per_percentile():
    assert stats.min_samples(0.99) == 100 and stats.min_samples(0.9) == 10 and stats.min_samples(0.5) == 2
    assert stats.min_samples(0.01) == 100


def test_bootstrap_interval_of_the_mean_matches_the_normal_theory():
    rng = np.random.default_rng(1)
    x = rng.normal(10.0, 2.0, size=400)
    low, high = stats.bootstrap_ci(x, np.mean)
    half = 1.959964 * x.std(ddof=1) / math.sqrt(x.size)  # the textbook 95% interval of a mean
    assert low < x.mean() < high
    assert (high - low) / 2 == pytest.approx(half, rel=0.12)


def test_bootstrap_interval_of_the_median_matches_its_asymptotic_width():
    rng = np.random.default_rng(2)
    x = rng.normal(0.0, 1.0, size=800)
    low, high = stats.bootstrap_ci(x)
    # sd of the sample median of a normal: sqrt(pi / 2) * sigma / sqrt(n)
    half = 1.959964 * math.sqrt(math.pi / 2) / math.sqrt(x.size)
    assert low < np.median(x) < high
    assert (high - low) / 2 == pytest.approx(half, rel=0.25)


def test_bootstrap_of_too_few_or_constant_samples():
    assert stats.bootstrap_ci([1.0]) == (None, None)
    assert stats.bootstrap_ci([2.0] * 6) == (2.0, 2.0)
    assert stats.bootstrap_ci([2.0, 2.5, 3.0]) == (None, None)  # below min_interval_samples


def ar1(n, phi, rng):
    x = np.empty(n)
    x[0] = rng.normal()
    for i in range(1, n):
        x[i] = phi * x[i - 1] + rng.normal()
    return x


def test_block_bootstrap_widens_for_autocorrelated_steps_and_not_for_independent_ones():
    rng = np.random.default_rng(3)
    iid = [rng.normal(5.0, 1.0, size=300) for _ in range(4)]
    low, high = stats.block_bootstrap_ci(iid, 0.5)
    flat = np.concatenate(iid)
    half = 1.959964 * math.sqrt(math.pi / 2) / math.sqrt(flat.size)
    assert low < np.median(flat) < high and (high - low) / 2 == pytest.approx(half, rel=0.35)
    # Slow drifts (a descheduled thread slows runs of steps): independent resampling would
    # understate the uncertainty; blocks keep runs together and the interval widens.
    correlated = [5.0 + 0.3 * ar1(300, 0.9, rng) for _ in range(4)]
    blocks = stats.block_bootstrap_ci(correlated, 0.5, block=20)
    singles = stats.block_bootstrap_ci(correlated, 0.5, block=1)
    assert blocks[1] - blocks[0] > 1.5 * (singles[1] - singles[0])


def test_blocks_never_span_two_trials():
    sizes = [7, 3, 12]
    starts = stats.block_starts(sizes, 4)
    trial_of = np.repeat(np.arange(len(sizes)), sizes)
    assert all(trial_of[s] == trial_of[s + 3] for s in starts)  # a block's first and last step: one trial
    assert len(starts) == (7 - 3) + 0 + (12 - 3)  # every legal start, the 3-step trial has none
    assert stats.block_starts([2, 2], 3).size == 0


def test_kv_cost_fit_recovers_a_known_slope_despite_preempted_steps():
    rng = np.random.default_rng(4)
    ctx = np.repeat(np.arange(512, 2560, 16), 3)
    ms = 2.0 + 0.003 * ctx + rng.normal(0, 0.05, ctx.size)  # 3 µs per position = 3000 µs per 1k
    ms[::37] += 25.0  # a few steps descheduled by other work
    fit = stats.kv_cost_fit(ctx, ms)
    assert fit["us_per_1k_ctx"] == pytest.approx(3000.0, rel=0.02)
    assert fit["us_per_1k_ctx_ci_low"] < 3000.0 < fit["us_per_1k_ctx_ci_high"]
    assert fit["at_ctx0_ms"] == pytest.approx(2.0, abs=0.1) and fit["n"] == ctx.size
    assert stats.kv_cost_fit([10, 11, 10, 11], [1, 2, 1, 2])["us_per_1k_ctx"] is None  # 2 lengths only


def test_paired_ratio_of_interleaved_rounds():
    rng = np.random.default_rng(5)
    drift = np.linspace(1.0, 3.0, 30)  # the machine slows down during the comparison
    a = drift * (1 + rng.normal(0, 0.01, 30))
    b = 0.5 * drift * (1 + rng.normal(0, 0.01, 30))
    ratio, low, high = stats.paired_ratio(a, b)
    assert ratio == pytest.approx(float(np.median(b) / np.median(a)))
    assert low < 0.5 < high and high - low < 0.2
    with pytest.raises(ValueError, match="same, non-zero length"):
        stats.paired_ratio([1.0], [1.0, 2.0])


def test_overlap_says_whether_a_difference_is_significant():
    assert stats.overlap((1.0, 2.0), (1.5, 3.0)) is True
    assert stats.overlap((1.0, 2.0), (2.5, 3.0)) is False
    assert stats.overlap((None, None), (1.0, 2.0)) is None


# ---- the record fields built from them: values computed here by hand ----------------------------

def test_trial_metric_is_the_true_median_with_its_interval_count_and_no_warning():
    m = stats.trial_metric("prefill_ms", [4.0, 1.0, 3.0, 2.0, 6.0, 5.0])
    assert m["prefill_ms"] == 3.5  # torch.median gave 3.0, the lower middle value
    assert m["prefill_ms_n"] == 6 and "prefill_ms_warning" not in m and m["prefill_ms_ci_reason"] is None
    # a bootstrap median of 6 values is one of them or the mean of two: within [1, 6], around 3.5
    assert 1.0 <= m["prefill_ms_ci_low"] <= 3.5 <= m["prefill_ms_ci_high"] <= 6.0


def test_one_trial_has_no_interval_and_a_warning():
    m = stats.trial_metric("tokens_per_s", [100.0])
    assert m["tokens_per_s"] == 100.0 and m["tokens_per_s_ci_low"] is None and m["tokens_per_s_ci_high"] is None
    assert m["tokens_per_s_n"] == 1 and "needs at least 2" in m["tokens_per_s_warning"]


def test_step_metrics_pool_the_trials_by_the_linear_method_and_warn_below_the_needed_count():
    trials = [[float(v) for v in range(1, 11)], [float(v) for v in range(11, 21)]]  # the steps 1..20
    m = stats.step_metrics(trials)
    # type 7: h = (n - 1) q, linear between the order statistics x[floor h] and x[floor h + 1]
    assert m["decode_ms_p50"] == pytest.approx(10.5)
    assert m["decode_ms_p90"] == pytest.approx(1 + 0.9 * 19)
    assert m["decode_ms_p99"] == pytest.approx(1 + 0.99 * 19)
    assert m["decode_ms_mean"] == pytest.approx(10.5)
    assert m["decode_ms_p99_n"] == m["decode_ms_p90_n"] == 20
    assert "decode_ms_p90_warning" not in m  # p90 needs 10
    assert "needs at least 100" in m["decode_ms_p99_warning"]
    assert m["decode_ms_p50_ci_low"] < 10.5 < m["decode_ms_p50_ci_high"]
    assert (m["decode_ms_p99_ci_low"], m["decode_ms_p99_ci_high"]) == stats.block_bootstrap_ci(trials, 0.99)
    assert "decode_ms_p90_ci_low" not in m  # only p50 and p99 get an interval


def test_every_field_of_the_record_helpers_has_a_method():
    fields = set(stats.step_metrics([[1.0, 2.0, 3.0]])) | set(stats.trial_metric("x", [1.0]))
    methods = {**stats.step_metric_methods(), **stats.trial_metric_methods("x", "ms")}
    assert fields - set(methods) == {"decode_ms_p50", "decode_ms_p90", "decode_ms_p99", "decode_ms_mean", "x"}


# ---- the rule: no interval, and no significance, below the samples an interval needs ------------

def test_min_interval_samples_is_where_min_to_max_covers_the_quantile_95_percent():
    def coverage(q, k):  # the probability that [x(1), x(k)] covers the q quantile
        return 1 - q ** k - (1 - q) ** k

    for q in (0.5, 0.9, 0.99):
        n = stats.min_interval_samples(q)
        assert coverage(q, n) >= 0.95 > coverage(q, n - 1)
    assert [stats.min_interval_samples(q) for q in (0.5, 0.9, 0.99)] == [6, 29, 299]


def test_three_trials_or_rounds_get_no_interval_and_say_why():
    m = stats.trial_metric("prefill_ms", [2.0, 2.1, 6.0])
    assert m["prefill_ms_ci_low"] is m["prefill_ms_ci_high"] is None
    assert "3 timed trials" in m["prefill_ms_ci_reason"] and "needs at least 6" in m["prefill_ms_ci_reason"]
    # task=compare with 3 rounds once gave 0.8035 the interval [0.8035, 0.8068]
    ratio, low, high = stats.paired_ratio([1.0, 1.2, 1.1], [0.8035, 0.97, 0.88])
    assert low is high is None and "3 rounds" in stats.paired_ratio_reason(3, ratio, low)
    assert stats.kv_cost_fit([1, 2, 3], [1.0, 2.0, 3.5])["ci_reason"]  # 3 points: a slope, no interval


def test_a_degenerate_interval_is_none():
    assert stats.degenerate(0.8035, 0.8035, 0.8068, varies=True)
    assert not stats.degenerate(0.8, 0.79, 0.81, varies=True) and not stats.degenerate(2.0, 2.0, 2.0, varies=False)
    # six rounds, five of them the same ratio: every resample's median is that ratio or next to it
    ratio, low, high = stats.paired_ratio([1.0] * 6, [0.5, 0.5, 0.5, 0.5, 0.5, 0.9])
    assert ratio == 0.5 and low is None and "degenerate" in stats.paired_ratio_reason(6, ratio, low)


def test_p99_needs_299_steps_for_an_interval():
    short = stats.step_metrics([[float(v) for v in range(1, 101)]] * 2)  # 200 steps
    assert short["decode_ms_p99_ci_low"] is None and "needs at least 299" in short["decode_ms_p99_ci_reason"]
    assert short["decode_ms_p50_ci_low"] is not None and short["decode_ms_p50_ci_reason"] is None


def test_tokens_per_s_is_derived_from_the_steps_it_summarises():
    """One stalled trial of three once halved tokens/s while the median step moved 8 %."""
    steady = [1.0 + 0.01 * (i % 7) for i in range(64)]
    trials = [steady, steady, [5.0] * 64]  # a stalled trial
    steps = stats.step_metrics(trials)
    rate = stats.step_rate(steps, batch_size=4)
    assert rate["tokens_per_s"] == pytest.approx(4 * 1000 / steps["decode_ms_p50"])
    assert rate["tokens_per_s_ci_low"] == pytest.approx(4 * 1000 / steps["decode_ms_p50_ci_high"])
    assert rate["tokens_per_s_mean"] == pytest.approx(4 * 1000 / steps["decode_ms_mean"])
    assert set(rate) <= set(stats.step_rate_methods())


def test_proportion_interval_is_clopper_pearson():
    # closed forms of the exact binomial interval: 0 of n -> [0, 1 - (a/2)^(1/n)], n of n ->
    # [(a/2)^(1/n), 1]; 1 of 1 -> [0.025, 1]
    assert stats.proportion_interval(0, 5) == pytest.approx((0.0, 1 - 0.025 ** (1 / 5)))
    assert stats.proportion_interval(5, 5) == pytest.approx((0.025 ** (1 / 5), 1.0))
    assert stats.proportion_interval(1, 1) == pytest.approx((0.025, 1.0))
    # 2 of 5: the k-th and (k+1)-th order-statistic quantiles, by the binomial tail sums
    low, high = stats.proportion_interval(2, 5)
    tail_above = sum(math.comb(5, j) * low ** j * (1 - low) ** (5 - j) for j in range(2, 6))
    tail_below = sum(math.comb(5, j) * high ** j * (1 - high) ** (5 - j) for j in range(0, 3))
    assert tail_above == pytest.approx(0.025) and tail_below == pytest.approx(0.025)
    assert stats.proportion_interval(0, 0) == (None, None)
