"""The conformance suite of the layer kinds (issue 54): every check here runs over every example of
every registered kind (:func:`kvbench.layouts.kinds.registered`, each kind's ``examples``: Hydra
overrides that build a small decoder using it), so a kind gets every check by registering and
nothing here names one. Each check holds a figure against an independent reference (the bytes of
the tensors a store allocates, a recompute of the whole sequence without a cache, a greedy decode
of a request alone); where a kind cannot do something, what its layout says about itself (its
``limits()``, whether it holds a state, the positions it keeps) predicts a refusal, and the check
asserts that refusal is one line naming the key and the value.

One decoder per example, built once for the module (:func:`example`); tiny shapes, few tokens."""

import functools
import re

import pytest
import torch
from conftest import compose
from test_serving_engine import isolated, workload

from kvbench.cache import Cache, cache_for
from kvbench.cli_job import _inspect
from kvbench.config.bench import COMPILE_MODES, CacheConfig
from kvbench.config.compare import VARIANT_OPTIONS, CompareConfig, variant_fields
from kvbench.config.layer_pattern import job_variant_label, variant_key, variant_label
from kvbench.config.model import attention_type
from kvbench.config.serving import ALLOCATORS
from kvbench.config.serving import STORES as STORE_KINDS
from kvbench.core.dtypes import CACHE_DTYPES, CACHE_IMPLS, DTYPE_BYTES
from kvbench.core.errors import ConfigError
from kvbench.generate import chunked_prefill, decode_step, prefill
from kvbench.jobs.job_config import to_bench_config
from kvbench.layouts.base import Layouts, check_limits, first_of_each
from kvbench.layouts.kinds import registered
from kvbench.serving.paged import PagedStore, SlotStore, plan_for
from kvbench.serving.scheduler import FakeClock, Scheduler
from kvbench.state_cache import StateLayer
from kvbench.tasks.common import build_model
from kvbench.tasks.compare import label as compare_label

EXAMPLES = [pytest.param(kind.name, name, id=f"{kind.name}-{name}") for kind in registered() for name in kind.examples]
OVERRIDES = {(kind.name, name): tuple(overrides) for kind in registered() for name, overrides in kind.examples.items()}

pytestmark = [pytest.mark.parametrize("kind, name", EXAMPLES), pytest.mark.usefixtures("one_torch_thread")]

# a prompt longer than the examples' windows, prefilled in two chunks (the first FIRST tokens), then
# cached steps past it
B, PROMPT, FIRST, STEPS = 2, 12, 5, 4
BLOCK, PREFIX = 4, 6  # serving: tokens per block, and a prompt prefix every request shares
STORES = [("paged", allocator) for allocator in ALLOCATORS] + [("slots", "per_kind")]  # workload.store, .allocator
HISTORY = [impl for impl in CACHE_IMPLS if Cache(impl, [], 1, 1).stores_history]  # the caches a roll back applies to
TOL = 1e-5  # float32 logits of O(1): a cached step and a recompute differ by rounding only (~1e-6)
# the values a setting takes (for a Limit that says only what it allows, the values it excludes);
# a key not here is asked with a value no setting has, which every Limit of that key must refuse too
VALUES = {"cache.impl": CACHE_IMPLS, "cache.dtype": CACHE_DTYPES, "runtime.compile": COMPILE_MODES,
          "cache.shared": (False, True), "kv_conversion": ("none", "repeat", "mean-pool"),
          "workload.store": STORE_KINDS, "workload.allocator": ALLOCATORS}


@functools.lru_cache(maxsize=None)
def example(kind, name, *extra):
    """The example's job (its overrides then ``extra``) and its decoder, built once for the module."""
    job = to_bench_config(compose(*OVERRIDES[kind, name], *extra))
    return job, build_model(job, torch.device("cpu"))


def one_line(exc) -> str:
    """The message of a refusal (``pytest.raises``' info), which must be one line."""
    message = str(exc.value)
    assert message and "\n" not in message, message
    return message


def tokens(model, n, seed=0):
    """(B, n) random token ids of ``model``'s vocabulary, the same for every kind."""
    return torch.randint(model.config.vocab_size, (B, n), generator=torch.Generator().manual_seed(seed))


# ---- bytes: the layouts' formula against the tensors each store allocates ----------------------------------

@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_a_static_cache_allocates_the_formula_in_every_cache_dtype_the_layers_take(kind, name, state_dtype):
    """Layouts.cache_bytes at the cache's length (each layer's own sequence_bytes: a ring holds W of
    them, a state the same at any length, a compressed pool an entry per m) and bytes_per_token +
    state_bytes are the bytes of the tensors the cache holds; a cache.dtype some layer refuses is
    refused in one line naming it. cache.dtype applies to the layers that keep K/V: a layer that
    holds a recurrent state takes every one, and what any layer holds whatever the length (a state,
    a compressor's buffer) keeps its bytes (a state keeps cache.state_dtype)."""
    # the example's own decoder where state_dtype is the config's default (one compose fewer per example)
    job, model = example(kind, name, *([] if state_dtype == CacheConfig.state_dtype else
                                        [f"cache.state_dtype={state_dtype}"]))
    assert job.cache.state_dtype == state_dtype
    layers, element = model.layouts, model.dtype.itemsize
    states = Layouts(layer for layer in layers if layer.state is not None)
    for cache_dtype in CACHE_DTYPES:
        assert states.accepts({"cache.dtype": cache_dtype}) and states.bytes_per_token(element, cache_dtype) == 0
        assert layers.state_bytes(element, cache_dtype) == layers.state_bytes(element)
        if not layers.accepts({"cache.dtype": cache_dtype}):
            with pytest.raises(ConfigError) as info:
                cache_for(model, "static", B, 24, cache_dtype)
            assert one_line(info).startswith(f"cache.dtype={cache_dtype!r}: ")
            continue
        for S in (1, 24):
            cache = cache_for(model, "static", B, S, cache_dtype)
            allocated = sum(t.untyped_storage().nbytes() for t in cache.tensors())
            assert allocated == cache.nbytes == layers.cache_bytes(S, B, element, cache_dtype), (cache_dtype, S)
            assert cache.nbytes == B * sum(layer.sequence_bytes(S, element, cache_dtype) for layer in layers)
        # one position before any window fills, and the state: the same total at length 1
        assert layers.cache_bytes(1, B, element, cache_dtype) == B * (
            layers.bytes_per_token(element, cache_dtype) + layers.state_bytes(element, cache_dtype))


def page(layer, element, cache_dtype, positions):
    """One page of ``layer``'s in a store, by its layout's page spec (``positions`` per block): held
    to the layout's own formula (its bytes per sequence at any length are the layout's)."""
    spec = layer.page_spec(element, cache_dtype)
    for length in (1, 5, 24):
        assert spec.sequence_bytes(length) == layer.sequence_bytes(length, element, cache_dtype), length
    return spec.page_bytes(positions)


def group_formula(plan, layers, element, cache_dtype="auto"):
    """The bytes a plan's storage holds by the layouts' page specs: per group, its capacity of
    blocks, a block a page of each of its layers (``block_size`` positions, a state, a compressed
    pool's block of positions or of entries)."""
    return sum(n * sum(page(layers[i], element, cache_dtype, plan.block_size) for i in group.layers)
               for group, n in zip(plan.groups, plan.capacity))


def taken(layers):
    """The cache.dtypes every layer takes (the others: the static cache's test asks their refusal)."""
    return [cache_dtype for cache_dtype in CACHE_DTYPES if layers.accepts({"cache.dtype": cache_dtype})]


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_a_paged_store_allocates_the_formula_for_its_blocks(kind, name, allocator):
    """In every cache.dtype the layers take: every layer that holds bytes is in one group of the
    store, and the store's tensors are the formula's bytes for each group's blocks (per_kind: a
    pool per group; unified: pages raised to hold a state)."""
    job, model = example(kind, name)
    layers, element = model.layouts, model.dtype.itemsize
    if not layers.accepts({"workload.store": "paged", "workload.allocator": allocator}):
        with pytest.raises(ConfigError) as info:
            PagedStore(model, 0, BLOCK, plan=plan_for(model, 40, BLOCK, allocator=allocator, longest=24))
        one_line(info)
        return
    for cache_dtype in taken(layers):
        plan = plan_for(model, 40, BLOCK, cache_dtype, allocator, longest=24)
        store = PagedStore(model, 0, BLOCK, cache_dtype=cache_dtype, plan=plan)
        holding = [i for i, lay in enumerate(layers) if lay.bytes_per_position(element) or lay.state_bytes(element)]
        assert sorted(i for group in plan.groups for i in group.layers) == holding
        assert all(n > 0 for n in plan.capacity)
        if store.shared is None:  # a pool per group: each group's blocks of its layers
            assert store.nbytes == group_formula(plan, layers, element, cache_dtype) > 0, cache_dtype
            continue
        # unified: one byte pool of pages, a page one layer's block of block_size positions (or its
        # state, or a compressed pool's block), as big as the largest of them by the formula
        one = max(page(layers[i], element, cache_dtype, plan.block_size) for group in plan.groups for i in group.layers)
        assert store.nbytes == plan.pages[0] * one > 0, cache_dtype


def test_a_slot_store_allocates_the_formula_for_its_slots(kind, name):
    """The serving store's static cache, in every cache.dtype the layers take: each slot every
    layer's positions of ``slot_len`` (a local layer's too: a ring of W - 1 + 512 positions is longer
    than a slot of 20) and each state once: the pages of a slot its page spec says (a compressed
    pool's: a block of every position, their entries' block, its buffer's pages)."""
    job, model = example(kind, name)
    layers, element = model.layouts, model.dtype.itemsize
    for cache_dtype in taken(layers):
        store = SlotStore(model, 3, 20, cache_dtype)
        specs = [(layer, layer.page_spec(element, cache_dtype)) for layer in layers]
        assert store.nbytes == 3 * sum(page(layer, element, cache_dtype, spec.slot_positions(20, 512)) *
                                       spec.slot_pages(20, 512) for layer, spec in specs if spec is not None)
        if all(spec is None or spec.slot_pages(20, 512) == 1 for _, spec in specs):  # positions and states
            assert store.nbytes == 3 * (20 * layers.bytes_per_token(element, cache_dtype) + layers.state_bytes(element))


# ---- decoding: cached steps against a recompute ----------------------------------------------------------

def recompute(model, ids):
    """Logits of every position of ``ids`` (B, T) by one forward without a cache."""
    with torch.no_grad():
        return model(ids)


def cached(model, cache, ids):
    """``ids`` (B, T) through ``cache``: the prompt (all but the last STEPS tokens) in two chunks,
    the second continuing what the first left held (a ring's earlier keys, a state), then STEPS
    decode steps; the logits after each forward (B, STEPS + 2, V), for positions FIRST - 1, then
    T - STEPS - 1 onwards."""
    P = ids.shape[1] - STEPS
    with torch.no_grad():
        out = [prefill(model, ids[:, :FIRST], cache), prefill(model, ids[:, FIRST:P], cache, FIRST)]
        out += [decode_step(model, ids[:, p:p + 1], cache, p) for p in range(P, ids.shape[1])]
    return torch.stack(out, 1)


def at_cached(logits, T):
    """The positions of a recompute's ``logits`` (B, T, V) that :func:`cached` gives."""
    return logits[:, [FIRST - 1] + list(range(T - STEPS - 1, T))]


@pytest.mark.parametrize("impl", CACHE_IMPLS)
def test_prefill_then_cached_decode_equals_a_recompute(kind, name, impl):
    """Every cache.impl the layers take (one they refuse: one line naming it): a prompt longer than
    any window in two chunks, then steps past it, give a recompute's logits; what a cache holds
    after them is the layouts' formula at that length."""
    job, model = example(kind, name)
    T = PROMPT + STEPS
    if not model.layouts.accepts({"cache.impl": impl}):
        with pytest.raises(ConfigError) as info:
            cache_for(model, impl, B, T)
        assert one_line(info).startswith(f"cache.impl={impl!r}: ")
        return
    ids, cache = tokens(model, T), cache_for(model, impl, B, T)
    want = at_cached(recompute(model, ids), T)
    if cache.stores_history:
        torch.testing.assert_close(cached(model, cache, ids), want, atol=TOL, rtol=0)
        assert cache.nbytes == model.layouts.cache_bytes(T, B, model.dtype.itemsize)
    else:  # no history: each step re-runs the whole sequence, its last position compared
        got = [prefill(model, ids[:, :p], cache) for p in [FIRST] + list(range(PROMPT, T + 1))]
        torch.testing.assert_close(torch.stack(got, 1), want, atol=TOL, rtol=0)
        assert cache.nbytes == 0


class Forwards:
    """``model`` counting the tokens of each forward it runs."""

    def __init__(self, model):
        self.model, self.tokens = model, []

    def __call__(self, ids, *args, **kwargs):
        self.tokens.append(ids.numel())
        return self.model(ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_a_copied_prefill_holds_what_prefilling_the_shared_history_holds(kind, name):
    """capacity.copy_prompts: the first sequence's history prefilled alone and copied into the other
    rows, the last chunk over the batch, leaves every tensor of the cache (K/V, rings, states, pools)
    and the logits as a prefill of the whole batch whose prompts share that history does; no forward
    holds more tokens than the chunk; the decode steps after it are the batch's."""
    job, model = example(kind, name)
    batch, chunk, T = 4, 8, PROMPT + STEPS
    first = PROMPT - chunk // batch  # the batch's last forward: a full chunk
    ids = torch.randint(model.config.vocab_size, (batch, T), generator=torch.Generator().manual_seed(3))
    shared = ids.clone()
    shared[1:, :first] = ids[0, :first]
    want, want_cache = [], cache_for(model, "static", batch, T)
    got, got_cache = [], cache_for(model, "static", batch, T)
    counted = Forwards(model)
    for out, run, cache, prompt, copied in ((want, model, want_cache, shared, False),
                                            (got, counted, got_cache, ids, True)):
        out.append(chunked_prefill(run, prompt[:, :PROMPT], cache, 0, chunk, copied=copied))
        out.extend(decode_step(model, prompt[:, p:p + 1], cache, p) for p in range(PROMPT, T))
    torch.testing.assert_close(torch.stack(got, 1), torch.stack(want, 1), atol=TOL, rtol=0)
    for a, b in zip(got_cache.tensors(), want_cache.tensors(), strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=TOL, rtol=0)
    assert max(counted.tokens) <= chunk
    assert sum(counted.tokens) == first + batch * (PROMPT - first)  # 1/B of the history's compute


def lost(layer, length, held):
    """Whether ``layer`` no longer holds what a continuation at ``length`` reads once ``held``
    positions were written: what it holds whatever the length (a state, a compressor's buffer)
    folded them (only 0, a fresh start, or ``held`` itself), a ring overwrote the first position a
    query at ``length`` still sees."""
    if layer.state is not None or layer.state_bytes(4):
        return length not in (0, held)
    return length > 0 and layer.first_kept(length) < held - layer.positions_held(held)


@pytest.mark.parametrize("impl", HISTORY)
def test_truncate_then_decode_equals_a_recompute_at_that_length(kind, name, impl):
    """Every cache.impl the layers take that keeps a history, rolled back one position, to an
    earlier length and to 0: refused exactly where some layer no longer holds what the next step
    reads (:func:`lost`, from what each layout says it keeps), in one line, the cache left as it
    was (the next step still equals a recompute: no layer forgot its tail); where it works, the
    sequence continues from there as a recompute of the shorter sequence does."""
    job, model = example(kind, name)
    held = PROMPT + STEPS
    if not model.layouts.accepts({"cache.impl": impl}):
        with pytest.raises(ConfigError) as info:
            cache_for(model, impl, B, held + 1)
        assert one_line(info).startswith(f"cache.impl={impl!r}: ")
        return
    ids, other = tokens(model, held + 1), tokens(model, held + 1, seed=1)
    for length in (held - 1, FIRST, 0):
        cache = cache_for(model, impl, B, held + 1)
        cached(model, cache, ids[:, :held])
        refused = any(lost(layer, length, held) for layer in model.layouts)
        if refused:
            with pytest.raises(ValueError) as info:
                cache.truncate(length)
            assert one_line(info).startswith(f"cannot truncate to {length}: ") and cache.length == held
            with torch.no_grad():
                step = decode_step(model, ids[:, held:], cache, held)
            torch.testing.assert_close(step, recompute(model, ids)[:, -1], atol=TOL, rtol=0)
            continue
        cache.truncate(length)
        seq = torch.cat([ids[:, :length], other[:, length:length + STEPS + 1]], 1)  # on from ``length``, other tokens
        with torch.no_grad():
            got = [prefill(model, seq[:, length:length + 1], cache, length)] + [
                decode_step(model, seq[:, p:p + 1], cache, p) for p in range(length + 1, seq.shape[1])]
        torch.testing.assert_close(torch.stack(got, 1), recompute(model, seq)[:, length:], atol=TOL, rtol=0)


# ---- what the layers do not run with ---------------------------------------------------------------------

def excluded(limit):
    """Values of the limit's key that it refuses: those it names, or those outside what it allows."""
    if limit.refuses:
        return list(limit.refuses)
    values = [v for v in VALUES.get(limit.key, ()) if limit.excludes(v)]
    return values or [f"not-{limit.key}"]


def test_every_limit_is_refused_in_one_line_naming_the_key_and_the_value(kind, name):
    """Each Limit each layout declares (as the first layer that has it), for every value it
    excludes: the model's layers refuse it in one line, ``key=value: why`` (or the layout's own key
    where the limit names it) with the why of the first layer and limit that excludes it; what no
    limit excludes passes."""
    job, model = example(kind, name)
    limits = [limit for index, layer in first_of_each(model.layouts) for limit in layer.limits(index)]
    for limit in limits:
        for value in excluded(limit):
            first = next(lim for lim in limits if lim.key == limit.key and lim.excludes(value))
            with pytest.raises(ConfigError) as info:
                check_limits(model.layouts, {limit.key: value})
            assert one_line(info) == f"{first.names or f'{limit.key}={value!r}'}: {first.why}"
        for value in VALUES.get(limit.key, ()):
            if not any(lim.key == limit.key and lim.excludes(value) for lim in limits):
                check_limits(model.layouts, {limit.key: value})


# ---- serving ---------------------------------------------------------------------------------------------

def serving_store(model, store, allocator, longest):
    """A store of ``workload.store`` and ``workload.allocator`` for ``model`` with room for several
    requests (paged: prefix caching on, a state saved at every block)."""
    if store == "slots":
        return SlotStore(model, 3, longest)
    return PagedStore(model, 0, BLOCK, True, plan=plan_for(model, 60, BLOCK, allocator=allocator, longest=longest))


@pytest.mark.parametrize("store, allocator", STORES)
def test_serving_replays_the_tokens_of_an_isolated_greedy_decode(kind, name, store, allocator):
    """Requests sharing a prefix, batched by the scheduler through each store (a store the layers
    do not take: one line): every request's tokens are those of it decoded alone (the serving
    tests' isolated greedy decode on a static cache), the prefix found in the cache wherever it
    spans the positions a prefix is continued at (a block; a compressed pool's: a multiple of its
    rate too), and every block given back."""
    job, model = example(kind, name)
    requests, prompts = workload(model.config.vocab_size, n=5, prefix=PREFIX)
    longest = max(r.prompt_len + r.output_len - 1 for r in requests)
    if not model.layouts.accepts({"workload.store": store, "workload.allocator": allocator}):
        with pytest.raises(ConfigError) as info:
            serving_store(model, store, allocator, longest)
        one_line(info)
        return
    s = serving_store(model, store, allocator, longest)
    scheduler = Scheduler(model, s, requests, prompts, 8, clock=FakeClock(0.01, 1e-4, 1e-3))
    timeline = scheduler.run()
    outputs = scheduler.outputs()
    for request, prompt in zip(requests, prompts):
        assert outputs[request.id] == isolated(model, request, prompt, layout=(kind, name)), request
    hits = sum(t.prefix_hit_tokens for t in timeline.traces)
    assert (hits > 0) == (s.prefix_caching and s.prefix_step < PREFIX), hits
    assert s.prefix_step % s.block_size == 0
    assert s.used_blocks == 0 and all(t.finished for t in timeline.traces)


# ---- inspect ---------------------------------------------------------------------------------------------

def cell_bytes(cell: str) -> float:
    """A bytes cell as inspect prints it (``512 B``, ``1.50 KiB (1,536)``, ``≈74,638``): its exact number."""
    found = re.search(r"\(≈?([\d,]+)\)$", cell) or re.fullmatch(r"≈?([\d,]+) B", cell)
    assert found, cell
    return int(found.group(1).replace(",", ""))


def table_row(text: str, first: str):
    """Inspect's table led by ``first`` (its header's first cell) as {header: the runtime dtype's cell},
    its parts joined where it was printed as several to fit the width."""
    header, row = [], []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(first):
            header += re.split(r"\s{2,}", line.strip())[1:]
            row += next(re.split(r"\s{2,}", r.strip())[1:] for r in lines[i + 1:] if r.startswith("float32 "))
    return dict(zip(header, row))


def test_inspect_prints_the_bytes_per_token_and_per_sequence_a_cache_allocates(kind, name, capsys):
    """task=inspect, run in process as the CLI runs it: its float32 row's per sequence is the bytes a
    static cache of that length allocates for one sequence (and the layouts' formula), its state per
    sequence what a static cache of one position holds beyond that position (a state, a compressor's
    buffer: a column only where some layer holds one), its per token the rest over the length, its
    per batch batch x per sequence."""
    S, batch = 40, 3
    overrides = ("task=inspect", "runtime.dtype=float32", "workload.prompt_len=32", "workload.gen_len=8",
                 f"workload.batch_size={batch}")
    assert _inspect(compose(*OVERRIDES[kind, name], *overrides)) == 0
    row = table_row(capsys.readouterr().out, "KV dtype")
    job, model = example(kind, name)
    assert model.dtype == torch.float32  # the row compared: inspect's runtime.dtype
    cache = cache_for(model, "static", 1, S)
    layers, element = model.layouts, DTYPE_BYTES["float32"]
    state = cache_for(model, "static", 1, 1).nbytes - layers.bytes_per_token(element)
    recurrent = sum(t.nbytes for layer in cache.layers if isinstance(layer, StateLayer) for t in layer.tensors())
    assert recurrent == Layouts(layer for layer in layers if layer.state is not None).state_bytes(element) <= state
    per_sequence = cache.nbytes
    assert per_sequence == layers.cache_bytes(S, 1, element) and state == layers.state_bytes(element)
    assert cell_bytes(row[f"per sequence ({S})"]) == per_sequence
    assert cell_bytes(row[f"per batch (x{batch})"]) == batch * per_sequence
    per_token = next(v for k, v in row.items() if k.startswith("per token"))
    assert cell_bytes(per_token) == round((per_sequence - state) / S)
    if state:
        assert cell_bytes(row["state per sequence"]) == state
    else:
        assert "state per sequence" not in row


# ---- its name --------------------------------------------------------------------------------------------

def read_by_compare(job, spec):
    """``spec`` as task=compare reads a compare.variants entry: its resolved attention for the job's
    model (beside a baseline of another layout: compare takes two or more)."""
    baseline = "2" if spec == "1" else "1"
    return CompareConfig(variants=[spec, baseline]).attentions(job.model)[0]


def compare_spec(job) -> str:
    """The compare.variants entry for a job's resolved attention, by compare's syntax: its KV-head
    count (its type where a count does not say it), then ``:<letter><value>`` for each field compare
    has a letter for (:data:`VARIANT_OPTIONS`) that is set to a number; a pattern of layer types that
    is left, as the letter and count compare reads as that pattern."""
    a = job.attention
    head = str(a.num_kv_heads) if attention_type(job.model.num_heads, a.num_kv_heads) == a.type else a.type
    spec = head + "".join(f":{letter}{getattr(a, field)}" for letter, field in VARIANT_OPTIONS.items()
                          if isinstance(getattr(a, field, None), int) and getattr(a, field) not in (0, False))
    if a.layer_types is None or read_by_compare(job, spec).layer_types == a.layer_types:
        return spec
    for letter in VARIANT_OPTIONS:
        for count in range(1, job.model.num_layers + 1):
            try:
                if read_by_compare(job, f"{spec}:{letter}{count}").layer_types == a.layer_types:
                    return f"{spec}:{letter}{count}"
            except ConfigError:  # not a count this letter takes here
                continue
    return spec


def test_its_label_round_trips_through_compares_syntax(kind, name):
    """The job's variant label, written as a compare.variants entry and read back as task=compare
    reads it, is the same label and metric prefix, and no other example's; a part of the label
    compare has no letter for (learned sinks today), written as an option, is refused in one line
    naming compare.variants and the entry."""
    job = example(kind, name)[0]
    label, L = job_variant_label(job), job.model.num_layers
    spec = compare_spec(job)
    back, a = read_by_compare(job, spec), job.attention
    # everything compare has a letter for is read back as the job has it (0, False and None: off)
    for field in ("type", "num_kv_heads", "layer_types", *VARIANT_OPTIONS.values()):
        assert (getattr(back, field, None) or None) == (getattr(a, field, None) or None), (field, spec)
    words, kept = label.split(), variant_label(back, num_layers=L).split()
    assert kept[:2] == words[:2] and kept == [w for w in words if w in kept], (label, spec, kept)
    assert compare_label(back, L) == variant_key(" ".join(kept))
    for word in (w for w in words if w not in kept):  # what compare cannot name
        with pytest.raises(ConfigError) as info:
            variant_fields(f"{spec}:{word}")
        assert one_line(info).startswith(f"compare.variants={spec + ':' + word!r}: ")
    others = {variant_key(job_variant_label(example(*other)[0])) for other in OVERRIDES if other != (kind, name)}
    assert variant_key(label) not in others  # tables and compare's prefixes tell the examples apart


# ---- quality: measured on a model of the variant's own layouts, or none --------------------------------------

def test_capacitys_quality_figure_is_measured_on_a_model_of_the_variants_layouts(kind, name, monkeypatch):
    """issue 59: a quality figure under a variant's label comes from a model whose layer layouts are the
    variant's, layer by layer (pooling the MHA model's K/V heads makes K/V heads and masks windows, never a
    recurrent or a latent layer), or it is null with a one-line reason naming the layer kind it cannot make
    (a Gated DeltaNet hybrid was given GQA-2's figures)."""
    from kvbench.tasks import capacity_quality

    job, model = example(kind, name)
    measured = []

    def fidelity(reference, kv, tokens, attention, pooled):  # the model the figures come from, then them
        measured.append(pooled)
        return {"kv_pool_kl_nats": 0.0, "kv_pool_top1_agreement": 1.0}

    monkeypatch.setattr(capacity_quality, "kv_pool_fidelity", fidelity)
    got = capacity_quality.variant_quality(job, model.layouts, torch.device("cpu"))
    if got["kv_pool_kl_nats"] is None:
        assert got["kv_pool_top1_agreement"] is None and got["quality_source"] is None and not measured
        reason = got["quality_none_reason"]
        assert "\n" not in reason and "are not what pooling the MHA model's K/V heads makes" in reason
        assert any(f"the variant's {k.title or k.name} layers" in reason for k in registered()), reason
        return
    (pooled,) = measured
    assert tuple(pooled.layouts) == tuple(model.layouts) and got["quality_source"]
    assert "quality_none_reason" not in got


# ---- tensor parallel: the decoder cut over ranks ---------------------------------------------------------------

def test_two_tensor_parallel_ranks_decode_token_equal_each_holding_the_per_gpu_formula(kind, name):
    """issue 58: every kind shards. The job's check lets runtime.tensor_parallel=2 run the example; cut over 2
    ranks (threads summing at a barrier, tests/test_parallel.py's stand-in for gloo) it decodes greedily
    token-equal to the whole decoder, each rank's cache allocates the per-GPU formula's bytes (between half the
    whole's and all of it: heads split, fewer heads than ranks replicated) and its weights are what the
    capacity figures count on the meta device."""
    from dataclasses import replace

    from test_parallel import check_ranks_decode_as_one_process

    from kvbench.parallel.plan import check_parallel

    job, model = example(kind, name)
    # the job's check on a GPU's terms: a CPU's count of cores, which bounds CPU ranks, is the machine's, not the kind's
    check_parallel(replace(job, runtime=replace(job.runtime, tensor_parallel=2, device="cuda")))
    check_ranks_decode_as_one_process(model, tokens(model, PROMPT), STEPS)
