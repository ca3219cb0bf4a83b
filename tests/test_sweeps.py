"""Sweeps through the CLI: the launcher presets against the real submitit plugin, a real submitit
multirun, a sweep killed with SIGKILL and resumed, a report over a sweep written by two hosts;
and jobs kept apart: Ctrl-C then resume, a job process killed mid-job, two kvbench processes on
one sweep, each job's own peak RSS and threads, the end of a sweep whatever is on disk."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict

import pytest
from conftest import LiveKvbench, compose, reap_after_test
from omegaconf import OmegaConf

from kvbench.jobs.claim import claim_job
from kvbench.jobs.isolation import oom_kills
from kvbench.jobs.job_config import to_bench_config
from kvbench.results import RunResult, find_results, read_record

TINY = ["model=tiny", "workload.prompt_len=12", "workload.gen_len=6", "runtime.warmup=1",
        "runtime.repeats=2", "wandb.mode=disabled"]
# Sweeps whose jobs run in the sweep's own process, for tests not about isolation (an isolated
# job costs a process start, ~3 s of importing torch).
IN_PROCESS = [*TINY, "runtime.isolate=false"]
# A job whose trials last long enough to be interrupted (seconds), and the line that says they began.
# One torch thread: with two on cores other jobs load, a tiny model's step runs 30-50x slower.
LONG = ["model=tiny", "workload.prompt_len=12", "workload.gen_len=6", "runtime.warmup=0", "runtime.threads=1",
        "wandb.mode=disabled"]


def kvbench_cmd(*args):
    return [sys.executable, "-m", "kvbench.cli", *args]


def run_env(**extra):
    return dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="1", **extra)


@pytest.mark.parametrize("preset, target", [("slurm", "SlurmLauncher"), ("local", "LocalLauncher")])
def test_launcher_presets_extend_the_plugin_configs(preset, target):
    cfg = compose(f"hydra/launcher={preset}", "hydra.launcher.timeout_min=7", hydra=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_ == f"hydra_plugins.hydra_submitit_launcher.submitit_launcher.{target}"
    assert launcher.gpus_per_node == 1 and launcher.tasks_per_node == 1 and launcher.timeout_min == 7
    # typed by the plugin's dataclass: a bad value is rejected naming the key
    with pytest.raises(Exception, match="gpus_per_node"):
        compose(f"hydra/launcher={preset}", "hydra.launcher.gpus_per_node=two", hydra=True)


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_submitit_local_multirun_writes_every_record(tmp_path):
    from kv_formula import kv_cache_bytes

    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        # jobs measured in the submitit job's own process: the claim is submitit's process per job
        kvbench_cmd("-m", "hydra/launcher=local", "hydra.launcher.timeout_min=3", *IN_PROCESS,
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


@pytest.mark.e2e
def test_joblib_multirun_measures_each_job_in_its_own_process(tmp_path):
    """hydra/launcher=joblib runs jobs in loky worker processes; each still measures in a
    process of its own. (With multiprocessing's spawn the child inherited the start method
    'loky' and died before measuring.)"""
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        kvbench_cmd("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=1", *TINY, "runtime.threads=1",
                    "attention=mqa", f"hydra.sweep.dir={sweep}"),
        cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = read_record(sweep / "0")
    assert record.status == "ok", record.error
    assert record.metrics["kv_cache_bytes"] == record.metrics["kv_cache_bytes_formula"] == 2 * 2 * 1 * 8 * 18 * 4
    assert "1 ok" in proc.stdout


@pytest.mark.e2e
def test_sigkill_mid_sweep_then_rerun_completes_only_the_missing_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    args = kvbench_cmd("-m", *IN_PROCESS, "attention=gqa", "attention.num_kv_heads=2",
                       "workload.batch_size=1,2,3,4,5,6", f"hydra.sweep.dir={sweep}")
    proc = reap_after_test(subprocess.Popen(args, cwd=tmp_path, env=run_env(), stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, start_new_session=True))
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


@pytest.mark.e2e
def test_ctrl_c_stops_the_sweep_with_its_table_and_resume_reruns_only_the_interrupted_job(tmp_path):
    """Job 1 of 3 is interrupted by a real SIGINT inside its trials: the sweep stops (exit 130)
    with a table of what finished (job 2 never ran); the same command again skips job 0 and runs
    jobs 1 and 2. (Before: job 1 was recorded ok, and resume skipped it.)"""
    sweep = tmp_path / "sweep"
    args = ["-m", *LONG, "runtime.repeats=2,300,1", f"hydra.sweep.dir={sweep}"]
    first = LiveKvbench(*args, cwd=tmp_path)
    first.wait_for(r": 0/300$")
    first.proc.send_signal(signal.SIGINT)
    assert first.finish() == 130, first.output
    assert read_record(sweep / "0").status == "ok"
    interrupted = read_record(sweep / "1")
    assert interrupted.status == "interrupted" and "decode_ms_p50" not in interrupted.metrics
    assert not (sweep / "2").exists()
    assert "(interrupted)" in first.stdout and "1 ok, 1 interrupted, 1 not run" in first.stdout
    done = (sweep / "0" / "results.json").read_bytes(), (sweep / "0" / "results.json").stat().st_mtime_ns

    again = LiveKvbench(*args, cwd=tmp_path)
    assert again.finish(timeout=600) == 0, again.output
    assert again.stderr.count("skipped:") == 1 and again.stdout.count("results: ") == 2
    assert ((sweep / "0" / "results.json").read_bytes(), (sweep / "0" / "results.json").stat().st_mtime_ns) == done
    assert [read_record(sweep / str(j)).status for j in range(3)] == ["ok"] * 3
    assert [read_record(sweep / str(j)).get("runtime.repeats") for j in range(3)] == [2, 300, 1]
    assert "3 ok" in again.stdout


@pytest.mark.e2e
def test_a_job_process_killed_mid_job_becomes_a_record_and_the_sweep_goes_on(tmp_path):
    """SIGKILL to the process measuring job 0 (what the OOM killer or `kill -9` does): job 0 is
    recorded (interrupted, or oom if the kernel's OOM-kill count rose meanwhile), job 1 runs."""
    sweep = tmp_path / "sweep"
    run = LiveKvbench("-m", *LONG, "runtime.repeats=100000,2", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    run.wait_for(r": 0/100000$")
    oom_before = oom_kills()
    run.job_process().kill()
    assert run.finish() == 1, run.output  # a job of the sweep has no result
    killed, after = read_record(sweep / "0"), read_record(sweep / "1")
    expected = "oom" if oom_kills() != oom_before else "interrupted"
    assert killed.status == expected and "SIGKILL" in killed.error, killed.error
    assert killed.get("runtime.repeats") == 100000 and killed.overrides[-1] == "runtime.repeats=100000"
    assert after.status == "ok" and after.metrics["decode_ms_p50"] > 0
    assert f"1 {expected}, 1 ok" in run.stdout


@pytest.mark.e2e
def test_two_kvbench_processes_on_one_sweep_never_measure_one_job_twice(tmp_path):
    """While the first kvbench runs job 0, a second one on the same sweep directory finds it
    claimed: one line naming the holder, no measuring process, `running` in its table."""
    sweep = tmp_path / "sweep"
    # The claim is kvbench's own, isolated or not: the first measures in-process (one torch import less).
    args = ["-m", *LONG, "runtime.repeats=100000", "runtime.isolate=false", f"hydra.sweep.dir={sweep}"]
    first = LiveKvbench(*args, cwd=tmp_path)
    first.wait_for(r": 0/100000$")
    second = LiveKvbench(*args, cwd=tmp_path)
    assert second.finish() == 1, second.output  # no result for a job it could not run: not a success
    [line] = [line for line in second.err_lines if "skipped:" in line]
    assert f"is being run by {os.uname().nodename} pid {first.pid} since" in line
    assert ": 0/100000" not in second.stderr  # it never started the job's trials
    assert "running" in second.stdout and "1 running" in second.stdout
    first.proc.send_signal(signal.SIGINT)
    assert first.finish() == 130
    assert read_record(sweep / "0").status == "interrupted"


@pytest.mark.e2e
def test_each_job_of_a_sweep_reports_its_own_peak_rss_and_threads(tmp_path):
    """Job 0 holds ~300 MB more than job 1 and sets its own thread count; job 1 (threads null)
    must report its own smaller peak and torch's default count, not job 0's. (Before: one
    process for the sweep, so job 1 inherited both.)"""
    presets = tmp_path / "conf" / "experiment"
    presets.mkdir(parents=True)
    # torch's own default in a fresh process (what runtime.threads=null means); this process may
    # have set another count already.
    default = int(subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                                 capture_output=True, text=True, check=True).stdout)
    threads = 1  # differs from the default on a machine of 2 or more cores
    (presets / "big.yaml").write_text("# @package _global_\nmodel:\n  vocab_size: 400000\n"
                                      f"runtime:\n  threads: {threads}\n")
    (presets / "small.yaml").write_text("# @package _global_\nruntime:\n  threads: null\n")
    sweep = tmp_path / "sweep"
    proc = subprocess.run(kvbench_cmd("--config-dir", str(tmp_path / "conf"), "-m", *TINY,
                                      "experiment=big,small", f"hydra.sweep.dir={sweep}"),
                          cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    big, small = read_record(sweep / "0"), read_record(sweep / "1")
    assert big.get("model.vocab_size") == 400000 and small.get("model.vocab_size") == 256
    # the big job's embedding and LM head alone: 2 x 400000 x 64 float32 = 205 MB
    assert big.metrics["weight_bytes"] - small.metrics["weight_bytes"] > 2 * 400000 * 64 * 4 * 0.99
    assert small.metrics["peak_rss_bytes"] < big.metrics["peak_rss_bytes"] - 150 * 2**20
    assert (big.env["torch_num_threads"], small.env["torch_num_threads"]) == (threads, default)


def sweep_config(sweep_dir, *task):
    cfg = compose(*[o.split(",")[0] for o in task], hydra=True)
    cfg.hydra.overrides.task = list(task)
    cfg.hydra.sweep.dir = str(sweep_dir)
    return cfg


def test_the_end_of_a_sweep_counts_only_its_jobs_whatever_is_on_disk(tmp_path, capsys):
    """This sweep is 2 jobs. On disk: job 0 ok, job 1 a results.json that parses but is no
    record (metrics a list), and records an earlier sweep left (job 1's directory once held
    another job; jobs 2 and 3 are beyond this sweep). The table, report and exit code see
    only this sweep's 2 jobs, and never crash."""
    from kvbench.cli_sweep import sweep_end
    from kvbench.sinks.report import CSV_FILE

    sweep = tmp_path / "sweep"
    task = ["model=tiny", "attention.num_kv_heads=2,4"]
    cfg = sweep_config(sweep, *task)
    # each job's config typed once (five records below share two configs; the records only read them)
    configs = {kv: asdict(to_bench_config(compose("model=tiny", f"attention.num_kv_heads={kv}"))) for kv in (2, 4)}
    config = configs.__getitem__
    RunResult("ok", config(2), overrides=["model=tiny", "attention.num_kv_heads=2"],
              metrics={"decode_ms_p50": 1.0}).write(sweep / "0")
    (sweep / "1").mkdir()
    (sweep / "1" / "results.json").write_text('{"status": "ok", "config": {}, "metrics": [1, 2]}')
    for job in ("2", "3"):  # an earlier, longer sweep's failures
        RunResult("error", config(2), overrides=["attention.num_kv_heads=1"], error="boom").write(sweep / job)
    assert sweep_end(cfg) == 1  # job 1 of this sweep has no readable record
    out = capsys.readouterr().out
    assert "1 ok, 1 unreadable" in out and "error" not in out.split("kvbench sweep")[1].split("—")[0]
    with (sweep / CSV_FILE).open() as f:
        assert [(r["job"], r["status"]) for r in csv.DictReader(f)] == [("0", "ok"), ("1", "unreadable")]

    # Job 1 written by an earlier sweep with other overrides: not this sweep's; then its own.
    RunResult("error", config(4), overrides=["attention.num_kv_heads=4"], error="boom").write(sweep / "1")
    assert sweep_end(cfg) == 1 and "1 ok, 1 not run" in capsys.readouterr().out
    RunResult("ok", config(4), overrides=["model=tiny", "attention.num_kv_heads=4"]).write(sweep / "1")
    assert sweep_end(cfg) == 0 and "2 ok —" in capsys.readouterr().out
    # claimed by a process still running it (here: this test): running, not done, not failed
    with claim_job(sweep / "1"):
        assert sweep_end(cfg) == 1
        out, err = capsys.readouterr()
        assert "1 ok, 1 running" in out and "1 of 2 jobs are being run by another process" in err


@pytest.mark.e2e
def test_another_sweep_into_a_sweep_directory_is_refused_in_one_line(tmp_path):
    """A sweep with other overrides would renumber and overwrite the jobs already there: it is
    refused before any job runs; the same sweep again (or with rerun=true) resumes as before."""
    sweep = tmp_path / "sweep"  # jobs in kvbench's own process: the refusal is the sweep's, not a job's
    first = subprocess.run(kvbench_cmd("-m", *IN_PROCESS, "attention=mha,mqa", f"hydra.sweep.dir={sweep}"),
                           cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=180)
    assert first.returncode == 0, first.stdout + first.stderr
    before = {p: p.read_bytes() for p in sweep.glob("*/results.json")}
    other = subprocess.run(kvbench_cmd("-m", *IN_PROCESS, "attention=gqa,mqa", f"hydra.sweep.dir={sweep}"),
                           cwd=tmp_path, env=dict(run_env(), HYDRA_FULL_ERROR="0"), capture_output=True,
                           text=True, timeout=180)
    assert other.returncode == 2, other.stdout + other.stderr
    [line] = other.stderr.strip().splitlines()
    assert line.startswith(f"kvbench: invalid config: hydra.sweep.dir='{sweep}': holds another sweep (")
    assert "attention=mha,mqa" in line and "new hydra.sweep.dir" in line
    assert {p: p.read_bytes() for p in sweep.glob("*/results.json")} == before and len(before) == 2
    again = subprocess.run(kvbench_cmd("-m", *IN_PROCESS, "attention=mha,mqa", f"hydra.sweep.dir={sweep}",
                                       "rerun=false"), cwd=tmp_path, env=run_env(), capture_output=True, text=True,
                           timeout=180)
    assert again.returncode == 0 and again.stderr.count("skipped:") == 2, again.stdout + again.stderr


# experiment=search on the tiny model: 6 trials, seeded, jobs in this process; a cap of 50 kB on
# the KV cache (the tiny model's caches here hold 18-288 KiB, so some trials are over it).
SEARCH = ["experiment=search", "model=tiny", "attention.num_kv_heads=choice(1,2,4,8)", "workload.prompt_len=64",
          "workload.gen_len=8", "runtime.warmup=0", "runtime.repeats=2", "runtime.fidelity=false",
          "runtime.isolate=false", "wandb.mode=disabled", "hydra.sweeper.n_trials=6", "hydra.sweeper.sampler.seed=0",
          "objective_caps.kv_cache_bytes=50000"]


def search_config(sweep_dir, *overrides):
    """The config a search's callbacks see: its choice(...) axes are the sweeper's, not composed."""
    cfg = compose(*[o for o in overrides if "choice(" not in o], hydra=True)
    cfg.hydra.overrides.task = list(overrides)
    cfg.hydra.sweep.dir = str(sweep_dir)
    return cfg


@pytest.mark.e2e
def test_an_optuna_search_reports_the_best_trial_of_its_records_and_fails_trials_over_the_cap(tmp_path):
    """The best trial Optuna reports (optimization_results.yaml) is the largest tokens_per_s
    among the trials' results.json whose KV cache is within the cap, recomputed from the files;
    a trial over the cap returned no objective (and says so); kvbench's own end of sweep counts
    the 6 jobs; the search's directory then refuses another sweep."""
    from kvbench.cli_sweep import check_sweep_start
    from kvbench.core.errors import ConfigError

    sweep = tmp_path / "search"
    proc = subprocess.run(kvbench_cmd("-m", *SEARCH, f"hydra.sweep.dir={sweep}"), cwd=tmp_path, env=run_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/results.json"))]
    assert len(records) == 6 and {r["status"] for r in records} == {"ok"}
    within = [r for r in records if r["metrics"]["kv_cache_bytes"] <= 50_000]
    over = [r for r in records if r["metrics"]["kv_cache_bytes"] > 50_000]
    assert within and over  # the seeded trials fall on both sides of the cap
    for r in over:
        assert (f"objective: none, kv_cache_bytes={r['metrics']['kv_cache_bytes']} is above "
                "objective_caps.kv_cache_bytes=50000") in proc.stderr
    best = max(within, key=lambda r: r["metrics"]["tokens_per_s"])
    reported = OmegaConf.to_container(OmegaConf.load(sweep / "optimization_results.yaml"))
    assert reported["best_value"] == best["metrics"]["tokens_per_s"]
    assert reported["best_params"] == {"workload.batch_size": best["config"]["workload"]["batch_size"],
                                       "attention.num_kv_heads": best["config"]["attention"]["num_kv_heads"],
                                       "runtime.dtype": best["config"]["runtime"]["dtype"]}
    # the type follows the searched count; every trial's job line counts to n_trials
    assert all(r["config"]["attention"]["type"] == {8: "mha", 1: "mqa"}.get(r["config"]["attention"]["num_kv_heads"],
                                                                           "gqa") for r in records)
    assert "kvbench job 6/6:" in proc.stderr and "6 ok — results under" in proc.stdout
    # A search does not resume, and a grid may not renumber its jobs: both refused before any job.
    for cfg in (search_config(sweep, *SEARCH), sweep_config(sweep, *TINY, "attention=mha,mqa")):
        with pytest.raises(ConfigError, match="hydra.sweep.dir=.*: holds"):
            check_sweep_start(cfg)


@pytest.mark.parametrize("change, needle", [
    (["objective=null"], "objective=null: a search sweeper (hydra.sweeper._target_=hydra_plugins."),
    (["objective=tokens_per_sec"], "objective='tokens_per_sec': task=bench workload=decode records no metric"),
    (["objective_caps.kv_bytes=1"], "objective_caps.kv_bytes=1: task=bench workload=decode records no metric"),
    (["hydra.sweeper.direction=minimize"], "hydra.sweeper.direction=minimize: kvbench's objective is maximised"),
])
def test_a_search_that_could_not_mean_anything_is_refused_before_any_job(tmp_path, change, needle):
    from kvbench.cli_sweep import check_sweep_start
    from kvbench.core.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        check_sweep_start(search_config(tmp_path / "new", *SEARCH, *change))
    assert str(err.value).startswith(needle) and "\n" not in str(err.value)


@pytest.mark.e2e
def test_a_search_whose_trials_all_fail_still_ends_with_the_sweeps_table_and_exit_1(tmp_path):
    """Optuna has no best trial to report when no trial returned a value (each over a 1-byte
    cap): one line says the sweeper failed, kvbench's table and report still come, exit 1."""
    sweep = tmp_path / "search"
    proc = subprocess.run(kvbench_cmd("-m", *SEARCH, "hydra.sweeper.n_trials=2", "objective_caps.kv_cache_bytes=1",
                                      f"hydra.sweep.dir={sweep}"),
                          cwd=tmp_path, env=dict(run_env(), HYDRA_FULL_ERROR="0"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.count("objective: none, kv_cache_bytes=") == 2
    assert "kvbench: the sweeper failed: ValueError: No trials are completed yet." in proc.stderr
    assert "2 ok — results under" in proc.stdout and (sweep / "summary.md").is_file()
    assert not (sweep / "optimization_results.yaml").exists()


def test_a_job_that_never_ran_is_named_as_its_job_line_names_it(tmp_path):
    """A sweep's job with no record (not run) is named in the end tables by its variant as its job
    line named it, composed from its overrides ("gqa kv=4 (not run, job 1)"), never "None kv=None"."""
    import io

    from rich.console import Console

    from kvbench.config.layer_pattern import job_variant_label
    from kvbench.jobs.sweep import sweep_records
    from kvbench.sinks.console import sweep_tables

    task = ["model=tiny", "attention=mha,gqa,mqa"]
    cfg = sweep_config(tmp_path, *task)
    labels = {}
    for num, kind in enumerate(("mha", "gqa", "mqa")):  # the reference: each job composed as the CLI does
        job = to_bench_config(compose("model=tiny", f"attention={kind}"))
        labels[num] = job_variant_label(job)
        if kind != "gqa":
            RunResult("ok", asdict(job), overrides=["model=tiny", f"attention={kind}"],
                      metrics={"decode_ms_p50": 1.0 + num, "tokens_per_s": 100.0, "prefill_ms": 2.0}).write(
                tmp_path / str(num))
    rows = sweep_records(tmp_path, cfg)
    assert [r["status"] for r in rows] == ["ok", "not run", "ok"]
    assert rows[1]["label"] == labels[1] and labels[1].startswith("gqa kv=")
    out = Console(file=io.StringIO(), width=100, color_system=None)
    for table in sweep_tables("S", rows):
        out.print(table)
    text = " ".join(out.file.getvalue().split())
    assert f"{labels[1]} (not run, job 1)" in text and "None" not in text
