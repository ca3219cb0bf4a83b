"""The report's KV cost across a sweep's prompt lengths: the fit against
hand-made decode records whose p50 is an exact line in the context, so the expected intercept,
slope and ratios are known without running the fit."""

import pytest

from kvbench.sinks.report import Report, kv_cost_across_prompts, markdown

GEN = 10


def record(job, kind, kv, prompt, batch, ms_at_0, us_per_1k, bytes_per_position):
    context = prompt + (GEN + 1) / 2  # the mean context the run's decode steps attended
    return {"job": job, "status": "ok", "metrics": {
                "decode_ms_p50": ms_at_0 + us_per_1k / 1e6 * context,
                "kv_cache_bytes_formula": bytes_per_position * (prompt + GEN) * batch},
            "config": {"task": "bench", "attention": {"type": kind, "num_kv_heads": kv},
                       "workload": {"name": "decode", "prompt_len": prompt, "gen_len": GEN, "batch_size": batch},
                       "cache": {"impl": "static", "dtype": "auto"}}}


def sweep():
    recs, n = [], 0
    for batch, scale in ((1, 1.0), (8, 3.0)):
        for kind, kv, slope in (("mha", 8, 4000.0), ("gqa", 2, 1200.0), ("mqa", 1, 700.0)):
            prompts = (128, 512, 2048) if kind != "mqa" else (128, 2048)  # MQA: too few for a fit
            for prompt in prompts:
                recs.append(record(str(n), kind, kv, prompt, batch, 2.0 * scale, slope * scale, 64 * kv))
                n += 1
    return recs


def test_the_fit_recovers_each_variants_line_per_cell():
    rows = kv_cost_across_prompts(sweep())
    assert [(r["workload.batch_size"], r["variant"]) for r in rows] == [(1, "mha kv=8"), (1, "gqa kv=2"),
                                                                        (8, "mha kv=8"), (8, "gqa kv=2")]
    for r in rows:
        scale = 3.0 if r["workload.batch_size"] == 8 else 1.0
        slope = (4000.0 if r["variant"].startswith("mha") else 1200.0) * scale
        assert r["prompts"] == 3 and r["baseline"] == "mha kv=8"
        assert r["us_per_1k_ctx"] == pytest.approx(slope) and r["at_ctx0_ms"] == pytest.approx(2.0 * scale)
        # 3 jobs, 3 points: too few for an interval of the slope (docs/statistics.md), and the reason
        assert r["us_per_1k_ctx_ci_low"] is None and r["us_per_1k_ctx_ci_high"] is None and "3 points" in r["ci_reason"]
    gqa = [r for r in rows if r["variant"] == "gqa kv=2"]
    assert all(r["slope_ratio"] == pytest.approx(0.3) and r["kv_bytes_ratio"] == pytest.approx(0.25) for r in gqa)


def test_failed_or_other_jobs_are_left_out_and_the_report_has_the_section(tmp_path):
    recs = sweep()
    recs[0]["status"] = "error"  # MHA batch 1 at prompt 128: two prompt lengths left, no fit
    recs.append({"job": "99", "status": "ok", "metrics": {"perplexity": 3.0},
                 "config": {"task": "train", "attention": {"type": "mha", "num_kv_heads": 8}}})
    rows = kv_cost_across_prompts(recs)
    assert [(r["workload.batch_size"], r["variant"], r["baseline"]) for r in rows][:1] == [(1, "gqa kv=2", "gqa kv=2")]
    text = markdown(Report(root=tmp_path, records=recs, axes=[]), [])
    assert "## KV cost across prompt lengths" in text
    assert "| 8 | gqa kv=2 | 3 | 6.000 | 3600.0, no interval | 0.300 | 0.250 |" in text
