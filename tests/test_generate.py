"""Greedy generation against a full recompute, in each dtype; the fixed-shape step against
today's step and transformers, eager and compiled."""

import pytest
import torch
from conftest import BENCH_SHAPE, make_decoder
from transformers import LlamaConfig, LlamaForCausalLM

from kvbench.cache import cache_for
from kvbench.checkpoint import build_decoder, hf_to_decoder_name
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.generate import FixedShapeStep, compiled_graphs, greedy_generate, prefill
from kvbench.layouts.build import build_layouts

KV_SPLITS = [8, 4, 2, 1]  # MHA, two GQA splits, MQA for 8 query heads


@pytest.mark.parametrize("num_kv_heads", KV_SPLITS)
@pytest.mark.parametrize("impl", ["static", "concat"])
def test_cached_decode_matches_full_recompute(num_kv_heads, impl):
    model = make_decoder(num_kv_heads)
    prompt = torch.randint(0, 97, (3, 11))
    gen_len = 9
    reference = greedy_generate(model, prompt, gen_len, cache_for(model, "none", 3, 20), keep_logits=True)
    cached = greedy_generate(model, prompt, gen_len, cache_for(model, impl, 3, 20), keep_logits=True)
    assert cached.logits.shape == (3, gen_len + 1, 97)
    torch.testing.assert_close(cached.logits, reference.logits, atol=1e-5, rtol=0)
    assert torch.equal(cached.tokens, reference.tokens)


def test_recompute_reference_is_one_causal_forward():
    """The 'none' path itself equals logits from a single forward over the final sequence."""
    model = make_decoder(2)
    prompt = torch.randint(0, 97, (2, 7))
    gen = greedy_generate(model, prompt, 5, cache_for(model, "none", 2, 20), keep_logits=True)
    full = torch.cat([prompt, gen.tokens[:, :-1]], dim=1)
    with torch.no_grad():
        logits = model(full)[:, prompt.shape[1] - 1:]
    torch.testing.assert_close(gen.logits, logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_generation_in_each_dtype(dtype):
    model = make_decoder(2, dtype=dtype)
    prompt = torch.randint(0, 97, (2, 6))
    out = greedy_generate(model, prompt, 4, cache_for(model, "static", 2, 10), keep_logits=True)
    assert out.tokens.shape == (2, 5) and out.logits.dtype == torch.float32
    assert cache_for(model, "static", 2, 10).tensors()[0].dtype == dtype
    # the low-precision run stays close to float32 with the same weights
    ref = make_decoder(2, dtype=torch.float32)
    ref_out = greedy_generate(ref, prompt, 0, cache_for(ref, "static", 2, 10), keep_logits=True)
    assert (out.logits[:, 0] - ref_out.logits[:, 0]).abs().max() < 0.1


@pytest.mark.parametrize("num_kv_heads", KV_SPLITS)
@pytest.mark.parametrize("batch", [1, 3])
def test_fixed_shape_step_matches_decode_step(num_kv_heads, batch):
    """The fixed-shape step (position as a tensor, the static cache read in buckets of 8
    positions, the rest masked) gives today's logits as the context crosses three buckets."""
    model = make_decoder(num_kv_heads)
    prompt = torch.randint(0, 97, (batch, 11))
    want = greedy_generate(model, prompt, 15, cache_for(model, "static", batch, 30), keep_logits=True)
    step = FixedShapeStep(bucket=8)
    got = greedy_generate(model, prompt, 15, cache_for(model, "static", batch, 30), keep_logits=True, step=step)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
    assert torch.equal(got.tokens, want.tokens)


def test_fixed_shape_step_counts_the_positions_its_windows_read():
    """What the roofline counts for a fixed-shape step is what each step's window reads."""
    model = make_decoder(2)
    cache, step = cache_for(model, "static", 1, 20), FixedShapeStep(bucket=8)
    prefill(model, torch.zeros(1, 11, dtype=torch.long), cache)
    read = [cache.fixed(p, 1, 8).length for p in range(11, 20)]
    assert step.lengths(cache_for(model, "static", 1, 20), range(11, 20)) == read == [16] * 5 + [20] * 4


@pytest.mark.e2e
def test_graph_step_gives_eager_tokens_and_never_recompiles():
    """runtime.compile=graph: the decode step compiled with fullgraph=True and static shapes.
    One graph serves every position of a decode (one context bucket), a second whole decode
    compiles nothing, and its tokens and logits are eager's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the benchmark and the job test that share this graph
    try:
        model = make_decoder(2, **BENCH_SHAPE)
        prompt = torch.randint(0, 512, (2, 120))
        step = FixedShapeStep(mode="graph")
        cache = cache_for(model, "static", 2, 129)
        graphs = compiled_graphs()
        greedy_generate(model, prompt, 9, cache, step=step)
        # One graph for all 9 positions, nothing per position (none if an earlier test in this
        # process compiled the same shapes: dynamo reuses it for any decoder of these shapes).
        first = compiled_graphs()
        assert first - graphs <= 1
        cache.reset()
        got = greedy_generate(model, prompt, 9, cache, keep_logits=True, step=step)
        assert compiled_graphs() == first  # zero recompiles over the whole decode
    finally:
        torch.set_num_threads(threads)
    want = greedy_generate(model, prompt, 9, cache_for(model, "static", 2, 129), keep_logits=True)
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_long_prompt_prefill_and_fixed_step_match_transformers(num_kv_heads):
    """A 1500-token prompt (batch 2): the prefill's logits and the fixed-shape decode after it
    against transformers' LlamaForCausalLM over the same tokens."""
    torch.manual_seed(0)
    hf_cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=num_kv_heads,
                         intermediate_size=48, vocab_size=97, max_position_embeddings=2048, rope_theta=10000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=False)
    hf_cfg._attn_implementation = "eager"
    hf = LlamaForCausalLM(hf_cfg).eval()
    cfg = ModelConfig(num_layers=2, d_model=32, num_heads=4, preset_kv_heads=num_kv_heads, ffn_dim=48, vocab_size=97,
                      max_seq_len=2048, norm_eps=1e-5)
    attention = AttentionConfig.for_heads(4, num_kv_heads)
    layouts = build_layouts(cfg, attention.resolved(cfg))
    state = {hf_to_decoder_name(k, layouts): v for k, v in hf.state_dict().items()}
    model = build_decoder(cfg, attention, state).eval()
    prompt = torch.randint(0, 97, (2, 1500))
    gen = greedy_generate(model, prompt, 4, cache_for(model, "static", 2, 1504), keep_logits=True,
                          step=FixedShapeStep(bucket=256))
    with torch.no_grad():
        theirs = hf(torch.cat([prompt, gen.tokens[:, :-1]], dim=1)).logits[:, 1499:]  # (2, 5, V)
    torch.testing.assert_close(gen.logits, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
def test_cuda_graph_step_replays_eager_decode():
    """runtime.compile=graph on a GPU (mode="reduce-overhead": CUDA graphs). Every kept logit
    equals eager's (so no output was read after a replay overwrote it), a second decode
    compiles nothing, and the cache is written where it was allocated (static addresses)."""
    model = make_decoder(2, **BENCH_SHAPE).cuda()
    prompt = torch.randint(0, 512, (2, 120), device="cuda")
    step = FixedShapeStep(mode="graph", device="cuda")
    assert step.cuda_graphs
    cache = cache_for(model, "static", 2, 129)
    pointers = [t.data_ptr() for t in cache.tensors()]
    for _ in range(2):  # the first call of a CUDA graph runs eagerly, the second records it
        cache.reset()
        greedy_generate(model, prompt, 9, cache, step=step)
    graphs = compiled_graphs()
    cache.reset()
    got = greedy_generate(model, prompt, 9, cache, keep_logits=True, step=step)
    assert compiled_graphs() == graphs and [t.data_ptr() for t in cache.tensors()] == pointers
    want = greedy_generate(model, prompt, 9, cache_for(model, "static", 2, 129), keep_logits=True)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.tokens, want.tokens)


@pytest.mark.parametrize("impl", ["static", "concat"])
def test_prefill_outside_inference_mode_leaves_no_graph_in_the_cache(impl):
    """A caller in autograd mode (the shared chat prefix did this) must not make the cache keep the
    prefill's graph: the stored K/V carry no grad_fn and need no grad, and the logits match."""
    model = make_decoder(num_kv_heads=2)
    prompt = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    cache = cache_for(model, impl, 2, 32)
    logits = prefill(model, prompt, cache)
    for layer in range(len(model.blocks)):
        for t in cache.layers[layer].tensors():
            assert t.grad_fn is None and not t.requires_grad
    with torch.no_grad():
        reference = model(prompt)[:, -1]
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
