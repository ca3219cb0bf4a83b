"""The pure part of ``task=capacity``: the search over batch sizes and its memory-only prediction.

The prediction is weights + the KV formula (the one ``task=inspect`` prints) + the activation
overhead the calibration probes measured. The probes themselves are :mod:`kvbench.tasks.capacity`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from kvbench.config.bench import BenchConfig
from kvbench.core.dtypes import DTYPE_BYTES
from kvbench.layouts.build import build_layouts

SEARCH_LIMIT = "capacity.max_batch"  # what stopped a search that never failed
# How far the memory-only prediction may be from the measured max batch (a fraction of the larger)
# before the record calls the difference a finding instead of taking the measurement silently
PREDICTION_TOLERANCE = 0.2


@dataclass
class Probe:
    """One batch at one context, measured (or refused), and the bounds it met or violated."""

    context: int
    batch: int
    ok: bool
    bound: Optional[str] = None  # the first bound violated (memory, ttft, tpot); None when ok
    violated: List[str] = field(default_factory=list)
    measured: bool = True
    peak_bytes: Optional[int] = None
    predicted_bytes: Optional[int] = None
    kv_bytes: Optional[int] = None
    activation_bytes: Optional[int] = None
    retained_bytes: int = 0  # CPU: resident right before it beyond right before the first probe; not counted
    ttft_ms: Optional[float] = None
    tpot_ms: Optional[float] = None
    decode_ms_p50: Optional[float] = None
    tokens_per_s: Optional[float] = None
    tpot_paired_ms: Optional[float] = None  # slo.tpot_x_batch1: the probe's steps, interleaved with
    tpot_reference_ms: Optional[float] = None  # ... steps of one sequence at the same context
    tpot_target_ms: Optional[float] = None  # the TPOT target it was judged by (slo.tpot_ms and/or slo.tpot_x_batch1)
    tpot_ratio_low: Optional[float] = None  # the paired steps' median ratio (probe / reference), its 95% interval
    tpot_ratio_high: Optional[float] = None
    oom: bool = False
    error: Optional[str] = None


@dataclass
class Search:
    """What :func:`search_capacity` found (``max_batch`` 0: not even the smallest passed;
    ``failed_at`` None: none failed up to the limit)."""

    max_batch: int
    failed_at: Optional[int]
    probes: List[Probe]


def search_capacity(measure: Callable[[int], Probe], start: int, limit: int, step: int = 1,
                    known: Sequence[Probe] = (), predict: Optional[Callable[[], int]] = None) -> Search:
    """The largest batch in [1, ``limit``] whose probe is ok, to within ``step``: gallop from the
    prediction ``start`` until the boundary is bracketed, then bisect. Assumes the bounds are
    monotone in the batch; a noisy pass above a failure does not move the bracket.

    ``predict`` (the memory line redrawn through the probes measured so far): after each probe the
    batch it says fits is probed next, while memory is what failed (a latency bound is not on that
    line); where it is at or past the bracket's edge, once, the batch one step inside it; after a
    predicted probe that failed (the line did not move), or an edge already tried, a bisection. A
    line within a few percent of the truth brackets the answer in 3-4 probes where a gallop from a
    prediction 9% off took 9-10."""
    tried: Dict[int, Probe] = {p.batch: p for p in known}
    order: List[Probe] = list(known)

    def ok(batch: int) -> bool:
        if batch not in tried:
            tried[batch] = measure(batch)
            order.append(tried[batch])
        return tried[batch].ok

    hi = min((b for b, p in tried.items() if not p.ok), default=limit + 1)
    lo = max((b for b, p in tried.items() if p.ok and b < hi), default=0)
    if predict is not None:
        guess, predicted, edge = min(max(start, lo + 1), hi - 1), True, False
        while hi - lo > step:
            if ok(guess):
                lo = guess
            else:
                hi = guess
            memory = hi > limit or tried[hi].bound == "memory"
            line = predict() if memory and (tried[guess].ok or not predicted) else None
            if line is not None and lo < line < hi:
                guess, predicted, edge = line, True, False
            elif line is not None and not edge and hi - lo > step:  # the line at the bracket's edge: once
                guess, predicted, edge = min(max(lo + step if line <= lo else hi - step, lo + 1), hi - 1), True, True
            else:
                guess, predicted = (lo + hi) // 2, False
        return Search(lo, hi if hi <= limit else None, order)
    if hi - lo > step:
        guess = min(max(start, lo + 1), hi - 1)
        if ok(guess):
            lo, jump = guess, step
            while hi - lo > step:
                batch = min(lo + jump, hi - 1)
                if not ok(batch):
                    hi = batch
                    break
                lo, jump = batch, jump * 2
        else:
            hi, jump = guess, step
            while hi - lo > step:
                batch = max(hi - jump, lo + 1)
                if ok(batch):
                    lo = batch
                    break
                hi, jump = batch, jump * 2
    while hi - lo > step:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return Search(lo, hi if hi <= limit else None, order)


def predict_max_batch(budget: int, fixed: int, per_sequence: int, limit: int) -> int:
    """Largest batch b <= ``limit`` with fixed + b * per_sequence <= budget (0 if none)."""
    if per_sequence <= 0:
        return limit
    return max(0, min(limit, (budget - fixed) // per_sequence))


def contexts(cfg: BenchConfig) -> List[int]:
    """The contexts searched, shortest first; for workload=multiturn the positions each conversation
    holds at its end (its last reply token is never fed back)."""
    if cfg.workload.name == "multiturn":
        return [cfg.workload.total_len - 1]
    return sorted(cfg.capacity.context_lens)


def kv_bytes(cfg: BenchConfig, context: int, batch: int) -> int:
    """The KV formula of what the probe's cache holds (a shared system prompt once;
    ``cache.impl=none`` nothing: its recomputed K/V are activations)."""
    m, w = cfg.model, cfg.workload
    if cfg.cache.impl == "none":
        return 0
    layers = build_layouts(m, cfg.attention, cfg.cache.state_dtype)

    def held(positions: int, sequences: int) -> int:
        return layers.cache_bytes(positions, sequences, DTYPE_BYTES[cfg.runtime.dtype])

    if w.name != "multiturn":
        return held(context + w.gen_len, batch)
    if cfg.cache.shared:
        return held(w.system_len, 1) + held(context - w.system_len, batch)
    return held(context, batch)


def kv_bytes_per_token(cfg: BenchConfig) -> Tuple[float, int]:
    """(bytes, positions): the KV formula of one sequence as the longest probe holds it, over its
    positions. Where some layer's cache stops growing, bytes per token fall as the context
    grows, so they are given at this stated length: the one definition every table shares."""
    context = contexts(cfg)[-1]
    positions = context if cfg.workload.name == "multiturn" else context + cfg.workload.gen_len
    return kv_bytes(cfg, context, 1) / positions, positions


def state_bytes_per_sequence(cfg: BenchConfig) -> int:
    """What one sequence holds whatever its length (Gated DeltaNet layers' states): part of
    :func:`kv_bytes` that no context shrinks."""
    if cfg.cache.impl == "none":
        return 0
    return build_layouts(cfg.model, cfg.attention, cfg.cache.state_dtype).state_bytes(DTYPE_BYTES[cfg.runtime.dtype])


def formula_max_batch(cfg: BenchConfig, context: int, budget: int, weights: int,
                      activation: Tuple[int, int] = (0, 0)) -> int:
    """The memory-only prediction: weights + KV formula (+ the activations' fixed part and part per
    sequence) under ``budget``."""
    fixed, per_sequence = (max(0, a) for a in activation)
    kv_per_sequence = kv_bytes(cfg, context, 2) - kv_bytes(cfg, context, 1)  # a shared prefix is held once
    return predict_max_batch(budget, weights + fixed + kv_bytes(cfg, context, 1) - kv_per_sequence,
                             kv_per_sequence + per_sequence, cfg.capacity.max_batch)


def saturation_batch(context: int, chunk: Optional[int], piece: Optional[int] = None) -> Optional[int]:
    """The smallest batch whose prefill's working set is at its bound, a chunk's (None without
    ``chunk``, ``capacity.prefill_chunk``: one forward, whose working set grows with B x context).
    A smaller batch prefills fewer tokens a forward (B x context < chunk), and a layer that works
    on ``piece`` positions of every sequence at once (a recurrent layer's chunk,
    ``Layouts.prefill_piece``) holds B x piece positions' matrices until B reaches chunk / piece
    (a forward's max(1, chunk // B) positions a sequence then fall below the piece). On a line
    through such a batch and a saturated one, that difference reads as bytes per sequence (issue 59:
    batch 1 at 256 tokens held 5 MB less than batch 2, which the line from batch 1 to 4 spread as
    1.7 MB a sequence; a Gated DeltaNet hybrid's 2.1 MB a sequence from batches 2 and 5 were its
    pieces filling up to batch 8, flat after)."""
    if chunk is None:
        return None
    return max(1, -(-chunk // context), -(-chunk // piece) if piece else 1)


def prefill_piece(layouts: Sequence[Any]) -> Optional[int]:
    """The smallest ``LayerLayout.prefill_piece`` of any layer (None: no layer works in pieces)."""
    return min((layer.prefill_piece for layer in layouts if layer.prefill_piece), default=None)


def calibration_batches(context: int, chunk: Optional[int], limit: int, span: int = 3,
                        piece: Optional[int] = None) -> Tuple[int, ...]:
    """The batches whose measured probes draw the activation line at ``context``: the
    :func:`saturation_batch` and ``span`` more (without a chunk: 1 and 1 + span, as before); within
    [1, ``limit``], distinct."""
    first = min(limit, saturation_batch(context, chunk, piece) or 1)
    return tuple(dict.fromkeys((first, min(limit, first + span))))


def split_activation(probes: Sequence[Probe], context: Optional[int] = None, chunk: Optional[int] = None,
                     piece: Optional[int] = None) -> Tuple[int, int]:
    """(fixed, per sequence) activation bytes from measured probes at two batch sizes (a line
    through them); one probe: all of it per sequence; none: nothing known. With ``context`` and
    ``chunk``, only probes at or past the :func:`saturation_batch` draw it, where there are two."""
    usable = _drawing(probes, context, chunk, piece)
    points = sorted((p.batch, p.activation_bytes) for p in usable)
    if not points:
        return 0, 0
    if len(points) == 1 or points[-1][0] == points[0][0]:
        return 0, points[0][1] // points[0][0]
    (b1, a1), (b2, a2) = points[0], points[-1]
    per_sequence = max(0, (a2 - a1) // (b2 - b1))
    return a1 - b1 * per_sequence, per_sequence


def _drawing(probes: Sequence[Probe], context: Optional[int], chunk: Optional[int],
             piece: Optional[int]) -> List[Probe]:
    """The probes an activation line is drawn through: those whose peak is whole (measured, not
    stopped part way: ``error``, its peak where it crossed the budget, less than it would have held;
    not out of memory), only those at or past the :func:`saturation_batch` where two batches are."""
    usable = [p for p in probes if p.measured and p.activation_bytes is not None and not p.error and not p.oom]
    first = None if context is None else saturation_batch(context, chunk, piece)
    full = [p for p in usable if first is not None and p.batch >= first]
    return full if len({p.batch for p in full}) >= 2 else usable


def fit_activation(probes: Sequence[Probe], context: Optional[int] = None, chunk: Optional[int] = None,
                   piece: Optional[int] = None) -> Optional[Tuple[int, int]]:
    """(fixed, per sequence) activation bytes on the line through the largest whole probe and the
    largest whole one at most 3/4 of its batch (else the smallest): a secant near the boundary a
    search closes in on, its two batches far enough apart that a few MB of noise is not a slope;
    past the :func:`saturation_batch` where two such batches are; the slope never negative; None
    with fewer than two batches. A least-squares line through batch 1 and 4 as well read 12-14 MB
    less than batches 118 and 169 held, and its predictions failed 7 times in a row."""
    usable = _drawing(probes, context, chunk, piece)
    if len({p.batch for p in usable}) < 2:
        return None
    top = max(usable, key=lambda p: p.batch)
    below = [p for p in usable if p.batch < top.batch]
    far = max((p for p in below if 4 * p.batch <= 3 * top.batch), key=lambda p: p.batch,
              default=min(below, key=lambda p: p.batch))
    per_sequence = max(0, (top.activation_bytes - far.activation_bytes) // (top.batch - far.batch))
    return top.activation_bytes - top.batch * per_sequence, per_sequence


def latency_judged(cfg: BenchConfig) -> bool:
    """Whether some latency target judges a probe (slo.ttft_ms, slo.tpot_ms, slo.tpot_x_batch1)."""
    slo = cfg.slo
    return any(v is not None for v in (slo.ttft_ms, slo.tpot_ms, slo.tpot_x_batch1))


def prediction_finding(max_batch: int, predicted: int, stopped_by: Optional[str], limit: int) -> Optional[str]:
    """A sentence when a search that memory stopped ended more than :data:`PREDICTION_TOLERANCE` of
    the larger from the memory-only ``predicted`` batch, else None (a latency bound or the search's
    limit stopping it below the prediction is what the prediction does not model: not a finding)."""
    if stopped_by != "memory" or predicted >= limit and max_batch >= limit:
        return None
    gap = abs(max_batch - predicted)
    if gap <= PREDICTION_TOLERANCE * max(max_batch, predicted, 1):
        return None
    return (f"memory stopped the search at {max_batch} sequences, the memory-only prediction was {predicted} "
            f"({gap / max(max_batch, predicted, 1):.0%} apart, beyond {PREDICTION_TOLERANCE:.0%}): the probes' "
            "activation_bytes differ from the calibration line")


def tpot_undecided(probe: Optional[Probe], x: Optional[float]) -> bool:
    """Whether ``probe``'s paired steps leave its slo.tpot_x_batch1 verdict to chance: their median
    ratio's 95% interval holds the target ``x``, or they gave none (a probe over the budget is not paired)."""
    if probe is None or x is None or not probe.measured or "memory" in probe.violated:
        return False
    low, high = probe.tpot_ratio_low, probe.tpot_ratio_high
    return low is None or high is None or low <= x <= high


def tpot_support(at: Optional[Probe], failed: Optional[Probe], x: Optional[float]) -> Optional[str]:
    """None when the samples support the answer's TPOT verdicts (the pass at the max batch and the
    failure above it), else which probe's interval holds the target: such a capacity moves with the
    machine's noise, and the table says 'untested', not a number (issue 59)."""
    undecided = [p for p in (at, failed) if tpot_undecided(p, x)]
    if not undecided:
        return None
    return "; ".join(f"batch {p.batch}: paired TPOT ratio {p.tpot_paired_ms / p.tpot_reference_ms:.2f}, 95% "
                     + (f"[{p.tpot_ratio_low:.2f}, {p.tpot_ratio_high:.2f}]" if p.tpot_ratio_low is not None
                        else "interval none") + f" around the target {x:g}"
                     for p in undecided if p.tpot_paired_ms and p.tpot_reference_ms) or "no paired steps"


def over_budget(probe: Probe, budget: int) -> bool:
    """The memory bound: an out-of-memory, no peak measured, or a peak above ``budget``."""
    return probe.oom or probe.peak_bytes is None or probe.peak_bytes > budget


def violations(probe: Probe, budget: int, ttft_ms: Optional[float], tpot_ms: Optional[float],
               tpot_x_batch1: Optional[float] = None) -> List[str]:
    """The bounds ``probe`` violates, memory first (an out-of-memory has no latency to judge); paired
    steps are not judged over the budget (not timed there)."""
    out = ["memory"] if over_budget(probe, budget) else []
    if ttft_ms is not None and (probe.ttft_ms is None or probe.ttft_ms > ttft_ms):
        out.append("ttft")
    slow = tpot_ms is not None and (probe.tpot_ms is None or probe.tpot_ms > tpot_ms)
    if tpot_x_batch1 is not None and "memory" not in out:
        slow = slow or (probe.tpot_paired_ms is None or probe.tpot_reference_ms is None
                        or probe.tpot_paired_ms > tpot_x_batch1 * probe.tpot_reference_ms)
    if slow:
        out.append("tpot")
    return out


def probes_expected(limit: int, step: int) -> int:
    """An upper bound on the probes one context's search runs: the calibrations, a gallop and a
    bisection over [1, limit] at resolution ``step``."""
    return 2 + 2 * (math.ceil(math.log2(max(2, limit / step))) + 1)
