"""What kvbench and its experiment scripts print to a pipe, where a person reads it 100 columns wide:
`--help` (its model presets were one line of 245), the W&B publish line (135), an experiment's
Markdown report (capacity_report.py printed rows of 1,358 characters). No line is wider; a table is
split, never a cell; the files keep their full Markdown."""

import io
import re
import sys
from pathlib import Path

import pytest
from rich.console import Console

from kvbench.cli_help import HELP_FILE, app_config_groups, listed_groups, render
from kvbench.cli_sweep import publish_text
from kvbench.sinks.dashboard import publish_commands
from kvbench.sinks.grid import Grid, from_markdown
from kvbench.sinks.markdown import md_text

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 100


def pipe() -> Console:
    out = Console(file=io.StringIO(), width=WIDTH, highlight=False, color_system=None)
    assert not out.is_terminal
    return out


def test_help_fits_100_columns_and_lists_every_option_of_every_group():
    text = render()
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    # the groups are written into the template (Hydra's $APP_CONFIG_GROUPS is one line per group):
    # joined back, they are exactly the config directory's options
    assert listed_groups(text) == app_config_groups()
    assert "$APP_CONFIG_GROUPS" not in HELP_FILE.read_text()
    model = next(line for line in text.splitlines() if line.startswith("model: "))
    assert "deepseek_v3," in model and len(model) <= WIDTH


def test_an_option_added_to_conf_and_not_to_the_help_is_caught(tmp_path):
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    for name in ("tiny", "small", "a_new_model"):
        (conf / "model" / f"{name}.yaml").write_text("{}\n")
    assert app_config_groups(conf) == "model: a_new_model, small, tiny\n"
    assert listed_groups("Groups (group=option; ...):\nmodel: small,\n  tiny\n\nfooter") == "model: small, tiny\n"


def test_the_publish_commands_are_a_line_each():
    sweep_dir = Path("multirun/2026-12-06/18-00-00")  # Hydra's default, as the sweep prints it
    text = publish_text(sweep_dir, runs_online=False)
    assert text.splitlines() == ["publish it to W&B with:", *(f"  {c}" for c in publish_commands(sweep_dir))]
    out = pipe()
    out.print(text, markup=False, soft_wrap=True)
    assert max(len(line) for line in out.file.getvalue().splitlines()) <= WIDTH
    assert publish_text(sweep_dir, runs_online=True).splitlines()[1:] == [f"  kvbench-dashboard {sweep_dir}"]


def markdown_report():
    header = ["model", "variant", "KV precision", *(f"figure {i} with a long header" for i in range(12)), "note"]
    rows = [["gpt_oss_120b", "gqa kv=8 w=128 1:1 sinks", p, *(f"{i * 1234.5:,.1f} KiB" for i in range(12)), "a | b"]
            for p in ("auto", "int8")]
    return "\n".join(["# A report", "", "A sentence " * 30, "",
                      "| " + " | ".join(header) + " |", "|---|---|---|" + "---:|" * 12 + "---|",
                      *("| " + " | ".join(md_text(c) for c in row) + " |" for row in rows), "", "after"]), header, rows


def test_a_markdown_report_prints_as_tables_that_fit():
    text, header, rows = markdown_report()
    items = from_markdown(text, keys=3)
    [grid] = [i for i in items if isinstance(i, Grid)]
    assert grid.header == header and grid.rows == rows  # "a \\| b" read back as the text it is
    assert grid._right == frozenset(range(3, 15))
    out = pipe()
    for item in items:
        out.print(item, markup=False)
    lines = out.file.getvalue().splitlines()
    assert max(map(len, lines)) <= WIDTH and len(grid.tables(WIDTH)) > 1
    for row in rows:
        assert all(any(cell in line for line in lines) for cell in row)
    assert all(any(line.startswith(f"│ {row[0]} │ {row[1]} │ {row[2]}") for line in lines) for row in rows)


def test_an_experiments_report_file_keeps_the_markdown_and_its_print_fits(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        import _common
    finally:
        sys.path.remove(str(ROOT / "experiments"))
    out = pipe()
    monkeypatch.setattr(_common, "stdout", out)
    text = markdown_report()[0]
    _common.write_report(tmp_path / "report.md", text, keys=3)
    assert (tmp_path / "report.md").read_text() == text
    printed = out.file.getvalue().splitlines()
    assert max(map(len, printed)) <= WIDTH and printed[-1] == f"wrote {tmp_path / 'report.md'}"


@pytest.mark.parametrize("script", ["capacity_report.py"])
def test_the_script_prints_through_write_report(script):
    """The script's terminal output is write_report's (its Markdown laid out to the width), not a print of its own."""
    source = (ROOT / "experiments" / script).read_text()
    assert "print(" not in source and "write_report(out, " in source


# ---- smaller: units, counts, what a table's cell says it is -----------------------------------------

def _conversation(job, **workload):
    turns = {"dist": "uniform", "mean": 4, "cv": 0.5, "lo": 2, "hi": 6}
    return {"job": job, "status": "ok", "metrics": {"ttft_ms_p99": 3.0, "tpot_ms_p99": 0.5},
            "config": {"task": "bench", "attention": {"type": "mha", "num_kv_heads": 8},
                       "workload": {"name": "conversations", "arrival": "poisson", "sharegpt": None, "turns": turns,
                                    **workload}}}


def _rows(renderable):
    out = pipe()
    out.print(renderable)
    return {cells[0]: cells[1] for cells in ([c.strip() for c in line.split("│")[1:-1]]
                                             for line in out.file.getvalue().splitlines() if line.startswith("│"))}


def test_a_conversation_jobs_turns_say_where_they_came_from_and_tpot_has_its_unit():
    from kvbench.sinks import console

    synthetic = _rows(console.run_table(_conversation("0")))
    assert synthetic["turns"] == "uniform 4 (2-6)"  # was {'dist': 'uniform', 'mean': 4, ...}
    serving = {"status": "ok", "config": {"task": "bench", "workload": {"name": "serving"}},
               "metrics": {"tpot_ms_p99": 0.5}}
    assert _rows(console.run_table(serving))["p99 TPOT ms"] == "0.50"  # was "p99 TPOT", no unit
    assert _rows(console.run_table(_conversation("1", sharegpt="/data/sharegpt.json")))["turns"] == \
        "from workload.sharegpt"
    assert _rows(console.run_table(_conversation("2", arrival="trace")))["turns"] == "from workload.trace"
    from kvbench.sinks.tables import axis_text  # a sweep's flattened column reads the same
    assert axis_text(_conversation("1", sharegpt="/data/sg.json"), "workload.turns.mean") == "from workload.sharegpt"


def test_a_compare_jobs_summary_row_has_its_noisy_column_and_notes(tmp_path):
    sys.path.insert(0, str(ROOT / "tests" / "sinks"))
    try:
        from test_intervals import compare_record
    finally:
        sys.path.remove(str(ROOT / "tests" / "sinks"))
    from kvbench.sinks.report import write_report

    record = compare_record()
    record["metrics"]["noisy"] = True
    for row in record["tables"]["compare"][1:]:
        row.update(slope_ratio=-0.682, slope_ratio_ci_low=None, slope_ratio_ci_high=None, decode_us_per_1k_ctx=-40.0,
                   slope_ratio_ci_reason="4 rounds: a 95% interval of the 50% quantile needs at least 6")
    write_report(tmp_path, records=[record], plots=False)
    md = (tmp_path / "summary.md").read_text()
    assert "| job | status | rounds | noisy |" in md and "| . | ok | 6 | True |" in md
    assert "- no interval: 4 rounds: a 95% interval of the 50% quantile needs at least 6" in md
    assert "- a negative µs / 1k ctx" in md and "1 job: 1 ok." in md


def test_choose_names_only_a_plot_that_was_drawn(tmp_path):
    sys.path.insert(0, str(ROOT / "tests" / "sinks"))
    try:
        from test_choose import sweep
    finally:
        sys.path.remove(str(ROOT / "tests" / "sinks"))
    from kvbench.results import RunResult
    from kvbench.sinks.report import write_report

    for i, rec in enumerate(sweep()):
        RunResult(status="ok", config=rec["config"], metrics=rec["metrics"], tables=rec["tables"]).write(
            tmp_path / str(i))
    write_report(tmp_path, plots=False)
    assert "capacity_vs_context.png" not in (tmp_path / "summary.md").read_text()
    write_report(tmp_path)
    assert "(`capacity_vs_context.png` plots it)" in (tmp_path / "summary.md").read_text()


# ---- end to end: what the commands of the issue print to a pipe -------------------------------------

@pytest.mark.e2e
def test_the_commands_print_nothing_wider_than_a_pipe(tmp_path):
    """task=inspect of a model with sinks, a sweep over two orders of layers and a run of a layout
    option, each printed to a pipe: no line past 100 columns, the layout named as the progress line
    names it, the overrides as written, and inspect leaves no directory behind."""
    from conftest import kvbench_forked

    tiny = ["model=tiny", "workload.prompt_len=12", "workload.gen_len=6", "runtime.warmup=1", "runtime.repeats=2",
            "wandb.mode=disabled", "runtime.isolate=false"]
    (tmp_path / "i").mkdir()
    (tmp_path / "s").mkdir()
    inspect, sweep, single = kvbench_forked([
        (["task=inspect", "model=gpt_oss_120b"], tmp_path / "i"),
        (["-m", *tiny, "attention.window=4", "attention.layer_types=[sliding_attention,full_attention],"
                                             "[full_attention,sliding_attention]"], tmp_path / "s"),
        ([*tiny, "attention.full_attention_interval=2", f"hydra.run.dir={tmp_path / 'r'}"], tmp_path)])
    for proc in (inspect, sweep, single):
        assert proc.returncode == 0, proc.stdout + proc.stderr
        # a line naming a path is as long as the path (pytest's own is long): the others fit
        lines = [line for line in (proc.stdout + proc.stderr).splitlines() if str(tmp_path) not in line]
        assert max(map(len, lines)) <= WIDTH, max(lines, key=len)
    assert "variant: gqa kv=8 w=128 1:1 sinks" in inspect.stdout and list((tmp_path / "i").iterdir()) == []
    joined = " ".join(sweep.stderr.split())
    assert "attention.layer_types=[sliding_attention,full_attention] (mha kv=8 w=4 1:1)" in joined
    assert "attention.layer_types=[full_attention,sliding_attention] (mha kv=8 w=4 1:1)" in joined
    assert "#0 :" not in sweep.stdout + sweep.stderr  # the launcher's own line of every override, once more
    assert re.search(r"│ 0 +│ mha kv=8 w=4 1:1 +│ sf +│", sweep.stdout), sweep.stdout
    assert "mha kv=8 gdn 1:1: 0/" in single.stderr  # the progress line, and the result table's row
    assert re.search(r"│ variant +│ +mha kv=8 gdn 1:1 │", single.stdout), single.stdout
