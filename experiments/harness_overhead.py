"""How much the timing harness adds over a bare loop of the same decode steps, in one run.

The bare loop is ``greedy_generate`` with no timer, timed as a whole; the harness is the same
call with a RegionTimer around the prefill and every decode step. Rounds alternate the two so
machine drift hits both alike; the overhead is the ratio of their medians.

    python experiments/harness_overhead.py                 # small model, prompt 512, batch 1
    python experiments/harness_overhead.py --model tiny    # where per-step overhead matters most
"""

from __future__ import annotations

import statistics
import time

import torch
from _common import Parser, conf_option, decode_setup, positive_int, run_main, say

from kvbench.generate import greedy_generate
from kvbench.measure.timing import RegionTimer


def main(argv=None) -> None:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=conf_option("model"), default="small")
    p.add_argument("--prompt-len", type=positive_int, default=512)
    p.add_argument("--gen-len", type=positive_int, default=32)
    p.add_argument("--rounds", type=positive_int, default=7)
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg, model, prompt, cache = decode_setup(args.model, args.prompt_len, args.gen_len)
    device = torch.device("cpu")
    bare, timed = [], []
    for _ in range(args.rounds + 1):  # round 0 warms up
        cache.reset()
        t0 = time.perf_counter()
        greedy_generate(model, prompt, args.gen_len, cache)
        bare.append(time.perf_counter() - t0)
        cache.reset()
        timer = RegionTimer(device)
        t0 = time.perf_counter()
        greedy_generate(model, prompt, args.gen_len, cache, timer)
        timed.append(time.perf_counter() - t0)
    bare_ms, timed_ms = statistics.median(bare[1:]) * 1e3, statistics.median(timed[1:]) * 1e3
    say(f"model {args.model}, prompt {args.prompt_len}, {args.gen_len} decode steps, {args.rounds} rounds")
    say(f"bare loop {bare_ms:.2f} ms, with timing harness {timed_ms:.2f} ms, "
        f"overhead {100 * (timed_ms / bare_ms - 1):+.2f} %")


if __name__ == "__main__":
    run_main(main)
