"""Every layer kind that prefills in pieces (``LayerLayout.prefill_piece``: a recurrent kind's chunk,
its state carried from one piece to the next) works in memory of a piece whatever the prompt's
length: an engine's chunked prefill is bounded by its chunk, and task=capacity's prediction assumes
so (issue 59). Found through the registry's examples, as tests/test_layer_kinds.py finds its kinds:
a kind gets this check by registering, and nothing here names one."""

import functools

import torch
from conftest import compose
from recurrent_checks import LiveBytes

from kvbench.cache import Positions, make_cache
from kvbench.jobs.job_config import to_bench_config
from kvbench.layouts.attention import attention_module
from kvbench.layouts.base import Layouts
from kvbench.layouts.build import build_layouts
from kvbench.layouts.kinds import registered

SHORT, LONG = 512, 4096  # positions; the longer is 8x the shorter
GROWTH = 1.5  # at most this much more working memory at LONG than at SHORT


@functools.lru_cache(maxsize=None)
def piecewise():
    """(kind, example, layout, module) for every registered kind's first example with a layer that
    prefills in pieces: that layer's layout and its module alone (seeded), once for the module."""
    found = []
    for kind in registered():
        overrides = next(iter(kind.examples.values()), None)
        if overrides is None:
            continue
        job = to_bench_config(compose(*overrides))
        lay = next((lay for lay in build_layouts(job.model, job.attention) if lay.prefill_piece), None)
        if lay is not None:
            torch.manual_seed(0)
            found.append((kind.name, next(iter(kind.examples)), lay, attention_module(job.model, lay).eval()))
    return found


def test_the_recurrent_kinds_are_found():
    # every kind whose layout prefills in pieces has an example that the check below runs
    assert len(piecewise()) >= 3, [(kind, name) for kind, name, _, _ in piecewise()]


@torch.no_grad()
def test_a_layers_prefill_works_in_memory_of_a_piece_whatever_the_length(one_torch_thread):
    """A whole layer's prefill (its projections, convolution, rule and output) through a static cache
    (a cache-less prefill takes the same path): beyond its input, output, weights and cache, its peak
    of live tensors at 4,096 tokens is within 1.5x its peak at 512. Mamba-2's and KDA's mixers
    projected the whole prompt at once and grew 4.7x and 7.8x here (their rules alone were flat);
    now every kind goes a piece at a time."""
    for kind, name, lay, module in piecewise():
        work = {}
        for T in (SHORT, LONG):
            x = torch.randn(1, T, module.wo.out_features, generator=torch.Generator().manual_seed(0))
            layer = make_cache("static", Layouts([lay]), 1, T).begin(Positions(0, T), 1)[0]
            with LiveBytes(x, *module.parameters(), *module.buffers(), *layer.tensors()) as count:
                out = module(x, None, None, layer, Positions(0, T))
            work[T] = count.peak - out.nbytes
        assert 0 < work[LONG] <= GROWTH * work[SHORT], (kind, name, work)
