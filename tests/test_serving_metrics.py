"""Serving metrics on scripted timelines (a fake clock: every time below is written by hand), each
figure against its value computed by hand from the engines' definitions."""

import numpy as np
import pytest

from kvbench.serving.metrics import METRICS, slo_violations, timeline_metrics, timeline_series
from kvbench.serving.trace import Request, RequestTrace, Sample, Timeline


def trace(id, arrival, prompt, output, scheduled, tokens, **kw):
    return RequestTrace(Request(id, arrival, prompt, output), scheduled_s=scheduled, token_s=list(tokens), **kw)


def scripted(samples=None):
    """r0: 3 tokens; r1: 1 token; r2: 4 tokens, preempted once; r3 unfinished (2 of 5); r4 never
    scheduled. Block size 4, 10 bytes per token."""
    traces = [
        trace(0, 0.0, 4, 3, 0.1, [0.3, 0.5, 0.9], prefix_query_tokens=4),
        trace(1, 0.2, 2, 1, 0.2, [0.6]),
        trace(2, 0.4, 6, 4, 0.5, [0.7, 0.8, 1.0, 1.3], preemptions=1, prefix_hit_tokens=4, prefix_query_tokens=6),
        trace(3, 1.0, 3, 5, 1.1, [1.4, 1.5]),
        trace(4, 1.2, 3, 2, None, []),
    ]
    samples = samples if samples is not None else [
        Sample(0.3, running=2, waiting=1, kv_blocks_used=2, kv_bytes_used=80, kv_bytes_needed=60),
        Sample(0.9, running=2, waiting=0, kv_blocks_used=3, kv_bytes_used=120, kv_bytes_needed=70),
        Sample(1.5, running=1, waiting=1, kv_blocks_used=1, kv_bytes_used=40, kv_bytes_needed=20),
    ]
    return Timeline(traces, samples, duration_s=1.5, store="paged", block_size=4, kv_blocks_total=8,
                    bytes_per_token=10)


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-9)


def test_latencies_equal_the_hand_computed_values():
    m = timeline_metrics(scripted())
    # TTFT [300, 400, 300] ms: linear percentiles of the sorted [300, 300, 400]
    assert (m["ttft_ms_mean"], m["ttft_ms_p50"], m["ttft_ms_p90"], m["ttft_ms_p99"]) == (
        approx(1000 / 3), approx(300), approx(380), approx(398))
    # TPOT: r0 (900 - 300) / 2 = 300, r2 (900 - 300) / 3 = 200; r1 (one token) has none
    assert (m["tpot_ms_mean"], m["tpot_ms_p50"], m["tpot_ms_p90"], m["tpot_ms_p99"], m["tpot_ms_p50_n"]) == (
        approx(250), approx(250), approx(290), approx(299), 2)
    # ITL pooled: r0 200, 400; r2 100, 200, 300 (r1 has no gap)
    assert (m["itl_ms_mean"], m["itl_ms_p50"], m["itl_ms_p90"], m["itl_ms_p99"], m["itl_ms_p50_n"]) == (
        approx(240), approx(200), approx(360), approx(396), 5)
    assert (m["e2e_ms_mean"], m["e2e_ms_p50"]) == (approx(2200 / 3), approx(900))
    assert (m["queue_ms_mean"], m["queue_ms_p50"]) == (approx(200 / 3), approx(100))


def test_unfinished_requests_are_counted_and_excluded():
    m = timeline_metrics(scripted())
    assert (m["requests"], m["requests_finished"], m["requests_unfinished"], m["requests_never_scheduled"]) == (
        5, 3, 2, 1)
    assert "2 of 5" in m["requests_unfinished_reason"] and "excluded" in m["requests_unfinished_reason"]
    assert m["ttft_ms_p50_n"] == 3  # r3's first token (at 1.4, TTFT 400) is not among them
    # throughput of finished requests over the 1.5 s: 3 requests, 3 + 1 + 4 output, 4 + 2 + 6 prompt
    assert (m["request_throughput"], m["output_throughput"], m["total_token_throughput"]) == (
        approx(2.0), approx(8 / 1.5), approx(20 / 1.5))
    assert slo_violations(m, {"ttft_ms": 1e9}) == ["unfinished"]


def test_goodput_counts_requests_meeting_every_target():
    m = timeline_metrics(scripted(), {"ttft_ms": 350, "tpot_ms": 250})
    # r0: TPOT 300 > 250; r1: TTFT 400 > 350; r2: TTFT 300, TPOT 200 -> good
    assert (m["good_requests"], m["goodput"]) == (1, approx(1 / 1.5))
    assert m["goodput_slo"] == "ttft_ms <= 350, tpot_ms <= 250"
    # a target equal to the value is met (vLLM: s >= r)
    assert timeline_metrics(scripted(), {"ttft_ms": 300})["good_requests"] == 2
    # a one-token output's TPOT counts as 0 (vLLM's all_tpots): r1 meets any TPOT target
    assert timeline_metrics(scripted(), {"tpot_ms": 0.001})["good_requests"] == 1
    assert timeline_metrics(scripted(), {"e2e_ms": 500})["good_requests"] == 1


def test_no_request_meeting_the_slo_is_a_goodput_of_zero_and_no_slo_is_null():
    m = timeline_metrics(scripted(), {"ttft_ms": 1.0})
    assert (m["good_requests"], m["goodput"]) == (0, 0.0)
    none = timeline_metrics(scripted(), None)
    assert none["goodput"] is None and "no SLO target" in none["goodput_reason"]


def test_one_token_outputs_have_no_tpot_and_no_itl():
    t = Timeline([trace(0, 0.0, 2, 1, 0.0, [0.2]), trace(1, 0.1, 2, 1, 0.2, [0.4])], [], duration_s=0.4,
                 store="slots", block_size=16, kv_blocks_total=2, bytes_per_token=8)
    m = timeline_metrics(t, {"tpot_ms": 10})
    assert m["tpot_ms_p50"] is None and m["tpot_ms_mean"] is None and m["tpot_ms_p50_n"] == 0
    assert m["itl_ms_p99"] is None and m["itl_ms_p50_n"] == 0
    assert (m["ttft_ms_mean"], m["good_requests"]) == (approx(250), 2)
    assert slo_violations(m, {"tpot_ms": 10}) == []  # no TPOT to miss
    assert m["block_waste_bytes_mean"] is None and m["samples"] == 0


def test_prefix_hits_and_preemptions():
    m = timeline_metrics(scripted())
    assert (m["preemptions"], m["prefix_hit_tokens"], m["prefix_query_tokens"]) == (1, 4, 10)
    assert m["prefix_hit_rate"] == approx(0.4)


def test_block_waste_against_its_bound_and_the_series():
    m = timeline_metrics(scripted())
    # waste 20, 50, 20 bytes; bounds (4 - 1) x 10 x running = 60, 60, 30
    assert (m["block_waste_bytes_mean"], m["block_waste_bytes_max"], m["block_waste_bound_bytes_max"]) == (
        approx(30), 50, 60)
    assert m["block_waste_within_bound"] is True and m["block_waste_over_bound_samples"] == 0
    assert (m["kv_blocks_used_max"], m["kv_block_usage_max"], m["running_max"], m["waiting_max"]) == (
        3, approx(3 / 8), 2, 1)
    over = timeline_metrics(scripted([Sample(0.5, 1, 0, 2, 80, 40)]))  # 40 > (4 - 1) x 10 x 1
    assert over["block_waste_within_bound"] is False and over["block_waste_over_bound_samples"] == 1
    s = timeline_series(scripted())
    assert s == {"serving_t_s": [0.3, 0.9, 1.5], "serving_running": [2, 2, 1], "serving_waiting": [1, 0, 1],
                 "serving_kv_blocks_used": [2, 3, 1], "serving_block_waste_bytes": [20, 50, 20]}


def test_few_samples_give_no_interval_and_say_why():
    m = timeline_metrics(scripted())
    assert m["ttft_ms_p50_ci_low"] is None and "needs at least 6" in m["ttft_ms_p50_ci_reason"]
    assert m["ttft_ms_p99_ci_high"] is None and "needs at least 299" in m["ttft_ms_p99_ci_reason"]
    # one line for every quantile short of samples, not one per latency
    assert m["quantiles_warning"].startswith("p90 of ttft_ms, tpot_ms, itl_ms, e2e_ms, queue_ms from 2/3/5 samples")
    assert "; p99 of ttft_ms, tpot_ms, itl_ms, e2e_ms, queue_ms from 2/3/5 samples (a 99% quantile needs 100)" in (
        m["quantiles_warning"])
    assert not [k for k in m if k.endswith("_warning") and k != "quantiles_warning"]


def test_enough_requests_give_intervals_around_the_estimate():
    rng = np.random.default_rng(0)
    ttft = rng.lognormal(-2, 0.5, 400)
    traces = [trace(i, 0.01 * i, 4, 2, 0.01 * i, [0.01 * i + t, 0.01 * i + t + 0.05]) for i, t in enumerate(ttft)]
    t = Timeline(traces, [], duration_s=5.0, store="paged", block_size=4, kv_blocks_total=64, bytes_per_token=8)
    m = timeline_metrics(t)
    assert m["ttft_ms_p50"] == approx(1e3 * np.percentile(ttft, 50))
    for key in ("ttft_ms_p50", "ttft_ms_p99"):
        assert m[f"{key}_ci_reason"] is None
        assert m[f"{key}_ci_low"] < m[key] < m[f"{key}_ci_high"]
    assert "ttft_ms" not in (m["quantiles_warning"] or "")
    quick = timeline_metrics(t, intervals=False)
    assert quick["ttft_ms_p50_ci_low"] is None and "not computed" in quick["ttft_ms_p50_ci_reason"]


def test_slo_violations_judge_the_stat_named():
    m = timeline_metrics(scripted())
    m["requests_unfinished"] = 0
    assert slo_violations(m, {"ttft_ms": 390, "tpot_ms": 300}) == ["ttft_ms"]  # p99 398 > 390; 299 <= 300
    assert slo_violations(m, {"ttft_ms": 390, "stat": "p50"}) == []
    judged = timeline_metrics(scripted(), {"ttft_ms": 390})
    assert judged["slo_met"] is False and judged["slo_missed"] == "ttft_ms, unfinished"
    assert timeline_metrics(scripted())["slo_met"] is None


def test_every_metric_recorded_is_declared_with_a_unit():
    m = timeline_metrics(scripted(), {"ttft_ms": 350})
    assert set(m) <= set(METRICS)
    assert all(METRICS[k].unit or k.startswith("series.") for k in m)
    assert {f"series.{k}" for k in timeline_series(scripted())} <= set(METRICS)
