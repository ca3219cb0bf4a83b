"""Checks every recurrent layer kind shares (Gated DeltaNet, Mamba-2, KDA, DeepSeek-V4's pools):
the live bytes a forward allocates, a constant state held in place, greedy steps against
transformers' generate. One copy, imported by each kind's tests."""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kvbench.cache import Positions
from kvbench.state_cache import StateLayer


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensors ops allocate while it is on, and their peak: each new storage counted
    once while a tensor that any op returned still holds it (views share their base's). Storages
    passed in (the inputs) are not counted."""

    def __init__(self, *inputs: torch.Tensor):
        super().__init__()
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}
        self.holders = {}  # storage address -> [bytes, tensors alive]
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._hold(t)
        return out

    def _hold(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        address, size = storage.data_ptr(), storage.nbytes()
        if address in self.inputs or not size:
            return
        if address not in self.holders:
            self.holders[address] = [size, 0]
            self.now += size
            self.peak = max(self.peak, self.now)
        self.holders[address][1] += 1
        weakref.finalize(t, self._drop, address)

    def _drop(self, address: int) -> None:
        entry = self.holders[address]
        entry[1] -= 1
        if not entry[1]:
            self.now -= entry[0]
            del self.holders[address]


def check_a_constant_state(layers, per_sequence, flops, make_module, run, dtype, state_dtype, d_model, batch=3):
    """``layers`` (a Layouts of one recurrent kind) hold ``per_sequence`` bytes per sequence at any
    length, nothing per token, read all of it each step and do ``flops`` a step; their caches
    allocate exactly that in the compute and state dtypes, and a prompt and 10 decode steps through
    ``make_module(layout)`` (run as ``run(module, cache, x, start)``) write them in place."""
    element = dtype.itemsize
    assert layers.state_bytes(element) == per_sequence and layers.bytes_per_token(element) == 0
    assert [layers.cache_bytes(S, batch, element) for S in (1, 256, 10 ** 6)] == [batch * per_sequence] * 3
    assert [layers.read_bytes(S, batch, element) for S in (1, 10 ** 6)] == [batch * per_sequence] * 2
    assert layers.step_flops(256) == layers.step_flops(4096) == flops
    caches = [StateLayer(lay.state, batch, dtype) for lay in layers]
    assert sum(c.nbytes for c in caches) == batch * per_sequence
    assert [(c.conv.dtype, c.recurrent.dtype) for c in caches] == [(dtype, getattr(torch, state_dtype))] * len(caches)
    before = [t.data_ptr() for c in caches for t in c.tensors()]
    modules = [make_module(lay).to(dtype) for lay in layers]
    with torch.no_grad():
        for start, T in [(0, 40)] + [(t, 1) for t in range(40, 50)]:
            x = torch.randn(batch, T, d_model, dtype=dtype)
            for module, cache in zip(modules, caches):
                assert torch.isfinite(run(module, cache, x, start)).all()
    assert sum(c.nbytes for c in caches) == batch * per_sequence
    assert [t.data_ptr() for c in caches for t in c.tensors()] == before
    assert all(t.abs().sum() > 0 for c in caches for t in c.tensors())


def greedy_steps(last_logits, prompt, want, tol):
    """Greedy tokens from ``last_logits(ids, start)`` (the next token's logits after feeding ``ids``
    at ``start``), as many as transformers' ``want`` (generate's output with its logits) made: each
    token equal, each step's logits within ``tol``. Returns the tokens (B, steps)."""
    tokens, logits, ids, start = [], [], prompt, 0
    for _ in range(len(want.logits)):
        logits.append(last_logits(ids, start))
        start += ids.shape[1]
        ids = logits[-1].argmax(-1, keepdim=True)
        tokens.append(ids)
    tokens = torch.cat(tokens, 1)
    assert torch.equal(tokens, want.sequences[:, prompt.shape[1]:])
    assert (torch.stack(logits, 1) - torch.stack(want.logits, 1)).abs().max() <= tol
    return tokens


def run(module, cache, x, start):
    """One forward of a recurrent mixer over ``x`` (B, T, C) at ``start`` through its ``cache``, as a
    decoder runs it (rotary tables of ones: a recurrent layer must not read them)."""
    ones = torch.ones(x.shape[1], 4)
    return module(x, ones, ones, cache, Positions(start, x.shape[1]))


def step_both(hf, hf_cache, ours, cache, x, parts):
    """Each (start, end) of ``parts`` through transformers' module ``hf`` and kvbench's ``ours`` with
    their caches; the largest difference of each, and kvbench's outputs."""
    diffs, outputs = [], []
    for start, end in parts:
        want, got = hf(x[:, start:end], cache=hf_cache), run(ours, cache, x[:, start:end], start)
        diffs.append((want - got).abs().max().item())
        outputs.append(got)
    return diffs, torch.cat(outputs, 1)


def check_parts_then_steps(cfg, hf, ours, state, x, prompt_parts, tol):
    """A prompt of ``x`` in ``prompt_parts`` (start, end), then a recurrent step per remaining token,
    each equal to transformers' module with its own cache; all outputs equal one prefill of ``x``,
    kvbench's and transformers'; and the last ten depend on the first token through the state."""
    from transformers.cache_utils import DynamicCache

    B, T = x.shape[:2]
    parts = list(prompt_parts) + [(t, t + 1) for t in range(prompt_parts[-1][1], T)]
    diffs, outputs = step_both(hf, DynamicCache(config=cfg), ours, StateLayer(state, B, torch.float32), x, parts)
    assert len(diffs) == len(parts) and max(diffs) <= tol, diffs
    once = run(ours, StateLayer(state, B, torch.float32), x, 0)
    assert (once - outputs).abs().max().item() <= tol
    assert (hf(x) - outputs).abs().max().item() <= tol
    other = x.clone()
    other[:, 0] += 1
    assert (run(ours, StateLayer(state, B, torch.float32), other, 0) - once)[:, T - 10:].abs().max() > 1e-4
