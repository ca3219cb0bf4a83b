"""kvbench sweeps on a real one-node SLURM (scripts/slurm_local.sh), through hydra/launcher=slurm
and sbatch: an array of ok records like a local sweep's, the preset's keys in the sbatch script,
and the faults as SLURM makes them: a requeue (preemption) of a running job, a job past its
--time, scancel of the array, the submitting process killed, and the resumed sweep. The commands
are docs/slurm.md's (test_the_docs_page_gives_these_commands)."""

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from slurm.cluster import HOW

from kvbench.results import RESULTS_FILE, RecordError, read_record

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]  # sbatch starts interpreters
DOCS = Path(__file__).resolve().parents[2] / "docs" / "slurm.md"

# docs/slurm.md's commands, run here as written (with `kvbench` as this interpreter's module).
# The one-node cluster has no GPU and 2 CPUs: a job asks for 1 CPU, 1 GB and no GPU.
ON_THIS_NODE = ("hydra/launcher=slurm hydra.launcher.partition=debug hydra.launcher.gpus_per_node=null "
                "hydra.launcher.cpus_per_task=1 hydra.launcher.mem_gb=1")
TINY = "model=tiny workload.prompt_len=12 workload.gen_len=6 runtime.threads=1"
SWEEP = f"kvbench -m {ON_THIS_NODE} hydra.launcher.array_parallelism=2 {TINY} attention=mha,mqa"
LOCAL = f"kvbench -m {TINY} attention=mha,mqa"
# Jobs long enough to be signalled mid-measurement: 300 trials (a few seconds on an idle core).
LONG = f"kvbench -m {ON_THIS_NODE} {TINY} runtime.warmup=0 runtime.repeats=300"
REQUEUE = f"{LONG} attention=gqa"
TIMEOUT = (f"kvbench -m {ON_THIS_NODE} hydra.launcher.timeout_min=1 hydra.launcher.signal_delay_s=20 {TINY} "
           "runtime.warmup=0 runtime.repeats=1000000 attention=mqa")
RESUME = f"{LONG} hydra.launcher.array_parallelism=1 runtime.isolate=false workload.batch_size=1,2,3"
GRES = f"kvbench -m {ON_THIS_NODE} hydra.launcher.gres=gpu:1 model=tiny attention=mha,mqa"
COMMANDS = [SWEEP, LOCAL, REQUEUE, TIMEOUT, RESUME, GRES]


def argv(command: str, sweep: Path, *extra: str) -> list:
    words = shlex.split(command)
    assert words[0] == "kvbench"
    return [sys.executable, "-m", "kvbench.cli", *words[1:], "wandb.mode=disabled", f"hydra.sweep.dir={sweep}", *extra]


def env():
    return {**{k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}, "WANDB_MODE": "disabled"}


def start(command: str, sweep: Path, *extra: str) -> subprocess.Popen:
    log = open(sweep.parent / f"{sweep.name}.log", "w")
    return subprocess.Popen(argv(command, sweep, *extra), cwd=sweep.parent, env=env(), stdout=log,
                            stderr=subprocess.STDOUT, text=True)


def output(sweep: Path) -> str:
    return (sweep.parent / f"{sweep.name}.log").read_text()


def until(what, timeout: float, why: str, every: float = 0.3):
    """``what()`` once it is truthy, polled; fails naming ``why`` after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = what()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"not within {timeout:.0f} s: {why}")


def job_logs(sweep: Path) -> str:
    """Every job's log (submitit's, under the sweep's .submitit/), appended across requeues."""
    return "".join(p.read_text(errors="replace") for p in sorted(sweep.glob(".submitit/*/*_log.*")))


def job_log(sweep: Path, num: int) -> str:
    """The log of job ``num`` of the sweep, over every array that ran it (a resume is another)."""
    return "".join(p.read_text(errors="replace") for p in sorted(sweep.glob(f".submitit/*_{num}/*_{num}_0_log.err")))


def record(job_dir: Path):
    try:
        return read_record(job_dir)
    except RecordError:
        return None


def submitted(sweep: Path) -> str:
    """The SLURM job id of the sweep's submission (an array's id), once submitit has written it."""
    scripts = until(lambda: list(sweep.glob(".submitit/*/*_submission.sh")), 300, "the sweep submitted")
    return scripts[0].name.split("_")[0]


def scontrol_job(job_id: str) -> dict:
    text = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S+)", text))


def queued() -> list:
    """(job id, state) of every job SLURM still holds, array tasks one by one."""
    lines = subprocess.run(["squeue", "-h", "-r", "-o", "%i %T"], capture_output=True, text=True).stdout.split("\n")
    return [tuple(line.split()) for line in lines if line.strip()]


def release(job_id: str) -> None:
    """Start a requeued job now: SLURM holds a requeued batch job for 120 s (BeginTime)."""
    until(lambda: scontrol_job(job_id).get("JobState") == "PENDING", 60, f"job {job_id} pending again")
    subprocess.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"], check=True)


def lowest_priority(sweep: Path, stop: threading.Event) -> None:
    """Nice 19 for every process of the sweep's SLURM job (``scontrol listpids``), the isolated
    job process included once it starts: the job only has to be running when its time limit
    comes, and at nice 0 it took one of the machine's 2 cores from the rest of the suite for
    more than a minute."""
    reniced = set()
    end = time.monotonic() + 240
    while not stop.is_set() and time.monotonic() < end:
        scripts = list(sweep.glob(".submitit/*/*_submission.sh"))
        if scripts:
            out = subprocess.run(["scontrol", "listpids", scripts[0].name.split("_")[0]], capture_output=True,
                                 text=True).stdout
            for pid in {int(w[0]) for w in (line.split() for line in out.splitlines()[1:]) if w and w[0].isdigit()}:
                if pid not in reniced:
                    try:
                        os.setpriority(os.PRIO_PROCESS, pid, 19)
                        reniced.add(pid)
                    except OSError:  # gone already
                        pass
        stop.wait(1.0)


@pytest.fixture(scope="module")
def timed_out(slurm_cluster, tmp_path_factory):
    """The sweep whose job runs past its --time: started before the other tests, since SLURM
    ends a job at a minute's resolution (its time limit is at least one minute)."""
    sweep = tmp_path_factory.mktemp("timeout") / "sweep"
    proc = start(TIMEOUT, sweep)
    stop = threading.Event()
    threading.Thread(target=lowest_priority, args=(sweep, stop), daemon=True).start()
    yield proc, sweep
    stop.set()
    if proc.poll() is None:  # a test before this one failed: its job goes too
        proc.kill()
        for script in sweep.glob(".submitit/*/*_submission.sh"):
            subprocess.run(["scancel", script.name.split("_")[0]])


def test_the_docs_page_gives_these_commands():
    page = DOCS.read_text()
    for command in [*COMMANDS, HOW]:
        assert command in " ".join(page.replace("\\\n", " ").split()), command


def test_a_sweep_through_sbatch_is_an_array_of_ok_records_like_a_local_sweep(timed_out, tmp_path):
    sweep, local = tmp_path / "sweep", tmp_path / "local"
    proc = start(SWEEP, sweep)
    ref = subprocess.run(argv(LOCAL, local, "runtime.isolate=false"), cwd=tmp_path, env=env(), capture_output=True,
                         text=True, timeout=300)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    assert proc.wait(300) == 0, output(sweep)
    assert "2 ok" in output(sweep)
    # one sbatch script for an array of 2, at most 2 at once, with the preset's keys as given
    [script] = sweep.glob(".submitit/*/*_submission.sh")
    directives = {line.split()[1] for line in script.read_text().splitlines() if line.startswith("#SBATCH")}
    assert {"--array=0-1%2", "--partition=debug", "--cpus-per-task=1", "--mem=1GB", "--time=60",
            "--job-name=kvbench", "--ntasks-per-node=1", "--nodes=1"} <= directives, directives
    assert not any(d.startswith("--gpus") for d in directives)
    array = script.name.split("_")[0]
    states = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", array], capture_output=True,
                            text=True).stdout.split()
    assert sorted(states) == [f"{array}_0|COMPLETED", f"{array}_1|COMPLETED"]
    for job in ("0", "1"):
        slurm, here = read_record(sweep / job), read_record(local / job)
        assert slurm.status == here.status == "ok", (slurm.error, here.error)
        here.config["runtime"]["isolate"] = True  # the reference measured in one process, for speed
        assert slurm.config == here.config  # the same job: the launcher is not part of it
        # the same figures, measured (a later job of a sweep in one process says its peak RSS is not its own)
        assert set(slurm.metrics) == set(here.metrics) - {"peak_rss_reason"}
        assert slurm.metrics["kv_cache_bytes"] == here.metrics["kv_cache_bytes"] == slurm.metrics[
            "kv_cache_bytes_formula"]


def test_gres_reaches_sbatch_and_a_cluster_without_it_refuses_in_one_line(timed_out, tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.run(argv(GRES, sweep), cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # submitit keeps the script sbatch refused under its temporary name
    [script] = sweep.glob(".submitit/.submission_file_*.sh")
    assert "#SBATCH --gres=gpu:1" in script.read_text().splitlines()
    assert "kvbench: the sweeper failed: FailedJobError: sbatch: error: Invalid generic resource (gres) " \
           "specification" in proc.stderr.splitlines()
    assert "2 not run" in proc.stdout  # no job of it ran, nothing recorded as measured


def test_a_requeued_job_is_recorded_interrupted_and_the_requeued_run_completes_it(timed_out, tmp_path):
    sweep = tmp_path / "sweep"
    proc = start(REQUEUE, sweep)
    until(lambda: "gqa kv=2: 0/300" in job_logs(sweep), 300, "the job's trials began")
    job_id = submitted(sweep)  # one job: submitit submits it as a plain job, not an array
    assert (job_id, "RUNNING") in queued()
    subprocess.run(["scontrol", "requeue", job_id], check=True)  # what preemption with requeue does
    first = until(lambda: (r := record(sweep / "0")) and r.status == "interrupted" and r, 90,
                  "an interrupted record")
    # as sacct states it, or the generic reason when sacct does not answer within its 2 s
    prefix = f"interrupted by SIGTERM from SLURM: job {job_id} is "
    assert first.error in (prefix + "requeued (scontrol requeue, or preempted)",
                           prefix + "being ended (its time limit, scancel, a requeue or preemption)")
    assert "decode_ms_p50" not in first.metrics and first.metrics["weight_bytes"] > 0  # what was complete
    release(job_id)
    assert proc.wait(300) == 0, output(sweep)
    final = read_record(sweep / "0")
    assert final.status == "ok" and final.started_at > first.started_at
    assert scontrol_job(job_id).get("Restarts") == "1"
    assert job_logs(sweep).count("kvbench job 1/1") == 2  # run twice, by SLURM
    assert "1 ok" in output(sweep)


def test_scancel_of_the_array_after_the_submitter_is_killed_then_the_resumed_sweep_measures_each_job_once(
        timed_out, tmp_path):
    sweep = tmp_path / "sweep"
    # RESUME names no attention: model=tiny runs in its own layout, MHA with 8 KV heads
    proc = start(RESUME, sweep)
    first = until(lambda: (r := record(sweep / "0")) and r.status == "ok" and r, 300, "job 0 ok")
    until(lambda: "mha kv=8: 0/300" in job_log(sweep, 1), 300, "job 1's trials began")
    proc.send_signal(signal.SIGKILL)  # the login node's session is gone
    proc.wait()
    array_id = submitted(sweep)
    assert (f"{array_id}_1", "RUNNING") in queued()  # the array outlives its submitter
    subprocess.run(["scancel", array_id], check=True)
    cancelled = until(lambda: (r := record(sweep / "1")) and r, 90, "job 1's record")
    assert cancelled.status == "interrupted", cancelled.error
    # the reason as sacct states it, or (when sacct does not answer within its 2 s) the generic one
    assert cancelled.error.startswith((f"interrupted by SIGTERM from SLURM: job {array_id}_1 is cancelled (scancel)",
                                       f"interrupted by SIGTERM from SLURM: job {array_id}_1 is being ended "))
    assert not (sweep / "2" / RESULTS_FILE).exists()  # never started
    until(lambda: not any(j.startswith(f"{array_id}_") for j, _ in queued()), 90, "the array gone")
    # resumed: the same command into the same directory runs only what is not ok
    resumed = subprocess.run(argv(RESUME, sweep), cwd=tmp_path, env=env(), capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "3 ok" in resumed.stdout
    assert read_record(sweep / "0").started_at == first.started_at  # not measured twice
    assert read_record(sweep / "1").started_at > cancelled.started_at
    assert all(read_record(sweep / j).status == "ok" for j in "012")
    assert [job_log(sweep, n).count("mha kv=8: 0/300") for n in range(3)] == [1, 2, 1]  # trials begun


def test_a_job_past_its_time_limit_is_interrupted_with_the_reason_never_ok(timed_out):
    proc, sweep = timed_out
    code = proc.wait(240)
    rec = read_record(sweep / "0")
    assert rec.status == "interrupted", rec.error
    assert "time limit" in rec.error, rec.error
    assert code == 1, output(sweep)
    assert "1 interrupted" in output(sweep)  # the sweep's table and counts, after one line
