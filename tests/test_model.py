"""The decoder against independent references: a full recompute, and attention written out
with explicit repeat_interleave of K/V."""

import pytest
import torch
import torch.nn.functional as F
from conftest import make_decoder, tiny_model_config
from torch.profiler import ProfilerActivity, profile

from kvbench.cache import Positions, uncached_layers
from kvbench.config.model import AttentionConfig
from kvbench.core.errors import ConfigError
from kvbench.footprint import parameter_counts
from kvbench.layouts.kv_heads import kv_group_map
from kvbench.layouts.kv_heads_attention import grouped_attention
from kvbench.mlp.dense import MLP
from kvbench.model import Decoder


def reference_attention(q, k, v, causal_mask):
    """Textbook GQA: copy each KV head to its G query heads, then plain softmax attention."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal_mask is not None:
        scores = scores.masked_fill(~causal_mask, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("num_kv_heads", [16, 8, 4, 2, 1])
@pytest.mark.parametrize("T", [1, 5])
def test_grouped_attention_equals_repeat_interleave_reference(num_kv_heads, T):
    B, H, S, D = 2, 16, 12, 8
    q = torch.randn(B, H, T, D)
    k, v = torch.randn(B, num_kv_heads, S, D), torch.randn(B, num_kv_heads, S, D)
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T) if T > 1 else None
    ours = grouped_attention(q, k, v, mask)
    torch.testing.assert_close(ours, reference_attention(q, k, v, mask), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("num_kv_heads", [16, 4, 1])
def test_attention_takes_the_output_layout_of_cuda_kernels(monkeypatch, num_kv_heads):
    """CUDA's fused SDPA kernels return (B, H_kv, M, D) strided as (B, M, H_kv, D); GQA once failed on
    a GPU with "view size is not compatible" (seen in the first GPU check). The same values in that
    layout must give the same result."""
    import kvbench.layouts.kv_heads_attention as model_module

    plain = model_module.F.scaled_dot_product_attention

    def cuda_layout(*args, **kwargs):
        out = plain(*args, **kwargs)  # (B, H_kv, M, D)
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, (B, M, H_kv, D) in memory

    B, H, T, S, D = 2, 16, 3, 12, 8
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, num_kv_heads, S, D), torch.randn(B, num_kv_heads, S, D)
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    want = grouped_attention(q, k, v, mask)
    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", cuda_layout)
    torch.testing.assert_close(grouped_attention(q, k, v, mask), want, atol=0, rtol=0)


def test_query_head_reads_its_own_group():
    """Zeroing every KV head but one changes exactly the query heads mapped to it."""
    B, H, H_kv, S, D = 1, 8, 2, 6, 4
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, H_kv, S, D), torch.randn(B, H_kv, S, D)
    base = grouped_attention(q, k, v, None)
    v2 = v.clone()
    v2[:, 1] += 1.0  # shift KV head 1's values: its query heads' outputs shift by exactly 1
    diff = (grouped_attention(q, k, v2, None) - base).mean(dim=(0, 2, 3))
    expected = torch.tensor([float(g == 1) for g in kv_group_map(H, H_kv)])
    torch.testing.assert_close(diff, expected, atol=1e-5, rtol=0)


def test_mha_equals_plain_sdpa_exactly():
    """With one query head per KV head the fold is the identity: bit-equal to plain SDPA."""
    q, k, v = torch.randn(2, 8, 5, 16), torch.randn(2, 8, 9, 16), torch.randn(2, 8, 9, 16)
    mask = torch.ones(5, 9, dtype=torch.bool).tril(4)
    assert torch.equal(grouped_attention(q, k, v, mask),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_gqa_with_all_kv_heads_is_mha():
    """A GQA model given num_kv_heads == num_heads is the MHA model: same weights, same logits."""
    mha = make_decoder(8, seed=3)
    grouped = make_decoder(8, seed=4)
    grouped.load_state_dict(mha.state_dict())
    tokens = torch.randint(0, 97, (2, 13))
    with torch.no_grad():
        assert torch.equal(mha(tokens), grouped(tokens))
    assert grouped.kv_groups() == list(range(8))


def _attention_bytes(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0 and e.cpu_parent is None)


@pytest.mark.parametrize("T", [1, 32])
def test_attention_memory_does_not_grow_with_group_size(T):
    """The profiler's allocation total for attention is the same for G = 1..16 (same H), while
    the repeat_interleave reference grows with the K/V copy."""
    B, H, S, D = 2, 16, 1024, 64
    ours, copies = [], []
    for G in (1, 4, 16):
        H_kv = H // G
        q, k, v = torch.randn(B, H, T, D), torch.randn(B, H_kv, S, D), torch.randn(B, H_kv, S, D)
        mask = None  # causal
        ours.append(_attention_bytes(lambda q=q, k=k, v=v, mask=mask: grouped_attention(q, k, v, mask)))
        copies.append(_attention_bytes(
            lambda k=k, v=v, G=G: k.repeat_interleave(G, 1) + 0 * v.repeat_interleave(G, 1)))
    assert max(ours) == min(ours), ours
    kv_bytes = B * H * S * D * 4
    assert max(ours) < kv_bytes / 4  # far below one expanded K
    assert copies[0] >= kv_bytes  # the naive expansion allocates at least one full K per call


@pytest.mark.parametrize("kv, needle", [(6, "attention.num_kv_heads=6"), (0, "attention.num_kv_heads=0")])
def test_bad_groupings_rejected_naming_the_field(kv, needle):
    from kvbench.config.model import AttentionConfig, ModelConfig
    model = ModelConfig(num_layers=1, d_model=4096, num_heads=32, preset_kv_heads=32)
    with pytest.raises(ConfigError) as err:
        AttentionConfig(type="gqa", num_kv_heads=kv).resolved(model)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_sequence_longer_than_max_seq_len_rejected():
    model = make_decoder(8)
    with pytest.raises(ValueError, match="max_seq_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize("kind", ["mha", "gqa", "mla"])
def test_a_decoder_on_the_meta_device_has_the_cpu_decoders_tensors(kind):
    """On the meta device nothing is initialised or computed (that would load torch._dynamo): the
    parameters and buffers still have the names, shapes and dtypes of the same decoder on the CPU."""
    from conftest import tiny_model_config

    from kvbench.config.model import AttentionConfig
    from kvbench.model import Decoder

    cfg = tiny_model_config()
    attention = {"mha": AttentionConfig.for_heads(8, 8), "gqa": AttentionConfig.for_heads(8, 2),
                 "mla": AttentionConfig(type="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                        v_head_dim=8)}[kind]
    cpu = Decoder(cfg, attention)
    with torch.device("meta"):
        meta = Decoder(cfg, attention)
    shapes = lambda m: {n: (tuple(t.shape), t.dtype) for n, t in [*m.named_parameters(), *m.named_buffers()]}
    assert shapes(meta) == shapes(cpu) and all(t.is_meta for t in meta.state_dict().values())
    assert meta.num_params() == cpu.num_params()


# ---- blocks of one mixer, the ungated relu2 MLP, no rotary (the pieces Nemotron-H's layers need) ----

def test_a_relu2_mlp_is_transformers_ungated_relu_squared():
    """model.mlp_act=relu2 against transformers' ACT2FN["relu2"] written out: down(relu2(up x)), no gate."""
    from transformers.activations import ACT2FN

    torch.manual_seed(0)
    mlp = MLP(tiny_model_config(mlp_act="relu2"))
    assert not hasattr(mlp, "w_gate")
    x = torch.randn(2, 5, 64)
    expected = mlp.w_down(ACT2FN["relu2"](mlp.w_up(x)))
    torch.testing.assert_close(mlp(x), expected, rtol=0, atol=0)


def test_a_block_without_an_mlp_is_its_mixer_alone_and_counted_so():
    """model.no_mlp_layers: that block is x + mixer(norm x), with no MLP weights; the parameter count
    from one- and two-layer models (footprint) equals the built decoder's, for every mix of kinds."""
    torch.manual_seed(0)
    cfg = tiny_model_config(num_layers=3, no_mlp_layers=[1], mlp_act="relu2")
    model = Decoder(cfg).eval()
    block = model.blocks[1]
    assert block.mlp is None and block.mlp_norm is None
    assert not any(".mlp" in name for name in dict(model.named_parameters()) if name.startswith("blocks.1."))
    x = model.embed(torch.tensor([[3, 1, 4, 1, 5]]))
    cos, sin = model.rope_cos[:5], model.rope_sin[:5]
    caches = uncached_layers(model.layouts)
    pos = Positions(0, 5, "cpu")
    with torch.no_grad():
        y = model.blocks[0](x, cos, sin, caches[0], pos)
        expected = y + block.attn(block.attn_norm(y), cos, sin, caches[1], pos)
        torch.testing.assert_close(block(y, cos, sin, caches[1], pos), expected, rtol=0, atol=0)
    for attention in (None, AttentionConfig(layer_types=["linear_attention", "full_attention", "linear_attention"])):
        resolved = (attention or AttentionConfig(type="mha")).resolved(cfg)
        assert parameter_counts(cfg, resolved).total == Decoder(cfg, resolved).num_params()


def test_without_rotary_embeddings_attention_does_not_see_absolute_positions():
    """model.rope_type=none (NoPE: Nemotron-H's and Granite 4's attention): the same tokens give the
    same logits wherever they start, as no rotary table turns them; with rotary they do not."""
    torch.manual_seed(0)
    tokens = torch.tensor([[5, 9, 2, 7, 1, 3]])
    for rope_type, same in (("none", True), ("default", False)):
        model = make_decoder(rope_type=rope_type)
        with torch.no_grad():
            at0, at9 = model(tokens, start_pos=0), model(tokens, start_pos=9)
        assert torch.equal(at0, at9) == same


@pytest.mark.parametrize("override, needle", [
    ({"mlp_act": "gelu"}, "model.mlp_act='gelu'"),
    ({"no_mlp_layers": [2]}, "model.no_mlp_layers=[2]: must name layers below model.num_layers=2"),
    ({"rope_type": "nope"}, "model.rope_type='nope'"),
    ({"multipliers": {"logits_scaling": 0.0}}, "model.multipliers.logits_scaling=0.0: must be a finite number > 0"),
    ({"multipliers": {"attention_multiplier": -1.0}}, "model.multipliers.attention_multiplier=-1.0: must be a finite"),
])
def test_a_block_shape_it_cannot_build_is_refused_naming_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        tiny_model_config(**override)
    assert needle in str(err.value) and "\n" not in str(err.value)
