"""Jobs in a fresh process (kvbench/jobs/isolation.py): every way a job's process can end becomes a
record; a launcher's SystemExit (submitit on preemption) is recorded interrupted, never ok; a
job process never outlives the kvbench process that started it.

The crash tests swap the measuring function for one that crashes the real child process in a
real way (a segfault, an exit code, SIGKILL); this module imports nothing heavy at its top, as
the child imports it to find that function.
"""

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict

import pytest
from conftest import job_processes

from kvbench.config import BenchConfig, CacheConfig, RuntimeConfig, WandbConfig, WorkloadConfig
from kvbench.jobs.isolation import death_status, run_isolated
from kvbench.model_config import AttentionConfig, ModelConfig
from kvbench.results import RunResult, read_record


def tiny_job(**runtime) -> BenchConfig:
    return BenchConfig(model=ModelConfig(name="t"), attention=AttentionConfig("gqa", 2),
                       workload=WorkloadConfig(prompt_len=12, gen_len=6), cache=CacheConfig(),
                       runtime=RuntimeConfig(device="cpu", **runtime), wandb=WandbConfig(mode="disabled"))


# ---- what the child runs instead of run_job (importable, so spawn can pickle them) ----

def segfault(job, out_dir, overrides, progress):
    ctypes.string_at(0)  # reads address 0: SIGSEGV


def exit_3(job, out_dir, overrides, progress):
    os._exit(3)


def write_then_die(job, out_dir, overrides, progress):
    RunResult("ok", asdict(job), metrics={"decode_ms_p50": 1.5}).write(out_dir)
    os.kill(os.getpid(), signal.SIGKILL)  # after its record, before handing it back


@pytest.mark.parametrize("measure, status, needle", [
    (segfault, "error", "died of SIGSEGV"),
    (exit_3, "error", "exited with code 3"),
    (write_then_die, "ok", None),
])
@pytest.mark.e2e
def test_every_end_of_a_job_process_is_a_record(tmp_path, measure, status, needle):
    result = run_isolated(tiny_job(), tmp_path, ["x=1"], measure=measure)
    assert result.status == status and (needle is None or needle in result.error), result.error
    on_disk = read_record(tmp_path)
    assert on_disk == result and on_disk.overrides == (["x=1"] if needle else [])
    assert on_disk.config["attention"]["num_kv_heads"] == 2
    if needle is None:  # the record the child wrote, found on disk since none came back
        assert on_disk.metrics == {"decode_ms_p50": 1.5}


@pytest.mark.e2e
def test_a_failure_on_the_parents_side_is_an_error_record_and_no_child_is_left(tmp_path):
    """A progress function that cannot be pickled (a lambda) fails while the job is handed to
    its process: recorded as error, never raised, never 'interrupted'."""
    result = run_isolated(tiny_job(), tmp_path, progress=lambda label, total: None)
    assert result.status == "error" and "pickle" in result.error.lower(), result.error
    assert read_record(tmp_path) == result
    assert not job_processes(os.getpid())


@pytest.mark.parametrize("exitcode, before, after, status, needle", [
    (-signal.SIGKILL, 5, 6, "oom", "OOM killer killed 1 process"),
    (-signal.SIGKILL, 5, None, "oom", "most likely by the kernel's OOM killer (unconfirmed"),
    (-signal.SIGKILL, 5, 5, "interrupted", "not by the kernel's OOM killer"),
    (-signal.SIGTERM, 5, 5, "interrupted", "killed by SIGTERM"),
    (-signal.SIGABRT, 5, 5, "error", "died of SIGABRT (Aborted)"),
    (-signal.SIGBUS, None, None, "error", "died of SIGBUS"),
    (0, 5, 5, "error", "exited with code 0 without writing a record"),
])
def test_death_status_tells_oom_from_kill_from_crash(exitcode, before, after, status, needle):
    got_status, error = death_status(exitcode, before, after)
    assert got_status == status and needle in error, error


# A parent as launchers run it: submitit, on preemption or timeout, requeues the job from its
# SIGUSR2 handler and then calls sys.exit(-1) wherever the parent happens to be.
PARENT = """
import signal, sys
from kvbench.config import *
from kvbench.jobs.isolation import launch_job
from kvbench.sinks.console import progress_lines
if sys.argv[2] == "submitit":
    signal.signal(signal.SIGUSR2, lambda signum, frame: sys.exit(-1))
job = BenchConfig(model=ModelConfig(name="t"), attention=AttentionConfig("gqa", 2),
                  workload=WorkloadConfig(prompt_len=12, gen_len=6), cache=CacheConfig(),
                  runtime=RuntimeConfig(device="cpu", warmup=0, repeats=100000, threads=1,
                                        isolate=sys.argv[3] == "isolate"),
                  wandb=WandbConfig(mode="disabled"))
launch_job(job, sys.argv[1], progress=progress_lines)
"""


def start_parent(tmp_path, *mode):
    proc = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "job"), *mode], stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=dict(os.environ, WANDB_MODE="disabled"))
    for line in proc.stderr:  # "  mha kv=8: 0/100000": the trials have started
        if line.rstrip().endswith(": 0/100000"):
            return proc
    raise AssertionError(f"the job never started its trials (exit {proc.wait()})")


@pytest.mark.e2e
@pytest.mark.parametrize("isolate", ["isolate", "in-process"])
def test_a_launchers_exit_on_preemption_is_recorded_interrupted_not_ok(tmp_path, isolate):
    """SIGUSR2 to every process of the job (as SLURM signals a job step): the parent's handler
    exits; the record says interrupted and keeps what was complete; the process exits as the
    launcher said (-1), so submitit's requeued job runs it again. (Before: "ok".)"""
    proc = start_parent(tmp_path, "submitit", isolate)
    measuring = job_children(proc.pid)
    os.killpg(proc.pid, signal.SIGUSR2)
    assert proc.wait(60) == 255, proc.stderr.read()
    rec = read_record(tmp_path / "job")
    assert rec.status == "interrupted" and "SystemExit(-1)" in rec.error, rec.error
    assert rec.metrics["weight_bytes"] > 0 and "decode_ms_p50" not in rec.metrics
    assert len(measuring) == (isolate == "isolate") and not any(c.is_running() for c in measuring)


def job_children(pid):
    """The processes measuring a job that ``pid`` started."""
    return job_processes(pid)


@pytest.mark.e2e
def test_a_job_process_stops_when_kvbench_is_killed(tmp_path):
    """SIGKILL to the parent (a killed sweep): its job's process notices, records interrupted
    and exits, instead of measuring on after the parent's claim on the job is gone."""
    proc = start_parent(tmp_path, "plain", "isolate")
    [child] = job_children(proc.pid)
    proc.kill()
    proc.wait()
    child.wait(40)
    deadline = time.monotonic() + 10
    while not (tmp_path / "job" / "results.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    rec = read_record(tmp_path / "job")
    assert rec.status == "interrupted" and "parent process ended" in rec.error, rec.error
