"""Decode-step and prefill benchmarks per attention variant (MHA, GQA, MQA) and cache impl.

Each benchmark checks what it timed: the logits equal a full recompute without a cache, and
the cache holds exactly the bytes of the KV formula.
"""

from __future__ import annotations

import pytest
import torch
from benchkit import (  # noqa: F401
    ATOL,
    BATCH_SIZE,
    PROMPT_LEN,
    VARIANTS,
    bench_decoder,
    formula_bytes,
    pinned_threads,
    prompt_for,
    recompute_last_logits,
    record_config,
    slowdown,
)

from kvbench.cache import cache_for
from kvbench.core.dtypes import CACHE_IMPLS


@pytest.mark.parametrize("impl", CACHE_IMPLS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_step(benchmark, slowdown, variant, impl):
    """One greedy decode step at position PROMPT_LEN over PROMPT_LEN cached positions: the
    token through the model with the cache (``static``/``concat``), or the whole sequence
    again (``none``, which keeps no history) — the step of ``kvbench.generate.greedy_generate``."""
    model = bench_decoder(variant)
    prompt = prompt_for(model)
    S = PROMPT_LEN + 1  # keys attended by the step; also the static cache's max_seq_len
    cache = cache_for(model, impl, BATCH_SIZE, S)
    with torch.inference_mode():
        token = model(prompt, cache, 0, last_only=True)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
    seq = torch.cat([prompt, token], dim=1)  # (B, S)

    @torch.inference_mode()
    def step():
        # Re-running the step writes the same position again, so every call does equal work.
        if cache.stores_history:
            return model(token, cache, PROMPT_LEN)[:, -1]
        return model(seq, cache, 0, last_only=True)[:, -1]

    logits = benchmark(slowdown(step))

    torch.testing.assert_close(logits, recompute_last_logits(model, seq), atol=ATOL, rtol=0)
    expected = 0 if impl == "none" else formula_bytes(model, S)
    assert cache.nbytes == expected
    # What was timed is the variant it is named after: the weights that make K and V have that
    # many heads in every layer (the config alone could say anything).
    D = model.config.head_dim
    for block in model.blocks:
        assert block.attn.wk.weight.shape == block.attn.wv.weight.shape == (VARIANTS[variant] * D, model.config.d_model)
    record_config(benchmark, model, cache_impl=impl, batch_size=BATCH_SIZE,
                  cached_len=PROMPT_LEN, kv_cache_bytes=cache.nbytes,
                  kv_cache_bytes_formula=formula_bytes(model, S))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill(benchmark, variant):
    """The prompt through the model into an empty static cache, last-position logits only
    (what time-to-first-token measures)."""
    model = bench_decoder(variant)
    prompt = prompt_for(model)
    cache = cache_for(model, "static", BATCH_SIZE, PROMPT_LEN)

    @torch.inference_mode()
    def prefill():
        return model(prompt, cache, 0, last_only=True)[:, -1]

    logits = benchmark(prefill)

    torch.testing.assert_close(logits, recompute_last_logits(model, prompt), atol=ATOL, rtol=0)
    assert cache.length == PROMPT_LEN
    assert cache.nbytes == formula_bytes(model, PROMPT_LEN)
    record_config(benchmark, model, cache_impl="static", batch_size=BATCH_SIZE,
                  prompt_len=PROMPT_LEN, kv_cache_bytes=cache.nbytes,
                  kv_cache_bytes_formula=formula_bytes(model, PROMPT_LEN))
