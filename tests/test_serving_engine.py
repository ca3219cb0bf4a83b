"""The serving engine against independent references: every request's tokens equal an isolated
greedy decode of it alone (kvbench.generate.greedy_generate on a static cache), for paged and
slot stores, with prefix sharing and with preemptions forced by a small budget, for MHA, GQA, MQA
and MLA; the store never exceeds its budget and its bytes equal the KV formula every iteration;
no request starves; a scripted clock gives the exact timeline the rules imply. A conversation's
every turn, whose prompt is the history the earlier turns produced, equals the isolated greedy
decode of that whole prompt too, whether its history was found in the prefix cache or evicted."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import make_decoder, tiny_model_config
from kv_formula import kv_cache_bytes

from kvbench.cache import cache_for
from kvbench.config.conversations import ConversationsWorkload, ThinkConfig
from kvbench.config.model import AttentionConfig
from kvbench.config.serving import LengthConfig
from kvbench.core.errors import ConfigError
from kvbench.generate import greedy_generate
from kvbench.layouts.pages import StatePage
from kvbench.model import Decoder
from kvbench.serving.conversations import make_chats
from kvbench.serving.paged import PagedStore, SlotStore, bytes_per_token, check_model, plan_for
from kvbench.serving.scheduler import FakeClock, Scheduler
from kvbench.serving.trace import Request
from kvbench.serving.turn_metrics import classify

BS = 4  # tokens per block


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # timelines of one thread, as a job runs


def mla_decoder() -> Decoder:
    torch.manual_seed(0)
    return Decoder(tiny_model_config(), AttentionConfig(type="mla", kv_lora_rank=16, qk_rope_head_dim=4,
                                                        qk_nope_head_dim=8, v_head_dim=8)).eval()


def windowed_decoder() -> Decoder:
    """GPT-OSS's alternation (local, global, ...) on 4 layers, windows of 5, GQA."""
    torch.manual_seed(0)
    return Decoder(tiny_model_config(num_layers=4), AttentionConfig(type="gqa", num_kv_heads=2, window=5,
                                                                     global_every=2)).eval()


def gdn_decoder() -> Decoder:
    """Qwen3.5's pattern in small: 3 Gated DeltaNet layers, then one full attention layer."""
    torch.manual_seed(0)
    cfg = tiny_model_config(num_layers=4, num_heads=4, preset_kv_heads=2, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                            linear_conv_kernel_dim=4)
    return Decoder(cfg, AttentionConfig(layer_types=["linear_attention"] * 3 + ["full_attention"])).eval()


def shared_kv_decoder() -> Decoder:
    """Gemma 3n's cross-layer sharing: the last 2 of 4 layers read their donors' K/V, windows 5 and global."""
    torch.manual_seed(0)
    return Decoder(tiny_model_config(num_layers=4), AttentionConfig(type="gqa", num_kv_heads=2, window=5,
                                                                     global_every=2, kv_shared_layers=2)).eval()


def dsa_decoder() -> Decoder:
    """DeepSeek-V3.2's indexer selecting 5 of up to 30 tokens."""
    torch.manual_seed(0)
    return Decoder(tiny_model_config(), AttentionConfig(type="mla", kv_lora_rank=16, qk_rope_head_dim=4,
                                                        qk_nope_head_dim=8, v_head_dim=8, index_topk=5)).eval()


def workload(vocab, n=10, seed=0, prefix=0):
    """``n`` requests 5 ms apart with random lengths; with ``prefix``, all share that many tokens."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, prefix).tolist()
    requests, prompts = [], []
    for i in range(n):
        own = int(rng.integers(2, 20))
        requests.append(Request(i, 0.005 * i, prefix + own, int(rng.integers(1, 12)), 0 if prefix else None, prefix))
        prompts.append(shared + rng.integers(0, vocab, own).tolist())
    return requests, prompts


# isolated()'s answers by (layout, cache dtype, prompt, output length): the stores under test
# replay the same requests of the same seeded model, and the decode of each alone was ~40 % of the
# CPU of the tests that compare every store with it.
_ISOLATED: dict = {}


def isolated(model, request, prompt, cache_dtype="auto", layout=None):
    """What the request alone gives: prefill then output_len - 1 greedy steps on a static cache
    (storing K/V in ``cache_dtype``, as the store under test does). ``layout``: what ``model`` was
    built as (a MODELS name; tests/test_layer_kinds.py's (kind, example)), alike each time: its
    answers are kept for the other tests asking the same."""
    key = (layout, cache_dtype, tuple(prompt), request.output_len)
    if layout is not None and key in _ISOLATED:
        return list(_ISOLATED[key])
    cache = cache_for(model, "static", 1, request.prompt_len + request.output_len, cache_dtype)
    tokens = greedy_generate(model, torch.tensor([prompt], device=model.device), request.output_len - 1,
                             cache).tokens[0].tolist()
    if layout is not None:
        _ISOLATED[key] = tuple(tokens)
    return tokens


def run(model, store, requests, prompts, observe=None, **kw):
    kw.setdefault("max_prefill_tokens", 8)
    scheduler = Scheduler(model, store, requests, prompts, clock=FakeClock(0.01, 1e-4, 1e-3), observe=observe, **kw)
    return scheduler, scheduler.run()


MODELS = {"mha": lambda: make_decoder(8), "gqa": lambda: make_decoder(2), "mqa": lambda: make_decoder(1),
          "mla": mla_decoder, "window": windowed_decoder, "gdn": gdn_decoder, "shared_kv": shared_kv_decoder,
          "dsa": dsa_decoder}
# the layouts every store replays here: MQA's one K/V head takes GQA's path (a group of query heads
# per K/V head, the pages alike), so GQA stands for it; MQA itself is served through every store by
# the conformance suite (tests/test_layer_kinds.py) and its blocks counted in the budget check below
REPLAYED = [name for name in MODELS if name != "mqa"]
# K/V stored as codes and scales: int8 everywhere, float8 where this torch has it on the CPU
CODES = ["int8"] + (["float8_e4m3fn"] if hasattr(torch, "float8_e4m3fn") else [])


@pytest.mark.parametrize("layout, cache_dtype", [(name, "auto") for name in REPLAYED] +
                         [("gqa", c) for c in CODES] + [("window", "int8")])
@pytest.mark.parametrize("store", ["paged", "paged_small", "prefix_small", "slots", "unified_prefix"])
def test_every_request_gets_the_tokens_of_an_isolated_greedy_decode(layout, cache_dtype, store):
    """A quantized store against an isolated decode through a static cache of the same codes; a
    recurrent hybrid's prefix hits need a saved state (every block here); the unified pool raises
    the attention block to hold a state."""
    model = MODELS[layout]()
    requests, prompts = workload(model.config.vocab_size, prefix=9 if "prefix" in store else 0)
    longest = max(r.prompt_len + r.output_len - 1 for r in requests)
    if store == "slots":  # a window's slot: a ring of W - 1 + 8 positions (forwards of at most 8)
        s = SlotStore(model, 3, longest, cache_dtype, chunk=8)
    else:
        small = store.endswith("small")
        if store.startswith("unified"):
            plan = plan_for(model, 200, BS, cache_dtype, "unified", longest)
            s = PagedStore(model, 0, BS, True, cache_dtype, plan)
        else:
            def paged(blocks):
                return PagedStore(model, blocks, BS, "prefix" in store, cache_dtype,
                                  plan_for(model, blocks, BS, cache_dtype, longest=longest, chunk=8))
            blocks = -(-longest // BS)
            while paged(blocks).unfit(longest, 8):  # small: the largest request fits, little else
                blocks += 1
            s = paged(blocks + (1 if small else 40))
            # room for 3 states, K/V for the largest request alone
            if small and isinstance(s.plan.groups[-1].spec, StatePage):
                s = PagedStore(model, 0, BS, "prefix" in store, cache_dtype,
                               replace(s.plan, capacity=s.plan.need(longest, 8)[:-1] + (3,),
                                       pages=s.plan.need(longest, 8)[:-1] + (3,)))
    scheduler, timeline = run(model, s, requests, prompts)
    outputs = scheduler.outputs()
    for r, p in zip(requests, prompts):
        assert outputs[r.id] == isolated(model, r, p, cache_dtype, layout), r
    preemptions = sum(t.preemptions for t in timeline.traces)
    assert (preemptions > 0) == store.endswith("small")  # the small budget did force recomputes
    hits = sum(t.prefix_hit_tokens for t in timeline.traces)
    assert (hits > 0) == ("prefix" in store and (s.block_size <= 8 or layout != "gdn"))
    assert s.used_blocks == 0 and s.bytes_needed == 0  # everything given back
    assert all(t.finished and len(t.token_s) == t.request.output_len for t in timeline.traces)


def chats(vocab, prefix=0):
    """Four conversations of 2-4 turns arriving within ~0.2 s, think times of ~20 ms."""
    w = ConversationsWorkload(num_requests=4, rate=20.0, prompt=LengthConfig("uniform", 6, 0.5, 2, 10),
                              output=LengthConfig("uniform", 4, 0.5, 1, 6), turns=LengthConfig("uniform", 3, 0.5, 2, 4),
                              think=ThinkConfig("exponential", 0.02), prefix_len=prefix, kv_budget_mb=None,
                              kv_budget_blocks=1)
    return make_chats(w, vocab).plan()


@pytest.mark.parametrize("layout", REPLAYED)
@pytest.mark.parametrize("store", ["prefix", "prefix_small", "system_small", "paged_small"])
def test_every_turn_of_a_conversation_gets_the_tokens_of_an_isolated_greedy_decode(layout, store):
    """Each turn's prompt is the previous turn's prompt and answer and a new message; its tokens are
    those of that whole prompt decoded alone. A small store evicts old histories (and preempts)."""
    model = MODELS[layout]()
    plan = chats(model.config.vocab_size, prefix=9 if store.startswith("system") else 0)
    longest = max(r.prompt_len + r.output_len - 1 for r in plan.requests)
    def paged(blocks):
        return PagedStore(model, blocks, BS, not store.startswith("paged"),
                          plan=plan_for(model, blocks, BS, longest=longest, chunk=8))
    blocks = -(-longest // BS)
    while paged(blocks).unfit(longest, 8):  # small: the largest turn fits, little else
        blocks += 1
    # small: a few blocks more, so that a local layer's pool (sized for decoding sequences) keeps one history
    s = paged(blocks + (3 if store.endswith("small") else 80))
    scheduler = Scheduler(model, s, plan.arrivals, plan.prompts, 8, clock=FakeClock(0.01, 1e-4, 1e-3),
                          follow=plan.follow)
    timeline = scheduler.run()
    served = {(x.request.conversation, x.request.turn): x for x in scheduler.all}
    assert sorted(served) == sorted((r.conversation, r.turn) for r in plan.requests)  # every turn was sent
    for (c, k), x in served.items():
        prompt = x.tokens[:x.request.prompt_len]
        assert x.generated == isolated(model, x.request, prompt, layout=layout), (c, k)
        if k:  # the history: every token of the turn before, then the new message
            before = served[(c, k - 1)]
            assert prompt[:len(before.tokens)] == before.tokens
            assert x.request.arrival_s >= before.trace.token_s[-1]  # sent after the answer
    kinds = [k for k in classify(timeline, recurrent=layout == "gdn").values() if k is not None]
    if store.startswith("paged"):
        assert kinds == []  # nothing was looked up
    if layout == "gdn":
        # a recurrent layer resumes only where a state was saved: its returning turns are classified by
        # the states the store held (tests/test_serving_conversations.py); its preemptions are not
        # asserted (a state pool's own size), its tokens are, above
        assert store.startswith("paged") or len(kinds) == sum(k > 0 for _, k in served)
        return
    if not store.startswith("paged"):
        assert ("evicted" in kinds) == store.endswith("small") and "cached" in kinds
    assert (sum(t.preemptions for t in timeline.traces) > 0) == store.endswith("small")


def held_positions(scheduler):
    """Distinct (block, offset) positions the running sequences' tables hold (shared ones once)."""
    bs, out = scheduler.store.block_size, set()
    for s in scheduler.running:
        out |= {(s.blocks.table[p // bs], p % bs) for p in range(s.blocks.length)}
    return len(out)


@pytest.mark.parametrize("layout", ["mha", "mqa", "mla"])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_the_budget_holds_and_block_accounting_is_the_formula_every_iteration(layout, prefix_caching):
    model = MODELS[layout]()
    a = model.attention
    heads, width, latent = ((1, a.kv_lora_rank + a.qk_rope_head_dim, True) if layout == "mla"
                            else (a.num_kv_heads, model.config.head_dim, False))
    per_token = kv_cache_bytes(model.config.num_layers, heads, width, 1, 1, 4, latent=latent)
    requests, prompts = workload(model.config.vocab_size, n=12, prefix=8 if prefix_caching else 0)
    store = PagedStore(model, 12, BS, prefix_caching)
    # storage allocated = the formula for blocks x block_size positions
    assert store.nbytes == kv_cache_bytes(model.config.num_layers, heads, width, 12 * BS, 1, 4, latent=latent)
    assert bytes_per_token(model) == per_token
    seen = []

    def observe(sch):
        st = sch.store
        tables = [s.blocks.table for s in sch.running]
        in_use = {b for t in tables for b in t}
        assert len(in_use) == st.used_blocks <= st.num_blocks  # never over the budget
        assert st.bytes_used == st.used_blocks * BS * per_token <= st.num_blocks * BS * per_token
        for s in sch.running:  # a sequence holds exactly ceil(length / block_size) blocks
            assert len(s.blocks.table) == -(-s.blocks.length // BS)
        assert st.bytes_needed == held_positions(sch) * per_token
        if not prefix_caching:  # nothing shared: the formula per sequence, waste < block_size each
            lengths = [s.blocks.length for s in sch.running]
            assert st.bytes_needed == sum(kv_cache_bytes(model.config.num_layers, heads, width, n, 1, 4,
                                                         latent=latent) for n in lengths)
            assert all(-(-n // BS) * BS - n < BS for n in lengths)
        assert st.bytes_used - st.bytes_needed <= len(sch.running) * (BS - 1) * per_token
        seen.append(sch.samples[-1])

    scheduler, timeline = run(model, store, requests, prompts, observe=observe)
    assert len(seen) == scheduler.iterations == len(timeline.samples)
    assert max(s.kv_blocks_used for s in timeline.samples) == 12  # the budget was reached
    assert timeline.bytes_per_token == per_token and timeline.kv_blocks_total == 12
    assert store.used_blocks == 0 and all(r == 0 for pool in store.pools for r in pool.ref)  # all freed at completion


def test_no_request_starves_when_the_budget_holds_only_the_largest():
    model = make_decoder(2)
    requests, prompts = workload(model.config.vocab_size, n=16, seed=4)
    need = max(-(-(r.prompt_len + r.output_len - 1) // BS) for r in requests)
    scheduler, timeline = run(model, PagedStore(model, need, BS, False), requests, prompts, max_prefill_tokens=3)
    assert all(t.finished for t in timeline.traces)
    assert sum(t.preemptions for t in timeline.traces) > 0
    for r, p in zip(requests, prompts):
        assert scheduler.outputs()[r.id] == isolated(model, r, p)


def test_a_scripted_clock_gives_the_timeline_the_rules_imply():
    """A: prompt 12 in chunks of 5 (3 iterations), 3 tokens; B arrives at 0.025, prompt 4, 2 tokens.
    Every iteration costs 10 ms: it 1-3 prefill A (first token at 0.03, B arrives during it 3),
    it 4 decodes A and prefills B (4 of the 5 tokens' budget), it 5 decodes both."""
    model = make_decoder(8)
    requests = [Request(0, 0.0, 12, 3), Request(1, 0.025, 4, 2)]
    prompts = [list(range(12)), list(range(4))]
    scheduler = Scheduler(model, PagedStore(model, 16, BS), requests, prompts, max_prefill_tokens=5,
                          clock=FakeClock(step_s=0.01))
    timeline = scheduler.run()
    a, b = timeline.traces
    assert a.scheduled_s == 0.0 and a.token_s == pytest.approx([0.03, 0.04, 0.05])
    assert b.scheduled_s == pytest.approx(0.03) and b.token_s == pytest.approx([0.04, 0.05])
    assert timeline.duration_s == pytest.approx(0.05)
    assert [(s.running, s.waiting) for s in timeline.samples] == [(1, 0), (1, 0), (1, 0), (2, 0), (2, 0)]
    assert [s.t_s for s in timeline.samples] == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.05])


def test_prefix_hits_are_full_blocks_of_the_prompt_but_its_last_token():
    model = make_decoder(8)
    shared = list(range(10))  # 2 full blocks of 4 and 2 tokens
    requests = [Request(0, 0.0, 13, 2, 0, 10), Request(1, 1.0, 12, 2, 0, 10), Request(2, 2.0, 8, 2, 0, 8)]
    prompts = [shared + [50, 51, 52], shared + [60, 61], shared[:8]]
    scheduler = Scheduler(model, PagedStore(model, 16, BS), requests, prompts, clock=FakeClock(0.01))
    a, b, c = scheduler.run().traces
    assert (a.prefix_hit_tokens, a.prefix_query_tokens) == (0, 13)
    assert (b.prefix_hit_tokens, b.prefix_query_tokens) == (8, 12)  # blocks 0-1; the 2 tokens after differ
    assert (c.prefix_hit_tokens, c.prefix_query_tokens) == (4, 8)  # 8 tokens: at most 7 looked up, 1 block
    for r, p in zip(requests, prompts):
        assert scheduler.outputs()[r.id] == isolated(model, r, p)


@pytest.mark.parametrize("layout", ["window", "shared_kv"])
def test_a_slot_store_keeps_a_ring_of_the_window_for_local_layers(layout):
    """A local layer's slot is a ring of W - 1 + chunk positions (5 - 1 + 8 = 12 here), not the slot's
    30: what the store allocates is that by hand; requests longer than the ring wrap it and decode the
    tokens of a static cache holding every position; a forward longer than the chunk it was sized for
    is refused rather than overwriting keys it reads."""
    model = MODELS[layout]()
    requests, prompts = workload(model.config.vocab_size, n=6, seed=3)
    slot = max(r.prompt_len + r.output_len - 1 for r in requests)
    assert slot > 12  # some request wraps its ring
    store = SlotStore(model, 2, slot, chunk=8)
    position = 2 * 2 * 8 * 4  # K and V, 2 heads of 8, float32
    # window: layers 0, 2 local (ring of 12), 1, 3 global; shared_kv: the last 2 hold nothing
    local, full = (2, 2) if layout == "window" else (1, 1)
    assert store.nbytes == 2 * (local * 12 + full * slot) * position
    assert store.nbytes == store.storage_bytes == 2 * sum(store.plan.page_bytes)
    scheduler, timeline = run(model, store, requests, prompts)
    for r, p in zip(requests, prompts):
        assert scheduler.outputs()[r.id] == isolated(model, r, p), r
    # chunks of 9: the second (positions 9..17) reads keys 5..17, 13 of them
    with pytest.raises(ValueError, match="reads 13 keys of a layer whose slot is a ring of 12"):
        run(model, SlotStore(model, 1, 21, chunk=8), [Request(0, 0.0, 20, 2)], [list(range(20))], max_prefill_tokens=9)


def test_a_slot_store_admits_only_as_many_requests_as_it_has_slots():
    model = make_decoder(1)
    requests, prompts = workload(model.config.vocab_size, n=8)
    slot = max(r.prompt_len + r.output_len - 1 for r in requests)
    store = SlotStore(model, 2, slot)
    assert store.nbytes == kv_cache_bytes(2, 1, 8, 2 * slot, 1, 4)
    running = []
    scheduler, timeline = run(model, store, requests, prompts, observe=lambda s: running.append(len(s.running)))
    assert max(running) == 2 and sum(t.preemptions for t in timeline.traces) == 0
    assert timeline.store == "slots" and timeline.block_size == slot


def test_what_the_stores_do_not_hold_is_refused_in_one_line():
    """Every layout is served (a hybrid's attention layers quantized, its state not); what remains
    refused is a layer's own limit (mxfp4's blocks of 32 a head of 16 does not fill) and a request
    larger than the store."""
    check_model(windowed_decoder())
    check_model(make_decoder(2), "int8")
    check_model(gdn_decoder(), "int8")
    check_model(gdn_decoder(), "nvfp4")
    blocks = r"^cache.dtype='mxfp4': stores blocks of 32 values of a head, and head_dim=16 "
    with pytest.raises(ConfigError, match=blocks):
        check_model(gdn_decoder(), "mxfp4")
    with pytest.raises(ConfigError, match=blocks):
        PagedStore(gdn_decoder(), 8, BS, cache_dtype="mxfp4")
    model = make_decoder(2)
    with pytest.raises(ValueError, match="request 0 needs 3 blocks, the store has 2"):
        Scheduler(model, PagedStore(model, 2, BS), [Request(0, 0.0, 8, 4)], [list(range(8))])


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_on_cuda_every_request_gets_the_tokens_of_an_isolated_greedy_decode(layout):
    """The gather, the writes and the masks on the GPU: preempted and prefix-shared requests alike."""
    model = MODELS[layout]().cuda()
    requests, prompts = workload(model.config.vocab_size, prefix=9)
    longest = max(r.prompt_len + r.output_len - 1 for r in requests)
    scheduler, timeline = run(model, PagedStore(model, -(-longest // BS) + 1, BS, True), requests, prompts)
    assert sum(t.preemptions for t in timeline.traces) > 0 and sum(t.prefix_hit_tokens for t in timeline.traces) > 0
    for r, p in zip(requests, prompts):
        assert scheduler.outputs()[r.id] == isolated(model, r, p)
