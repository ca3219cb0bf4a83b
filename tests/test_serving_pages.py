"""Page specs (kvbench.layouts.pages) against their byte formulas, written out here by hand from
the layer shapes: a full layer's blocks, a window's ring, a recurrent state in float32 and in
bfloat16, DeepSeek-V4's compressed pool (its spec against the bytes its static cache allocates).
The store groups layers by spec and runs each group by its spec class's manager: a mixed model
(Gated DeltaNet, a window, full attention) allocates what the specs say and every request it
serves, under both allocators, gets the tokens of an isolated greedy decode. The unified
allocator's groups share one byte pool: what it allocates is what it reserves."""

import math

import pytest
import torch
from conftest import tiny_model_config
from test_serving_engine import isolated, run, workload

from kvbench.config.model import AttentionConfig
from kvbench.core.errors import ConfigError
from kvbench.layouts.base import Layouts
from kvbench.layouts.compressed import CSA, HCA, SLIDING, Compressed
from kvbench.layouts.compressed_attention import CompressedCache
from kvbench.layouts.kda import KDA
from kvbench.layouts.kv_heads import KVHeads
from kvbench.layouts.latent import Latent
from kvbench.layouts.mamba2 import Mamba2
from kvbench.layouts.pages import Blocks, CompressedPool, Ring, StatePage
from kvbench.model import Decoder
from kvbench.serving.allocator import Checkpoint, groups_of, make_plan
from kvbench.serving.managers import MANAGERS, BlockManager, RingManager, StateManager
from kvbench.serving.paged import PagedStore, plan_for
from kvbench.serving.pool_manager import PoolManager

BS, W = 4, 5
H_K, H_V, D_K, D_V, K = 2, 4, 8, 12, 4  # the Gated DeltaNet layers' shape
KV_POSITION = 2 * 2 * 16 * 4  # K and V, 2 KV heads of 16, float32: one position of one layer
# Gated DeltaNet, local (window 5), full, Gated DeltaNet
MIXED = ["linear_attention", "sliding_attention", "full_attention", "linear_attention"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def hand_state(state_dtype: str, element: int = 4) -> int:
    """One Gated DeltaNet layer's state of one sequence: the convolution's last K - 1 inputs of q, k,
    v (compute dtype) and H_v states of d_k x d_v in ``state_dtype``."""
    recurrent = {"float32": 4, "bfloat16": 2}[state_dtype]
    return (2 * H_K * D_K + H_V * D_V) * (K - 1) * element + H_V * D_K * D_V * recurrent


def mixed(state_dtype: str = "float32") -> Decoder:
    torch.manual_seed(0)
    cfg = tiny_model_config(num_layers=4, num_heads=4, preset_kv_heads=2, linear_num_key_heads=H_K,
                            linear_num_value_heads=H_V, linear_key_head_dim=D_K, linear_value_head_dim=D_V,
                            linear_conv_kernel_dim=K)
    return Decoder(cfg, AttentionConfig(window=W, layer_types=MIXED), state_dtype).eval()


def test_a_full_layers_blocks_hold_every_position():
    layer = KVHeads(None, 4, 2, 16)
    spec = layer.page_spec(4)
    assert spec == Blocks(KV_POSITION) and spec.page_bytes(BS) == 4 * KV_POSITION == 1024
    for length, blocks in ((1, 1), (4, 1), (5, 2), (13, 4), (40, 10)):
        assert spec.blocks_held(length, BS) == spec.worst_blocks(length, BS, 8) == blocks
        assert spec.reserved_bytes(length, BS) == blocks * 1024
        assert spec.sequence_bytes(length) == length * KV_POSITION == layer.sequence_bytes(length, 4)
    # int8 codes: 16 one-byte codes and a float32 scale per head and position, K and V
    assert layer.page_spec(4, "int8") == Blocks(2 * 2 * (16 + 4))
    assert KVHeads(None, 4, 2, 16, kv_source=0).page_spec(4) is None  # reads another layer's K/V: holds none


def test_a_windows_ring_frees_the_blocks_that_fall_out():
    """W = 5: after 13 positions the next query (at 13) sees 9..13, so 9..12 are held (blocks 2 and
    3); after 20, 16..19 (block 4); after 8, 4..7 (block 1); after 3, 0..2 (block 0). While it
    decodes, W - 1 kept positions and one new one span at most 2 blocks of 4; prefilled 8 at a time,
    at most 4 (12 positions from offset 3)."""
    layer = KVHeads(W, 4, 2, 16)
    spec = layer.page_spec(4)
    assert spec == Ring(KV_POSITION, W)
    for length, held in ((3, 1), (8, 1), (13, 2), (20, 1)):
        assert spec.blocks_held(length, BS) == held
        assert spec.reserved_bytes(length, BS) == held * BS * KV_POSITION
        assert spec.sequence_bytes(length) == min(length, W) * KV_POSITION == layer.sequence_bytes(length, 4)
    assert [spec.worst_blocks(40, BS, chunk) for chunk in (1, 8)] == [2, 4]
    assert spec.worst_blocks(3, BS, 8) == 1  # never more than the sequence's own blocks


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_a_recurrent_state_is_one_page_in_its_dtype(state_dtype):
    model = mixed(state_dtype)
    spec = model.layouts[0].page_spec(4)
    assert spec == StatePage(conv_bytes=(2 * H_K * D_K + H_V * D_V) * (K - 1) * 4,
                             recurrent_elements=H_V * D_K * D_V, state_dtype=state_dtype)
    assert spec.state_bytes == spec.page_bytes(BS) == hand_state(state_dtype)
    for length in (1, 13, 90):
        assert spec.blocks_held(length, BS) == spec.worst_blocks(length, BS, 8) == 1
        assert spec.reserved_bytes(length, BS) == spec.sequence_bytes(length) == hand_state(state_dtype)
    # the store allocates a state page per page of its pool in each of the two layers, in its dtype
    store = PagedStore(model, 10, BS, plan=plan_for(model, 10, BS, longest=24))
    g = next(g for g, m in enumerate(store.managers) if isinstance(m, StateManager))
    state = store.managers[g]
    assert sum(t.untyped_storage().nbytes() for t in state.tensors()) == \
        store.plan.capacity[g] * 2 * hand_state(state_dtype)
    assert all(r.dtype == getattr(torch, state_dtype) and c.dtype == torch.float32 for c, r in state.states)


def test_a_state_dtype_no_state_takes_is_one_line():
    with pytest.raises(ConfigError) as e:
        StatePage(conv_bytes=10, recurrent_elements=10, state_dtype="int8")
    assert str(e.value).startswith("cache.state_dtype='int8'") and "\n" not in str(e.value)


def v4(layer_type: str, rate: int) -> Compressed:
    return Compressed(window=6, layer_type=layer_type, num_heads=4, head_dim=16, rope_dim=4, q_lora_rank=8,
                      o_groups=2, o_lora_rank=8, compress_rate=rate, index_n_heads=2, index_head_dim=8, index_topk=3)


def hand_v4(layer_type: str, S: int) -> int:
    """Per sequence at S tokens, float32 (e = 4): the ring min(S, 6) x 16; CSA (m = 4) an entry of
    16 + 8 per 4 tokens, buffers of 3 tokens x 2 (kv, gate) x (2 x 16 + 2 x 8), the overlap 4 x
    (16 + 8) x (4 + 4: kv, float32 gate); HCA (m' = 8) an entry of 16 per 8, buffers 7 x 2 x 16."""
    ring = min(S, 6) * 16 * 4
    if layer_type == CSA:
        return ring + S // 4 * 24 * 4 + 3 * 2 * 48 * 4 + 4 * 24 * 8
    return ring + S // 8 * 16 * 4 + 7 * 2 * 16 * 4


@pytest.mark.parametrize("layer_type, rate", [(CSA, 4), (HCA, 8)])
def test_a_compressed_pool_holds_a_ring_entries_and_buffers(layer_type, rate):
    lay = v4(layer_type, rate)
    spec = lay.page_spec(4)
    assert isinstance(spec, CompressedPool) and (spec.window, spec.rate) == (6, rate)
    for S in (3, 6, 17, 64):
        assert spec.sequence_bytes(S) == hand_v4(layer_type, S) == lay.sequence_bytes(S, 4)
    for S in (6, 17, 64):  # what its static cache allocates for 2 sequences of S tokens (the ring whole: S >= W)
        assert CompressedCache(lay, 2, S, torch.float32).nbytes == 2 * hand_v4(layer_type, S)
    # paged: pages of 4 ring positions or 4 entries, whichever is larger: ring blocks (at 17: 12..17 seen
    # from 17 on, blocks 3 and 4), pool blocks of 4 entries for the whole blocks of positions held (at 17:
    # 20 positions, CSA 5 entries in 2 blocks; HCA 2 in 1), the buffer in whole pages
    entry, buffers = (24 * 4, 3 * 2 * 48 * 4 + 4 * 24 * 8) if layer_type == CSA else (16 * 4, 7 * 2 * 16 * 4)
    page = BS * max(16 * 4, entry)
    assert spec.page_bytes(BS) == page and spec.buffer_pages(BS) == math.ceil(buffers / page)
    for S, pool in ((17, {CSA: 2, HCA: 1}), (64, {CSA: 4, HCA: 2})):
        held = 2 + pool[layer_type] + math.ceil(buffers / page)
        assert spec.blocks_held(S, BS) == held and spec.reserved_bytes(S, BS) == held * page
    assert spec.prefix_step(BS) == math.lcm(BS, rate)


def test_a_sliding_v4_layer_is_a_ring_and_a_store_serves_a_pool():
    spec = v4(SLIDING, 0).page_spec(4)
    assert isinstance(spec, CompressedPool) and spec.rate == 0  # its cache is the kind's: one manager for all
    assert spec.sequence_bytes(17) == Ring(16 * 4, 6).sequence_bytes(17) and spec.buffer_pages(BS) == 0
    assert spec.blocks_held(17, BS) == Ring(16 * 4, 6).blocks_held(17, BS) and spec.prefix_step(BS) == BS
    lay = v4(CSA, 4)
    Layouts([lay]).check({"workload.store": "paged"})
    (group,) = groups_of(Layouts([lay, lay]), 4)
    assert group.layers == (0, 1) and group.page_bytes(BS) == 2 * BS * 24 * 4
    assert MANAGERS[type(group.spec)] is PoolManager


EVERY_LAYOUT = {
    "gqa": KVHeads(None, 8, 2, 16), "gqa_window": KVHeads(W, 8, 2, 16),
    "sinks_window": KVHeads(7, 8, 1, 32, sinks=True),
    "mla": Latent(None, 8, kv_lora_rank=16, qk_rope_head_dim=4),
    "mla_window": Latent(W, 8, kv_lora_rank=16, qk_rope_head_dim=4),
    "dsa": Latent(None, 8, kv_lora_rank=16, qk_rope_head_dim=4, index_n_heads=2, index_head_dim=8, index_topk=4),
    "mamba2_bf16": Mamba2(state_dtype="bfloat16"), "kda": KDA(), "gdn": mixed().layouts[0],
    "v4_csa": v4(CSA, 4), "v4_hca": v4(HCA, 8), "v4_sliding": v4(SLIDING, 0),
}


@pytest.mark.parametrize("name, element, cache_dtype", [
    (name, element, cache_dtype) for name in EVERY_LAYOUT
    for element, cache_dtype in ((4, "auto"), (2, "auto"), (2, "int8"))
    if cache_dtype == "auto" or Layouts([EVERY_LAYOUT[name]]).accepts({"cache.dtype": cache_dtype})])  # V4: auto only
def test_every_layouts_spec_holds_what_its_layout_says(name, element, cache_dtype):
    """A spec's bytes per sequence are its layout's at every length (the layout's own formula, written
    and tested with the kind), and a ring keeps what the layout's window rule keeps."""
    layout = EVERY_LAYOUT[name]
    spec = layout.page_spec(element, cache_dtype)
    for length in (1, 3, 4, 5, 6, 9, 16, 17, 100):
        assert spec.sequence_bytes(length) == layout.sequence_bytes(length, element, cache_dtype), length
        assert spec.first_kept(length) == (layout.first_kept(length) if spec.position_bytes else 0)
        if spec.position_bytes:
            for chunk in (1, 3, 8):
                kept = layout.most_kept(length, chunk)  # positions held, at the worst block alignment
                worst = -(-length // BS) if kept >= length else min(-(-length // BS), -(-(kept + BS - 1) // BS))
                if isinstance(spec, CompressedPool):  # and its pool blocks and buffer pages, held to the end
                    entries = -(-length // BS) * BS // spec.rate if spec.rate else 0
                    worst += -(-entries // BS) + -(-spec.buffer_bytes // spec.page_bytes(BS))
                assert spec.worst_blocks(length, BS, chunk) == worst


def test_the_store_groups_layers_by_spec_and_allocates_what_the_specs_say():
    model = mixed()
    groups = groups_of(model.layouts, 4)
    assert [(g.layers, type(g.spec)) for g in groups] == [((2,), Blocks), ((1,), Ring), ((0, 3), StatePage)]
    store = PagedStore(model, 12, BS, plan=plan_for(model, 12, BS, longest=30, chunk=8))
    assert [type(m) for m in store.managers] == [BlockManager, RingManager, StateManager]
    full, window, state = store.plan.capacity
    assert store.nbytes == (full + window) * BS * KV_POSITION + state * 2 * hand_state("float32")


@pytest.mark.parametrize("allocator", ["per_kind", "unified"])
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_a_mixed_model_serves_the_tokens_of_an_isolated_greedy_decode(allocator, state_dtype):
    """Windowed, full and recurrent layers in one store, requests sharing a 13-token prefix (a state
    saved at each block boundary): every request's tokens equal its isolated decode through a static
    cache (its state in the same dtype); the pages in use never reserve beyond the plan's pools."""
    model = mixed(state_dtype)
    requests, prompts = workload(model.config.vocab_size, n=6, prefix=13)
    longest = max(r.prompt_len + r.output_len - 1 for r in requests)
    plan = plan_for(model, 60, BS, "auto", allocator, longest, 8)
    store = PagedStore(model, 0, BS, True, plan=plan, checkpoint=Checkpoint("block"))
    seen = []
    scheduler, timeline = run(model, store, requests, prompts, observe=lambda s: seen.append(s.store.bytes_used))
    for r, p in zip(requests, prompts):
        assert scheduler.outputs()[r.id] == isolated(model, r, p), r
    assert sum(t.prefix_hit_tokens for t in timeline.traces) > 0 and store.checkpoints_saved > 0
    assert 0 < max(seen) <= plan.reserved_bytes
    assert store.used_blocks == 0  # every page given back


def test_the_unified_pool_allocates_what_it_reserves_and_no_two_blocks_share_a_page():
    """One byte pool for every group: its pages (a layer's block of the raised size, 12 tokens x
    256 B, or a layer's state of 2,496 B, each page 3,072 B) are what is allocated and reserved. A
    budget small enough to preempt and evict hands a page from a state to K/V and back; at every
    scheduler step the pages held (by running blocks and cached ones) are distinct, as many as
    the pool counts used, and every request still decodes its isolated tokens."""
    model = mixed()
    requests, prompts = workload(model.config.vocab_size, n=8, prefix=13)
    longest = max(r.prompt_len + r.output_len - 1 for r in requests)
    bs = BS * math.ceil(hand_state("float32") / (BS * KV_POSITION))
    plan = plan_for(model, 0, BS, "auto", "unified", longest, 8)
    need = plan.need(longest, 8)[0]
    plan = make_plan(plan.groups, "unified", BS, (need + 4) * bs * KV_POSITION, longest, 8)
    store = PagedStore(model, 0, BS, True, plan=plan, checkpoint=Checkpoint("block"))
    assert plan.block_size == bs == 12 and store.shared is not None
    assert store.nbytes == plan.reserved_bytes == store.storage_bytes == plan.pages[0] * bs * KV_POSITION
    steps = []

    def observe(sch):
        pages = sch.store.pools[0].pages
        held = [p for pool in sch.store.pools for b, ids in enumerate(pool.page_ids)
                if pool.ref[b] or (pool, b) in pages.cached for p in ids]
        assert len(held) == len(set(held)) == pages.used <= plan.pages[0]
        steps.append(len(held))

    scheduler, timeline = run(model, store, requests, prompts, observe=observe)
    for r, p in zip(requests, prompts):
        assert scheduler.outputs()[r.id] == isolated(model, r, p), r
    assert steps and sum(t.preemptions for t in timeline.traces) + len(store.evicted) > 0


def test_a_part_a_page_cannot_align_keeps_storage_per_group():
    """int8 codes of 1 KV head of 6 put its float32 scales off their alignment in a page's row: the
    store keeps each group's storage of its own (as the per-kind pools do) and says so in its formula."""
    torch.manual_seed(0)
    cfg = tiny_model_config(num_layers=2, num_heads=2, preset_kv_heads=1, head_dim=6)
    model = Decoder(cfg, AttentionConfig(window=W, layer_types=["sliding_attention", "full_attention"])).eval()
    store = PagedStore(model, 0, BS, False, "int8", plan=plan_for(model, 10, BS, "int8", "unified", 20, 8))
    assert store.shared is None
    assert store.nbytes == store.storage_bytes == store.plan.storage_bytes == \
        sum(store.plan.capacity) * BS * 2 * (6 + 4)  # K and V: 6 one-byte codes and a float32 scale
