"""Mamba-2 layers (kvbench.layouts.mamba2, kvbench.layouts.mamba2_mixer): exact against the mamba
mixers of transformers' own NemotronH and GraniteMoeHybrid models (tiny random configs, float32) in
prefill and over cached decode steps; the chunked scan against the recurrent step and a float64
loop of the recurrence; the chunked scan's working memory against the prompt's length (and
transformers' scan, which grows with it); the state's bytes against a hand formula; config.json
reading against transformers' config classes; what the layer refuses, in one line."""


import pytest
import torch
from conftest import tiny_model_config
from recurrent_checks import LiveBytes, check_a_constant_state, check_parts_then_steps, greedy_steps, run, step_both

from kvbench.core.errors import ConfigError
from kvbench.layouts.base import Layouts
from kvbench.layouts.kv_heads import KVHeads
from kvbench.layouts.mamba2 import Mamba2, hf_layer_kinds, mamba2_from_hf
from kvbench.layouts.mamba2_mixer import (
    Mamba2Mixer,
    chunked_scan,
    hf_mixer_weights,
    recurrent_step,
)
from kvbench.state_cache import StateLayer

TOL = 1e-5
D_MODEL = 64
# Nemotron-H: 8 heads of 8 in 2 groups, state 16, kernel 4, chunks of 16, biases on in/out_proj.
# Granite: 8 heads of 16 (mamba_d_head "auto": expand 2 x 64 / 8) in 1 group, state 12, kernel 3, chunks of 24.
FAMILIES = {
    "nemotron_h": dict(hybrid_override_pattern="M*-M", mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16,
                       n_groups=2, conv_kernel=4, chunk_size=16, use_bias=True),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention", "linear_attention"], mamba_n_heads=8,
                             mamba_n_groups=1, mamba_d_state=12, mamba_d_conv=3, mamba_chunk_size=24,
                             mamba_expand=2, mamba_proj_bias=False, num_hidden_layers=3),
}
ARCHITECTURES = {"nemotron_h": "NemotronHForCausalLM", "granitemoehybrid": "GraniteMoeHybridForCausalLM"}


# transformers' warnings off: it falls back to the torch path compared with (conftest.quiet_transformers)
pytestmark = pytest.mark.usefixtures("quiet_transformers")


def hf_config(family, **overrides):
    from transformers import GraniteMoeHybridConfig, NemotronHConfig

    common = dict(vocab_size=97, hidden_size=D_MODEL, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, initializer_range=0.1)
    if family == "nemotron_h":
        return NemotronHConfig(**common, head_dim=16, **{**FAMILIES[family], **overrides})
    return GraniteMoeHybridConfig(**common, shared_intermediate_size=96, num_local_experts=0,
                                  **{**FAMILIES[family], **overrides})


def config_json(cfg) -> dict:
    """What a checkpoint's config.json holds for ``cfg`` (to_dict, as save_pretrained writes it)."""
    return {**cfg.to_dict(), "architectures": [ARCHITECTURES[cfg.model_type]]}


def pair(family, seed=0, **overrides):
    """transformers' mixer of the model's first layer (random weights: decays slow enough that the
    state carries across chunks and steps, dt biases, D and norm weights off their initial values)
    and kvbench's, loaded from its tensors by their transformers names."""
    from transformers import GraniteMoeHybridForCausalLM, NemotronHForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(family, **overrides)
    model = {"nemotron_h": NemotronHForCausalLM, "granitemoehybrid": GraniteMoeHybridForCausalLM}[family](cfg)
    layer = model.model.layers[0]
    hf = (layer.mixer if family == "nemotron_h" else layer.mamba).eval()
    H = hf.num_heads
    with torch.no_grad():
        hf.A_log.copy_(torch.empty(H).uniform_(0.01, 0.3).log())
        hf.dt_bias.normal_()
        hf.D.normal_()
        hf.norm.weight.normal_(1.0, 0.3)
    lay = mamba2_from_hf(config_json(cfg))
    eps = cfg.layer_norm_epsilon if family == "nemotron_h" else cfg.rms_norm_eps
    ours = Mamba2Mixer(tiny_model_config(d_model=D_MODEL, norm_eps=eps), lay).eval()
    ours.load_state_dict(hf_mixer_weights(hf.state_dict()))
    return cfg, hf, ours, lay




@pytest.mark.parametrize("T", [1, 75, 200])
@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_a_prompt_equals_transformers(family, T):
    """Prompts of one token, of 75 (not a multiple of either chunk) and 200 (more than eight chunks
    of 16 or 24): kvbench's chunked scan, a chunk at a time, equals transformers' torch path, all
    chunks at once."""
    _, hf, ours, lay = pair(family)
    x = torch.randn(2, T, D_MODEL)
    want = hf(x)
    got = run(ours, StateLayer(lay.state, 2, torch.float32), x, 0)
    assert (want - got).abs().max().item() <= TOL
    assert want.abs().max() > 0.1  # the comparison is not between zeros




@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_prefill_then_40_decode_steps_equal_transformers_and_one_prefill(family):
    """A prompt of 70 tokens in two parts (50, then 20 from the held state: neither a multiple of the
    chunk), then 40 recurrent decode steps: each equals transformers' module with its own cache (its
    chunked scan from an initial state, its selective_state_update), and all 110 outputs equal one
    prefill of the 110 tokens, kvbench's and transformers'."""
    cfg, hf, ours, lay = pair(family)
    x = torch.randn(2, 110, D_MODEL)
    check_parts_then_steps(cfg, hf, ours, lay.state, x, [(0, 50), (50, 70)], TOL)


@torch.no_grad()
def test_a_nemotron_h_greedy_decodes_40_tokens_as_transformers_generate():
    """A Nemotron-H of blocks M * M (each block: norm, mixer, residual) with kvbench's Mamba-2
    mixers and state caches in place of transformers' (its attention block kept, with its own K/V
    cache: transformers cannot cache a model of mamba layers only): 40 greedy tokens after a 23-token
    prompt equal transformers' generate (its chunked prefill, then cached recurrent steps), every
    step's logits within TOL."""
    from transformers import NemotronHForCausalLM
    from transformers.cache_utils import DynamicCache

    torch.manual_seed(1)
    cfg = hf_config("nemotron_h", hybrid_override_pattern="M*M")
    model = NemotronHForCausalLM(cfg).eval()
    lay = mamba2_from_hf(config_json(cfg))
    ours = {}  # block index -> (mixer, its state cache)
    for i, block in enumerate(model.model.layers):
        if block.block_type == "linear_attention":
            block.mixer.A_log.copy_(torch.empty(8).uniform_(0.01, 0.3).log())
            block.mixer.dt_bias.normal_()
            mixer = Mamba2Mixer(tiny_model_config(d_model=D_MODEL, norm_eps=cfg.layer_norm_epsilon), lay).eval()
            mixer.load_state_dict(hf_mixer_weights(block.mixer.state_dict()))
            ours[i] = mixer, StateLayer(lay.state, 2, torch.float32)
    kv = DynamicCache(config=cfg)

    def last_logits(ids, start):
        h = model.model.embeddings(ids)
        for i, block in enumerate(model.model.layers):
            x = block.norm(h)
            h = h + (run(ours[i][0], ours[i][1], x, start) if i in ours else block.mixer(x, cache=kv)[0])
        return model.lm_head(model.model.norm_f(h))[:, -1]

    prompt = torch.randint(0, 97, (2, 23))
    want = model.generate(prompt, max_new_tokens=40, min_new_tokens=40, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
    tokens = greedy_steps(last_logits, prompt, want, TOL)
    assert len(set(tokens[0].tolist())) > 3  # not one token repeated


@torch.no_grad()
def test_the_time_step_clamp_binds_in_the_prompt_only_as_in_transformers():
    """dt biases of -9 put softplus(dt) under Nemotron-H's time_step_min (0.001): transformers
    clamps dt to it in the chunked scan and not in the decode step (mamba_ssm's step has no clamp).
    kvbench does the same, so both paths still equal transformers' over a prompt and 10 steps."""
    from transformers.cache_utils import DynamicCache

    cfg, hf, ours, lay = pair("nemotron_h")
    with torch.no_grad():
        for module, name in ((hf, "dt_bias"), (ours, "step_bias")):
            getattr(module, name).fill_(-9.0)
    assert lay.time_step_limit == (0.001, float("inf"))
    x = torch.randn(2, 40, D_MODEL)
    cache = StateLayer(lay.state, 2, torch.float32)
    diffs, outputs = step_both(hf, DynamicCache(config=cfg), ours, cache, x, [(0, 30)] + [(t, t + 1)
                                                                                         for t in range(30, 40)])
    assert max(diffs) <= TOL, diffs
    # the clamp did bind: a prefill of all 40 (clamped throughout) differs from the steps (unclamped)
    assert (run(ours, StateLayer(lay.state, 2, torch.float32), x, 0) - outputs)[:, 30:].abs().max() > 1e-4


@torch.no_grad()
def test_a_forward_without_a_cache_starts_from_zero_state():
    """A cache that holds nothing (cache.impl=none): each forward is the whole sequence from a zero
    state, transformers' forward without a cache, and nothing is kept."""
    _, hf, ours, lay = pair("granitemoehybrid")
    x = torch.randn(2, 50, D_MODEL)
    cache = StateLayer(lay.state, 0, torch.float32, held=False)
    for _ in range(2):
        assert (hf(x) - run(ours, cache, x, 0)).abs().max().item() <= TOL
    assert cache.tensors() == [] and cache.nbytes == 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gradients_equal_transformers(family):
    """A training step's gradients (task=train) through the chunked scan, a chunk at a time, equal
    those through transformers' torch path for every parameter."""
    _, hf, ours, lay = pair(family)
    x = torch.randn(2, 50, D_MODEL)
    hf(x).pow(2).sum().backward()
    run(ours.train(), StateLayer(lay.state, 0, torch.float32, held=False), x, 0).pow(2).sum().backward()
    theirs, mine = hf_mixer_weights(dict(hf.named_parameters())), dict(ours.named_parameters())
    assert sorted(theirs) == sorted(mine)
    for name, want in theirs.items():
        assert (mine[name].grad - want.grad).abs().max() <= 1e-5 * want.grad.abs().max(), name


@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_in_bfloat16_a_prompt_rounds_as_transformers_and_steps_within_an_ulp_or_two(family):
    """In bfloat16 a prompt equals transformers' within one rounding of the output (both scan in
    float32). transformers' torch decode step rounds dt·B·x and the state to bfloat16 before reading
    it; kvbench's, as mamba_ssm's kernel, stays in float32 inside, so a step differs by a rounding or two."""
    from transformers.cache_utils import DynamicCache

    cfg, hf, ours, lay = pair(family)
    hf, ours = hf.to(torch.bfloat16), ours.to(torch.bfloat16)
    x = torch.randn(2, 60, D_MODEL, dtype=torch.bfloat16)
    cache = StateLayer(lay.state, 2, torch.bfloat16)
    hf_cache = DynamicCache(config=cfg)
    for start, end in [(0, 40)] + [(t, t + 1) for t in range(40, 60)]:
        want, got = hf(x[:, start:end], cache=hf_cache).float(), run(ours, cache, x[:, start:end], start).float()
        ulp = 2.0 ** -7 * want.abs().max()
        assert (want - got).abs().max() <= (ulp if start == 0 else 4 * ulp), start


# ---- the scan on its own ---------------------------------------------------------------------

def scan_inputs(T, B=2, H=6, P=5, G=3, N=4, seed=0):
    """x, dt (before its softplus), A, B, C, D, dt_bias and a state that is not zero."""
    gen = torch.Generator().manual_seed(seed)
    randn = (lambda *shape: torch.randn(*shape, generator=gen))
    return (randn(B, T, H, P), randn(B, T, H), -torch.rand(H, generator=gen) * 0.5, randn(B, T, G, N),
            randn(B, T, G, N), randn(H), randn(H), randn(B, H, P, N))


def naive_scan(x, dt, A, B, C, D, dt_bias, state):
    """The recurrence as written, float64, one token at a time: S <- exp(A dt) S + dt x B^T; y = S C + D x."""
    x, dt, A, B, C, D, dt_bias, S = (t.double() for t in (x, dt, A, B, C, D, dt_bias, state))
    dt = torch.nn.functional.softplus(dt + dt_bias)
    R = x.shape[2] // B.shape[2]
    B, C = B.repeat_interleave(R, 2), C.repeat_interleave(R, 2)
    out = []
    for t in range(x.shape[1]):
        S = S * (A * dt[:, t]).exp()[..., None, None] + torch.einsum("bh,bhp,bhn->bhpn", dt[:, t], x[:, t], B[:, t])
        out.append(torch.einsum("bhpn,bhn->bhp", S, C[:, t]) + D[:, None] * x[:, t])
    return torch.stack(out, 1), S


@pytest.mark.parametrize("T,chunk", [(1, 8), (7, 8), (8, 8), (9, 8), (50, 8), (37, 16), (50, 7), (64, 64)])
def test_the_chunked_scan_equals_the_recurrent_step_and_a_float64_loop(T, chunk):
    """Lengths that are not multiples of the chunk (and some that are), heads sharing groups (6 in 3),
    from a state that is not zero: the chunked scan's outputs and final state equal T recurrent
    steps' and a float64 loop's."""
    x, dt, A, B, C, D, bias, state = scan_inputs(T)
    want, want_state = naive_scan(x, dt, A, B, C, D, bias, state)
    chunked_state, stepped_state = state.clone(), state.clone()
    chunked = chunked_scan(x, dt, A, B, C, D, bias, chunked_state, chunk)
    stepped = torch.cat([recurrent_step(x[:, t:t + 1], dt[:, t:t + 1], A, B[:, t:t + 1], C[:, t:t + 1], D, bias,
                                        stepped_state) for t in range(T)], 1)
    for out, final in ((chunked, chunked_state), (stepped, stepped_state)):
        assert (out.double() - want).abs().max() <= TOL and (final.double() - want_state).abs().max() <= TOL
    assert (want_state - state.double()).abs().max() > 0.1  # the tokens did change the state


@torch.no_grad()
def test_the_chunked_scan_works_in_memory_of_a_chunk_whatever_the_length():
    """Beyond its output (B, T, H, P), the chunked scan's peak of live tensors is the same at 256 and
    2,048 tokens (within 1.5x): only the state crosses chunks. transformers' scan, the reference that
    keeps every chunk's weights and states at once, grows with T under the same count (the count
    can see growth)."""
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    work, reference = {}, {}
    for T in (256, 2048):
        x, dt, A, B, C, D, bias, state = inputs = scan_inputs(T, B=1, H=4, P=8, G=2, N=16)
        with LiveBytes(*inputs) as count:
            out = chunked_scan(x, dt, A, B, C, D, bias, state, 32)
        work[T] = count.peak - out.nbytes
        assert count.now == out.nbytes  # nothing but the output outlives the call
        with LiveBytes(*inputs) as count:
            out = mamba2_chunk_scan(x, dt, A, B, C, 32, D=D, dt_bias=bias, dt_softplus=True)
        reference[T] = count.peak - out.nbytes
    assert 0 < work[2048] <= 1.5 * work[256], work
    assert reference[2048] > 4 * reference[256] and reference[2048] > 10 * work[2048], reference


# ---- the state and the layout ----------------------------------------------------------------

def hand_state_bytes(H, P, N, G, K, element, state_element):
    # the SSM state H x P x N in its dtype + the conv's last K - 1 inputs of x, B, C (H P + 2 G N) in the compute dtype
    return H * P * N * state_element + (K - 1) * (H * P + 2 * G * N) * element


SHAPES = [(8, 8, 16, 2, 4), (4, 16, 12, 1, 3)]  # (H, P, N, G, K)


def layout(H, P, N, G, K, state_dtype="float32"):
    return Mamba2(None, mamba_num_heads=H, mamba_head_dim=P, ssm_state_size=N, n_groups=G, conv_kernel=K,
                  chunk_size=16, state_dtype=state_dtype, num_heads=4, head_dim=16)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_state_as_allocated_is_the_formula_and_does_not_grow(dtype, state_dtype):
    """Held bytes per sequence are H·P·N in the state's dtype plus K − 1 inputs of H·P + 2·G·N
    channels in the compute dtype, at any length; the cache allocates exactly that, in those dtypes,
    and a prompt and 10 decode steps write it in place."""
    state_element = {"float32": 4, "bfloat16": 2}[state_dtype]
    layers = Layouts(layout(*s, state_dtype) for s in SHAPES)
    per_sequence = sum(hand_state_bytes(*s, dtype.itemsize, state_element) for s in SHAPES)
    check_a_constant_state(layers, per_sequence, sum(5 * H * P * N for H, P, N, _, _ in SHAPES),
                           lambda lay: Mamba2Mixer(tiny_model_config(d_model=D_MODEL), lay), run, dtype, state_dtype,
                           D_MODEL)


@torch.no_grad()
def test_a_half_precision_state_follows_the_float32_one():
    """A bfloat16 SSM state (mamba_ssm_cache_dtype) rounds the state between forwards only: over a
    prompt and 20 steps the outputs stay within bfloat16's rounding of a float32 state's."""
    _, _, ours, lay = pair("nemotron_h")
    half = layout(8, 8, 16, 2, 4, "bfloat16")
    x = torch.randn(2, 60, D_MODEL)
    outs = []
    for shape in (lay.state, half.state):
        cache = StateLayer(shape, 2, torch.float32)
        outs.append(torch.cat([run(ours, cache, x[:, s:e], s) for s, e in [(0, 40)] + [(t, t + 1)
                                                                                      for t in range(40, 60)]], 1))
    scale = outs[0].abs().max()
    assert 0 < (outs[0] - outs[1]).abs().max() <= 0.05 * scale


def test_a_hybrid_pays_per_token_only_for_its_attention_layers():
    mamba, full = layout(*SHAPES[0]), KVHeads(None, 4, 2, 16)
    layers = Layouts([mamba, full, mamba])
    per_token = 2 * 2 * 16 * 4  # K and V, 2 heads of 16, float32
    assert layers.bytes_per_token(4) == per_token
    assert layers.cache_bytes(1000, 2, 4) == 2 * (2 * hand_state_bytes(*SHAPES[0], 4, 4) + 1000 * per_token)
    assert layers.rotary_dim() == 16 and Layouts([mamba]).rotary_dim() == 0
    assert mamba.as_mha() == KVHeads(None, 4, 4, 16)
    assert mamba.kind == mamba.table_name() == "mamba2" and "mamba_ssm_cache_dtype" not in mamba.fields()
    assert layout(*SHAPES[0], "bfloat16").fields()["mamba_ssm_cache_dtype"] == "bfloat16"


@pytest.mark.parametrize("fields,key,value", [
    (dict(mamba_num_heads=0), "mamba_num_heads", 0), (dict(ssm_state_size=16.0), "ssm_state_size", 16.0),
    (dict(chunk_size=True), "chunk_size", True), (dict(mamba_num_heads=8, n_groups=3), "n_groups", 3),
    (dict(state_dtype="int8"), "mamba_ssm_cache_dtype", "int8"),
    (dict(time_step_limit=(0.5, 0.1)), "time_step_limit", [0.5, 0.1]),
])
def test_a_layout_built_by_hand_is_held_to_the_same_rules(fields, key, value):
    with pytest.raises(ConfigError) as info:
        Mamba2(None, **fields)
    assert "\n" not in str(info.value) and str(info.value).startswith(f"{key}={value!r}: ")


# ---- config.json and weights -----------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_config_json_reads_as_transformers_builds_the_mixer(family):
    """The layout read from a config.json has the shape transformers' own mixer is built with."""
    cfg, hf, ours, lay = pair(family)
    assert (lay.mamba_num_heads, lay.mamba_head_dim, lay.ssm_state_size, lay.n_groups, lay.conv_kernel,
            lay.chunk_size) == (hf.num_heads, hf.head_dim, hf.ssm_state_size, hf.n_groups, hf.conv_kernel_size,
                                hf.chunk_size)
    assert lay.time_step_limit == tuple(hf.time_step_limit) and lay.conv_channels == hf.conv_dim
    assert lay.conv_bias == (hf.conv1d.bias is not None) and lay.proj_bias == (hf.in_proj.bias is not None)
    count = lay.mixer_params(D_MODEL)
    assert count == sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in ours.parameters())
    assert hf_layer_kinds(config_json(cfg)) == [{"linear_attention": "mamba", "full_attention": "attention"}.get(t, t)
                                                for t in cfg.layers_block_type]


def test_nemotron_h_reads_its_pattern_and_older_names_as_transformers_does():
    """A hub config.json writes Nemotron-H's layers as hybrid_override_pattern and may use the
    mamba_* names, which transformers' NemotronHConfig lets win over the newer ones."""
    from transformers import NemotronHConfig

    raw = {"architectures": ["NemotronHForCausalLM"], "hybrid_override_pattern": "M-M*ME", "mamba_num_heads": 8,
           "mamba_head_dim": 4, "n_groups": 8, "mamba_n_groups": 4, "conv_kernel": 3, "mamba_d_conv": 2,
           "mamba_chunk_size": 32, "mamba_dt_min": 0.01, "mamba_ssm_cache_dtype": "bfloat16"}
    cfg = NemotronHConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    lay = mamba2_from_hf(raw)
    assert (lay.n_groups, lay.conv_kernel, lay.chunk_size, lay.time_step_limit[0]) == (
        cfg.n_groups, cfg.conv_kernel, cfg.chunk_size, cfg.time_step_min) == (4, 2, 32, 0.01)
    assert lay.state_dtype == "bfloat16" and lay.state.nbytes(2) == 8 * 4 * 128 * 2 + 1 * (32 + 2 * 4 * 128) * 2
    assert hf_layer_kinds(raw) == ["mamba", "mlp", "mamba", "attention", "mamba", "moe"]
    assert hf_layer_kinds(raw) == hf_layer_kinds(config_json(cfg))


def test_granite_reads_the_older_layer_type_names_as_transformers_does():
    """Granite 4's hub files name layers mamba / attention; transformers reads them as its
    linear_attention / full_attention (and a mamba layer_type is a Mamba-2 layer there, not a Gated
    DeltaNet one)."""
    from transformers import GraniteMoeHybridConfig

    raw = {"architectures": ["GraniteMoeHybridForCausalLM"], "num_hidden_layers": 4, "hidden_size": 64,
           "mamba_n_heads": 8, "layer_types": ["mamba", "attention", "mamba", "mamba"]}
    cfg = GraniteMoeHybridConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    assert hf_layer_kinds(raw) == hf_layer_kinds(config_json(cfg)) == ["mamba", "attention", "mamba", "mamba"]
    assert mamba2_from_hf(raw).mamba_head_dim == cfg.mamba_d_head == 16


NEMOTRON = {"architectures": ["NemotronHForCausalLM"], "mamba_num_heads": 8, "mamba_head_dim": 4}
GRANITE = {"architectures": ["GraniteMoeHybridForCausalLM"], "hidden_size": 64, "mamba_n_heads": 8}


@pytest.mark.parametrize("cfg,key,value", [
    ({**NEMOTRON, "n_groups": 3}, "n_groups", 3),
    ({**NEMOTRON, "mamba_n_groups": 0}, "mamba_n_groups", 0),
    ({**NEMOTRON, "ssm_state_size": "128"}, "ssm_state_size", "128"),
    ({**NEMOTRON, "chunk_size": True}, "chunk_size", True),
    ({**NEMOTRON, "mamba_hidden_act": "gelu"}, "mamba_hidden_act", "gelu"),
    ({**NEMOTRON, "time_step_min": -0.5}, "time_step_min", -0.5),
    ({**NEMOTRON, "mamba_ssm_cache_dtype": "int4"}, "mamba_ssm_cache_dtype", "int4"),
    ({**GRANITE, "mamba_d_head": 5}, "mamba_d_head", 5),
    ({**GRANITE, "mamba_d_head": "big"}, "mamba_d_head", "big"),
    ({**GRANITE, "time_step_limit": [0.5]}, "time_step_limit", [0.5]),
    ({**GRANITE, "time_step_limit": [1.0, 0.5]}, "time_step_limit", [1.0, 0.5]),
    ({**GRANITE, "mamba_conv_bias": "yes"}, "mamba_conv_bias", "yes"),
    ({"architectures": ["LlamaForCausalLM"]}, "architectures", ["LlamaForCausalLM"]),
])
def test_a_config_json_it_cannot_run_is_refused_in_one_line_naming_the_key(cfg, key, value):
    with pytest.raises(ConfigError) as info:
        mamba2_from_hf(cfg)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{key}={value!r}: "), message


@pytest.mark.parametrize("cfg,key", [({"hybrid_override_pattern": "MX*"}, "hybrid_override_pattern"),
                                     ({"layer_types": ["mamba", "dense"]}, "layer_types"),
                                     ({"layers_block_type": "M*"}, "layers_block_type")])
def test_a_layer_pattern_it_cannot_read_is_refused_naming_the_key(cfg, key):
    with pytest.raises(ConfigError, match=rf"^{key}=") as info:
        hf_layer_kinds(cfg)
    assert "\n" not in str(info.value)


def test_a_tensor_that_is_not_the_mixers_is_refused_by_name():
    names = ["in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D",
             "norm.weight", "out_proj.weight", "out_proj.bias"]
    mapped = hf_mixer_weights({name: torch.zeros(1) for name in names})
    assert sorted(mapped) == sorted(["w_in.weight", "w_in.bias", "conv.weight", "conv.bias", "step_bias",
                                     "log_decay_rate", "skip", "norm.weight", "wo.weight", "wo.bias"])
    with pytest.raises(ValueError, match=r"^q_proj.weight: not a Mamba-2 mixer tensor"):
        hf_mixer_weights({"q_proj.weight": torch.zeros(1)})
