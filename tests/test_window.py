"""Sliding-window and hybrid attention: the layer pattern, the ring cache (cached decode ==
recompute past W, bytes as allocated == the formula), transformers' Mistral / Qwen2 / Qwen3 with
their windows (logits and task=eval perplexity), and one-line refusals."""


import dataclasses

import pytest
import torch
from conftest import (  # noqa: F401 (corpus: a fixture)
    VOCAB,
    corpus,
    edit_config_json,
    eval_job,
    hf_dir,
    reread,
    tiny_model_config,
    transformers_perplexity,
)
from kv_formula import kv_cache_bytes
from test_checkpoint import PROMPT, STEPS, logits_with_cache

from kvbench.cache import cache_for
from kvbench.checkpoint import load_llama_dir
from kvbench.config.bench import BenchConfig, CacheConfig, RuntimeConfig, WandbConfig
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.config.workload import DecodeWorkload
from kvbench.core.errors import ConfigError
from kvbench.jobs.job_config import check_job
from kvbench.layouts.base import LayerLayout
from kvbench.model import Decoder
from kvbench.quality.train import run_eval

W = 5


def windowed(num_kv_heads, num_layers=3, seed=0, **pattern) -> Decoder:
    torch.manual_seed(seed)
    cfg = tiny_model_config(num_layers=num_layers)
    attention = AttentionConfig(type="mha" if num_kv_heads == 8 else "mqa" if num_kv_heads == 1 else "gqa",
                                num_kv_heads=num_kv_heads, **pattern)
    return Decoder(cfg, attention).eval()


@pytest.mark.parametrize("pattern, windows", [
    ({"window": 4}, [4, 4, 4, 4, 4, 4]),
    ({"window": 4, "global_every": 3}, [4, 4, None, 4, 4, None]),  # 2 local : 1 global
    ({"window": 4, "global_every": 2}, [4, None, 4, None, 4, None]),  # GPT-OSS's alternation
    ({"window": 4, "layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 4}, [None, None, 4, 4, 4, 4]),
    ({"window": 0}, [None] * 6),
    ({}, [None] * 6),
])
def test_layer_pattern(pattern, windows):
    model = ModelConfig(num_layers=6)
    assert AttentionConfig(type="mha", **pattern).resolved(model).layer_windows(6) == windows


@pytest.mark.parametrize("num_kv_heads", [8, 2, 1])
@pytest.mark.parametrize("pattern", [{"window": W}, {"window": W, "global_every": 2}], ids=["local", "hybrid"])
@pytest.mark.parametrize("impl", ["static", "none"])
def test_cached_decode_equals_recompute_past_the_window(num_kv_heads, pattern, impl):
    """A prompt longer than W in two chunks, then decode steps to 5 W: each position's logits as a
    full recompute of the sequence gives them (where the window drops keys, which a test with
    W >= the sequence would not see). The window changes the logits (it is applied at all)."""
    model = windowed(num_kv_heads, **pattern)
    tokens = torch.randint(0, VOCAB, (2, 5 * W))
    with torch.no_grad():
        full = model(tokens)
        assert (full - windowed(num_kv_heads, window=0)(tokens)).abs().max() > 1e-3
        if impl == "none":
            got = torch.stack([model(tokens[:, :p + 1])[:, -1] for p in range(5 * W)], 1)
        else:
            cache = cache_for(model, impl, 2, 5 * W)
            got = [model(tokens[:, :2 * W - 1], cache, 0), model(tokens[:, 2 * W - 1:3 * W], cache, 2 * W - 1)]
            got += [model(tokens[:, p:p + 1], cache, p) for p in range(3 * W, 5 * W)]
            got = torch.cat(got, 1)
    torch.testing.assert_close(got, full, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("pattern", [{"window": W}, {"window": W, "global_every": 3}, {"window": 60}])
def test_bytes_allocated_equal_the_formula(pattern, cache_dtype):
    """sum over layers of min(S, W_layer) x 2 x kv_heads x head_dim x bytes (+ scales): a local
    layer's ring stops at W; a window longer than the cache is a full cache."""
    model = windowed(2, **pattern)
    S, B = 40, 3
    cache = cache_for(model, "static", B, S, cache_dtype)
    by_hand = sum(S if w is None else min(S, w) for w in list(model.layouts.windows)) * 2 * 2 * 8 * B
    by_hand *= 4 if cache_dtype == "auto" else (1 + 4 / 8)  # int8 codes + a float32 scale per vector of 8
    assert cache.nbytes == by_hand == kv_cache_bytes(3, 2, 8, S, B, 4, cache_dtype, list(model.layouts.windows))


@pytest.mark.parametrize("num_kv_heads", [8, 2])
@pytest.mark.parametrize("pattern", [{"window": W}, {"window": W, "global_every": 2}, {"window": 12}],
                         ids=["local", "hybrid", "window-past-the-prefix"])
def test_shared_prefix_with_a_window_equals_recompute(num_kv_heads, pattern):
    """A system prompt of P = 8 > W held once, then two conversations in chunks and decode steps
    to 20 positions past it: the logits of each conversation recomputed whole with the prompt in
    front. A local layer keeps only the prompt's last min(P, W) positions (the only ones a later
    token still sees) and a ring of W per conversation: bytes == the formula of both parts."""
    from kvbench.shared_prefix import shared_cache_for

    model = windowed(num_kv_heads, **pattern)
    P, B, N = 8, 2, 20
    system, own = torch.randint(0, VOCAB, (1, P)), torch.randint(0, VOCAB, (B, N))
    with torch.no_grad():
        full = model(torch.cat([system.expand(B, -1), own], 1))[:, P:]
        cache = shared_cache_for(model, "static", B, P, P + N)
        model(system, cache, 0)
        got = [model(own[:, :3], cache, P), model(own[:, 3:10], cache, P + 3)]
        got += [model(own[:, i:i + 1], cache, P + i) for i in range(10, N)]
    torch.testing.assert_close(torch.cat(got, 1), full, atol=2e-5, rtol=1e-5)
    windows = list(model.layouts.windows)
    assert cache.nbytes == kv_cache_bytes(3, num_kv_heads, 8, P, 1, 4, "auto", windows) + kv_cache_bytes(
        3, num_kv_heads, 8, N, B, 4, "auto", windows)


def test_a_layout_says_which_positions_it_keeps():
    """What the caches and the serving store ask a layer's layout: a query at position n sees
    first_kept(n) .. n (the last W with a window), a sequence grown by chunks holds at most W - 1
    earlier keys and a chunk, a ring only when W is shorter than the cache, and its groups sort
    full attention first, then the shortest window."""
    full, local, wider = LayerLayout(), LayerLayout(W), LayerLayout(2 * W)
    for n in range(3 * W):
        for layout in (full, local):
            assert [k for k in range(n + 1) if layout.sees(n, k)] == list(range(layout.first_kept(n), n + 1))
    assert (local.first_kept(10), full.first_kept(10)) == (10 - W + 1, 0)
    assert (local.most_kept(100, 3), local.most_kept(6, 3), full.most_kept(100, 3)) == (W - 1 + 3, 6, 100)
    assert local.keeps_ring(W + 1) and not local.keeps_ring(W) and not full.keeps_ring(W)
    assert sorted([wider, local, full], key=lambda x: x.retention) == [full, local, wider]
    assert [x.layers_text() for x in (full, local)] == ["full layers", f"layers of window {W}"]


def test_a_jobs_layouts_are_built_once_and_follow_its_config(monkeypatch):
    """A job asks for its layouts from its check, footprint and model: built once per pair of
    configs (a million-layer config once took 13 s to refuse, building them five times), and a
    config changed in place gets the layouts it now says."""
    from kvbench.footprint import job_footprint, kv_bytes_per_token
    from kvbench.layouts import build

    built = []
    monkeypatch.setattr(build, "_build", lambda m, a, real=build._build: built.append((m, a)) or real(m, a))
    cfg = _bench(model=tiny_model_config(num_layers=5), attention=AttentionConfig(type="gqa", num_kv_heads=2, window=W))
    job_footprint(cfg), kv_bytes_per_token(cfg)
    first = build.build_layouts(cfg.model, cfg.attention)
    assert build.build_layouts(dataclasses.replace(cfg.model), dataclasses.replace(cfg.attention)) is first
    own = [pair for pair in built if pair == (cfg.model, cfg.attention)]  # the rest: footprint's 1-layer models
    assert len(own) == 1 and first.windows == (W,) * 5
    before, cfg.attention.window = len(built), W + 1
    assert build.build_layouts(cfg.model, cfg.attention).windows == (W + 1,) * 5 and len(built) == before + 1


HF_WINDOW = 8  # < PROMPT (64): the prompt and every decode step run past it


@pytest.mark.parametrize("family, overrides, windows", [
    ("mistral", {"sliding_window": HF_WINDOW}, [HF_WINDOW, HF_WINDOW]),
    ("qwen2", {"sliding_window": HF_WINDOW, "use_sliding_window": True, "max_window_layers": 1}, [None, HF_WINDOW]),
    ("qwen3", {"sliding_window": HF_WINDOW, "use_sliding_window": True,
               "layer_types": ["sliding_attention", "full_attention"]}, [HF_WINDOW, None]),
])
@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["gqa", "mqa"])
def test_windowed_checkpoints_match_transformers_past_the_window(tmp_path, family, overrides, windows, num_kv_heads):
    """transformers' own class with its sliding window, 64-token prompt and 16 cached decode steps,
    each side with its own cache: max logit difference <= 1e-5 (float32)."""
    path, hf = hf_dir(tmp_path, num_kv_heads, False, family, max_position_embeddings=PROMPT + STEPS, **overrides)
    model, _ = load_llama_dir(path, torch.float32)
    assert list(model.layouts.windows) == windows
    tokens = torch.randint(0, VOCAB, (2, PROMPT + STEPS), generator=torch.Generator().manual_seed(1))
    ours, theirs = logits_with_cache(model, hf, tokens)
    assert (ours - theirs).abs().max().item() <= 1e-5
    cache = cache_for(model, "static", 2, PROMPT + STEPS)
    assert cache.nbytes == kv_cache_bytes(2, num_kv_heads, model.config.head_dim, PROMPT + STEPS, 2, 4, "auto", windows)


SLIDING_FULL = ["sliding_attention", "full_attention"]


@pytest.mark.parametrize("family, drop, changes, windows", [
    ("llama", (), {"sliding_window": 4, "layer_types": SLIDING_FULL}, [None, None]),  # Llama reads no window
    # Mistral: sliding_window on every layer (use_sliding_window, max_window_layers unread), or on the
    # sliding layers of layer_types (transformers' AutoConfig then reads the file as Ministral's)
    ("mistral", (), {"sliding_window": 4, "use_sliding_window": False, "max_window_layers": 1}, [4, 4]),
    ("mistral", (), {"sliding_window": 4, "layer_types": SLIDING_FULL, "max_window_layers": 1}, [4, None]),
    # Qwen2/Qwen3 left without a key: their config class's (use_sliding_window false, max_window_layers 28)
    ("qwen2", ("use_sliding_window", "layer_types"), {"sliding_window": 4, "max_window_layers": 0}, [None, None]),
    ("qwen3", ("max_window_layers", "layer_types"), {"sliding_window": 4, "use_sliding_window": True}, [None, None]),
])
def test_window_keys_are_read_as_each_architectures_transformers_class_reads_them(tmp_path, family, drop, changes,
                                                                                  windows):
    """A config.json's window keys as transformers' class of that architecture reads them (keys it
    does not read are not read; absent ones take its defaults): the windows, and the logits of 24
    tokens (past the window of 4) against transformers reading the same file."""
    path, _ = hf_dir(tmp_path, 2, False, family)
    edit_config_json(path, drop, **changes)
    model, _ = load_llama_dir(path, torch.float32)
    assert list(model.layouts.windows) == windows
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(tokens) - reread(path)(tokens).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family, overrides", [
    ("mistral", {"sliding_window": HF_WINDOW}),
    ("qwen2", {"sliding_window": HF_WINDOW, "use_sliding_window": True, "max_window_layers": 1})])
def test_eval_of_a_windowed_checkpoint_is_transformers_perplexity(tmp_path, corpus, family, overrides):  # noqa: F811
    path, hf = hf_dir(tmp_path / family, 2, family=family, vocab_size=256, **overrides)
    model = ModelConfig(num_layers=1, d_model=32, num_heads=4, preset_kv_heads=4, ffn_dim=64, vocab_size=1000,
                        max_seq_len=64)
    cfg = eval_job(model, AttentionConfig(type="gqa"), corpus, path)
    m = run_eval(cfg, torch.device("cpu"))
    assert m["perplexity"] == pytest.approx(transformers_perplexity(hf, cfg), rel=1e-4)


def _bench(**changes):
    parts = dict(model=tiny_model_config(), attention=AttentionConfig(type="mha", window=16),
                 workload=DecodeWorkload(prompt_len=8, gen_len=8), cache=CacheConfig(),
                 runtime=RuntimeConfig(device="cpu"), wandb=WandbConfig(mode="disabled"))
    parts.update(changes)
    return check_job(BenchConfig(**parts))


@pytest.mark.parametrize("changes, needle", [
    ({"cache": CacheConfig(impl="concat")}, "cache.impl='concat': keeps every position; with attention.window=16"),
    ({"runtime": RuntimeConfig(device="cpu", compile="graph")}, "runtime.compile='graph': is not supported with a "
                                                               "sliding window"),
    ({"attention": dict(window=-1)}, "attention.window=-1: must be >= 1 positions"),
    ({"attention": dict(window=4, layer_types=["sliding_attention"])},
     "attention.layer_types=['sliding_attention']: must name each of model.num_layers=2 layers"),
    ({"attention": dict(window=4, global_every=2, layer_types=["full_attention"] * 2)},
     "attention.global_every=2: and attention.layer_types both say"),
])
def test_what_a_window_does_not_run_with_is_refused_in_one_line(changes, needle):
    with pytest.raises(ConfigError) as err:
        if isinstance(changes.get("attention"), dict):
            changes = {**changes, "attention": AttentionConfig(type="mha", **changes["attention"])}
        _bench(**changes)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("preset, local, W, kv, D, L", [
    ("gemma3_27b", 52, 1024, 16, 128, 62),  # 5 local : 1 global, layers 5, 11, ..., 59 global
    ("gpt_oss_120b", 18, 128, 8, 64, 36),  # alternating, layer 0 local
    ("mistral_7b_v01", 32, 4096, 8, 128, 32),  # every layer local
])
def test_presets_inspect_their_kv_by_kind_of_layer(preset, local, W, kv, D, L):
    """task=inspect of each windowed preset at 8192 positions: the bytes of each kind of layer in
    bfloat16 worked out by hand from the published shapes."""
    from hydra import compose, initialize_config_dir

    from kvbench.config.bench import CONF_DIR
    from kvbench.jobs.job_config import to_bench_config
    from kvbench.tasks.inspect import describe

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = to_bench_config(compose("config", overrides=[f"model={preset}", "task=inspect", "runtime.dtype=bfloat16",
                                                           "workload.prompt_len=8191", "workload.gen_len=1"]))
    assert cfg.attention.num_kv_heads == kv and cfg.attention.window == W
    text = describe(cfg)
    per_position = 2 * kv * D * 2  # K and V, bfloat16
    assert f"{local * W * per_position:,}" in text.split(f"local W={W}")[1].splitlines()[0]
    if local < L:
        assert f"{(L - local) * 8192 * per_position:,}" in text.split("\nglobal ")[1].splitlines()[0]
    total = (local * W + (L - local) * 8192) * per_position
    assert f"({total:,})" in next(line for line in text.splitlines() if line.startswith("bfloat16"))
