"""Which CPU thread count gives stable decode timings (issue 14, item 6): the same tiny decode with
1 torch thread and with torch's default, interleaved in one process, several rounds.

On a shared machine every extra torch thread is one more thread that can be descheduled, and each
small operation waits for its slowest thread; the spread of the step times shows it.

    python experiments/cpu_threads.py                   # model tiny, prompt 64, 32 steps, 10 rounds
    python experiments/cpu_threads.py --out experiments/results/cpu_threads   # refresh the committed one

Writes ``--out`` + ``.md`` (default ``outputs/experiments/cpu_threads.md``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from _common import Parser, conf_option, decode_setup, out_path, positive_int, run_main, write_report

from kvbench.jobs.runner import DEFAULT_THREADS
from kvbench.measure.env import load_average, usable_cpus
from kvbench.measure.stats import paired_ratio, percentile
from kvbench.workloads.decode import time_decode

ROOT = Path(__file__).resolve().parents[1]


def load(value) -> str:
    return "unknown" if value is None else f"{value:.2f}"


def main(argv=None) -> None:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=conf_option("model"), default="tiny")
    p.add_argument("--prompt-len", type=positive_int, default=64)
    p.add_argument("--gen-len", type=positive_int, default=32)
    p.add_argument("--rounds", type=positive_int, default=10)
    p.add_argument("--out", type=out_path, default=ROOT / "outputs" / "experiments" / "cpu_threads",
                   help="the committed result changes only with --out experiments/results/cpu_threads")
    args = p.parse_args(argv)
    cfg, model, prompt, cache = decode_setup(args.model, args.prompt_len, args.gen_len)
    device = torch.device("cpu")
    arms = {1: [], DEFAULT_THREADS: []}  # threads -> per round, the trial's step times
    load_before = load_average()
    for threads in arms:  # warm both up
        torch.set_num_threads(threads)
        time_decode(model, prompt, args.gen_len, cache, 1, 0, device)
    for r in range(args.rounds):
        for threads in (list(arms) if r % 2 == 0 else list(arms)[::-1]):  # ABBA
            torch.set_num_threads(threads)
            arms[threads].append(time_decode(model, prompt, args.gen_len, cache, 0, 1, device).decode_ms[0])
    load_after = load_average()
    rows = []
    for threads, trials in arms.items():
        steps = [ms for t in trials for ms in t]
        rows.append(f"| {threads} | {percentile(steps, 0.5):.3f} | {percentile(steps, 0.99):.3f} | "
                    f"{min(steps):.3f} | {max(steps):.3f} | {max(steps) / min(steps):.1f} |")
    one, default = ([float(np.median(t)) for t in arms[k]] for k in (1, DEFAULT_THREADS))
    ratio, low, high = paired_ratio(one, default)
    lines = [
        "# CPU threads: step-time stability of the same decode",
        "",
        f"`python experiments/cpu_threads.py --model {args.model} --prompt-len {args.prompt_len} "
        f"--gen-len {args.gen_len} --rounds {args.rounds}`",
        "",
        f"{usable_cpus()} usable CPUs (os.cpu_count {os.cpu_count()}), torch's default {DEFAULT_THREADS} threads; "
        f"1-minute load average {load(load_before)} before, {load(load_after)} after; {args.rounds} ABBA rounds of one "
        f"{args.gen_len}-step trial per arm ({args.rounds * args.gen_len} steps each).",
        "",
        "| threads | step p50 ms | p99 ms | min ms | max ms | max / min |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"median step, default / 1 thread, paired over rounds: **{ratio:.3f}** "
        + (f"(95% interval [{low:.3f}, {high:.3f}])." if low is not None and high is not None
           else f"(no interval: {args.rounds} rounds are too few for one)."),
        "",
    ]
    write_report(args.out.with_suffix(".md"), "\n".join(lines))


if __name__ == "__main__":
    run_main(main)
