"""Gated DeltaNet layers (kvbench.layouts.gated_deltanet): exact against transformers' own
Qwen3_5GatedDeltaNet and Qwen3NextGatedDeltaNet modules (random weights, float32) in prefill and
over cached decode steps, a long prompt in one forward too; the chunked form against the recurrent
form and a float64 loop of the rule; the working memory of the rule and of the layer's prefill
against the prompt's length (and transformers', which grows with it); the state cache's bytes
against a hand formula; what the layer refuses, in one line."""

import logging
from types import SimpleNamespace

import pytest
import torch
from conftest import compose, tiny_model_config
from recurrent_checks import LiveBytes

from kvbench.cache import Positions, make_cache, uncached
from kvbench.config.model import AttentionConfig
from kvbench.core.errors import ConfigError
from kvbench.generate import greedy_generate
from kvbench.jobs.job_config import to_bench_config
from kvbench.layouts.base import Layouts, check_limits
from kvbench.layouts.gated_deltanet import GatedDeltaNet
from kvbench.layouts.gated_deltanet_attention import (
    HF_NAMES,
    GatedDeltaNetAttention,
    chunked_delta_rule,
    recurrent_delta_rule,
)
from kvbench.layouts.kv_heads import KVHeads
from kvbench.model import Decoder
from kvbench.serving.batch import PagedStateLayer
from kvbench.shared_prefix import shared_cache_for

TOL = 1e-5
# (batch, H_k, H_v, d_k, d_v, kernel): value heads sharing key heads, d_k != d_v, two kernels
SHAPES = [(2, 2, 4, 8, 12, 4), (1, 2, 2, 16, 16, 3)]


@pytest.fixture(autouse=True)
def _quiet_fallbacks():
    """transformers logs that flash-linear-attention and causal-conv1d are not installed: the
    torch reference it falls back to is the one compared with."""
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


def layout(H_k, H_v, d_k, d_v, K):
    return GatedDeltaNet(None, H_k, H_v, d_k, d_v, K, num_heads=4, head_dim=16)


def hf_config(family, H_k, H_v, d_k, d_v, K):
    from transformers import Qwen3_5TextConfig, Qwen3NextConfig

    config = {"qwen3_5": Qwen3_5TextConfig, "qwen3_next": Qwen3NextConfig}[family]
    return config(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=97, linear_num_key_heads=H_k, linear_num_value_heads=H_v, linear_key_head_dim=d_k,
                  linear_value_head_dim=d_v, linear_conv_kernel_dim=K)


def qwen3_next_as_qwen3_5(sd, H_k, H_v, d_k, d_v):
    """Qwen3-Next's fused projections in Qwen3.5's names: in_proj_qkvz holds, per key head, that
    head's q (d_k rows), k (d_k), and its G value heads' v (G*d_v) and z (G*d_v); in_proj_ba per key
    head its G b rows and G a rows. Qwen3.5 stacks all q, then all k, then all v."""
    G, C = H_v // H_k, sd["in_proj_qkvz.weight"].shape[1]
    q, k, v, z = sd.pop("in_proj_qkvz.weight").view(H_k, -1, C).split([d_k, d_k, G * d_v, G * d_v], 1)
    b, a = sd.pop("in_proj_ba.weight").view(H_k, 2 * G, C).split([G, G], 1)
    flat = (lambda t: t.reshape(-1, C))
    sd.update({"in_proj_qkv.weight": torch.cat([flat(q), flat(k), flat(v)]), "in_proj_z.weight": flat(z),
               "in_proj_b.weight": flat(b), "in_proj_a.weight": flat(a)})
    return sd


def pair(family, shape, seed=0):
    """transformers' module (random weights: decays slow enough that the state carries across
    chunks and steps, norm weights and decay biases off their initial values) and kvbench's with
    the same weights."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    torch.manual_seed(seed)
    _, H_k, H_v, d_k, d_v, K = shape
    cfg = hf_config(family, H_k, H_v, d_k, d_v, K)
    hf = {"qwen3_5": Qwen3_5GatedDeltaNet, "qwen3_next": Qwen3NextGatedDeltaNet}[family](cfg, 0).eval()
    with torch.no_grad():
        hf.A_log.copy_(torch.empty(H_v).uniform_(0.001, 0.3).log())
        hf.dt_bias.normal_()
        hf.norm.weight.normal_(1.0, 0.3)
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    if family == "qwen3_next":
        sd = qwen3_next_as_qwen3_5(sd, H_k, H_v, d_k, d_v)
    lay = layout(H_k, H_v, d_k, d_v, K)
    ours = GatedDeltaNetAttention(tiny_model_config(norm_eps=cfg.rms_norm_eps), lay).eval()
    ours.load_state_dict({HF_NAMES[name]: t for name, t in sd.items()})
    return cfg, hf, ours, lay


def step(module, cache, x, start):
    """One forward of ``x`` (B, T, C) at ``start`` through ``cache``, as the decoder runs a layer."""
    pos = Positions(start, x.shape[1])
    out = module(x, None, None, cache.begin(pos, x.shape[0])[0], pos)
    cache.commit(pos)
    return out


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@torch.no_grad()
def test_prefill_and_45_cached_decode_steps_equal_transformers(family, shape):
    """A prompt of 150 tokens in two parts (90, then 60 after them: not multiples of the chunk),
    then 45 decode steps, one token at a time through kvbench's state cache. References: transformers'
    module with its own cache (its chunked prefill and recurrent step), and at the end its full
    recompute of the whole sequence without a cache, row by row."""
    from transformers.cache_utils import DynamicCache

    cfg, hf, ours, lay = pair(family, shape)
    B = shape[0]
    x = torch.randn(B, 195, 64)
    hf_cache, cache = DynamicCache(config=cfg), make_cache("static", Layouts([lay]), B, 256)
    diffs, outputs = [], []
    for start, end in [(0, 90), (90, 150)] + [(t, t + 1) for t in range(150, 195)]:
        want, got = hf(x[:, start:end], cache=hf_cache), step(ours, cache, x[:, start:end], start)
        diffs.append((want - got).abs().max().item())
        outputs.append(got)
    assert len(diffs) == 47 and max(diffs) <= TOL, diffs
    recomputed = hf(x)
    assert (recomputed - torch.cat(outputs, 1)).abs().max().item() <= TOL
    assert recomputed.abs().max() > 0.1  # the comparison is not between zeros


@torch.no_grad()
def test_a_forward_without_a_cache_starts_from_zero_state():
    """``uncached`` (cache.impl=none, a decoder forward without a cache) holds nothing: each
    forward is the whole sequence from a zero state, transformers' forward without a cache."""
    _, hf, ours, lay = pair("qwen3_5", SHAPES[0])
    x = torch.randn(2, 70, 64)
    cache = uncached(lay)
    for _ in range(2):
        got = ours(x, None, None, cache, Positions(0, 70))
        assert (hf(x) - got).abs().max().item() <= TOL
    assert cache.tensors() == []


def naive_rule(q, k, v, g, beta, state):
    """The gated delta rule as written (q scaled, q and k unit): float64, one token at a time."""
    q, k, v, g, beta, S = (t.double() for t in (q, k, v, g, beta, state))
    out = []
    for t in range(q.shape[2]):
        S = S * g[:, :, t, None, None].exp()
        remembered = torch.einsum("bhk,bhkv->bhv", k[:, :, t], S)
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, :, t], beta[:, :, t, None] * (v[:, :, t] - remembered))
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return torch.stack(out, 2), S


def rule_inputs(T, B=2, H=3, d_k=8, d_v=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    unit = (lambda t: t / t.norm(dim=-1, keepdim=True))
    q = unit(torch.randn(B, H, T, d_k, generator=gen)) * d_k ** -0.5
    k = unit(torch.randn(B, H, T, d_k, generator=gen))
    v = torch.randn(B, H, T, d_v, generator=gen)
    g = -torch.rand(B, H, T, generator=gen) * 0.2
    beta = torch.rand(B, H, T, generator=gen)
    return q, k, v, g, beta, torch.randn(B, H, d_k, d_v, generator=gen)


@pytest.mark.parametrize("T,chunk", [(2, 64), (63, 64), (64, 64), (65, 64), (130, 64), (37, 16), (50, 7)])
def test_the_chunked_form_equals_the_recurrent_form_token_by_token(T, chunk):
    """Lengths that are not multiples of the chunk (and one that is), from a state that is not
    zero: the chunked form's outputs and final state equal the recurrent form's, and both equal a
    float64 loop."""
    q, k, v, g, beta, state = rule_inputs(T)
    chunked_state, recurrent_state = state.clone(), state.clone()
    chunked = chunked_delta_rule(q, k, v, g, beta, chunked_state, chunk)
    recurrent = recurrent_delta_rule(q, k, v, g, beta, recurrent_state)
    want, want_state = naive_rule(q, k, v, g, beta, state)
    for out, final in ((chunked, chunked_state), (recurrent, recurrent_state)):
        assert (out.double() - want).abs().max() <= TOL and (final.double() - want_state).abs().max() <= TOL
    assert (chunked - recurrent).abs().max() <= TOL
    assert (want_state - state.double()).abs().max() > 0.1  # the tokens did change the state


def hand_state_bytes(H_k, H_v, d_k, d_v, K, element):
    # recurrent H_v x d_k x d_v in float32 + the conv's last K - 1 inputs of q, k, v in the compute dtype
    return H_v * d_k * d_v * 4 + (2 * H_k * d_k + H_v * d_v) * (K - 1) * element


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["static", "concat"])
def test_the_state_as_allocated_is_the_formula_and_does_not_grow(dtype, impl):
    shapes = [(2, 4, 8, 12, 4), (4, 4, 16, 16, 3)]
    layers = Layouts(layout(*s) for s in shapes)
    element, B = dtype.itemsize, 3
    per_sequence = sum(hand_state_bytes(*s, element) for s in shapes)
    cache = make_cache(impl, layers, B, 500, dtype)
    assert cache.nbytes == B * per_sequence
    assert layers.state_bytes(element) == per_sequence and layers.bytes_per_token(element) == 0
    assert [layers.cache_bytes(S, B, element) for S in (1, 256, 4096, 10 ** 6)] == [B * per_sequence] * 4
    assert layers.step_flops(256) == layers.step_flops(4096) == sum(7 * H_v * d_k * d_v for _, H_v, d_k, d_v, _ in
                                                                     shapes)
    # written in place: after a prompt and 10 steps the cache holds the same tensors, no more bytes
    before = [t.data_ptr() for t in cache.tensors()]
    modules = [GatedDeltaNetAttention(tiny_model_config(), lay).to(dtype) for lay in layers]
    with torch.no_grad():
        for start, T in [(0, 100)] + [(t, 1) for t in range(100, 110)]:
            pos = Positions(start, T)
            x = torch.randn(B, T, 64, dtype=dtype)
            for module, layer_cache in zip(modules, cache.begin(pos, B)):
                x = module(x, None, None, layer_cache, pos)
            cache.commit(pos)
    assert cache.nbytes == B * per_sequence and [t.data_ptr() for t in cache.tensors()] == before
    assert all(t.abs().sum() > 0 for t in cache.tensors())


def test_a_hybrid_pays_per_token_only_for_its_attention_layers():
    gdn, full = layout(2, 4, 8, 12, 4), KVHeads(None, 4, 2, 16)
    layers = Layouts([gdn, full])
    per_token = 2 * 2 * 16 * 4  # K and V, 2 heads of 16, float32
    assert layers.bytes_per_token(4) == per_token
    assert layers.cache_bytes(1000, 2, 4) == 2 * (hand_state_bytes(2, 4, 8, 12, 4, 4) + 1000 * per_token)
    assert layers.rotary_dim() == 16 and Layouts([gdn]).rotary_dim() == 0
    assert gdn.as_mha() == KVHeads(None, 4, 4, 16)


@pytest.fixture
def gdn_decoder():
    """A Decoder whose layers are ``kinds`` (attention.layer_types), its linear layers of the
    shape above (the model's linear_* fields)."""
    def make(kinds, seed=0):
        cfg = tiny_model_config(num_layers=len(kinds), num_heads=4, preset_kv_heads=2, max_seq_len=96,
                                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                linear_value_head_dim=12, linear_conv_kernel_dim=4)
        torch.manual_seed(seed)
        model = Decoder(cfg, AttentionConfig(layer_types=list(kinds))).eval()
        assert list(model.layouts) == [layout(2, 4, 8, 12, 4) if kind == "linear_attention"
                                       else KVHeads(None, 4, 2, 16) for kind in kinds]
        return model
    return make


@pytest.mark.parametrize("kinds", [["linear_attention"] * 3, ["linear_attention"] * 3 + ["full_attention"]])
def test_greedy_decoding_through_the_caches_equals_a_recompute(gdn_decoder, kinds):
    """A pure Gated DeltaNet stack and a 3:1 hybrid: 40 greedy steps through the static cache
    equal those through the concat cache token for token, and every step's logits equal a
    forward of the whole sequence without a cache (what cache.impl=none runs every step)."""
    model = gdn_decoder(kinds)
    prompt = torch.randint(0, 97, (2, 21))
    runs = {impl: greedy_generate(model, prompt, 40, make_cache(impl, model.layouts, 2, 64), keep_logits=True)
            for impl in ("static", "concat")}
    assert torch.equal(runs["concat"].tokens, runs["static"].tokens)
    assert (runs["concat"].logits - runs["static"].logits).abs().max() <= TOL
    with torch.no_grad():
        recomputed = model(torch.cat([prompt, runs["static"].tokens[:, :-1]], 1))[:, 20:]  # (2, 41, V)
    assert (recomputed - runs["static"].logits).abs().max() <= TOL


@torch.no_grad()
def test_a_state_refuses_to_roll_back_but_resets(gdn_decoder):
    model = gdn_decoder(["linear_attention"] * 2)
    cache = make_cache("static", model.layouts, 1, 64)
    tokens = torch.randint(0, 97, (1, 30))
    first = model(tokens, cache)
    assert torch.equal(model(tokens, cache), first)  # a prompt written at position 0 again starts afresh
    with pytest.raises(ValueError) as info:
        cache.truncate(20)
    assert str(info.value) == ("cannot truncate to 20: a recurrent state folds positions 0..29 together and "
                               "cannot roll back; only reset() (0) or 30 works")
    assert cache.length == 30
    cache.truncate(30)
    cache.reset()
    assert cache.length == 0 and all(t.abs().sum() == 0 for t in cache.tensors())
    assert torch.equal(model(tokens, cache), first)


REFUSED = {  # setting: the one line
    "cache.shared": ("cache.shared=True: a shared prefix holds K/V once for many sequences; a Gated DeltaNet layer's "
                     "state is each sequence's own (prefix caching for state layers is not built); use "
                     "cache.shared=false"),
    "runtime.compile": ("runtime.compile='graph': the fixed-shape step reads a context bucket of K/V; a Gated "
                        "DeltaNet layer's state has no such view (not built); use false or default"),
}


def test_refused_combinations_are_one_line_naming_the_key():
    layers = Layouts([KVHeads(None, 4, 2, 16), layout(2, 4, 8, 12, 4)])
    model = SimpleNamespace(layouts=layers, dtype=torch.float32, device=torch.device("cpu"))
    attempts = {
        "cache.shared": lambda: shared_cache_for(model, "static", 2, 4, 16),
        "runtime.compile": lambda: check_limits(layers, {"runtime.compile": "graph"}),
    }
    for key, attempt in attempts.items():
        with pytest.raises(ConfigError) as info:
            attempt()
        assert str(info.value) == REFUSED[key]
    # the serving store holds a state page per sequence (tests/test_serving_engine.py)
    check_limits(layers, {"runtime.compile": "default", "cache.shared": False, "workload.store": "paged"})
    with pytest.raises(ValueError, match="^a recurrent state has no fixed-shape view"):
        make_cache("static", layers, 1, 16).fixed(0, 1, 8)


def test_a_jobs_config_names_the_settings_a_state_layer_refuses():
    """BenchConfig.layout_settings carries cache.shared (a multi-turn chat sharing its prompt), so a
    job with a Gated DeltaNet layer is refused before it runs; cache.dtype is the attention layers'
    (tests/test_kv_fp4.py), a state layer takes any."""
    layers = Layouts([layout(2, 4, 8, 12, 4)])
    shared = to_bench_config(compose("model=tiny", "workload=multiturn", "cache.shared=true"))
    with pytest.raises(ConfigError, match="^cache.shared=True: "):
        layers.check(shared.layout_settings())
    layers.check(to_bench_config(compose("model=tiny", "cache.dtype=int8")).layout_settings())
    layers.check(to_bench_config(compose("model=tiny", "workload=multiturn")).layout_settings())


def test_the_chunked_form_trains_its_gradients_equal_the_float64_loops():
    """Training a Gated DeltaNet layer from scratch (task=recall, task=train) backpropagates through
    the chunked form from a zero state, as a forward without a cache starts: its gradients with
    respect to every input equal those of the float64 loop (the state it writes back is not read
    by the backward)."""
    inputs = [t.clone().requires_grad_() for t in rule_inputs(50)[:5]]
    state = torch.zeros(2, 3, 8, 6)
    out = chunked_delta_rule(*inputs, state, 16)
    grads = torch.autograd.grad((out * out.detach().sin()).sum(), inputs)
    doubles = [t.detach().double().requires_grad_() for t in inputs]
    want_out, _ = naive_rule(*doubles, torch.zeros(2, 3, 8, 6))
    want = torch.autograd.grad((want_out * want_out.detach().sin()).sum(), doubles)
    for got, ref in zip(grads, want):
        assert (got.double() - ref).abs().max() <= 1e-4 * max(1.0, ref.abs().max().item())
    assert not state.requires_grad and state.abs().max() > 0  # the cache got the final state, without a graph


@pytest.mark.parametrize("T", [129, 195])
@torch.no_grad()
def test_a_long_prompt_in_one_forward_is_transformers_and_the_recurrent_step(T):
    """A prompt of several chunks in one forward (the layer goes a chunk of tokens at a time, the
    conv tail and the state carried; 129 leaves a last piece shorter than the kernel's tail, 195 one
    exactly as long), then 5 decode steps from the cache it wrote: equal to transformers' recompute
    of the whole sequence, and to the same tokens fed one at a time through the layer's recurrent
    step; a serving store's state pages take the prompt's final conv tail and state as the cache does."""
    _, hf, ours, lay = pair("qwen3_5", SHAPES[0])
    B = SHAPES[0][0]
    x = torch.randn(B, T + 5, 64)
    cache, stepped = (make_cache("static", Layouts([lay]), B, 256) for _ in range(2))
    got = torch.cat([step(ours, cache, x[:, :T], 0)] + [step(ours, cache, x[:, t:t + 1], t)
                                                         for t in range(T, T + 5)], 1)
    one_by_one = [step(ours, stepped, x[:, t:t + 1], t) for t in range(T)]
    after_prompt = [t.clone() for t in stepped.tensors()]
    one_by_one = torch.cat(one_by_one + [step(ours, stepped, x[:, t:t + 1], t) for t in range(T, T + 5)], 1)
    want = hf(x)
    assert (want - got).abs().max().item() <= TOL and (one_by_one - got).abs().max().item() <= TOL
    assert want.abs().max() > 0.1  # the comparison is not between zeros
    assert all((a - b).abs().max() <= TOL for a, b in zip(cache.tensors(), stepped.tensors()))
    # a serving store's state pages (read as a batch, written back at commit) end where the cache did
    conv, recurrent = (torch.zeros((3,) + t.shape[1:]) for t in after_prompt)
    pages = [2, 0][:B]
    paged = PagedStateLayer(conv, recurrent, torch.tensor(pages))
    prefilled = ours(x[:, :T], None, None, paged, Positions(0, T))
    paged.commit()
    assert (prefilled - got[:, :T]).abs().max().item() <= TOL
    for held, want_held in zip((conv, recurrent), after_prompt):
        assert (held[pages] - want_held).abs().max() <= TOL and not held[1].any()


def test_a_layers_gradients_over_a_prompt_of_several_chunks_equal_transformers():
    """Training through a layer (task=train, task=recall): a prompt of 150 tokens (three pieces)
    from a zero state; the gradients with respect to the input and every weight equal those of
    transformers' module (autograd through its torch chunked rule): the state carried from piece
    to piece keeps its graph."""
    _, hf, ours, lay = pair("qwen3_5", SHAPES[0])
    x = torch.randn(1, 150, 64)
    grads = []
    for module, names in ((ours, None), (hf, HF_NAMES)):
        t = x.clone().requires_grad_()
        out = module(t, None, None, uncached(lay), Positions(0, 150)) if module is ours else module(t)
        params = dict(module.named_parameters())
        got = torch.autograd.grad((out * out.detach().sin()).sum(), [t, *params.values()])
        grads.append(dict(zip(["x"] + [names[n] if names else n for n in params], got)))
    assert grads[0].keys() == grads[1].keys()
    for name, want in grads[1].items():
        assert (grads[0][name] - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item()), name
    assert grads[1]["x"].abs().max() > 0.1


@torch.no_grad()
def test_the_chunked_form_works_in_memory_of_a_chunk_whatever_the_length():
    """Beyond its output, the chunked form's peak of live tensors at 4,096 tokens is within 1.5x its
    peak at 512: only the state crosses chunks. transformers' torch_chunk_gated_delta_rule, which
    keeps every chunk's matrices at once, grows with T under the same count (the count can see it)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    work, reference = {}, {}
    for T in (512, 4096):
        q, k, v, g, beta, state = inputs = rule_inputs(T, B=1, H=2, d_k=8, d_v=8)
        with LiveBytes(*inputs) as count:
            out = chunked_delta_rule(q, k, v, g, beta, state)
        work[T] = count.peak - out.nbytes
        assert count.now == out.nbytes  # nothing but the output outlives the call
        # transformers' layout (B, T, H, d), scaling q itself: its inputs are new tensors, not counted
        theirs = [t.transpose(1, 2).contiguous() for t in (q * 8 ** 0.5, k, v, g, beta)]
        with LiveBytes(*inputs, *theirs) as count:
            out, _ = torch_chunk_gated_delta_rule(*theirs, initial_state=state, output_final_state=True)
        reference[T] = count.peak - out.nbytes
    assert 0 < work[4096] <= 1.5 * work[512], work
    assert reference[4096] > 4 * reference[512] and reference[4096] > 10 * work[4096], reference


@pytest.mark.parametrize("held", [True, False])
@torch.no_grad()
def test_a_layers_prefill_works_in_memory_of_a_chunk_whatever_the_length(held):
    """A whole layer's prefill (projections, convolution, rule, norm and gate), through a held
    cache or none: beyond its input, output, weights and cache, its peak of live tensors at 4,096
    tokens is within 1.5x its peak at 512. transformers' Qwen3_5GatedDeltaNet, which projects the
    whole prompt and keeps every chunk's matrices at once, grows with T under the same count."""
    _, hf, ours, lay = pair("qwen3_5", SHAPES[0])
    work, reference = {}, {}
    for T in (512, 4096):
        x = torch.randn(1, T, 64)
        cache = make_cache("static", Layouts([lay]), 1, T) if held else None
        layer = cache.begin(Positions(0, T), 1)[0] if held else uncached(lay)
        with LiveBytes(x, *ours.parameters(), *layer.tensors()) as count:
            out = ours(x, None, None, layer, Positions(0, T))
        work[T] = count.peak - out.nbytes
        assert count.now == out.nbytes  # nothing but the output outlives the call
        if not held:  # the reference once (it takes seconds)
            with LiveBytes(x, *hf.parameters()) as count:
                out = hf(x)
            reference[T] = count.peak - out.nbytes
    assert 0 < work[4096] <= 1.5 * work[512], work
    assert held or reference[4096] > 4 * reference[512] and reference[4096] > 10 * work[4096], reference


@torch.no_grad()
def test_a_hybrids_prefill_costs_a_sequence_less_than_mhas_at_the_capacity_probes_context():
    """experiment=choose's model at 256 tokens, prefilled as a capacity probe prefills (kvbench.generate's
    prefill: every prompt of the batch at once): per sequence (the peak of live tensors at batch 4
    less batch 1's, over 3) the Gated DeltaNet hybrid's working memory is within 1.5x that of the
    same model all GQA-2 (its full layers' kind), and that plus what its cache holds is below MHA's
    (issue 59: a prefill that kept every chunk's matrices at once cost the hybrid 3.5x GQA's per
    sequence and, with its cache, more than MHA's)."""
    from kvbench.generate import prefill
    from kvbench.tasks.common import build_model

    torch.set_num_threads(1)
    work, held = {}, {}
    for attention in ("mha", "gqa", "choose/gdn"):
        cfg = to_bench_config(compose("experiment=choose", f"attention={attention}"))
        model = build_model(cfg, torch.device("cpu")).eval()
        peaks = {}
        for B in (1, 4):
            prompt = torch.randint(0, cfg.model.vocab_size, (B, 256), generator=torch.Generator().manual_seed(0))
            cache = make_cache("static", model.layouts, B, 264)
            with LiveBytes(prompt, *model.parameters(), *model.buffers(), *cache.tensors()) as count:
                prefill(model, prompt, cache)
            peaks[B] = count.peak
        work[attention] = (peaks[4] - peaks[1]) / 3
        held[attention] = sum(t.nbytes for t in cache.tensors()) / 4
    assert 0 < work["choose/gdn"] <= 1.5 * work["gqa"], work
    assert work["choose/gdn"] + held["choose/gdn"] < work["mha"] + held["mha"], (work, held)
    assert held["choose/gdn"] < held["mha"] / 8  # what the formula promises: the working memory decided it
