"""MLA with a sliding window (``attention=mla attention.window=W``): a local layer's cache is a ring
of W latents. Cached decode past W, in the absorbed and the expanded form, and a shared prefix
longer than W, equal a full recompute with the window's mask; bytes as allocated equal the
formula (a local layer holds min(S, W) latents of kv_lora_rank + qk_rope_head_dim)."""

import pytest
import torch
from conftest import VOCAB, tiny_model_config
from kv_formula import kv_cache_bytes

from kvbench.cache import cache_for
from kvbench.config.model import AttentionConfig
from kvbench.layouts.attention import decode_form
from kvbench.model import Decoder
from kvbench.shared_prefix import shared_cache_for

W, R, ROPE = 5, 16, 4


def latent_windowed(seed=0, **pattern) -> Decoder:
    torch.manual_seed(seed)
    attention = AttentionConfig(type="mla", kv_lora_rank=R, qk_rope_head_dim=ROPE, **pattern)
    return Decoder(tiny_model_config(num_layers=3), attention).eval()


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
@pytest.mark.parametrize("pattern", [{"window": W}, {"window": W, "global_every": 2}], ids=["local", "hybrid"])
def test_cached_mla_decode_equals_recompute_past_the_window(form, pattern):
    """A prompt longer than W in two chunks, then decode steps to 5 W, against the whole sequence
    recomputed; the window changes the logits (it is applied at all)."""
    model = latent_windowed(**pattern)
    tokens = torch.randint(0, VOCAB, (2, 5 * W))
    with torch.no_grad(), decode_form(model, form):
        full = model(tokens)
        assert (full - latent_windowed(window=0)(tokens)).abs().max() > 1e-3
        cache = cache_for(model, "static", 2, 5 * W)
        got = [model(tokens[:, :2 * W - 1], cache, 0), model(tokens[:, 2 * W - 1:3 * W], cache, 2 * W - 1)]
        got += [model(tokens[:, p:p + 1], cache, p) for p in range(3 * W, 5 * W)]
    torch.testing.assert_close(torch.cat(got, 1), full, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_shared_prefix_longer_than_the_window_equals_recompute(form):
    model = latent_windowed(window=W, global_every=3)
    P, B, N = 8, 2, 16
    system, own = torch.randint(0, VOCAB, (1, P)), torch.randint(0, VOCAB, (B, N))
    with torch.no_grad(), decode_form(model, form):
        full = model(torch.cat([system.expand(B, -1), own], 1))[:, P:]
        cache = shared_cache_for(model, "static", B, P, P + N)
        model(system, cache, 0)
        got = [model(own[:, :3], cache, P), model(own[:, 3:9], cache, P + 3)]
        got += [model(own[:, i:i + 1], cache, P + i) for i in range(9, N)]
    torch.testing.assert_close(torch.cat(got, 1), full, atol=2e-5, rtol=1e-5)
    # the prefix's local layers keep its last W latents, once; each conversation a ring of W
    assert cache.nbytes == ((2 * W + P) * 1 + (2 * W + N) * B) * (R + ROPE) * 4


@pytest.mark.parametrize("pattern", [{"window": W}, {"window": W, "global_every": 3}])
def test_a_latent_ring_allocates_the_formula(pattern):
    model = latent_windowed(**pattern)
    S, B = 40, 3
    cache = cache_for(model, "static", B, S)
    by_hand = sum(S if w is None else min(S, w) for w in list(model.layouts.windows)) * (R + ROPE) * 4 * B
    assert cache.nbytes == by_hand == kv_cache_bytes(3, 1, R + ROPE, S, B, 4, windows=list(model.layouts.windows),
                                                     latent=True)


@pytest.mark.cuda
@pytest.mark.parametrize("latent", [True, False], ids=["mla", "mha"])
def test_windowed_decode_on_cuda_equals_recompute(latent):
    """The GPU check runs this: a 5:1 hybrid (MLA's latent ring, or MHA's K/V ring) on CUDA, the
    absorbed decode past W against a recompute; CUDA's SDPA kernels lay outputs out differently
    (a view where a reshape is needed fails only there)."""
    torch.manual_seed(0)
    kind = dict(type="mla", kv_lora_rank=R, qk_rope_head_dim=ROPE) if latent else dict(type="mha")
    model = Decoder(tiny_model_config(num_layers=6), AttentionConfig(window=W, global_every=6, **kind))
    model = model.to("cuda").eval()
    tokens = torch.randint(0, VOCAB, (2, 5 * W), device="cuda")
    with torch.no_grad():
        full = model(tokens)
        cache = cache_for(model, "static", 2, 5 * W)
        got = [model(tokens[:, :2 * W - 1], cache, 0)]
        got += [model(tokens[:, p:p + 1], cache, p) for p in range(2 * W - 1, 5 * W)]
    torch.testing.assert_close(torch.cat(got, 1), full, atol=1e-4, rtol=1e-4)
    heads, width = (1, R + ROPE) if latent else (8, 8)  # MLA's latent, or MHA's 8 heads of 64 / 8
    assert cache.nbytes == kv_cache_bytes(6, heads, width, 5 * W, 2, 4, windows=list(model.layouts.windows),
                                          latent=latent)
