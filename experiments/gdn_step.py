"""A Gated DeltaNet stack's decode step does not grow with the context: its state is constant.

Four contenders, each a stack of ``--layers`` blocks (attention + SwiGLU MLP) with batch
``--batch`` and a cache prefilled to a context: a pure Gated DeltaNet stack (Qwen3.5's linear
layers, scaled down) at the short and the long context, and a GQA stack of the same width at the
same two contexts, the contrast whose step reads every cached position. A timed call is one decode
step at the context (the cache is rewound to it before every step, so the context stays put). The
contenders run in one interleaved loop (ABCD, DCBA, ...) on ``--threads`` torch threads; a figure
is the median over rounds, the ratio long / short is printed of the medians, of the minima (which
drop the steps another job interrupted) and per round (a load that slows a round alike cancels:
the median of those is the headline).

    python experiments/gdn_step.py --threads 1 --out experiments/results/gdn_step.md
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch
from _common import Parser, list_of, out_file, positive_int, run_main, write_report

from kvbench.cache import Positions, make_cache
from kvbench.config.model import ModelConfig
from kvbench.layouts.base import Layouts
from kvbench.layouts.gated_deltanet import GatedDeltaNet
from kvbench.layouts.kv_heads import KVHeads
from kvbench.model import Block
from kvbench.rope import rope_tables

ROOT = Path(__file__).resolve().parents[1]


class Stack:
    """``layouts``' blocks, a cache prefilled to ``context`` positions, and one decode step there."""

    def __init__(self, cfg: ModelConfig, layouts: Layouts, context: int, batch: int):
        self.blocks = [Block(cfg, layout, i).eval() for i, layout in enumerate(layouts)]
        self.cos, self.sin = rope_tables(cfg, layouts.rotary_dim())
        self.cache = make_cache("static", layouts, batch, context + 1)
        self.context, self.d_model = context, cfg.d_model
        self.forward(torch.randn(batch, context, cfg.d_model), 0)  # the prompt, chunked for GDN layers

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        pos = Positions(start, x.shape[1])
        cos, sin = self.cos[pos.rows], self.sin[pos.rows]
        for block, layer_cache in zip(self.blocks, self.cache.begin(pos, x.shape[0])):
            x = block(x, cos, sin, layer_cache, pos)
        self.cache.commit(pos)
        return x

    def step(self) -> None:
        self.cache.rewind(self.context)  # a state cannot roll back: only the held length moves
        self.forward(torch.randn(self.cache.batch_size, 1, self.d_model), self.context)


def main(argv: Optional[List[str]] = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=list_of(positive_int, 2), default="256,4096", help="short,long")
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--d-model", type=positive_int, default=512)
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--rounds", type=positive_int, default=60)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--out", type=out_file, default=ROOT / "outputs" / "experiments" / "gdn_step.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load = os.getloadavg()[0]
    short, long = (int(c) for c in args.contexts.split(","))
    cfg = ModelConfig(num_layers=args.layers, d_model=args.d_model, num_heads=8, preset_kv_heads=2,
                      ffn_dim=4 * args.d_model, max_seq_len=long + 1)
    # Qwen3.5's linear layers scaled down: 2 value heads per key head, d_k = d_v = 64
    gdn = Layouts([GatedDeltaNet(None, 4, 8, 64, 64, 4, cfg.num_heads, cfg.head_dim)] * args.layers)
    gqa = Layouts([KVHeads(None, cfg.num_heads, 2, cfg.head_dim)] * args.layers)
    with torch.inference_mode():
        stacks = {(kind, ctx): Stack(cfg, layouts, ctx, args.batch)
                  for kind, layouts in (("gdn", gdn), ("gqa", gqa)) for ctx in (short, long)}
        names = list(stacks)
        for stack in stacks.values():
            stack.step()  # warm-up
        times = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                t0 = time.perf_counter()
                stacks[name].step()
                times[name].append(time.perf_counter() - t0)
    lines = [f"# Decode step vs context: Gated DeltaNet and GQA ({args.layers} layers, d_model={args.d_model}, "
             f"batch {args.batch}, float32, {args.threads} thread(s), {args.rounds} interleaved rounds)", "",
             f"`python experiments/gdn_step.py --threads {args.threads} --rounds {args.rounds}`; "
             f"torch {torch.__version__}, {platform.processor() or platform.machine()}, load average "
             f"{load:.1f} at the start on {os.cpu_count()} cores", "",
             "Gated DeltaNet: H_k=4, H_v=8, d_k=d_v=64, kernel 4 (state per layer per sequence: "
             f"{gdn[0].state_bytes(4):,} B); GQA: H=8, H_kv=2, D={cfg.head_dim} "
             f"({gqa[0].bytes_per_position(4):,} B per position per layer).", "",
             f"| stack | step at {short} ms (median) | step at {long} ms (median) | long / short (medians) "
             "| long / short (minima) | long / short (median of per-round ratios) "
             "| state + KV bytes per sequence at short / long |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    ratios = {}
    for kind, layouts in (("gdn", gdn), ("gqa", gqa)):
        a, b = times[(kind, short)], times[(kind, long)]
        ratios[kind] = per_round = statistics.median(y / x for x, y in zip(a, b))
        lines.append(f"| {kind} | {statistics.median(a) * 1e3:.3f} | {statistics.median(b) * 1e3:.3f} | "
                     f"{statistics.median(b) / statistics.median(a):.3f} | {min(b) / min(a):.3f} | {per_round:.3f} | "
                     f"{layouts.cache_bytes(short, 1, 4):,} / {layouts.cache_bytes(long, 1, 4):,} |")
    lines += ["", f"Gated DeltaNet: a step at {long} positions takes {ratios['gdn']:.3f}x its step at {short} "
              f"({'within' if ratios['gdn'] <= 1.1 else 'beyond'} 1.1x): its state does not grow with the context. "
              f"GQA: {ratios['gqa']:.3f}x, its step reads every cached position."]
    write_report(args.out, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
