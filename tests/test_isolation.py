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
from conftest import job_processes, reap_after_test

from kvbench.config.bench import BenchConfig, CacheConfig, RuntimeConfig, WandbConfig
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.config.workload import DecodeWorkload
from kvbench.jobs.isolation import GRACE_S, _no_record, death_status, run_isolated
from kvbench.jobs.job_config import check_job
from kvbench.results import RunResult, read_record


def tiny_job(**runtime) -> BenchConfig:
    return check_job(BenchConfig(model=ModelConfig(name="t"), attention=AttentionConfig("gqa", 2),
                                 workload=DecodeWorkload(prompt_len=12, gen_len=6), cache=CacheConfig(),
                                 runtime=RuntimeConfig(device="cpu", **runtime), wandb=WandbConfig(mode="disabled")))


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


def typing_counted(job, out_dir, overrides, progress):
    """run_job in the job's process, saying in the record's env how often the config was typed there."""
    from kvbench.jobs.isolation import run_here

    calls = []
    post_init = BenchConfig.__post_init__
    BenchConfig.__post_init__ = lambda self: (calls.append(1), post_init(self))[1]
    try:
        result = run_here(job, out_dir, overrides, progress)
    finally:
        BenchConfig.__post_init__ = post_init
    result.env["typed_in_the_jobs_process"] = len(calls)
    return result


@pytest.mark.e2e
def test_the_jobs_process_runs_the_config_typed_by_its_parent(tmp_path):
    """The fork server's child is handed the typed config (pickled: not typed again) and runs it."""
    result = run_isolated(tiny_job(warmup=0, repeats=1, fidelity=False), tmp_path, measure=typing_counted)
    assert result.status == "ok", result.error
    assert result.env["typed_in_the_jobs_process"] == 0


@pytest.mark.e2e
def test_a_failure_on_the_parents_side_is_an_error_record_and_no_child_is_left(tmp_path):
    """A progress function that cannot be pickled (a lambda) fails while the job is handed to
    its process: recorded as error, never raised, never 'interrupted'."""
    result = run_isolated(tiny_job(), tmp_path, progress=lambda label, total: None)
    assert result.status == "error" and "pickle" in result.error.lower(), result.error
    assert read_record(tmp_path) == result
    assert not job_processes(os.getpid())


@pytest.mark.parametrize("returncode, said", [
    (None, " before the job's process started: nothing was measured (this record is kvbench's own)"),
    (130, " while the job's process was starting, before it measured anything (this record is kvbench's own)"),
    (-signal.SIGKILL, f"; the job's process was killed before it handed back its record (after {GRACE_S:.0f} s, "
                      "or a second signal): what it measured is lost (this record is kvbench's own)"),
])
def test_an_interrupted_job_without_its_processs_record_says_whose_record_it_has(returncode, said):
    """Ctrl-C while the job's process starts: the record kvbench writes in its place says nothing was
    measured and that it is kvbench's, never that the job 'left no record' above a ``results:`` path."""
    child = None if returncode is None else type("Child", (), {"proc": type("Proc", (), {"returncode": returncode})})
    assert _no_record(child) == said and "left no record" not in said


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
from kvbench.config.bench import BenchConfig, CacheConfig, RuntimeConfig, WandbConfig
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.config.workload import DecodeWorkload
from kvbench.jobs.job_config import check_job
from kvbench.jobs.isolation import launch_job
from kvbench.sinks.console import progress_lines
if sys.argv[2] == "submitit":
    signal.signal(signal.SIGUSR2, lambda signum, frame: sys.exit(-1))
job = check_job(BenchConfig(model=ModelConfig(name="t"), attention=AttentionConfig("gqa", 2),
                            workload=DecodeWorkload(prompt_len=12, gen_len=6), cache=CacheConfig(),
                            runtime=RuntimeConfig(device="cpu", warmup=0, repeats=100000, threads=1,
                                                  isolate=sys.argv[3] == "isolate"),
                            wandb=WandbConfig(mode="disabled")))
launch_job(job, sys.argv[1], progress=progress_lines)
"""


def start_parent(tmp_path, *mode, ignore_sigint=False):
    """``ignore_sigint``: started as ``kvbench ... &`` from a script is (a shell without job control)."""
    def ignore() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "job"), *mode], stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=dict(os.environ, WANDB_MODE="disabled"),
                            preexec_fn=ignore if ignore_sigint else None)
    reap_after_test(proc)
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
@pytest.mark.parametrize("ignore_sigint", [False, True])
def test_a_job_process_stops_when_kvbench_is_killed(tmp_path, ignore_sigint):
    """SIGKILL to the parent (a killed sweep): its job's process notices, records interrupted
    and exits, instead of measuring on after the parent's claim on the job is gone; also when the
    job ignores SIGINT, as one started in a script's background does."""
    proc = start_parent(tmp_path, "plain", "isolate", ignore_sigint=ignore_sigint)
    [child] = job_children(proc.pid)
    proc.kill()
    proc.wait()
    child.wait(GRACE_S + 10)  # past GRACE_S the watcher ends it without a record
    deadline = time.monotonic() + 10
    while not (tmp_path / "job" / "results.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    rec = read_record(tmp_path / "job")
    assert rec.status == "interrupted" and "parent process ended" in rec.error, rec.error


# ---- the fork server: a fresh process per job without a fresh interpreter ----

def _report(job, **extra):
    import torch

    from kvbench.measure.memory import peak_rss_bytes

    return RunResult("ok", asdict(job), metrics={
        "peak_rss_bytes": peak_rss_bytes(), "parent": os.getppid(), "threads": torch.get_num_threads(),
        "mark": os.environ.get("KVBENCH_TEST_MARK"), "cwd": os.getcwd(), "sighup_ignored":
        signal.getsignal(signal.SIGHUP) is signal.SIG_IGN, **extra})


def hold_600_mb(job, out_dir, overrides, progress):
    import torch

    torch.set_num_threads(1)  # a job's own setting, which must not reach the next job
    block = b"\x01" * (600 << 20)  # written, so resident
    return _report(job, held=len(block))


def hold_little(job, out_dir, overrides, progress):
    return _report(job)


def kill_the_server_then_exit(job, out_dir, overrides, progress):
    if os.getppid() != int(os.environ["KVBENCH_TEST_PID"]):  # never the test's own process
        os.kill(os.getppid(), signal.SIGKILL)
    os._exit(3)


@pytest.mark.e2e
def test_jobs_forked_by_one_server_each_report_their_own_peak_rss_threads_and_environment(tmp_path, monkeypatch):
    """Two jobs in turn from one fork server (their parent, not this process): the first holds
    600 MB and sets torch's threads to 1; the second's peak RSS is its own (a forked process starts
    with its parent's high-water mark; the server never ran a job) and its thread count is torch's
    default; each sees this process's environment and directory as they are when it starts."""
    default = int(subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                                 capture_output=True, text=True, check=True).stdout)
    monkeypatch.setenv("KVBENCH_TEST_MARK", "first")
    first = run_isolated(tiny_job(), tmp_path / "a", measure=hold_600_mb).metrics
    monkeypatch.setenv("KVBENCH_TEST_MARK", "second")
    monkeypatch.chdir(tmp_path)
    second = run_isolated(tiny_job(), tmp_path / "b", measure=hold_little).metrics
    assert first["parent"] == second["parent"] != os.getpid()  # forked by the same server
    assert first["peak_rss_bytes"] >= 600 << 20
    assert second["peak_rss_bytes"] <= first["peak_rss_bytes"] - (500 << 20), (first, second)
    assert (first["threads"], second["threads"]) == (1, default)
    assert (first["mark"], second["mark"]) == ("first", "second") and second["cwd"] == str(tmp_path)
    assert not job_processes(os.getpid())  # each job's process is gone (reaped) once its record is back


@pytest.mark.e2e
def test_a_changed_import_time_environment_or_ignored_sighup_reaches_the_job(tmp_path, monkeypatch):
    """OMP_NUM_THREADS counts when torch is imported: a job after it changes comes from a new server.
    A parent that ignores SIGHUP (nohup) has jobs that ignore it, as a new interpreter would inherit."""
    before = run_isolated(tiny_job(), tmp_path / "a", measure=hold_little).metrics
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        after = run_isolated(tiny_job(), tmp_path / "b", measure=hold_little).metrics
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert after["parent"] != before["parent"] and after["threads"] == 1
    assert after["sighup_ignored"] and not before["sighup_ignored"]


@pytest.mark.e2e
def test_a_fork_server_killed_under_a_job_is_an_error_record_and_the_next_job_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_TEST_PID", str(os.getpid()))
    lost = run_isolated(tiny_job(), tmp_path / "a", measure=kill_the_server_then_exit)
    assert lost.status == "error" and "fork server" in lost.error, lost.error
    assert read_record(tmp_path / "a") == lost
    assert run_isolated(tiny_job(), tmp_path / "b", measure=hold_little).status == "ok"


@pytest.mark.e2e
def test_without_a_fork_server_each_job_is_a_new_interpreter(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_FORK_SERVER", "0")
    result = run_isolated(tiny_job(), tmp_path, measure=hold_little)
    assert result.status == "ok" and result.metrics["parent"] == os.getpid()


@pytest.mark.e2e
@pytest.mark.parametrize("preload", ["fork_server_crash", "fork_server_cuda"])
def test_a_fork_server_that_dies_starting_leaves_the_job_to_a_new_interpreter(tmp_path, monkeypatch, preload):
    """A server that ends before it is ready (an import that crashes it; CUDA initialised by an
    import, which a forked child could not use): the job runs all the same, in a new interpreter,
    which would show the import's own failure in the record."""
    from kvbench.jobs import isolation

    monkeypatch.setattr(isolation, "_server", None)
    monkeypatch.setattr(isolation, "PRELOAD", ("kvbench.jobs.isolation", preload))
    result = run_isolated(tiny_job(), tmp_path, measure=hold_little)
    assert result.status == "ok" and result.metrics["parent"] == os.getpid()
    isolation._server.close()
