"""Intervals in the tables, plots and report, on hand-made records: a value shows its 95% interval
where the record has one (and only then: older records have none), a ratio of separate jobs is
untested whatever their own intervals, a task=compare record's table shows its paired ratios, and
the decode plot draws the intervals as error bars."""

import io

import pytest
from conftest import saved_figures
from matplotlib.collections import LineCollection
from rich.console import Console

from kvbench.results import RunResult
from kvbench.sinks import console
from kvbench.sinks.comparison import UNTESTED, comparisons
from kvbench.sinks.interleaved import interleaved_table
from kvbench.sinks.report import MD_FILE, write_report
from kvbench.sinks.tables import NO_INTERVAL, NOT_SIGNIFICANT, Column, value_text

P50 = Column("decode_ms_p50", "decode p50 ms", "{:.3f}", sampled=True)


def decode(kind, kv, prompt=64, job="0", **metrics):
    return {"job": job, "status": "ok", "metrics": metrics,
            "config": {"task": "bench", "model": {"name": "m", "num_heads": 8},
                       "attention": {"type": kind, "num_kv_heads": kv},
                       "workload": {"name": "decode", "prompt_len": prompt, "batch_size": 1}}}


def ci(value, low, high, key="decode_ms_p50"):
    return {key: value, f"{key}_ci_low": low, f"{key}_ci_high": high}


def test_a_value_shows_its_interval_only_where_the_record_has_one():
    assert value_text(decode("mha", 8, **ci(2.0, 1.9, 2.25)), P50) == "2.000 [1.900, 2.250]"
    assert value_text(decode("mha", 8, decode_ms_p50=2.0), P50) == "2.000"  # an older record
    assert value_text(decode("mha", 8, **ci(2.0, None, 2.25)), P50) == "2.000"


def test_a_ratio_of_separate_jobs_is_untested_whatever_their_own_intervals():
    """A job's own interval leaves out the drift between jobs: overlapping or not, with or without
    intervals, a ratio of two separate jobs makes no claim (and the side-by-side view shows no
    within-job interval to be read as one)."""
    records = [decode("mha", 8, job="0", **ci(10.0, 9.5, 10.5)),
               decode("gqa", 2, job="1", **ci(10.2, 9.8, 10.6)),  # overlaps MHA's interval
               decode("mqa", 1, job="2", **ci(5.0, 4.8, 5.2)),  # clear of it
               decode("gqa", 4, job="3", decode_ms_p50=7.0)]  # no interval
    [comparison] = comparisons(records)
    [cell] = comparison.cells
    text = {label: comparison.text(cell, label, P50) for label in comparison.variants}
    assert text == {"mha kv=8": "10.000", "gqa kv=4": f"7.000 (0.700×, {UNTESTED})",
                    "gqa kv=2": f"10.200 (1.02×, {UNTESTED})", "mqa kv=1": f"5.000 (0.500×, {UNTESTED})"}


def compare_record():
    rows = []
    for name, ms, slope, ratio, share in (("mha_kv8", 10.0, 400.0, None, 0.08), ("gqa_kv2", 9.0, 110.0, 0.27, 0.02),
                                          ("mqa_kv1", 9.9, 380.0, 0.95, 0.07)):
        row = {"variant": name, **ci(ms, ms - 0.1, ms + 0.2, "step_ms_ctx1024"), **ci(ms - 1, ms - 1.1, ms - 0.9,
               "step_ms_ctx512"), **ci(slope, slope - 20, slope + 30, "decode_us_per_1k_ctx"),
               "kv_bytes_ratio": {"mha_kv8": 1.0, "gqa_kv2": 0.25, "mqa_kv1": 0.125}[name], "kv_share_ctx1024": share}
        if ratio is None:
            row.update(ci(1.0, 1.0, 1.0, "slope_ratio"), **ci(1.0, 1.0, 1.0, "step_ratio_ctx1024"))
        else:
            row.update(ci(ratio, ratio - 0.1, ratio + 0.1, "slope_ratio"),
                       **ci(ms / 10, ms / 10 - 0.02, ms / 10 + 0.02, "step_ratio_ctx1024"))
        rows.append(row)
    return {"job": ".", "status": "ok", "config": {"task": "compare", "model": {"name": "m"},
                                                   "compare": {"contexts": [512, 1024]}},
            "metrics": {"rounds": 6}, "tables": {"compare": rows}}


def test_the_interleaved_table_shows_paired_ratios_and_their_significance():
    header, rows = interleaved_table(compare_record())
    assert header == ["variant", "step ms @512", "step ms @1024", "KV µs / 1k ctx", "slope ratio", "KV bytes ratio",
                      "step ratio @1024", "KV share @1024"]
    mha, gqa, mqa = rows
    assert mha == ["mha_kv8", "9.000 [8.900, 9.100]", "10.000 [9.900, 10.200]", "400.0 [380.0, 430.0]",
                   "1 (baseline)", "1.00×", "1 (baseline)", "8.0%"]
    assert gqa[4] == "0.270× [0.170, 0.370]" and gqa[5] == "0.250×"
    assert gqa[6] == "0.900× [0.880, 0.920]"
    # an interval that holds 1: the variants do not differ at this confidence
    assert mqa[4] == f"0.950× [0.850, 1.05], {NOT_SIGNIFICANT}" and mqa[6] == f"0.990× [0.970, 1.01], {NOT_SIGNIFICANT}"
    assert interleaved_table(decode("mha", 8, decode_ms_p50=1.0)) == ([], [])


def test_the_interleaved_table_shows_what_a_cache_adds_per_1k_tokens_and_a_state():
    """A Gated DeltaNet hybrid's row: its bytes per 1k tokens of context (its full layers' only)
    and its state per sequence, the K/V layouts' 0 B beside it."""
    record = compare_record()
    for row, per_1k, state in zip(record["tables"]["compare"], (8_192_000, 2_048_000, 1_024_000), (0, 0, 270_336)):
        row.update(kv_bytes_per_1k_ctx=per_1k, kv_state_bytes=state)
    header, rows = interleaved_table(record)
    assert header[-2:] == ["KV bytes / 1k ctx", "state / sequence"]
    assert [r[-2:] for r in rows] == [["7.81 MiB", "0 B"], ["1.95 MiB", "0 B"], ["1000.00 KiB", "264.00 KiB"]]
    for row in record["tables"]["compare"]:
        row["kv_state_bytes"] = 0
    assert interleaved_table(record)[0][-1] == "KV bytes / 1k ctx"  # no state: no column


def write(root, name, record):
    RunResult(status=record["status"], config=record["config"], metrics=record["metrics"],
              tables=record.get("tables", {})).write(root / name)


def test_the_report_shows_intervals_marks_overlap_and_lists_the_interleaved_comparison(tmp_path):
    write(tmp_path, "0", decode("mha", 8, **ci(10.0, 9.5, 10.5)))
    write(tmp_path, "1", decode("gqa", 2, **ci(10.2, 9.8, 10.6)))
    write(tmp_path, "2", compare_record())
    write_report(tmp_path, plots=False)
    md = (tmp_path / MD_FILE).read_text()
    assert f"10.200 (1.02×, {UNTESTED})" in md
    section = md.split("## Interleaved comparisons (task=compare)")[1].split("\n## ")[0]
    assert "### job 2: 6 rounds" in section and f"0.950× [0.850, 1.05], {NOT_SIGNIFICANT}" in section


def decode_plot_error_bars(tmp_path, records):
    """The report's decode-vs-context figure for ``records`` (it must be drawn) and the (low, high)
    span of every error bar on it, sorted."""
    for rec in records:
        write(tmp_path, rec["job"], rec)
    with saved_figures() as saved:
        report = write_report(tmp_path, tmp_path / "out")
    assert any(p.name == "decode_vs_context.png" for p in report.files)
    [fig] = [f for f in saved if f.get_suptitle().startswith("Decode latency")]
    bars = [c for ax in fig.axes for c in ax.collections if isinstance(c, LineCollection)]
    return fig, sorted(tuple(sorted(y for _, y in seg)) for bar in bars for seg in bar.get_segments())


def test_the_decode_plot_draws_error_bars_where_records_have_intervals(tmp_path):
    records = [decode("mha", 8, 32, "0", **ci(2.0, 1.8, 2.3)), decode("mha", 8, 64, "1", **ci(3.0, 2.9, 3.2)),
               decode("gqa", 2, 32, "2", decode_ms_p50=1.5), decode("gqa", 2, 64, "3", decode_ms_p50=1.7)]
    fig, spans = decode_plot_error_bars(tmp_path, records)
    # one error bar per MHA point (the GQA records have no interval), spanning its interval
    assert spans == [pytest.approx((1.8, 2.3)), pytest.approx((2.9, 3.2))]
    assert "95% interval" in fig.axes[0].get_ylabel() or any("95% interval" in t.get_text() for t in fig.texts)


def test_the_console_prints_the_interleaved_table():
    out = Console(file=io.StringIO(), width=250, highlight=False, color_system=None)
    out.print(console.variants_table(compare_record()))
    text = out.file.getvalue()
    assert "interleaved comparison: 6 rounds" in text
    header, rows = interleaved_table(compare_record())
    for cell in (*header, *rows[2]):
        assert cell in text


def test_an_interval_that_does_not_hold_its_point_is_drawn_not_refused(tmp_path):
    """A percentile-bootstrap interval of a p50 over few skewed steps can lie beside the p50
    (the GPU check's dry run once met one): the plot draws the side that exists, not a crash."""
    records = [decode("mha", 8, 32, "0", **ci(2.0, 2.1, 2.4)), decode("mha", 8, 64, "1", **ci(3.0, 2.9, 3.2))]
    _, spans = decode_plot_error_bars(tmp_path, records)
    assert spans == [pytest.approx((2.0, 2.4)), pytest.approx((2.9, 3.2))]


def test_no_ratio_of_a_timed_figure_reads_as_significant_without_intervals():
    """3 trials once marked GQA's TTFT 3.18x MHA's significant: with too few samples the records
    carry no interval (and the reason), and the ratio of separate jobs makes no claim; a paired
    task=compare ratio without an interval says it has none."""
    records = [decode("mha", 8, job="0", prefill_ms=2.0, prefill_ms_ci_low=None, prefill_ms_ci_high=None,
                      prefill_ms_ci_reason="3 timed trials: a 95% interval of the 50% quantile needs at least 6"),
               decode("gqa", 2, job="1", prefill_ms=6.36, prefill_ms_ci_low=None, prefill_ms_ci_high=None),
               decode("mqa", 1, job="2", kv_cache_bytes=100, prefill_ms=2.0)]
    [comparison] = comparisons(records)
    [cell] = comparison.cells
    ttft = Column("prefill_ms", "TTFT ms", "{:.2f}")  # declared by its records' null interval fields
    assert comparison.text(cell, "gqa kv=2", ttft) == f"6.36 (3.18×, {UNTESTED})"
    exact = Column("kv_cache_bytes", "KV", "{}")
    assert comparison.text(cell, "mqa kv=1", exact) == "100"  # bytes are exact: nothing to test
    header, rows = interleaved_table({"status": "ok", "config": {"compare": {"contexts": [64]}}, "tables": {"compare": [
        {"variant": "mha", "step_ms_ctx64": 1.0, "step_ratio_ctx64": 1.0},
        {"variant": "gqa", "step_ms_ctx64": 0.8, "step_ratio_ctx64": 0.8035, "step_ratio_ctx64_ci_low": None,
         "step_ratio_ctx64_ci_high": None}]}})
    assert rows[1][header.index("step ratio @64")] == f"0.803×, {NO_INTERVAL}"


def test_a_value_is_written_in_the_unit_its_record_declares():
    from kvbench.sinks.tables import spec_for

    column = Column("kv_cache_bytes", "KV cache", "bytes")
    rec = {"status": "ok", "schema_version": 2, "config": {}, "metrics": {"kv_cache_bytes": 3 * 2**20},
           "units": {"kv_cache_bytes": "bytes"}}
    assert value_text(rec, column) == "3.00 MiB" and spec_for(rec, column) == "bytes"
    # a unit other than bytes is a plain number; a record that declares none keeps the column's format
    assert value_text({**rec, "units": {"kv_cache_bytes": "count"}}, column) == "3,145,728"
    assert value_text({**rec, "units": {}}, column) == "3.00 MiB"
    ms = Column("decode_ms_p50", "decode p50 ms", "{:.3f}")
    assert value_text({**rec, "metrics": {"decode_ms_p50": 1.23456}, "units": {"decode_ms_p50": "ms"}}, ms) == "1.235"


def test_a_p90_far_above_the_medians_does_not_squash_the_lines(tmp_path):
    """Under load one point's p90 was 20x its median: the band set the axis and every line lay
    along the bottom. The axis now reaches 1.6x the highest median, and the cut band is marked."""
    from kvbench.sinks.plots import HEADROOM

    p50 = {("mha", 32): 2.0, ("mha", 64): 3.0, ("gqa", 32): 1.5, ("gqa", 64): 1.7}
    records = [decode(kind, kv, prompt, str(i), decode_ms_p50=p50[kind, prompt],
                      decode_ms_p90=p50[kind, prompt] * (20 if (kind, prompt) == ("gqa", 32) else 1.2))
               for i, (kind, kv, prompt) in enumerate([("mha", 8, 32), ("mha", 8, 64), ("gqa", 2, 32), ("gqa", 2, 64)])]
    for rec in records:
        write(tmp_path, rec["job"], rec)
    with saved_figures() as saved:
        write_report(tmp_path, tmp_path / "out")
    [fig] = [f for f in saved if f.get_suptitle().startswith("Decode latency")]
    [ax] = fig.axes
    bottom, top = ax.get_ylim()
    assert bottom == 0 and top == pytest.approx(HEADROOM * 3.0)  # not the 30 ms of the p90
    assert min(p50.values()) / top > 0.3  # every median in the upper two thirds' reach
    marks = [line for line in ax.get_lines() if line.get_marker() == "^"]
    assert [(list(m.get_xdata()), list(m.get_ydata())) for m in marks] == [([32], [pytest.approx(top)])]
    assert any("past the axis" in text.get_text() for legend in fig.legends for text in legend.get_texts())
    # a band within reach leaves the axis to matplotlib, as before: nothing cut, no mark
    records[2]["metrics"]["decode_ms_p90"] = 1.5 * 1.2
    write(tmp_path, "2", records[2])
    with saved_figures() as saved:
        write_report(tmp_path, tmp_path / "out")
    [fig] = [f for f in saved if f.get_suptitle().startswith("Decode latency")]
    assert not [line for line in fig.axes[0].get_lines() if line.get_marker() == "^"]
    assert fig.axes[0].get_ylim()[1] == pytest.approx(3.6, rel=0.1)
