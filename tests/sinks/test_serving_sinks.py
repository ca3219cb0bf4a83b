"""The serving sinks from hand-made records: every run's point, the highest rate within the SLO per
variant, the report's table and plots, and the article table's column."""

import pytest

from kvbench.results import RunResult
from kvbench.sinks.choose import choices
from kvbench.sinks.report import write_report
from kvbench.sinks.serving import curves, markdown, max_rate_text, max_rates, pareto_front, xy
from kvbench.sinks.serving_plots import draw

SLO = {"name": "test", "ttft_ms": 500.0, "tpot_ms": 50.0, "stat": "p99"}


def config(kind, kv, rate=4.0, model="tiny"):
    return {"task": "bench", "model": {"name": model}, "attention": {"type": kind, "num_kv_heads": kv},
            "workload": {"name": "serving", "rate": rate, "search": {"enabled": True}}, "slo": SLO}


def curve_row(rate, ttft, tpot, ok):
    return {"rate": rate, "ok": ok, "violated": None if ok else "ttft_ms", "ttft_ms_p99": ttft, "tpot_ms_p99": tpot,
            "tpot_ms_p50": tpot / 2, "output_throughput": 10 * rate, "goodput": rate if ok else 0.5 * rate,
            "tokens_per_s_per_user": 2e3 / tpot}


def search_record(job, kind, kv, limit, best, failed, bound="ttft_ms", **metrics):
    """A rate search whose p99 TTFT is 100 ms x rate x (4.5 / limit): it meets 500 ms below ``limit``."""
    rows = [curve_row(r, 100 * r * 4.5 / limit, 10 + r, 100 * r * 4.5 / limit <= 500) for r in (1, 2, 4, best, failed)]
    return {"job": str(job), "status": "ok", "config": config(kind, kv),
            "metrics": {"max_rate_under_slo": best, "max_rate_failed_at": failed, "max_rate_bound": bound,
                        "max_rate_probes": len(rows), "max_rate_under_slo_reason": None, **metrics},
            "tables": {"serving_rate_curve": sorted(rows, key=lambda r: r["rate"])}}


def records():
    return [search_record(0, "mha", 4, 4.5, 4.3, 4.7), search_record(1, "gqa", 2, 5.0, 4.9, 5.3),
            search_record(2, "mqa", 1, 6.0, 5.8, 6.4)]


def test_points_come_from_the_curve_in_rate_order():
    data = curves(records(), [])
    assert list(data) == [""] and list(data[""]) == ["mha kv=4", "gqa kv=2", "mqa kv=1"]
    assert [r["rate"] for r in data[""]["mha kv=4"]] == [1, 2, 4, 4.3, 4.7]
    assert xy(data, "rate", "ttft_ms_p99")[""]["mha kv=4"][0] == (1, pytest.approx(100.0))


def test_a_sweep_over_rates_without_search_gives_one_point_per_record():
    recs = [{"job": str(i), "status": "ok", "config": config("mqa", 1, rate=r),
             "metrics": {"ttft_ms_p99": 10 * r, "tpot_ms_p50": 20.0, "output_throughput": 5 * r, "slo_met": r < 3}}
            for i, r in enumerate((1, 2, 4))]
    rows = curves(recs, [("workload.rate", "rate")])[""]["mqa kv=1"]
    assert [(r["rate"], r["ttft_ms_p99"], r["ok"], r["tokens_per_s_per_user"]) for r in rows] == [
        (1, 10, True, 50.0), (2, 20, True, 50.0), (4, 40, False, 50.0)]
    assert max_rates(recs, []) == []  # no search: no max rate claimed


def test_max_rate_rows_and_their_text_for_each_outcome():
    rows = max_rates(records(), [])
    assert [(r["variant"], r["max_rate"], r["bound"]) for r in rows] == [
        ("mha kv=4", 4.3, "ttft_ms"), ("gqa kv=2", 4.9, "ttft_ms"), ("mqa kv=1", 5.8, "ttft_ms")]
    assert rows[0]["ttft_ms_p99"] == pytest.approx(100 * 4.3)  # the curve's point at the answer
    assert max_rate_text(records()[0]) == "4.3 req/s (ttft_ms)"
    never = {"metrics": {"max_rate_under_slo": None, "max_rate_at_least": 64.0, "max_rate_probes": 7}}
    assert max_rate_text(never) == ">= 64 req/s (SLO never bound)"
    low = {"metrics": {"max_rate_under_slo": None, "max_rate_failed_at": 0.5, "max_rate_bound": "tpot_ms"}}
    assert max_rate_text(low) == "< 0.5 req/s (fails at the lowest rate: tpot_ms)"


def test_pareto_front_keeps_the_points_nothing_beats_on_both_axes():
    assert pareto_front([(1, 10), (2, 9), (3, 5), (2, 4), (1, 1)]) == [(1, 10), (2, 9), (3, 5)]


def test_plots_and_report(tmp_path):
    drawn, skipped = draw(records(), [], tmp_path)
    assert [p.name for p in drawn] == ["rate_latency.png", "serving_pareto.png"] and skipped == {}
    assert all(p.stat().st_size > 10_000 for p in drawn)
    assert draw([], [], tmp_path) == ([], {})
    one = [{**records()[0], "tables": {}}]  # one rate only (the record's own)
    assert "needs >= 2 arrival rates" in draw(one, [], tmp_path)[1]["rate_latency"]
    for i, rec in enumerate(records()):
        RunResult(status="ok", config=rec["config"], metrics=rec["metrics"], tables=rec["tables"]).write(
            tmp_path / "sweep" / str(i))
    write_report(tmp_path / "sweep")
    md = (tmp_path / "sweep" / "summary.md").read_text()
    assert "## Serving: the highest arrival rate within the SLO" in md
    assert "| mqa kv=1 | 5.8 req/s (ttft_ms) | 6.4 |" in md
    assert "![rate_latency](rate_latency.png)" in md and "![serving_pareto](serving_pareto.png)" in md


def test_a_conversations_rate_search_has_its_curve_plot_and_row_in_the_report(tmp_path):
    """workload=conversations searches rates too (conversations per second): the report draws its
    curve and tables its highest rate; beside workload=serving records, each workload is a panel of
    its own (requests and conversations per second are never one line)."""
    chats = [search_record(3, "mqa", 1, 2.0, 1.9, 2.2), search_record(4, "gqa", 2, 1.5, 1.4, 1.6)]
    for rec in chats:
        rec["config"]["workload"]["name"] = "conversations"
    data = curves(chats, [])
    assert list(data) == [""] and [r["rate"] for r in data[""]["mqa kv=1"]] == [1, 1.9, 2, 2.2, 4]
    assert [(r["variant"], r["max_rate"], r["text"]) for r in max_rates(chats, [])] == [
        ("gqa kv=2", 1.4, "1.4 conv/s (ttft_ms)"), ("mqa kv=1", 1.9, "1.9 conv/s (ttft_ms)")]
    drawn, skipped = draw(chats, [], tmp_path)
    assert [p.name for p in drawn] == ["rate_latency.png", "serving_pareto.png"] and skipped == {}
    both = curves(records() + chats, [])
    assert list(both) == ["workload=conversations", "workload=serving"]
    assert list(both["workload=serving"]) == ["mha kv=4", "gqa kv=2", "mqa kv=1"]
    assert [r["rate"] for r in both["workload=conversations"]["mqa kv=1"]] == [1, 1.9, 2, 2.2, 4]
    md = "\n".join(markdown(records() + chats, []))  # the report's serving section
    assert "### workload=conversations" in md and "| mqa kv=1 | 1.9 conv/s (ttft_ms) | 2.2 |" in md
    assert "### workload=serving" in md and "| mqa kv=1 | 5.8 req/s (ttft_ms) | 6.4 |" in md


def capacity_record(job, kind, kv, max_batch):
    return {"job": str(job), "status": "ok",
            "config": {"task": "capacity", "model": {"name": "tiny"}, "attention": {"type": kind, "num_kv_heads": kv},
                       "workload": {"name": "decode", "gen_len": 8}, "capacity": {"context_lens": [128]}},
            "metrics": {"max_batch_longest": max_batch, "stopped_by_longest": "memory", "kv_bytes_per_token": 64 * kv},
            "tables": {"capacity": [{"context": 128, "max_batch": max_batch, "predicted_max_batch": max_batch}]}}


def test_choose_gains_the_max_rate_column_when_serving_searches_are_there():
    capacity = [capacity_record(10, "mha", 4, 8), capacity_record(11, "gqa", 2, 16), capacity_record(12, "mqa", 1, 32)]
    (plain,) = choices(capacity)
    assert "max rate under SLO" not in plain.header
    (choice,) = choices(capacity + records())
    col = choice.header.index("max rate under SLO")
    assert {r[0]: r[col] for r in choice.rows} == {"mha kv=4": "4.3 req/s (ttft_ms)", "gqa kv=2": "4.9 req/s (ttft_ms)",
                                                   "mqa kv=1": "5.8 req/s (ttft_ms)"}
    other_model = [{**r, "config": config("mha", 4, model="small")} for r in records()[:1]]
    (choice,) = choices(capacity + other_model)
    assert "max rate under SLO" not in choice.header  # a search of another model is not this table's


def allocator_record(job, allocator, fit, per_seq, **extra):
    """A serving run's capacity figures (what workload=serving records) under ``allocator``."""
    rec = search_record(job, "gqa", 2, 5.0, 4.9, 5.3)
    rec["config"]["cache"] = {"dtype": "int8"}
    rec["config"]["workload"]["allocator"] = allocator
    rec["metrics"].update(kv_allocator=allocator, kv_budget_bytes=400_000, kv_sequence_positions=26,
                          kv_bytes_per_token=512, kv_sequence_bytes_formula=15_872, kv_sequences_fit_formula=25,
                          kv_sequence_reserved_bytes=per_seq, kv_sequences_fit=fit, kv_reserved_bytes=393_216,
                          kv_store_bytes=516_096, **extra)
    return rec


def test_the_report_tables_each_allocators_capacity_beside_the_formulas(tmp_path):
    """Both allocators of one layout side by side, figures computed from the plan labelled so, the
    measured ones measured; a record whose figure is not a whole number is left out; a sweep
    without the figures has no such section."""
    recs = [allocator_record(0, "unified", 16, 24_576), allocator_record(1, "per_kind", 21, 18_944),
            allocator_record(2, "per_kind", 21, "18 KiB")]
    for i, rec in enumerate(recs):
        RunResult(status="ok", config=rec["config"], metrics=rec["metrics"], tables=rec["tables"]).write(
            tmp_path / "sweep" / str(i))
    write_report(tmp_path / "sweep")
    md = (tmp_path / "sweep" / "summary.md").read_text()
    assert "![serving_capacity](serving_capacity.png)" in md
    assert (tmp_path / "sweep" / "serving_capacity.png").stat().st_size > 10_000
    section = md.split("## Serving capacity per layout, KV precision and allocator")[1].split("\n## ")[0]
    assert "fit (allocator's plan)" in section and "store allocated (measured)" in section
    rows = [line for line in section.splitlines() if line.startswith("| gqa")]
    assert rows == [
        "| gqa kv=2 int8 | per_kind | 390.62 KiB | 26 | 512 | 15.50 KiB | 25 | 18.50 KiB | 21 | 388.50 KiB | "
        "384.00 KiB | 504.00 KiB | 4.9 req/s (ttft_ms) |",
        "| gqa kv=2 int8 | unified | 390.62 KiB | 26 | 512 | 15.50 KiB | 25 | 24.00 KiB | 16 | 384.00 KiB | "
        "384.00 KiB | 504.00 KiB | 4.9 req/s (ttft_ms) |"]
    write_report(tmp_path / "sweep", tmp_path / "plain", plots=False, records=records())
    assert "Serving capacity" not in (tmp_path / "plain" / "summary.md").read_text()
