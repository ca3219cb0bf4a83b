"""One turn of the multi-turn chat (kvbench.multiturn), with the system prompt's and history's
K/V kept across turns (``cache.shared=true``) and without (every turn re-prefilled).

Timed: turn 2 (the user message, the prefill, the reply's decode steps); before each round,
untimed, a new conversation and its turn 1, so every round starts from the same cache state
(a shared cache keeps the system prompt's K/V across conversations). Checked: the reply
equals a cache-less greedy recompute, the prefill computes exactly the tokens the cache
lacks, and the cache holds the bytes of the KV formula.
"""

from __future__ import annotations

import pytest
import torch
from benchkit import BATCH_SIZE, bench_decoder, pinned_threads, record_config  # noqa: F401
from kv_formula import kv_cache_bytes

from kvbench.config.workload import MultiturnWorkload
from kvbench.workloads.multiturn import ChatSession, chat_prompts

WORKLOAD = MultiturnWorkload(batch_size=BATCH_SIZE, system_len=96, turns=2,
                          user_len=16, reply_len=4)
ROUNDS = 40  # pedantic rounds: a turn is 2-6 ms here


@torch.inference_mode()
def recompute_reply(model, context: torch.Tensor, reply_len: int) -> torch.Tensor:
    """Reference: greedy reply by running the whole conversation without a cache each step."""
    seq = context
    for _ in range(reply_len):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[:, context.shape[1]:]


@pytest.mark.parametrize("shared", [False, True], ids=["unshared", "shared"])
def test_multiturn_turn(benchmark, shared):
    model = bench_decoder("gqa")
    system, users = chat_prompts(WORKLOAD, model.config.vocab_size, seed=0)
    P, U, R, B = WORKLOAD.system_len, WORKLOAD.user_len, WORKLOAD.reply_len, BATCH_SIZE
    max_len = WORKLOAD.total_len - 1  # the chat's last reply token is never fed
    session = ChatSession(model, system, B, shared, "static", max_len)

    @torch.inference_mode()
    def turn_1():
        # Not a rollback of turn 2: that would keep turn 1's last reply token, which turn 2
        # itself fed, and the next turn 2 would prefill one token less.
        session.new_conversation()
        session.ask(users[0], R)

    @torch.inference_mode()
    def turn_2():
        return session.ask(users[1], R)

    gen, turn = benchmark.pedantic(turn_2, setup=turn_1, rounds=ROUNDS, warmup_rounds=3)

    context = torch.cat([session.tokens[:, :P + U + R], users[1]], dim=1)  # (B, P + 2U + R)
    assert torch.equal(gen.tokens, recompute_reply(model, context, R))
    # Shared: the cache lacks only turn 1's last reply token and the new message.
    assert turn.prefill_tokens == (B * (1 + U) if shared else B * (P + 2 * U + R))
    assert turn.context_tokens == P + 2 * U + R
    per_position = kv_cache_bytes(model.config.num_layers, model.num_kv_heads, model.config.head_dim,
                                  1, 1, 4)
    # Static storage: shared holds the system prompt once (batch 1) beside B histories.
    allocated = (P + B * (max_len - P)) if shared else B * max_len
    held = (P + B * (U + R + U + R - 1)) if shared else B * (P + 2 * U + R + R - 1)
    assert turn.kv_cache_bytes == per_position * allocated
    assert turn.kv_cache_bytes_formula == per_position * held
    record_config(benchmark, model, cache_impl="static", cache_shared=shared, turn=2,
                  batch_size=B, system_len=P, user_len=U, reply_len=R,
                  prefill_tokens=turn.prefill_tokens, kv_cache_bytes=turn.kv_cache_bytes,
                  kv_cache_bytes_formula=turn.kv_cache_bytes_formula)
