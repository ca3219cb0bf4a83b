"""KDA layers and Kimi Linear's full layers (kvbench.layouts.kda, kda_mixer; latent layers without
rotary embeddings: latent, latent_attention): exact against transformers' KimiLinearDeltaAttention
and KimiLinearAttention (tiny random KimiLinearConfig, float32) in prefill and over cached decode
steps, and a whole Kimi Linear built from them against transformers' generate; the chunked rule
against the recurrent step and a float64 loop; the chunked rule's working memory against the
prompt's length (and transformers', which grows with it); the state's bytes against a hand formula;
config.json reading against KimiLinearConfig; what the layers refuse, in one line."""

import math
from dataclasses import replace

import pytest
import torch
from conftest import tiny_model_config
from recurrent_checks import LiveBytes, check_a_constant_state, check_parts_then_steps, greedy_steps, run, step_both

from kvbench.cache import Positions, layer_cache
from kvbench.core.errors import ConfigError
from kvbench.layouts.base import Layouts
from kvbench.layouts.kda import KDA, hf_layer_kinds, kda_from_hf, latent_fields
from kvbench.layouts.kda_mixer import (
    KDAAttention,
    chunked_kda,
    decayed_scores,
    hf_kda_weights,
    recurrent_kda,
)
from kvbench.layouts.kv_heads import KVHeads
from kvbench.layouts.latent import Latent
from kvbench.layouts.latent_attention import LatentAttention
from kvbench.state_cache import StateLayer

TOL = 1e-5
D_MODEL = 64
# 4 KDA heads of 16, kernel 4; full layers: 4 heads, latent 16, nope 8 + unrotated 4, values 8
SHAPE = dict(vocab_size=97, hidden_size=D_MODEL, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
             kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, linear_head_dim=16,
             linear_num_heads=4, linear_conv_kernel_dim=4, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
TYPES = ["linear_attention", "full_attention", "linear_attention"]


# transformers' warnings off: it falls back to the torch path compared with (conftest.quiet_transformers)
pytestmark = pytest.mark.usefixtures("quiet_transformers")


def hf_config(**overrides):
    from transformers import KimiLinearConfig

    fields = {**SHAPE, "num_hidden_layers": len(TYPES), "layer_types": TYPES, "mlp_layer_types": ["dense"] * 3,
              **overrides}
    return KimiLinearConfig(**fields)


def kimi_latent_from_hf(cfg: dict) -> Latent:
    """Kimi Linear's full layers as its home reads them: latent layers whose key part is not rotated."""
    return Latent(None, num_heads=cfg.get("num_attention_heads", 32), **latent_fields(cfg), rotary=False)


def config_json(cfg) -> dict:
    """What a checkpoint's config.json holds for ``cfg`` (to_dict, as save_pretrained writes it)."""
    return {**cfg.to_dict(), "architectures": ["KimiLinearForCausalLM"]}


def model_config(cfg):
    return tiny_model_config(d_model=D_MODEL, norm_eps=cfg.rms_norm_eps, max_seq_len=256)


def pair(seed=0, **overrides):
    """transformers' KDA module (initialised as its model initialises one, after flash-linear-attention:
    A_log the log of uniform [1, 16], dt biases the inverse softplus of log-uniform [1e-3, 0.1]; the
    norm's weight moved off 1) and kvbench's, loaded from its tensors by their transformers names."""
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    torch.manual_seed(seed)
    cfg = hf_config(**overrides)
    hf = KimiLinearDeltaAttention(cfg, 0).eval()  # the module alone: a whole model's init is slow here
    with torch.no_grad():
        gate = hf.forget_gate
        gate.A_log.copy_(torch.empty_like(gate.A_log).uniform_(1.0, 16.0).log())
        dt = torch.empty_like(gate.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
        gate.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        hf.o_norm.weight.normal_(1.0, 0.3)
    lay = kda_from_hf(config_json(cfg))
    ours = KDAAttention(model_config(cfg), lay).eval()
    ours.load_state_dict(hf_kda_weights(hf.state_dict()))
    return cfg, hf, ours, lay




@pytest.mark.parametrize("T", [1, 75, 200])
@torch.no_grad()
def test_a_prompt_equals_transformers(T):
    """Prompts of one token, of 75 (not a multiple of the chunk of 64) and 200 (more than three
    chunks): kvbench's chunked rule, a chunk at a time, equals transformers' torch path, all chunks
    at once."""
    _, hf, ours, lay = pair()
    x = torch.randn(2, T, D_MODEL)
    want = hf(x)
    got = run(ours, StateLayer(lay.state, 2, torch.float32), x, 0)
    assert (want - got).abs().max().item() <= TOL
    assert want.abs().max() > 0.1  # the comparison is not between zeros




@torch.no_grad()
def test_prefill_in_two_parts_then_40_decode_steps_equal_transformers_and_one_prefill():
    """A prompt of 150 tokens in two parts (90, then 60 from the held state: neither a multiple of the
    chunk, together past two chunks), then 40 recurrent decode steps: each equals transformers' module
    with its own cache, and all 190 outputs equal one prefill of the 190 tokens, kvbench's and
    transformers'."""
    cfg, hf, ours, lay = pair()
    x = torch.randn(2, 190, D_MODEL)
    check_parts_then_steps(cfg, hf, ours, lay.state, x, [(0, 90), (90, 150)], TOL)


@torch.no_grad()
def test_a_forward_without_a_cache_starts_from_zero_state():
    """A cache that holds nothing (cache.impl=none): each forward is the whole sequence from a zero
    state, transformers' forward without a cache, and nothing is kept."""
    _, hf, ours, lay = pair()
    x = torch.randn(2, 70, D_MODEL)
    cache = StateLayer(lay.state, 0, torch.float32, held=False)
    for _ in range(2):
        assert (hf(x) - run(ours, cache, x, 0)).abs().max().item() <= TOL
    assert cache.tensors() == [] and cache.nbytes == 0


def test_gradients_equal_transformers():
    """A training step's gradients (task=train) through the chunked rule, a chunk at a time, equal
    those through transformers' torch path for every parameter."""
    _, hf, ours, lay = pair()
    x = torch.randn(2, 80, D_MODEL)
    hf(x).pow(2).sum().backward()
    run(ours.train(), StateLayer(lay.state, 0, torch.float32, held=False), x, 0).pow(2).sum().backward()
    theirs = hf_kda_weights({name: p.grad for name, p in hf.named_parameters()})
    mine = dict(ours.named_parameters())
    assert sorted(theirs) == sorted(mine)
    for name, want in theirs.items():
        assert (mine[name].grad - want).abs().max() <= 1e-5 * want.abs().max(), name


@torch.no_grad()
def test_in_bfloat16_a_prompt_and_steps_round_as_transformers():
    """In bfloat16 both run the rule in float32 between the same roundings: a prompt and 20 steps
    within one rounding of the output of transformers'."""
    from transformers.cache_utils import DynamicCache

    cfg, hf, ours, lay = pair()
    hf, ours = hf.to(torch.bfloat16), ours.to(torch.bfloat16)
    x = torch.randn(2, 90, D_MODEL, dtype=torch.bfloat16)
    cache, hf_cache = StateLayer(lay.state, 2, torch.bfloat16), DynamicCache(config=cfg)
    for start, end in [(0, 70)] + [(t, t + 1) for t in range(70, 90)]:
        want, got = hf(x[:, start:end], cache=hf_cache).float(), run(ours, cache, x[:, start:end], start).float()
        assert (want - got).abs().max() <= 2.0 ** -7 * want.abs().max(), start


# ---- the decay gate ----------------------------------------------------------------------------

@torch.no_grad()
def test_the_decay_gate_is_transformers_per_channel_and_with_a_lower_bound_glm5_nexts():
    """Kimi Linear's gate (no bound: -exp(A) softplus(f), transformers' log(1 + exp) below 20 and f
    above) and, with ``gate_lower_bound``, the safe gate L sigmoid(exp(A) f) of transformers'
    Glm5NextTextForgetGate (same projections, A_log (H,)): equal to transformers' on inputs that reach
    past 20, each key channel its own value."""
    from types import SimpleNamespace

    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextForgetGate

    _, hf, ours, lay = pair()
    x = torch.randn(2, 30, D_MODEL) * 40  # some f past softplus' threshold
    g = ours.decay(x)
    assert (g - hf.forget_gate(x)).abs().max() <= TOL and g.shape == (2, 30, 4, 16)
    assert (g[..., 1:] - g[..., :1]).abs().max() > 0.1 and g.max() <= 0  # per channel, a decay
    glm = Glm5NextTextForgetGate(SimpleNamespace(linear_head_dim=16, linear_num_heads=4, hidden_size=D_MODEL,
                                                 linear_lower_bound=-5.0))
    glm.load_state_dict({"f_a_proj.weight": hf.forget_gate.f_a_proj.weight, "A_log": hf.forget_gate.A_log.flatten(),
                         "f_b_proj.weight": hf.forget_gate.f_b_proj.weight, "dt_bias": hf.forget_gate.dt_bias})
    bounded = KDAAttention(model_config(hf_config()), KDA(None, linear_num_heads=4, linear_head_dim=16,
                                                          gate_lower_bound=-5.0))
    bounded.load_state_dict(ours.state_dict())
    g = bounded.decay(x)
    assert (g - glm(x)).abs().max() <= TOL and -5 <= g.min() and g.max() <= 0


@torch.no_grad()
def test_with_a_lower_bound_the_layer_equals_glm5_nexts_kda():
    """``gate_lower_bound`` (-5, GLM-5.3-Flash's safe gate) through the whole layer: a prompt of 150
    in two parts and 40 cached decode steps equal transformers' Glm5NextTextLinearAttention (Kimi's
    KDA with the bounded gate; A_log one per head) with its cache."""
    from types import SimpleNamespace

    from transformers.cache_utils import DynamicCache
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention

    cfg, _, kimi, _ = pair()
    glm = Glm5NextTextLinearAttention(SimpleNamespace(
        hidden_size=D_MODEL, linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4, hidden_act="silu",
        rms_norm_eps=cfg.rms_norm_eps, layer_types=TYPES, linear_lower_bound=-5.0), 0).eval()
    lay = KDA(None, linear_num_heads=4, linear_head_dim=16, gate_lower_bound=-5.0)
    ours = KDAAttention(model_config(cfg), lay).eval()
    ours.load_state_dict(kimi.state_dict())
    with torch.no_grad():
        ours.log_decay_rate.normal_(0.0, 0.5)  # Glm5Next initialises 0 (rates of 1); these differ per head
    mine, theirs = ours.state_dict(), {}  # transformers' names -> kvbench's tensors
    for name, t in glm.state_dict().items():
        if name in KDAAttention.HF_FUSED:  # its one convolution over q, k and v
            theirs[name] = torch.cat([mine[part] for part in KDAAttention.HF_FUSED[name]])
        else:
            (ours_name,) = hf_kda_weights({name: t})
            theirs[name] = mine[ours_name].reshape(t.shape)  # A_log: one per head, (H,) here
    glm.load_state_dict(theirs)
    x = torch.randn(2, 190, D_MODEL)
    parts = [(0, 90), (90, 150)] + [(t, t + 1) for t in range(150, 190)]
    diffs, _ = step_both(glm, DynamicCache(config=cfg), ours, StateLayer(lay.state, 2, torch.float32), x, parts)
    assert len(diffs) == 42 and max(diffs) <= TOL, diffs
    assert glm(x).abs().max() > 0.1


# ---- the rule on its own -----------------------------------------------------------------------

def rule_inputs(T, B=2, H=3, d=8, seed=0, bound=None, rate=0.3):
    """q (normalised, scaled), k (normalised), v, g (< 0 per channel), beta in (0, 1) and a state that
    is not zero, (B, H, T, ...) as the module hands them to the rule."""
    gen = torch.Generator().manual_seed(seed)
    randn = (lambda *shape: torch.randn(*shape, generator=gen))
    q, k = (torch.nn.functional.normalize(randn(B, H, T, d), dim=-1) for _ in range(2))
    f = randn(B, H, T, d)
    g = bound * torch.sigmoid(f) if bound else -rate * torch.nn.functional.softplus(f)
    return q * d ** -0.5, k, randn(B, H, T, d), g, torch.rand(B, H, T, generator=gen), randn(B, H, d, d)


def naive_rule(q, k, v, g, beta, state):
    """The rule as written, float64, one token at a time: S <- diag(exp g) S; S += k (beta (v - S^T k))^T; o = S^T q."""
    q, k, v, g, beta, S = (t.double() for t in (q, k, v, g, beta, state))
    out = []
    for t in range(q.shape[2]):
        S = S * g[:, :, t, :, None].exp()
        delta = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, :, t]))
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, :, t], delta)
        out.append(torch.einsum("bhkv,bhk->bhv", S, q[:, :, t]))
    return torch.stack(out, 2), S


@pytest.mark.parametrize("T,chunk,bound,rate", [
    (1, 8, None, 0.3), (7, 8, None, 0.3), (8, 8, None, 0.3), (9, 8, None, 0.3), (50, 8, None, 0.3),
    (37, 16, -5.0, 0.3), (50, 7, -5.0, 0.3), (64, 64, None, 0.3), (100, 64, None, 0.05), (70, 64, None, 30.0)])
def test_the_chunked_rule_equals_the_recurrent_step_and_a_float64_loop(T, chunk, bound, rate):
    """Lengths that are not multiples of the chunk (and some that are, some of several sub-chunks),
    decays with and without a lower bound, slow ones and fast ones (a chunk decaying by thousands of
    nats, where exp(-G) overflows), from a state that is not zero: the chunked rule's outputs and
    final state equal T recurrent steps' and a float64 loop's."""
    q, k, v, g, beta, state = rule_inputs(T, bound=bound, rate=rate)
    want, want_state = naive_rule(q, k, v, g, beta, state)
    chunked_state, stepped_state = state.clone(), state.clone()
    chunked = chunked_kda(q, k, v, g, beta, chunked_state, chunk)
    stepped = torch.cat([recurrent_kda(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], g[:, :, t:t + 1],
                                       beta[:, :, t:t + 1], stepped_state) for t in range(T)], 2)
    for out, final in ((chunked, chunked_state), (stepped, stepped_state)):
        assert (out.double() - want).abs().max() <= TOL and (final.double() - want_state).abs().max() <= TOL
    assert (want_state - state.double()).abs().max() > 0.1  # the tokens did change the state


@pytest.mark.parametrize("L", [1, 16, 37, 64])
def test_decayed_scores_are_the_per_channel_sum_a_block_of_rows_at_a_time(L):
    """Blocks of 16 rows, the last one short: equal to the (L, L, d) sum transformers forms, in
    float64; zero above the diagonal."""
    gen = torch.Generator().manual_seed(L)
    a, b = torch.randn(2, L, 8, generator=gen, dtype=torch.float64), torch.randn(2, L, 8, generator=gen,
                                                                                dtype=torch.float64)
    G = -torch.rand(2, L, 8, generator=gen, dtype=torch.float64).cumsum(-2)
    want = (a[:, :, None] * b[:, None] * (G[:, :, None] - G[:, None]).exp()).sum(-1).tril()
    assert (decayed_scores(a, b, G) - want).abs().max() <= 1e-12


@torch.no_grad()
def test_the_chunked_rule_works_in_memory_of_a_chunk_whatever_the_length():
    """Beyond its output, the chunked rule's peak of live tensors is the same at 128 and 1,024 tokens
    (within 1.5x): only the state crosses chunks. transformers' chunk_kimi_delta_attention, which
    keeps every chunk's weights at once, grows with T under the same count (the count can see growth)."""
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    work, reference = {}, {}
    for T in (128, 1024):
        q, k, v, g, beta, state = inputs = rule_inputs(T, B=1, H=2, d=8)
        with LiveBytes(*inputs) as count:
            out = chunked_kda(q, k, v, g, beta, state, 32)
        work[T] = count.peak - out.nbytes
        assert count.now == out.nbytes  # nothing but the output outlives the call
        # transformers' layout (B, T, H, d), scaling q itself: its inputs are new tensors, not counted
        theirs = [t.transpose(1, 2).contiguous() for t in (q * 8 ** 0.5, k, v, g, beta)]
        with LiveBytes(*inputs, *theirs) as count:
            out, _ = chunk_kimi_delta_attention(*theirs[:3], g=theirs[3], beta=theirs[4], chunk_size=32,
                                                initial_state=state)
        reference[T] = count.peak - out.nbytes
    assert 0 < work[1024] <= 1.5 * work[128], work
    assert reference[1024] > 4 * reference[128] and reference[1024] > 10 * work[1024], reference


# ---- the state and the layout ------------------------------------------------------------------

def hand_state_bytes(H, d, K, element, state_element):
    # the recurrent state H x d x d in its dtype + the conv's last K - 1 inputs of q, k, v (3 H d) in the compute dtype
    return H * d * d * state_element + (K - 1) * 3 * H * d * element


SHAPES = [(4, 16, 4), (2, 8, 3)]  # (H, d, K)


def layout(H, d, K, state_dtype="float32"):
    return KDA(None, linear_num_heads=H, linear_head_dim=d, linear_conv_kernel_dim=K, state_dtype=state_dtype,
               num_heads=4, head_dim=12, v_head_dim=8)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_state_as_allocated_is_the_formula_and_does_not_grow(dtype, state_dtype):
    """Held bytes per sequence are H·d·d in the state's dtype plus K − 1 inputs of 3·H·d channels in
    the compute dtype, at any length; the cache allocates exactly that, in those dtypes, and a
    prompt and 10 decode steps write it in place."""
    state_element = {"float32": 4, "bfloat16": 2}[state_dtype]
    layers = Layouts(layout(*s, state_dtype) for s in SHAPES)
    per_sequence = sum(hand_state_bytes(*s, dtype.itemsize, state_element) for s in SHAPES)
    check_a_constant_state(layers, per_sequence, sum(7 * H * d * d for H, d, _ in SHAPES),
                           lambda lay: KDAAttention(tiny_model_config(d_model=D_MODEL), lay), run, dtype, state_dtype,
                           D_MODEL)


@torch.no_grad()
def test_a_half_precision_state_follows_the_float32_one():
    """A bfloat16 recurrent state rounds the state between forwards only: over a prompt and 20 steps
    the outputs stay within bfloat16's rounding of a float32 state's."""
    _, _, ours, lay = pair()
    half = layout(4, 16, 4, "bfloat16")
    x = torch.randn(2, 90, D_MODEL)
    outs = []
    for shape in (lay.state, half.state):
        cache = StateLayer(shape, 2, torch.float32)
        outs.append(torch.cat([run(ours, cache, x[:, s:e], s) for s, e in [(0, 70)] + [(t, t + 1)
                                                                                      for t in range(70, 90)]], 1))
    assert 0 < (outs[0] - outs[1]).abs().max() <= 0.05 * outs[0].abs().max()


def test_a_kimi_linear_pays_per_token_only_for_its_latent_layers_and_rotates_nothing():
    cfg = config_json(hf_config())
    kda, mla = kda_from_hf(cfg), kimi_latent_from_hf(cfg)
    layers = Layouts([kda, mla, kda])
    assert layers.bytes_per_token(4) == (16 + 4) * 4  # the latent and the unrotated shared key, float32
    assert layers.cache_bytes(1000, 2, 4) == 2 * (2 * hand_state_bytes(4, 16, 4, 4, 4) + 1000 * 20 * 4)
    assert layers.rotary_dim() == 0 and mla.stored == (1, (20,)) and mla.kind == "latent"
    assert kda.as_mha() == mla.as_mha() == KVHeads(None, 4, 4, 12, v_head_dim=8)
    assert kda.kind == kda.table_name() == "kda" and "state_dtype" not in kda.fields()
    assert layout(4, 16, 4, "bfloat16").fields()["state_dtype"] == "bfloat16"


@pytest.mark.parametrize("fields,key,value", [
    (dict(linear_num_heads=0), "linear_num_heads", 0), (dict(linear_head_dim=16.0), "linear_head_dim", 16.0),
    (dict(chunk_size=True), "chunk_size", True), (dict(state_dtype="int8"), "state_dtype", "int8"),
    (dict(gate_lower_bound=0.5), "gate_lower_bound", 0.5), (dict(gate_lower_bound=-math.inf), "gate_lower_bound",
                                                            -math.inf),
])
def test_a_layout_built_by_hand_is_held_to_the_same_rules(fields, key, value):
    with pytest.raises(ConfigError) as info:
        KDA(None, **fields)
    assert "\n" not in str(info.value) and str(info.value).startswith(f"{key}={value!r}: ")


# ---- config.json and weights -------------------------------------------------------------------

def test_config_json_reads_as_transformers_builds_the_layers():
    """The layouts read from a config.json have the shapes transformers' own modules are built with;
    the parameter count by formula is theirs and kvbench's."""
    cfg, hf, ours, lay = pair()
    assert (lay.linear_num_heads, lay.linear_head_dim, lay.linear_conv_kernel_dim) == (
        hf.num_heads, hf.head_dim, hf.conv_kernel_size) and lay.conv_channels == hf.conv_dim
    count = lay.mixer_params(D_MODEL)
    assert count == sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in ours.parameters())
    assert hf_layer_kinds(config_json(cfg)) == ["kda", "attention", "kda"]
    mla = kimi_latent_from_hf(config_json(cfg))
    assert (mla.num_heads, mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim,
            mla.v_head_dim) == (4, 0, 16, 8, 4, 8)


def test_a_hub_config_json_reads_its_linear_attn_config_as_transformers_does():
    """Kimi's hub files keep the KDA sizes and the 1-indexed kda_layers / full_attn_layers in
    linear_attn_config, which KimiLinearConfig reads before its own keys; without either, layers
    4, 8, … (0-indexed) are full, as its default."""
    from transformers import KimiLinearConfig

    raw = {"architectures": ["KimiLinearForCausalLM"], "num_hidden_layers": 7, "linear_head_dim": 64,
           "linear_attn_config": {"head_dim": 32, "num_heads": 6, "short_conv_kernel_size": 3,
                                  "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4]}}
    cfg = KimiLinearConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    lay = kda_from_hf(raw)
    assert (lay.linear_head_dim, lay.linear_num_heads, lay.linear_conv_kernel_dim) == (
        cfg.linear_head_dim, cfg.linear_num_heads, cfg.linear_conv_kernel_dim) == (32, 6, 3)
    kinds = {"linear_attention": "kda", "full_attention": "attention"}
    assert hf_layer_kinds(raw) == [kinds[t] for t in cfg.layer_types] == ["kda"] * 3 + ["attention"] + ["kda"] * 3
    assert hf_layer_kinds(config_json(cfg)) == hf_layer_kinds(raw)  # as save_pretrained writes it back
    default = KimiLinearConfig(num_hidden_layers=9)
    assert hf_layer_kinds({"num_hidden_layers": 9}) == [kinds[t] for t in default.layer_types]
    assert lay.state.nbytes(2) == 6 * 32 * 32 * 4 + 2 * 3 * 6 * 32 * 2


KIMI = {"architectures": ["KimiLinearForCausalLM"], "num_hidden_layers": 4}


def lists(kda, full):
    return {**KIMI, "linear_attn_config": {"kda_layers": kda, "full_attn_layers": full}}


@pytest.mark.parametrize("cfg,key,value", [
    (lists([1, 2, 5], [3]), "linear_attn_config.kda_layers", [1, 2, 5]),  # past num_hidden_layers
    (lists([0, 1, 2], [4]), "linear_attn_config.kda_layers", [0, 1, 2]),  # 0-indexed by mistake
    (lists([1, 2, 3], [3, 4]), "linear_attn_config.kda_layers", [1, 2, 3]),  # layer 3 in both
    (lists([1, 1, 2], [3, 4]), "linear_attn_config.kda_layers", [1, 1, 2]),  # listed twice
    (lists([1, 2], [4]), "linear_attn_config.kda_layers", [1, 2]),  # layer 3 in neither
    (lists([1, 2, 3], [True]), "linear_attn_config.full_attn_layers", [True]),
    (lists([1, 2, "3"], [4]), "linear_attn_config.kda_layers", [1, 2, "3"]),
    (lists([1, 2, 3], 4), "linear_attn_config.full_attn_layers", 4),
    ({**KIMI, "linear_attn_config": {"kda_layers": [1, 2, 3]}}, "linear_attn_config.kda_layers", [1, 2, 3]),
    ({**KIMI, "linear_attn_config": [1, 2]}, "linear_attn_config", [1, 2]),
    ({**KIMI, "layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]}, "layer_types",
     ["linear_attention", "mamba", "linear_attention", "full_attention"]),
    ({**KIMI, "layer_types": ["linear_attention"]}, "layer_types", ["linear_attention"]),
    ({**KIMI, "num_hidden_layers": 0}, "num_hidden_layers", 0),
])
def test_layer_lists_it_cannot_read_are_refused_in_one_line_naming_the_key(cfg, key, value):
    with pytest.raises(ConfigError) as info:
        hf_layer_kinds(cfg)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{key}={value!r}: "), message


@pytest.mark.parametrize("cfg,key,value", [
    ({**KIMI, "linear_attn_config": {"head_dim": 0}}, "linear_attn_config.head_dim", 0),
    ({**KIMI, "linear_attn_config": {"num_heads": "32"}}, "linear_attn_config.num_heads", "32"),
    ({**KIMI, "linear_attn_config": {"short_conv_kernel_size": True}}, "linear_attn_config.short_conv_kernel_size",
     True),
    ({**KIMI, "linear_num_heads": 2.5}, "linear_num_heads", 2.5),
    ({**KIMI, "hidden_act": "gelu"}, "hidden_act", "gelu"),
    ({**KIMI, "qk_nope_head_dim": -1}, "qk_nope_head_dim", -1),
    ({"architectures": ["DeepseekV3ForCausalLM"]}, "architectures", ["DeepseekV3ForCausalLM"]),
])
def test_a_config_json_it_cannot_run_is_refused_in_one_line_naming_the_key(cfg, key, value):
    with pytest.raises(ConfigError) as info:
        kda_from_hf(cfg)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{key}={value!r}: "), message


@pytest.mark.parametrize("cfg,key,value", [({**KIMI, "attention_bias": True}, "attention_bias", True),
                                           ({**KIMI, "num_key_value_heads": 8}, "num_key_value_heads", 8),
                                           ({**KIMI, "kv_lora_rank": 0}, "kv_lora_rank", 0),
                                           ({**KIMI, "q_lora_rank": "64"}, "q_lora_rank", "64")])
def test_full_layers_it_cannot_run_are_refused_in_one_line_naming_the_key(cfg, key, value):
    with pytest.raises(ConfigError) as info:
        kimi_latent_from_hf(cfg)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{key}={value!r}: "), message


def test_a_tensor_that_is_not_the_layers_is_refused_by_name():
    _, hf, _, _ = pair()
    assert hf.forget_gate.A_log.shape == (1, 1, 4, 1)
    assert hf_kda_weights(hf.state_dict())["log_decay_rate"].shape == (1, 1, 4, 1)  # as Kimi's files hold it
    # transformers' one convolution over q, k, v as kvbench's three (Kimi's files hold three)
    parts = hf_kda_weights({"conv1d.weight": hf.conv1d.weight})
    assert torch.equal(torch.cat([parts[k] for k in ("q_conv.weight", "k_conv.weight", "v_conv.weight")]),
                       hf.conv1d.weight)
    with pytest.raises(ValueError, match=r"^in_proj_qkv.weight: not a KDA tensor"):
        hf_kda_weights({"in_proj_qkv.weight": torch.zeros(1)})


# ---- Kimi Linear's full layers and a whole model -----------------------------------------------

def latent_weights(hf_attention) -> dict:
    """transformers' KimiLinearAttention tensors under LatentAttention's names."""
    names = LatentAttention.HF_NAMES
    return {names[name.split(".")[0] + "."] + name.split(".", 1)[1]: t for name, t in hf_attention.state_dict().items()}


def causal_mask(start, T):
    """transformers' additive mask of T queries from ``start`` over start + T keys."""
    seen = torch.arange(start + T)[None] <= torch.arange(start, start + T)[:, None]
    return torch.zeros(seen.shape).masked_fill(~seen, -torch.inf)[None, None]


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
@torch.no_grad()
def test_the_full_layers_equal_transformers_latent_attention_without_rotation(form):
    """Kimi Linear's full layer (KimiLinearAttention: MLA whose shared key part is never rotated) as
    kvbench's latent attention handed any rotary tables: a prompt in two parts and 40 cached decode
    steps (both decode forms) equal transformers' with its cache; DeepSeek's rotating module, handed
    real tables, does not."""
    from transformers import KimiLinearForCausalLM
    from transformers.cache_utils import DynamicCache

    from kvbench.rope import rope_tables

    torch.manual_seed(0)
    cfg = hf_config()
    hf = KimiLinearForCausalLM(cfg).model.layers[1].self_attn.eval()
    lay = kimi_latent_from_hf(config_json(cfg))
    ours = LatentAttention(model_config(cfg), lay).eval()
    ours.load_state_dict(latent_weights(hf))
    ours.form = form
    cos, sin = rope_tables(model_config(cfg), 4)
    x, kv = torch.randn(2, 110, D_MODEL), DynamicCache(config=cfg)
    cache = layer_cache(lay, "static", 2, 256, torch.float32, torch.device("cpu"))
    for start, end in [(0, 50), (50, 70)] + [(t, t + 1) for t in range(70, 110)]:
        want, _ = hf(x[:, start:end], causal_mask(start, end - start), cache=kv)
        got = ours(x[:, start:end], cos[start:end], sin[start:end], cache, Positions(start, end - start))
        assert (want - got).abs().max() <= TOL, start
    rotating = LatentAttention(model_config(cfg), replace(lay, rotary=True)).eval()  # the same shape, rotated
    rotating.load_state_dict(ours.state_dict())
    fresh = layer_cache(lay, "static", 2, 256, torch.float32, torch.device("cpu"))
    want = hf(x, causal_mask(0, 110))[0]
    assert (rotating(x, cos[:110], sin[:110], fresh, Positions(0, 110)) - want).abs().max() > 1e-3
    # the decoder of a model that rotates nothing (Layouts.rotary_dim() 0) hands tables of width 0:
    # DeepSeek's module then equals Kimi's too
    fresh = layer_cache(lay, "static", 2, 256, torch.float32, torch.device("cpu"))
    empty = torch.ones(110, 0)
    assert (rotating(x, empty, empty, fresh, Positions(0, 110)) - want).abs().max() <= TOL


@torch.no_grad()
def test_a_kimi_linear_greedy_decodes_40_tokens_as_transformers_generate():
    """A Kimi Linear of layers KDA, full, KDA (each: norm, attention, residual, norm, MLP, residual)
    with kvbench's KDA modules and state caches and its latent attention without rotation and static
    latent cache in place of transformers' attentions: 40 greedy tokens after a 23-token prompt equal
    transformers' generate (its chunked prefill, then cached recurrent steps), every step's logits
    within TOL."""
    from transformers import KimiLinearForCausalLM

    torch.manual_seed(1)
    cfg = hf_config()
    model = KimiLinearForCausalLM(cfg).eval()
    kda, mla = kda_from_hf(config_json(cfg)), kimi_latent_from_hf(config_json(cfg))
    mc = model_config(cfg)
    layers = []  # (transformers' layer, kvbench's attention, its cache)
    for layer, kind in zip(model.model.layers, hf_layer_kinds(config_json(cfg))):
        if kind == "kda":
            attention, cache = KDAAttention(mc, kda), StateLayer(kda.state, 2, torch.float32)
            attention.load_state_dict(hf_kda_weights(layer.self_attn.state_dict()))
        else:
            attention, cache = LatentAttention(mc, mla), layer_cache(mla, "static", 2, 256, torch.float32,
                                                                          torch.device("cpu"))
            attention.load_state_dict(latent_weights(layer.self_attn))
        layers.append((layer, attention.eval(), cache))

    def last_logits(ids, start):
        h = model.model.embed_tokens(ids)
        for layer, attention, cache in layers:
            h = h + run(attention, cache, layer.input_layernorm(h), start)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return model.lm_head(model.model.norm(h))[:, -1]

    prompt = torch.randint(3, 97, (2, 23))
    want = model.generate(prompt, max_new_tokens=40, min_new_tokens=40, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
    tokens = greedy_steps(last_logits, prompt, want, TOL)
    assert len(set(tokens[0].tolist())) > 3  # not one token repeated
