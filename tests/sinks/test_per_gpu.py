"""The report's capacity per GPU section: a capacity record's tables.per_gpu, one row per split, and
nothing from a record that is not an ok capacity run or a row that lacks a figure."""

from kvbench.config.model import AttentionConfig
from kvbench.parallel.per_gpu import per_gpu_table
from kvbench.results import RunResult
from kvbench.sinks.per_gpu import markdown
from tests.conftest import tiny_model_config


def record(status="ok", task="capacity", rows=None):
    return RunResult(status=status, config={"task": task, "attention": {"type": "mqa", "num_kv_heads": 1}},
                     tables={"per_gpu": rows or []})


def test_a_capacity_records_splits_are_rows():
    model = tiny_model_config()
    attention = AttentionConfig(type="mqa").resolved(model)
    rows = per_gpu_table(model, attention, "float32", "auto", [64], 10 ** 6, 4)
    assert [r["split"] for r in rows] == ["DP=4", "TP=2 DP=2", "TP=4"]
    lines = markdown([record(rows=rows), record(status="error", rows=rows), record(task="bench", rows=rows),
                      record(rows=[{**rows[0], "kv_replication": None}])])
    table = [line for line in lines if line.startswith("| mqa")]
    assert len(table) == 3
    # MQA's one K/V head: every TP rank holds all of it (2 layers x K and V x 8 wide x 64 positions x 4 bytes = 8 KiB)
    assert all("| 8.00 KiB |" in line for line in table)
    assert [line.split(" | ")[6] for line in table] == ["1x", "2x", "4x"]
    assert markdown([record(status="invalid", rows=rows)]) == []
