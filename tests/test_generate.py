"""Greedy generation against a full recompute, in each dtype."""

import pytest
import torch
from conftest import make_decoder

from kvbench.cache import cache_for
from kvbench.generate import greedy_generate

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
    assert cache_for(model, "static", 2, 10).k[0].dtype == dtype
    # the low-precision run stays close to float32 with the same weights
    ref = make_decoder(2, dtype=torch.float32)
    ref_out = greedy_generate(ref, prompt, 0, cache_for(ref, "static", 2, 10), keep_logits=True)
    assert (out.logits[:, 0] - ref_out.logits[:, 0]).abs().max() < 0.1
