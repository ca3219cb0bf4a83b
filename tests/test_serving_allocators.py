"""The two allocators of the serving store against their formulas, written out here by hand from
the layer shapes (not from kvbench's allocator): what each sets aside of a budget (whole blocks,
windows kept whole, state pages, the unified page raised to hold a state) and, at every scheduler
iteration, what the running sequences reserve (block rounding, the blocks a window still needs,
one state page per running sequence, taken at admission). Prefix caching and state checkpoints:
a state is reused only where it was saved, and a saved state's bytes are counted."""

import itertools
import math

import pytest
import torch
from conftest import make_decoder, tiny_model_config
from test_serving_engine import isolated, workload

from kvbench.config.model import AttentionConfig
from kvbench.model import Decoder
from kvbench.serving.allocator import Checkpoint, make_plan, usable_pages
from kvbench.serving.metrics import block_metrics
from kvbench.serving.paged import PagedStore, plan_for
from kvbench.serving.scheduler import FakeClock, Scheduler
from kvbench.serving.trace import Request

BS, W, CHUNK = 4, 5, 8
# 4 layers: Gated DeltaNet, local (window 5), Gated DeltaNet, global; GQA 4 heads over 2 of width 16
KINDS = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
KV_LAYER = 2 * 2 * 16 * 4  # K and V, 2 heads of 16, float32: bytes per position of one layer
STATE_LAYER = 4 * 8 * 12 * 4 + (2 * 2 * 8 + 4 * 12) * 3 * 4  # H_v d_k d_v float32 + conv tail (K - 1) x channels


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # timelines of one thread, as a job runs


def hybrid() -> Decoder:
    torch.manual_seed(0)
    cfg = tiny_model_config(num_layers=4, num_heads=4, preset_kv_heads=2, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                            linear_conv_kernel_dim=4)
    return Decoder(cfg, AttentionConfig(window=W, layer_types=KINDS)).eval()


def window_blocks(longest, chunk, bs=BS):
    """Blocks a local layer holds at its worst while a forward adds ``chunk`` positions: the W - 1
    before it and the chunk, at the worst alignment (never more than every block of the sequence)."""
    return min(math.ceil(longest / bs), math.ceil((W - 1 + chunk + bs - 1) / bs))


def hand_per_kind(budget, longest):
    """Pools (blocks, block bytes) of full, window, state: what a prefill chunk holds beyond a
    decoding sequence set aside once (the window's CHUNK - 1 more positions), the rest split by what
    the longest request holds at its worst in each while it decodes, rounded down to whole blocks."""
    full = (math.ceil(longest / BS), BS * KV_LAYER)
    window = (window_blocks(longest, 1), BS * KV_LAYER)
    state = (1, 2 * STATE_LAYER)
    reserve = (0, window_blocks(longest, CHUNK) - window_blocks(longest, 1), 0)
    left = budget - reserve[1] * window[1]
    weights = [n * b for n, b in (full, window, state)]
    return [(r + int(left * w // sum(weights) // b), b)
            for r, w, (_, b) in zip(reserve, weights, (full, window, state))]


def hand_unified():
    """(attention block, page bytes): the first multiple of 4 tokens whose one-layer page holds a state."""
    bs = BS * math.ceil(STATE_LAYER / (BS * KV_LAYER))
    return bs, max(bs * KV_LAYER, STATE_LAYER)


def hand_sequence(n, bs, full_page, window_page, state_page):
    """Bytes one running sequence of n positions reserves: every block of the global layer, the
    blocks from position n - W + 1's on of the local one, one state page per recurrent layer group."""
    blocks = math.ceil(n / bs)
    return blocks * full_page + (blocks - max(0, n - W + 1) // bs) * window_page + state_page


@pytest.mark.parametrize("allocator", ["per_kind", "unified"])
def test_each_allocator_reserves_its_own_formula(allocator):
    model = hybrid()
    requests, prompts = workload(97)
    longest = max(r.prompt_len + r.output_len - 1 for r in requests)
    blocks = 40
    budget = blocks * BS * 2 * KV_LAYER  # kv_budget_blocks: blocks of every K/V layer
    plan = plan_for(model, blocks, BS, "auto", allocator, longest, CHUNK)
    store = PagedStore(model, 0, BS, False, plan=plan)
    if allocator == "per_kind":
        pools = hand_per_kind(budget, longest)
        assert [n for n, _ in pools] == list(plan.pages) == [p.capacity for p in store.pools]
        reserved = sum(n * b for n, b in pools)
        # storage allocated: each pool's blocks of its layers' K/V (or their states), nothing more
        assert store.nbytes == pools[0][0] * BS * KV_LAYER + pools[1][0] * BS * KV_LAYER + pools[2][0] * 2 * STATE_LAYER
        pages = (pools[0][1], pools[1][1], pools[2][1])
    else:
        bs, page = hand_unified()
        assert bs == plan.block_size == 12  # 1048 bytes of state: 12 positions of 256 bytes hold it
        total = int(budget // page)
        reserved = total * page
        pages = (page, page, 2 * page)  # a block of the global or local layer: 1 page; a state: 1 per layer
    assert plan.reserved_bytes == reserved <= budget
    seen = []

    def observe(sch):
        st = sch.store
        want = sum(hand_sequence(s.blocks.length, st.block_size, *pages) for s in sch.running)
        assert st.bytes_used == want <= reserved
        seen.append(want)

    scheduler = Scheduler(model, store, requests, prompts, max_prefill_tokens=CHUNK, clock=FakeClock(0.01, 1e-4, 1e-3),
                          observe=observe)
    timeline = scheduler.run()
    assert len(seen) == scheduler.iterations and max(seen) > 0
    assert store.used_blocks == 0
    # the most one sequence's pages hold beyond the formula: each K/V page less one position, the
    # state pages less the states (per_kind: none; unified: the page raised to hold a state)
    waste = pages[0] - KV_LAYER + pages[1] - KV_LAYER + pages[2] - 2 * STATE_LAYER
    assert plan.waste_per_sequence == timeline.waste_per_sequence == waste
    m = block_metrics(timeline)
    assert m["block_waste_within_bound"] and m["block_waste_over_bound_samples"] == 0
    assert m["block_waste_bound_bytes_max"] == waste * max(x.running for x in timeline.samples)


def test_a_window_holds_a_bounded_number_of_blocks_whatever_the_length():
    """Past its window a local layer holds a bounded number of blocks whatever the length."""
    model = hybrid()
    plan = plan_for(model, 40, BS, longest=60)
    window = plan.groups[1]
    assert window.keeps.window == W
    lengths = (20, 41, 62)
    held = [plan.sequence_bytes(n) for n in lengths]
    full, local = plan.page_bytes[0], plan.page_bytes[1]
    assert held[2] - held[1] == 5 * full  # 21 positions more: 5 more blocks of the global layer, none of the local one
    assert held == [hand_sequence(n, BS, full, local, 2 * STATE_LAYER) for n in lengths]
    # the next query sees positions n - 4 .. n: at 20, block 4 (16..19) alone; at 41, blocks 9 and 10
    assert [math.ceil(n / BS) - max(0, n - W + 1) // BS for n in lengths] == [1, 2, 2]


@pytest.mark.parametrize("policy, every, hit", [("block", 0, 12), ("every_n", 8, 8), ("prompt_end", 0, 12)])
def test_a_state_is_reused_only_where_it_was_saved(policy, every, hit):
    """Two requests share 14 tokens: the second hits the longest prefix whose state was saved
    (block: 12 = 3 blocks; every 8 tokens: 8; the first prompt's last block boundary: 12), its tokens those of
    an isolated decode; the saved states' bytes are counted."""

    model = hybrid()
    shared = list(range(14))
    requests = [Request(0, 0.0, 14, 3, 0, 14), Request(1, 1.0, 17, 3, 0, 14)]
    prompts = [shared, shared + [50, 51, 52]]
    store = PagedStore(model, 400, BS, True, checkpoint=Checkpoint(policy, every))  # room: nothing evicted
    scheduler = Scheduler(model, store, requests, prompts, max_prefill_tokens=CHUNK, clock=FakeClock(0.01))
    a, b = scheduler.run().traces
    assert (a.prefix_hit_tokens, b.prefix_hit_tokens) == (0, hit)
    for r, p in zip(requests, prompts):
        assert scheduler.outputs()[r.id] == isolated(model, r, p)
    # request 0 saves at 4, 8, 12, 16 / 8, 16 / 12; request 1 at 16 (its tokens 12..15 differ from request 0's)
    assert store.checkpoints_saved == {"block": 5, "every_n": 3, "prompt_end": 2}[policy]
    assert store.checkpoint_bytes_max == store.checkpoint_bytes == store.checkpoints_saved * 2 * STATE_LAYER


def test_the_unified_block_loses_a_prefix_that_does_not_fill_it():
    """The raised block of 12 tokens: a shared prefix of 10 gives no hit (vLLM #40696); per kind
    with blocks of 4 the same requests hit 8 tokens."""
    model = hybrid()
    shared = list(range(10))
    requests = [Request(0, 0.0, 13, 2, 0, 10), Request(1, 1.0, 13, 2, 0, 10)]
    prompts = [shared + [60, 61, 62], shared + [70, 71, 72]]
    hits = {}
    for allocator in ("per_kind", "unified"):
        store = PagedStore(model, 0, BS, True, plan=plan_for(model, 64, BS, "auto", allocator, 16, CHUNK))
        scheduler = Scheduler(model, store, requests, prompts, max_prefill_tokens=CHUNK, clock=FakeClock(0.01))
        hits[allocator] = scheduler.run().traces[1].prefix_hit_tokens
    assert hits == {"per_kind": 8, "unified": 0}


def test_the_store_logs_each_evicted_key_once_in_order():
    """A store too small to keep every prompt's blocks evicts cached blocks and says which (a
    returning conversation's history lost is read from this log; a hybrid's key is logged once per
    group that held it)."""
    model = make_decoder(2)
    requests = [Request(i, float(i), 9, 2) for i in range(4)]
    prompts = [[10 * i + j for j in range(9)] for i in range(4)]
    store = PagedStore(model, 5, BS, True)
    registered = []

    def observe(sch):
        for s in sch.running:
            registered.extend(k for k in s.blocks.keys if k not in registered)

    Scheduler(model, store, requests, prompts, max_prefill_tokens=CHUNK, clock=FakeClock(0.01), observe=observe).run()
    assert store.evicted and len(set(store.evicted)) == len(store.evicted)
    assert set(store.evicted) <= set(registered) and len(store.evicted) == len(registered) - len(store.pools[0].key_of)
    assert all(k not in p.block_of for p in store.pools for k in store.evicted)


@pytest.mark.parametrize("allocator", ["per_kind", "unified"])
@pytest.mark.parametrize("layout", ["windowed", "gdn_hybrid"])
def test_a_capacity_rows_reserved_bytes_and_fit_equal_the_hand_formula(layout, allocator):
    """The capacity report's per-allocator figures (what one sequence at the context reserves at its
    worst while it decodes, how many fit, what they reserve) against the layer shapes by hand: a
    windowed model (local, global, local, global) and the Gated DeltaNet hybrid."""
    from kvbench.serving.allocator import groups_of, make_plan

    context, budget = 30, 40 * BS * 2 * KV_LAYER
    if layout == "windowed":
        cfg = tiny_model_config(num_layers=4, num_heads=4, preset_kv_heads=2)
        model = Decoder(cfg, AttentionConfig(window=W, layer_types=["sliding_attention", "full_attention"] * 2))
    else:
        model = hybrid()
    groups = groups_of(model.layouts, model.dtype.itemsize)
    plan = make_plan(groups, allocator, BS, budget, context, CHUNK)
    # the window's blocks a prefill chunk holds beyond a decoding sequence's: kept once, not per sequence
    extra = lambda bs: window_blocks(context, CHUNK, bs) - window_blocks(context, 1, bs)  # noqa: E731
    if layout == "windowed":  # two full layers, two local ones, no state
        if allocator == "per_kind":
            block = BS * 2 * KV_LAYER
            need = [math.ceil(context / BS), window_blocks(context, 1)]
            left = budget - extra(BS) * block
            pools = [int(left * n // sum(need) // block) for n in need]
            pools[1] += extra(BS)
            per_seq = sum(need) * block
            fit = min((p - r) // n for p, r, n in zip(pools, (0, extra(BS)), need))
        else:  # no state: the block stays, a page is one layer's block
            page = BS * KV_LAYER
            need = 2 * math.ceil(context / BS) + 2 * window_blocks(context, 1)
            per_seq, fit = need * page, (int(budget // page) - 2 * extra(BS)) // need
    elif allocator == "per_kind":
        pools = [n for n, _ in hand_per_kind(budget, context)]
        need = [math.ceil(context / BS), window_blocks(context, 1), 1]
        per_seq = (need[0] + need[1]) * BS * KV_LAYER + 2 * STATE_LAYER
        fit = min((p - r) // n for p, r, n in zip(pools, (0, extra(BS), 0), need))
    else:  # blocks of 12 tokens, a page of max(12 positions of one layer, one state); a state: a page per layer
        bs, page = hand_unified()
        need = math.ceil(context / bs) + window_blocks(context, 1, bs) + 2
        per_seq, fit = need * page, (int(budget // page) - extra(bs)) // need
    assert plan.worst_sequence_bytes(context) == per_seq
    assert plan.sequences_fit(context) == fit > 0
    assert fit * per_seq <= plan.reserved_bytes <= budget


def _unified_case(name):
    """(model, cost of each group's block in pages, bytes of one page, hand blocks held per group)
    for a 3-layer MHA / GQA / MQA model, a 4-layer one of 2 local (window W) and 2 global layers, and
    a 4-layer hybrid of 2 Gated DeltaNet and 2 global layers: every cost leaves pages of an odd
    budget that no block can use."""
    torch.manual_seed(0)
    full = lambda n, bs: math.ceil(n / bs)  # noqa: E731 — every block of the sequence
    window = lambda n, bs: math.ceil(n / bs) - max(0, n - W + 1) // bs  # noqa: E731 — from the window's first on
    heads = {"mha": 4, "gqa": 2, "mqa": 1}
    if name in heads:
        cfg = tiny_model_config(num_layers=3, num_heads=4, preset_kv_heads=4)
        model = Decoder(cfg, AttentionConfig(num_kv_heads=heads[name])).eval()
        return model, (3,), BS * 2 * heads[name] * 16 * 4, (full,)
    if name == "windowed":  # global layers 0 and 2, local 1 and 3 (full attention first)
        cfg = tiny_model_config(num_layers=4, num_heads=4, preset_kv_heads=2)
        model = Decoder(cfg, AttentionConfig(window=W, global_every=2)).eval()
        return model, (2, 2), BS * KV_LAYER, (full, window)
    kinds = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    cfg = tiny_model_config(num_layers=4, num_heads=4, preset_kv_heads=2, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                            linear_conv_kernel_dim=4)
    bs, page = hand_unified()
    return Decoder(cfg, AttentionConfig(layer_types=kinds)).eval(), (2, 2), page, (full, lambda n, bs: 1)


@pytest.mark.parametrize("name", ["mha", "gqa", "mqa", "windowed", "hybrid"])
def test_unified_pages_are_only_those_a_block_can_use(name):
    """The unified pool counted every page of the budget as reserved, also the last pages of a pool
    whose blocks take 2 or 3 pages each: MQA in 2 MB reported 1,999,872 bytes reserved against
    1,998,848 stored. Now the pool makes the pages its blocks can use (here: the budget's pages
    rounded down to the cost), at every scheduler step the pages in use are what the running
    sequences hold by the hand formula, and a single group's storage is exactly what is reserved."""
    model, cost, page, held = _unified_case(name)
    requests, prompts = workload(97)
    budget = (12 * math.lcm(*cost) + 1) * page + page // 2  # one page more than the blocks can use
    plan = plan_for(model, 0, BS, "auto", "unified", 30, CHUNK)  # the groups and the raised block
    plan = make_plan(plan.groups, "unified", BS, budget, 30, CHUNK)
    usable = 12 * math.lcm(*cost)
    assert plan.cost == cost and plan.page_bytes == tuple(c * page for c in cost)
    assert plan.pages == (usable,) and plan.reserved_bytes == usable * page < budget - page
    store = PagedStore(model, 0, BS, False, plan=plan)
    if len(cost) == 1:  # one group: its storage is the pool
        assert store.nbytes == plan.storage_bytes == plan.reserved_bytes
    steps = []

    def observe(sch):
        st = sch.store
        want = sum(h(s.blocks.length, st.block_size) * c * page
                   for s in sch.running for h, c in zip(held, cost))
        assert st.bytes_used == want <= plan.reserved_bytes
        assert st.used_blocks * page == want and st.num_blocks * page == plan.reserved_bytes
        steps.append(want)

    Scheduler(model, store, requests, prompts, max_prefill_tokens=CHUNK, clock=FakeClock(0.01, 1e-4, 1e-3),
              observe=observe).run()
    assert steps and max(steps) > 0 and store.used_blocks == 0


@pytest.mark.parametrize("pages, cost, usable", [
    (1953, (2,), 1952), (1953, (3,), 1953), (7, (2, 3), 7), (1, (2, 3), 0), (5, (2, 4), 4), (11, (4, 6), 10),
    (13, (4, 6), 12), (0, (3,), 0), (9, (1, 2), 9)])
def test_usable_pages_are_the_largest_sum_of_block_costs(pages, cost, usable):
    # by brute force: every count of blocks of each cost that fits
    best = max(sum(n * c for n, c in zip(ns, cost)) for ns in itertools.product(*(range(pages // c + 1) for c in cost))
               if sum(n * c for n, c in zip(ns, cost)) <= pages)
    assert usable_pages(pages, cost) == best == usable


@pytest.mark.parametrize("preset, local, window, kv, head_dim, layers, fit", [
    ("gemma3_27b", 52, 1024, 16, 128, 62, 35),  # 5 local : 1 global
    ("gpt_oss_120b", 18, 128, 8, 64, 36, 130),  # alternating
])
def test_per_kind_fits_as_many_decoding_sequences_as_unified_on_windowed_presets(preset, local, window, kv, head_dim,
                                                                                   layers, fit):
    """The capacity report's presets in bfloat16 at 8192 tokens and 40 GB, blocks of 16, chunks of 512,
    from the published shapes by hand: per_kind sized its window pool for a 512-token chunk kept
    whole in every sequence, so Gemma 3 27B fit 30 sequences against unified's 35. Sized for
    decoding sequences with one chunk's room set aside once, both fit the same, and both keep
    that room out of the count."""
    from conftest import compose

    from kvbench.jobs.job_config import to_bench_config
    from kvbench.layouts.build import build_layouts
    from kvbench.serving.allocator import groups_of

    cfg = to_bench_config(compose(f"model={preset}", "task=inspect", "runtime.dtype=bfloat16"))
    groups = groups_of(build_layouts(cfg.model, cfg.attention), 2)
    context, budget, bs, chunk = 8192, 40 * 10**9, 16, 512
    position = 2 * kv * head_dim * 2  # K and V of one layer, bfloat16
    full_need = context // bs  # every block, every global layer
    window_need = math.ceil((window + bs - 1) / bs)  # W kept while it decodes, at the worst alignment
    extra = math.ceil((window - 1 + chunk + bs - 1) / bs) - window_need  # what a chunk's forward adds
    full_page, window_page = bs * position * (layers - local), bs * position * local
    per_seq = full_need * full_page + window_need * window_page
    left = budget - extra * window_page
    pools = [int(left * full_need * full_page // per_seq // full_page),
             extra + int(left * window_need * window_page // per_seq // window_page)]
    per_kind = make_plan(groups, "per_kind", bs, budget, context, chunk)
    assert per_kind.pages == tuple(pools) and per_kind.reserve == (0, extra)
    assert per_kind.worst_sequence_bytes(context) == per_seq
    assert per_kind.sequences_fit(context) == min(pools[0] // full_need, (pools[1] - extra) // window_need) == fit
    unified = make_plan(groups, "unified", bs, budget, context, chunk)
    page = bs * position  # one layer's block
    need = full_need * (layers - local) + window_need * local
    assert unified.reserve == (extra * local,)
    assert unified.sequences_fit(context) == (budget // page - extra * local) // need == fit
