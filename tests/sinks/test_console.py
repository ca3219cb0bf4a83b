"""The terminal: the end-of-sweep tables (one per kind of job, in job order, the variants side by
side last) rendered as a person reads them, and progress lines where there is no terminal."""

import io
import sys

import pytest
from fake_sweep import build_sweep, decode_ms
from rich.console import Console

from kvbench.sinks import console
from kvbench.sinks.report import collect


def render(tables) -> str:
    out = Console(file=io.StringIO(), width=200, highlight=False, color_system=None)
    for table in tables:
        out.print(table)
    return out.file.getvalue()


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    records = collect(build_sweep(tmp_path_factory.mktemp("sweep")))
    return render(console.sweep_tables("kvbench sweep S", list(reversed(records))))


def test_sweep_tables_are_per_kind_in_job_order_and_end_with_the_comparison(text):
    titles = [line.strip() for line in text.splitlines() if line.startswith(("kvbench sweep", "decode:", "multi-turn"))]
    assert titles == ["kvbench sweep S: decode", "kvbench sweep S: multi-turn chat",
                      "decode: attention variants side by side, value (ratio to mha kv=8 of the same row)",
                      "multi-turn TTFT: cache.shared=false vs true"]
    decode = text.split("kvbench sweep S: decode")[1].split("kvbench sweep S: multi-turn chat")[0]
    jobs = [line.split("│")[1].strip() for line in decode.splitlines() if line.startswith("│")]
    assert jobs == ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "17"]
    assert "TTFT turn 1" not in decode and "shared" not in decode  # decode rows carry no chat column
    compared = text.split("decode: attention variants side by side")[1].split("multi-turn TTFT")[0]
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in compared.splitlines() if line.startswith("│")]
    first = rows.index(next(r for r in rows if r[:3] == ["1", "16", "TTFT ms"]))
    mha, gqa, mqa = (decode_ms(kv, 16) for kv in (8, 2, 1))
    # the cell's axes on its first row only; every variant of it side by side with its ratio to MHA
    # separate jobs: the timed ratios are untested, and the legend under the table says why
    assert rows[first + 1] == ["", "", "decode p50 ms", f"{mha:.3f}", f"{gqa:.3f} ({gqa / mha:#.3g}×, untested)",
                               f"{mqa:.3f} ({mqa / mha:#.3g}×, untested)"]
    assert "untested: separate jobs, whose own intervals leave out the drift between jobs" in compared


def test_run_table_shows_only_what_the_job_measured():
    record = {"status": "ok", "config": {"task": "bench", "attention": {"type": "gqa", "num_kv_heads": 2},
                                         "workload": {"name": "decode", "prompt_len": 64, "batch_size": 1,
                                                      "system_len": 512, "turns": 4},
                                         "cache": {"impl": "static", "shared": True}, "train": {"steps": 1000}},
              "metrics": {"decode_ms_p50": 1.5, "percent_of_peak": 0.004, "compile_s": 12.5}}
    out = render([console.run_table(record)])
    for absent in ("system", "turns", "shared", "train steps"):  # a decode run's record ignores them
        assert f"│ {absent} " not in out
    assert "│ % BW peak " in out and "0.004" in out and "│ compile s " in out and "12.5" in out


def test_run_table_prints_the_records_warnings_and_why_it_is_noisy():
    record = {"status": "ok", "config": {"task": "bench", "workload": {"name": "decode"}},
              "metrics": {"decode_ms_p99": 2.0, "decode_ms_p99_n": 12, "noisy": True,
                          "decode_ms_p99_warning": "decode_ms_p99 from 12 samples: too few",
                          "noisy_reason": "load average 5.00 on 2 usable CPUs", "prefill_ms_warning": None}}
    out = render([console.run_table(record)])
    assert "decode_ms_p99 from 12 samples: too few" in out and "load average 5.00 on 2 usable CPUs" in out
    assert "│ noisy " in out and "True" in out and "prefill_ms_warning" not in out


def test_progress_prints_lines_where_there_is_no_terminal(monkeypatch):
    captured = Console(file=io.StringIO(), width=200)
    monkeypatch.setattr(console, "stderr", captured)
    assert not captured.is_terminal
    with console.trial_progress("train", 25) as tick:
        for step in range(25):
            tick(description=f"loss {step}")
    lines = captured.file.getvalue().splitlines()
    # every 25 // 10 = 2 ticks, and the last
    assert [line.split(" (")[0] for line in lines] == [f"  train: {n}/25 loss {n - 1}" for n in [*range(2, 25, 2), 25]]


def test_a_jobs_progress_without_a_terminal_is_a_line_per_tenth_of_the_way_with_what_each_tick_says(monkeypatch):
    """What a job is handed when stderr is a log (``progress_bar``): the start, a line every ~1/10 of
    the way naming the round (a long preset was a ``0/77`` line for minutes), and the end. Counted in
    ticks: a tick a minute after the last line prints too, which no test here waits for."""
    captured = Console(file=io.StringIO(), width=200)
    monkeypatch.setattr(console, "stderr", captured)
    with console.progress_bar("compare mha,gqa", 20) as tick:
        for n in range(1, 21):
            tick(description=f"compare: round {n}/20")
    lines = [line.split(" (")[0] for line in captured.file.getvalue().splitlines()]
    assert lines[0] == "  compare mha,gqa: 0/20"
    assert lines[1:-1] == [f"  compare mha,gqa: {n}/20 compare: round {n}/20" for n in range(2, 20, 2)]
    assert lines[-1].startswith("  compare mha,gqa: 20/20 in ") and lines[-1].endswith(" s")


def test_piped_output_is_laid_out_at_100_columns_or_what_COLUMNS_says(monkeypatch):
    assert console.piped_width({}) == console.PIPED_WIDTH == 100
    assert console.piped_width({"COLUMNS": "80"}) == 80 and console.piped_width({"COLUMNS": " 132 "}) == 132
    for junk in ("", "wide", "-1", "0", "5", "10**9"):  # not a width: the default, not a crash
        assert console.piped_width({"COLUMNS": junk}) == 100
    # what kvbench's own consoles get where stdout and stderr are a pipe or a file
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.delenv("COLUMNS", raising=False)
    assert console._console(False).width == console._console(True).width == 100
    monkeypatch.setenv("COLUMNS", "80")
    assert console._console(False).width == console._console(True).width == 80


def test_the_sweep_tables_fit_the_piped_width(tmp_path):
    """The fake sweep's tables (two axes, three variants, a chat) at the piped width: rich wraps a
    long cell inside its column, so no line is wider than the output."""
    records = collect(build_sweep(tmp_path))
    out = Console(file=io.StringIO(), width=console.piped_width({}), highlight=False, color_system=None)
    for table in console.sweep_tables(f"kvbench sweep {tmp_path}", records):
        out.print(table)
    lines = out.file.getvalue().splitlines()
    assert max(map(len, lines)) <= 100 and any("attention variants side by side" in line for line in lines)


def test_a_long_noisy_reason_is_a_line_under_the_run_table_not_a_wide_value_column():
    reason = ("load average 7.93 before, 8.41 after on 2 usable CPUs: more runnable work than CPUs around the job "
              "(timings are unreliable; rerun on an idle machine)")
    record = {"status": "ok", "config": {"task": "bench", "workload": {"name": "decode", "prompt_len": 128}},
              "metrics": {"decode_ms_p50": 0.474, "noisy": True, "noisy_reason": reason,
                          "decode_ms_p99_warning": "decode_ms_p99 from 24 samples: fewer than the 100 p99 needs"}}
    out = Console(file=io.StringIO(), width=100, highlight=False, color_system=None)
    out.print(console.run_table(record))
    lines = out.file.getvalue().splitlines()
    table = [line for line in lines if line.startswith("│")]
    # the values sit next to their keys: the table is as wide as its longest value, not the reason
    assert table and max(map(len, table)) < 40
    assert next(line for line in table if "decode p50 ms" in line).rstrip().endswith("0.474 │")
    notes = " ".join(line for line in lines if not line.startswith(("│", "┏", "┃", "┡", "└", "┗", "kvbench")))
    assert "noisy_reason: load average 7.93" in notes and "rerun on an idle machine" in notes
    assert "decode_ms_p99_warning: decode_ms_p99 from 24 samples" in notes and max(map(len, lines)) <= 100
