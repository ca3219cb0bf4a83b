"""MLA's absorbed decode step against its expanded one (docs/layouts-mla.md), on model=small.

The same MLA model and cache at each context; one step in each form in turn (absorbed, expanded,
expanded, absorbed, ...) so that a load that comes and goes falls on both; the ratio of the
medians per context. 1 torch thread.

    python experiments/mla_forms.py [--contexts 512 1024 2048] [--rounds 15]
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
from _common import Parser, compose_config, positive_int, run_main, write_report

from kvbench.cache import cache_for
from kvbench.jobs.job_config import to_bench_config
from kvbench.layouts.attention import decode_form
from kvbench.tasks.common import build_model

OUT = Path(__file__).resolve().parent / "results" / "mla_forms.md"


def main(argv=None) -> None:
    parser = Parser()
    parser.add_argument("--contexts", type=positive_int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--rounds", type=positive_int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = to_bench_config(compose_config(["model=small", "attention=mla"]))
    model = build_model(cfg, torch.device("cpu"))
    a = cfg.attention
    longest = max(args.contexts)
    cache = cache_for(model, "static", 1, longest + 1)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, longest + 1), generator=torch.Generator().manual_seed(0))
    rows = []
    load_before = os.getloadavg()[0]
    with torch.inference_mode():
        for context in args.contexts:
            cache.reset()
            model(tokens[:, :context], cache, 0)
            times = {"absorbed": [], "expanded": []}
            for r in range(args.rounds):
                order = ("absorbed", "expanded") if r % 2 == 0 else ("expanded", "absorbed")
                for form in order:
                    cache.truncate(context)
                    with decode_form(model, form):
                        start = time.perf_counter()
                        model(tokens[:, context:context + 1], cache, context)
                        times[form].append((time.perf_counter() - start) * 1e3)
            med = {f: statistics.median(t) for f, t in times.items()}
            rows.append(f"| {context} | {med['absorbed']:.2f} | {med['expanded']:.2f} | "
                        f"{med['expanded'] / med['absorbed']:.2f}x |")
    text = "\n".join([
        "# MLA decode step: absorbed vs expanded form (model=small)",
        "",
        "Command (repository root, 1 torch thread, 2 shared cores):",
        "",
        "```bash",
        f"python experiments/mla_forms.py --contexts {' '.join(map(str, args.contexts))} --rounds {args.rounds}",
        "```",
        "",
        f"model=small attention=mla: {cfg.model.num_layers} layers, {cfg.model.num_heads} heads, kv_lora_rank "
        f"{a.kv_lora_rank}, qk_rope {a.qk_rope_head_dim}, qk_nope {a.qk_nope_head_dim}, v {a.v_head_dim} "
        f"(the defaults from head_dim {cfg.model.head_dim}); batch 1, float32, eager. One step per form in "
        f"turn, {args.rounds} rounds per context; median ms per step. Load average {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs: absolute times are inflated by other work, "
        "the ratios (interleaved) much less.",
        "",
        "| context | absorbed ms | expanded ms | expanded / absorbed |",
        "|---:|---:|---:|---:|",
        *rows,
        "",
        "The expanded form up-projects every cached latent to K and V for each head at each step (work",
        "and memory traffic that grow with heads x context); the absorbed form reads the latents once.",
    ])
    write_report(OUT, text + "\n")


if __name__ == "__main__":
    run_main(main)
