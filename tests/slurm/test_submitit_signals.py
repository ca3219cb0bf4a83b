"""How a job under submitit's own signal handlers records SLURM's signals, without a SLURM (these
run in the ordinary suite; tests/slurm/test_slurm.py makes the same signals on a real one).

submitit installs in every job a SIGTERM handler that only logs it (``bypass``) and a SIGUSR2
handler that requeues the job, or, when it will not (a timed-out job with ``max_num_timeout``
used up), raises UncompletedJobError wherever the job is. Before: SIGTERM let the job measure on
until SLURM's SIGKILL, with no record, and UncompletedJobError was recorded ``error``."""

import os
import signal
import subprocess
import sys

import pytest
from conftest import job_processes, reap_after_test

from kvbench.jobs.interrupts import bypassed, launcher_stop
from kvbench.results import read_record

# A job's first process as submitit's process_job leaves it: submitit's real bypass on SIGTERM;
# on SIGUSR2 what its handler does for a timed-out job it will not requeue (the seam: the raise
# only, as checkpoint_and_try_requeue ends; the real handler needs a SLURM job around it).
PARENT = """
import logging, signal, sys
from submitit.core.job_environment import SignalHandler
from submitit.core.utils import UncompletedJobError
from kvbench.config.bench import BenchConfig, CacheConfig, RuntimeConfig, WandbConfig
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.config.workload import DecodeWorkload
from kvbench.jobs.job_config import check_job
from kvbench.jobs.isolation import launch_job
from kvbench.sinks.console import progress_lines
handler = object.__new__(SignalHandler)
handler._logger = logging.getLogger("submitit")
signal.signal(signal.SIGTERM, handler.bypass)
def not_requeued(signum, frame):
    raise UncompletedJobError("Job not requeued because: timed-out too many times.")
signal.signal(signal.SIGUSR2, not_requeued)
job = check_job(BenchConfig(model=ModelConfig(name="t"), attention=AttentionConfig("gqa", 2),
                            workload=DecodeWorkload(prompt_len=12, gen_len=6), cache=CacheConfig(),
                            runtime=RuntimeConfig(device="cpu", warmup=0, repeats=100000, threads=1,
                                                  isolate=sys.argv[2] == "isolate"),
                            wandb=WandbConfig(mode="disabled")))
launch_job(job, sys.argv[1], progress=progress_lines)
"""


def start_job(tmp_path, isolate):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # not in a SLURM job
    proc = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "job"), isolate], stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=dict(env, WANDB_MODE="disabled"))
    reap_after_test(proc)
    for line in proc.stderr:  # "  gqa kv=2: 0/100000": the trials have started
        if line.rstrip().endswith(": 0/100000"):
            return proc, job_processes(proc.pid)
    raise AssertionError(f"the job never started its trials (exit {proc.wait()})")


@pytest.mark.e2e  # the job runs in a process of its own that is signalled
@pytest.mark.parametrize("isolate", ["isolate", "in-process"])
def test_sigterm_that_submitit_bypasses_is_recorded_interrupted(tmp_path, isolate):
    """SIGTERM to every process of the job, as SLURM ends one (time limit, scancel, requeue)."""
    proc, measuring = start_job(tmp_path, isolate)
    os.killpg(proc.pid, signal.SIGTERM)
    code = proc.wait(60)
    rec = read_record(tmp_path / "job")
    assert rec.status == "interrupted" and rec.error == "interrupted by SIGTERM", rec.error
    assert rec.metrics["weight_bytes"] > 0 and "decode_ms_p50" not in rec.metrics
    # raised again (no result for submitit to pickle: SLURM requeues or ends the job)
    assert code != 0 and "Interrupted: interrupted by SIGTERM" in proc.stderr.read()
    assert len(measuring) == (isolate == "isolate") and not any(c.is_running() for c in measuring)


@pytest.mark.e2e  # the job runs in a process of its own that is signalled
@pytest.mark.parametrize("isolate", ["isolate", "in-process"])
def test_submitits_refusal_to_requeue_a_timed_out_job_is_recorded_interrupted_not_error(tmp_path, isolate):
    """SIGUSR2 (SLURM's warning before --time) to every process; submitit will not requeue."""
    proc, measuring = start_job(tmp_path, isolate)
    os.killpg(proc.pid, signal.SIGUSR2)
    code = proc.wait(60)
    rec = read_record(tmp_path / "job")
    assert rec.status == "interrupted", rec.error
    assert rec.error.startswith("stopped by submitit: Job not requeued because: timed-out too many times. "
                                "(SLURM's SIGUSR2 before the time limit"), rec.error
    assert code == 1 and "UncompletedJobError" in proc.stderr.read()  # raised again, for submitit's error result
    assert not any(c.is_running() for c in measuring)


def test_only_submitits_bypass_and_uncompleted_job_error_count():
    from submitit.core.job_environment import SignalHandler
    from submitit.core.utils import FailedJobError, UncompletedJobError

    handler = object.__new__(SignalHandler)
    assert bypassed(handler.bypass) and not bypassed(handler.checkpoint_and_try_requeue)
    assert not bypassed(signal.SIG_IGN) and not bypassed(signal.default_int_handler)
    assert launcher_stop(UncompletedJobError("x")) and not launcher_stop(FailedJobError("x"))
    assert not launcher_stop(RuntimeError("UncompletedJobError"))
