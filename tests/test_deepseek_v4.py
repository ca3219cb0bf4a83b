"""DeepSeek-V4 layers (kvbench.layouts.compressed, kvbench.layouts.compressed_attention): exact
against the attention of transformers' own DeepseekV4ForCausalLM (tiny random configs with all
three layer kinds, float32) over a prompt that is not a multiple of any rate and 40 cached decode
steps that cross compression boundaries, inside the model (each layer's inputs as transformers'
generate feeds them) and as the whole model's greedy tokens; the bytes a cache allocates, holds
and a step reads against hand formulas and transformers' own cache; config.json reading against
transformers' DeepseekV4Config; what the layout refuses, in one line."""

from contextlib import contextmanager
from fractions import Fraction

import pytest
import torch
from conftest import tiny_model_config
from recurrent_checks import greedy_steps
from torch import nn

from kvbench.blocks.hyper_connection import HyperConnection, HyperHead, expand, residual
from kvbench.cache import Positions
from kvbench.core.errors import ConfigError
from kvbench.layouts.base import Layouts, check_limits
from kvbench.layouts.compressed import (
    CSA,
    HCA,
    SLIDING,
    Compressed,
    compress_rates,
    compressed_from_hf,
    v4_layer_types,
    v4_mlp_layer_types,
)
from kvbench.layouts.compressed_attention import CompressedAttention, CompressedCache

TOL = 1e-5
D_MODEL = 64
KINDS = [SLIDING, CSA, HCA]
# 4 heads of 32 (rope on the last 8), q LoRA 24, output LoRA 2 groups of 16, window 6, CSA m = 4 with
# 16 indexer heads of 16 keeping the top 3, HCA m' = 8 (small enough to close windows in a test),
# hyper-connections of 2 streams, 4 experts (a hash-routed layer, then learned routing)
SHAPE = dict(vocab_size=97, hidden_size=D_MODEL, moe_intermediate_size=32, num_attention_heads=4, head_dim=32,
             q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=4, sliding_window=6, hc_mult=2, o_groups=2,
             o_lora_rank=16, index_n_heads=16, index_head_dim=16, index_topk=3, partial_rotary_factor=0.25,
             initializer_range=0.1, num_hidden_layers=3, layer_types=KINDS, mlp_layer_types=["hash_moe", "moe", "moe"],
             compress_rates={CSA: 4, HCA: 8})


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """torch on one thread (the module's fixtures too): these tensors are tiny, and on shared cores
    more threads cost twenty times the time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# transformers' warnings off: it falls back to the torch path compared with (conftest.quiet_transformers)
pytestmark = pytest.mark.usefixtures("quiet_transformers")


def config_json(cfg) -> dict:
    """What a checkpoint's config.json holds for ``cfg`` (to_dict, as save_pretrained writes it)."""
    return {**cfg.to_dict(), "architectures": ["DeepseekV4ForCausalLM"]}


def hf_model(seed=0, **overrides):
    """transformers' model with random weights, the ones it starts at zero or one (sinks, position
    biases, norm weights, the hash table) moved off them, so that each one counts."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**{**SHAPE, **overrides})
    model = DeepseekV4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                p.normal_()
            elif name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
        for layer in model.model.layers:
            if layer.mlp.is_hash:
                layer.mlp.gate.tid2eid.copy_(torch.randint(0, 4, layer.mlp.gate.tid2eid.shape))
    return cfg, model


def ours_for(cfg, model, i):
    """kvbench's attention for layer ``i``, loaded from transformers' tensors by their own names."""
    lay = compressed_from_hf(config_json(cfg))[i]
    ours = CompressedAttention(tiny_model_config(d_model=D_MODEL, norm_eps=cfg.rms_norm_eps), lay).eval()
    ours.load_state_dict(model.model.layers[i].self_attn.state_dict())
    return lay, ours


@contextmanager
def capture(model):
    """Each layer's attention calls while the model runs within: (input, first position, output)."""
    calls = {i: [] for i in range(len(model.model.layers))}

    def hook(i):
        def record(module, args, kwargs, out):
            calls[i].append((kwargs["hidden_states"] if "hidden_states" in kwargs else args[0],
                             int(kwargs["position_ids"][0, 0]), out[0]))
        return record

    handles = [layer.self_attn.register_forward_hook(hook(i), with_kwargs=True)
               for i, layer in enumerate(model.model.layers)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def run(module, cache, x, start):
    return module(x, None, None, cache, Positions(start, x.shape[1]))


@pytest.fixture(scope="module")
def generated():
    """transformers' greedy generate of 41 tokens after a 23-token prompt (a prefill, then 40 cached
    steps: positions 23..62 cross CSA's windows of 4 ten times and HCA's of 8 five times), each
    attention call captured."""
    cfg, model = hf_model()
    prompt = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), capture(model) as calls:
        out = model.generate(prompt, max_new_tokens=41, min_new_tokens=41, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return cfg, model, calls, prompt, out


@pytest.mark.parametrize("i", range(3), ids=KINDS)
@torch.no_grad()
def test_each_layer_kind_equals_transformers_over_a_prompt_and_40_cached_steps(generated, i):
    """Each layer's attention, fed what transformers' generate fed its own: the 23-token prompt (not
    a multiple of 4 or 8, longer than the window of 6) and 40 single-token steps, through kvbench's
    cache: every output equals transformers' within TOL; and all 63 at once through a fresh cache
    give the same outputs as the steps."""
    cfg, model, calls, _, _ = generated
    lay, ours = ours_for(cfg, model, i)
    assert lay.layer_type == KINDS[i]
    cache = CompressedCache(lay, 2, 64, torch.float32)
    assert [(start, x.shape[1]) for x, start, _ in calls[i]] == [(0, 23)] + [(t, 1) for t in range(23, 63)]
    outputs = []
    for x, start, want in calls[i]:
        outputs.append(run(ours, cache, x, start))
        assert (outputs[-1] - want).abs().max() <= TOL, start
        assert want.abs().max() > 0.1  # the comparison is not between zeros
    x = torch.cat([x for x, _, _ in calls[i]], 1)
    once = run(ours, CompressedCache(lay, 2, 64, torch.float32), x, 0)
    assert (once - torch.cat(outputs, 1)).abs().max() <= TOL


@pytest.mark.parametrize("i", range(3), ids=KINDS)
@torch.no_grad()
def test_without_a_cache_a_prompt_equals_transformers_without_one(generated, i):
    """No cache: the whole sequence from position 0, the remainder of < m tokens dropped, as
    transformers' attention called without a cache."""
    cfg, model, calls, _, _ = generated
    lay, ours = ours_for(cfg, model, i)
    hf = model.model.layers[i].self_attn
    x = torch.cat([x for x, _, _ in calls[i]], 1)[:, :37]
    ids = torch.arange(37)[None]
    from transformers.masking_utils import create_sliding_window_causal_mask

    mask = create_sliding_window_causal_mask(config=cfg, inputs_embeds=x, attention_mask=None, cache=None,
                                             position_ids=ids)
    emb = {kind: model.model.rotary_emb(x, position_ids=ids, layer_type=kind) for kind in ("main", "compress")}
    want = hf(x, position_embeddings=emb, position_ids=ids, attention_mask=mask)[0]
    assert (run(ours, None, x, 0) - want).abs().max() <= TOL


@pytest.mark.parametrize("i", range(3), ids=KINDS)
def test_gradients_equal_transformers(generated, i):
    """A training step's gradients (task=train: no cache, the whole sequence) through kvbench's
    attention equal those through transformers' for every parameter (the indexer's selection, as
    there, passes none)."""
    import copy

    from transformers.masking_utils import create_sliding_window_causal_mask

    cfg, model, calls, _, _ = generated
    hf = copy.deepcopy(model.model.layers[i].self_attn).train()
    lay, ours = ours_for(cfg, model, i)
    x = torch.cat([x for x, _, _ in calls[i]], 1)[:, :30]
    ids = torch.arange(30)[None]
    mask = create_sliding_window_causal_mask(config=cfg, inputs_embeds=x, attention_mask=None, cache=None,
                                             position_ids=ids)
    emb = {kind: model.model.rotary_emb(x, position_ids=ids, layer_type=kind) for kind in ("main", "compress")}
    hf(x, position_embeddings=emb, position_ids=ids, attention_mask=mask)[0].pow(2).sum().backward()
    run(ours.train(), None, x, 0).pow(2).sum().backward()
    theirs, mine = dict(hf.named_parameters()), dict(ours.named_parameters())
    assert sorted(theirs) == sorted(mine)
    for name, want in theirs.items():
        if want.grad is None:  # the indexer's weights: a top-k passes no gradient
            assert mine[name].grad is None or not mine[name].grad.any(), name
            continue
        assert (mine[name].grad - want.grad).abs().max() <= 1e-5 * max(want.grad.abs().max(), 1e-3), name
    assert sum(p.grad is not None and bool(p.grad.any()) for p in mine.values()) > 6


def the_compressor_counts(cfg, model, calls, i):
    """How much another position bias (a shift would not do: the gate's softmax ignores it) changes
    a compressing layer's outputs before its first window closes, and late."""
    lay, ours = ours_for(cfg, model, i)
    x = torch.cat([x for x, _, _ in calls[i]], 1)
    before = run(ours, CompressedCache(lay, 2, 64, torch.float32), x, 0)
    with torch.no_grad():
        ours.compressor.position_bias.add_(torch.randn_like(ours.compressor.position_bias))
    after = run(ours, CompressedCache(lay, 2, 64, torch.float32), x, 0)
    return (before - after)[:, :lay.compress_rate - 1].abs().max(), (before - after)[:, 40:].abs().max()


@pytest.mark.parametrize("i", [1, 2], ids=[CSA, HCA])
@torch.no_grad()
def test_the_pooled_entries_count_once_a_window_closes(generated, i):
    cfg, model, calls, _, _ = generated
    early, late = the_compressor_counts(cfg, model, calls, i)
    assert early == 0 and late > 1e-3  # nothing pooled before the first window closes


@torch.no_grad()
def test_a_prompt_in_parts_not_multiples_of_m_then_steps_equal_transformers():
    """A prompt fed in three parts (10, 13, 9 tokens: each ends mid-window, so the buffer of < m
    tokens and CSA's overlap carry across forwards; one part longer than the window) then 40 steps,
    as transformers' model runs them with its own cache: every layer's outputs equal its."""
    from transformers.cache_utils import DynamicCache

    cfg, model = hf_model(seed=1)
    ids = torch.randint(0, 97, (2, 72), generator=torch.Generator().manual_seed(1))
    hf_cache = DynamicCache(config=cfg)
    with capture(model) as calls:
        for start, end in [(0, 10), (10, 23), (23, 32)] + [(t, t + 1) for t in range(32, 72)]:
            model(input_ids=ids[:, start:end], cache=hf_cache, use_cache=True)
    for i in range(3):
        lay, ours = ours_for(cfg, model, i)
        cache = CompressedCache(lay, 2, 72, torch.float32)
        assert len(calls[i]) == 43
        for x, start, want in calls[i]:
            assert (run(ours, cache, x, start) - want).abs().max() <= TOL, (i, start)
        # the pools hold what transformers' cache holds: the same entries, the same buffer
        theirs = hf_cache.layers[i]
        if lay.compresses:
            pool = cache.pools["compressor"]
            assert torch.allclose(pool.entries[:, :72 // lay.compress_rate], theirs.compressed_kv["compressor"],
                                  atol=TOL)
            assert theirs.buffer_kv["compressor"].shape[1] == 72 % lay.compress_rate
        assert torch.equal(cache.ring[:, torch.arange(72 - 5, 72) % 6], theirs.keys[:, 0])  # W - 1 = 5 held there


@pytest.mark.parametrize("prompt", [1, 3, 4, 8, 9])
@torch.no_grad()
def test_prompts_shorter_than_a_window_or_on_its_boundary_then_steps_equal_transformers(prompt):
    """A prompt of one token, of fewer than m, of exactly m and m', of m' + 1, then 12 steps (the
    first windows closing during the steps, or the prompt closing them itself): every layer equals
    transformers' model run with its cache."""
    from transformers.cache_utils import DynamicCache

    cfg, model = hf_model(seed=3)
    ids = torch.randint(0, 97, (1, prompt + 12), generator=torch.Generator().manual_seed(prompt))
    hf_cache = DynamicCache(config=cfg)
    with capture(model) as calls:
        for start, end in [(0, prompt)] + [(t, t + 1) for t in range(prompt, prompt + 12)]:
            model(input_ids=ids[:, start:end], cache=hf_cache, use_cache=True)
    for i in range(3):
        lay, ours = ours_for(cfg, model, i)
        cache = CompressedCache(lay, 1, prompt + 12, torch.float32)
        for x, start, want in calls[i]:
            assert (run(ours, cache, x, start) - want).abs().max() <= TOL, (i, start)


@torch.no_grad()
def test_the_real_hca_rate_of_128_and_a_yarn_compress_rope_equal_transformers():
    """m' = 128 as V4 ships it (a prompt of 100, then 40 steps: the first entry closes at step 28)
    and the compressed branch's YaRN rope (factor 16 over a pretraining context of 32, attention
    factor 1 as V4 forces): every layer's outputs equal transformers'."""
    rope = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32}
    cfg, model = hf_model(seed=2, compress_rates={CSA: 4, HCA: 128}, rope_parameters=rope)
    assert cfg.rope_parameters["compress"]["rope_type"] == "yarn"
    prompt = torch.randint(0, 97, (1, 100), generator=torch.Generator().manual_seed(2))
    with capture(model) as calls:
        model.generate(prompt, max_new_tokens=41, min_new_tokens=41, do_sample=False)
    for i in range(3):
        lay, ours = ours_for(cfg, model, i)
        assert lay.compress_rope.type == "yarn" and lay.rope.type == "default"
        cache = CompressedCache(lay, 1, 160, torch.float32)
        for x, start, want in calls[i]:
            assert (run(ours, cache, x, start) - want).abs().max() <= TOL, (i, start)
    assert cache.pools["compressor"].entries[0, 0].abs().max() > 0  # the entry of tokens 0..127 was pooled
    assert lay.entries(140) == 1 and lay.entries(100) == 0


@torch.no_grad()
def test_a_bfloat16_checkpoint_loads_with_its_float32_keeps_and_rounds_as_transformers(generated, tmp_path):
    """A checkpoint saved and loaded as transformers loads it in bfloat16 (its sinks, position biases
    and norm weights kept in float32): kvbench's attention takes each tensor in the dtype it comes
    in, its pools hold what transformers' do, and over the prompt and 40 steps each layer's outputs
    are within two bfloat16 roundings of the largest (the same products, summed by other kernels: one
    rounding apart here)."""
    from transformers import DeepseekV4ForCausalLM

    cfg, model, _, prompt, _ = generated
    model.save_pretrained(tmp_path)
    half = DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    with capture(half) as calls:
        half.generate(prompt, max_new_tokens=41, min_new_tokens=41, do_sample=False)
    for i in range(3):
        hf = half.model.layers[i].self_attn
        lay, ours = ours_for(cfg, model, i)
        for name, p in ours.named_parameters():
            p.data = p.data.to(hf.get_parameter(name).dtype)
        ours.load_state_dict(hf.state_dict())
        assert ours.sinks.dtype == torch.float32 and ours.q_b_proj.weight.dtype == torch.bfloat16
        cache = CompressedCache(lay, 2, 64, torch.bfloat16)
        for x, start, want in calls[i]:
            got = run(ours, cache, x, start)
            assert got.dtype == torch.bfloat16
            assert (got.float() - want.float()).abs().max() <= 2 * 2 ** -7 * want.float().abs().max(), (i, start)


class Swapped(nn.Module):
    """In place of a transformers layer's attention: kvbench's, with its own cache."""

    def __init__(self, ours, cache):
        super().__init__()
        self.ours, self.cache = ours, cache

    def forward(self, hidden_states, position_ids=None, **kwargs):
        return run(self.ours, self.cache, hidden_states, int(position_ids[0, 0])), None


@torch.no_grad()
def test_the_model_with_kvbench_attention_greedy_decodes_40_tokens_as_transformers_generate(generated):
    """transformers' DeepseekV4ForCausalLM (its hyper-connections, hash-routed and learned MoE) with
    kvbench's attention and caches in every layer, fed one new token a step with no cache of its
    own: 40 greedy tokens after the 23-token prompt equal transformers' generate, every step's
    logits within TOL."""
    cfg, model, _, prompt, want = generated
    originals = [layer.self_attn for layer in model.model.layers]
    try:
        for i, layer in enumerate(model.model.layers):
            lay, ours = ours_for(cfg, model, i)
            layer.self_attn = Swapped(ours, CompressedCache(lay, 2, 64, torch.float32))

        def last_logits(ids, start):
            positions = torch.arange(start, start + ids.shape[1])[None]
            return model(input_ids=ids, position_ids=positions, use_cache=False).logits[:, -1]

        tokens = greedy_steps(last_logits, prompt, want, TOL)
    finally:
        for layer, attention in zip(model.model.layers, originals):
            layer.self_attn = attention
    assert len(set(tokens[0].tolist())) > 3  # not one token repeated


@torch.no_grad()
def test_hyper_connections_equal_transformers_and_comb_is_doubly_stochastic():
    """kvbench's hyper-connection of 4 streams (transformers' fn, base and scale, random) on streams
    that differ: the collapsed input, post and comb equal transformers'; comb's columns sum to 1
    (its last normalisation) and its rows nearly, and it is not symmetric (the residual's transpose
    matters); the head collapses as transformers' does."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead

    cfg = DeepseekV4Config(**{**SHAPE, "hc_mult": 4})
    ours = HyperConnection(D_MODEL, 4, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    ours.load_state_dict({"fn": 0.1 * torch.randn(24, 4 * D_MODEL), "base": 0.3 * torch.randn(24),
                          "scale": 1 + 0.3 * torch.randn(3)})
    theirs = DeepseekV4HyperConnection(cfg)
    theirs.load_state_dict(ours.state_dict())
    streams = torch.randn(2, 9, 4, D_MODEL)
    for want, got in zip(theirs(streams), ours(streams)):
        assert (want - got).abs().max() <= TOL
    comb = ours(streams)[1]
    assert (comb.sum(-2) - 1).abs().max() <= 1e-5 and (comb.sum(-1) - 1).abs().max() <= 0.05  # 20 iterations
    assert (comb - comb.transpose(-1, -2)).abs().max() > 1e-2
    head = HyperHead(D_MODEL, 4, cfg.hc_eps, cfg.rms_norm_eps)
    head.load_state_dict({"hc_fn": 0.1 * torch.randn(4, 4 * D_MODEL), "hc_base": torch.randn(4),
                          "hc_scale": torch.randn(1)})
    theirs = DeepseekV4HyperHead(cfg)
    theirs.load_state_dict(head.state_dict())
    assert (head(streams) - theirs(streams)).abs().max() <= TOL


@torch.no_grad()
def test_a_model_of_kvbench_blocks_greedy_decodes_40_tokens_as_transformers_generate(generated):
    """Every V4 block run by kvbench: its hyper-connections around kvbench's attention (with its
    cache) and around transformers' MoE (hash-routed, then learned: not kvbench's yet), the head's
    collapse, one token a step: 40 greedy tokens after the 23-token prompt equal transformers'
    generate, every step's logits within TOL."""
    cfg, model, _, prompt, want = generated
    hf = model.model
    blocks = []
    for i, layer in enumerate(hf.layers):
        lay, attention = ours_for(cfg, model, i)
        hcs = [HyperConnection(D_MODEL, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
               for _ in range(2)]
        hcs[0].load_state_dict(layer.attn_hc.state_dict())
        hcs[1].load_state_dict(layer.ffn_hc.state_dict())
        blocks.append((layer, attention, CompressedCache(lay, 2, 64, torch.float32), *hcs))
    head = HyperHead(D_MODEL, cfg.hc_mult, cfg.hc_eps, cfg.rms_norm_eps)
    head.load_state_dict(hf.hc_head.state_dict())

    def last_logits(ids, start):
        h = expand(hf.embed_tokens(ids), cfg.hc_mult)  # (B, T, N, C)
        for layer, attention, cache, attn_hc, ffn_hc in blocks:
            post, comb, x = attn_hc(h)
            h = residual(h, run(attention, cache, layer.input_layernorm(x), start), post, comb)
            post, comb, x = ffn_hc(h)
            h = residual(h, layer.mlp(layer.post_attention_layernorm(x), input_ids=ids), post, comb)
        return model.lm_head(hf.norm(head(h)))[:, -1]

    greedy_steps(last_logits, prompt, want, TOL)


# ---- bytes -----------------------------------------------------------------------------------

def hand_bytes(kind, S, e, W=6, D=32, Di=16, m=None):
    """Held per sequence, from the config by hand: the ring, the pool, the buffers of m - 1 tokens
    (kv and gate; CSA's two series of D and its indexer's of D_i), CSA's overlap (kv in e, gate in float32)."""
    m = m or {SLIDING: 0, CSA: 4, HCA: 8}[kind]
    ring = min(S, W) * D * e
    if kind == SLIDING:
        return ring
    if kind == HCA:
        return ring + S // m * D * e + (m - 1) * 2 * D * e
    return ring + S // m * (D + Di) * e + (m - 1) * 2 * (2 * D + 2 * Di) * e + m * (D + Di) * (e + 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cache_allocates_what_the_layout_says_and_hand_formulas_agree(dtype):
    """Each kind's cache for 3 sequences of up to 61 tokens allocates B x the layout's bytes at 61,
    which is the hand formula; a prompt and 10 steps write it in place."""
    cfg, model = hf_model()
    e, B = dtype.itemsize, 3
    layers = Layouts(compressed_from_hf(config_json(cfg)))
    for kind, lay in zip(KINDS, layers):
        assert [lay.sequence_bytes(S, e) for S in (1, 5, 61)] == [hand_bytes(kind, S, e) for S in (1, 5, 61)]
        cache = CompressedCache(lay, B, 61, dtype)
        assert cache.nbytes == B * hand_bytes(kind, 61, e)
        before = [t.data_ptr() for t in cache.tensors()]
        ours = CompressedAttention(tiny_model_config(d_model=D_MODEL), lay).to(dtype)
        with torch.no_grad():
            for start, T in [(0, 41)] + [(t, 1) for t in range(41, 51)]:
                assert torch.isfinite(run(ours, cache, torch.randn(B, T, D_MODEL, dtype=dtype), start)).all()
        assert [t.data_ptr() for t in cache.tensors()] == before and cache.nbytes == B * hand_bytes(kind, 61, e)
    assert layers.cache_bytes(61, B, e) == B * sum(hand_bytes(kind, 61, e) for kind in KINDS)


def test_held_bytes_are_what_transformers_cache_holds_past_its_ring(generated):
    """After the 63 tokens of generate, transformers' cache holds per layer: W - 1 ring positions
    (kvbench keeps W), floor(63 / m) entries (CSA: and index keys), 63 mod m buffered tokens, CSA's
    overlap; the layout's pool and overlap bytes are exactly its, the buffer at most its capacity."""
    cfg, model, calls, _, out = generated
    # generate's own cache is not returned with the tokens: run the 63 tokens through one
    from transformers.cache_utils import DynamicCache

    hf_cache = DynamicCache(config=cfg)
    with torch.no_grad():
        model(input_ids=out.sequences[:, :63], cache=hf_cache, use_cache=True)
    e, S = 4, 63
    for i, lay in enumerate(compressed_from_hf(config_json(cfg))):
        layer = hf_cache.layers[i]
        assert layer.keys[0].nbytes == (lay.window - 1) * lay.head_dim * e  # one sequence's ring
        if not lay.compresses:
            continue
        names = ["compressor"] + (["indexer"] if lay.indexed else [])
        pooled = sum(layer.compressed_kv[n][0].nbytes for n in names)
        assert pooled == lay.pool_bytes(S, e) == S // lay.compress_rate * lay.entry_width * e
        buffered = sum(layer.buffer_kv[n][0].nbytes + layer.buffer_gate[n][0].nbytes for n in names)
        overlap = sum(layer.overlap_kv[n][0].nbytes + layer.overlap_gate[n][0].nbytes for n in names) \
            if lay.indexed else 0
        capacity = lay.buffer_bytes(e) - overlap
        assert buffered == capacity * (S % lay.compress_rate) // (lay.compress_rate - 1) <= capacity
        assert overlap == (lay.compress_rate * (lay.head_dim + lay.index_head_dim) * (e + 4) if lay.indexed else 0)


def test_per_token_and_read_bytes_by_hand_for_deepseek_v4_flash():
    """V4-Flash's shape (head_dim 512, window 128, CSA m = 4 with index keys of 128 and top 512,
    HCA m' = 128) in bfloat16, by hand: per token past the window CSA adds (512 + 128) x 2 / 4 =
    320 bytes, HCA 512 x 2 / 128 = 8; at 1M tokens a step reads the ring, every index key and 512
    entries (CSA) or every entry (HCA)."""
    layers = compressed_from_hf({"architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 3,
                                 "layer_types": KINDS})
    sliding, csa, hca = layers
    assert csa.token_bytes(2, window_full=True) == 320 and hca.token_bytes(2, window_full=True) == 8
    assert csa.token_bytes(2) == 1024 + 320 and sliding.token_bytes(2, window_full=True) == 0
    assert Compressed(7, layer_type=HCA, compress_rate=3, head_dim=10, rope_dim=2, num_heads=8) \
        .token_bytes(2, window_full=True) == Fraction(20, 3)  # exact where the mean is not a whole byte
    S = 2 ** 20
    ring = 128 * 512 * 2
    assert sliding.read_bytes(S, 2) == ring
    assert csa.read_bytes(S, 2) == ring + (S // 4) * 128 * 2 + 512 * 512 * 2
    assert hca.read_bytes(S, 2) == ring + (S // 128) * 512 * 2
    # held grows by m entries' bytes over m tokens once the ring is full
    for lay in (csa, hca):
        m = lay.compress_rate
        assert lay.sequence_bytes(S + m, 2) - lay.sequence_bytes(S, 2) == m * lay.token_bytes(2, window_full=True)
    assert csa.step_flops(S) == 4 * 64 * 512 * (128 + 512) + 2 * 64 * 129 * (S // 4)
    lines = Layouts(layers).memory_lines(4096, "bfloat16", 2)  # what inspect says: each type's figures
    assert [line.split(" layer adds ")[1].split(" B (exact")[0] for line in lines if "adds" in line] == [
        "1024 B per token in bfloat16 while its ring fills, then 0", "1344 B per token in bfloat16 while its ring "
        "fills, then 320", "1032 B per token in bfloat16 while its ring fills, then 8"]


@pytest.mark.parametrize("i", [1, 2], ids=[CSA, HCA])
@torch.no_grad()
def test_a_decode_step_attends_what_the_read_formula_counts(generated, i):
    """The keys a decode step's softmax runs over: the ring's min(S, W) and min(k, entries) gathered
    (CSA) or every entry (HCA), what read_bytes counts per element."""
    cfg, model, calls, _, _ = generated
    lay, ours = ours_for(cfg, model, i)
    seen = []
    attend = ours._attend
    ours._attend = lambda q, kv, visible: (seen.append((q.shape[2], kv.shape[1])), attend(q, kv, visible))[1]
    cache = CompressedCache(lay, 2, 64, torch.float32)
    for x, start, _ in calls[i]:
        run(ours, cache, x, start)
    for S, (T, keys) in zip(range(24, 64), seen[1:]):
        assert T == 1 and keys * lay.head_dim * 4 == lay.read_bytes(S, 4) - (
            lay.entries(S) * lay.index_head_dim * 4 if lay.indexed else 0), S


# ---- config.json -----------------------------------------------------------------------------

def test_config_json_reads_as_transformers_builds_the_layers(generated):
    cfg, model, _, _, _ = generated
    layers = compressed_from_hf(config_json(cfg))
    for lay, block in zip(layers, model.model.layers):
        hf = block.self_attn
        assert (lay.layer_type, lay.window, lay.num_heads, lay.head_dim, lay.rope_dim) == (
            hf.layer_type, hf.sliding_window, hf.num_heads, hf.head_dim, cfg.qk_rope_head_dim)
        assert lay.compress_rate == (hf.compressor.compress_rate if hf.compressor is not None else 0)
        ours = CompressedAttention(tiny_model_config(d_model=D_MODEL), lay)
        count = lay.attention_params(D_MODEL)
        assert count == sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in ours.parameters())
        assert sorted(ours.state_dict()) == sorted(hf.state_dict())
        assert all(ours.state_dict()[k].shape == v.shape for k, v in hf.state_dict().items())
    assert layers[0] is not layers[1] and compressed_from_hf(config_json(cfg))[1] == layers[1]


def test_legacy_keys_and_defaults_read_as_deepseek_v4_config_reads_them():
    """Older files: per-layer compress_ratios, compress_rate_csa / _hca, num_hash_layers,
    qk_rope_head_dim; and a file with none of the schedule: transformers' defaults."""
    from transformers import DeepseekV4Config

    raw = {"num_hidden_layers": 5, "compress_ratios": [0, 4, 128, 4, 0], "compress_rate_hca": 64,
           "num_hash_layers": 2, "qk_rope_head_dim": 32, "head_dim": 128}
    cfg = DeepseekV4Config(**raw)
    assert v4_layer_types(raw) == cfg.layer_types and compress_rates(raw) == cfg.compress_rates
    assert v4_mlp_layer_types(raw) == cfg.mlp_layer_types
    assert [lay.rope_dim for lay in compressed_from_hf(raw)] == [cfg.qk_rope_head_dim] * 5
    assert compressed_from_hf(raw)[2].compress_rate == 64
    plain = {"num_hidden_layers": 7}
    cfg = DeepseekV4Config(**plain)
    assert v4_layer_types(plain) == cfg.layer_types and v4_mlp_layer_types(plain) == cfg.mlp_layer_types
    assert compressed_from_hf(plain)[0].compress_rope.theta == cfg.rope_parameters["compress"]["rope_theta"]


BASE = {"architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 2}


@pytest.mark.parametrize("cfg,key,value", [
    ({**BASE, "layer_types": ["sliding_attention", "full_attention"]}, "layer_types",
     ["sliding_attention", "full_attention"]),
    ({**BASE, "layer_types": [SLIDING]}, "layer_types", [SLIDING]),
    ({**BASE, "compress_ratios": [0, 8]}, "compress_ratios", [0, 8]),
    ({**BASE, "compress_rates": {CSA: 0, HCA: 128}}, f"compress_rates.{CSA}", 0),
    ({**BASE, "compress_rates": {"csa": 4}}, "compress_rates", {"csa": 4}),
    ({**BASE, "compress_rate_hca": 2.5}, "compress_rate_hca", 2.5),
    ({**BASE, "sliding_window": 0}, "sliding_window", 0),
    ({**BASE, "index_topk": "512"}, "index_topk", "512"),
    ({**BASE, "head_dim": True}, "head_dim", True),
    ({**BASE, "num_key_value_heads": 2}, "num_key_value_heads", 2),
    ({**BASE, "o_groups": 5}, "o_groups", 5),
    ({**BASE, "partial_rotary_factor": 1.5}, "partial_rotary_factor", 1.5),
    ({**BASE, "partial_rotary_factor": 0.1}, "partial_rotary_factor", 0.1),
    ({**BASE, "qk_rope_head_dim": 33}, "qk_rope_head_dim", 33),
    ({**BASE, "qk_rope_head_dim": "64"}, "qk_rope_head_dim", "64"),
    ({**BASE, "compress_rates": {CSA: 4}}, "compress_rates", {CSA: 4}),
    ({**BASE, "layer_types": [HCA, CSA], "index_head_dim": 32, "partial_rotary_factor": 0.125}, "index_head_dim",
     32),
    ({**BASE, "mlp_layer_types": ["moe", "dense"]}, "mlp_layer_types", ["moe", "dense"]),
    ({**BASE, "num_hash_layers": -1}, "num_hash_layers", -1),
    ({**BASE, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_parameters.compress.rope_type",
     "llama3"),
    ({**BASE, "rope_parameters": {"rope_type": "yarn", "factor": 16}},
     "rope_parameters.compress.original_max_position_embeddings", None),
    ({**BASE, "compress_rope_theta": -1.0}, "compress_rope_theta", -1.0),
    ({"architectures": ["DeepseekV3ForCausalLM"]}, "architectures", ["DeepseekV3ForCausalLM"]),
    ({"architectures": 4}, "architectures", 4),
    ({**BASE, "num_key_value_heads": True}, "num_key_value_heads", True),
    ({**BASE, "num_hidden_layers": 0}, "num_hidden_layers", 0),
    ({**BASE, "rope_parameters": {"main": {"rope_type": "default"}, "compress": {"rope_theta": 1e5}}},
     "rope_parameters.main.rope_theta", None),
])
def test_a_config_json_it_cannot_run_is_refused_in_one_line_naming_the_key(cfg, key, value):
    with pytest.raises(ConfigError) as info:
        compressed_from_hf(cfg)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{key}={value!r}: "), message


@pytest.mark.parametrize("fields,key,value", [
    (dict(layer_type="full_attention"), "layer_types", "full_attention"),
    (dict(window=None), "sliding_window", None),
    (dict(compress_rate=0), f"compress_rates.{CSA}", 0),
    (dict(layer_type=SLIDING, compress_rate=4), "compress_rate", 4),
    (dict(rope_dim=7), "qk_rope_head_dim", 7),
    (dict(num_heads=6, o_groups=4), "o_groups", 4),
    (dict(index_topk=0), "index_topk", 0),
])
def test_a_layout_built_by_hand_is_held_to_the_same_rules(fields, key, value):
    with pytest.raises(ConfigError) as info:
        Compressed(**{"window": 128, **fields})
    assert "\n" not in str(info.value) and str(info.value).startswith(f"{key}={value!r}: ")


@pytest.mark.parametrize("key,value", [("cache.dtype", "int8"), ("cache.shared", True), ("runtime.compile", "true"),
                                       ("cache.impl", "concat")])
def test_what_a_v4_layer_refuses_names_the_key_and_value(key, value):
    with pytest.raises(ConfigError) as info:
        check_limits([Compressed(128)], {key: value})
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{key}={value!r}: ") and "DeepSeek-V4" in message


def test_a_cache_continues_only_from_what_it_holds():
    """A pool folds tokens it cannot give back: a forward at another position than the length held
    (or past the cache's end) is refused in one line; position 0 starts afresh."""
    lay = Compressed(6, layer_type=HCA, compress_rate=8, num_heads=4, head_dim=32, rope_dim=8, q_lora_rank=24,
                     o_groups=2, o_lora_rank=16)
    ours = CompressedAttention(tiny_model_config(d_model=D_MODEL), lay).eval()
    cache = CompressedCache(lay, 1, 20, torch.float32)
    x = torch.randn(1, 12, D_MODEL)
    with torch.no_grad():
        first = run(ours, cache, x, 0)
        for start, T in ((5, 1), (13, 1), (12, 9)):
            with pytest.raises(ValueError) as info:
                run(ours, cache, x[:, :T], start)
            assert "\n" not in str(info.value) and str(info.value).startswith("position ")
        assert torch.equal(run(ours, cache, x, 0), first)
        cache.truncate(12, 12)
        with pytest.raises(ValueError, match=r"^cannot truncate to 7: "):
            cache.truncate(7, 12)
        cache.truncate(0, 12)
        with pytest.raises(ValueError, match=r"^position 12: this cache holds 0 tokens"):
            run(ours, cache, x[:, :1], 12)
