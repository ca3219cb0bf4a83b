"""Cross-layer KV sharing (attention.kv_shared_layers, Gemma 3n): the donor rule against
transformers' Gemma3nTextConfig, cached decode against a recompute and against a naive reference
that hands each shared layer its donor's K/V, the bytes held against a hand formula (shared layers
hold none), the parameter count, the Gemma 3n E4B preset's arithmetic, refusals in one line."""

import json
from dataclasses import replace

import pytest
import torch
from conftest import VOCAB, compose, llama_dir
from test_cli import TINY, kvbench

from kvbench.cache import cache_for, causal_mask
from kvbench.checkpoint import CheckpointError, load_llama_dir, to_layout
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.config.nope import NoPE
from kvbench.core.errors import ConfigError
from kvbench.footprint import parameter_count
from kvbench.generate import greedy_generate
from kvbench.jobs.job_config import check_job, to_bench_config
from kvbench.layouts.build import build_layouts
from kvbench.layouts.kv_sharing import share_kv
from kvbench.model import Decoder
from kvbench.rope import apply_rope
from kvbench.tasks import capacity
from kvbench.tasks.inspect import describe

MODEL = ModelConfig(name="t", num_layers=6, d_model=64, num_heads=8, preset_kv_heads=2, ffn_dim=96, vocab_size=VOCAB,
                    max_seq_len=64)
LOCAL_GLOBAL = dict(window=5, global_every=3)  # layers 2 and 5 global, the others local (window 5)


def shared_decoder(shared=3, **attention) -> Decoder:
    torch.manual_seed(0)
    return Decoder(MODEL, AttentionConfig(type="gqa", num_kv_heads=2, kv_shared_layers=shared, **attention)).eval()


@pytest.mark.parametrize("layers, shared, every", [(35, 15, 5), (30, 10, 5), (8, 4, 4), (12, 3, 6), (6, 2, 3)])
def test_the_donor_rule_is_transformers_gemma3n(layers, shared, every):
    """Each of the last N layers reads the layer transformers' Gemma3nTextConfig.kv_sharing_modes
    stores for its type (Gemma 3n E4B: 35 layers, every 5th global, the last 15 shared); where
    transformers finds no producer for a type, kvbench refuses the count in one line."""
    from transformers import Gemma3nTextConfig

    types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]
    hf = Gemma3nTextConfig(num_hidden_layers=layers, layer_types=types, num_kv_shared_layers=shared)
    model = ModelConfig(name="g", num_layers=layers, d_model=32, num_heads=4, preset_kv_heads=2, max_seq_len=64)
    attention = AttentionConfig(window=8, layer_types=types, kv_shared_layers=shared).resolved(model)
    try:
        modes = hf.kv_sharing_modes
    except ValueError:
        with pytest.raises(ConfigError, match=rf"^attention.kv_shared_layers={shared}: layer \d+ .* has no layer of "
                                              rf"its kind before layer {layers - shared} to read K/V from$"):
            build_layouts(model, attention)
        return
    stores = {types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    want = [stores[types[i]] if mode == "reuse" else None for i, mode in enumerate(modes)]
    assert [layer.kv_source for layer in build_layouts(model, attention)] == want


class _Reads(list):
    """A list of layouts that counts the layers read from it (one by one or in slices)."""

    reads = 0

    def __getitem__(self, i):
        out = super().__getitem__(i)
        _Reads.reads += len(out) if isinstance(i, slice) else 1
        return out

    def __iter__(self):
        for layer in super().__iter__():
            _Reads.reads += 1
            yield layer


def test_finding_the_donors_reads_each_layer_a_bounded_number_of_times():
    """Half of 4,000 layers shared: the donors are found in one pass over the layers, not a scan back
    per shared layer (which read ~4 million layers here, and hung a config of a million layers
    before its memory refusal)."""
    model = ModelConfig(name="g", num_layers=4000, d_model=32, num_heads=4, preset_kv_heads=2, max_seq_len=64)
    attention = AttentionConfig(window=8, global_every=5).resolved(model)
    layers = _Reads(build_layouts(model, attention))
    _Reads.reads = 0
    out = share_kv(layers, 2000)
    assert _Reads.reads <= 3 * len(layers)
    assert [layer.kv_source for layer in out[2000:2005]] == [1998, 1998, 1998, 1998, 1999]


@pytest.mark.parametrize("attention, impls", [({}, ["static", "concat", "none"]), (LOCAL_GLOBAL, ["static", "none"])])
def test_cached_decode_equals_recompute(attention, impls):
    """A 12-token prefill and 12 one-token steps (past a window of 5: the local donors' rings
    wrap) give the logits of one forward over all 24 tokens; 40 greedy steps through the static
    cache are those of recomputing the sequence at every step."""
    model = shared_decoder(**attention)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        for impl in impls:
            cache = cache_for(model, impl, 2, 24)
            if impl == "none":
                steps = [model(tokens[:, :12], cache, 0)] + [model(tokens[:, :p + 1], cache, 0)[:, -1:]
                                                             for p in range(12, 24)]
            else:
                steps = [model(tokens[:, :12], cache, 0)] + [model(tokens[:, p:p + 1], cache, p) for p in range(12, 24)]
            assert (torch.cat(steps, 1) - full).abs().max().item() <= 1e-5, impl
    prompt = tokens[:, :8]
    cached = greedy_generate(model, prompt, 40, cache_for(model, "static", 2, 48), keep_logits=True)
    again = greedy_generate(model, prompt, 40, cache_for(model, "none", 2, 48), keep_logits=True)
    assert torch.equal(cached.tokens, again.tokens) and (cached.logits - again.logits).abs().max().item() <= 1e-4


def naive_logits(model: Decoder, tokens: torch.Tensor) -> torch.Tensor:
    """The decoder's forward written out with an explicit softmax, each shared layer attending the
    K/V its donor computed (the layouts' kv_source), each layer under its own window."""
    B, T = tokens.shape
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    x, kv = model.embed(tokens), {}
    for i, (block, layout) in enumerate(zip(model.blocks, model.layouts)):
        a, h = block.attn, block.attn_norm(x)
        q = apply_rope(a.wq(h).view(B, T, a.num_heads, -1).transpose(1, 2), cos, sin)  # (B, H, T, D)
        if layout.kv_source is None:
            k = apply_rope(a.wk(h).view(B, T, a.num_kv_heads, -1).transpose(1, 2), cos, sin)
            kv[i] = (k, a.wv(h).view(B, T, a.num_kv_heads, -1).transpose(1, 2))
        own = i if layout.kv_source is None else layout.kv_source
        k, v = (t.repeat_interleave(a.num_heads // a.num_kv_heads, 1) for t in kv[own])
        scores = (q @ k.transpose(-1, -2)) / a.head_dim ** 0.5
        scores = scores.masked_fill(~causal_mask(T, T, "cpu", layout), float("-inf"))
        x = x + a.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1))
        x = x + block.mlp(block.mlp_norm(x))
    return model.lm_head(model.norm(x))


@pytest.mark.parametrize("attention", [{}, LOCAL_GLOBAL])
def test_shared_layers_attend_their_donors_keys_as_a_naive_reference_does(attention):
    model = shared_decoder(**attention)
    assert [layer.kv_source for layer in model.layouts] == ([None] * 3 + [2] * 3 if not attention
                                                             else [None, None, None, 1, 1, 2])
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (model(tokens) - naive_logits(model, tokens)).abs().max().item() <= 1e-5
        unshared = Decoder(MODEL, AttentionConfig(type="gqa", num_kv_heads=2, **attention)).eval()
        unshared.load_state_dict(model.state_dict(), strict=False)  # the shared layers' own K/V weights: random
        assert (model(tokens) - unshared(tokens)).abs().max().item() > 1e-3


@pytest.mark.parametrize("attention, held", [({}, 3 * 24), (LOCAL_GLOBAL, 2 * 5 + 1 * 24)])
@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
def test_shared_layers_hold_no_bytes(attention, held, cache_dtype):
    """Allocated bytes = formula = the layers with a cache of their own, by hand: 2 (K, V) x 2 KV
    heads x (8 x 4 bytes, or 8 codes + a 4-byte scale) per position held, x batch 3; the 3
    shared layers add nothing (with windows: local donor 0 and 1 hold 5 positions, global 2 all 24)."""
    model = shared_decoder(**attention)
    per_position = 2 * 2 * (8 * 4 if cache_dtype == "auto" else 8 + 4)
    cache = cache_for(model, "static", 3, 24, cache_dtype)
    assert cache.nbytes == model.layouts.cache_bytes(24, 3, 4, cache_dtype) == held * per_position * 3
    assert model.layouts.bytes_per_token(4) == 3 * 2 * 2 * 8 * 4
    assert model.layouts.read_bytes(24, 1, 4) > model.layouts.cache_bytes(24, 1, 4)  # shared layers read again


def test_the_parameter_count_has_no_k_v_weights_in_shared_layers():
    model = shared_decoder()
    assert "blocks.4.attn.wk.weight" not in model.state_dict() and "blocks.2.attn.wk.weight" in model.state_dict()
    assert parameter_count(MODEL, model.attention) == model.num_params()
    assert model.num_params() == shared_decoder(0).num_params() - 3 * 2 * (64 * 2 * 8)


def test_inspect_of_gemma3n_e4b_prints_bytes_per_token_and_per_sequence_by_hand():
    """20 of its 35 layers hold K/V (2 heads x 256, K and V, 2 bytes): 40,960 B per token before
    the windows fill; per sequence of 8,192 tokens 4 global layers hold all of them and 16 local
    ones 512, and the 15 shared layers none, by kind of layer."""
    cfg = to_bench_config(compose("model=gemma3n_e4b", "task=inspect", "runtime.dtype=bfloat16",
                                  "workload.prompt_len=8000", "workload.gen_len=192"))
    layers = build_layouts(cfg.model, cfg.attention)
    assert [layer.kv_source for layer in layers][18:] == [None, None] + [18, 18, 18, 18, 19] * 3
    position = 2 * 2 * 256 * 2
    per_sequence = (4 * 8192 + 16 * 512) * position
    text = describe(cfg)
    assert layers.bytes_per_token(2) == 20 * position == 40_960 and f"({40_960:,}) in bfloat16" in text
    bf16 = next(line for line in text.splitlines() if line.startswith("bfloat16"))
    assert f"({per_sequence:,})" in bf16
    rows = {line.split("  ")[0].strip(): line.split() for line in text.splitlines()
            if line.startswith(("global", "local"))}
    assert rows["global"][1:3] == ["4", "8,192"] and f"({4 * 8192 * position:,})" in rows["global"][-1]
    assert rows["local W=512"][2:4] == ["16", "512"]
    assert rows["global, reads layer 19"][4:6] == ["3", "0"] and rows["local W=512, reads layer 18"][5] == "12"
    capacity_cfg = to_bench_config(compose("model=gemma3n_e4b", "task=capacity", "runtime.memory_budget_gb=1",
                                           "runtime.dtype=bfloat16", "workload.gen_len=96",
                                           "capacity.context_lens=[4000]"))
    assert capacity.kv_bytes(capacity_cfg, 4000, 8) == (4 * 4096 + 16 * 512) * position * 8  # task=capacity's


FAST = ["wandb=disabled", "runtime.isolate=false", "workload.prompt_len=8", "workload.gen_len=2"]


@pytest.mark.parametrize("overrides, line", [
    (["attention.kv_shared_layers=2"], "attention.kv_shared_layers=2: must be 0 (none) or fewer than the 2 layers"),
    (["attention.kv_shared_layers=-1"], "attention.kv_shared_layers=-1: must be 0 (none) or fewer than the 2 layers"),
    (["attention.kv_shared_layers=1", "attention.window=4", "attention.layer_types=[full_attention,sliding_attention]"],
     "attention.kv_shared_layers=1: layer 1 (kv_heads layer of window 4) has no layer of its kind before layer 1"),
    (["attention=mla", "attention.kv_shared_layers=1"], "attention.kv_shared_layers=1: layer 1 is a latent layer; "
                                                        "reading another layer's cache is built for K/V-head layers"),
    (["attention.kv_shared_layers=1", "runtime.compile=graph"], "runtime.compile='graph': layer 1 reads layer 0's "
                                                                "K/V (attention.kv_shared_layers): cross-layer KV "
                                                                "sharing is not built for the fixed-shape step"),
    (["attention.kv_shared_layers=1", "workload=multiturn", "cache.shared=true"],
     "cache.shared=True: layer 1 reads layer 0's K/V (attention.kv_shared_layers): cross-layer KV sharing is not "
     "built for a shared prefix"),
])
def test_what_kv_sharing_does_not_run_with_is_one_line_naming_the_key(overrides, line):
    with pytest.raises(ConfigError) as info:
        to_bench_config(compose(*FAST, "model=tiny", *overrides))
    [message] = str(info.value).splitlines()
    assert message.startswith(line), message


@pytest.mark.parametrize("asked, line", [
    ({"kv_shared_layers": 1}, "attention.kv_shared_layers=1: the checkpoint's is 0"),
    ({"sinks": True}, "attention.sinks=True: the checkpoint's is False")])
def test_a_layer_property_asked_of_a_checkpoint_without_it_is_refused_not_dropped(tmp_path, asked, line):
    """A checkpoint's weights have no shared layers or sinks: asking for them was silently dropped
    (the run measured the checkpoint as it is while its record named the asked layout)."""
    path, _ = llama_dir(tmp_path, 2)
    model = load_llama_dir(path)[0]
    with pytest.raises(CheckpointError) as info:
        to_layout(model, AttentionConfig(type="gqa", num_kv_heads=2, **asked).resolved(model.config))
    assert str(info.value) == f"{line} (leave it null)"


@pytest.mark.e2e
def test_cli_run_with_shared_layers_is_an_ok_record_with_their_bytes(tmp_path):
    out = tmp_path / "run"
    kvbench(*TINY, "attention=gqa", "attention.num_kv_heads=2", "attention.kv_shared_layers=1",
            "workload.batch_size=2", f"hydra.run.dir={out}", cwd=tmp_path)
    rec = json.loads((out / "results.json").read_text())
    assert rec["status"] == "ok", rec["error"]
    m = rec["metrics"]
    # tiny: 2 layers, the second shared: 1 layer x K and V x 2 heads x head_dim 8 x 4 bytes x 18 positions x batch 2
    assert m["kv_cache_bytes"] == m["kv_cache_bytes_formula"] == 1 * 2 * 2 * 8 * 4 * 18 * 2
    assert m["fidelity_max_abs_logit_diff"] <= 1e-5 and rec["config"]["attention"]["kv_shared_layers"] == 1


@pytest.mark.parametrize("attention", [{"kv_shared_layers": 1}, {"sinks": True}])
def test_a_kvbench_checkpoint_with_shared_layers_or_sinks_is_evaluated_as_saved(tmp_path, attention):
    """task=eval of a saved model with shared layers (or sinks) and attention=model: the model as
    saved, its own layout being the checkpoint's (not refused as another layout, not dropped)."""
    from kvbench.checkpoint import save_checkpoint
    from kvbench.config.bench import BenchConfig, CacheConfig, RuntimeConfig, TrainConfig, WandbConfig
    from kvbench.config.workload import DecodeWorkload
    from kvbench.quality.train import checkpoint_for_eval

    torch.manual_seed(0)
    saved = Decoder(MODEL, AttentionConfig(type="gqa", num_kv_heads=2, **attention)).eval()
    path = save_checkpoint(tmp_path / "model.pt", saved)
    cfg = check_job(BenchConfig(task="eval", model=MODEL, attention=AttentionConfig(),
                                workload=DecodeWorkload(prompt_len=8, gen_len=8), cache=CacheConfig(),
                                runtime=RuntimeConfig(device="cpu"), wandb=WandbConfig(mode="disabled"),
                                train=TrainConfig(checkpoint=str(path))))
    model, _, converted = checkpoint_for_eval(cfg, torch.device("cpu"))
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert converted["kv_heads_conversion"] == "none" and torch.equal(model(tokens), saved(tokens))
    assert [layer.kv_source for layer in model.layouts] == [layer.kv_source for layer in saved.layouts]
    assert model.layouts[0].sinks == saved.layouts[0].sinks


def test_records_with_and_without_sharing_are_two_variants():
    from kvbench.sinks.views import Variant

    rows = [Variant.from_config({"attention": {"type": "gqa", "num_kv_heads": 2, "kv_shared_layers": n}})
            for n in (0, 3)]
    assert [v.label for v in rows] == ["gqa kv=2", "gqa kv=2 kvshare=3"]
    assert Variant.of_attention(shared_decoder().attention, num_layers=6).label == "gqa kv=2 kvshare=3"


@pytest.mark.parametrize("nope, want", [
    ([1, 5], [None, None, None, None, 3, 1]),  # layer 5 (NoPE) reads layer 1 (NoPE), not layer 3 (rotated)
    ([5], None),  # no NoPE layer before the shared ones: refused
])
def test_a_shared_layer_without_rotary_embeddings_reads_a_donor_without_them(nope, want):
    """Keys are cached rotated: a NoPE layer (Llama 4's globals, model.nope.layers) that read a rotated
    layer's keys would attend positions the wrong way, so donors are matched on rotation too."""
    model = replace(MODEL, nope=NoPE(layers=nope))
    attention = AttentionConfig(type="gqa", num_kv_heads=2, kv_shared_layers=2).resolved(model)
    if want is None:
        with pytest.raises(ConfigError, match=r"^attention.kv_shared_layers=2: layer 5 \(kv_heads, without rotary "
                                              r"embeddings\) has no layer of its kind before layer 4"):
            build_layouts(model, attention)
        return
    layers = build_layouts(model, attention)
    assert [layer.kv_source for layer in layers] == want
    assert [bool(layer.rotary_dim) for layer in layers] == [i not in nope for i in range(6)]
