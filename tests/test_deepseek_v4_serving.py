"""DeepSeek-V4's compressed layers in the serving stores (kvbench/serving/pool_manager.py, the kind's
paged cache kvbench/layouts/compressed_pages.py) beyond what the conformance suite checks of every
kind: a prefix continued only at a multiple of the rates, with the buffer saved there; preemption
and resume; the pages in use never past the bound the plan states; and compare's V4 letter
reading DeepSeek-V4-Flash's own schedule back.

One tiny decoder of a sliding, a CSA (m = 4) and an HCA (m' = 8) layer, ring of 6, built once."""

import math

import pytest
import torch
from conftest import compose
from test_serving_engine import isolated, run, workload

from kvbench.config.compare import CompareConfig
from kvbench.config.layer_pattern import variant_label
from kvbench.core.errors import ConfigError
from kvbench.jobs.job_config import to_bench_config
from kvbench.layouts.build import build_layouts
from kvbench.layouts.compressed import CSA, EXAMPLE, HCA, SLIDING
from kvbench.serving.paged import PagedStore, plan_for
from kvbench.serving.pool_manager import PoolManager
from kvbench.tasks.common import build_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BS = 4


@pytest.fixture(scope="module")
def v4():
    job = to_bench_config(compose(*EXAMPLE))
    return build_model(job, torch.device("cpu"))


def serve(model, allocator, blocks, prefix, n=6, seed=3):
    requests, prompts = workload(model.config.vocab_size, n=n, prefix=prefix, seed=seed)
    longest = max(r.prompt_len + r.output_len - 1 for r in requests)
    store = PagedStore(model, 0, BS, True, plan=plan_for(model, blocks, BS, allocator=allocator, longest=longest))
    samples = []
    scheduler, timeline = run(model, store, requests, prompts, observe=lambda s: samples.append(
        (len(s.running), s.store.bytes_used - s.store.bytes_needed)))
    for r, p in zip(requests, prompts):
        assert scheduler.outputs()[r.id] == isolated(model, r, p), r
    assert store.used_blocks == 0  # every page given back
    # what the pages in use reserve beyond the formula: at most the plan's bound per running sequence
    assert all(0 <= waste <= running * store.plan.waste_per_sequence for running, waste in samples), samples
    return store, timeline


def test_a_prefix_is_continued_only_at_a_multiple_of_the_rates_from_its_saved_buffer(v4):
    """A 13-token shared prefix in blocks of 4: the store continues it at 8 (a multiple of 4 and 8, where
    the saved buffer and partial pool block are), never at 4 or 12; every request its isolated tokens.
    (The unified allocator's pages replay and hit in the conformance suite, tests/test_layer_kinds.py.)"""
    store, timeline = serve(v4, "per_kind", 60, prefix=13)
    assert [type(m) for m in store.managers] == [PoolManager] * 3 and store.prefix_step == 8
    hits = [t.prefix_hit_tokens for t in timeline.traces]
    assert all(h % 8 == 0 for h in hits) and 8 in hits, hits
    assert store.checkpoints_saved > 0 and store.checkpoint_bytes_max > 0


def test_preempted_requests_resume_to_the_tokens_of_an_isolated_decode(v4):
    """A budget of 14 blocks holds two requests at most: some are preempted (their pages freed, their
    positions recomputed or continued from the prefix cache) and still decode their isolated tokens."""
    store, timeline = serve(v4, "per_kind", 14, prefix=13, n=8)
    assert sum(t.preemptions for t in timeline.traces) > 0


def test_a_tables_pages_are_ring_blocks_pool_blocks_and_the_buffer_in_a_fixed_order(v4):
    """The CSA group's table (m = 4, blocks of 4: a pool block per 4 blocks of positions), by hand: k
    buffer pages, then ring block j followed by the pool block its entries start (j = 0, 4, 8 ...)."""
    store = PagedStore(v4, 0, BS, True, plan=plan_for(v4, 60, BS, longest=40))
    csa = next(m for m in store.managers if m.spec.rate == 4)
    k = csa.k
    assert k == math.ceil(csa.spec.buffer_bytes / csa.spec.page_bytes(BS)) > 0
    assert [csa.ring_index(j) for j in range(6)] == [k, k + 2, k + 3, k + 4, k + 5, k + 7]
    assert [csa.pool_index(q) for q in range(2)] == [k + 1, k + 6]
    assert [csa.table_len(b) for b in (1, 4, 5)] == [k + 2, k + 5, k + 7]
    assert [csa.blocks_of([0] * csa.table_len(b)) for b in range(8)] == list(range(8))


def test_compares_v4_letter_reads_back_v4_flashs_own_schedule_and_bytes():
    """``1:w128:p2`` on DeepSeek-V4-Flash: two sliding layers then CSA and HCA alternating, its ring of 128,
    as the preset's own layers (the same layouts, so the same bytes by formula at 8k and 1M), labelled
    with its 21 CSA and 20 HCA layers; the label reads back from the entry."""
    model = to_bench_config(compose("model=deepseek_v4_flash")).model
    v4, baseline = CompareConfig(variants=["1:w128:p2", "mha"]).attentions(model)
    assert v4.layer_types == [SLIDING] * 2 + [CSA, HCA] * 20 + [CSA] == list(model.preset_layer_types)
    own = build_layouts(model, to_bench_config(compose("model=deepseek_v4_flash")).attention)
    ours = build_layouts(model, v4)
    assert tuple(ours) == tuple(own)
    for S in (8192, 1 << 20):
        assert ours.cache_bytes(S, 1, 2) == own.cache_bytes(S, 1, 2) > 0
    label = variant_label(v4, num_layers=model.num_layers)
    assert "v4 21:20" in label and label != variant_label(baseline, num_layers=model.num_layers)


def test_a_v4_pattern_with_no_compressed_layer_left_is_one_line():
    """``:p3`` on a 3-layer model would leave only sliding layers, which are K/V heads' without a V4
    layer beside them: refused in one line naming compare.variants and the entry."""
    model = to_bench_config(compose(*EXAMPLE)).model
    with pytest.raises(ConfigError) as info:
        CompareConfig(variants=["1:w6:p3", "mha"]).attentions(model)
    message = str(info.value)
    assert "\n" not in message and message.startswith("compare.variants=['1:w6:p3', 'mha']: '1:w6:p3': :p3: ")
    assert CompareConfig(variants=["1:w6:p2", "mha"]).attentions(model)[0].layer_types == [SLIDING, SLIDING, CSA]
