"""A serving run's :class:`~kvbench.serving.trace.Timeline` as a record's tables, and back.

``tables.serving_requests``: one row per request (its arrival, lengths, prefix, admission, first
and last token, preemptions, prefix hits, those of its first admission, what the store could
resume of it when it finished; a conversation's turn: its conversation and turn index);
``tables.serving_tokens``: every output token's time (``request``, ``t_s``), in order per request;
``tables.serving_samples``: the scheduler's state after each iteration. The Timeline's scalars
are metrics (``duration_s``, ``kv_store``, ``block_size``, ``kv_blocks_total``,
``kv_bytes_per_token``). :func:`timeline_from_record` rebuilds
the Timeline from them, so a record's metrics can be recomputed from the record alone.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping

from kvbench.serving.trace import Request, RequestTrace, Sample, Timeline

SAMPLE_FIELDS = ("t_s", "running", "waiting", "kv_blocks_used", "kv_bytes_used", "kv_bytes_needed")


def timeline_tables(timeline: Timeline) -> Dict[str, List[Dict[str, Any]]]:
    """The three tables of ``timeline`` (see the module's docstring)."""
    requests, tokens = [], []
    for tr in timeline.traces:
        r = tr.request
        requests.append({"id": r.id, "arrival_s": r.arrival_s, "prompt_len": r.prompt_len,
                         "output_len": r.output_len, "prefix_id": r.prefix_id, "prefix_len": r.prefix_len,
                         "scheduled_s": tr.scheduled_s, "first_token_s": tr.token_s[0] if tr.token_s else None,
                         "last_token_s": tr.token_s[-1] if tr.token_s else None, "output_tokens": len(tr.token_s),
                         "preemptions": tr.preemptions, "prefix_hit_tokens": tr.prefix_hit_tokens,
                         "prefix_query_tokens": tr.prefix_query_tokens, "first_hit_tokens": tr.first_hit_tokens,
                         "resumable_tokens": tr.resumable_tokens,
                         **({"conversation": r.conversation, "turn": r.turn} if r.conversation is not None else {})})
        tokens += [{"request": r.id, "t_s": t} for t in tr.token_s]
    samples = [{f: getattr(s, f) for f in SAMPLE_FIELDS} for s in timeline.samples]
    return {"serving_requests": requests, "serving_tokens": tokens, "serving_samples": samples}


def timeline_scalars(timeline: Timeline) -> Dict[str, Any]:
    """The Timeline's own scalars as the record's metrics name them."""
    return {"duration_s": timeline.duration_s, "kv_store": timeline.store, "block_size": timeline.block_size,
            "kv_blocks_total": timeline.kv_blocks_total, "kv_bytes_per_token": timeline.bytes_per_token,
            "block_waste_per_sequence_bytes": timeline.waste_per_sequence}


def timeline_from_record(tables: Mapping[str, List[Mapping[str, Any]]], metrics: Mapping[str, Any]) -> Timeline:
    """The Timeline a record of ``workload=serving`` was written from (its tables and metrics)."""
    times: Dict[int, List[float]] = {}
    for row in tables.get("serving_tokens", []):
        times.setdefault(int(row["request"]), []).append(float(row["t_s"]))
    traces = []
    for row in tables.get("serving_requests", []):
        r = Request(int(row["id"]), float(row["arrival_s"]), int(row["prompt_len"]), int(row["output_len"]),
                    row.get("prefix_id"), int(row.get("prefix_len") or 0), row.get("conversation"),
                    int(row.get("turn") or 0))
        traces.append(RequestTrace(r, row.get("scheduled_s"), times.get(r.id, []), int(row["preemptions"]),
                                   int(row["prefix_hit_tokens"]), int(row["prefix_query_tokens"]),
                                   row.get("first_hit_tokens"), row.get("resumable_tokens")))
    samples = [Sample(**{f: row[f] for f in SAMPLE_FIELDS}) for row in tables.get("serving_samples", [])]
    return Timeline(traces, samples, float(metrics["duration_s"]), str(metrics["kv_store"]),
                    int(metrics["block_size"]), int(metrics["kv_blocks_total"]), int(metrics["kv_bytes_per_token"]),
                    metrics.get("block_waste_per_sequence_bytes"))
