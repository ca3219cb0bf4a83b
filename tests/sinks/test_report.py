"""The local report over a sweep directory with ok, invalid, oom, missing and unreadable jobs:
rows and columns against the records written, plot data against the same records, PNGs that
decode to images, and kvbench-report's messages for a missing or empty directory."""

import csv
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import matplotlib.image
import pytest
import yaml
from conftest import tiny_model_config

from kvbench.cache import kv_cache_bytes
from kvbench.cli import report_main as main
from kvbench.config import AttentionConfig, BenchConfig, CacheConfig, RuntimeConfig, WandbConfig, WorkloadConfig
from kvbench.results import RunResult
from kvbench.sinks.plots import lines, metric, turn_lines
from kvbench.sinks.report import CSV_FILE, MD_FILE, collect, swept_axes, write_report

VARIANTS = {"mha": 8, "gqa": 2, "mqa": 1}
PROMPTS, BATCHES, GEN = (16, 32), (1, 2), 8
TURN_TTFT = {True: [40.0, 4.0, 5.0, 6.0], False: [40.0, 50.0, 60.0, 70.0]}


def decode_ms(kv, prompt):
    """A made-up but distinct latency per (variant, context)."""
    return 1.0 + 0.01 * prompt * kv / 8


def bench(kind, kv, prompt=16, batch=1, workload="decode", shared=False):
    return BenchConfig(model=tiny_model_config(max_seq_len=512),
                       attention=AttentionConfig(type=kind, num_kv_heads=kv),
                       workload=WorkloadConfig(name=workload, batch_size=batch, prompt_len=prompt, gen_len=GEN,
                                               system_len=32, turns=4, user_len=8, reply_len=4),
                       cache=CacheConfig(shared=shared), runtime=RuntimeConfig(device="cpu"),
                       wandb=WandbConfig(mode="disabled"))


def hydra_files(job_dir, config, overrides):
    (job_dir / ".hydra").mkdir(parents=True)
    (job_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    (job_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """jobs 0-11 ok decode (3 variants x 2 prompts x 2 batches), 12 invalid, 13 missing (killed),
    14 oom, 15-16 ok multiturn with sharing on/off, 17 an unreadable results.json."""
    root = tmp_path_factory.mktemp("multirun") / "2026-01-01" / "10-00-00"
    n = 0
    for kind, kv in VARIANTS.items():
        for prompt in PROMPTS:
            for batch in BATCHES:
                cfg = bench(kind, kv, prompt, batch)
                ms = decode_ms(kv, prompt)
                kv_bytes = kv_cache_bytes(2, kv, 8, prompt + GEN, batch, 4)
                overrides = [f"attention={kind}", f"workload.prompt_len={prompt}", f"workload.batch_size={batch}"]
                hydra_files(root / str(n), asdict(cfg), overrides)
                RunResult("ok", asdict(cfg), overrides=overrides, metrics={
                    "prefill_ms": 2.0 * prompt, "decode_ms_p50": ms, "decode_ms_p90": 1.5 * ms,
                    "tokens_per_s": batch * 1000.0 / ms, "kv_cache_bytes": kv_bytes,
                    "kv_cache_bytes_formula": kv_bytes, "nvml_reason": "device is cpu"},
                    series={"decode_ms": [ms] * GEN}).write(root / str(n))
                n += 1
    raw = asdict(bench("gqa", 2))
    raw["attention"]["num_kv_heads"], raw["model"]["head_dim"] = 3, None  # as saved before validation
    hydra_files(root / "12", raw, ["attention.num_kv_heads=3"])
    RunResult("invalid", raw, error="attention.num_kv_heads=3: must divide model.num_heads=8",
              overrides=["attention.num_kv_heads=3"]).write(root / "12")
    killed = asdict(bench("gqa", 2, prompt=64))
    killed["attention"]["num_kv_heads"] = None  # Hydra saves the config before it is resolved
    hydra_files(root / "13", killed, ["workload.prompt_len=64"])
    oom = asdict(bench("mha", 8, batch=512))
    hydra_files(root / "14", oom, ["workload.batch_size=512"])
    RunResult("oom", oom, error="OutOfMemoryError: CUDA out of memory", overrides=["workload.batch_size=512"],
              metrics={"kv_cache_bytes_formula": 123}).write(root / "14")
    for n, shared in ((15, True), (16, False)):
        cfg = bench("gqa", 2, workload="multiturn", shared=shared)
        overrides = ["workload=multiturn", f"cache.shared={str(shared).lower()}"]
        hydra_files(root / str(n), asdict(cfg), overrides)
        rows = [{"turn": t, "ttft_ms": v, "context_len": 32 + 12 * t} for t, v in enumerate(TURN_TTFT[shared])]
        RunResult("ok", asdict(cfg), overrides=overrides, metrics={"prefill_ms": rows[0]["ttft_ms"]},
                  tables={"turns": rows}).write(root / str(n))
    hydra_files(root / "17", asdict(bench("mqa", 1)), ["attention=mqa"])
    (root / "17" / "results.json").write_text('{"status": "ok", "metr')
    return root


@pytest.fixture(scope="module")
def report(sweep, tmp_path_factory):
    return write_report(sweep, tmp_path_factory.mktemp("report"))


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


def test_markdown_lists_results_and_every_job_that_is_not_ok(report):
    md = (report.files[0].parent / MD_FILE).read_text()
    assert "18 jobs: 14 ok, 1 invalid, 1 missing, 1 oom, 1 unreadable." in md
    header = next(line for line in md.splitlines() if line.startswith("| job | attn"))
    assert header.split(" | ")[:8] == ["| job", "attn", "kv", "workload", "B", "prompt", "shared", "status"]
    not_ok = md.split("## Jobs that are not ok")[1].split("## Plots")[0]
    for job, status, overrides in (("12", "invalid", "attention.num_kv_heads=3"),
                                   ("13", "missing", "workload.prompt_len=64"),
                                   ("14", "oom", "workload.batch_size=512"),
                                   ("17", "unreadable", "attention=mqa")):
        assert f"| {job} | {status} | `{overrides}` |" in not_ok
    for png in ("decode_vs_context", "kv_bytes_vs_heads", "tokens_vs_batch", "ttft_per_turn"):
        assert f"![{png}]({png}.png)" in md


def test_plot_data_matches_the_records(sweep):
    records = collect(sweep)
    axes = swept_axes(records)
    decode = [r for r in records if r["status"] == "ok" and r["config"]["workload"]["name"] == "decode"]
    ms = lines(decode, axes, "workload.prompt_len", metric("decode_ms_p50"))
    assert ms == {f"{k} kv={kv} B={b}": [(p, decode_ms(kv, p)) for p in PROMPTS]
                  for k, kv in sorted(VARIANTS.items()) for b in BATCHES}
    tps = lines(decode, axes, "workload.batch_size", metric("tokens_per_s"))
    assert tps["gqa kv=2 prompt=32"] == [(b, b * 1000 / decode_ms(2, 32)) for b in BATCHES]
    kv = lines(decode, axes, "attention.num_kv_heads", metric("kv_cache_bytes_formula"), ("attention.type",))
    assert kv["B=2 prompt=16"] == [(h, kv_cache_bytes(2, h, 8, 16 + GEN, 2, 4)) for h in (1, 2, 8)]
    turns = turn_lines(records, axes)
    assert turns == {f"gqa kv=2 shared={s}": list(enumerate(TURN_TTFT[s == "on"])) for s in ("off", "on")}


def test_plots_are_images_with_content(report):
    pngs = {p.stem: p for p in report.files if p.suffix == ".png"}
    assert set(pngs) == {"decode_vs_context", "kv_bytes_vs_heads", "tokens_vs_batch", "ttft_per_turn"}
    assert report.skipped_plots == {}
    for path in pngs.values():
        image = matplotlib.image.imread(path)
        assert image.shape[0] > 300 and image.shape[1] > 500
        assert image.std() > 0.05  # lines, labels and legend, not a blank canvas


def test_single_job_directory_skips_plots_that_need_two_points(sweep, tmp_path):
    report = write_report(sweep / "3", tmp_path)
    assert [r["job"] for r in report.records] == ["."]
    assert set(report.skipped_plots) == {"decode_vs_context", "kv_bytes_vs_heads", "tokens_vs_batch",
                                         "ttft_per_turn"}
    assert "needs >= 2 values of workload.prompt_len" in report.skipped_plots["decode_vs_context"]


def test_cli_on_missing_or_empty_directory_exits_with_a_clear_message(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    assert f"kvbench-report: no such directory: {tmp_path / 'nope'}" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "no results.json and no Hydra job directory" in capsys.readouterr().err
    assert not list((tmp_path / "empty").iterdir())


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
