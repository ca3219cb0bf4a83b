"""The sinks read records only through kvbench.sinks.views: every layout named and ordered in the
side-by-side table and the plots' palette from its fields; a schema-1 record on disk reported
with its units; records with missing keys read by every sink without a KeyError."""

import json

import pytest

from kvbench.results import RESULTS_FILE
from kvbench.sinks import console, dashboard, recall, tracking
from kvbench.sinks.choose import choices
from kvbench.sinks.comparison import comparisons
from kvbench.sinks.plots import palette, variants_of
from kvbench.sinks.report import collect, write_report
from kvbench.sinks.tables import variant
from kvbench.sinks.views import RecordView

# (attention, cache dtype, label), in the order the tables list them
LAYOUTS = [
    ({"type": "mha", "num_kv_heads": 8}, "auto", "mha kv=8"),
    ({"type": "mha", "num_kv_heads": 8}, "int8", "mha kv=8 int8"),
    ({"type": "mha", "num_kv_heads": 8, "window": 64}, "auto", "mha kv=8 w=64"),
    ({"type": "gqa", "num_kv_heads": 2}, "auto", "gqa kv=2"),
    ({"type": "gqa", "num_kv_heads": 2, "window": 64, "global_every": 6}, "auto", "gqa kv=2 w=64 5:1"),
    ({"type": "mqa", "num_kv_heads": 1}, "auto", "mqa kv=1"),
    ({"type": "mla", "num_kv_heads": 1, "kv_lora_rank": 32, "qk_rope_head_dim": 8}, "auto", "mla r=32"),
]


def decode_record(job, attention, dtype, kv_bytes, ms):
    return {"job": str(job), "status": "ok", "schema_version": 2,
            "config": {"task": "bench", "model": {"name": "small", "num_heads": 8}, "attention": attention,
                       "cache": {"impl": "static", "dtype": dtype},
                       "workload": {"name": "decode", "batch_size": 1, "prompt_len": 128, "gen_len": 8}},
            "metrics": {"decode_ms_p50": ms, "kv_cache_bytes": kv_bytes, "tokens_per_s": 1000 / ms},
            "units": {"decode_ms_p50": "ms", "kv_cache_bytes": "bytes", "tokens_per_s": "tokens/s"}}


@pytest.fixture
def every_layout():
    # the records in reverse: the order comes from the fields, not the input
    return [decode_record(i, a, d, 1024 * (len(LAYOUTS) - i), 1.0 + i) for i, (a, d, _) in enumerate(LAYOUTS)][::-1]


def test_the_side_by_side_table_names_and_orders_every_layout(every_layout, tmp_path):
    [comparison] = comparisons(every_layout)
    assert comparison.variants == [label for _, _, label in LAYOUTS]
    header, rows, _ = comparison.table()
    kv_row = next(r for r in rows if r[len(header) - len(LAYOUTS) - 1] == "KV cache")
    # the hybrid's cell is its own record's value and ratio to MHA (1024 * 7 bytes), in binary units
    hybrid = header.index("gqa kv=2 w=64 5:1")
    assert kv_row[hybrid] == "3.00 KiB (0.429×)"
    report = write_report(tmp_path, records=every_layout, plots=False)
    md = (tmp_path / "summary.md").read_text()
    assert "| mha kv=8 | mha kv=8 int8 | mha kv=8 w=64 | gqa kv=2 | gqa kv=2 w=64 5:1 | mqa kv=1 | mla r=32 |" in md
    assert report.counts() == {"ok": len(LAYOUTS)}


def test_the_palette_gives_windowed_and_quantized_variants_their_own_colours(every_layout):
    colours = palette(list(variants_of(every_layout).values()))
    assert list(colours) == [label for _, _, label in LAYOUTS]  # the palette's order is the variants'
    assert colours["mha kv=8"] == "tab:blue" and colours["mqa kv=1"] == "tab:red"
    assert len(set(colours.values())) == len(LAYOUTS)  # a windowed MHA is not plain MHA's blue


def test_a_schema_1_record_on_disk_is_reported_with_its_units(tmp_path):
    old = {"status": "ok", "config": {"task": "bench", "attention": {"type": "gqa", "num_kv_heads": 2},
                                      "workload": {"name": "decode", "prompt_len": 16}},
           "metrics": {"kv_cache_bytes": 2048, "decode_ms_p50": 1.5},
           "methods": {"kv_cache_bytes": "bytes; the cache's tensors, allocated", "decode_ms_p50": "ms; median step"},
           "schema_version": 1}
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / RESULTS_FILE).write_text(json.dumps(old))
    [rec] = collect(tmp_path)
    view = RecordView(rec)
    assert view.schema_version == 1 and view.unit("kv_cache_bytes") == "bytes" and variant(rec) == "gqa kv=2"
    write_report(tmp_path, plots=False)
    assert "2.00 KiB" in (tmp_path / "summary.md").read_text()
    assert tracking.run_config(view)["units"] == {"kv_cache_bytes": "bytes", "decode_ms_p50": "ms"}


SPARSE = [
    {"job": "0", "status": "ok"},
    {"job": "1", "status": "ok", "config": {"task": "capacity"}, "metrics": {"max_batch_longest": 4}},
    {"job": "2", "status": "ok", "config": {"task": "recall", "attention": {"type": "mqa"}}, "tables": {}},
    {"job": "3", "status": "ok", "config": {"task": "bench", "workload": {"name": "multiturn"},
                                            "cache": {"shared": True}}, "tables": {"turns": []}},
    {"job": "4", "status": "missing", "config": {}, "metrics": {}, "error": "no results.json"},
    {"job": "5", "status": "ok", "config": {"task": "compare"}, "metrics": {"rounds": 2}},
]


def test_records_with_missing_keys_reach_every_sink_without_a_key_error(tmp_path):
    tables = console.sweep_tables("sweep", SPARSE)
    assert tables and all(t.row_count >= 0 for t in tables)
    report = write_report(tmp_path, records=SPARSE)  # the plots too: each says why it is not drawn
    assert report.counts() == {"ok": 5, "missing": 1} and "ttft_per_turn" in report.skipped_plots
    assert choices(SPARSE)[0].recommendations  # a capacity job without its table still says something
    assert recall.groups(SPARSE) == []
    board = dashboard.build(SPARSE, "multirun/x")
    assert board.group == "x"
    for rec in SPARSE:
        summary = tracking.run_summary(RecordView(rec))
        assert summary["status"] == rec["status"] and tracking.run_config(RecordView(rec))["units"] == {}
        console.run_table(rec)
        assert console.record_notes(rec) == []


def test_a_compare_records_table_has_a_column_per_context_it_timed(tmp_path):
    from conftest import compose

    from kvbench.jobs.runner import run_job
    from kvbench.sinks.interleaved import interleaved_table

    record = run_job(compose("wandb.mode=disabled", "task=compare", "model=tiny", "model.max_seq_len=64",
                             "runtime.threads=1", "compare.variants=[mha,mqa]", "compare.contexts=[8,4,16]",
                             "compare.steps=2", "runtime.warmup=0", "runtime.repeats=2"), tmp_path)
    assert record.status == "ok", record.error
    header, rows = interleaved_table(record)
    assert header[1:4] == ["step ms @4", "step ms @8", "step ms @16"]
    assert [r[0] for r in rows] == ["mha kv=8", "mqa kv=1"]  # the variants' labels, not their metric prefixes
    assert RecordView(record).unit("mqa_kv1_step_ms_ctx16") == "ms"  # the registry's pattern, recorded


def test_a_runs_w_and_b_name_is_its_variants_label():
    config = {"model": {"name": "gemma3"}, "attention": {"type": "gqa", "num_kv_heads": 2, "window": 1024,
                                                         "global_every": 6}, "workload": {"name": "decode"}}
    assert tracking.short_name(config) == "gemma3 gqa kv=2 w=1024 5:1 decode"
    mla = {"model": {"name": "deepseek"}, "attention": {"type": "mla", "num_kv_heads": 1, "kv_lora_rank": 512},
           "cache": {"dtype": "int8"}, "task": "capacity"}
    assert tracking.short_name(mla) == "deepseek mla r=512 int8 capacity"


@pytest.mark.parametrize("attention, label", [
    ({"type": "gqa", "full_attention_interval": 4}, "gqa kv=2 gdn 3:1"),
    ({"type": "gqa", "full_attention_interval": 4, "num_kv_heads": 1}, "gqa kv=1 gdn 3:1"),
    ({"type": "mha", "window": 64, "global_every": 4}, "mha kv=8 w=64 3:1"),
    ({"type": "mqa"}, "mqa kv=1")])
def test_an_invalid_jobs_record_is_named_by_its_layout(attention, label):
    """An invalid job's record keeps the attention as the user wrote it, never resolved (issue 59: the refused
    GDN shared chat read 'gqa kv=None'): its label is what resolving it gives, the preset's KV heads for gqa and
    the layers of full_attention_interval."""
    rec = {"status": "invalid", "config": {"task": "capacity", "attention": attention,
                                           "model": {"num_layers": 8, "num_heads": 8, "preset_kv_heads": 2}}}
    assert RecordView.of(rec).variant.label == label
