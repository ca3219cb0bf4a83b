"""A conversation run's figures per turn index, from its :class:`~kvbench.serving.trace.Timeline`.

When a turn finished, the store said how much of its history (prompt and answer but the last
token, whose K/V was never computed) a new sequence could continue from: ``resumable_tokens``,
every full block of it on attention layers, up to the last state saved
(``workload.state_checkpoint``) on a recurrent one. That stays findable unless evicted meanwhile,
so the next turn can find ``reusable = min(resumable_tokens, floor((prompt_len - 1) / block_size)
x block_size)`` tokens; at its first admission it found ``first_hit_tokens``: all of them
(**cached**) or fewer (**evicted**: it recomputes the rest, and its TTFT pays for them).

Without a prefix cache returning turns are neither. A record written before the store said so
has no ``resumable_tokens``: its attention models' turns are classified by every full block
(``floor(min(history - 1, prompt_len - 1) / block_size) x block_size``), its recurrent ones not.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from kvbench.measure.stats import min_samples, percentile
from kvbench.metrics import Metric, metric_table
from kvbench.serving.trace import RequestTrace, Timeline

QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
KINDS = ("cached", "evicted")


def reusable_tokens(previous: RequestTrace, turn: RequestTrace, block_size: int,
                    recurrent: bool = False) -> Optional[int]:
    """Tokens of ``turn``'s prompt that ``previous`` left where the store could continue from them
    (None: not known, an older record of a recurrent model)."""
    looked_up = (turn.request.prompt_len - 1) // block_size * block_size
    if previous.resumable_tokens is not None:
        return min(previous.resumable_tokens, looked_up)
    if recurrent:
        return None
    prev = previous.request
    return min(prev.prompt_len + prev.output_len - 1, looked_up) // block_size * block_size


def _by_turn(timeline: Timeline) -> Dict[tuple, RequestTrace]:
    return {(t.request.conversation, t.request.turn): t for t in timeline.traces if t.request.conversation is not None}


def classify(timeline: Timeline, recurrent: bool = False) -> Dict[int, Optional[str]]:
    """Request id -> ``cached`` | ``evicted`` for each admitted returning turn looked up in a prefix
    cache; None for the rest."""
    by_turn = _by_turn(timeline)
    out: Dict[int, Optional[str]] = {}
    for (c, k), t in by_turn.items():
        kind = None
        if k > 0 and t.first_hit_tokens is not None and t.prefix_query_tokens > 0:
            reusable = reusable_tokens(by_turn[(c, k - 1)], t, timeline.block_size, recurrent)
            if reusable is not None:
                kind = "cached" if t.first_hit_tokens >= reusable else "evicted"
        out[t.request.id] = kind
    return out


def _ttft_ms(t: RequestTrace) -> float:
    return 1e3 * (t.token_s[0] - t.request.arrival_s)


def _quantile(values: Sequence[float], q: float) -> Optional[float]:
    """The ``q`` quantile of ``values``; None from too few samples (a turn index holds few turns, and
    a p99 of 8 is their maximum under another name)."""
    return percentile(list(values), q) if len(values) >= min_samples(q) else None


def _stats(prefix: str, values: Sequence[float]) -> Dict[str, Any]:
    out: Dict[str, Any] = {f"{prefix}_n": len(values), f"{prefix}_mean": float(np.mean(values)) if values else None}
    out.update({f"{prefix}_{tag}": _quantile(values, q) for tag, q in QUANTILES.items()})
    return out


def turn_rows(timeline: Timeline, recurrent: bool = False) -> List[Dict[str, Any]]:
    """A row per turn index: turns, TTFT over finished ones, prefix hits, and the returning turns
    cached / evicted."""
    kinds = classify(timeline, recurrent)
    turns = sorted({t.request.turn for t in timeline.traces if t.request.conversation is not None})
    rows = []
    for k in turns:
        ts = [t for t in timeline.traces if t.request.conversation is not None and t.request.turn == k]
        done = [t for t in ts if t.finished]
        hits, queries = sum(t.prefix_hit_tokens for t in ts), sum(t.prefix_query_tokens for t in ts)
        row: Dict[str, Any] = {"turn": k, "turns": len(ts), "finished": len(done)}
        row.update(_stats("ttft_ms", [_ttft_ms(t) for t in done]))
        row.update(prefix_hit_tokens=hits, prefix_query_tokens=queries,
                   prefix_hit_rate=hits / queries if queries else None)
        for kind in KINDS:
            values = [_ttft_ms(t) for t in done if kinds[t.request.id] == kind]
            row[kind] = sum(kinds[t.request.id] == kind for t in ts)
            row[f"ttft_ms_p50_{kind}"] = _quantile(values, 0.5)
        rows.append(row)
    return rows


def conversation_metrics(timeline: Timeline, recurrent: bool | str = False) -> Dict[str, Any]:
    """The run's returning turns, cached against evicted, and the history tokens recomputed;
    ``recurrent``: whether a layer keeps a state (the names of its kinds, when given as words)."""
    kinds = classify(timeline, recurrent)
    traces = {t.request.id: t for t in timeline.traces}
    chats = {t.request.conversation for t in timeline.traces if t.request.conversation is not None}
    returning = [t for t in timeline.traces if t.request.conversation is not None and t.request.turn > 0]
    out: Dict[str, Any] = {"conversations": len(chats), "returning_turns": len(returning)}
    for kind in KINDS:
        ids = [i for i, k in kinds.items() if k == kind]
        out[f"returning_{kind}"] = len(ids)
        out.update(_stats(f"returning_{kind}_ttft_ms", [_ttft_ms(traces[i]) for i in ids if traces[i].finished]))
    by_turn = _by_turn(timeline)
    recomputed = reusable = 0
    for t in returning:
        if kinds[t.request.id] is not None:
            r = reusable_tokens(by_turn[(t.request.conversation, t.request.turn - 1)], t, timeline.block_size,
                                recurrent)
            reusable += r
            recomputed += max(0, r - t.first_hit_tokens)
    looked_up = any(t.first_hit_tokens is not None and t.prefix_query_tokens > 0 for t in returning)
    out.update(history_reusable_tokens=reusable, history_recomputed_tokens=recomputed,
               returning_reason=None if any(kinds.values()) or not returning else
               "not classified: a record written before the store said which saved states it held (a recurrent "
               "layer resumes only from a state saved at exactly that position)" if recurrent and looked_up else
               "no returning turn was looked up in a prefix cache (workload.prefix_caching=false, a slot store, "
               "or none was admitted): each recomputed its whole history")
    return out


def _metric_stats(prefix: str, what: str) -> List[Metric]:
    return [Metric(f"{prefix}_n", "count", f"finished {what}"), Metric(f"{prefix}_mean", "ms", f"mean TTFT of {what}"),
            *(Metric(f"{prefix}_{tag}", "ms", f"TTFT of {what}: {q:.0%} quantile (numpy linear)")
              for tag, q in QUANTILES.items())]


METRICS: Dict[str, Metric] = metric_table(
    Metric("conversations", "count", "conversations that arrived"),
    Metric("returning_turns", "count", "turns after a conversation's first (each sent a think time after the answer "
                                       "before it)"),
    *(m for kind, what in (("cached", "returning turns that found, at their first admission, all the history the "
                                      "store could resume when the previous turn finished (every full block; a "
                                      "recurrent layer: up to its last saved state)"),
                           ("evicted", "returning turns that found less of their history than the previous turn left "
                                       "(blocks evicted meanwhile): they recompute the rest"))
      for m in (Metric(f"returning_{kind}", "count", what), *_metric_stats(f"returning_{kind}_ttft_ms", what))),
    Metric("history_reusable_tokens", "tokens", "over returning turns looked up: tokens of history the store could "
                                                "resume when their previous turn finished (its resumable_tokens, at "
                                                "most prompt - 1 rounded down to block_size)"),
    Metric("history_recomputed_tokens", "tokens", "over returning turns looked up: reusable history tokens not found "
                                                  "at first admission (evicted), prefilled again"),
    Metric("returning_reason", "text", "why no returning turn is cached or evicted: nothing was looked up, or a "
           "record of a recurrent model written before the store said which saved states it held"),
    Metric("tables.conversation_turns", "", "one row per turn index: turns, finished, ttft_ms_mean/_p50/_p90/_p99 "
                                            "(and _n), prefix_hit_tokens, prefix_query_tokens, prefix_hit_rate, "
                                            "cached, evicted, ttft_ms_p50_cached, ttft_ms_p50_evicted; a quantile "
                                            "from fewer turns than it needs (2 for p50, 10 for p90, 100 for p99) is "
                                            "null"),
)
