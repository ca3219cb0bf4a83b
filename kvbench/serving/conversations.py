"""The turns of a conversation workload as the scheduler's requests, and what a serving run serves.

A conversation's turn ``k`` is one request whose prompt is the whole history followed by the new
message: ``prompt_len(k) = prompt_len(k-1) + output_len(k-1) + user_len(k)``. Every turn's lengths
are known before the run (so the budget is checked on them), but a later turn's tokens and arrival
are not: it is released a think time after the previous answer is finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from kvbench.config.serving import check_record_size
from kvbench.core.errors import ConfigError
from kvbench.serving.arrivals import draw_lengths, make_requests, request_tokens
from kvbench.serving.conversation_traces import TurnSpec, read_sharegpt, read_turns
from kvbench.serving.tokenize import Encode, byte_ids
from kvbench.serving.trace import Request

Follow = Callable[[Request, List[int], float], Optional[Tuple[Request, List[int]]]]


@dataclass
class Plan:
    """What one serving run serves: every request, those the run starts with and their prompts, and
    ``follow``, what releases the rest."""

    requests: List[Request]
    arrivals: List[Request]
    prompts: List[List[int]]
    follow: Optional[Follow] = None


@dataclass
class Chats:
    """Conversations as requests (ids in order of conversation, then turn) and what each later
    turn adds: its think time and its message's token ids."""

    requests: List[Request]
    first_prompts: Dict[int, List[int]]  # conversation -> its first turn's prompt
    think_s: Dict[int, float] = field(default_factory=dict)  # request id -> think time before it
    message: Dict[int, List[int]] = field(default_factory=dict)  # request id -> its new message's ids

    def __post_init__(self) -> None:
        self.next_of = {a.id: b for a, b in zip(self.requests, self.requests[1:])
                        if a.conversation == b.conversation}

    def follow(self, request: Request, tokens: List[int], t: float) -> Optional[Tuple[Request, List[int]]]:
        """The turn after ``request`` (finished at ``t``), sent ``think_s`` later; None after the last."""
        nxt = self.next_of.get(request.id)
        if nxt is None:
            return None
        return replace(nxt, arrival_s=max(t + self.think_s[nxt.id], nxt.arrival_s)), tokens + self.message[nxt.id]

    def plan(self) -> Plan:
        first = [r for r in self.requests if r.turn == 0]
        return Plan(self.requests, first, [self.first_prompts[r.conversation] for r in first], self.follow)


def draw_think(rng: np.random.Generator, n: int, think) -> np.ndarray:
    """``n`` think times (s) from ``think`` (:class:`~kvbench.config.conversations.ThinkConfig`)."""
    if think.dist == "fixed":
        return np.full(n, float(think.mean))
    if think.dist == "exponential":
        return rng.exponential(think.mean, n) if think.mean > 0 else np.zeros(n)
    if think.dist == "uniform":
        return rng.uniform(think.lo, think.hi, n)
    sigma2 = np.log1p(think.cv ** 2)
    values = rng.lognormal(np.log(think.mean) - sigma2 / 2, np.sqrt(sigma2), n)
    return np.clip(values, think.lo, think.hi)


def message_tokens(seed: int, vocab_size: int, conversation: int, turn: int, spec: TurnSpec) -> List[int]:
    """A message's token ids: its text's (modulo the vocabulary), else drawn from (seed,
    conversation, turn): the same in every variant."""
    if spec.text is not None:
        return [b % vocab_size for b in spec.text]
    return np.random.default_rng([seed, 2, conversation, turn]).integers(0, vocab_size, spec.user_len).tolist()


def synthetic_chats(w, first: List[Request]) -> List[List[TurnSpec]]:
    """Turn counts, message and answer lengths from ``w``'s distributions; the first turns are the
    arrival process's requests ``first``."""
    rng = np.random.default_rng([w.seed, 3])
    counts = draw_lengths(rng, len(first), w.turns)
    later = int(counts.sum()) - len(first)
    users, answers = draw_lengths(rng, later, w.prompt), draw_lengths(rng, later, w.output)
    chats, at = [], 0
    for r, n in zip(first, counts):
        turns = [TurnSpec(r.prompt_len - r.prefix_len, r.output_len)]
        turns += [TurnSpec(int(users[at + k]), int(answers[at + k])) for k in range(n - 1)]
        at += n - 1
        chats.append(turns)
    return chats


def make_chats(w, vocab_size: int, encode: Encode = byte_ids) -> Chats:
    """The conversations of ``w`` (a :class:`~kvbench.config.conversations.ConversationsWorkload`); a
    ShareGPT file's text tokenized by ``encode``."""
    if w.arrival == "trace":
        specs, first, key, value = read_turns(w.trace), None, "workload.trace", w.trace
    else:
        first = make_requests(w)  # the conversations' arrival times, system prompts (and synthetic first turns)
        key = "workload.num_requests" if w.num_requests is not None else "workload.duration_s"
        value = getattr(w, key.split(".")[1])
        if w.sharegpt is None:
            specs = synthetic_chats(w, first)
        else:
            specs = read_sharegpt(w.sharegpt, encode)
            if len(specs) < len(first):
                raise ConfigError(f"{key}={value!r}: {len(first)} conversations arrive, workload.sharegpt="
                                  f"{w.sharegpt!r} holds {len(specs)}; lower it")
            specs = specs[:len(first)]
    turns = sum(len(s) for s in specs)
    check_record_size(key, value, turns, sum(t.output_len for s in specs for t in s) / turns, f"{turns} turns: ")
    think = draw_think(np.random.default_rng([w.seed, 4]), turns, w.think)
    requests, prompts, thinks, messages, i = [], {}, {}, {}, 0
    for c, spec in enumerate(specs):
        arrival = spec[0].arrival_s if first is None else first[c].arrival_s
        prefix_id, prefix_len = (None, 0) if first is None else (first[c].prefix_id, first[c].prefix_len)
        history = prefix_len
        for k, t in enumerate(spec):
            r = Request(i, arrival if k == 0 else (t.arrival_s or 0.0), history + t.user_len, t.output_len,
                        prefix_id, prefix_len, c, k)
            message = message_tokens(w.seed, vocab_size, c, k, t)
            if k == 0:
                system = request_tokens(replace(r, prompt_len=prefix_len), vocab_size, w.seed) if prefix_len else []
                prompts[c] = system + message
            else:
                messages[i], thinks[i] = message, t.think_s if t.think_s is not None else float(think[i])
            requests.append(r)
            history, i = r.prompt_len + r.output_len, i + 1
    return Chats(requests, prompts, thinks, messages)
