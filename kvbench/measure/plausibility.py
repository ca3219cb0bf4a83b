"""Physical bounds a record's figures must respect, checked on every record before it is written.

A figure that breaks one is not silently true: the record keeps it and carries ``implausible``
(the bounds are listed in :data:`PLAUSIBILITY_METHODS`), which the console and the report show.
Every bound is measured or read on the machine the record was taken on, never a constant of some
other machine. A KV cost whose whole interval is below zero is a step that got cheaper as it read
more, which no cache does: drift, not cost.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterator, List, Optional, Tuple

# How far past a bound a figure may lie before it is flagged, per kind of bound: probes are best of
# a few runs on a machine that may be busy, NVML limits a power averaged over about a second.
TOLERANCE = {"bandwidth": 0.05, "time": 0.05, "power": 0.10}

PLAUSIBILITY_METHODS: Dict[str, str] = {
    "implausible": "list of {metric, value, bound, reason}: figures of this record that break a physical bound "
                   "of the machine (kvbench/measure/plausibility.py: bandwidth <= the probed peak, step time >= the "
                   "roofline and the step's own GEMMs, power <= NVML's enforced limit, allocations > 0, an estimate "
                   "inside its interval, a KV cost not below zero); empty when none",
}

Item = Dict[str, Any]


def _num(value: Any) -> Optional[float]:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _item(metric: str, value: float, bound: str, reason: str) -> Item:
    return {"metric": metric, "value": value, "bound": bound, "reason": reason}


def _bandwidth(m: Dict[str, Any]) -> Iterator[Item]:
    achieved, peak = _num(m.get("achieved_gb_per_s")), _num(m.get("peak_gb_per_s"))
    if achieved is not None and peak and achieved > peak * (1 + TOLERANCE["bandwidth"]):
        yield _item("achieved_gb_per_s", achieved, f"<= peak_gb_per_s = {peak:.4g} GB/s",
                    f"{achieved:.4g} GB/s is faster than this machine's probed peak of {peak:.4g} GB/s "
                    f"({m.get('peak_method', 'probe')}): the peak was probed under load, or bytes are miscounted")


def _time(m: Dict[str, Any]) -> Iterator[Item]:
    step = _num(m.get("decode_ms_p50"))
    if step is None:
        return
    for key, what in (("roofline_ms", "the roofline (bytes / peak bandwidth, FLOP / peak compute)"),
                      ("gemm_ms_at_batch", "the step's own weight GEMMs timed at its batch")):
        bound = _num(m.get(key))
        if bound and step < bound * (1 - TOLERANCE["time"]):
            yield _item("decode_ms_p50", step, f">= {key} = {bound:.4g} ms",
                        f"a decode step of {step:.4g} ms is faster than {what}, {bound:.4g} ms")


def _power(m: Dict[str, Any], config: Dict[str, Any]) -> Iterator[Item]:
    limit = _num(m.get("power_limit_w"))
    if not limit:
        return
    cap = limit * (1 + TOLERANCE["power"])
    energy, span_s = _num(m.get("energy_mj")), _num(m.get("energy_span_s"))
    if energy is not None and span_s:
        watts = energy / 1e3 / span_s
        if watts > cap:
            yield _item("energy_mj", energy, f"energy_mj / energy_span_s <= power_limit_w = {limit:.4g} W",
                        f"{energy:.6g} mJ in {span_s:.3g} s is {watts:.4g} W, above the board's enforced limit of "
                        f"{limit:.4g} W: the energy and its span do not match")
    per_token, e2e = _num(m.get("energy_mj_per_token")), _num(m.get("e2e_ms"))
    w = config.get("workload") or {}
    batch, gen = w.get("batch_size"), w.get("gen_len")
    if per_token is not None and e2e and isinstance(batch, int) and isinstance(gen, int):
        watts = per_token * batch * (gen + 1) / e2e  # mJ per ms = W
        if watts > cap:
            yield _item("energy_mj_per_token", per_token,
                        f"x tokens per ms of a trial <= power_limit_w = {limit:.4g} W",
                        f"{per_token:.4g} mJ/token at {batch * (gen + 1)} tokens per {e2e:.4g} ms trial is "
                        f"{watts:.4g} W, above the board's enforced limit of {limit:.4g} W: energy and tokens "
                        "come from different spans")


def _memory(m: Dict[str, Any], env: Dict[str, Any]) -> Iterator[Item]:
    formula = _num(m.get("kv_cache_bytes_formula"))
    if formula:
        for key in ("kv_cache_bytes", "kv_cache_bytes_torch", "kv_cache_bytes_nvml"):
            value = _num(m.get(key))
            if value is not None and value <= 0:
                yield _item(key, value, "> 0 (the formula allocates bytes)",
                            f"{key} = {value:.0f} for a cache of {formula:.0f} bytes: a zero that means 'not seen' "
                            "is null with a reason, never a measurement")
    weights, kv = _num(m.get("weight_bytes")), _num(m.get("kv_cache_bytes")) or 0.0
    peak = _num(m.get("torch_peak_allocated_bytes"))
    if peak is not None and weights and peak < weights + kv:
        yield _item("torch_peak_allocated_bytes", peak, f">= weight_bytes + kv_cache_bytes = {weights + kv:.0f}",
                    "torch's peak allocation over the timed trials is less than the weights and cache alive in it")
    rss = _num(m.get("peak_rss_bytes"))
    if rss is not None and weights and str(env.get("device", "cpu")).startswith("cpu") and rss < weights:
        yield _item("peak_rss_bytes", rss, f">= weight_bytes = {weights:.0f}",
                    "the process's peak resident set is smaller than the weights it held on the CPU")


def _intervals(values: Dict[str, Any], where: str) -> Iterator[Item]:
    for key in [k[: -len("_ci_low")] for k in values if k.endswith("_ci_low")]:
        est, low, high = (_num(values.get(k)) for k in (key, f"{key}_ci_low", f"{key}_ci_high"))
        if None in (est, low, high):
            continue
        slack = 1e-9 * max(abs(est), abs(low), abs(high), 1.0)
        if not low - slack <= est <= high + slack:
            yield _item(where + key, est, f"in [{low:.6g}, {high:.6g}]",
                        f"{key} = {est:.6g} lies outside its own 95% interval [{low:.6g}, {high:.6g}]: the "
                        "estimate and the interval are of different statistics or samples")
        if key.endswith("us_per_1k_ctx") and high < 0:
            yield _item(where + key, est, ">= 0 µs per 1k positions",
                        f"a KV cost of {est:.4g} µs per 1k positions, interval [{low:.4g}, {high:.4g}], is a step "
                        "that gets cheaper as it reads more: a drift of the machine, not a cost")


def check(record: Dict[str, Any]) -> List[Item]:
    """Every bound a record's figures break (a record as :meth:`RunResult.to_dict` gives it)."""
    m = record.get("metrics") or {}
    config, env = record.get("config") or {}, record.get("env") or {}
    found = [*_bandwidth(m), *_time(m), *_power(m, config), *_memory(m, env), *_intervals(m, "")]
    for name, rows in (record.get("tables") or {}).items():
        for i, row in enumerate(rows or []):
            if isinstance(row, dict):
                found += _intervals(row, f"tables.{name}[{i}].")
    return found


def flag_implausible(result: Any) -> Tuple[Item, ...]:
    """Set ``result.implausible`` (and its method when something is flagged); returns what was flagged."""
    found = check(result.to_dict())
    result.implausible = found
    if found:
        result.methods.update(PLAUSIBILITY_METHODS)
    return tuple(found)
