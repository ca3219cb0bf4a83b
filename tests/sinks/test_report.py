"""The local report over a sweep directory with ok, invalid, oom, missing and unreadable jobs:
rows and columns against the records written, plot data against the same records, PNGs with one
colour per attention variant and the legend clear of every panel, and kvbench-report's messages
for a missing or empty directory."""

import csv
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import matplotlib.image
import pytest
from conftest import saved_figures
from fake_sweep import BATCHES, GEN, PROMPTS, TURN_TTFT, VARIANTS, bench, build_sweep, decode_ms, hydra_files
from kv_formula import kv_cache_bytes
from matplotlib.backends.backend_agg import FigureCanvasAgg

from kvbench.cli_tools import report_main as main
from kvbench.config.layer_pattern import LayerPattern
from kvbench.results import RunResult
from kvbench.sinks.comparison import LEGEND, UNTESTED
from kvbench.sinks.plots import (
    MHA_COLOUR,
    MQA_COLOUR,
    config_value,
    metric,
    palette,
    panels,
    per_token,
    positions_held,
    turn_panels,
)
from kvbench.sinks.report import CSV_FILE, MD_FILE, collect, write_report
from kvbench.sinks.tables import swept_axes
from kvbench.sinks.views import RecordView, Variant
from kvbench.units import human_bytes

PNGS = {"decode_vs_context", "kv_bytes_vs_heads", "kv_memory", "tokens_vs_batch", "ttft_per_turn"}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    return build_sweep(tmp_path_factory.mktemp("multirun") / "2026-01-01" / "10-00-00")


@pytest.fixture(scope="module")
def figures(sweep, tmp_path_factory):
    """The report, and every matplotlib Figure it saved (a spy around Figure.savefig)."""
    with saved_figures() as saved:
        report = write_report(sweep, tmp_path_factory.mktemp("report"))
    return report, saved


@pytest.fixture(scope="module")
def report(figures):
    return figures[0]


def test_every_job_is_a_row_with_its_status(report, sweep):
    rows = list(csv.DictReader((report.files[0].parent / CSV_FILE).open()))
    assert [r["job"] for r in rows] == [str(i) for i in range(18)]  # natural order: 2 before 10
    status = {r["job"]: r["status"] for r in rows}
    assert [status[str(i)] for i in range(12)] == ["ok"] * 12
    assert (status["12"], status["13"], status["14"], status["15"], status["16"], status["17"]) == \
        ("invalid", "missing", "oom", "ok", "ok", "unreadable")
    for row in rows[:12]:  # every value is the record's own
        rec = json.loads((sweep / row["job"] / "results.json").read_text())
        assert float(row["decode_ms_p50"]) == rec["metrics"]["decode_ms_p50"]
        assert int(row["kv_cache_bytes"]) == rec["metrics"]["kv_cache_bytes"]
        assert row["attention.type"] == rec["config"]["attention"]["type"]
        assert int(row["workload.prompt_len"]) == rec["config"]["workload"]["prompt_len"]
    by_job = {r["job"]: r for r in rows}
    assert by_job["13"]["workload.prompt_len"] == "64" and by_job["13"]["overrides"] == "workload.prompt_len=64"
    assert "killed" in by_job["13"]["error"] and "must divide" in by_job["12"]["error"]
    assert by_job["12"]["attention.num_kv_heads"] == "3" and by_job["12"]["decode_ms_p50"] == ""


def test_summary_csv_has_each_column_once(report):
    with (report.files[0].parent / CSV_FILE).open() as f:
        header = next(csv.reader(f))
    assert len(header) == len(set(header)), sorted(h for h in header if header.count(h) > 1)
    assert header.count("model.name") == 1 and header[:2] == ["job", "status"]


def test_swept_axes_are_the_keys_that_vary(sweep):
    records = collect(sweep)
    keys = [k for k, _ in swept_axes(records)]
    # model.head_dim is null only in the unvalidated config: not an axis; nor the default-only keys
    assert keys == ["attention.type", "attention.num_kv_heads", "workload.name", "workload.batch_size",
                    "workload.prompt_len", "cache.shared"]


def test_markdown_puts_the_variants_side_by_side_first_then_a_table_per_kind(report):
    md = (report.files[0].parent / MD_FILE).read_text()
    assert "18 jobs: 14 ok, 1 invalid, 1 missing, 1 oom, 1 unreadable." in md
    sections = [line for line in md.splitlines() if line.startswith("## ")]
    assert sections == ["## Attention variants side by side", "## Results: decode", "## Results: multi-turn chat",
                        "## Jobs that are not ok", "## Plots"]
    compared = md.split("## Attention variants side by side")[1].split("## Results")[0]
    header = next(line for line in compared.splitlines() if line.startswith("| B |"))
    assert header == "| B | prompt | metric | mha kv=8 | gqa kv=2 | mqa kv=1 |"
    # B=1, prompt=16: KV bytes 1/4 and 1/8 of MHA's, latency as the records say
    mha, gqa = decode_ms(8, 16), decode_ms(2, 16)
    # separate jobs: a timed ratio is untested, and a legend line under the table says why
    assert ("| 1 | 16 | TTFT ms | 32.00 | 32.00 (1.00×, untested) | 32.00 (1.00×, untested) |") in compared
    assert f"|  |  | decode p50 ms | {mha:.3f} | {gqa:.3f} ({gqa / mha:#.3g}×, untested) |" in compared
    assert f"- {LEGEND[UNTESTED]}" in compared
    kv = [human_bytes(kv_cache_bytes(2, h, 8, 16 + GEN, 1, 4)) for h in (8, 2, 1)]  # 24, 6, 3 KiB
    assert f"|  |  | KV cache | {kv[0]} | {kv[1]} (0.250×) | {kv[2]} (0.125×) |" in compared
    # a job never run keeps its attention unresolved: named as resolving it gives (the preset's KV heads)
    assert "not compared, no ok job: gqa kv=3 (invalid, job 12), gqa kv=8 (missing, job 13)" in compared
    decode = md.split("## Results: decode")[1].split("## Results: multi-turn chat")[0]
    chat = md.split("## Results: multi-turn chat")[1].split("## Jobs that are not ok")[0]
    decode_header = next(line for line in decode.splitlines() if line.startswith("| job"))
    # the variant as its progress line names it, not its keys' columns
    assert decode_header.split(" | ")[:5] == ["| job", "variant", "B", "prompt", "status"]
    assert "TTFT turn 1 ms" not in decode_header and "shared" not in decode_header  # chat columns
    chat_header = next(line for line in chat.splitlines() if line.startswith("| job"))
    assert chat_header == "| job | shared | status | TTFT turn 1 ms | TTFT turns 2-N ms |"
    assert f"| 15 | True | ok | 40.00 | {sum(TURN_TTFT[True][1:]) / 3:.2f} |" in chat
    not_ok = md.split("## Jobs that are not ok")[1].split("## Plots")[0]
    for job, status, overrides in (("12", "invalid", "attention.num_kv_heads=3"),
                                   ("13", "missing", "workload.prompt_len=64"),
                                   ("14", "oom", "workload.batch_size=512"),
                                   ("17", "unreadable", "attention=mqa workload.prompt_len=64")):
        assert f"| {job} | {status} | `{overrides}` |" in not_ok
    for png in PNGS:
        assert f"![{png}]({png}.png)" in md


def test_plot_data_matches_the_records(sweep):
    records = collect(sweep)
    axes = swept_axes(records)
    decode = [r for r in records if r["status"] == "ok" and r["config"]["workload"]["name"] == "decode"]
    prompt, batch = config_value("workload.prompt_len"), config_value("workload.batch_size")
    ms = panels(decode, axes, prompt, metric("decode_ms_p50"), ["workload.prompt_len"])
    assert ms == {f"B={b}": {f"{k} kv={kv}": [(p, decode_ms(kv, p)) for p in PROMPTS] for k, kv in VARIANTS.items()}
                  for b in BATCHES}
    assert list(ms["B=1"]) == ["mha kv=8", "gqa kv=2", "mqa kv=1"]  # most KV heads first
    tps = panels(decode, axes, batch, metric("tokens_per_s"), ["workload.batch_size"])
    assert tps["prompt=32"]["gqa kv=2"] == [(b, b * 1000 / decode_ms(2, 32)) for b in BATCHES]
    # bytes per cached token divide batch and length out: one panel, one value per variant
    fold = ["workload.batch_size", "workload.prompt_len", "workload.gen_len"]
    per_tok = panels(decode, axes, config_value("attention.num_kv_heads"), per_token("kv_cache_bytes"), fold)
    assert {v: set(pts) for v, pts in per_tok[""].items()} == {
        f"{k} kv={kv}": {(kv, kv_cache_bytes(2, kv, 8, 1, 1, 4))} for k, kv in VARIANTS.items()}
    held = panels(decode, axes, positions_held, metric("kv_cache_bytes_formula"), ["workload.prompt_len"])
    assert held["B=2"]["mqa kv=1"] == [(p + GEN, kv_cache_bytes(2, 1, 8, p + GEN, 2, 4)) for p in PROMPTS]
    turns = turn_panels(records, axes)
    assert turns == {"": {f"gqa kv=2 shared={s}": list(enumerate(TURN_TTFT[s == "on"])) for s in ("off", "on")}}


def test_each_variant_has_one_colour_in_every_plot():
    colours = palette([Variant(k, num_kv_heads=kv) for k, kv in
                       (("gqa", 2), ("mqa", 1), ("mha", 8), ("gqa", 4), ("mha", 16), ("gqa", 8))])
    assert colours["mha kv=8"] == colours["mha kv=16"] == MHA_COLOUR and colours["mqa kv=1"] == MQA_COLOUR
    gqa = [colours[f"gqa kv={k}"] for k in (8, 4, 2)]
    assert len(set(gqa)) == 3 and not {MHA_COLOUR, MQA_COLOUR} & set(gqa)
    # what else its label names takes a colour of its own, beside the plain layout in one panel: a
    # window no layer applies (w=64 0:1), linear layers, a layer option, a quantized cache
    others = [Variant("mha", num_kv_heads=8, pattern=LayerPattern(64, 1, num_layers=4)),
              Variant("mha", num_kv_heads=8,
                      pattern=LayerPattern(layer_types=("linear_attention", "full_attention"))),
              Variant("mha", num_kv_heads=8, options=(("sinks", True),)), Variant("mqa", 8, 1, cache_dtype="int8")]
    mixed = palette([Variant("mha", num_kv_heads=8), Variant("mqa", num_kv_heads=1), *others])
    assert mixed["mha kv=8"] == MHA_COLOUR and mixed["mqa kv=1"] == MQA_COLOUR and len(set(mixed.values())) == 6
    many = palette([Variant("gqa", num_kv_heads=k) for k in range(2, 26)])
    assert len(set(many.values())) == 24  # a sweep of 24 GQA counts still has distinct colours


def test_plots_use_the_palette_and_keep_the_legend_off_the_data(figures, sweep):
    report, saved = figures
    pngs = {p.stem: p for p in report.files if p.suffix == ".png"}
    assert set(pngs) == PNGS and len(saved) == len(PNGS)
    assert report.skipped_plots == {}
    colours = palette([RecordView(r).variant for r in collect(sweep)])
    for fig in saved:
        renderer = FigureCanvasAgg(fig).get_renderer()
        fig.draw(renderer)  # the layout as saved
        [legend] = fig.legends
        box = legend.get_window_extent(renderer)
        panels_drawn = [ax for ax in fig.axes if ax.get_visible()]
        for ax in panels_drawn:
            # the legend covers no panel, tick label, axis label or title
            assert not box.overlaps(ax.get_tightbbox(renderer)), fig.get_suptitle()
            for line in ax.get_lines():
                label = line.get_label().partition(" shared=")[0]
                if label in colours:
                    assert line.get_color() == colours[label], (fig.get_suptitle(), label)
        legend_colours = {t.get_text(): h.get_color() for t, h in zip(legend.get_texts(), legend.legend_handles)}
        assert {k: v for k, v in legend_colours.items() if k in colours} == \
            {k: colours[k] for k in legend_colours if k in colours}
    for path in pngs.values():
        image = matplotlib.image.imread(path)
        assert image.shape[0] > 300 and image.shape[1] > 500
        assert image.std() > 0.05  # lines, labels and legend, not a blank canvas


def test_a_single_job_says_why_each_plot_is_not_drawn(sweep, tmp_path):
    report = write_report(sweep / "3", tmp_path)
    assert [r["job"] for r in report.records] == ["."]
    assert set(report.skipped_plots) == PNGS
    assert "needs >= 2 values of workload.prompt_len" in report.skipped_plots["decode_vs_context"]
    md = (tmp_path / MD_FILE).read_text()
    assert "## Attention variants side by side" not in md  # one variant: nothing to put beside it
    plots = md.split("## Plots")[1]
    assert all(f"- `{name}.png` not drawn: " in plots for name in PNGS)
    off = write_report(sweep, tmp_path / "off", plots=False)
    assert off.skipped_plots == {} and "Not drawn: plots were turned off" in (tmp_path / "off" / MD_FILE).read_text()


def test_cli_on_missing_or_empty_directory_exits_with_a_clear_message(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    assert f"kvbench-report: no such directory: {tmp_path / 'nope'}" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "no results.json and no Hydra job directory" in capsys.readouterr().err
    assert not list((tmp_path / "empty").iterdir())


@pytest.mark.e2e
def test_console_script_writes_the_report(sweep, tmp_path):
    # The console script pyproject installs beside this interpreter, as a user runs it.
    script = Path(sys.executable).parent / "kvbench-report"
    proc = subprocess.run([str(script), str(sweep), "--out", str(tmp_path), "--no-plots"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "18 jobs (14 ok, 1 invalid, 1 missing, 1 oom, 1 unreadable)" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [CSV_FILE, MD_FILE]


def test_malformed_records_are_unreadable_rows_never_a_crash(tmp_path, capsys):
    """kvbench-report over whatever a hostile or broken disk holds: each job that has no
    record is an unreadable row naming what is wrong, and the report (plots included) is made.
    (Before: a record that parsed but had, say, a list for metrics crashed the report.)"""
    import os

    good = asdict(bench("gqa", 2))
    broken = {
        "metrics_list": '{"status": "ok", "config": {}, "metrics": [1, 2]}',
        "overrides_int": '{"status": "ok", "config": {}, "overrides": 5}',
        "turns_not_rows": '{"status": "ok", "config": {}, "tables": {"turns": "x"}}',
        "unknown_status": '{"status": "finished", "config": {}}',
        "torn": '{"status": "ok", "conf',
        "not_utf8": b"\xff\xfe\x00",
        "deep": "[" * 50000 + "]" * 50000,
    }
    for name, content in broken.items():
        (tmp_path / name).mkdir()
        path = tmp_path / name / "results.json"
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "results.json")  # reading it would wait forever for a writer
    hydra_files(tmp_path / "fifo_hydra", good, ["a=1"])
    (tmp_path / "fifo_hydra" / ".hydra" / "overrides.yaml").unlink()
    os.mkfifo(tmp_path / "fifo_hydra" / ".hydra" / "overrides.yaml")
    (tmp_path / "dir" / "results.json").mkdir(parents=True)
    # well-typed but odd values reach the tables and plots: a string latency, a huge KV count
    for n, prompt in enumerate((16, 32)):
        odd = asdict(bench("gqa", 2, prompt=prompt))
        RunResult("ok", odd, metrics={"decode_ms_p50": "fast" if n else 1.0, "tokens_per_s": None,
                                      "kv_cache_bytes": 10**30}).write(tmp_path / f"odd{n}")
    assert main([str(tmp_path)]) == 0, capsys.readouterr().err
    with (tmp_path / CSV_FILE).open() as f:
        rows = {r["job"]: r for r in csv.DictReader(f)}
    assert {j for j, r in rows.items() if r["status"] == "unreadable"} == {*broken, "fifo", "dir"}
    assert "metrics has type list" in rows["metrics_list"]["error"]
    assert "not a regular file" in rows["fifo"]["error"]
    assert rows["odd0"]["status"] == rows["odd1"]["status"] == "ok"
    assert "fifo_hydra" not in rows or rows["fifo_hydra"]["status"] == "missing"


def _interrupted_compare(job, rounds, repeats, partial=True):
    from test_intervals import compare_record

    from kvbench.jobs.interrupts import stop_error

    rec = compare_record()
    rec.update(job=job, status="interrupted")
    rec["config"]["runtime"] = {"repeats": repeats}
    rec["metrics"]["rounds"] = rounds
    if partial:  # as tasks/compare.py marks the figures of the complete rounds kept on Ctrl-C
        rec["metrics"].update(partial=True, partial_reason=f"interrupted after {rounds} of {repeats} timed rounds")
    rec["error"] = stop_error(KeyboardInterrupt(), rec["metrics"])
    return rec


def test_an_interrupted_compare_with_partial_figures_says_so_in_its_status_cell(tmp_path):
    """summary.md's Results table and the console's jobs table: an interrupted compare that kept the
    figures of its complete rounds reads "interrupted (partial, 3 of 10 rounds)" where its status is,
    not only in the error column; one that kept nothing is "interrupted"."""
    import io

    from rich.console import Console

    from kvbench.sinks.console import jobs_table, run_table

    records = [_interrupted_compare("0", 3, 10), _interrupted_compare("1", 1, 10),
               _interrupted_compare("2", 0, 10, partial=False)]
    write_report(tmp_path, plots=False, records=records)
    md = (tmp_path / MD_FILE).read_text()
    results = md.split("## Results")[1].split("\n## ")[0]
    header = next(line for line in results.splitlines() if line.startswith("| job"))
    column = [c.strip() for c in header.split("|")].index("status")
    status = {cells[1]: cells[column] for cells in ([c.strip() for c in line.split("|")]
              for line in results.splitlines()[results.splitlines().index(header) + 2:] if line.startswith("|"))}
    assert status == {"0": "interrupted (partial, 3 of 10 rounds)", "1": "interrupted (partial, 1 of 10 rounds)",
                      "2": "interrupted"}
    assert "| 0 | interrupted (partial, 3 of 10 rounds) |" in md.split("## Jobs that are not ok")[1]
    out = Console(file=io.StringIO(), width=100, color_system=None)
    out.print(jobs_table("jobs", records, [], "compare"))
    out.print(run_table(records[0]))
    lines = out.file.getvalue().splitlines()
    assert sum("interrupted (partial, 3 of 10 rounds)" in line for line in lines) == 2  # whole, in each table
    assert sum("interrupted (partial, 1 of 10 rounds)" in line for line in lines) == 1
    # a record that does not say how many rounds were planned, or how many it kept
    record = _interrupted_compare("3", 1, 10)
    del record["config"]["runtime"]
    assert RecordView(record).status_text == "interrupted (partial, 1 round)"
    del record["metrics"]["rounds"]
    assert RecordView(record).status_text == "interrupted (partial)"
    assert RecordView({**record, "status": "ok"}).status_text == "ok"
