"""Prefix caching of a Gated DeltaNet hybrid: hit rate, TTFT and the bytes of the saved states
per state-checkpoint policy and allocator, for a shared system prompt that does or does not fill
the unified allocator's raised block (vLLM #40696 / #45238: 0 hits when it does not).

    python experiments/state_checkpoint.py [--requests 24] [--rate 8] [--threads 1] [--repeats 3]

Every run goes through kvbench.jobs.runner.run_job (the code behind ``kvbench workload=serving``):
model=tiny with 4 layers (3 Gated DeltaNet, 1 full attention; states of ~19 KB per layer, so
the unified allocator raises the attention block from 16 to 48 tokens), every request a shared
system prompt of ``prefix_len`` tokens before its own 8-24. ``workload.allocator`` per_kind |
unified x ``workload.state_checkpoint`` block | every_n (96 tokens) | prompt_end x prefix_len
40 (fills no unified block) | 96 (two of them), and a run without prefix caching per prefix_len;
each run ``--repeats`` times, interleaved, TTFT the median over them (the CPU is shared). Each
job's results.json goes under ``--runs`` (default outputs/state_checkpoint/, git-ignored); the
table goes to ``--out`` (default
outputs/experiments/state_checkpoint.md; ``--out experiments/results/state_checkpoint``
refreshes the committed copy, on purpose only).
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from _common import (
    Parser,
    compose_config,
    ok_record,
    out_dir,
    out_path,
    positive_float,
    positive_int,
    run_main,
    say,
    write_report,
)

from kvbench.jobs.runner import run_job

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["model=tiny", "model.num_layers=4", "model.max_seq_len=256", "model.linear_num_key_heads=2",
         "model.linear_num_value_heads=4", "model.linear_key_head_dim=32", "model.linear_value_head_dim=32",
         "attention.layer_types=[linear_attention,linear_attention,linear_attention,full_attention]"]
POLICIES = [("block", 0), ("every_n", 96), ("prompt_end", 0)]
RUNS = [(prefix_len, allocator, policy, every) for prefix_len in (40, 96)
        for allocator, policy, every in [("per_kind", None, 0)] + [(a, p, n) for a in ("per_kind", "unified")
                                                                   for p, n in POLICIES]]


def main(argv=None) -> None:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=positive_int, default=24)
    ap.add_argument("--rate", type=positive_float, default=8.0, help="requests/s (Poisson)")
    ap.add_argument("--threads", type=positive_int, default=1, help="runtime.threads")
    ap.add_argument("--repeats", type=positive_int, default=3, help="runs of each configuration (TTFT: their median)")
    ap.add_argument("--budget-mb", type=positive_float, default=2.0, help="workload.kv_budget_mb")
    ap.add_argument("--runs", type=out_dir, default=ROOT / "outputs" / "state_checkpoint", help="the jobs' directories")
    ap.add_argument("--out", type=out_path, default=ROOT / "outputs" / "experiments" / "state_checkpoint",
                    help="report path without suffix (.md is written)")
    args = ap.parse_args(argv)
    base = MODEL + ["workload=serving", f"workload.num_requests={args.requests}", f"workload.rate={args.rate}",
                    "workload.prompt.dist=uniform", "workload.prompt.lo=8", "workload.prompt.hi=24",
                    "workload.output.lo=4", "workload.output.hi=8", f"workload.kv_budget_mb={args.budget_mb}",
                    f"runtime.threads={args.threads}", "runtime.device=cpu", "runtime.isolate=false",
                    "wandb.mode=disabled"]
    metrics, start = {}, time.perf_counter()
    for repeat in range(args.repeats):
        for run in RUNS:
            prefix_len, allocator, policy, every = run
            name = f"p{prefix_len}_{allocator}_{policy or 'off'}_{repeat}"
            caching = ["workload.prefix_caching=false"] if policy is None else [
                f"workload.state_checkpoint={policy}", f"workload.state_checkpoint_tokens={every}"]
            cfg = compose_config(base + [f"workload.prefix_len={prefix_len}", f"workload.allocator={allocator}",
                                         *caching])
            rec = ok_record(run_job(cfg, args.runs / name).to_dict(), name)
            metrics.setdefault(run, []).append(rec["metrics"])
            say(f"{name}: hit rate {rec['metrics']['prefix_hit_rate']}, TTFT p50 "
                f"{rec['metrics']['ttft_ms_p50']:.1f} ms")
    rows = []
    for run, ms in metrics.items():
        m = ms[0]  # hits, saves and bytes do not depend on the clock's order of events here; TTFT does
        rows.append((run[0], run[1], "off (no prefix caching)" if run[2] is None else run[2] + (
            f" ({run[3]})" if run[3] else ""), m["block_size"], m["prefix_hit_rate"] or 0.0, m["prefix_hit_tokens"],
            statistics.median(x["ttft_ms_p50"] for x in ms), statistics.median(x["ttft_ms_mean"] for x in ms),
            m.get("state_checkpoints_saved", 0), m.get("state_checkpoint_bytes_max", 0), m["kv_reserved_bytes"],
            m["preemptions"]))
    command = "python experiments/state_checkpoint.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = ["# Prefix caching of a Gated DeltaNet hybrid: where its states are saved", "",
             f"Command: `{command.strip()}`", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs (shared), torch {torch.__version__}, "
             f"{args.threads} thread(s); {time.perf_counter() - start:.0f} s in all. TTFT is the wall clock of a CPU "
             f"shared with other jobs: the median over {args.repeats} interleaved runs of each row's p50 and mean.", "",
             f"{args.requests} requests at {args.rate:g} req/s (Poisson, seed 0), each a shared system prompt of "
             "prefix_len tokens and 8-24 own tokens, 4-8 output tokens; model=tiny, 4 layers (3 Gated DeltaNet, 1 "
             f"full attention), workload.kv_budget_mb={args.budget_mb:g}, cache.block_size=16. block: the attention "
             "block the allocator uses (unified raises it until one page holds a layer's state). Hit rate: prompt "
             "tokens found / prompt tokens looked up (vLLM's). Saved-state bytes: the most that states nobody ran "
             "from held at once.", "",
             "| prefix_len | allocator | state_checkpoint | block | hit rate | hit tokens | TTFT p50 ms | TTFT mean ms "
             "| states saved | saved-state bytes max | reserved bytes | preemptions |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.3f} | {r[5]} | {r[6]:.1f} | {r[7]:.1f} | {r[8]} "
                     f"| {r[9]:,} | {r[10]:,} | {r[11]} |")
    write_report(args.out.with_suffix(".md"), "\n".join(lines) + "\n")


if __name__ == "__main__":
    run_main(main)
