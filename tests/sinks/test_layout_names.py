"""A sweep over attention=mha,gqa,mqa,mla x attention.window=null,256 side by side: eight
variants under eight names (kvbench.config.layer_pattern.variant_label, the one name), in ATTENTION_TYPES'
order with each windowed variant after its full one, the ratios to MHA without a window, and a
job table whose W column tells a windowed job from a full one."""

from kvbench.sinks.comparison import comparisons
from kvbench.sinks.tables import job_axes, job_cells, swept_axes, variant

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
