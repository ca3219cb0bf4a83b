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
    assert stats.bootstrap_ci([2.0, 2.0, 2.0]) == (2.0, 2.0)


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
