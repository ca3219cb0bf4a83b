"""The decode step ``runtime.compile=graph`` times: :class:`kvbench.generate.FixedShapeStep`
compiled with ``fullgraph=True`` and static shapes (GQA, static cache, one greedy step over
128 cached positions, as ``test_decode_step``). Compiled once before timing, untimed.

Checked: the logits equal a cache-less recompute, and timing it compiled nothing (no
recompile). One variant only: each compile costs seconds in every pytest run.
A module of its own, so that a base commit without the compiled step still runs the others.
"""

from __future__ import annotations

import pytest
import torch
from benchkit import (  # noqa: F401
    ATOL,
    BATCH_SIZE,
    PROMPT_LEN,
    bench_decoder,
    formula_bytes,
    pinned_threads,
    prompt_for,
    recompute_last_logits,
    record_config,
    slowdown,
)

from kvbench.cache import cache_for
from kvbench.generate import FixedShapeStep, compiled_graphs


@pytest.mark.e2e
def test_decode_step_graph(benchmark, slowdown):
    model = bench_decoder("gqa")
    prompt = prompt_for(model)
    S = PROMPT_LEN + 1  # keys attended by the step; the cache's max_seq_len, so its one bucket
    cache = cache_for(model, "static", BATCH_SIZE, S)
    step = FixedShapeStep(mode="graph")

    @torch.inference_mode()
    def decode():
        # Re-running the step writes the same position again, so every call does equal work.
        return step(model, token, cache, PROMPT_LEN)

    with torch.inference_mode():
        token = model(prompt, cache, 0, last_only=True)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
    decode()  # compiles, untimed
    graphs = compiled_graphs()
    logits = benchmark(slowdown(decode))

    assert compiled_graphs() == graphs  # every timed call ran the graph compiled above
    torch.testing.assert_close(logits, recompute_last_logits(model, torch.cat([prompt, token], dim=1)),
                               atol=ATOL, rtol=0)
    assert cache.nbytes == formula_bytes(model, S)
    record_config(benchmark, model, cache_impl="static", compile="graph", batch_size=BATCH_SIZE,
                  cached_len=PROMPT_LEN, kv_cache_bytes=cache.nbytes, kv_cache_bytes_formula=formula_bytes(model, S))
