"""What the serving engine's batched decode costs over the static cache's, per layout.

workload=serving decodes every running request in one forward, each at its own position: the
paged store writes the new K/V into each sequence's blocks and gathers all its blocks into a
padded K/V with a key mask (kvbench/serving/paged.py, BatchView). A static cache reads its
(B, H_kv, S, D) tensors in place. This times both decode steps on the same model, batch and
context, interleaved step by step (one torch thread), and prints the paged / static ratio per
KV-head count: the price of the gather, which a GPU engine's paged attention kernel does not pay.

    python experiments/serving_gather.py                      # model=small, B=16, S=256
    python experiments/serving_gather.py --model tiny --steps 4 --out /tmp/gather.md
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Parser, compose_config, conf_option, out_file, positive_int, run_main, write_report  # noqa: E402

from kvbench.cache import cache_for  # noqa: E402
from kvbench.generate import decode_step, prefill  # noqa: E402
from kvbench.jobs.job_config import to_bench_config  # noqa: E402
from kvbench.serving.paged import PagedStore, SeqBlocks  # noqa: E402
from kvbench.tasks.common import build_model  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "serving_gather.md"
BLOCK = 16


def time_layout(model_name: str, attention: str, batch: int, context: int, steps: int) -> tuple:
    """Median ms of a static decode step and of a paged gather step, interleaved, and their ratios."""
    cfg = to_bench_config(compose_config([f"model={model_name}", f"attention={attention}",
                                          f"workload.prompt_len={context}", f"workload.gen_len={steps + 1}"]))
    model = build_model(cfg, torch.device("cpu"))
    prompt = torch.randint(0, cfg.model.vocab_size, (batch, context))
    with torch.inference_mode():
        cache = cache_for(model, "static", batch, context + steps + 1)
        prefill(model, prompt, cache)
        store = PagedStore(model, batch * (-(-(context + steps + 1) // BLOCK)), BLOCK, prefix_caching=False)
        seqs = [SeqBlocks() for _ in range(batch)]
        for s in seqs:
            store.grow(s, context)
        store.written(seqs, context)  # positions held (their values do not change the time)
        token = torch.zeros(batch, 1, dtype=torch.long)
        static_ms: List[float] = []
        paged_ms: List[float] = []
        for i in range(steps + 1):  # the first pair warms up
            t = time.perf_counter()
            decode_step(model, token, cache, context + i)
            static_ms.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            if not all(store.grow(s, s.length + 1) for s in seqs):
                raise RuntimeError("the store is sized for every step: a block ran out")
            view = store.view(seqs, 1)
            model(token, view, view.positions, last_only=True)
            store.written(seqs, 1)
            paged_ms.append((time.perf_counter() - t) * 1e3)
    ratios = [p / s for p, s in zip(paged_ms[1:], static_ms[1:])]
    return model.num_kv_heads, statistics.median(static_ms[1:]), statistics.median(paged_ms[1:]), ratios


def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=conf_option("model"), default="small")
    parser.add_argument("--batch", type=positive_int, default=16)
    parser.add_argument("--context", type=positive_int, default=256)
    parser.add_argument("--steps", type=positive_int, default=16)
    parser.add_argument("--out", type=out_file, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    command = "python experiments/serving_gather.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"# Serving's batched decode (paged gather) vs the static cache's, model={args.model}", "",
             f"`{command.strip()}`", "",
             f"B = {args.batch} sequences at context {args.context}, blocks of {BLOCK} tokens, {args.steps} steps "
             "each, interleaved step by step, 1 torch thread; ratio = paged / static per step pair (median, "
             "and the range over pairs).", "",
             "| variant | KV heads | static step ms | paged step ms | ratio (median) | ratio range |",
             "|---|---:|---:|---:|---:|---:|"]
    for attention in ("mha", "gqa", "mqa"):
        heads, static, paged, ratios = time_layout(args.model, attention, args.batch, args.context, args.steps)
        lines.append(f"| {attention} | {heads} | {static:.1f} | {paged:.1f} | {statistics.median(ratios):.2f} | "
                     f"{min(ratios):.2f}-{max(ratios):.2f} |")
    lines += ["", f"Load average (1, 5, 15 min) at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())} on "
              f"{os.cpu_count()} CPUs: other work shared the cores, so single pairs spread; the medians of "
              "interleaved pairs are what to compare."]
    write_report(args.out, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
