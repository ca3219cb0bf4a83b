"""The typed view of a record (kvbench/sinks/views.py) against hand-built records of every layout: each
variant's label, the order the tables list them in, the units of its metrics; an old-schema
record read the same way; a record with missing keys read with clear absent values."""

import json
import random
from pathlib import Path

import pytest

from kvbench.config.layer_pattern import LayerPattern
from kvbench.config.model import AttentionConfig
from kvbench.metrics import matches
from kvbench.results import RENAMED_IN_3, RunResult
from kvbench.sinks.views import (
    NONE_IS_VALUE_KEYS,
    VARIANT_COLUMNS,
    VARIANT_KEYS,
    RecordView,
    Variant,
    ordered,
    v1_units,
)
from kvbench.tasks.common import variant_label
from kvbench.units_v1 import V1_UNITS


def record(attention, model=None, cache=None, workload="decode", **extra):
    return {"status": "ok", "schema_version": 2,
            "config": {"task": "bench", "model": {"name": "small", "num_heads": 8, **(model or {})},
                       "attention": attention, "cache": {"impl": "static", **(cache or {})},
                       "workload": {"name": workload}},
            "metrics": {"decode_ms_p50": 1.5, "kv_cache_bytes": 4096, "mha_kv8_step_ms_ctx256": 2.0},
            "units": {"decode_ms_p50": "ms", "kv_cache_bytes": "bytes", "<v>_step_ms_ctx<C>": "ms"}, **extra}


# (attention, cache, expected label), in the order every table lists them.
LAYOUTS = [
    ({"type": "mha", "num_kv_heads": 8}, {}, "mha kv=8"),
    ({"type": "mha", "num_kv_heads": 8}, {"dtype": "int8"}, "mha kv=8 int8"),
    ({"type": "mha", "num_kv_heads": 8, "window": 4096, "global_every": 2}, {}, "mha kv=8 w=4096 1:1"),
    ({"type": "mha", "num_kv_heads": 8, "window": 4096}, {}, "mha kv=8 w=4096"),
    ({"type": "gqa", "num_kv_heads": 4}, {}, "gqa kv=4"),
    ({"type": "gqa", "num_kv_heads": 2}, {}, "gqa kv=2"),
    ({"type": "gqa", "num_kv_heads": 2, "window": 1024, "global_every": 6}, {}, "gqa kv=2 w=1024 5:1"),
    ({"type": "gqa", "num_kv_heads": 2, "window": 1024,
      "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}, {"dtype": "int8"}, "gqa kv=2 w=1024 5:1 int8"),
    ({"type": "gqa", "num_kv_heads": 2, "window": 256}, {}, "gqa kv=2 w=256"),
    ({"type": "mqa", "num_kv_heads": 1}, {}, "mqa kv=1"),
    ({"type": "mqa", "num_kv_heads": 1}, {"dtype": "float8_e4m3fn"}, "mqa kv=1 float8_e4m3fn"),
    ({"type": "mla", "num_kv_heads": 1, "kv_lora_rank": 64, "qk_rope_head_dim": 16}, {}, "mla r=64"),
    ({"type": "mla", "num_kv_heads": 1, "kv_lora_rank": 32, "qk_rope_head_dim": 16}, {}, "mla r=32"),
    ({"type": "mla", "num_kv_heads": 1, "kv_lora_rank": 32, "qk_rope_head_dim": 16}, {"dtype": "int8"},
     "mla r=32 int8"),
]


@pytest.mark.parametrize("attention, cache, label", LAYOUTS, ids=[label for _, _, label in LAYOUTS])
def test_each_layout_has_its_label_and_fields(attention, cache, label):
    view = RecordView(record(attention, cache=cache))
    v = view.variant
    assert v.label == label
    assert v.layout == attention["type"] and v.num_kv_heads == attention["num_kv_heads"] and v.num_heads == 8
    assert v.kv_lora_rank == attention.get("kv_lora_rank") and v.qk_rope_head_dim == attention.get("qk_rope_head_dim")
    assert v.pattern.window == attention.get("window") and v.cache_dtype == cache.get("dtype") and v.model == "small"
    assert v.pattern.has_local == ("window" in attention) and v.quantized == ("dtype" in cache)


def test_the_order_comes_from_the_fields_not_the_labels():
    variants = [RecordView(record(a, cache=c)).variant for a, c, _ in LAYOUTS]
    shuffled = variants[:]
    random.Random(0).shuffle(shuffled)
    assert [v.label for v in ordered(shuffled)] == [label for _, _, label in LAYOUTS]
    # the key is the fields': a label that sorts otherwise as text keeps its place (kv=16 before kv=2)
    assert [v.label for v in ordered([Variant("gqa", num_kv_heads=2), Variant("gqa", num_kv_heads=16)])] == [
        "gqa kv=16", "gqa kv=2"]


def test_the_layout_is_derived_from_the_head_counts_where_the_type_is_not_named():
    assert [Variant.from_config({"model": {"num_heads": 8}, "attention": {"type": "model", "num_kv_heads": kv}}).layout
            for kv in (8, 2, 1)] == ["mha", "gqa", "mqa"]
    assert Variant.from_config({"attention": {"kv_lora_rank": 16}}).label == "mla r=16"


def test_a_chat_names_its_shared_cache_and_orders_unshared_first():
    on, off = (RecordView(record({"type": "gqa", "num_kv_heads": 2}, cache={"shared": s}, workload="multiturn"))
               for s in (True, False))
    assert on.kind == "multiturn" and on.shared is True and off.shared is False
    assert on.variant == off.variant  # sharing is a chat's own axis in the tables
    assert on.variant.with_sharing(on.shared).label == "gqa kv=2 shared=on"
    assert [v.label for v in ordered([on.variant.with_sharing(True), off.variant.with_sharing(False)])] == [
        "gqa kv=2 shared=off", "gqa kv=2 shared=on"]


def test_the_progress_label_is_the_variants_label():
    for attention in (AttentionConfig(type="gqa", num_kv_heads=2, window=1024, global_every=6),
                      AttentionConfig(type="mla", kv_lora_rank=32), AttentionConfig(type="mqa", num_kv_heads=1)):
        assert variant_label(attention) == Variant.of_attention(attention).label
    hybrid = AttentionConfig(type="gqa", num_kv_heads=2, window=1024, global_every=6)
    assert variant_label(hybrid) == "gqa kv=2 w=1024 5:1"


def test_units_come_from_the_record_including_patterns():
    view = RecordView(record({"type": "mha", "num_kv_heads": 8}))
    assert view.unit("decode_ms_p50") == "ms" and view.unit("kv_cache_bytes") == "bytes"
    assert view.unit("mha_kv8_step_ms_ctx256") == "ms"  # from the pattern <v>_step_ms_ctx<C>
    assert view.unit("never_recorded") is None
    assert matches("<v>_step_ms_ctx<C>", "gqa_kv2_step_ms_ctx4096") and not matches("<v>_step_ms_ctx<C>", "step_ms")


def test_an_old_schema_record_is_read_with_its_units_by_name_not_from_its_text():
    old = {"status": "ok", "config": {"task": "bench", "attention": {"type": "gqa", "num_kv_heads": 2},
                                      "workload": {"name": "decode"}},
           "metrics": {"decode_ms_p50": 1.0, "timing_method": "perf_counter", "made_up_ms": 2.0},
           # the text is deliberately wrong: the unit comes from the name, never from the line
           "methods": {"decode_ms_p50": "s; median decode step", "timing_method": "text; how it was timed",
                       "mqa_kv1_step_ms_ctx1024": "a line", "made_up_ms": "ms; a metric kvbench never declared"}}
    view = RecordView(old)
    assert view.schema_version == 1 and view.variant.label == "gqa kv=2"
    assert view.unit("decode_ms_p50") == "ms" and view.unit("timing_method") == "text"
    assert view.unit("mqa_kv1_step_ms_ctx1024") == "ms"  # a pattern's name
    assert view.unit("made_up_ms") is None
    assert v1_units({"x": "ms; a method"}) == {}


TASKS = [("bench", "decode"), ("bench", "multiturn"), ("bench", "serving"), ("train", "decode"),
         ("eval", "decode"), ("capacity", "decode"), ("compare", "decode"), ("recall", "decode")]


@pytest.mark.parametrize("task,workload", TASKS)
def test_the_schema_1_units_agree_with_the_registry(task, workload):
    from kvbench.jobs.runner import task_metrics

    declared = task_metrics(task, workload)
    v1 = {RENAMED_IN_3.get(n, n): unit for n, unit in V1_UNITS.items()}  # an old name reads as its new one
    assert {n: v1[n] for n in declared if n in v1} == {n: m.unit for n, m in declared.items() if n in v1}


def test_every_committed_schema_1_record_gets_the_units_its_methods_lines_name():
    """The committed old records as the reference: the head of each methods line (``"ms; ..."``)
    is the unit the record was written with; the view's unit, by name, must equal it."""
    root = Path(__file__).resolve().parents[1] / "experiments" / "results"
    checked = 0
    for path in sorted(root.rglob("results.json")):
        rec = json.loads(path.read_text())
        if rec.get("schema_version", 1) >= 2:
            continue
        view = RecordView(rec)
        for name, text in rec.get("methods", {}).items():
            head, sep, _ = text.partition("; ")
            if sep and len(head) <= 40:
                assert view.unit(RENAMED_IN_3.get(name, name)) == head, (path, name)
                checked += 1
    assert checked > 100


def test_a_schema_2_record_reads_its_renamed_metrics_under_their_schema_3_names():
    root = Path(__file__).resolve().parents[1] / "experiments" / "results"
    rec = json.loads((root / "recall" / "mqar" / "0" / "results.json").read_text())  # a CPU run: no energy figure
    assert rec["schema_version"] == 2
    rec["units"]["energy_window_s"] = "s"  # the unit a schema-2 decode record wrote under the old name
    rec["metrics"]["energy_window_s"] = 1.5
    view = RecordView(rec)
    assert view.metric("energy_span_s") == 1.5 and view.metric("energy_window_s") is None
    assert view.unit("energy_span_s") == "s" and "energy_window_s" not in view.units
    assert view.to_dict() == rec  # handed on as written
    eval_v2 = {"status": "ok", "schema_version": 2, "metrics": {"eval_tokens_per_window": 64},
               "units": {"eval_tokens_per_window": "tokens"}, "null_reasons": {"eval_tokens_per_window": "why"}}
    view = RecordView(eval_v2)
    assert view.number("eval_seq_len") == 64 and view.unit("eval_seq_len") == "tokens"
    assert dict(view.null_reasons) == {"eval_seq_len": "why"}
    v1 = {"status": "ok", "metrics": {"energy_window_s": 2.0}, "methods": {"energy_window_s": "s; the span"}}
    assert RecordView(v1).unit("energy_span_s") == "s" and RecordView(v1).number("energy_span_s") == 2.0
    current = {"status": "ok", "schema_version": 3, "metrics": {"energy_window_s": 1.0}}
    assert RecordView(current).metric("energy_window_s") == 1.0  # only an older record's names change


def test_a_runresult_reads_through_the_view_too():
    result = RunResult(status="ok", config={"attention": {"type": "mqa", "num_kv_heads": 1}},
                       metrics={"tokens_per_s": 10.0}, tables={"turns": [{"turn": 0, "ttft_ms": 1.0}]})
    view = RecordView.of(result)
    assert RecordView.of(view) is view
    assert view.number("tokens_per_s") == 10.0 and view.table("turns")[0]["ttft_ms"] == 1.0
    assert view.variant.label == "mqa kv=1"


@pytest.mark.parametrize("data", [{}, {"status": "missing"}, {"status": "ok", "config": None, "metrics": None},
                                  {"status": "error", "config": {"attention": {}}, "tables": {"turns": None}},
                                  "not a mapping"])
def test_missing_keys_read_as_clear_absent_values(data):
    view = RecordView(data)
    assert view.status in ("?", "missing", "ok", "error") and view.job is None and view.error is None
    assert view.metric("decode_ms_p50") is None and view.number("decode_ms_p50") is None
    assert view.interval("decode_ms_p50") is None and view.unit("decode_ms_p50") is None
    assert view.series("decode_ms") == [] and view.table("turns") == [] and view.implausible == []
    assert view.get("attention.num_kv_heads") is None and view.kv_conversion is None
    assert view.task == "bench" and view.kind == "decode" and view.shared is None
    assert view.variant.layout is None and view.variant.label == "None kv=None"


def test_the_view_is_read_only():
    view = RecordView(record({"type": "mha", "num_kv_heads": 8}))
    with pytest.raises(TypeError):
        view.metrics["decode_ms_p50"] = 0  # type: ignore[index]
    with pytest.raises(TypeError):
        view.config["task"] = "train"  # type: ignore[index]
    assert view.number("decode_ms_p50") == 1.5


def test_a_job_records_each_metrics_unit_from_the_registry(tmp_path):
    from conftest import BENCH_OVERRIDES, compose

    from kvbench.jobs.runner import run_job, task_metrics
    from kvbench.results import SCHEMA_VERSION, read_record

    run_job(compose("wandb.mode=disabled", *BENCH_OVERRIDES, "workload.prompt_len=16", "workload.gen_len=4",
                    "runtime.warmup=0", "runtime.repeats=1"), tmp_path)
    record = read_record(tmp_path)
    declared = task_metrics("bench", "decode")
    assert record.schema_version == SCHEMA_VERSION == 3 and record.units
    assert record.units == {name: declared[name].unit for name in record.methods if name in declared}
    view = RecordView(record)
    assert view.unit("decode_ms_p50") == "ms" and view.unit("kv_cache_bytes") == "bytes"
    assert all(view.unit(name) == declared[name].unit for name in record.metrics if name in declared)


def test_the_workloads_sizes_are_typed():
    view = RecordView({"status": "ok", "config": {"workload": {"name": "decode", "batch_size": 2, "prompt_len": 16,
                                                               "gen_len": 4}}})
    assert (view.workload, view.batch_size, view.prompt_len, view.gen_len, view.positions_held) == (
        "decode", 2, 16, 4, 20)
    odd = RecordView({"status": "ok", "config": {"workload": {"prompt_len": "16", "gen_len": True}}})
    assert odd.prompt_len is None and odd.gen_len is None and odd.positions_held is None


# (attention, cache.dtype, model.num_layers) of every kind of layout, for the derived properties.
KINDS = {
    "mha": ({"type": "mha", "num_kv_heads": 8}, None, 4),
    "gqa": ({"type": "gqa", "num_kv_heads": 2}, None, 4),
    "mqa": ({"type": "mqa", "num_kv_heads": 1}, None, 4),
    "mla": ({"type": "mla", "num_kv_heads": 1, "kv_lora_rank": 32, "qk_rope_head_dim": 16}, None, 4),
    "mla windowed": ({"type": "mla", "num_kv_heads": 1, "kv_lora_rank": 32, "window": 16}, None, 4),
    "windowed": ({"type": "mha", "num_kv_heads": 8, "window": 64}, None, 4),
    "local/global": ({"type": "gqa", "num_kv_heads": 2, "window": 32, "global_every": 6}, None, 12),
    "local/global by layer_types": ({"type": "gqa", "num_kv_heads": 2, "window": 32,
                                     "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}, None, 4),
    "window, every layer global": ({"type": "gqa", "num_kv_heads": 2, "window": 32, "global_every": 1}, None, 4),
    "gated deltanet": ({"type": "gqa", "num_kv_heads": 2,
                        "layer_types": ["linear_attention"] * 3 + ["full_attention"]}, None, 4),
    "gated deltanet + window": ({"type": "gqa", "num_kv_heads": 2, "window": 32, "layer_types": [
        "sliding_attention", "linear_attention", "full_attention", "linear_attention"]}, None, 4),
    "quantized": ({"type": "mha", "num_kv_heads": 8}, "int8", 4),
    "quantized mla": ({"type": "mla", "num_kv_heads": 1, "kv_lora_rank": 32}, "float8_e4m3fn", 4),
    "auto dtype": ({"type": "mqa", "num_kv_heads": 1}, "auto", 4),
    "quantized windowed": ({"type": "gqa", "num_kv_heads": 2, "window": 32, "global_every": 2}, "int8", 4),
}


def _whole_context_by_hand(attention, num_layers):
    """Every layer attends over the whole context: no window, or one that no layer applies."""
    if not attention.get("window"):
        return True
    if "layer_types" in attention:
        return "sliding_attention" not in attention["layer_types"]
    every = attention.get("global_every")
    return bool(every) and all((i + 1) % every == 0 for i in range(num_layers))


@pytest.mark.parametrize("name", KINDS)
def test_the_derived_properties_agree_with_the_fields_they_come_from(name):
    attention, dtype, num_layers = KINDS[name]
    v = RecordView(record(attention, model={"num_layers": num_layers}, cache={"dtype": dtype})).variant
    whole = _whole_context_by_hand(attention, num_layers)
    heads = attention["type"] != "mla" and "kv_lora_rank" not in attention
    state = "linear_attention" in attention.get("layer_types", ())
    assert v.full_context is whole and v.full_context is not v.pattern.has_local
    # the layout as such: a label of nothing else (a window no layer applies, linear layers: not plain)
    assert v.plain is (not attention.get("window") and not state and dtype in (None, "auto"))
    assert v.counts_kv_heads is heads
    assert v.stateful is state
    assert v.ranked_by_kv_heads is (heads and whole and not state)
    assert v.named is True


def test_the_derived_properties_by_name():
    v = {name: RecordView(record(a, model={"num_layers": n}, cache={"dtype": d})).variant
         for name, (a, d, n) in KINDS.items()}
    assert [name for name in KINDS if v[name].full_context] == [
        "mha", "gqa", "mqa", "mla", "window, every layer global", "gated deltanet", "quantized", "quantized mla",
        "auto dtype"]
    assert [name for name in KINDS if v[name].plain] == ["mha", "gqa", "mqa", "mla", "auto dtype"]
    assert [name for name in KINDS if not v[name].counts_kv_heads] == ["mla", "mla windowed", "quantized mla"]
    assert [name for name in KINDS if v[name].stateful] == ["gated deltanet", "gated deltanet + window"]
    assert [name for name in KINDS if v[name].ranked_by_kv_heads] == [
        "mha", "gqa", "mqa", "window, every layer global", "quantized", "auto dtype"]


def test_a_config_names_a_variant_by_any_of_its_layout_count_or_rank():
    assert not Variant.from_config({}).named and not Variant.from_config({"attention": {"window": 8}}).named
    assert Variant.from_config({"attention": {"type": "gqa"}}).named
    assert Variant.from_config({"attention": {"num_kv_heads": 2}}).named
    assert Variant.from_config({"attention": {"kv_lora_rank": 16}}).named
    assert Variant(None, kv_lora_rank=16).named and not Variant(None, pattern=LayerPattern(window=8)).named


def test_the_variant_columns_and_none_keys_are_variant_keys_and_the_tables_use_them():
    from kvbench.sinks.tables import AXES, VARIANT_AXES

    assert set(NONE_IS_VALUE_KEYS) <= set(VARIANT_KEYS) and {k for k, _ in VARIANT_COLUMNS} <= set(VARIANT_KEYS)
    assert AXES[1:1 + len(VARIANT_COLUMNS)] == list(VARIANT_COLUMNS)
    assert VARIANT_AXES == [*VARIANT_COLUMNS, ("cache.dtype", "KV dtype")]
