"""How steady is task=capacity's relative TPOT judgement (slo.tpot_x_batch1)? The same probe
judged again and again, two ways, on the model of ``experiment=choose``:

- before/after: the probe's median decode step over the median of batch-1 runs just before and
  just after it (the design capacity.py used first);
- paired: capacity.time_pairs, the probe's filled cache and one sequence's stepping in turn
  (what capacity.py does now), ``--pairs`` steps of each.

    python experiments/tpot_pairing.py [--batch 20] [--context 128] [--rounds 8] [--threads 1]

Prints, per attention variant, the ratio of every round, their range and spread, and writes the
table to ``--out`` (default outputs/experiments/tpot_pairing.md; ``--out
experiments/results/tpot_pairing`` refreshes the committed copy, on purpose only).
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from _common import Parser, compose_config, conf_option, list_of, out_path, positive_int, run_main, write_report

from kvbench.jobs.job_config import to_bench_config
from kvbench.measure.host import release_heap
from kvbench.tasks import capacity
from kvbench.tasks.common import build_model

ROOT = Path(__file__).resolve().parents[1]


def rounds(variant: str, args) -> dict:
    overrides = ["experiment=choose", f"attention={variant}", "scenario=decode", f"workload.gen_len={args.gen_len}",
                 f"capacity.tpot_pairs={args.pairs}", "hydra.mode=RUN"]
    if args.model:
        overrides.append(f"model={args.model}")
    cfg = to_bench_config(compose_config(overrides))
    device = torch.device("cpu")
    model = build_model(cfg, device)
    out = {"before/after": [], "paired": []}
    with torch.inference_mode():
        for _ in range(args.rounds):
            before = capacity.decode_latency(cfg, model, device, args.context, 1).step_ms
            probe = capacity.decode_latency(cfg, model, device, args.context, args.batch)
            after = capacity.decode_latency(cfg, model, device, args.context, 1)
            out["before/after"].append(statistics.median(probe.step_ms)
                                       / statistics.median(before + after.step_ms))
            steps, reference = capacity.time_pairs(probe.stepper, after.stepper, cfg.capacity.tpot_pairs, device)
            out["paired"].append(statistics.median(steps) / statistics.median(reference))
            del probe, after
            release_heap()
    return out


def table_row(variant: str, design: str, ratios: list) -> str:
    """A row of the table: the ratio of every round, their range, median and spread (max / min of
    the unrounded ratios), each printed to 2 decimals."""
    spread = max(ratios) / min(ratios)
    return (f"| {variant} | {design} | {' '.join(f'{r:.2f}' for r in ratios)} | "
            f"{min(ratios):.2f}-{max(ratios):.2f} | {statistics.median(ratios):.2f} | {spread:.2f} |")


def main(argv=None) -> None:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", type=list_of(conf_option("attention")), default="mha,gqa,mqa")
    ap.add_argument("--batch", type=positive_int, default=20)
    ap.add_argument("--context", type=positive_int, default=128)
    ap.add_argument("--gen-len", type=positive_int, default=8, help="decode steps of a run (experiment=choose's)")
    ap.add_argument("--pairs", type=positive_int, default=32, help="capacity.tpot_pairs")
    ap.add_argument("--rounds", type=positive_int, default=8)
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--model", type=conf_option("model"), default=None,
                    help="a conf/model preset instead of experiment=choose's (tiny to try)")
    ap.add_argument("--out", type=out_path, default=ROOT / "outputs" / "experiments" / "tpot_pairing")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    started, load = time.time(), os.getloadavg()[0]
    rows = [table_row(variant, design, ratios) for variant in args.variants.split(",")
            for design, ratios in rounds(variant, args).items()]
    command = " ".join(["python experiments/tpot_pairing.py", *(argv if argv is not None else sys.argv[1:])])
    text = "\n".join([
        f"# The relative TPOT judgement of task=capacity, two designs: batch {args.batch} over batch 1 at "
        f"{args.context} tokens ({args.model or 'experiment=choose'}'s model, {args.threads} torch threads, "
        f"torch {torch.__version__}, {platform.machine()})",
        "",
        f"Reproduce: `{command}` ({time.time() - started:.0f} s, load average {load:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end). Each round times the same probe both ways: *before/after*, its "
        "median decode step over the median of batch-1 runs just before and after it; *paired*, "
        f"capacity.time_pairs: {args.pairs} steps of its filled cache, each next to a step of one sequence at the "
        "same context and position. Spread = max / min over the rounds: what a judgement at a fixed "
        "slo.tpot_x_batch1 sees move while nothing but the machine changes.",
        "",
        "| variant | design | ratio per round | range | median | spread |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ])
    write_report(args.out.with_suffix(".md"), text)


if __name__ == "__main__":
    run_main(main)
