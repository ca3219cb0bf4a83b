"""The requests of a serving run: when they arrive and how long they are, drawn from a seed.

Open loop: arrival times do not depend on how fast the server is, so every variant meets the
same requests at the same times (one numpy ``Generator`` seeded with ``workload.seed``).

- ``poisson``: exponential inter-arrival times of mean 1 / rate.
- ``gamma``: gamma inter-arrival times of shape ``burstiness`` and mean 1 / rate (vLLM's
  ``--burstiness``): CV^2 = 1 / burstiness; 1 is Poisson, below 1 burstier, above 1 more regular.
- ``trace``: a JSONL or CSV file of ``arrival_s, prompt_len, output_len`` and optionally
  ``prefix_id`` (and ``prefix_len``), read bounded, each bad row a one-line error naming it.

Lengths: :class:`~kvbench.config.serving.LengthConfig` (fixed, uniform, lognormal with mean and
CV). A prefixed request (``prefix_fraction`` of them) starts with one of ``prefix_groups`` system
prompts of ``prefix_len`` tokens: its prompt is that prefix plus its own drawn length.
:func:`request_tokens` gives the token ids, from the seed, the request's id and its prefix id.
"""

from __future__ import annotations

import math
from typing import List, Optional

import numpy as np

from kvbench.config.serving import MAX_REQUESTS, MAX_SPAN_S, LengthConfig, check_record_size, duration_text
from kvbench.core.errors import ConfigError
from kvbench.serving.table_files import number, read_text, table_rows
from kvbench.serving.trace import Request

MAX_TRACE_BYTES = 64 * 2**20  # a trace of more is not one this CPU-sized scheduler can serve
MAX_TRACE_ROWS = MAX_REQUESTS  # more than a record can hold (config.serving)
MAX_DRAWN = MAX_REQUESTS  # arrivals drawn for a duration_s at most


def inter_arrivals(rng: np.random.Generator, n: int, rate: float, burstiness: float = 1.0) -> np.ndarray:
    """``n`` gaps (s) of mean 1 / ``rate``: gamma of shape ``burstiness`` (exponential at 1)."""
    if burstiness == 1.0:
        return rng.exponential(1.0 / rate, n)
    return rng.gamma(burstiness, 1.0 / (rate * burstiness), n)


def draw_lengths(rng: np.random.Generator, n: int, dist: LengthConfig) -> np.ndarray:
    """``n`` integer lengths from ``dist``: fixed, uniform on [lo, hi], or lognormal of the given
    mean and CV (sigma^2 = ln(1 + cv^2), mu = ln(mean) - sigma^2 / 2), rounded, clipped to [lo, hi]."""
    if dist.dist == "fixed":
        return np.full(n, int(dist.mean), dtype=np.int64)
    if dist.dist == "uniform":
        return rng.integers(dist.lo, dist.hi + 1, n)
    sigma2 = math.log1p(dist.cv ** 2)
    values = rng.lognormal(math.log(dist.mean) - sigma2 / 2, math.sqrt(sigma2), n)
    return np.clip(np.rint(values), dist.lo, dist.hi).astype(np.int64)


def make_requests(w) -> List[Request]:
    """The requests of ``w`` (a :class:`~kvbench.config.serving.ServingWorkload`), by arrival."""
    if w.arrival == "trace":
        return read_trace(w.trace, w.prefix_len)
    rng = np.random.default_rng(w.seed)
    if w.num_requests is not None:
        times = np.cumsum(inter_arrivals(rng, w.num_requests, w.rate, w.burstiness))
    else:  # draw gaps in batches until the duration is passed
        chunks, end = [], 0.0
        while end <= w.duration_s and sum(len(c) for c in chunks) < MAX_DRAWN:
            gaps = inter_arrivals(rng, max(16, int(w.rate * w.duration_s)), w.rate, w.burstiness)
            chunks.append(end + np.cumsum(gaps))
            end = chunks[-1][-1]
        times = np.concatenate(chunks)
        times = times[times <= w.duration_s]
        if not len(times):
            raise ConfigError(f"workload.duration_s={w.duration_s}: no request arrives in it at "
                              f"workload.rate={w.rate}; use a longer duration or a higher rate")
    n = len(times)
    prompt = draw_lengths(rng, n, w.prompt)
    output = draw_lengths(rng, n, w.output)
    check_drawn(w, float(times[-1]), n, float(output.sum()))
    prefixed = (rng.random(n) < w.prefix_fraction) if w.prefix_len > 0 else np.zeros(n, dtype=bool)
    groups = rng.integers(0, w.prefix_groups, n)
    return [Request(i, float(times[i]), int(prompt[i]) + (w.prefix_len if prefixed[i] else 0), int(output[i]),
                    int(groups[i]) if prefixed[i] else None, w.prefix_len if prefixed[i] else 0)
            for i in range(n)]


def check_drawn(w, last_s: float, n: int, output_tokens: float) -> None:
    """The drawn arrivals, checked as the config's means were: a gamma of small ``burstiness`` draws a
    few enormous gaps whatever its mean."""
    if not last_s <= MAX_SPAN_S:  # NaN too: gaps that overflowed
        key, value = (("workload.burstiness", w.burstiness) if w.arrival == "gamma" and w.burstiness < 1
                      else ("workload.rate", w.rate))
        raise ConfigError(f"{key}={value!r}: the drawn arrivals span {duration_text(last_s)}, more than the "
                          f"{duration_text(MAX_SPAN_S)} a serving run may span (workload.arrival={w.arrival}, "
                          f"workload.rate={w.rate:g}, workload.seed={w.seed})")
    key = "workload.num_requests" if w.num_requests is not None else "workload.duration_s"
    check_record_size(key, getattr(w, key.split(".")[1]), n, output_tokens / n, "the drawn ")


def request_tokens(request: Request, vocab_size: int, seed: int) -> List[int]:
    """The prompt's token ids: the prefix of ``prefix_id`` (the same for every request of that id),
    then the request's own tokens, each drawn from (seed, id): the same in every variant."""
    own = np.random.default_rng([seed, 0, request.id]).integers(0, vocab_size, request.prompt_len - request.prefix_len)
    if request.prefix_id is None:
        return own.tolist()
    prefix = np.random.default_rng([seed, 1, request.prefix_id]).integers(0, vocab_size, request.prefix_len)
    return prefix.tolist() + own.tolist()


# ---- trace files ---------------------------------------------------------------------------

_COLUMNS = ("arrival_s", "prompt_len", "output_len")


def read_trace(path: str, default_prefix_len: int = 0) -> List[Request]:
    """A trace file (JSONL or CSV with a header row, arrivals in order) as requests; every problem is
    one :class:`ConfigError` naming the file and the row."""
    key = f"workload.trace={path!r}"
    text = read_text(key, path, MAX_TRACE_BYTES, "a trace")
    rows = table_rows(text, key, _COLUMNS, f"{', '.join(_COLUMNS)}, optional prefix_id, prefix_len", MAX_TRACE_ROWS,
                      "requests")
    if not rows:
        raise ConfigError(f"{key}: holds no requests")
    out, last = [], -math.inf
    for i, (line, row) in enumerate(rows):
        r = _request(i, row, default_prefix_len, f"{key}: line {line}")
        if r.arrival_s < last:
            raise ConfigError(f"{key}: line {line}: arrival_s={r.arrival_s} is before the previous row's "
                              f"{last}; sort the trace by arrival")
        if r.arrival_s > MAX_SPAN_S:  # the scheduler would sleep until it
            raise ConfigError(f"{key}: line {line}: arrival_s={r.arrival_s:g} is {duration_text(r.arrival_s)} after "
                              f"the run's start, more than the {duration_text(MAX_SPAN_S)} a serving run may span "
                              "(arrival_s counts seconds from the start of the run, not a timestamp)")
        last = r.arrival_s
        out.append(r)
    check_record_size("workload.trace", path, len(out), sum(r.output_len for r in out) / len(out))
    return out


def _request(i: int, row: dict, default_prefix_len: int, where: str) -> Request:
    arrival = number(row, "arrival_s", where, float, 0)
    prompt = number(row, "prompt_len", where, int, 1)
    output = number(row, "output_len", where, int, 1)
    prefix_id: Optional[int] = number(row, "prefix_id", where, int, 0, optional=True)
    prefix_len = number(row, "prefix_len", where, int, 0, optional=True)
    if prefix_id is None:
        return Request(i, arrival, prompt, output)
    prefix_len = default_prefix_len if prefix_len is None else prefix_len
    if prefix_len > prompt:
        raise ConfigError(f"{where}: prefix_len={prefix_len} is longer than prompt_len={prompt}")
    return Request(i, arrival, prompt, output, prefix_id, prefix_len)
