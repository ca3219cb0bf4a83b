"""``task=capacity``: the largest batch that fits a memory budget and meets latency targets (the
probes; the search and its prediction are :mod:`kvbench.tasks.capacity_search`).

For each context length the search probes batch 1, calibrates the activation overhead on two
probes whose prefill forwards are full chunks of ``capacity.prefill_chunk`` tokens (the smallest
such batch and 3 more), predicts the largest batch from weights + KV formula + that overhead,
then confirms and bisects around the prediction with measured probes
(:func:`~kvbench.tasks.capacity_search.search_capacity`); a measured answer beyond
:data:`~kvbench.tasks.capacity_search.PREDICTION_TOLERANCE` of the prediction is a finding in the
record. A probe that no latency target judges runs one trial (repeats measure latency). With
``workload=multiturn`` the batch is the number of concurrent conversations of the chat.

A probe is a real decode of that batch whose peak memory is checked against the budget and whose
TTFT and TPOT are checked against ``slo``; an out-of-memory is the probe's answer. With
``slo.tpot_x_batch1`` its TPOT is judged against one sequence's, stepped interleaved with it
(:func:`time_pairs`). Every probe is kept (``tables.capacity_probes``).
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from kvbench.config.bench import BenchConfig
from kvbench.core.errors import ConfigError
from kvbench.measure.host import long_lived_frozen, release_heap, rss_status
from kvbench.measure.memory import PeakSpan, is_oom, peak_span_reason, weight_bytes
from kvbench.measure.stats import median, paired_ratio, percentile, preload
from kvbench.measure.timing import timing_method
from kvbench.metrics import Metric, metric_table, record_methods
from kvbench.model import Decoder
from kvbench.parallel.per_gpu import SPLIT_METRICS, job_split_metrics, per_gpu_table
from kvbench.parallel.per_gpu import TABLE as PER_GPU
from kvbench.progress import Progress
from kvbench.quant_weights import checkpoint_bytes
from kvbench.results import RunResult
from kvbench.tasks.capacity_latency import (
    MEMORY_PROBE_STEPS,
    Guarded,
    Latency,
    OverBudget,
    Stepper,
    chat_latency,
    copies_prompts,
    decode_latency,
    probe_decode_steps,
    time_pairs,
    warm_up,
)
from kvbench.tasks.capacity_plan import plan_capacity
from kvbench.tasks.capacity_quality import QUALITY_METHODS, QUALITY_METRICS, variant_quality
from kvbench.tasks.capacity_search import (
    SEARCH_LIMIT,
    Probe,
    calibration_batches,
    contexts,
    fit_activation,
    formula_max_batch,
    kv_bytes,
    kv_bytes_per_token,
    latency_judged,
    over_budget,
    prediction_finding,
    prefill_piece,
    probes_expected,
    search_capacity,
    split_activation,
    state_bytes_per_sequence,
    tpot_support,
    violations,
)
from kvbench.tasks.common import JOB_METHODS, JOB_METRICS, build_model, job_variant_label, weight_metrics

# the probes' latency half
__all__ = ["MEMORY_PROBE_STEPS", "Latency", "Stepper", "chat_latency", "decode_latency", "time_pairs", "warm_up"]

GB = 10 ** 9  # runtime.memory_budget_gb is in GB, as device memory is sold
STAT_Q = {"p50": 0.5, "p99": 0.99}
# On a CPU the budget is a rule, not the machine's limit: a probe predicted to need more than this
# many budgets is not run (it could take the machine's memory from everyone else on it).
CPU_REFUSE_FACTOR = 2.0
# The calibration's second batch: far enough from batch 1 that the slope per sequence is not lost
# in one-off growth (batch 1 -> 2 read 6 MB more where 2 -> 9 added 1.4 MB per sequence).
CALIBRATION_BATCH = 4

METRICS: Dict[str, Metric] = metric_table(
    Metric("memory_budget_bytes", "bytes", "runtime.memory_budget_gb x 1e9, or (null, CUDA) the device's total memory"),
    Metric("memory_method", "text", "how a probe's memory is measured: CPU, the peak resident set of the job's process "
                     "during the probe (VmHWM, reset through /proc/self/clear_refs after freed heap is returned "
                     "to the OS) minus the resident set before the model was built (what judging a probe imports, "
                     "scipy.stats, loaded before it), so weights, KV cache, activations and allocator slack count "
                     "and the Python/torch runtime does not (the code pages of kernels first run in the job do: a "
                     "fixed part of the overhead, set up by an untimed decode of one short sequence before the "
                     "first probe); each probe against its own baseline: less what the process held right before "
                     "it beyond what it held right before the first probe (retained_bytes: what earlier probes "
                     "left resident is not this one's); CUDA, "
                     "torch.cuda.max_memory_reserved during the probe (what torch held from the device; the "
                     "CUDA context is outside it)"),
    Metric("weight_bytes_measured", "bytes", "parameters and persistent buffers of the model the probes ran"),
    Metric("kv_bytes_per_token", "bytes", "KV formula of one sequence as the longest probe holds it, all layers, "
                          "over its kv_bytes_per_token_positions (2 * layers * kv_heads * head_dim * bytes per "
                          "element per position; MLA: layers * (kv_lora_rank + qk_rope_head_dim) * bytes per "
                          "element): any one position's bytes where every layer holds every position; a local "
                          "layer's ring stops at W, so such a layout's figure is that of this length, and falls as "
                          "the context grows"),
    Metric("kv_state_bytes_per_sequence", "bytes", "what one sequence holds whatever its length (the layouts' "
           "formula: each recurrent layer's state and convolution tail; 0 for K/V layers), included in "
           "kv_bytes_per_token's sequence"),
    Metric("kv_bytes_per_token_positions", "tokens", "the positions of one sequence kv_bytes_per_token is taken at: "
                                    "the longest context + workload.gen_len (a chat: a conversation's positions)"),
    Metric("prompts_copied", "bool", "capacity.copy_prompts in effect: a probe of B > 1 sequences whose prompts "
           "fill more than one prefill forward prefilled its first prompt alone (forwards of capacity.prefill_chunk "
           "tokens), copied that history into the other rows and ran the last chunk // B positions over the batch, "
           "each its own tokens. Memory and TPOT are the batch's; its TTFT is not (ttft_ms null there). false: every "
           "prompt prefilled (slo.ttft_ms set, cache.impl=concat, capacity.prefill_chunk=null or copy_prompts=false)"),
    Metric("probe_decode_steps", "steps", "decode steps of each probe's trial: null, all of them (workload.gen_len, "
           "a chat's every turn); where no latency target judges a probe and its cache allocates every position up "
           "front (cache.impl=static, workload=decode), at most 8: its memory peaks at the first step, and later "
           "ones add time, not bytes (the cache still holds context + workload.gen_len positions)"),
    Metric("max_batch_longest", "sequences", "max_batch at the longest context"),
    Metric("stopped_by_longest", "text",
           "memory | ttft | tpot | capacity.max_batch: the bound of the smallest batch that "
                          "failed at the longest context ('memory (predicted, not run)': that batch was refused on "
                          "a CPU, predicted over 2 budgets)"),
    Metric("decode_ms_p50_longest", "ms",
           "median decode step at batch 1 and the longest context (the calibration probe)"),
    Metric("tokens_per_s_longest", "tokens/s", "batch x 1000 / the median decode step (every step of every "
                                                "trial) of the probe at max_batch at the longest context"),
    Metric("probes_run", "count", "probes measured over all contexts (refused ones not counted); a probe that "
           "no latency target judges (no slo.ttft_ms, slo.tpot_ms, slo.tpot_x_batch1) runs one trial, else "
           "runtime.warmup + runtime.repeats"),
    Metric("tpot_untested_longest", "text", "slo.tpot_x_batch1: null when the paired steps support the longest "
           "context's answer (the median ratio's 95% paired-bootstrap interval of the probe at max_batch and of "
           "the one that failed above it each clear of the target), else which interval holds the target: that "
           "capacity moves with the machine's noise (tables.capacity's tpot_untested)"),
    Metric("prediction_findings", "text", "the contexts whose memory-bound answer is more than 20% (of the larger) "
           "from the memory-only prediction, each with both figures (tables.capacity's prediction_finding); "
           "null: the prediction held everywhere memory bound"),
    Metric("tables.capacity", "",
           "one row per context (workload=multiturn: one row, context = the positions a conversation holds at the "
           "chat's end, max_batch = concurrent conversations): max_batch (largest batch whose probe met every bound; "
           "the search assumes that a bound met at batch b is met below it), stopped_by, predicted_max_batch (weights "
           "+ KV formula + activation_fixed_bytes + activation_bytes_per_sequence per sequence, a line through the "
           "calibration probes: the smallest batch whose prefill forwards are full capacity.prefill_chunk chunks and 3 "
           "more; without a chunk, or a chat, batches 1 and 4; memory only), prediction_finding (null, or the sentence "
           "when memory stopped the search more than 20% from that prediction), tpot_untested (null, or the probes "
           "whose paired-step ratio interval holds slo.tpot_x_batch1: untested), formula_max_batch (weights + KV "
           "formula alone; formula_max_batch_stored, a quantized checkpoint's: its weights as stored, "
           "weight_bytes_stored), kv_bytes_per_sequence (KV formula of one more sequence; with cache.shared the system "
           "prompt's, held once, is not in it), activation_fixed_bytes and activation_bytes_per_sequence (bytes), "
           "decode_ms_p50_batch1, the probe at max_batch: peak_bytes (measured) next to predicted_bytes, ttft_ms, "
           "tpot_ms, tpot_paired_ms, tpot_target_ms, tokens_per_s (each with the suffix _at_max)"),
    Metric("tables.capacity_probes", "",
           "one row per probe, in the order run: context, batch, ok, bound (the first bound violated: memory, ttft, "
           "tpot), violated (all of them, comma-separated), measured (false: refused on a CPU, predicted over 2 "
           "budgets), peak_bytes, predicted_bytes (weights + KV formula + the activation line through the "
           "calibration probes, or the secant of the probes measured whole within the budget before it: the "
           "largest and the largest at most 3/4 of its batch), kv_bytes "
           "(formula), activation_bytes (peak - weights - KV), "
           "retained_bytes (CPU: the resident set right before the probe less right before the first, not counted in "
           "its peak_bytes), ttft_ms "
           "and tpot_ms (slo.stat over the trials' TTFTs and over every decode step of every trial; ttft_ms null "
           "where the probe copied its prompts, prompts_copied; "
           "workload=multiturn: over every turn's TTFT of every chat and every decode step of every turn; with fewer "
           "than 100 samples a p99 is near their maximum; judged against slo.tpot_ms), tpot_paired_ms and "
           "tpot_reference_ms (slo.tpot_x_batch1, with tpot_ratio_low and tpot_ratio_high the 95% paired-bootstrap "
           "interval of their median ratio, after the probe, outside its memory span: slo.stat over "
           "capacity.tpot_pairs decode steps of the probe's filled cache, at the positions its last decode steps wrote "
           "(workload=multiturn: the last turn's), each interleaved with a step of one sequence at the same context "
           "and position, whose slo.stat is the reference; judged: tpot_paired_ms <= slo.tpot_x_batch1 x "
           "tpot_reference_ms; not timed for a probe over the budget), tpot_target_ms (slo.tpot_ms, slo.tpot_x_batch1 "
           "x tpot_reference_ms, or the tighter of both), decode_ms_p50, tokens_per_s, oom, error (CPU: a probe whose "
           "resident set passed the budget stops at the forward that crossed it, 'stopped after N forwards', its "
           "peak_bytes the peak it had reached)"),
)
METRICS[PER_GPU.name] = PER_GPU
METRICS.update(SPLIT_METRICS)  # the job's own split (runtime.tensor_parallel / expert_parallel), where it has one
METHODS: Dict[str, str] = record_methods(METRICS)

def metrics(workload: str = "decode") -> Dict[str, Metric]:
    """Every metric a job of this task may record."""
    return {**JOB_METRICS, **METRICS, **QUALITY_METRICS}


def memory_budget(cfg: BenchConfig, device: torch.device) -> int:
    """The budget in bytes; a CPU needs ``runtime.memory_budget_gb`` (one-line ConfigError)."""
    if cfg.runtime.memory_budget_gb is not None:
        return int(cfg.runtime.memory_budget_gb * GB)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    raise ConfigError(f"runtime.memory_budget_gb=None: task=capacity on {device.type} needs a memory budget "
                      "in GB (e.g. runtime.memory_budget_gb=0.5); only a CUDA device has one of its own")


class Prober:
    """Runs probes of one model: a decode of ``batch`` sequences of ``context`` tokens, its peak
    memory against the budget and its latencies against the SLOs."""

    def __init__(self, cfg: BenchConfig, model: Decoder, device: torch.device, budget: int, baseline: int):
        self.cfg, self.model, self.device = cfg, model, device
        self.budget, self.baseline = budget, baseline
        self.weights = weight_bytes(model)
        stored = cfg.model.weights_stored
        self.weights_stored = checkpoint_bytes(model, stored) if stored else None
        self.activation: Dict[int, Tuple[int, int]] = {}  # context -> (fixed, per sequence), calibrated
        # context -> the line through the calibration and every probe measured within the budget since:
        # what a probe is predicted to hold (a line from batches 2 and 5 read 20 MB of allocator noise as
        # 6 MB a sequence and refused batches that held 0.73 GB of a 1 GB budget as over 2 GB)
        self.fit: Dict[int, Tuple[int, int]] = {}
        self.within: Dict[int, List[Probe]] = {}
        self.chunk = cfg.capacity.prefill_chunk if cfg.workload.name != "multiturn" else None
        self.piece = prefill_piece(model.layouts)
        self.idle: Optional[int] = None  # CPU: the resident set right before the first probe (after a warm-up)
        self.latency = chat_latency if cfg.workload.name == "multiturn" else decode_latency
        # what repeated trials measure is latency: a probe that no target judges runs one trial
        self.probe_cfg = cfg if latency_judged(cfg) else replace(
            cfg, runtime=replace(cfg.runtime, warmup=0, repeats=1, min_time_s=0.0))
        self.steps = probe_decode_steps(cfg)

    def tpot_target(self, reference_ms: Optional[float]) -> Optional[float]:
        """slo.tpot_ms, or slo.tpot_x_batch1 x ``reference_ms`` (the batch-1 TPOT), the tighter."""
        slo = self.cfg.slo
        targets = [slo.tpot_ms] if slo.tpot_ms is not None else []
        if slo.tpot_x_batch1 is not None and reference_ms is not None:
            targets.append(slo.tpot_x_batch1 * reference_ms)
        return min(targets, default=None)

    def paired_steps(self, context: int, probe: Optional[Stepper]) -> Optional[Tuple[List[float], List[float]]]:
        """slo.tpot_x_batch1: more steps of the probe's filled cache, each interleaved with a step of
        one sequence at the same context (outside any measured span); None when the target is absolute."""
        if self.cfg.slo.tpot_x_batch1 is None or probe is None:
            return None
        reference = self.latency(self.cfg, self.model, self.device, context, 1).stepper
        if reference is None:
            return None
        try:
            return time_pairs(probe, reference, self.cfg.capacity.tpot_pairs, self.device)
        finally:
            del reference
            release_heap()

    def line(self, context: int) -> Tuple[int, int]:
        """The activation line a next probe is predicted by: the redrawn one, else the calibration's."""
        return self.fit.get(context, self.activation.get(context, (0, 0)))

    def predicted_bytes(self, context: int, batch: int) -> int:
        fixed, per_sequence = (max(0, a) for a in self.line(context))
        return self.weights + fixed + kv_bytes(self.cfg, context, batch) + batch * per_sequence

    def line_batch(self, context: int) -> int:
        """The largest batch :meth:`line` says the budget holds."""
        return formula_max_batch(self.cfg, context, self.budget, self.weights, self.line(context))

    def refit(self, probe: Probe) -> None:
        """After the calibration, a probe measured whole within the budget redraws the line a next
        probe is predicted by (:func:`fit_activation`, once two batches are measured)."""
        if probe.context not in self.activation or over_budget(probe, self.budget):
            return
        seen = self.within.setdefault(probe.context, [])
        seen.append(probe)
        line = fit_activation(seen, probe.context, self.chunk, self.piece)
        if line is not None:
            self.fit[probe.context] = line

    def measure(self, context: int, batch: int) -> Probe:
        cfg = self.cfg
        probe = Probe(context, batch, ok=False, kv_bytes=kv_bytes(cfg, context, batch),
                      predicted_bytes=self.predicted_bytes(context, batch))
        if self.device.type != "cuda" and probe.predicted_bytes > CPU_REFUSE_FACTOR * self.budget:
            probe.measured, probe.bound, probe.violated = False, "memory", ["memory"]
            probe.error = (f"not run: predicted {probe.predicted_bytes:,} bytes, over {CPU_REFUSE_FACTOR:g}x the "
                           f"budget on a CPU")
            return probe
        latency, cpu = None, self.device.type != "cuda"
        span, guarded = PeakSpan(self.device), Guarded(self.model, None)
        try:
            with span:
                idle = rss_status()[0] if cpu else 0  # freed heap returned, the clock of the peak reset
                if cpu:  # past the budget the verdict is in: stop there (this probe's own baseline)
                    guarded.limit = self.baseline + idle - (idle if self.idle is None else self.idle) + self.budget
                latency = self.latency(self.probe_cfg, guarded, self.device, context, batch, steps=self.steps)
        except OverBudget as exc:
            probe.error = str(exc)
        except Exception as exc:  # noqa: BLE001 — an out-of-memory is the probe's answer; others are not
            if not is_oom(exc):
                raise
            probe.oom, probe.error = True, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        finally:
            guarded.limit = None  # its paired steps run outside the span
            release_heap()
        if cpu:
            # Each probe against its own baseline: what earlier probes left resident (an import, a cache,
            # heap the allocator kept) is not this one's; what the process held before the first is.
            self.idle = idle if self.idle is None else self.idle
            probe.retained_bytes = idle - self.idle
        probe.peak_bytes = span.peak - (self.baseline + probe.retained_bytes if cpu else 0)
        probe.activation_bytes = probe.peak_bytes - self.weights - probe.kv_bytes
        q = STAT_Q[cfg.slo.stat]
        if latency is not None:
            probe.ttft_ms = percentile(latency.ttft_ms, q) if latency.ttft_ms else None  # copied prompts: none
            probe.tpot_ms = percentile(latency.step_ms, q) if latency.step_ms else None
            probe.decode_ms_p50 = median(latency.step_ms) if latency.step_ms else None
            probe.tokens_per_s = latency.tokens_per_s
            # over the budget it has failed already, and its cache would hold that memory longer
            if not over_budget(probe, self.budget):
                paired = self.paired_steps(context, latency.stepper)
                if paired is not None:
                    probe.tpot_paired_ms, probe.tpot_reference_ms = (percentile(ms, q) for ms in paired)
                    _, probe.tpot_ratio_low, probe.tpot_ratio_high = paired_ratio(paired[1], paired[0])
            latency = None  # the probe's cache
            release_heap()
        probe.tpot_target_ms = self.tpot_target(probe.tpot_reference_ms)
        probe.violated = violations(probe, self.budget, cfg.slo.ttft_ms, cfg.slo.tpot_ms, cfg.slo.tpot_x_batch1)
        probe.ok = not probe.violated
        probe.bound = probe.violated[0] if probe.violated else None
        self.refit(probe)
        return probe


def baseline_bytes(device: torch.device) -> int:
    """What the process holds before the model exists (CPU: its resident set; CUDA: 0, torch's
    counters start from nothing); checks first that the peak of a span can be measured here."""
    reason = peak_span_reason(device)
    if reason:
        raise ConfigError(f"task=capacity on {device.type}: {reason}")
    if device.type == "cuda":
        return 0
    preload()  # what judging a probe imports on first use is the runtime's, not that probe's
    release_heap()
    return rss_status()[0]


def run_probes(cfg: BenchConfig, model: Decoder, device: torch.device, result: RunResult, baseline: int,
               tick: Optional[Callable[..., None]] = None) -> None:
    """Every context of ``capacity.context_lens``: calibrate, predict, search; probes and answers
    into ``result.tables`` as they are measured (a failure keeps them)."""
    with long_lived_frozen():  # each probe frees its heap about four times
        _search_all(cfg, model, device, result, baseline, tick)


def _search_all(cfg: BenchConfig, model: Decoder, device: torch.device, result: RunResult, baseline: int,
                tick: Optional[Callable[..., None]]) -> None:
    result.methods.update(METHODS)
    metrics = result.metrics
    budget = memory_budget(cfg, device)
    prober = Prober(cfg, model, device, budget, baseline)
    per_token, positions = kv_bytes_per_token(cfg)
    metrics.update(memory_budget_bytes=budget, weight_bytes_measured=prober.weights,
                   memory_method="cuda max_memory_reserved" if device.type == "cuda" else "cpu peak RSS delta",
                   kv_bytes_per_token=per_token, kv_bytes_per_token_positions=positions,
                   kv_state_bytes_per_sequence=state_bytes_per_sequence(cfg),
                   prompts_copied=cfg.workload.name != "multiturn" and copies_prompts(cfg, 2, max(contexts(cfg))),
                   probe_decode_steps=None if prober.steps is None else min(prober.steps, cfg.workload.gen_len))
    probes = result.tables.setdefault("capacity_probes", [])
    answers = result.tables.setdefault("capacity", [])
    limit, step = cfg.capacity.max_batch, cfg.capacity.batch_step

    def measure(context: int) -> Callable[[int], Probe]:
        def one(batch: int) -> Probe:
            probe = prober.measure(context, batch)
            # one scalar per cell (a W&B table's column holds one type): the bounds as "memory,tpot"
            probes.append({**asdict(probe), "violated": ",".join(probe.violated)})
            if tick is not None:
                tick()
            return probe
        return one

    chunk, piece = prober.chunk, prober.piece
    warm_up(cfg, model, device)
    for context in contexts(cfg):
        calibration = [measure(context)(1)]
        # The line is drawn through batches whose prefill forwards are full chunks (batch 1 at a
        # short context prefills fewer tokens a forward, which a line through it would spread over
        # every sequence); they are for memory: a latency miss at batch 1 does not make them useless.
        if calibration[0].measured and "memory" not in calibration[0].violated:
            for batch in calibration_batches(context, chunk, limit, CALIBRATION_BATCH - 1, piece):
                if batch > 1 and not any(p.violated == ["memory"] for p in calibration):
                    calibration.append(measure(context)(batch))
            # the budget is reached before the working set is: the answer lies below, so does the line
            if len(calibration) == 2 and calibration[1].violated == ["memory"] and calibration[1].batch > 2:
                calibration.append(measure(context)(2))
        prober.activation[context] = split_activation(calibration, context, chunk, piece)
        for probe in calibration:
            prober.refit(probe)
        predicted = formula_max_batch(cfg, context, budget, prober.weights, prober.activation[context])
        search = search_capacity(measure(context), max(1, predicted), limit, step, known=calibration,
                                 predict=lambda c=context: prober.line_batch(c))
        at = next((p for p in search.probes if p.batch == search.max_batch), None)
        failed = next((p for p in search.probes if p.batch == search.failed_at), None)
        # a refused probe's bound is a prediction, and the answer says so
        stopped_by = (SEARCH_LIMIT if failed is None else failed.bound if failed.measured
                      else f"{failed.bound} (predicted, not run)")
        answers.append({
            "context": context, "max_batch": search.max_batch, "stopped_by": stopped_by,
            "predicted_max_batch": predicted,
            "prediction_finding": prediction_finding(search.max_batch, predicted, stopped_by, limit),
            "tpot_untested": tpot_support(at, failed, cfg.slo.tpot_x_batch1),
            "formula_max_batch": formula_max_batch(cfg, context, budget, prober.weights),
            # a quantized checkpoint's weights as an engine reading them holds them, not kvbench's dequantized copy
            **({"formula_max_batch_stored": formula_max_batch(cfg, context, budget, prober.weights_stored)}
               if prober.weights_stored is not None else {}),
            "probes": len(search.probes),
            "kv_bytes_per_sequence": kv_bytes(cfg, context, 2) - kv_bytes(cfg, context, 1),
            "activation_fixed_bytes": prober.activation[context][0],
            "activation_bytes_per_sequence": prober.activation[context][1],
            "decode_ms_p50_batch1": calibration[0].decode_ms_p50,
            **{f"{k}_at_max": getattr(at, k) if at else None
               for k in ("peak_bytes", "predicted_bytes", "ttft_ms", "tpot_ms", "tpot_paired_ms", "tpot_target_ms",
                         "tokens_per_s")},
        })
    longest = answers[-1]
    findings = [f"context {a['context']}: {a['prediction_finding']}" for a in answers if a["prediction_finding"]]
    metrics.update(max_batch_longest=longest["max_batch"], stopped_by_longest=longest["stopped_by"],
                   prediction_findings="; ".join(findings) or None, tpot_untested_longest=longest["tpot_untested"],
                   decode_ms_p50_longest=longest["decode_ms_p50_batch1"],
                   tokens_per_s_longest=longest["tokens_per_s_at_max"],
                   probes_run=sum(1 for p in probes if p["measured"]))


def run(cfg: BenchConfig, device: torch.device, out_dir: Path, result: RunResult, progress: Progress) -> None:
    """``task=capacity``: the largest batch per context under the budget and the SLOs (baseline: pre-model)."""
    result.methods.update({**JOB_METHODS, **METHODS})
    # a GPU's part under the job's own split (runtime.tensor_parallel / expert_parallel), by formula
    result.metrics.update(job_split_metrics(cfg, max(contexts(cfg)), memory_budget(cfg, device), less_weights=True))
    if cfg.capacity.plan:  # formulas and the serving store's plan: no model built, no probe run
        return plan_capacity(cfg, memory_budget(cfg, device), result)
    result.metrics["timing_method"] = timing_method(device)
    baseline = baseline_bytes(device)
    model = build_model(cfg, device)
    result.metrics.update(weight_metrics(model))
    # what the budget holds per GPU where the model is split over a node (formula: kvbench.parallel)
    result.tables["per_gpu"] = per_gpu_table(cfg.model, cfg.attention, cfg.runtime.dtype, cfg.cache.dtype,
                                             contexts(cfg), memory_budget(cfg, device), cfg.capacity.gpus_per_node)
    label = f"capacity {job_variant_label(cfg)}"
    if cfg.workload.name == "multiturn":
        label += f" chat shared={cfg.cache.shared}"
    expected = len(contexts(cfg)) * probes_expected(cfg.capacity.max_batch,
                                                                          cfg.capacity.batch_step)
    with progress(label, expected) as tick:
        run_probes(cfg, model, device, result, baseline, tick)
    # quality of this KV-head count, after the probes (its models are not theirs), measured on a model of
    # the variant's own layer layouts or null with the reason (tasks/capacity_quality.py)
    if cfg.runtime.fidelity:
        layouts = model.layouts
        del model
        result.methods.update(QUALITY_METHODS)
        result.metrics.update(variant_quality(cfg, layouts, device))
