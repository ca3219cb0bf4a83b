"""Learned attention sinks (GPT-OSS, ``attention.sinks``): one logit per query head joins every
softmax as a column with no value. Checked against transformers' own GPT-OSS attention module
(random weights, prefill and cached decode past a window) and against a naive softmax with an
extra column in float64, on every path of the attention (decode fold, causal prefill, a prompt
after cached keys, a window, a shared prefix), and through the decoder's caches."""

import pytest
import torch
from conftest import make_decoder, tiny_model_config

from kvbench.cache import Positions, cache_for, causal_mask, make_cache
from kvbench.config.model import AttentionConfig
from kvbench.core.errors import ConfigError
from kvbench.generate import FixedShapeStep, greedy_generate
from kvbench.layouts.base import LayerLayout, Layouts
from kvbench.layouts.kv_heads import KVHeads
from kvbench.layouts.kv_heads_attention import KVHeadsAttention, grouped_attention
from kvbench.model import Decoder
from kvbench.shared_prefix import shared_cache_for


def naive(q, k, v, sinks, mask):
    """K/V copied to every query head, softmax over [scores, sink] in float64, the sink dropped."""
    G = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    scores = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, H, T, S)
    if mask is not None:
        scores = scores.masked_fill(~(mask if mask.dim() == 2 else mask[:, None]), float("-inf"))
    sink = sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    return (probs @ v).float()


CASES = {  # name: (T, S, mask); None: the function's own causal mask
    "decode": (1, 13, None),
    "decode, fixed-window mask": (1, 13, torch.arange(13)[None] <= 9),
    "causal prefill": (7, 7, None),
    "prompt after cached keys": (5, 12, None),
    "window over a prompt": (9, 9, causal_mask(9, 9, "cpu", LayerLayout(4))),
    "window after cached keys": (4, 10, causal_mask(4, 10, "cpu", LayerLayout(3))),
}


@pytest.mark.parametrize("num_kv_heads", [8, 2, 1])
@pytest.mark.parametrize("case", list(CASES))
def test_every_attention_path_with_sinks_is_a_softmax_with_an_extra_column(case, num_kv_heads):
    T, S, mask = CASES[case]
    torch.manual_seed(0)
    B, H, D = 2, 8, 16
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, num_kv_heads, S, D), torch.randn(B, num_kv_heads, S, D)
    sinks = torch.randn(H) * 2
    want = naive(q, k, v, sinks, causal_mask(T, S, "cpu") if mask is None and T > 1 else mask)
    got = grouped_attention(q, k, v, mask, sinks=sinks)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    # the sink takes weight: without it the output is another one
    assert (grouped_attention(q, k, v, mask) - got).abs().max() > 1e-3


@pytest.mark.parametrize("num_kv_heads", [8, 2, 1])
@pytest.mark.parametrize("T", [1, 5])
def test_a_shared_prefix_with_sinks_is_the_prefix_copied(num_kv_heads, T):
    torch.manual_seed(1)
    B, H, P, S, D = 3, 8, 7, 6, 16
    q = torch.randn(B, H, T, D)
    k, v = torch.randn(B, num_kv_heads, S, D), torch.randn(B, num_kv_heads, S, D)
    kp, vp = torch.randn(1, num_kv_heads, P, D), torch.randn(1, num_kv_heads, P, D)
    sinks = torch.randn(H)
    full_k, full_v = torch.cat([kp.expand(B, -1, -1, -1), k], 2), torch.cat([vp.expand(B, -1, -1, -1), v], 2)
    want = naive(q, full_k, full_v, sinks, causal_mask(T, P + S, "cpu") if T > 1 else None)
    torch.testing.assert_close(grouped_attention(q, k, v, None, (kp, vp), sinks), want, atol=2e-6, rtol=1e-5)


def _gpt_oss_attention(layer_type):
    """transformers' GptOssAttention with random weights (sinks included), eager attention; its
    output projection's bias zeroed (kvbench's decoder has none: a whole GPT-OSS checkpoint
    needs its mixture-of-experts too)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

    config = GptOssConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                          num_hidden_layers=2, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                          num_local_experts=2, intermediate_size=32, vocab_size=97, max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(3)
    layer = 0 if layer_type == "sliding_attention" else 1
    hf = GptOssAttention(config, layer).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.1)
        hf.sinks.normal_(0, 1.5)
        hf.o_proj.bias.zero_()
    return config, hf, GptOssRotaryEmbedding(config)


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_gpt_oss_attention_module_prefill_and_cached_decode_past_the_window(layer_type):
    """kvbench's KV-head layer with sinks against transformers' GptOssAttention itself: a prefill
    of 9 tokens, then 11 decode steps through kvbench's cache (a ring of 6 for the sliding layer),
    each equal to transformers' attention over the whole sequence at that position."""
    config, hf, rotary = _gpt_oss_attention(layer_type)
    W = config.sliding_window if layer_type == "sliding_attention" else None
    layout = KVHeads(W, 8, 2, 8, sinks=True)
    model_cfg = tiny_model_config(d_model=64, num_heads=8, head_dim=8, qkv_bias=True)
    ours = KVHeadsAttention(model_cfg, layout).eval()
    with torch.no_grad():
        for mine, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            getattr(ours, mine).weight.copy_(getattr(hf, theirs).weight)
            if getattr(ours, mine).bias is not None:
                getattr(ours, mine).bias.copy_(getattr(hf, theirs).bias)
        ours.sinks.copy_(hf.sinks)
    B, P, N = 2, 9, 11
    S = P + N
    x = torch.randn(B, S, 64, generator=torch.Generator().manual_seed(4))
    cos, sin = rotary(x, torch.arange(S)[None])  # (1, S, D/2): GPT-OSS's halves
    allowed = causal_mask(S, S, "cpu", layout)
    additive = torch.zeros(S, S).masked_fill(~allowed, float("-inf"))[None, None]
    with torch.no_grad():
        want, _ = hf(x, (cos, sin), additive)  # (B, S, C): every position, no cache
    full_cos, full_sin = torch.cat([cos[0], cos[0]], -1), torch.cat([sin[0], sin[0]], -1)  # (S, D) rotate-half
    cache = make_cache("static", Layouts([layout]), B, S)
    got = []
    with torch.no_grad():
        for start, T in [(0, P)] + [(p, 1) for p in range(P, S)]:
            pos = Positions(start, T)
            layer = cache.begin(pos, B)[0]
            got.append(ours(x[:, start:start + T], full_cos[start:start + T], full_sin[start:start + T], layer, pos))
            cache.commit(pos)
    got = torch.cat(got, 1)
    assert (got - want).abs().max() <= 1e-5
    if W is not None:
        assert cache.layers[0].stores[0].codes.shape[2] == W  # decode ran past the window, from a ring of W


HYBRID = dict(type="gqa", num_kv_heads=2, window=6, global_every=2)  # GPT-OSS's alternation


@pytest.mark.parametrize("attention, impl", [(dict(type="gqa", num_kv_heads=2), impl) for impl in
                                             ("static", "concat", "none")]
                         + [(dict(type="mqa"), "static"), (HYBRID, "static"), (HYBRID, "none")])
def test_a_decoder_with_sinks_decodes_exactly_as_its_recompute(attention, impl):
    cfg = tiny_model_config()
    torch.manual_seed(5)
    model = Decoder(cfg, AttentionConfig(sinks=True, **attention)).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.sinks.normal_(0, 2)
    prompt = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(6))
    gen = greedy_generate(model, prompt, 12, cache_for(model, impl, 2, 30), keep_logits=True)
    seq = torch.cat([prompt, gen.tokens[:, :-1]], 1)
    with torch.no_grad():
        recompute = model(seq)[:, 9:]
    torch.testing.assert_close(gen.logits, recompute, atol=1e-5, rtol=0)
    if not attention.get("window") and impl == "static":  # the fixed-shape step too
        fixed = greedy_generate(model, prompt, 12, cache_for(model, impl, 2, 30), keep_logits=True,
                                step=FixedShapeStep(bucket=8))
        torch.testing.assert_close(fixed.logits, gen.logits, atol=1e-5, rtol=0)


def test_a_shared_prefix_chat_with_sinks_equals_its_recompute():
    torch.manual_seed(7)
    model = Decoder(tiny_model_config(), AttentionConfig(type="gqa", num_kv_heads=2, sinks=True)).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.sinks.normal_(0, 2)
    system = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(8))
    users = torch.randint(0, 97, (3, 5), generator=torch.Generator().manual_seed(9))
    cache = shared_cache_for(model, "static", 3, 8, 40)
    with torch.no_grad():
        model(system, cache, 0)
        got = model(users, cache, 8)
        want = model(torch.cat([system.expand(3, -1), users], 1))[:, 8:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_sinks_cost_no_cache_and_a_parameter_per_query_head():
    plain, sunk = make_decoder(2), Decoder(tiny_model_config(), AttentionConfig(type="gqa", num_kv_heads=2, sinks=True))
    assert sunk.num_params() - plain.num_params() == 2 * 8  # layers x query heads
    assert sunk.layouts.cache_bytes(40, 3, 4) == plain.layouts.cache_bytes(40, 3, 4)


def test_sinks_with_latent_attention_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match="attention.sinks=True: .*attention=mla has none"):
        AttentionConfig(type="mla", sinks=True).resolved(tiny_model_config())
