"""Time to first token per turn of a multi-turn chat, with and without a KV cache shared
across turns (cache.shared=false,true), on model=small: a 512-token system prompt, 4 turns.

    python experiments/multiturn_ttft.py [--batch-size 4] [--warmup 1] [--repeats 3] [--threads 1]

Both runs go through kvbench.jobs.runner.run_job (the code behind ``kvbench workload=multiturn``)
with conf/model/<--model>.yaml and conf/workload/multiturn.yaml; each job's results.json goes
under ``--runs`` (default outputs/multiturn_ttft/, git-ignored). Prints the turn-by-turn table
and the unshared/shared TTFT ratio, and writes it to ``--out`` (default
outputs/experiments/multiturn_ttft.md; ``--out experiments/results/multiturn_ttft`` refreshes the
committed copy, on purpose only).
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

import torch
from _common import (
    Parser,
    compose_config,
    conf_option,
    natural_int,
    ok_record,
    out_dir,
    out_path,
    positive_int,
    run_main,
    say,
    write_report,
)

from kvbench.jobs.runner import run_job
from kvbench.sinks.console import ttft_side_by_side

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> None:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=positive_int, default=None, help="conversations (default: the yaml's)")
    ap.add_argument("--warmup", type=natural_int, default=1)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--cache", default="static", choices=["static", "concat"])
    ap.add_argument("--threads", type=positive_int, default=None,
                    help="torch CPU threads (runtime.threads); 1 is steadier on a machine shared with other jobs")
    ap.add_argument("--model", type=conf_option("model"), default="small",
                    help="a conf/model preset (tiny for a quick try)")
    ap.add_argument("--runs", type=out_dir, default=ROOT / "outputs" / "multiturn_ttft", help="the jobs' directories")
    ap.add_argument("--out", type=out_path, default=ROOT / "outputs" / "experiments" / "multiturn_ttft",
                    help="report path without suffix (.md is written)")
    args = ap.parse_args(argv)

    overrides = [f"model={args.model}", "workload=multiturn", "workload.system_len=512", "workload.turns=4",
                 f"cache.impl={args.cache}", f"runtime.warmup={args.warmup}",
                 f"runtime.repeats={args.repeats}", "runtime.device=cpu", "wandb.mode=disabled"]
    if args.batch_size:
        overrides.append(f"workload.batch_size={args.batch_size}")
    if args.threads:
        overrides.append(f"runtime.threads={args.threads}")
    records, start = [], time.perf_counter()
    for shared in (False, True):
        cfg = compose_config(overrides + [f"cache.shared={str(shared).lower()}"])
        t0 = time.perf_counter()
        rec = ok_record(run_job(cfg, args.runs / f"shared_{str(shared).lower()}").to_dict(), f"cache.shared={shared}")
        say(f"cache.shared={str(shared).lower()}: {time.perf_counter() - t0:.0f} s")
        records.append(rec)
    rows = ttft_side_by_side(records)
    off, on = (r["metrics"] for r in records)
    w = records[0]["config"]["workload"]
    later = [r for r in rows if r["turn"] >= 2]
    mean_ratio = off["mean_ttft_ms_turns_2_n"] / on["mean_ttft_ms_turns_2_n"]
    per_turn = ", ".join(f"turn {r['turn']} {r['speedup']:.1f}x" for r in later)

    lines = [
        "# Multi-turn chat: TTFT per turn with and without a shared KV cache",
        "",
        f"model={args.model} ({records[0]['config']['model']['num_layers']} layers, d_model "
        f"{records[0]['config']['model']['d_model']}, {rows[0]['variant']}), float32, cache.impl={args.cache}; "
        f"{w['batch_size']} conversations, system prompt {w['system_len']} tokens, {w['turns']} turns of "
        f"{w['user_len']} user + {w['reply_len']} reply tokens; median of {args.repeats} timed chats after "
        f"{args.warmup} warm-up; torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
        f"{platform.processor() or platform.machine()}; total {(time.perf_counter() - start) / 60:.1f} min.",
        "",
        "TTFT = the turn's prefill + argmax of its first reply token. Without sharing every turn "
        "re-prefills system prompt + history + message for each conversation; with sharing the "
        "system prompt is prefilled once (batch 1, in turn 1) and a turn prefills only the previous "
        "reply's last token and the new message. Prefill tokens are summed over the batch.",
        "",
        "| turn | TTFT ms, shared=false | TTFT ms, shared=true | unshared / shared "
        "| prefill tokens, false | prefill tokens, true |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['turn']} | {r['ttft_ms_unshared']:.1f} | {r['ttft_ms_shared']:.1f} | "
                     f"{r['speedup']:.1f}x | {r['prefill_tokens_unshared']:,} | {r['prefill_tokens_shared']:,} |")
    lines += [
        "",
        f"Turns 2-{w['turns']}: mean TTFT {off['mean_ttft_ms_turns_2_n']:.1f} ms without sharing, "
        f"{on['mean_ttft_ms_turns_2_n']:.1f} ms with it: **{mean_ratio:.1f}x** "
        f"(per turn {per_turn}).",
        f"KV cache held at the end: {off['kv_cache_bytes_formula'] / 2**20:.2f} MiB without sharing "
        f"(system prompt x{w['batch_size']}), {on['kv_cache_bytes_formula'] / 2**20:.2f} MiB with it "
        f"(system prompt once); allocated {off['kv_cache_bytes'] / 2**20:.2f} / "
        f"{on['kv_cache_bytes'] / 2**20:.2f} MiB.",
        f"Decode step p50: {off['decode_ms_p50']:.2f} ms without sharing, {on['decode_ms_p50']:.2f} ms with it "
        "(the two runs are a minute or more apart, so a change of machine load shifts this; the shared "
        "path's attention over the batch-1 prefix is a plain softmax, not SDPA, and costs a little more per step).",
        "",
        f"Reproduce: `python {' '.join(['experiments/multiturn_ttft.py'] + sys.argv[1:])}` (absolute times "
        f"depend on what else the machine runs, load average {os.getloadavg()[0]:.2f} at the end of this run; "
        "the ratio is measured in one run).",
    ]
    text = "\n".join(lines) + "\n"
    write_report(args.out.with_suffix(".md"), text)


if __name__ == "__main__":
    run_main(main)
