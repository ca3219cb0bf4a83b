"""runtime.device=cuda:free: one GPU per concurrent process (lock files), also across joblib workers."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from kvbench.core.errors import ConfigError
from kvbench.jobs.device import hold_free_gpu, resolve_device

HOLD = ("import sys, time\nfrom kvbench.jobs.device import hold_free_gpu\nfrom kvbench.core.errors import ConfigError\n"
        "try:\n    print(hold_free_gpu(['GPU-aa', 'GPU-bb'], sys.argv[1]), flush=True)\n"
        "except ConfigError as e:\n    print(e, flush=True)\n    sys.exit(2)\ntime.sleep(120)\n")


def _holder(lock_dir):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(lock_dir)], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


@pytest.mark.e2e
def test_each_process_holds_its_own_gpu_until_it_dies(tmp_path):
    procs = []
    try:
        first, got = _holder(tmp_path)
        procs.append(first)
        assert got == "0"
        second, got = _holder(tmp_path)
        procs.append(second)
        assert got == "1"
        third, got = _holder(tmp_path)
        assert third.wait() == 2
        assert "runtime.device='cuda:free': all 2 GPUs" in got and "hydra.launcher.n_jobs=2" in got
        first.send_signal(signal.SIGKILL)  # the kernel releases the dead process's lock
        first.wait()
        fourth, got = _holder(tmp_path)
        procs.append(fourth)
        assert got == "0"
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert hold_free_gpu(["x", "y"], tmp_path / "own") == hold_free_gpu(["x", "y"], tmp_path / "own") == 0


def _job_on_a_gpu(lock_dir):
    time.sleep(0.2)  # long enough that both workers are busy at once
    return os.getpid(), hold_free_gpu(["GPU-aa", "GPU-bb"], lock_dir)


@pytest.mark.e2e  # loky worker processes
def test_joblib_workers_get_distinct_gpus(tmp_path):
    """What hydra/launcher=joblib does: loky worker processes each run several jobs."""
    from joblib import Parallel, delayed

    out = Parallel(n_jobs=2, backend="loky")(delayed(_job_on_a_gpu)(str(tmp_path)) for _ in range(6))
    by_pid = {}
    for pid, index in out:
        assert by_pid.setdefault(pid, index) == index  # a worker keeps its GPU
    assert len(set(by_pid.values())) == len(by_pid)  # no two workers share one


@pytest.mark.cuda
def test_cuda_free_on_a_real_gpu_is_held_by_one_process_at_a_time(tmp_path):
    """Every GPU of the machine held by child processes through runtime.device=cuda:free: the next
    process is told, in one line, that all are held."""
    import torch

    env = dict(os.environ, TMPDIR=str(tmp_path))  # a private lock directory for this test
    hold = ("import time\nfrom kvbench.jobs.device import resolve_device\n"
            "print(resolve_device('cuda:free'), flush=True)\ntime.sleep(120)\n")
    holders = []
    try:
        for i in range(torch.cuda.device_count()):
            p = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True, env=env)
            holders.append(p)
            assert p.stdout.readline().strip() == f"cuda:{i}"
        probe = ("from kvbench.jobs.device import resolve_device\nfrom kvbench.core.errors import ConfigError\n"
                 "try:\n    resolve_device('cuda:free')\nexcept ConfigError as e:\n    print(e)\n")
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
        assert f"all {torch.cuda.device_count()} GPUs" in out.stdout, out.stdout + out.stderr
    finally:
        for p in holders:
            p.kill()


def test_a_cuda_index_this_machine_lacks_is_invalid(monkeypatch):
    """cuda:N beyond the visible GPUs once failed later, as an internal "invalid device ordinal".
    The seam: torch told there are 2 GPUs (this machine may have none)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"runtime.device='cuda:2': this machine has 2 CUDA device\(s\)"):
        resolve_device("cuda:2")
