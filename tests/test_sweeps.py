"""Sweeps through the CLI: the launcher presets against the real submitit plugin, a real submitit
multirun, a sweep killed with SIGKILL and resumed, a report over a sweep written by two hosts."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from kvbench.config import register_configs
from kvbench.results import RunResult, find_results

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


TINY = ["model=tiny", "workload.prompt_len=12", "workload.gen_len=6", "runtime.warmup=1",
        "runtime.repeats=2", "wandb.mode=disabled"]


def kvbench_cmd(*args):
    return [sys.executable, "-m", "kvbench.cli", *args]


def run_env(**extra):
    return dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="1", **extra)


def compose_cfg(*overrides, hydra=False):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


@pytest.mark.parametrize("preset, target", [("slurm", "SlurmLauncher"), ("local", "LocalLauncher")])
def test_launcher_presets_extend_the_plugin_configs(preset, target):
    cfg = compose_cfg(f"hydra/launcher={preset}", "hydra.launcher.timeout_min=7", hydra=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_ == f"hydra_plugins.hydra_submitit_launcher.submitit_launcher.{target}"
    assert launcher.gpus_per_node == 1 and launcher.tasks_per_node == 1 and launcher.timeout_min == 7
    # typed by the plugin's dataclass: a bad value is rejected naming the key
    with pytest.raises(Exception, match="gpus_per_node"):
        compose_cfg(f"hydra/launcher={preset}", "hydra.launcher.gpus_per_node=two", hydra=True)


def test_slurm_preset_submits_an_array_with_one_gpu_per_job(tmp_path):
    """The real plugin builds the sbatch script; a stand-in sbatch keeps it and refuses the job."""
    bin_dir, captured = tmp_path / "bin", tmp_path / "captured.sh"
    bin_dir.mkdir()
    for tool in ("sbatch", "srun"):  # submitit checks that srun exists before it submits
        (bin_dir / tool).write_text(f'#!/bin/sh\ncp "$1" {captured}\necho "no cluster here" >&2\nexit 1\n')
        (bin_dir / tool).chmod(0o755)
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        kvbench_cmd("-m", "hydra/launcher=slurm", "hydra.launcher.partition=gpu_test",
                    "hydra.launcher.array_parallelism=2", "hydra.launcher.mem_gb=32", *TINY,
                    "attention=mha,gqa,mqa", f"hydra.sweep.dir={sweep}"),
        cwd=tmp_path, env=run_env(PATH=f"{bin_dir}:{os.environ['PATH']}"), capture_output=True,
        text=True, timeout=120)
    assert proc.returncode != 0 and "no cluster here" in proc.stderr
    directives = {line.split()[1] for line in captured.read_text().splitlines() if line.startswith("#SBATCH")}
    # 3 jobs, at most 2 at once; the preset's resources and the overrides
    assert {"--array=0-2%2", "--gpus-per-node=1", "--ntasks-per-node=1", "--nodes=1",
            "--partition=gpu_test", "--mem=32GB", "--cpus-per-task=8", "--time=60",
            "--job-name=kvbench"} <= directives


def test_submitit_local_multirun_writes_every_record(tmp_path):
    from kvbench.cache import kv_cache_bytes

    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        kvbench_cmd("-m", "hydra/launcher=local", "hydra.launcher.timeout_min=3", *TINY,
                    "attention=mha,mqa", f"hydra.sweep.dir={sweep}"),
        cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kv_heads = {}
    for job in ("0", "1"):
        rec = json.loads((sweep / job / "results.json").read_text())
        assert rec["status"] == "ok", rec["error"]
        kv = rec["config"]["attention"]["num_kv_heads"]
        kv_heads[rec["config"]["attention"]["type"]] = kv
        # tiny: 2 layers, head_dim 8, 12 + 6 positions, batch 1, float32
        assert rec["metrics"]["kv_cache_bytes"] == kv_cache_bytes(2, kv, 8, 18, 1, 4) == 2 * 2 * kv * 8 * 18 * 4
        assert rec["env"]["hostname"]
    assert kv_heads == {"mha": 8, "mqa": 1}
    # each job ran as its own submitit job (its own log), and the sweep table saw both
    assert len(list((sweep / ".submitit").glob("*/*_0_log.out"))) == 2
    assert "2 ok" in proc.stdout


def test_sigkill_mid_sweep_then_rerun_completes_only_the_missing_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    args = kvbench_cmd("-m", *TINY, "attention=gqa", "attention.num_kv_heads=2",
                       "workload.batch_size=1,2,3,4,5,6", f"hydra.sweep.dir={sweep}")
    proc = subprocess.Popen(args, cwd=tmp_path, env=run_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while len(list(sweep.glob("*/results.json"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the sweep finished before it could be killed"

    before = {p.parent.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sweep.glob("*/results.json")}
    assert 2 <= len(before) < 6
    for content, _ in before.values():  # atomic writes: whatever is there is complete
        assert json.loads(content)["status"] == "ok"

    again = subprocess.run(args, cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stderr.count("skipped:") == len(before)
    assert again.stdout.count("results: ") == 6 - len(before)  # one line per job that ran
    for job, (content, mtime) in before.items():
        path = sweep / job / "results.json"
        assert path.read_bytes() == content and path.stat().st_mtime_ns == mtime
    paths = find_results(sweep)
    assert sorted(p.parent.name for p in paths) == [str(i) for i in range(6)]
    batches = sorted(json.loads(p.read_text())["config"]["workload"]["batch_size"] for p in paths)
    assert batches == [1, 2, 3, 4, 5, 6]
    assert "6 ok" in again.stdout
    # the sweep report written at the end counts every job once
    with (sweep / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["job"] for r in rows) == [str(i) for i in range(6)]
    assert {r["status"] for r in rows} == {"ok"}


def test_report_counts_each_job_once_over_a_sweep_from_two_hosts(tmp_path):
    from kvbench.sinks.report import write_report

    sweep = tmp_path / "sweep"
    for job in range(4):
        config = {"model": {"name": "tiny"}, "attention": {"type": "gqa", "num_kv_heads": 2},
                  "workload": {"name": "decode", "batch_size": job + 1}}
        RunResult(status="ok", config=config, metrics={"decode_ms_p50": 1.0 + job},
                  env={"hostname": f"node-{'ab'[job % 2]}"}).write(sweep / str(job))
        (sweep / str(job) / ".hydra").mkdir()
        (sweep / str(job) / ".hydra" / "overrides.yaml").write_text(f"- workload.batch_size={job + 1}\n")
    # job 3 was first killed on node-a mid-write, then finished on node-b
    (sweep / "3" / ".results.json.q1w2e3.tmp").write_text('{"status": "ok", "met')
    report = write_report(sweep, plots=False)
    assert [r["job"] for r in report.records] == ["0", "1", "2", "3"]
    assert report.counts() == {"ok": 4}
    assert [r["env"]["hostname"] for r in report.records] == ["node-a", "node-b", "node-a", "node-b"]
    with (sweep / "summary.csv").open() as f:
        assert [r["job"] for r in csv.DictReader(f)] == ["0", "1", "2", "3"]


def test_another_sweep_into_a_sweep_directory_is_refused_in_one_line(tmp_path):
    """A sweep with other overrides would renumber and overwrite the jobs already there: it is
    refused before any job runs; the same sweep again (or with rerun=true) resumes as before."""
    sweep = tmp_path / "sweep"
    first = subprocess.run(kvbench_cmd("-m", *TINY, "attention=mha,mqa", f"hydra.sweep.dir={sweep}"),
                           cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=180)
    assert first.returncode == 0, first.stdout + first.stderr
    before = {p: p.read_bytes() for p in sweep.glob("*/results.json")}
    other = subprocess.run(kvbench_cmd("-m", *TINY, "attention=gqa,mqa", f"hydra.sweep.dir={sweep}"),
                           cwd=tmp_path, env=dict(run_env(), HYDRA_FULL_ERROR="0"), capture_output=True,
                           text=True, timeout=180)
    assert other.returncode == 2, other.stdout + other.stderr
    [line] = other.stderr.strip().splitlines()
    assert line.startswith(f"kvbench: invalid config: hydra.sweep.dir='{sweep}': holds another sweep (")
    assert "attention=mha,mqa" in line and "new hydra.sweep.dir" in line
    assert {p: p.read_bytes() for p in sweep.glob("*/results.json")} == before and len(before) == 2
    again = subprocess.run(kvbench_cmd("-m", *TINY, "attention=mha,mqa", f"hydra.sweep.dir={sweep}", "rerun=false"),
                           cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=180)
    assert again.returncode == 0 and again.stderr.count("skipped:") == 2, again.stdout + again.stderr
