"""A sweep over attention=mha,gqa,mqa,mla x attention.window=null,256 side by side: eight
variants under eight names (kvbench.config.layer_pattern.variant_label, the one name), in ATTENTION_TYPES'
order with each windowed variant after its full one, the ratios to MHA without a window, and a
job table whose W column tells a windowed job from a full one. Then the one label of a job, as its
progress line, result table, summary.md, sweep line and inspect print it."""

import io
from dataclasses import asdict

import pytest
from conftest import compose
from rich.console import Console

from kvbench.cli_job import job_line
from kvbench.config.layer_pattern import job_variant_label
from kvbench.jobs.job_config import to_bench_config
from kvbench.results import RunResult, record_config
from kvbench.sinks import console
from kvbench.sinks.comparison import comparisons
from kvbench.sinks.report import write_report
from kvbench.sinks.tables import job_axes, job_cells, swept_axes, variant
from kvbench.tasks.inspect import describe

LAYOUTS = [("mha", 16, None), ("gqa", 4, None), ("mqa", 1, None), ("mla", 1, 256)]


def record(job, kind, kv, rank, window, global_every=None, ms=1.0):
    attention = {"type": kind, "num_kv_heads": kv, "kv_lora_rank": rank, "window": window,
                 "global_every": global_every, "layer_types": None}
    return {"job": str(job), "status": "ok", "metrics": {"decode_ms_p50": ms},
            "config": {"task": "bench", "model": {"num_heads": 16, "num_layers": 6}, "attention": attention,
                       "workload": {"name": "decode", "prompt_len": 512, "batch_size": 1}}}


def sweep():
    out, job = [], 0
    for window in (None, 256):
        for i, (kind, kv, rank) in enumerate(LAYOUTS):
            out.append(record(job, kind, kv, rank, window, ms=10.0 - i - (window is not None)))
            job += 1
    return out


def test_eight_variants_side_by_side_under_distinct_names():
    records = sweep()
    [comparison] = comparisons(records)
    assert comparison.variants == ["mha kv=16", "mha kv=16 w=256", "gqa kv=4", "gqa kv=4 w=256", "mqa kv=1",
                                   "mqa kv=1 w=256", "mla r=256", "mla r=256 w=256"]
    cell = comparison.cells[0]
    assert cell.baseline() == "mha kv=16"  # the ratios are to MHA without a window
    assert len(cell.jobs) == 8


def test_the_job_table_tells_a_windowed_job_from_a_full_one():
    records = sweep()
    axes = job_axes(records, swept_axes(records))
    assert ("attention.window", "W") in axes
    cells = [job_cells(r, axes, [])[0] for r in records]
    assert len({tuple(c) for c in cells}) == 8  # no two jobs look the same


def test_a_hybrid_is_named_by_its_local_to_global_layers():
    assert variant(record(0, "gqa", 4, None, 1024, global_every=6)) == "gqa kv=4 w=1024 5:1"
    assert variant(record(0, "gqa", 4, None, 1024, global_every=2)) == "gqa kv=4 w=1024 1:1"


# ---- the one label: progress line, result table, summary.md, sweep line, inspect ------------------------

# Each asked for a layout the result table once named "attn mha, kv 8" (only the progress line said more)
ASKED = [(("attention.full_attention_interval=2",), "mha kv=8 gdn 1:1"),
         (("attention=mla", "attention.kv_lora_rank=16", "attention.index_topk=64"), "mla r=16 topk=64"),
         (("model.num_layers=4", "attention.kv_shared_layers=1"), "mha kv=8 kvshare=1"),
         (("attention.sinks=true",), "mha kv=8 sinks"),
         (("cache.dtype=int8",), "mha kv=8 int8")]


def _text(renderable, width=100) -> str:
    out = Console(file=io.StringIO(), width=width, highlight=False, color_system=None)
    out.print(renderable)
    return out.file.getvalue()


@pytest.mark.parametrize("overrides, label", ASKED)
def test_the_layout_asked_for_is_named_as_the_progress_line_names_it(tmp_path, overrides, label):
    job = to_bench_config(compose("model=tiny", "workload.prompt_len=16", *overrides))
    assert job_variant_label(job) == label  # what the job's progress line prints
    record = RunResult("ok", record_config(asdict(job)), metrics={"decode_ms_p50": 1.0})
    rows = dict([c.strip() for c in line.split("│")[1:-1]] for line in _text(console.run_table(record.to_dict()))
                .splitlines() if line.startswith("│"))
    assert rows["variant"] == label and "attn" not in rows and "kv" not in rows
    record.write(tmp_path / "0")
    write_report(tmp_path, plots=False)
    summary = (tmp_path / "summary.md").read_text()
    assert "| job | variant | status |" in summary and f"| 0 | {label} | ok |" in summary
    assert "1 job: 1 ok." in summary  # one job, not "1 jobs"
    line = job_line(2, "5", list(overrides), job).plain
    assert line == f"kvbench job 3/5: {' '.join(overrides)} ({label})"
    assert f"variant: {label} " in describe(job)


def test_a_sweep_line_keeps_a_lists_brackets_and_two_orders_of_layers_read_apart():
    overrides = [["attention.window=8", f"attention.layer_types=[{a},{b}]"]
                 for a, b in (("sliding_attention", "full_attention"), ("full_attention", "sliding_attention"))]
    jobs = [to_bench_config(compose("model=tiny", *o)) for o in overrides]
    lines = [_text(job_line(n, "2", o, job)) for n, (o, job) in enumerate(zip(overrides, jobs))]
    # rich read "[sliding_attention,full_attention]" as a markup tag: both lines said "attention.layer_types="
    assert "attention.layer_types=[sliding_attention,full_attention]" in lines[0].replace("\n", " ")
    assert "attention.layer_types=[full_attention,sliding_attention]" in lines[1].replace("\n", " ")
    assert job_line(0, "2", [], None).plain == "kvbench job 1/2: (defaults)"  # an invalid config: no label
    records = [RunResult("ok", record_config(asdict(job)), metrics={"decode_ms_p50": 1.0}).to_dict() | {"job": str(n)}
               for n, job in enumerate(jobs)]
    # one label for both (w=8 1:1): the table shows their layer types, one letter a layer
    text = _text(console.sweep_tables("S", records)[0])
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if line.startswith("│")]
    assert [r[:3] for r in rows] == [["0", "mha kv=8 w=8 1:1", "sf"], ["1", "mha kv=8 w=8 1:1", "fs"]]
