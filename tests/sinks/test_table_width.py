"""Every kind of table the sinks print, laid out for a pipe (100 columns, no terminal): no line is
wider, and no header word or cell is broken across lines (rich wraps a cell a few characters at a
time where a table is too wide: ``slop / e / rati / o``). A table that does not fit is split into
several that repeat the columns naming a row."""

import io
import re

import pytest
from fake_sweep import build_sweep
from rich.console import Console, Group
from test_choose import capacity_record, chat_record, sweep
from test_intervals import ci, compare_record

from kvbench.sinks import console
from kvbench.sinks.grid import Grid
from kvbench.sinks.report import collect

WIDTH = 100


def render(renderables, width=WIDTH) -> str:
    out = Console(file=io.StringIO(), width=width, highlight=False, color_system=None)
    assert not out.is_terminal
    for item in renderables:
        out.print(item)
    return out.file.getvalue()


def grids(renderables):
    for item in renderables:
        if isinstance(item, Group):
            yield from (r for r in item.renderables if isinstance(r, Grid))
        elif isinstance(item, Grid):
            yield item


def assert_fits_unbroken(renderables, width=WIDTH):
    """No line wider than ``width``; each cell whole on one line; each header word whole on one line."""
    lines = render(renderables, width).splitlines()
    assert lines and max(map(len, lines)) <= width, max(lines, key=len)
    found = list(grids(renderables))
    assert found
    for grid in found:
        for row in grid.rows:
            for cell in row:
                text = getattr(cell, "plain", cell)
                assert any(text in line for line in lines), f"cell broken across lines: {text!r}"
        for word in (w for name in grid.header for w in name.split()) if grid.show_header else ():
            assert any(re.search(rf"(^|[\s│┃]){re.escape(word)}($|[\s│┃])", line) for line in lines), word
    return lines


def long_variant(job, **attention):
    rec = capacity_record(job, "gqa", 2, {128: 60, 256: 30}, {128: 61, 256: 31}, 1024, 1.5)
    rec["config"]["attention"].update(attention)
    return rec


@pytest.fixture(scope="module")
def sweep_records(tmp_path_factory):
    return collect(build_sweep(tmp_path_factory.mktemp("sweep")))


def test_the_sweep_tables_jobs_comparison_and_shared_ttft(sweep_records):
    tables = console.sweep_tables("kvbench sweep /some/multirun/2026-12-06/18-00-00", sweep_records)
    lines = assert_fits_unbroken(tables)
    assert any("attention variants side by side" in line for line in lines)
    assert any("multi-turn TTFT" in line for line in lines)
    # every job of the decode table is named in each table its columns are split into
    decode = [g for g in grids(tables) if g.title.endswith(": decode")][0]
    assert decode.header[:decode.keys] == ["job", "variant", "B", "prompt"]
    assert all([c.header for c in part.columns[:4]] == decode.header[:4] for part in decode.tables(WIDTH))


def test_a_wide_comparison_repeats_the_cell_and_metric_in_each_part():
    records = []
    for job, (kind, kv) in enumerate((("mha", 8), ("gqa", 4), ("gqa", 2), ("mqa", 1), ("gqa", 2))):
        attention = {"type": kind, "num_kv_heads": kv, **({"window": 1024, "global_every": 6} if job == 4 else {})}
        records.append({"job": str(job), "status": "ok", "metrics": {
            **ci(1.0 + job, 0.9 + job, 1.2 + job, "decode_ms_p50"), "prefill_ms": 3.0,
            "tokens_per_s": 1000.0 / (job + 1), "kv_cache_bytes": 4096 * kv, "noisy": True},
            "config": {"task": "bench", "model": {"name": "m", "num_heads": 8}, "attention": attention,
                       "workload": {"name": "decode", "prompt_len": 64, "batch_size": 1}}})
    tables = console.sweep_tables("S", records)
    lines = assert_fits_unbroken(tables)
    comparison = [g for g in grids(tables) if "side by side" in (g.title or "")][0]
    parts = comparison.tables(WIDTH)
    assert len(parts) > 1  # five variants with their ratios do not fit 100 columns
    assert all(p.columns[0].header == "metric" for p in parts)
    assert sum(len(p.columns) - 1 for p in parts) == len(comparison.header) - 1
    assert any("continued" in line for line in lines)


def test_the_choose_tables_with_every_optional_column():
    records = sweep()
    for rec, (kl, top1) in zip(records, [(0.0, 1.0), (0.0123, 0.9), (0.05, 0.75)]):
        rec["metrics"].update(kv_pool_kl_nats=kl, kv_pool_top1_agreement=top1, kv_state_bytes_per_sequence=0)
    gdn = long_variant(3, layer_types=["linear_attention"] * 3 + ["full_attention"])
    gdn["metrics"]["kv_state_bytes_per_sequence"] = 135_168
    hybrid = long_variant(4, window=64, global_every=4, kv_shared_layers=2, sinks=True)
    recall = [{"job": f"r{kv}", "status": "ok",
               "config": {"task": "recall", "attention": {"type": t, "num_kv_heads": kv}},
               "metrics": {"accuracy": acc, "accuracy_ci_low": acc - 0.01, "accuracy_ci_high": acc + 0.01}}
              for t, kv, acc in (("mha", 8, 0.99), ("mqa", 1, 0.5))]
    train = [{"job": "t", "status": "ok", "config": {"task": "train", "attention": {"type": "mha", "num_kv_heads": 8}},
              "metrics": {"perplexity": 12.5}}]
    chats = [chat_record(10, "mha", 8, False, 6), chat_record(11, "mha", 8, True, 20)]
    tables = console.sweep_tables("choose", records + [gdn, hybrid] + recall + train + chats)
    lines = assert_fits_unbroken(tables)
    # the choose table is split at 100 columns, its title printed once (the parts after it: "(continued)")
    assert sum("which attention to deploy" in line for line in lines) == 1
    assert any(line.strip() == "(continued)" for line in lines)


def _recall_record(kind, kv, per_seed, **attention):
    rows = [{"stage": "final", "kind": "mqar", "seq_len": 48, "num_pairs": p, "accuracy": sum(v) / len(v),
             "ci_low": 0.0, "ci_high": 1.0, "seeds": len(v), "per_seed": v, "chance": 1 / 32,
             "copy": (1 + (p - 1) / 32) / p} for p, v in per_seed.items()]
    return {"status": "ok", "job": kind, "tables": {"accuracy": rows},
            "config": {"task": "recall", "attention": {"type": kind, "num_kv_heads": kv, **attention},
                       "recall": {"kind": "mqar", "seeds": 3}, "train": {"steps": 9}},
            "metrics": {"kv_bytes_per_token": 128 * kv, "decode_ms_p50": 0.5, "kv_state_bytes_per_sequence": 64}}


def test_the_recall_table_of_many_variants():
    seeds = {4: [1.0, 0.9, 0.95], 8: [0.5, 0.6, 0.55], 16: [0.1, 0.2, 0.15]}
    records = [_recall_record("mha", 4, seeds), _recall_record("gqa", 2, seeds), _recall_record("mqa", 1, seeds),
               _recall_record("mha", 4, seeds, window=8),
               _recall_record("mha", 4, seeds, layer_types=["linear_attention", "full_attention"])]
    assert_fits_unbroken(console.sweep_tables("recall", records))


def test_a_compare_records_table_with_a_window_and_no_interval():
    record = compare_record()
    for row in record["tables"]["compare"]:
        row.update(**ci(120.0, 100.0, 140.0, "decode_us_per_1k_ctx_below_w"),
                   **ci(-30.0, -50.0, 10.0, "decode_us_per_1k_ctx_past_w"), kv_bytes_per_1k_ctx_past_w=65536,
                   kv_bytes_per_1k_ctx=131072, kv_state_bytes=4096, slope_ratio_past_w=-0.682,
                   slope_ratio_past_w_ci_reason="2 rounds: a 95% interval of the 50% quantile needs at least 6")
    record["metrics"]["window_split_ctx"] = 768
    for row, label in zip(record["tables"]["compare"], ("mha kv=8", "gqa kv=2", "mqa kv=1")):
        row["layout"] = label
    table = console.variants_table(record)
    lines = assert_fits_unbroken([table])
    text = "\n".join(lines)
    # each variant by its label, as its progress line names it, not its metric prefix (gqa_kv2)
    assert [row[0] for row in table.rows] == ["mha kv=8", "gqa kv=2", "mqa kv=1"] and "gqa_kv2" not in text
    # what the reader needs to read the figures: why there is no interval, why a figure is negative
    assert "no interval: 2 rounds: a 95% interval" in " ".join(text.split())
    assert "negative µs / 1k ctx" in text


def test_the_run_tables_and_the_turn_tables():
    run = {"status": "ok", "config": {"task": "bench", "model": {"name": "gemma3n_e4b"},
                                      "attention": {"type": "gqa", "num_kv_heads": 2, "window": 512,
                                                    "global_every": 5, "kv_shared_layers": 15, "sinks": True},
                                      "workload": {"name": "decode", "prompt_len": 4096, "batch_size": 64}},
           "metrics": {**ci(123.456, 120.0, 130.5, "decode_ms_p50"), **ci(98765.4, 95000.1, 99999.9, "tokens_per_s"),
                       "noisy": True, "noisy_reason": "load average 7.93 before, 8.41 after on 2 usable CPUs " * 3}}
    turns = {"status": "ok", "config": {"task": "bench", "cache": {"shared": True}, "workload": {"name": "multiturn"}},
             "tables": {"turns": [{"turn": t, "ttft_ms": 12345.67, "prefill_tokens": 1234567, "reused_tokens": 7654321,
                                   "context_tokens": 123456, "decode_ms_p50": 1234.567, "kv_cache_bytes": 10 ** 12,
                                   "kv_cache_bytes_formula": 10 ** 12} for t in range(1, 4)]}}
    chats = {"status": "ok", "config": {"task": "bench", "workload": {"name": "conversations"}},
             "tables": {"conversation_turns": [
                 {"turn": t, "turns": 1000, "ttft_ms_p50": 12345.67, "ttft_ms_p90": 23456.78, "prefix_hit_rate": 0.5,
                  "cached": 900, "evicted": 100, "ttft_ms_p50_cached": 1234.5, "ttft_ms_p50_evicted": 23456.7}
                 for t in range(1, 4)]}}
    lines = assert_fits_unbroken([console.run_table(run), console.turns_table(turns),
                                  console.conversation_turns_table(chats)])
    assert any("gqa kv=2 w=512 4:1 sinks kvshare=15" in line for line in lines)


def test_a_table_narrower_than_its_key_columns_still_breaks_no_word_of_its_header():
    grid = Grid("t", ["a very long header of many words", "b"], [["x", "y"]])
    assert_fits_unbroken([grid], width=30)
