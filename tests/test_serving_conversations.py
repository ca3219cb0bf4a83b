"""Conversations at serving scale against independent references: a returning turn whose history
was evicted finds nothing and prefills it all, one whose history stayed finds its full blocks
(counted position by position); cached / evicted as the store's own log of evictions says; a
run's per-turn TTFT and prefix hits, and its cached / evicted returning turns, recomputed from the
record's tables."""

import numpy as np
import pytest
import torch
from conftest import compose, make_decoder

from kvbench.config.conversations import ConversationsWorkload, ThinkConfig
from kvbench.config.serving import LengthConfig
from kvbench.jobs.runner import run_job
from kvbench.results import read_record
from kvbench.serving.conversations import Chats, make_chats
from kvbench.serving.paged import PagedStore
from kvbench.serving.record import timeline_from_record
from kvbench.serving.scheduler import FakeClock, Scheduler
from kvbench.serving.trace import Request
from kvbench.serving.turn_metrics import classify, conversation_metrics, turn_rows

BS = 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # timelines of one thread, as a job runs


def two_chats(other_len):
    """Conversation 0: a 10-token message answered in 3, then (1 s later) 5 more answered in 2.
    Conversation 1 arrives at 0.1 s with one turn of ``other_len`` tokens (0: no conversation 1)."""
    requests = [Request(0, 0.0, 10, 3, conversation=0, turn=0), Request(1, 0.0, 18, 2, conversation=0, turn=1)]
    prompts = {0: list(range(1, 11))}
    if other_len:
        requests.append(Request(2, 0.1, other_len, 2, conversation=1, turn=0))
        prompts[1] = [(7 * i + 3) % 32 for i in range(other_len)]
    return Chats(requests, prompts, {1: 1.0}, {1: [20, 21, 22, 23, 24]})


def serve_counting(chats, blocks):
    """Serve ``chats`` on ``blocks`` blocks; the positions each request computed (its scheduled
    chunks, summed) and its prefix hits, seen from outside the scheduler."""
    model = make_decoder(2)
    computed = {}

    def observe(s):
        for x, T in s.scheduled:
            computed[x.request.id] = computed.get(x.request.id, 0) + T

    plan = chats.plan()
    scheduler = Scheduler(model, PagedStore(model, blocks, BS), plan.arrivals, plan.prompts, max_prefill_tokens=8,
                          clock=FakeClock(0.01, 1e-4, 1e-3), observe=observe, follow=plan.follow)
    timeline = scheduler.run()
    return {t.request.id: t for t in timeline.traces}, computed, timeline


def test_a_returning_turn_whose_history_was_evicted_finds_nothing_and_prefills_it_all():
    # 8 blocks: conversation 1's 31 positions take all of them while conversation 0 thinks
    traces, computed, timeline = serve_counting(two_chats(30), 8)
    back = traces[1]
    assert back.request.prompt_len == 10 + 3 + 5  # the history (message and answer) and the new message
    assert back.preemptions == 0
    assert back.first_hit_tokens == back.prefix_hit_tokens == 0
    assert back.prefix_query_tokens == 18
    assert computed[1] == 18 + 2 - 1  # its whole prompt prefilled, then one decode step
    assert classify(timeline)[1] == "evicted"
    m = conversation_metrics(timeline)
    assert (m["returning_turns"], m["returning_cached"], m["returning_evicted"]) == (1, 0, 1)
    # its previous turn computed positions 0..11: three full blocks of 4, all recomputed
    assert m["history_reusable_tokens"] == m["history_recomputed_tokens"] == 12


@pytest.mark.parametrize("other_len", [0, 12])
def test_a_returning_turn_whose_history_stayed_finds_its_full_blocks(other_len):
    # conversation 1 (if any) needs 4 blocks: the 5 blocks no key holds are taken before cached ones
    traces, computed, timeline = serve_counting(two_chats(other_len), 8)
    back = traces[1]
    assert back.first_hit_tokens == back.prefix_hit_tokens == 12  # positions 0..11 of the 13 it had
    assert computed[1] == 18 - 12 + 2 - 1  # the rest of the prompt, then one decode step
    assert classify(timeline)[1] == "cached"
    m = conversation_metrics(timeline)
    assert (m["returning_cached"], m["returning_evicted"], m["history_recomputed_tokens"]) == (1, 0, 0)
    assert m["returning_cached_ttft_ms_n"] == 1
    assert m["returning_cached_ttft_ms_mean"] == pytest.approx(1e3 * (back.token_s[0] - back.request.arrival_s))
    assert m["returning_cached_ttft_ms_p50"] is None  # a median of one turn is no median


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cached_or_evicted_is_what_the_stores_evictions_say(seed):
    """A returning turn is evicted exactly when a block its previous turn left registered was
    reused for something else between that turn's end and this one's admission (the store's own
    log, not the hit counts)."""
    model = make_decoder(2)
    w = ConversationsWorkload(num_requests=6, rate=30.0, prompt=LengthConfig("uniform", 8, 0.5, 3, 12),
                              output=LengthConfig("uniform", 4, 0.5, 2, 6), turns=LengthConfig("uniform", 3, 0.5, 2, 4),
                              think=ThinkConfig("exponential", 0.03), kv_budget_mb=None, kv_budget_blocks=1, seed=seed)
    plan = make_chats(w, model.config.vocab_size).plan()
    store = PagedStore(model, -(-max(r.prompt_len + r.output_len for r in plan.requests) // BS) + 6, BS)
    keys, at_end, at_admission = {}, {}, {}

    def observe(s):
        for x in s.running:
            at_admission.setdefault(x.request.id, len(store.evicted))
            if x.trace.finished:  # observed before its blocks are released
                keys[x.request.id] = set(x.blocks.keys)  # its registered blocks' content keys
                at_end[x.request.id] = len(store.evicted)

    timeline = Scheduler(model, store, plan.arrivals, plan.prompts, max_prefill_tokens=8,
                         clock=FakeClock(0.01, 1e-4, 1e-3), observe=observe, follow=plan.follow).run()
    by_turn = {(t.request.conversation, t.request.turn): t.request.id for t in timeline.traces}
    expected = {}
    for (c, k), i in by_turn.items():
        if k:
            prev = by_turn[(c, k - 1)]
            lost = keys[prev] & set(store.evicted[at_end[prev]:at_admission[i]])
            expected[i] = "evicted" if lost else "cached"
    got = {i: kind for i, kind in classify(timeline).items() if kind is not None}
    assert got == expected
    assert "evicted" in got.values() and "cached" in got.values()


@pytest.mark.parametrize("policy, other_len, resumable, found, kind", [
    ("block", 0, 12, 12, "cached"),  # states saved at 4, 8 (prefill) and 12 (a decode step): all 12 resumable
    ("prompt_end", 0, 8, 8, "cached"),  # saved only at its prompt's last block boundary: 8, though 12 have K/V
    ("block", 30, 12, 0, "evicted"),  # conversation 1's 31 positions took the blocks meanwhile
])
def test_a_hybrids_returning_turn_is_cached_or_evicted_by_the_states_the_store_held(policy, other_len, resumable,
                                                                                   found, kind):
    """A Gated DeltaNet hybrid resumes a history only where a state was saved: the store says, when a
    turn finishes, how much of it a new sequence could continue from (its blocks and a saved state
    there), and the next turn is cached when it finds that much. Counted by hand from where the
    checkpoint policy saves: turn 0 computes positions 0..11 (10 prompt tokens, 2 answer tokens fed back)."""
    from dataclasses import replace

    from test_serving_engine import gdn_decoder

    from kvbench.serving.allocator import Checkpoint
    from kvbench.serving.paged import plan_for

    model = gdn_decoder()
    plan = two_chats(other_len).plan()
    pools = plan_for(model, 8, BS, longest=31, chunk=8)
    pools = replace(pools, capacity=(8, 6), pages=(8, 6))  # 8 blocks of the full layer, 6 state pages
    store = PagedStore(model, 0, BS, plan=pools, checkpoint=Checkpoint(policy))
    timeline = Scheduler(model, store, plan.arrivals, plan.prompts, max_prefill_tokens=8,
                         clock=FakeClock(0.01, 1e-4, 1e-3), follow=plan.follow).run()
    first, back = timeline.traces[0], timeline.traces[1]
    assert (first.resumable_tokens, back.first_hit_tokens) == (resumable, found)
    assert classify(timeline, recurrent=True)[1] == kind
    m = conversation_metrics(timeline, recurrent=True)
    assert (m["returning_cached"], m["returning_evicted"]) == ((1, 0) if kind == "cached" else (0, 1))
    assert (m["history_reusable_tokens"], m["history_recomputed_tokens"]) == (resumable, resumable - found)
    assert m["returning_reason"] is None


CONV = ["workload=conversations", "model=tiny", "model.max_seq_len=512", "workload.num_requests=6",
        "workload.rate=8", "workload.prompt.mean=24", "workload.prompt.lo=8", "workload.prompt.hi=40",
        "workload.output.lo=4", "workload.output.hi=12", "workload.think.mean=0.05", "workload.kv_budget_mb=0.25",
        "runtime.isolate=false", "wandb=disabled", "runtime.threads=1", "runtime.warmup=0"]


@pytest.fixture(scope="module")
def conv_record(tmp_path_factory):
    out = tmp_path_factory.mktemp("conversations")
    torch.set_num_threads(1)
    run_job(compose(*CONV), out)
    return read_record(out / "results.json")


def test_a_conversation_record_holds_every_turn_and_its_per_turn_figures_are_its_timelines(conv_record):
    """TTFT per turn index and prefix hits recomputed from tables.serving_requests with numpy alone;
    cached / evicted from the rule in the record's own columns."""
    record = conv_record
    assert record.status == "ok", record.error
    m, rows = record.metrics, record.tables["serving_requests"]
    assert m["conversations"] == 6 == len({r["conversation"] for r in rows})
    assert all(r["output_tokens"] == r["output_len"] for r in rows)
    by = {(r["conversation"], r["turn"]): r for r in rows}
    for (c, k), r in by.items():
        if k:
            prev = by[(c, k - 1)]
            assert r["prompt_len"] > prev["prompt_len"] + prev["output_len"]  # the history and a new message
            assert r["arrival_s"] >= prev["last_token_s"]  # sent after the previous answer
    table = record.tables["conversation_turns"]
    assert [t["turn"] for t in table] == sorted({r["turn"] for r in rows})
    for t in table:
        mine = [r for r in rows if r["turn"] == t["turn"]]
        ttft = [1e3 * (r["first_token_s"] - r["arrival_s"]) for r in mine]
        assert t["turns"] == t["finished"] == t["ttft_ms_n"] == len(mine)
        for tag, q, need in (("p50", 50, 2), ("p90", 90, 10), ("p99", 99, 100)):  # fewer: the extreme value
            assert t[f"ttft_ms_{tag}"] == (pytest.approx(np.percentile(ttft, q)) if len(ttft) >= need else None)
        assert t["prefix_hit_tokens"] == sum(r["prefix_hit_tokens"] for r in mine)
        assert t["prefix_query_tokens"] == sum(r["prefix_query_tokens"] for r in mine)
    evicted = cached = 0
    for (c, k), r in by.items():
        if k:
            prev = by[(c, k - 1)]
            left = (prev["prompt_len"] + prev["output_len"] - 1) // 16 * 16  # full blocks of 16 it computed
            evicted += r["first_hit_tokens"] < left
            cached += r["first_hit_tokens"] >= left
    assert (m["returning_cached"], m["returning_evicted"]) == (cached, evicted)
    assert m["returning_turns"] == cached + evicted == len(rows) - 6
    assert m["returning_evicted_ttft_ms_n"] == evicted
    assert sum(t["evicted"] for t in table) == evicted and sum(t["cached"] for t in table) == cached


def test_turn_rows_of_a_run_without_a_prefix_cache_say_why_nothing_is_classified():
    chats = two_chats(0)
    model = make_decoder(2)
    plan = chats.plan()
    timeline = Scheduler(model, PagedStore(model, 8, BS, prefix_caching=False), plan.arrivals, plan.prompts,
                         clock=FakeClock(0.01), follow=plan.follow).run()
    m = conversation_metrics(timeline)
    assert (m["returning_turns"], m["returning_cached"], m["returning_evicted"]) == (1, 0, 0)
    assert m["returning_reason"].startswith("no returning turn was looked up in a prefix cache")
    assert [r["prefix_query_tokens"] for r in turn_rows(timeline)] == [0, 0]


def test_a_hybrids_returning_turns_are_classified_from_the_record(tmp_path):
    """A Gated DeltaNet hybrid's run: every returning turn is cached or evicted, by the rule in the
    record's own columns (what the store could resume when the turn before finished, a whole number
    of blocks no longer than what it computed, against what the turn found); an older record, without
    resumable_tokens, is not classified and says why."""
    torch.set_num_threads(1)
    run_job(compose(*CONV, "attention.full_attention_interval=2"), tmp_path)
    record = read_record(tmp_path / "results.json")
    assert record.status == "ok", record.error
    m, table, rows = record.metrics, record.tables["conversation_turns"], record.tables["serving_requests"]
    by = {(r["conversation"], r["turn"]): r for r in rows}
    cached = evicted = 0
    for (c, k), r in by.items():
        prev = by.get((c, k - 1))
        if prev is None:
            continue
        left = prev["resumable_tokens"]
        assert left % 16 == 0 and 0 <= left <= prev["prompt_len"] + prev["output_len"] - 1
        cached += r["first_hit_tokens"] >= min(left, (r["prompt_len"] - 1) // 16 * 16)
        evicted += r["first_hit_tokens"] < min(left, (r["prompt_len"] - 1) // 16 * 16)
    assert m["returning_turns"] == cached + evicted > 0 and m["returning_reason"] is None
    assert (m["returning_cached"], m["returning_evicted"]) == (cached, evicted)
    assert sum(t["cached"] for t in table) == cached and sum(t["evicted"] for t in table) == evicted
    assert sum(t["prefix_hit_tokens"] for t in table) == sum(r["prefix_hit_tokens"] for r in rows)
    old = {k: [{c: v for c, v in r.items() if c != "resumable_tokens"} for r in t] if k == "serving_requests" else t
           for k, t in record.tables.items()}
    timeline = timeline_from_record(old, record.metrics)
    assert conversation_metrics(timeline, recurrent=True)["returning_reason"].startswith("not classified: a record")


def test_the_console_prints_the_record_per_turn_table(conv_record):
    from rich.console import Console

    from kvbench.sinks.console import conversation_turns_table

    console = Console(record=True, width=140)
    console.print(conversation_turns_table(conv_record.to_dict()))
    lines = [line.split("│")[1:-1] for line in console.export_text().splitlines() if line.startswith("│")]
    table = conv_record.tables["conversation_turns"]
    assert [int(cells[0]) for cells in lines] == [t["turn"] for t in table]
    assert [(int(c[5]), int(c[6])) for c in lines] == [(t["cached"], t["evicted"]) for t in table]


SHAREGPT = [{"conversations": [{"from": "system", "value": "the"}, {"from": "human", "value": "hello world how are"},
                               {"from": "gpt", "value": "fine thanks"}, {"from": "human", "value": "how is zzz"},
                               {"from": "gpt", "value": "fine"}]},
            {"conversations": [{"from": "human", "value": "héllo you"}, {"from": "gpt", "value": "a world"}]}]


@pytest.fixture(scope="module")
def checkpoint_with_tokenizer(tmp_path_factory):
    """A tiny Llama checkpoint directory's config.json (a plan reads no weights) with a word-level
    tokenizer.json of 11 words, and a ShareGPT file."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("tokenized")
    path = root / "llama"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48, "vocab_size": 97,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 500.0, "tie_word_embeddings": False}))
    words = "hello world how are you fine thanks the a is".split()
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (root / "chats.json").write_text(json.dumps(SHAREGPT))
    return path, root / "chats.json"


def test_sharegpt_lengths_and_ids_come_from_the_checkpoints_own_tokenizer(checkpoint_with_tokenizer):
    """model=hf_dir with a tokenizer.json: each turn's message and answer are as many tokens as that
    tokenizer gives (read here by the tokenizers library itself), the first prompt its ids (the
    system message's, then the message's); without a checkpoint, the UTF-8 bytes."""
    from tokenizers import Tokenizer

    from kvbench.jobs.job_config import to_bench_config
    from kvbench.serving.tokenize import tokenizer_name
    from kvbench.workloads.serving import plan_at

    path, chats = checkpoint_with_tokenizer
    ref = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = lambda text: ref.encode(text, add_special_tokens=False).ids  # noqa: E731
    base = ["workload=conversations", f"workload.sharegpt={chats}", "workload.num_requests=2", "runtime.device=cpu"]
    plan = plan_at(to_bench_config(compose(*base, "model=hf_dir", f"model.path={path}")))
    assert ids("the") + ids("hello world how are") == [8, 1, 2, 3, 4]
    first, second, third = (sorted(plan.requests, key=lambda r: r.id))
    assert (first.prompt_len, first.output_len) == (5, len(ids("fine thanks"))) == (5, 2)
    assert (second.prompt_len, second.output_len) == (5 + 2 + len(ids("how is zzz")), 1) == (10, 1)
    assert (third.prompt_len, third.output_len) == (len(ids("héllo you")), len(ids("a world"))) == (2, 2)
    assert plan.prompts == [[8, 1, 2, 3, 4], [0, 5]]  # "héllo" is no word of it: [UNK]
    assert tokenizer_name(str(path)).endswith("tokenizer.json (AutoTokenizer)")
    byte_plan = plan_at(to_bench_config(compose(*base, "model=tiny")))
    lengths = [(r.prompt_len, r.output_len) for r in sorted(byte_plan.requests, key=lambda r: r.id)]
    assert lengths == [(3 + 19, 11), (3 + 19 + 11 + 10, 4), (10, 7)]  # "héllo you": é is 2 bytes
    assert byte_plan.prompts[1] == [b % 512 for b in "héllo you".encode()]
    assert tokenizer_name(None) == "bytes (UTF-8, one token per byte)"
