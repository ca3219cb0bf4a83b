"""What a serving run leaves behind: every request's timeline and the scheduler's samples.

The contract between the scheduler, which writes a :class:`Timeline`, and the metrics, which read
nothing else. Times are seconds on the scheduler's clock, zero at the run's start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass(frozen=True)
class Request:
    """One request of the arrival process. Requests of one ``prefix_id`` share their first
    ``prefix_len`` prompt tokens (a system prompt); a conversation's turn's prompt is its whole history.
    """

    id: int
    arrival_s: float
    prompt_len: int
    output_len: int
    prefix_id: Optional[int] = None
    prefix_len: int = 0
    conversation: Optional[int] = None
    turn: int = 0


@dataclass
class RequestTrace:
    """What happened to one request.

    ``scheduled_s``: when it was first admitted; ``token_s[0]`` is the first token (the end of its
    prefill), so TTFT = ``token_s[0] - arrival_s``. ``prefix_hit_tokens`` / ``prefix_query_tokens``:
    vLLM's counting (hit rate = hits / queries over all requests). ``first_hit_tokens``: what a
    returning turn found of its history at its first admission. ``resumable_tokens``: when it
    finished, the longest prefix of its own positions the store could continue a new sequence
    from (every group: its blocks findable, a recurrent layer's state saved at exactly that
    position); None: the store keeps no prefix cache, or an older record.
    """

    request: Request
    scheduled_s: Optional[float] = None
    token_s: List[float] = field(default_factory=list)
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    first_hit_tokens: Optional[int] = None
    resumable_tokens: Optional[int] = None

    @property
    def finished(self) -> bool:
        return len(self.token_s) >= self.request.output_len


@dataclass(frozen=True)
class Sample:
    """The scheduler's state after one iteration."""

    t_s: float
    running: int
    waiting: int
    kv_blocks_used: int  # blocks in use (a slot store: slots in use)
    kv_bytes_used: int  # bytes those blocks hold room for
    kv_bytes_needed: int  # bytes the formula gives for the tokens they hold (waste = used - needed)


@dataclass
class Timeline:
    """A whole serving run: every request's trace, the samples, and the store it ran on.

    ``duration_s``: from the run's start to its last token (the engines' benchmark duration);
    ``block_size``: tokens per block (slots: the slot's length); ``bytes_per_token``: the KV formula's
    for one token of one sequence, all layers.
    """

    traces: List[RequestTrace]
    samples: List[Sample]
    duration_s: float
    store: str
    block_size: int
    kv_blocks_total: int
    bytes_per_token: int
    waste_per_sequence: Optional[int] = None  # None: an older record
