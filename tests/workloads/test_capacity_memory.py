"""task=capacity on a CPU: a probe's measured memory is its own, whatever earlier probes of the
process left resident (issue 59: after a large probe's paired TPOT imported scipy.stats, 61 MiB,
every later probe counted it, and under experiment=choose's 80 MB budget measured 0 past 32 tokens)."""

import sys

import torch
from conftest import compose

from kvbench.jobs.job_config import to_bench_config
from kvbench.measure.host import long_lived_frozen
from kvbench.tasks import capacity
from kvbench.tasks.common import build_model

CPU = torch.device("cpu")
MiB = 2 ** 20
# what an earlier probe might leave resident (an import, a module's cache, heap the allocator kept)
LEFT = 64 * MiB
# a batch-1 probe of the tiny model measured alone and after a large one, three times each, spread
# 0.1-1.0 MiB (whole pages of allocator and interpreter state): 4 MiB is above that, far below LEFT
TOLERANCE = 4 * MiB


def test_a_small_probe_after_a_large_one_measures_as_it_does_alone():
    torch.set_num_threads(1)
    cfg = to_bench_config(compose("task=capacity", "model=tiny", "attention=mha", "capacity.context_lens=[32]",
                                  "workload.gen_len=4", "runtime.memory_budget_gb=64"))
    baseline = capacity.baseline_bytes(CPU)
    assert "scipy.stats" in sys.modules  # what judging a probe imports is loaded before the baseline
    model = build_model(cfg, CPU)
    budget = capacity.memory_budget(cfg, CPU)
    with long_lived_frozen():  # as run_probes: a probe's collections scan only what it made
        capacity.warm_up(cfg, model, CPU)  # as run_probes: what the runtime sets up once is in place
        alone = capacity.Prober(cfg, model, CPU, budget, baseline).measure(32, 1)
        prober = capacity.Prober(cfg, model, CPU, budget, baseline)
        large = prober.measure(32, 64)
        left = torch.ones(LEFT // 4)  # touched: resident until the end of the test
        small = prober.measure(32, 1)
    # the large probe holds what its 63 more sequences' caches hold (the KV formula)
    assert large.peak_bytes - alone.peak_bytes >= large.kv_bytes - alone.kv_bytes
    assert alone.ok and large.ok and small.ok
    assert abs(small.peak_bytes - alone.peak_bytes) <= TOLERANCE, (small.peak_bytes, alone.peak_bytes)
    # it is the per-probe baseline that keeps LEFT out: counted from before the first probe, it is in
    assert small.retained_bytes >= LEFT - TOLERANCE and large.retained_bytes == 0
    assert small.peak_bytes + small.retained_bytes - alone.peak_bytes >= LEFT - TOLERANCE
    assert small.activation_bytes == small.peak_bytes - prober.weights - small.kv_bytes
    del left
