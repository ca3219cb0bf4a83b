"""``task=recall``: does the KV layout lose recall? The ``attention`` variant of the job learns a
synthetic recall task (kvbench/quality/recall.py: MQAR or passkey) from scratch, once per seed
under the same ``train`` budget, and is scored on held-out sequences per condition; accuracy is
the mean over seeds with a 95 % t-interval (kvbench/measure/stats.py, ``ci_seeds``).

A sweep over ``attention=mha,gqa,mqa`` compares the variants, each job on the same seeds, so the
same training streams and held-out sequences. With ``recall.uptrain_steps`` the variant is instead
an MHA model converted by mean-pooling its KV heads, scored before and after uptraining. Each
seed's accuracy is kept per condition, so a gap between two variants' records can be tested.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List

import torch

from kvbench.cache import cache_for
from kvbench.checkpoint import convert_kv_heads
from kvbench.config.bench import BenchConfig
from kvbench.config.model import AttentionConfig
from kvbench.config.recall import RecallConfig
from kvbench.generate import decode_step, prefill
from kvbench.layouts.build import build_layouts
from kvbench.measure import stats
from kvbench.measure.timing import RegionTimer, timing_method
from kvbench.metrics import Metric, metric_table, record_methods
from kvbench.model import Decoder, torch_dtype
from kvbench.progress import Progress
from kvbench.quality.recall import Condition, accuracy, chance, copy_baseline, eval_set, train_stream
from kvbench.quality.train import train
from kvbench.results import RunResult
from kvbench.tasks.common import variant_label

EVAL_SEED_OFFSET = 1_000_003  # eval sets drawn from another stream than training (the split is by hash anyway)
DECODE_STEPS = 16  # timed decode steps of batch 1 after a prefill of the longest length

_ACC = ("mqar: queries whose argmax is the stored value, over all queries; passkey: sequences whose every digit's "
        "argmax is the passkey (what a greedy decode returns), over all sequences; recall.eval_sequences held-out "
        "sequences per condition and seed, mean over recall.seeds seeds; with a quantized cache.dtype each sequence "
        "is scored through a static cache of that dtype, every position attending the dequantized K/V before it")
METRICS: Dict[str, Metric] = metric_table(
    Metric("accuracy", "ratio", _ACC + "; all conditions pooled (each condition weighs the same)"),
    Metric("accuracy_ci_low", "ratio", "low end of the 95% interval of accuracy: " + stats.METHODS["ci_seeds"]),
    Metric("accuracy_ci_high", "ratio", "high end of the 95% interval of accuracy (as accuracy_ci_low)"),
    Metric("accuracy_seeds", "count", "seeds the accuracy is the mean of"),
    Metric("accuracy_interval_reason", "text", "only without an interval: why (fewer than 2 seeds)"),
    Metric("accuracy_before_uptrain", "ratio", "recall.uptrain_steps only: accuracy of the mean-pooled MHA model "
           "before uptraining (as accuracy)"),
    Metric("chance_accuracy", "ratio", "accuracy of a guess that sees no context, pooled as accuracy (1 / values "
           "for mqar, 10^-digits for passkey)"),
    Metric("copy_accuracy", "ratio", "mqar only: accuracy of a model that answers each query with a value copied "
           "from its context without learning which key it belongs to, pooled as accuracy ((1 + (P - 1) / M) / P "
           "for P pairs of values drawn from M = V - V // 2): the floor a recall result must clear, far above "
           "chance"),
    Metric("kv_bytes_per_token", "bytes", "KV cache of one position of one sequence: a static cache of the trained "
           "model in cache.dtype (its layout's formula, the scales counted) less its per-sequence state, over its "
           "length"),
    Metric("kv_state_bytes_per_sequence", "bytes", "what one sequence holds whatever its length (each recurrent "
           "layer's state and convolution tail; 0 for K/V layers): the layouts' formula"),
    Metric("decode_ms_p50", "ms", f"median of the batch-1 decode steps at the last {DECODE_STEPS} positions of the "
           "longest recall.seq_len (a prefill of the positions before them and one warm-up step first; "
           "timing_method), the last seed's model"),
    Metric("timing_method", "text", "cuda_events on CUDA, perf_counter on CPU"),
    Metric("train_seconds", "s", "wall time of all training steps of all seeds, evaluation excluded"),
    Metric("tokens_seen", "tokens", "input tokens of all training steps of one seed (every seed sees as many)"),
    Metric("steps", "count", "optimizer steps per seed (train.steps, + recall.uptrain_steps when converting)"),
    Metric("num_params", "count", "parameters of the decoder scored"),
    Metric("num_kv_heads", "count", "KV heads of the decoder scored"),
    Metric("kv_heads_conversion", "text", "none | mean-pool: recall.uptrain_steps converts a trained MHA model "
           "(Ainslie et al. 2023)"),
    Metric("tables.accuracy", "", "one row per condition (and stage, with recall.uptrain_steps): kind, seq_len, "
           "num_pairs or distance, accuracy (mean over seeds), ci_low, ci_high (ci_seeds), seeds, per_seed (each "
           f"seed's accuracy, in seed order), solved (seeds with accuracy >= {stats.SOLVED_AT}), solved_rate (solved / "
           "seeds) with solved_rate_ci_low, solved_rate_ci_high (solved_seeds), chance, copy (mqar: copy_accuracy's "
           "value for the condition)"),
    Metric("tables.train_curve", "", "one row per logged training step of every seed (train.log_every): seed, stage "
           "(train | uptrain), step, train_loss (nats per answer token, mean over the steps since the last row), lr: "
           "whether a seed that scored low was still learning or stuck"),
)


def metrics(workload: str = "decode") -> Dict[str, Metric]:
    """Every metric a job of this task may record."""
    return METRICS


def conditions(cfg: RecallConfig) -> List[Condition]:
    """Every condition of the config: (num_pairs x seq_len) for mqar, (seq_len x distances) for passkey."""
    if cfg.kind == "mqar":
        return [Condition("mqar", t, num_pairs=p) for p in cfg.num_pairs for t in cfg.seq_len]
    return [Condition("passkey", t, distance=d) for t in cfg.seq_len for d in cfg.distances]


def summarise(per_seed: List[float]) -> Dict[str, Any]:
    """:func:`kvbench.measure.stats.seed_summary`, and why there is no interval."""
    out: Dict[str, Any] = stats.seed_summary(per_seed)
    low = out["ci_low"]
    if low is None:
        out["interval_reason"] = (f"{len(per_seed)} seed: a t-interval needs >= {stats.MIN_SEEDS} "
                                  "(raise recall.seeds)")
    return out


def _check_is_variant(model: Decoder, attention: AttentionConfig) -> None:
    """The model scored is the layout its label names, layer by layer: a conversion that dropped
    part of it would score another model under the variant's label."""
    if model.layouts != build_layouts(model.config, attention, model.state_dtype):
        raise RuntimeError(f"the recall model is {variant_label(model.attention)}, not the variant "
                           f"{variant_label(attention)} it is scored as")


def _scores(model: Decoder, sets: Dict[Condition, Any], kind: str, cache_dtype: str) -> Dict[Condition, float]:
    return {cond: accuracy(model, kind, x, y, cache_dtype=cache_dtype) for cond, (x, y) in sets.items()}


def _fit(model: Decoder, cfg: BenchConfig, steps: int, seed: int, conds: List[Condition], tick) -> Dict[str, Any]:
    r = cfg.recall
    budget = replace(cfg.train, steps=steps, warmup_steps=min(cfg.train.warmup_steps, max(steps, 1)),
                     eval_every=max(steps, 1))  # scored once, after training, by this task
    autocast = None if cfg.runtime.dtype == "float32" else torch_dtype(cfg.runtime.dtype)
    stream = train_stream(conds, cfg.train.batch_size, r.vocab_size, r.digits, seed, model.device)
    return train(model, budget, None, None, tick, seed, autocast, stream=stream, evaluate_fn=lambda m: {})


def decode_step_ms(model: Decoder, length: int, vocab_size: int, device: torch.device) -> float:
    """Median batch-1 decode step over the last positions of a ``length``-token sequence: it needs no
    position past ``length``, so a recall.seq_len of model.max_seq_len is timed like any other."""
    steps = max(1, min(DECODE_STEPS, length - 2))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab_size, (1, length - steps - 1), generator=gen).to(device)
    cache = cache_for(model, "static", 1, length)
    timer = RegionTimer(device)
    with torch.no_grad():
        token = prefill(model, prompt, cache).argmax(-1).reshape(1, 1)
        pos = prompt.shape[1]
        for i in range(steps + 1):
            with timer.region("warmup" if i == 0 else "step"):
                token = decode_step(model, token, cache, pos + i).argmax(-1).reshape(1, 1)
    return stats.median(timer.ms("step"))


def run(cfg: BenchConfig, device: torch.device, out_dir: Path, result: RunResult, progress: Progress) -> None:
    """Train and score the variant on every seed (the table is written at the end: one seed's numbers
    are never recorded alone)."""
    r = cfg.recall
    conds = conditions(r)
    model_cfg = replace(cfg.model, vocab_size=r.vocab_size)
    attention = cfg.attention
    converting = r.uptrain_steps is not None
    # recall.seq_len against model.max_seq_len and what recall.uptrain_steps can convert: checked
    # when the config was typed (config.recall.check_recall_run), before any step
    h = model_cfg.num_heads
    seeds = [cfg.runtime.seed + i for i in range(r.seeds)]
    stages = ["before_uptrain", "final"] if converting else ["final"]
    per_seed: Dict[str, Dict[Condition, List[float]]] = {s: {c: [] for c in conds} for s in stages}
    seconds, model, curve = 0.0, None, []
    steps = cfg.train.steps + (r.uptrain_steps or 0)
    label = f"recall {r.kind} {variant_label(attention)}"
    with progress(label, steps * len(seeds)) as tick:
        for seed in seeds:
            sets = {c: eval_set(c, r.eval_sequences, r.vocab_size, r.digits, EVAL_SEED_OFFSET + seed) for c in conds}
            torch.manual_seed(seed)
            with device:
                # converting: the MHA model of the variant's own layer pattern, so only its heads change
                start = replace(attention, type="mha", num_kv_heads=h) if converting else attention
                model = Decoder(model_cfg, start).to(torch_dtype("float32"))
            fitted = _fit(model, cfg, cfg.train.steps, seed, conds, tick)
            seconds += fitted["train_seconds"]
            curve += [{"seed": seed, "stage": "train", **point} for point in fitted["curve"]]
            if converting:
                model = convert_kv_heads(model, attention.num_kv_heads).float()
                for c, acc in _scores(model, sets, r.kind, cfg.cache.dtype).items():
                    per_seed["before_uptrain"][c].append(acc)
                if r.uptrain_steps:
                    uptrained = _fit(model, cfg, r.uptrain_steps, seed, conds, tick)
                    seconds += uptrained["train_seconds"]
                    curve += [{"seed": seed, "stage": "uptrain", **point} for point in uptrained["curve"]]
            _check_is_variant(model, attention)
            for c, acc in _scores(model, sets, r.kind, cfg.cache.dtype).items():
                per_seed["final"][c].append(acc)
            tokens = fitted["tokens_seen"]
    rows = []
    for stage in stages:
        for c in conds:
            row = {"stage": stage, "kind": c.kind, "seq_len": c.seq_len, "num_pairs": c.num_pairs,
                   "distance": c.distance, **summarise(per_seed[stage][c]), "per_seed": per_seed[stage][c],
                   "chance": chance(c, r.vocab_size, r.digits), "copy": copy_baseline(c, r.vocab_size)}
            rows.append({k: v for k, v in row.items() if v is not None or k in ("ci_low", "ci_high")})
    result.tables["accuracy"] = rows
    result.tables["train_curve"] = curve
    pooled = {stage: [sum(per_seed[stage][c][i] for c in conds) / len(conds) for i in range(len(seeds))]
              for stage in stages}
    head = summarise(pooled["final"])
    result.metrics.update(accuracy=head["accuracy"], accuracy_ci_low=head["ci_low"],
                          accuracy_ci_high=head["ci_high"], accuracy_seeds=head["seeds"])
    if "interval_reason" in head:
        result.metrics["accuracy_interval_reason"] = head["interval_reason"]
    if converting:
        result.metrics["accuracy_before_uptrain"] = summarise(pooled["before_uptrain"])["accuracy"]
    longest = max(c.seq_len for c in conds)
    state = model.layouts.state_bytes(model.dtype.itemsize)
    if r.kind == "mqar":
        result.metrics["copy_accuracy"] = sum(copy_baseline(c, r.vocab_size) for c in conds) / len(conds)
    result.metrics.update(
        chance_accuracy=sum(chance(c, r.vocab_size, r.digits) for c in conds) / len(conds),
        kv_bytes_per_token=(cache_for(model, "static", 1, longest, cfg.cache.dtype).nbytes - state) / longest,
        kv_state_bytes_per_sequence=state,
        decode_ms_p50=decode_step_ms(model.eval(), longest, r.vocab_size, device),
        timing_method=timing_method(device), train_seconds=seconds, tokens_seen=tokens, steps=steps,
        num_params=model.num_params(), num_kv_heads=model.num_kv_heads,
        kv_heads_conversion="mean-pool" if converting else "none")
    result.methods.update(record_methods(METRICS))
