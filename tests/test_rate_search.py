"""The rate search over synthetic serving runs whose p99 latencies are known functions of the rate,
so the true limit is known by hand."""

import pytest

from kvbench.serving.rate_search import curve_rows, max_rate_under_slo, search_metrics


def linear(rate, ttft_per_rate=100.0, tpot_per_rate=10.0, calls=None):
    """p99 TTFT = 100 ms x rate, p99 TPOT = 10 ms x rate: a TTFT target of 450 ms binds at 4.5 req/s."""
    if calls is not None:
        calls.append(rate)
    return {"ttft_ms_p99": ttft_per_rate * rate, "tpot_ms_p99": tpot_per_rate * rate, "tpot_ms_p50": 5.0 * rate,
            "ttft_ms_p50": 50.0 * rate, "requests_unfinished": 0, "output_throughput": 20.0 * rate}


def test_monotone_latency_brackets_the_true_limit():
    calls = []
    s = max_rate_under_slo(lambda r: linear(r, calls=calls), {"ttft_ms": 450}, lo=0.5, hi=64, rel_tol=0.1)
    assert s.max_rate <= 4.5 < s.failed_at and s.failed_at / s.max_rate <= 1.1
    assert s.bound == ["ttft_ms"] and s.reason is None and s.non_monotone == []
    # gallop 0.5, 1, 2, 4 (pass), 8 (fail), one above it (16), then bisection between 4 and 8
    assert calls[:6] == [0.5, 1, 2, 4, 8, 16] and all(4 < r < 8 for r in calls[6:])
    assert [p.rate for p in s.curve] == calls


def test_the_target_that_binds_first_sets_the_limit():
    s = max_rate_under_slo(linear, {"ttft_ms": 450, "tpot_ms": 30}, lo=0.5, hi=64, rel_tol=0.05)
    assert s.max_rate <= 3.0 < s.failed_at and s.bound == ["tpot_ms"]
    assert search_metrics(s)["max_rate_bound"] == "tpot_ms"


def test_failing_at_the_lowest_rate_records_no_rate_and_says_why():
    s = max_rate_under_slo(linear, {"ttft_ms": 10}, lo=0.5, hi=64)
    assert s.max_rate is None and s.failed_at == 0.5 and len(s.curve) == 1
    assert "fails even at the lowest rate" in s.reason and "ttft_ms" in s.reason


def test_an_slo_that_never_binds_records_a_lower_bound_only():
    s = max_rate_under_slo(linear, {"ttft_ms": 1e6}, lo=1, hi=10)
    assert s.max_rate is None and s.at_least == 10 and "never binds" in s.reason
    assert [p.rate for p in s.curve] == [1, 2, 4, 8, 10]
    m = search_metrics(s)
    assert m["max_rate_under_slo"] is None and m["max_rate_at_least"] == 10


def test_the_probe_limit_is_said():
    s = max_rate_under_slo(linear, {"ttft_ms": 1e6}, lo=1, hi=1000, max_probes=3)
    assert s.max_rate is None and s.at_least == 4 and "probe limit" in s.reason and len(s.curve) == 3


def test_a_noisy_pass_above_a_failure_is_reported_never_taken():
    def noisy(rate):
        m = linear(rate)
        if rate == 16:  # a lucky run far above the limit
            m["ttft_ms_p99"] = 10.0
        return m

    s = max_rate_under_slo(noisy, {"ttft_ms": 450}, lo=0.5, hi=64)
    assert s.non_monotone == [16] and s.max_rate <= 4.5 < s.failed_at
    assert search_metrics(s)["max_rate_non_monotone"] == 1


def test_a_noisy_failure_below_the_limit_lowers_the_answer_conservatively():
    def noisy(rate):
        m = linear(rate)
        if rate == 2:  # an unlucky run below the limit
            m["ttft_ms_p99"] = 1e4
        return m

    s = max_rate_under_slo(noisy, {"ttft_ms": 450}, lo=0.5, hi=64)
    # the gallop stops at the first failure: the answer is below it, and 4 (above it) passed
    assert s.max_rate < 2 <= s.failed_at and s.non_monotone == [4]


def test_unfinished_requests_fail_a_rate():
    def overloaded(rate):
        return {**linear(rate), "requests_unfinished": 3 if rate > 5 else 0}

    s = max_rate_under_slo(overloaded, {"ttft_ms": 1e6}, lo=1, hi=64)
    assert s.max_rate <= 5 < s.failed_at and s.bound == ["unfinished"]


def test_bad_ranges_and_no_target_are_refused():
    with pytest.raises(ValueError, match="lo=4"):
        max_rate_under_slo(linear, {"ttft_ms": 1}, lo=4, hi=2)
    with pytest.raises(ValueError, match="needs an SLO target"):
        max_rate_under_slo(linear, {"ttft_ms": None}, lo=1, hi=2)


def test_curve_rows_are_in_rate_order_with_tokens_per_user():
    s = max_rate_under_slo(linear, {"ttft_ms": 450}, lo=0.5, hi=64)
    rows = curve_rows(s)
    assert [r["rate"] for r in rows] == sorted(p.rate for p in s.curve)
    first = rows[0]
    assert first["ok"] is True and first["violated"] is None
    assert first["tokens_per_s_per_user"] == pytest.approx(1e3 / (5.0 * 0.5))
    assert rows[-1]["violated"] == "ttft_ms"


def test_the_slo_keys_the_search_and_capacity_accept():
    from conftest import compose

    from kvbench.core.errors import ConfigError
    from kvbench.jobs.job_config import to_bench_config

    serving = ("model=tiny", "workload=serving", "workload.search.enabled=true")
    assert to_bench_config(compose(*serving, "slo.e2e_ms=900")).slo.e2e_ms == 900  # an E2E target alone is one
    with pytest.raises(ConfigError, match=r"^slo.tpot_x_batch1=2.0: workload=serving judges TPOT against"):
        to_bench_config(compose(*serving, "slo.ttft_ms=100", "slo.tpot_x_batch1=2"))
    with pytest.raises(ConfigError, match=r"^slo.e2e_ms=5.0: task=capacity judges TTFT and TPOT only"):
        to_bench_config(compose("model=tiny", "task=capacity", "slo.e2e_ms=5"))
