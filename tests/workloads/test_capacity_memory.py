"""task=capacity on a CPU: a probe's measured memory is its own, whatever earlier probes of the
process left resident (issue 59: after a large probe's paired TPOT imported scipy.stats, 61 MiB,
every later probe counted it, and under experiment=choose's 80 MB budget measured 0 past 32 tokens)."""

import sys

import pytest
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
TINY = ("task=capacity", "model=tiny", "attention=mha", "workload.gen_len=4")


@pytest.fixture(scope="module")
def tiny():
    """(the pre-model baseline, the tiny model a job builds), shared by the tests here."""
    baseline = capacity.baseline_bytes(CPU)
    return baseline, build_model(to_bench_config(compose(*TINY)), CPU)


def test_a_small_probe_after_a_large_one_measures_as_it_does_alone(tiny, one_torch_thread):
    cfg = to_bench_config(compose(*TINY, "capacity.context_lens=[32]", "runtime.memory_budget_gb=64"))
    baseline, model = tiny
    assert "scipy.stats" in sys.modules  # what judging a probe imports is loaded before the baseline
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


def test_a_probe_over_the_budget_stops_at_the_forward_that_crossed_it(tiny, one_torch_thread):
    """A CPU probe's memory verdict is in once its resident set passes the budget: it stops there
    instead of prefilling the rest of batch x context tokens and decoding (the failing probe above each
    answer was a search's largest); its peak, above the budget, is recorded. Under a budget it reaches
    it runs every forward: the first prompt's 62 positions in forwards of 16, copied into the other 7
    (capacity.copy_prompts), the batch's last 2 (chunk 16 over 8 sequences), and 4 decode steps."""
    baseline, model = tiny
    calls = []
    hook = model.register_forward_hook(lambda *_: calls.append(1))
    forwards = {}
    for budget_gb in (64, 0.0008):
        cfg = to_bench_config(compose(*TINY, "capacity.context_lens=[64]", "capacity.prefill_chunk=16",
                                      f"runtime.memory_budget_gb={budget_gb}"))
        with long_lived_frozen():
            capacity.warm_up(cfg, model, CPU)
            calls.clear()
            prober = capacity.Prober(cfg, model, CPU, capacity.memory_budget(cfg, CPU), baseline)
            probe = prober.measure(64, 8)
        forwards[budget_gb] = len(calls)
        assert probe.measured and not probe.oom
        if budget_gb == 64:
            assert probe.ok and probe.error is None
        else:  # its KV alone (the formula: 0.56 MB) is under the budget; the process's footprint is not
            assert probe.kv_bytes < prober.budget < probe.peak_bytes and probe.violated == ["memory"]
            assert probe.error == f"stopped after {len(calls)} forwards: the resident set passed the budget"
    hook.remove()
    assert forwards[64] == -(-62 // 16) + 1 + 4 and 1 <= forwards[0.0008] < forwards[64] // 2, forwards
