"""The environment record against torch's own answers."""

import os

import pytest
import torch

from kvbench.measure.env import collect_env


def test_collect_env_matches_torch():
    env = collect_env(torch.device("cpu"))
    assert env["torch"] == torch.__version__
    assert env["torch_num_threads"] == torch.get_num_threads()
    assert env["cpu_count"] == os.cpu_count() and env["device_type"] == "cpu"
    assert env["torch_cuda"] == torch.version.cuda
    assert env["git_commit"] is None or len(env["git_commit"]) == 40


@pytest.mark.cuda
def test_cuda_event_timing_agrees_with_a_synchronised_host_clock():
    """RegionTimer on a GPU times with CUDA events; a region that keeps the GPU busy ~50 ms reads
    the same (within 20%) as the host clock around it with a synchronise."""
    import time

    from kvbench.measure.timing import RegionTimer, timing_method

    device = torch.device("cuda")
    a = torch.randn(4096, 4096, device=device)
    (a @ a).sum().item()  # warm-up: handles and kernels loaded
    timer = RegionTimer(device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with timer.region("work"):
        for _ in range(40):
            a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
    host_ms = (time.perf_counter() - t0) * 1e3
    [event_ms] = timer.ms("work")
    assert timing_method(device) == "cuda_events"
    assert 0.8 * host_ms <= event_ms <= 1.05 * host_ms, (event_ms, host_ms)


def test_a_job_is_noisy_when_the_machine_had_more_work_than_cpus():
    from kvbench.measure.env import load_average, noisy, usable_cpus

    assert noisy(1.9, 2.2, 2) == (False, None)  # our own 2 threads on 2 cores
    flag, why = noisy(1.0, 3.4, 2)
    assert flag is True and "load average 3.40 on 2 usable CPUs" in why
    assert noisy(None, None, 2) == (None, None)
    assert usable_cpus() >= 1 and (load_average() is None or load_average() >= 0)
