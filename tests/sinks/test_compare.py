"""The comparison a person came for, against the records: every value of the side-by-side view
and its ratio recomputed from the records themselves; the baseline when a cell has no MHA;
duplicate configs and failed variants said, not hidden; columns per kind of job."""

import pytest
from fake_sweep import VARIANTS, build_sweep, decode_ms

from kvbench.results import lookup
from kvbench.sinks.comparison import comparisons
from kvbench.sinks.report import collect
from kvbench.sinks.tables import (
    COLUMNS,
    fmt,
    job_columns,
    natural,
    ratio_text,
    swept_axes,
    value_text,
    variant,
)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return collect(build_sweep(tmp_path_factory.mktemp("sweep")))


def record(kind, kv, prompt, status="ok", job="0", heads=8, **metrics):
    return {"job": job, "status": status, "metrics": metrics,
            "config": {"task": "bench", "model": {"num_heads": heads},
                       "attention": {"type": kind, "num_kv_heads": kv},
                       "workload": {"name": "decode", "prompt_len": prompt, "batch_size": 1}}}


def test_every_value_and_ratio_is_the_records_own(records):
    [comparison] = comparisons(records)
    assert comparison.kind == "decode" and comparison.variants == ["mha kv=8", "gqa kv=2", "mqa kv=1"]
    assert [t for _, t in comparison.axes] == ["B", "prompt"]
    by_key = {(lookup(r["config"], "workload.batch_size"), lookup(r["config"], "workload.prompt_len"), variant(r)): r
              for r in records if r["status"] == "ok" and r["config"]["workload"]["name"] == "decode"}
    checked = 0
    for cell in comparison.cells:
        for column in comparison.columns:
            for label in comparison.variants:
                rec = by_key.get((*cell.values, label))
                if rec is None or column.key not in rec["metrics"]:
                    continue
                mha = by_key[(*cell.values, "mha kv=8")]["metrics"][column.key]
                expected = fmt(rec["metrics"][column.key], column.spec)
                if label != "mha kv=8":
                    # a timed figure of separate jobs is not tested
                    mark = ", untested" if column.sampled else ""
                    expected += f" ({rec['metrics'][column.key] / mha:#.3g}×{mark})"
                assert comparison.text(cell, label, column) == expected
                checked += 1
    assert checked == 2 * 2 * 3 * 4  # B x prompt x variants x (TTFT, decode p50, tok/s, KV bytes)
    # the ratio of KV bytes is the ratio of KV heads (the records' bytes follow the formula)
    cell = next(c for c in comparison.cells if c.values == [2, 32])
    kv = next(c for c in comparison.columns if c.key == "kv_cache_bytes")
    assert [comparison.ratio(cell, f"{k} kv={h}", kv) for k, h in VARIANTS.items()] == [None, 2 / 8, 1 / 8]
    decode = next(c for c in comparison.columns if c.key == "decode_ms_p50")
    assert comparison.ratio(cell, "mqa kv=1", decode) == pytest.approx(decode_ms(1, 32) / decode_ms(8, 32))


def test_rows_name_their_cell_once_and_ratios_say_their_baseline():
    recs = [record("gqa", 4, 64, job="0", decode_ms_p50=2.0), record("gqa", 2, 64, job="1", decode_ms_p50=1.0),
            record("mqa", 1, 64, job="2", decode_ms_p50=0.5), record("mha", 8, 128, job="3", decode_ms_p50=4.0),
            record("mqa", 1, 128, job="4", decode_ms_p50=1.0), record("gqa", 2, 128, status="oom", job="5")]
    [comparison] = comparisons(recs)
    header, rows, starts = comparison.table()
    # prompt 64 has no MHA: its ratios are to its variant with the most KV heads, and the table says so
    assert header == ["prompt", "ratio to", "metric", "mha kv=8", "gqa kv=4", "gqa kv=2", "mqa kv=1"]
    assert rows == [["64", "gqa kv=4", "decode p50 ms", "", "2.000", "1.000 (0.500×, untested)",
                     "0.500 (0.250×, untested)"],
                    ["128", "mha kv=8", "decode p50 ms", "4.000", "", "oom", "1.000 (0.250×, untested)"]]
    assert starts == [0, 1]
    assert "the row's MHA, else its variant with the most KV heads" in comparison.title()


def test_jobs_of_one_config_are_repeats_shown_as_their_median_and_counted():
    """Two jobs of one config (two sweeps reported together, or runtime.seed swept) repeat it: the
    cell shows their median and a jobs row says how many; too few repeats to test stay untested."""
    recs = [record("mha", 8, 64, job="0", decode_ms_p50=2.0), record("mqa", 1, 64, job="1", decode_ms_p50=1.0),
            record("mqa", 1, 64, job="2", decode_ms_p50=9.0), record("mqa", 1, 64, "oom", job="3")]
    [comparison] = comparisons(recs)
    assert comparison.notes == []
    _, rows, _ = comparison.table()
    assert rows == [["decode p50 ms", "2.000", "5.000 (2.50×, untested)"], ["jobs", "1", "2 of 3 ok"]]
    assert any(line.startswith("jobs: each value is the median") for line in comparison.legend())


def test_no_comparison_without_two_variants_in_one_cell():
    one_variant = [record("mha", 8, 64, decode_ms_p50=1.0), record("mha", 8, 128, job="1", decode_ms_p50=1.0)]
    apart = [record("mha", 8, 64, decode_ms_p50=1.0), record("gqa", 2, 128, job="1", decode_ms_p50=1.0)]
    assert comparisons(one_variant) == [] and comparisons(apart) == []


def test_each_kind_has_its_own_columns(records):
    decode = [r for r in records if r["config"].get("workload", {}).get("name") == "decode"]
    chat = [r for r in records if r["config"].get("workload", {}).get("name") == "multiturn"]
    decode_keys = {c.key for c in job_columns(decode, "decode")}
    assert {"decode_ms_p50", "kv_cache_bytes", "prefill_ms"} <= decode_keys
    assert not decode_keys & {"turn1_ttft_ms", "mean_ttft_ms_turns_2_n", "perplexity", "val_loss"}
    assert [c.key for c in job_columns(chat, "multiturn")] == ["turn1_ttft_ms", "mean_ttft_ms_turns_2_n"]
    assert {c.key for c in COLUMNS["train"]} >= {"perplexity", "ppl_before_uptrain", "val_loss"}
    assert "compile_s" in {c.key for c in COLUMNS["decode"]}
    # decode rows keep no chat axis: the records say nothing about chat keys
    assert [k for k, _ in swept_axes(decode)] == ["attention.type", "attention.num_kv_heads",
                                                  "workload.batch_size", "workload.prompt_len"]


def test_numbers_are_written_so_small_ones_stay_readable():
    percent = next(c for c in COLUMNS["decode"] if c.key == "percent_of_peak")
    assert value_text({"metrics": {"percent_of_peak": 0.0123}}, percent) == "0.0123"
    assert value_text({"metrics": {"percent_of_peak": 87.456}}, percent) == "87.5"
    assert value_text({"metrics": {}}, percent) == "-"
    assert [ratio_text(r) for r in (0.125, 0.25, 1.0, 4.0, 12.34, 123.4, None)] == \
        ["0.125×", "0.250×", "1.00×", "4.00×", "12.3×", "123×", ""]
    assert sorted(["10", "2", "1", "0", "11"], key=natural) == ["0", "1", "2", "10", "11"]
    assert sorted(["prompt=256", "prompt=64", "B=8"], key=natural) == ["B=8", "prompt=64", "prompt=256"]


def test_cache_dtype_is_a_variant_axis():
    """{MHA, MQA} x {auto, int8}: four variants of one cell, the unquantized MHA the baseline, and
    the KV-bytes ratios those of the records (heads x precision); the KV dtype is no cell axis."""
    def rec(kind, kv, cache_dtype, job, kv_bytes):
        r = record(kind, kv, 64, job=job, kv_cache_bytes=kv_bytes, decode_ms_p50=1.0)
        r["config"]["cache"] = {"impl": "static", "dtype": cache_dtype}
        return r

    per_head = {"auto": 8 * 4, "int8": 8 + 4}  # head_dim 8: float32 elements, or int8 codes + a scale
    records = [rec(kind, kv, d, str(i), kv * per_head[d])
               for i, (kind, kv, d) in enumerate([("mqa", 1, "int8"), ("mha", 8, "int8"),
                                                   ("mha", 8, "auto"), ("mqa", 1, "auto")])]
    [comparison] = comparisons(records)
    assert comparison.variants == ["mha kv=8", "mha kv=8 int8", "mqa kv=1", "mqa kv=1 int8"]
    assert "cache.dtype" not in [k for k, _ in comparison.axes]
    [cell] = comparison.cells
    assert cell.baseline() == "mha kv=8"
    kv = next(c for c in comparison.columns if c.key == "kv_cache_bytes")
    assert [comparison.ratio(cell, label, kv) for label in comparison.variants] == [
        None, 12 / 32, 1 / 8, 12 / (8 * 32)]
    assert variant(records[2]) == "mha kv=8" and variant(records[1]) == "mha kv=8 int8"
