"""What each KV precision costs a trained model: perplexity, fidelity and recall per cache.dtype, paired.

    python experiments/kv_precision_quality.py --threads 1

Two small models are trained once each (float32, CPU), then scored through a static cache in every
precision of ``--precisions`` (default: auto, float8_e4m3fn, int8, nvfp4, mxfp4, nvfp4_rotated), so the
precisions differ only in how K/V are stored and every comparison is paired (same weights, same text):

- **Language model** (4 layers, d_model 128, 4 heads of 32 (MHA), byte tokens, the default corpus: the
  standard library's sources, its last 10 % held out; ``--lm-steps`` steps of 16 x 128 tokens). Perplexity
  over ``--lm-slices`` held-out slices of 128 bytes, scored by :func:`kvbench.quality.train.sequence_nll`
  (every position attends the dequantized K/V before it, as a token-by-token decode through that cache
  would); the difference to ``auto`` per byte with a percentile-bootstrap 95 % interval over slices.
  Fidelity (:func:`kvbench.quality.fidelity.quantized_cache_fidelity`): a greedy decode of ``--gen``
  tokens after 8 held-out prompts of 256 bytes through the quantized cache against the same tokens
  through the float32 cache: the largest |logit difference| and the positions whose argmax agrees, with
  an exact binomial interval over positions (the positions of one prompt are not independent, so read
  that interval as the least uncertainty there is, not all of it).
- **Recall** (MQAR as ``experiment=recall`` sets it: 2 layers, d_model 64, 4 heads of 32, keys and
  values of a 64-token vocabulary, 4 / 8 / 12 pairs in 40 positions, 800 steps; then passkey retrieval,
  a 4-digit number 8 / 20 / 32 positions back, trained and scored alike; ``--seeds`` seeds): each
  seed's model scored on the same 256 held-out sequences per condition (:func:`kvbench.quality.recall.
  accuracy` with ``cache_dtype``); per precision the mean over seeds of its accuracy and of its paired
  difference to ``auto``, each with a t-interval over seeds (a seed is one trained model).

``--reuse RUN.json`` keeps the parts a run of the same settings measured and measures the others;
``--from-json`` rewrites the report from a run's figures. Heads are 32 wide because mxfp4's scale
block is 32 values (a head of 16 is refused). KV bytes per token: the layouts' formula
(``Layouts.bytes_per_token``) for the language model, against bfloat16 (2 bytes per value) as a GPU
would compute. Writes ``--out`` (default ``outputs/experiments/kv_precision_quality.md``; the committed
copy is ``experiments/results/kv_precision_quality.md``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch
from _common import Parser, existing_file, list_of, out_file, positive_int, run_main, say, write_report

from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.config.train import DataConfig, TrainConfig
from kvbench.core.dtypes import CACHE_DTYPES
from kvbench.measure.stats import bootstrap_ci, proportion_interval, t_interval
from kvbench.model import Decoder
from kvbench.quality.data import byte_data
from kvbench.quality.fidelity import quantized_cache_fidelity
from kvbench.quality.recall import Condition, accuracy, eval_set, train_stream
from kvbench.quality.train import sequence_nll, train
from kvbench.tasks.recall import EVAL_SEED_OFFSET

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = "auto,float8_e4m3fn,int8,nvfp4,mxfp4,nvfp4_rotated"
LM = ModelConfig(name="lm", num_layers=4, d_model=128, num_heads=4, preset_kv_heads=4, head_dim=32, ffn_dim=384,
                 vocab_size=256, max_seq_len=1024)
RECALL = ModelConfig(name="recall", num_layers=2, d_model=64, num_heads=4, preset_kv_heads=4, head_dim=32,
                     ffn_dim=128, vocab_size=64, max_seq_len=64)
# experiment=recall's: MQAR with 4, 8, 12 pairs, and a passkey 8, 20, 32 positions back, in 40 positions
CONDITIONS = {"mqar": [Condition("mqar", 40, num_pairs=p) for p in (4, 8, 12)],
              "passkey": [Condition("passkey", 40, distance=d) for d in (8, 20, 32)]}
RECALL_WHAT = {"mqar": "4, 8, 12 pairs in 40 positions", "passkey": "a 4-digit passkey 8, 20, 32 positions back in 40"}
SEQ_LEN, PROMPT, PROMPTS = 128, 256, 8


def interval(low, high, digits=4) -> str:
    return "no interval" if low is None else f"[{low:.{digits}f}, {high:.{digits}f}]"


def language_model(precisions, steps, slices, gen, seed, corpus_bytes):
    """The language model's rows: (precision, bytes/token, ratio to bf16, loss, Δ loss, its interval,
    perplexity, max |Δlogit|, top-1 agreement, its interval), and the training seconds."""
    data = byte_data(DataConfig(max_bytes=corpus_bytes))
    torch.manual_seed(seed)
    model = Decoder(LM, AttentionConfig(type="mha"))
    started = time.perf_counter()
    train(model, TrainConfig(steps=steps, eval_every=steps, log_every=max(steps // 10, 1)), data, seed=seed,
          tick=None, evaluate_fn=lambda m: {})
    seconds = time.perf_counter() - started
    model.eval()
    batches = math.ceil(slices / 16)
    nll = {p: sequence_nll(model, data, SEQ_LEN, batches, 16, p).numpy() / SEQ_LEN for p in precisions}
    starts = torch.linspace(0, len(data.val) - PROMPT - 1, PROMPTS).long()
    prompt = torch.stack([data.val[s:s + PROMPT] for s in starts.tolist()])
    bf16 = model.layouts.bytes_per_token(2)
    rows = []
    for p in precisions:
        per_token = model.layouts.bytes_per_token(2, p)
        loss, delta = float(nll[p].mean()), nll[p] - nll["auto"]
        low, high = bootstrap_ci(delta, np.mean) if p != "auto" else (None, None)
        if p == "auto":
            diff, agree, n, k = 0.0, 1.0, None, None
        else:
            fid = quantized_cache_fidelity(model, prompt, gen, p)
            diff, agree = fid["kvq_max_abs_logit_diff"], fid["kvq_top1_agreement"]
            n = PROMPTS * (gen + 1)
            k = round(agree * n)
        a_low, a_high = proportion_interval(k, n) if n else (None, None)
        rows.append(dict(precision=p, bytes_per_token=per_token, vs_bf16=per_token / bf16, loss=loss,
                         delta=float(delta.mean()), delta_low=low, delta_high=high, perplexity=math.exp(loss),
                         max_abs_logit_diff=diff, top1=agree, top1_low=a_low, top1_high=a_high, positions=n))
        say(f"lm {p}: loss {loss:.4f} (Δ {delta.mean():+.5f}), max |Δlogit| {diff:.4g}, top-1 {agree:.4f}")
    return rows, seconds


def recall(precisions, seeds, steps, sequences, kind="mqar"):
    """Per precision: each seed's accuracy at ``kind`` (pooled over its conditions, each weighing the same)."""
    conditions = CONDITIONS[kind]
    per_seed = {p: [] for p in precisions}
    seconds = 0.0
    for seed in range(seeds):
        sets = {c: eval_set(c, sequences, RECALL.vocab_size, 4, EVAL_SEED_OFFSET + seed) for c in conditions}
        torch.manual_seed(seed)
        model = Decoder(RECALL, AttentionConfig(type="mha"))
        started = time.perf_counter()
        budget = TrainConfig(steps=steps, batch_size=32, lr=3e-3, warmup_steps=20, eval_every=steps, log_every=50)
        train(model, budget, None, seed=seed, stream=train_stream(conditions, 32, RECALL.vocab_size, 4, seed),
              evaluate_fn=lambda m: {})
        seconds += time.perf_counter() - started
        for p in precisions:
            scores = [accuracy(model, kind, x, y, cache_dtype=p) for x, y in sets.values()]
            per_seed[p].append(sum(scores) / len(scores))
        say(f"{kind} seed {seed}: " + ", ".join(f"{p} {per_seed[p][-1]:.4f}" for p in precisions))
    rows = []
    for p in precisions:
        acc = per_seed[p]
        delta = [a - b for a, b in zip(acc, per_seed["auto"])]
        low, high = t_interval(acc, (0, 1))
        d_low, d_high = t_interval(delta) if p != "auto" else (None, None)
        rows.append(dict(precision=p, accuracy=float(np.mean(acc)), low=low, high=high, per_seed=acc,
                         delta=float(np.mean(delta)), delta_low=d_low, delta_high=d_high))
    return rows, seconds


def report(args, lm_rows, train_s, recall_parts, wall_s, loads) -> str:
    lines = [
        "# KV precision and quality: a trained model scored through each cache.dtype, paired",
        "",
        f"Reproduce: `python experiments/kv_precision_quality.py --lm-steps {args.lm_steps} --lm-slices "
        f"{args.lm_slices} --gen {args.gen} --corpus-bytes {args.corpus_bytes} --seeds {args.seeds} "
        f"--recall-sequences {args.recall_sequences} --recall-steps {args.recall_steps} --threads "
        f"{args.threads}` ({wall_s / 60:.1f} min of which training {train_s / 60:.1f} min; load average "
        f"{loads[0]:.1f} at the start, {loads[1]:.1f} at the end; CPU, torch {torch.__version__}, "
        f"{platform.machine()}). What each column is, and how the models were trained: the script's docstring.",
        "",
        "## Language model: perplexity and fidelity",
        "",
        f"MHA, 4 layers of 4 heads of 32, {args.lm_steps} training steps, seed {args.seed}; "
        f"{args.lm_slices} held-out slices of {SEQ_LEN} bytes (loss in nats per byte); Δ loss: the paired "
        "difference to the float32 cache (auto) per byte, mean over slices with a 95 % bootstrap interval; "
        f"fidelity over {PROMPTS} prompts of {PROMPT} bytes and {args.gen} greedy tokens "
        f"({PROMPTS * (args.gen + 1)} positions; its interval exact binomial over positions, which are not "
        "independent within a prompt: the least uncertainty there is), against the float32 cache fed the same tokens.",
        "",
        "| cache.dtype | KV B/token | vs bf16 | loss | Δ loss vs auto | 95 % interval | perplexity "
        "| max abs Δlogit | top-1 agreement | 95 % interval |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in lm_rows:
        ref = r["precision"] == "auto"
        delta = "0" if ref else f"{r['delta']:+.5f}"
        diff = "0" if ref else f"{r['max_abs_logit_diff']:.4g}"
        lines.append(
            f"| {r['precision']}{' (float32, the reference)' if ref else ''} | {r['bytes_per_token']:,} "
            f"| {r['vs_bf16']:.3f} | {r['loss']:.4f} | {delta} "
            f"| {'—' if ref else interval(r['delta_low'], r['delta_high'], 5)} | {r['perplexity']:.4f} "
            f"| {diff} | {r['top1']:.4f} | {'—' if ref else interval(r['top1_low'], r['top1_high'])} |")
    for kind, rows in recall_parts.items():
        lines += recall_table(kind, rows, args)
    return "\n".join(lines + ["", *reading(lm_rows, recall_parts)]) + "\n"


def recall_table(kind, rows, args) -> list:
    """The recall table of ``kind``: accuracy per precision and its paired difference to auto, over seeds."""
    lines = [
        "",
        f"## Recall: {'MQAR' if kind == 'mqar' else 'passkey'} accuracy",
        "",
        f"MHA, 2 layers of 4 heads of 32, {args.recall_steps} steps per seed, {args.seeds} seeds; "
        f"{args.recall_sequences} held-out sequences per condition ({RECALL_WHAT[kind]}), pooled; "
        "intervals: 95 % t-intervals over seeds (a seed is one trained model; the difference is paired per seed).",
        "",
        "| cache.dtype | accuracy | 95 % interval | Δ vs auto | 95 % interval | per seed |",
        "|---|---:|---|---:|---|---|",
    ]
    auto = next(r for r in rows if r["precision"] == "auto")
    for r in rows:
        ref = r["precision"] == "auto"
        deltas = [a - b for a, b in zip(r["per_seed"], auto["per_seed"])]
        delta = "0" if ref else f"{r['delta']:+.4f}"
        # seeds that all score the same have no spread to take an interval from: a zero-width interval
        # would claim a certainty the seeds do not give
        spread = interval(r["low"], r["high"]) if len(set(r["per_seed"])) > 1 else "no spread (seeds alike)"
        d_spread = ("—" if ref else interval(r["delta_low"], r["delta_high"]) if len(set(deltas)) > 1
                    else "no spread (seeds alike)")
        lines.append(f"| {r['precision']} | {r['accuracy']:.4f} | {spread} | {delta} | {d_spread} "
                     f"| {', '.join(f'{a:.3f}' for a in r['per_seed'])} |")
    return lines


def reading(lm_rows, recall_parts) -> list:
    """What each precision costs, in words, from the figures above (nothing here is typed by hand)."""
    out = ["## What each precision costs", ""]
    for r in lm_rows:
        if r["precision"] == "auto":
            continue
        moved = r["delta_low"] is not None and r["delta_low"] > 0
        out.append(f"- **{r['precision']}**: {1 / r['vs_bf16']:.2f}x fewer KV bytes than bfloat16; "
                   + (f"perplexity up {100 * (math.exp(r['delta']) - 1):.2f} % (the loss's interval excludes 0)"
                      if moved else "no perplexity change the slices can tell from 0")
                   + f"; the greedy token agrees with the float32 cache's at {100 * r['top1']:.1f} % of positions.")
    out.append("")
    for kind, rows in recall_parts.items():
        name = "MQAR" if kind == "mqar" else "Passkey"
        ceiling = all(a == 1 for r in rows if r["precision"] == "auto" for a in r["per_seed"])
        worst = min((r for r in rows if r["precision"] != "auto"), key=lambda r: r["delta"])
        out.append(f"{name}: " + ("every seed answers every query right through the float32 cache, so this task "
                                  "is at its ceiling and cannot show a loss a harder one might; read its rows as no "
                                  "loss seen, not as no loss." if ceiling else
                                  (f"the largest mean loss against auto is {worst['precision']}'s "
                                   f"{worst['delta']:+.4f}, its paired interval clear of 0."
                                   if worst["delta_high"] is not None and worst["delta_high"] < 0 else
                                   f"no precision's loss against auto is clear of 0 over these seeds (the largest "
                                   f"mean, {worst['precision']}'s {worst['delta']:+.4f}, has a paired interval "
                                   f"{interval(worst['delta_low'], worst['delta_high'])}).")))
    return out + [""]


def main(argv=None) -> None:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--precisions", type=list_of(str), default=PRECISIONS)
    p.add_argument("--lm-steps", type=positive_int, default=1000)
    p.add_argument("--lm-slices", type=positive_int, default=512)
    p.add_argument("--gen", type=positive_int, default=32)
    p.add_argument("--corpus-bytes", type=positive_int, default=4_000_000, help="corpus bytes read (data.max_bytes)")
    p.add_argument("--recall-sequences", type=positive_int, default=256, help="held-out sequences per condition")
    p.add_argument("--seeds", type=positive_int, default=4)
    p.add_argument("--recall-steps", type=positive_int, default=800)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--reuse", type=existing_file, default=None,
                   help="an earlier run's .json: the parts it holds are kept, the others measured")
    p.add_argument("--from-json", type=existing_file, default=None,
                   help="rewrite the report from a run's .json (its figures and command), training nothing")
    p.add_argument("--out", type=out_file, default=ROOT / "outputs" / "experiments" / "kv_precision_quality.md",
                   help="the committed results change only with --out experiments/results/kv_precision_quality.md")
    args = p.parse_args(argv)
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        write_report(args.out, text_of(data), data=data)
        return
    precisions = [x.strip() for x in args.precisions.split(",")]
    bad = [x for x in precisions if x not in CACHE_DTYPES]
    if bad or "auto" not in precisions:
        p.error(f"argument --precisions: {args.precisions!r}: must list auto and cache.dtype values of "
                f"{', '.join(CACHE_DTYPES)}")
    torch.set_num_threads(args.threads)
    start, load0 = time.perf_counter(), os.getloadavg()[0]
    # --reuse: the parts an earlier run of the same settings measured are taken from its figures
    asked = {k: v for k, v in vars(args).items() if k not in ("out", "from_json", "reuse")}
    data = json.loads(args.reuse.read_text()) if args.reuse else {}
    if data and data["run"]["args"] != asked:
        differ = sorted(k for k in asked if data["run"]["args"].get(k) != asked[k])
        p.error(f"argument --reuse: {str(args.reuse)!r}: measured with other settings ({', '.join(differ)})")
    run = data.get("run", {"args": asked, "seconds": {}, "wall_s": 0.0, "loads": [load0, load0]})
    if "language_model" not in data:
        data["language_model"], run["seconds"]["lm"] = language_model(precisions, args.lm_steps, args.lm_slices,
                                                                      args.gen, args.seed, args.corpus_bytes)
    for kind, key in (("mqar", "recall"), ("passkey", "passkey")):
        if key not in data:
            data[key], run["seconds"][kind] = recall(precisions, args.seeds, args.recall_steps,
                                                     args.recall_sequences, kind)
    run["wall_s"] += time.perf_counter() - start
    run["loads"] = [run["loads"][0], os.getloadavg()[0]]
    data["run"] = run
    write_report(args.out, text_of(data), data=data)


def text_of(data) -> str:
    """The report of a run's figures (``data``: what its .json holds)."""
    run = data["run"]
    parts = {kind: data[key] for kind, key in (("mqar", "recall"), ("passkey", "passkey")) if key in data}
    return report(argparse.Namespace(**run["args"]), data["language_model"], sum(run["seconds"].values()), parts,
                  run["wall_s"], run["loads"])


if __name__ == "__main__":
    run_main(main)
