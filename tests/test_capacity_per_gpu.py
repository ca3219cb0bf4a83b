"""Capacity per GPU: docs/capacity-per-gpu.md derives DeepSeek-V3's TP=8 and DP=8 EP=8 figures by hand;
here each term is written out again and checked against the code's (kvbench/parallel/), and the page
against both. Also: per-rank KV where K/V heads split, where they are replicated, and a recurrent
layer's state split by its heads."""

import math
from pathlib import Path

import pytest

from kvbench.config.model import AttentionConfig
from kvbench.jobs.job_config import to_bench_config
from kvbench.layouts.build import build_layouts
from kvbench.parallel.per_gpu import rank_weights
from kvbench.parallel.plan import Split, node_splits, per_gpu, rank_kv
from tests.conftest import compose, tiny_model_config

PAGE = Path(__file__).resolve().parents[1] / "docs" / "capacity-per-gpu.md"
GPU = 126_900_000_000  # 141 GB x 0.9
CONTEXT = 8192


def fp8(R, C):
    """An R x C matrix in FP8: a byte a value and a float32 scale per 128 x 128 block."""
    return R * C + 4 * math.ceil(R / 128) * math.ceil(C / 128)


def by_hand(heads, dense_ffn, experts, expert_ffn, shared_ffn, vocab):
    """DeepSeek-V3's weights on one GPU (the page's table): 61 MLA layers with ``heads`` of the 128, 3 dense
    MLPs ``dense_ffn`` wide, 58 MoE layers of ``experts`` routed experts ``expert_ffn`` wide and a shared
    expert ``shared_ffn`` wide, ``vocab`` rows of the embedding and of the LM head; bf16 (2 bytes) for norms,
    router, correction bias, embedding and LM head."""
    C, V, bf16 = 7168, vocab, 2
    attention = (fp8(1536, C) + fp8(576, C) + (1536 + 512) * bf16  # q_a, kv_a and their norms: whole
                 + fp8(heads * 192, 1536) + fp8(heads * 256, 512) + fp8(C, heads * 128)  # q_b, kv_b, o: per head
                 + 2 * C * bf16)  # the block's two norms

    def mlp(width):
        return 2 * fp8(width, C) + fp8(C, width)
    routed = experts * (2 * expert_ffn * C + 4 * 2 * math.ceil(expert_ffn / 128) * math.ceil(C / 128)) \
        + experts * (C * expert_ffn + 4 * math.ceil(C / 128) * math.ceil(expert_ffn / 128))
    moe = routed + mlp(shared_ffn) + 256 * C * bf16 + 256 * 4  # + router, correction bias (float32)
    return 2 * V * C * bf16 + C * bf16 + 61 * attention + 3 * mlp(dense_ffn) + 58 * moe


@pytest.fixture(scope="module")
def deepseek():
    return to_bench_config(compose("model=deepseek_v3", "runtime.dtype=bfloat16"))


def test_deepseek_v3_tp8_against_dp8_by_hand(deepseek):
    page = PAGE.read_text()
    layouts = build_layouts(deepseek.model, deepseek.attention)
    per_token = 61 * (512 + 64) * 2
    tp8 = by_hand(heads=16, dense_ffn=18432 // 8, experts=256, expert_ffn=2048 // 8, shared_ffn=2048 // 8,
                  vocab=129280 // 8)
    dp8 = by_hand(heads=128, dense_ffn=18432, experts=256 // 8, expert_ffn=2048, shared_ffn=2048, vocab=129280)
    assert (tp8, dp8) == (85_140_130_848, 100_840_747_360)
    rows = {}
    for split, weights, replication in ((Split(8), tp8, 8), (Split(1, 8, 8), dp8, 1)):
        assert rank_weights(deepseek.model, deepseek.attention, split, "bfloat16") == weights
        kv = rank_kv(layouts, split.tp, CONTEXT, 2)
        assert kv.per_token == per_token and kv.per_sequence == per_token * CONTEXT == 575_668_224
        assert kv.replication == replication
        rows[split.name()] = per_gpu(kv, split, weights, GPU, 8)
    assert rows["TP=8"]["kv_budget_bytes_gpu"] == GPU - tp8 == 41_759_869_152
    assert rows["TP=8"]["sequences_per_node"] == (GPU - tp8) // 575_668_224 == 72
    assert rows["DP=8 EP=8"]["sequences_per_node"] == 8 * ((GPU - dp8) // 575_668_224) == 360
    assert rows["DP=8 EP=8"]["sequences_per_gpu"] == 45 and rows["TP=8"]["sequences_per_gpu"] == 9
    for figure in ("70,272", "575,668,224", "85,140,130,848", "100,840,747,360", "41,759,869,152",
                   "26,059,252,640", "| **72** | **360** |", "| 9 | 45 |"):
        assert figure in page, figure


def test_kv_heads_split_until_one_a_rank_then_replicate():
    """8 K/V heads for 32 query heads: TP=4 holds 2 a rank, TP=8 one, TP=16 one on each pair of ranks (2x)."""
    model = tiny_model_config(d_model=256, num_heads=32, preset_kv_heads=8)
    layouts = build_layouts(model, AttentionConfig(type="gqa", num_kv_heads=8).resolved(model))
    whole = 2 * 2 * 8 * 8 * 4  # 2 layers, K and V, 8 heads of 8, float32
    for tp, heads, replication in ((4, 2, 1), (8, 1, 1), (16, 1, 2)):
        kv = rank_kv(layouts, tp, 1024, 4)
        assert kv.per_token == whole * heads / 8 and kv.replication == replication
    assert [s.name() for s in node_splits(model, layouts, 8)] == ["DP=8", "TP=2 DP=4", "TP=4 DP=2", "TP=8"]


def test_a_recurrent_layers_state_splits_by_its_heads():
    """A Gated DeltaNet hybrid on 2 ranks: the K/V layer's 2 heads and the state's value heads both halve."""
    model = tiny_model_config()
    attention = AttentionConfig(type="gqa", num_kv_heads=2, layer_types=["linear_attention", "full_attention"])
    layouts = build_layouts(model, attention.resolved(model))
    kv = rank_kv(layouts, 2, 64, 4)
    assert layouts[0].state is not None and layouts[0].tensor_parts(2) == 2
    assert kv.per_sequence == layouts.cache_bytes(64, 1, 4) / 2 and kv.replication == 1
