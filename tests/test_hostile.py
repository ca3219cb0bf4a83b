"""Careless and hostile input: each test plants what a user or an attacker could leave
behind (a formula in a config value, raw HTML, an ``ok`` record with nothing or NaN in it, a
typo in a group name, a sweep whose every job is invalid) and checks what kvbench makes of it."""

import csv
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from conftest import llama_dir, make_decoder, tiny_model_config
from hydra import compose, initialize_config_dir

from kvbench.checkpoint import CheckpointError, load_checkpoint, load_llama_dir, save_checkpoint
from kvbench.cli import _top_level_names
from kvbench.cli_sweep import sweep_exit
from kvbench.config.bench import CONF_DIR, BenchConfig, CacheConfig, RuntimeConfig, WandbConfig
from kvbench.config.model import AttentionConfig
from kvbench.config.workload import DecodeWorkload
from kvbench.core.errors import ConfigError, config_error_line
from kvbench.footprint import available_bytes, job_footprint, parameter_count
from kvbench.jobs.claim import completed_record
from kvbench.jobs.job_config import check_job, to_bench_config
from kvbench.jobs.runner import run_job
from kvbench.results import RunResult, read_record, record_config
from kvbench.sinks.report import CSV_FILE, MD_FILE, write_report


def bench(kind, kv):
    return check_job(BenchConfig(model=tiny_model_config(), attention=AttentionConfig(type=kind, num_kv_heads=kv),
                                 workload=DecodeWorkload(prompt_len=8, gen_len=4), cache=CacheConfig(),
                                 runtime=RuntimeConfig(device="cpu"), wandb=WandbConfig(mode="disabled")))


def _record(tmp_path, name, value, error=None):
    cfg = asdict(bench("mha", 8))
    cfg["model"]["name"] = value
    RunResult("ok", record_config(cfg), metrics={"decode_ms_p50": 1.5, "note": value}, error=error,
              overrides=[f"model.name={value}"]).write(tmp_path / name)


@pytest.mark.parametrize("start", ["=", "+", "-", "@", "\t", "\r"])
def test_summary_csv_never_writes_a_cell_a_spreadsheet_would_run(tmp_path, start):
    payload = f"{start}1+1|HYPERLINK(\"x\")"
    _record(tmp_path, "0", payload)
    write_report(tmp_path, plots=False)
    with (tmp_path / CSV_FILE).open(newline="") as f:
        rows = list(csv.reader(f))
    cells = [cell for row in rows[1:] for cell in row]
    assert any(payload in cell for cell in cells)  # the value is kept, as text
    assert not [cell for cell in cells if cell.startswith(("=", "+", "-", "@", "\t", "\r"))]
    # a number stays a number: a negative figure is not text
    RunResult("ok", record_config(asdict(bench("mha", 8))), metrics={"decode_ms_p50": -2.5}).write(tmp_path / "1")
    write_report(tmp_path, plots=False)
    with (tmp_path / CSV_FILE).open(newline="") as f:
        assert "-2.5" in [row["decode_ms_p50"] for row in csv.DictReader(f)]


def test_summary_md_shows_config_values_as_text_never_as_html(tmp_path):
    payload = '<img src=x onerror="alert(1)">'
    _record(tmp_path, "0", payload, error=f"boom {payload}")
    RunResult("error", record_config(asdict(bench("mha", 8))), error=f"<b>{payload}</b>",
              overrides=[f"model.name={payload}"]).write(tmp_path / "1")
    write_report(tmp_path, plots=False)
    text = (tmp_path / MD_FILE).read_text()
    assert "<img" not in text and "<b>" not in text
    assert "&lt;img src=x onerror=\"alert(1)\"&gt;" in text


@pytest.mark.parametrize("metrics", ["{}", '{"decode_ms_p50": NaN}', '{"tokens_per_s": Infinity, "x": 1}'])
def test_resume_measures_again_an_ok_record_with_no_metrics_or_a_bare_nan(tmp_path, metrics):
    config = record_config(asdict(bench("mha", 8)))
    (tmp_path / "results.json").write_text(f'{{"status": "ok", "config": {json.dumps(config)}, '
                                           f'"metrics": {metrics}}}')
    assert completed_record(tmp_path, config) is None
    RunResult("ok", config, metrics={"decode_ms_p50": 1.0}).write(tmp_path)
    assert completed_record(tmp_path, config) is not None  # a real one is still trusted


@pytest.mark.parametrize("counts, code", [
    ({"invalid": 3}, 2),                      # a typo in a swept key: every job invalid
    ({"ok": 1, "running": 2}, 1),             # jobs another process still runs: no results for them
    ({"running": 3}, 1),
    ({"oom": 2}, 1),                          # nothing measured
    ({}, 1),
    ({"ok": 2, "invalid": 1, "oom": 1}, 0),   # a sweep with measurements; invalid/oom are data
    ({"ok": 1, "missing": 1}, 1),
])
def test_a_sweep_exits_zero_only_when_it_measured_and_accounted_for_every_job(counts, code):
    got, why = sweep_exit(counts)
    assert got == code
    assert (why is None) == (code == 0 or any(counts.get(s) for s in ("missing", "error")))


def test_a_misspelled_group_suggests_the_group(tmp_path):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        with pytest.raises(Exception) as info:
            compose("config", overrides=["atention=mha"])
    line = config_error_line(info.value, _top_level_names())
    assert line == "atention=mha: no such config group or key (did you mean attention?)"


def test_the_renamed_scenario_group_names_its_new_name():
    """conf/serving (task=capacity's scenarios) is conf/scenario: "serving" is the workload."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        with pytest.raises(Exception) as info:
            compose("config", overrides=["experiment=choose", "serving=chat"])
        assert compose("config", overrides=["experiment=choose", "scenario=chat"]).workload.name == "multiturn"
    line = config_error_line(info.value, _top_level_names())
    assert line == "serving=chat: the group serving is renamed to scenario (scenario=chat)"


def test_a_saved_checkpoint_with_a_model_key_kvbench_does_not_know_is_refused(tmp_path):
    path = save_checkpoint(tmp_path / "ck.pt", make_decoder(4))
    payload = torch.load(path, weights_only=True)
    payload["model"]["sliding_windw"] = 16  # what this version would silently not model
    torch.save(payload, path)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    [line] = str(info.value).splitlines()
    assert "model.sliding_windw" in line and str(path) in line


# ---- bounds before work ------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [dict(), dict(qkv_bias=True), dict(qk_norm=True), dict(num_layers=7)])
def test_the_parameter_count_from_two_meta_layers_is_the_built_models(overrides):
    cfg = tiny_model_config(**overrides)
    for kv in (8, 2, 1):
        attention = AttentionConfig.for_heads(cfg.num_heads, kv)
        assert parameter_count(cfg, attention) == make_decoder(kv, **overrides).num_params()


def _job(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["model=tiny", "wandb=disabled", "runtime.isolate=false", *overrides])
    return run_job(cfg, tmp_path)


@pytest.mark.parametrize("override, named", [
    ("model.num_layers=1000000", "model.num_layers=1000000"),       # would build layers until memory ran out
    ("model.max_seq_len=1000000000000", "model.max_seq_len=1000000000000"),  # an 8 TB rotary table
])
def test_a_model_too_large_for_the_machine_is_invalid_before_anything_is_built(tmp_path, override, named):
    result = _job(tmp_path, override, "workload.prompt_len=8", "workload.gen_len=2")
    assert result.status == "invalid"
    [line] = result.error.splitlines()
    assert named in line and "nothing was built" in line and "memory available" in line
    assert "weight_bytes" not in result.metrics


def test_a_batch_whose_kv_cache_cannot_fit_is_invalid_naming_the_batch(tmp_path):
    result = _job(tmp_path, "workload.batch_size=100000000", "workload.prompt_len=8", "workload.gen_len=2")
    assert result.status == "invalid" and "workload.batch_size=100000000" in result.error
    job = to_bench_config_of()
    m, a = job.model, job.attention
    need = job_footprint(job)
    assert need.kv_cache == 2 * m.num_layers * a.num_kv_heads * m.head_dim * 10 * 100_000_000 * 4  # the formula
    assert need.kv_cache > available_bytes(torch.device("cpu"))


def to_bench_config_of():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["model=tiny", "workload.batch_size=100000000", "workload.prompt_len=8",
                                           "workload.gen_len=2"])
    return to_bench_config(cfg)


def test_a_checkpoint_whose_config_json_describes_a_huge_model_is_refused_before_it_is_built(tmp_path):
    path, _ = llama_dir(tmp_path / "ck", 2)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 100_000,
                                                  "hidden_size": 4096, "num_attention_heads": 32,
                                                  "num_key_value_heads": 8, "intermediate_size": 11008}))
    with pytest.raises(CheckpointError) as info:
        load_llama_dir(path)
    [line] = str(info.value).splitlines()
    assert "100000 layers" in line and "config.json" in line and "nothing was built" in line


@pytest.mark.parametrize("content, needle", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    (" " * (17 * 2**20) + "{}", "bytes"),
])
def test_a_config_json_that_is_huge_or_nested_too_deeply_is_one_line(tmp_path, content, needle):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(CheckpointError) as info:
        load_llama_dir(tmp_path)
    [line] = str(info.value).splitlines()
    assert needle in line and "config.json" in line
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["model=hf_dir", f"model.path={tmp_path}"])
    with pytest.raises(ConfigError) as info:
        to_bench_config(cfg)
    [line] = str(info.value).splitlines()
    assert needle in line and f"model.path={str(tmp_path)!r}" in line


# ---- safe writes ---------------------------------------------------------------------------

def test_a_worse_record_never_replaces_an_ok_one(tmp_path):
    """rerun=true into a finished job, then Ctrl-C: the measurement stays in results.json, the
    interrupted record goes beside it."""
    first = _job(tmp_path, "workload.prompt_len=8", "workload.gen_len=2", "runtime.repeats=1", "runtime.warmup=0")
    assert first.status == "ok"

    @contextmanager
    def interrupting(label, total):
        def tick(*args, **kwargs):
            raise KeyboardInterrupt
        yield tick

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["model=tiny", "wandb=disabled", "runtime.isolate=false", "rerun=true",
                                           "workload.prompt_len=8", "workload.gen_len=2", "runtime.repeats=1",
                                           "runtime.warmup=0"])
    with pytest.raises(KeyboardInterrupt) as info:
        run_job(cfg, tmp_path, progress=interrupting)
    assert info.value.record.status == "interrupted"
    assert info.value.record.written_to == tmp_path / "results.interrupted.json"
    kept = read_record(tmp_path)
    assert kept.status == "ok" and kept.metrics == first.metrics
    assert read_record(tmp_path / "results.interrupted.json").status == "interrupted"
    # an ok record replaces an ok one (rerun=true that finishes), and anything replaces a failed one
    RunResult("error", kept.config, error="boom").write(tmp_path / "other")
    RunResult("interrupted", kept.config, error="SIGINT").write(tmp_path / "other")
    assert read_record(tmp_path / "other").status == "interrupted"


def test_summary_csv_and_md_are_written_before_the_plots(tmp_path, monkeypatch):
    """Ctrl-C while the end-of-sweep plots draw: the tables are already on disk."""
    import kvbench.sinks.report as report

    _record(tmp_path, "0", "a")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "draw_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_report(tmp_path, plots=True)
    assert (tmp_path / CSV_FILE).is_file() and "interrupted" in (tmp_path / MD_FILE).read_text()


# ---- failures outside the job wrapper: one line, non-zero ---------------------------------

def _kvbench(*args, cwd):
    env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="0")
    return subprocess.run([sys.executable, "-c", "from kvbench.entry import main; main()", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.e2e
def test_an_output_directory_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("in the way")
    proc = _kvbench("model=tiny", f"hydra.run.dir={tmp_path}/afile/run", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"kvbench: cannot write {tmp_path}/afile/run: Not a directory"]


@pytest.mark.e2e
def test_ctrl_c_while_kvbench_starts_is_one_line_and_130(tmp_path):
    env = dict(os.environ, WANDB_MODE="disabled")
    proc = subprocess.Popen([sys.executable, "-c", "from kvbench.entry import main; main()", "model=tiny"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Signal once PyYAML's C loader is mapped into the process: inside the console script's import of
    # kvbench.cli (Hydra's import, its first; torch is the job's process's alone), whatever the
    # machine's speed; if that is already over, kvbench's own handler answers the same way.
    maps, deadline = Path(f"/proc/{proc.pid}/maps"), time.monotonic() + 120
    while "/_yaml." not in (maps.read_text() if proc.poll() is None else "/_yaml."):
        assert time.monotonic() < deadline, "Hydra was never imported"
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) <= 2 and "interrupted by SIGINT" in lines[-1] and "Traceback" not in err


def test_report_to_an_unwritable_place_and_a_nan_timeout_are_one_line(tmp_path, capsys):
    from kvbench.cli_tools import dashboard_main, report_main

    _record(tmp_path, "0", "a")
    (tmp_path / "afile").write_text("in the way")
    assert report_main([str(tmp_path), "--out", str(tmp_path / "afile" / "r"), "--no-plots"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"kvbench-report: cannot write {tmp_path / 'afile' / 'r'}: Not a directory"]
    for bad in ("nan", "inf", "0", "-1", "soon"):
        with pytest.raises(SystemExit) as info:
            dashboard_main([str(tmp_path), "--timeout", bad])
        assert info.value.code == 2 and "--timeout" in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_sweep_along_a_long_axis_is_reported_without_drawing_thousands_of_panels(tmp_path):
    from kvbench.sinks.plots import MAX_PANELS

    seeds = MAX_PANELS + 6
    for i in range(2 * seeds):
        cfg = asdict(bench("mha", 8))
        cfg["runtime"]["seed"], cfg["workload"]["prompt_len"] = i // 2, 8 + 8 * (i % 2)
        overrides = [f"runtime.seed={i // 2}", f"workload.prompt_len={8 + 8 * (i % 2)}"]
        RunResult("ok", record_config(cfg), metrics={"decode_ms_p50": 1.0 + i, "tokens_per_s": 10.0},
                  overrides=overrides).write(tmp_path / str(i))
    report = write_report(tmp_path, plots=True)
    assert "decode_vs_context" in report.skipped_plots
    assert f"{seeds} panels" in report.skipped_plots["decode_vs_context"]
    assert not list(tmp_path.glob("decode_vs_context.png"))
    assert (tmp_path / MD_FILE).read_text().count("| ok |") == 2 * seeds  # every job is still listed


@pytest.mark.parametrize("content", [b"garbage", pickle.dumps({"a": object})])
def test_a_file_that_is_not_a_checkpoint_is_one_short_line_without_torchs_warning(tmp_path, content, recwarn):
    path = tmp_path / "bad.pt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    [line] = str(info.value).splitlines()
    assert str(path) in line and "weights-only loader refused it" in line and len(line) < 250
    assert "arbitrary code execution" not in line
    assert not [w for w in recwarn if "pickle protocol" in str(w.message)]


@pytest.mark.e2e
def test_kvbench_dashboard_against_a_server_that_never_answers_exits_when_it_says_so(tmp_path):
    """A W&B server on this machine that accepts connections and never answers (a black hole):
    the failure is one line within --timeout, and the process is gone right after it."""
    import socket
    import threading

    _record(tmp_path, "0", "a")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held, stop = [], threading.Event()

    def hold():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                pass

    threading.Thread(target=hold, daemon=True).start()
    env = dict(os.environ, WANDB_BASE_URL=f"http://127.0.0.1:{server.getsockname()[1]}",
               WANDB_API_KEY="local-" + "0" * 40, WANDB_MODE="online")
    try:
        proc = subprocess.Popen([sys.executable, "-c", "from kvbench.entry import dashboard_main; dashboard_main()",
                                 str(tmp_path), "--timeout", "2"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        line = proc.stderr.readline()  # the failure, after at most --timeout of waiting for W&B
        said = time.monotonic()
        rest = proc.stderr.read()
        proc.wait(timeout=120)
        gone = time.monotonic()
    finally:
        stop.set()
        server.close()
    assert proc.returncode == 1 and line.startswith("kvbench-dashboard: not created on W&B: ") and not rest
    assert gone - said < 5  # before: W&B's client kept the process ~25 s after the line


def test_a_capacity_search_towards_a_batch_that_could_never_run_is_refused_at_once(tmp_path):
    result = _job(tmp_path, "task=capacity", "capacity.max_batch=1000000000", "capacity.context_lens=[16]",
                  "runtime.memory_budget_gb=1", "workload.gen_len=2")
    assert result.status == "invalid"
    [line] = result.error.splitlines()
    assert line.startswith("capacity.max_batch=1000000000: a probe of that batch at context 16") and "at most" in line
    assert "max_batch" not in result.metrics  # no probe ran


@pytest.mark.parametrize("name", [".kvbench-claim", "summary.csv", "summary.md", "results.json", "error.txt",
                                  "kv_bytes_vs_heads.png"])
def test_a_symlink_planted_in_a_job_directory_is_replaced_never_written_through(tmp_path, name):
    """Every output kvbench writes in a job or sweep directory: the link goes, its target stays."""
    from kvbench.jobs.claim import claim_holder, claim_job
    from kvbench.jsonio import write_text_atomic

    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    job = tmp_path / "job"
    job.mkdir()
    (job / name).symlink_to(target)
    if name == ".kvbench-claim":
        with claim_job(job) as claim:
            assert claim is not None and "pid" in claim_holder(job)
    elif name.startswith("summary") or name.endswith(".png"):
        for i, kv in enumerate((8, 2, 1)):
            RunResult("ok", record_config(asdict(bench("mha" if kv == 8 else "gqa" if kv == 2 else "mqa", kv))),
                      metrics={"decode_ms_p50": 1.0, "kv_cache_bytes": 100.0 * kv,
                               "kv_cache_bytes_formula": 100.0 * kv}).write(job / str(i))
        write_report(job, plots=True)
    elif name == "results.json":
        RunResult("ok", {}, metrics={"x": 1.0}).write(job)
    else:
        write_text_atomic(job / name, "traceback")
    assert target.read_text() == "keep me\n"
    assert not (job / name).is_symlink() and (job / name).is_file()


def test_a_fifo_at_the_claims_name_is_refused_not_waited_on(tmp_path):
    from kvbench.jobs.claim import claim_holder, claim_job

    os.mkfifo(tmp_path / ".kvbench-claim")
    assert claim_holder(tmp_path) is None
    with pytest.raises(OSError):
        claim_job(tmp_path)


@pytest.mark.parametrize("metric", ["timing_method", "noisy", "roofline_bound", "noisy_reason", "kv_heads_conversion"])
def test_an_objective_that_names_a_text_or_boolean_metric_is_refused_before_any_job(metric):
    from kvbench.jobs.runner import check_objective

    with pytest.raises(ConfigError) as info:
        check_objective(metric, {}, "bench")
    assert info.value.args[0].startswith(f"objective={metric!r}: task=bench")


def test_every_metric_a_job_records_as_text_or_a_flag_is_declared_so(tmp_path):
    """The class behind objective=timing_method: the registry's unit must say what the value is."""
    from kvbench.jobs.runner import task_metrics

    result = _job(tmp_path, "workload.prompt_len=8", "workload.gen_len=2", "runtime.repeats=2", "runtime.warmup=0")
    assert result.status == "ok", result.error
    declared = task_metrics("bench", "decode")
    for name, value in result.metrics.items():
        if isinstance(value, (str, bool)) and name in declared:
            assert declared[name].unit in ("text", "bool"), (name, value, declared[name].unit)
        elif isinstance(value, (int, float)) and name in declared:
            assert declared[name].unit not in ("text", "bool"), (name, value, declared[name].unit)
