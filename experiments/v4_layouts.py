"""DeepSeek-V3's MLA, V3.2's DSA and V4's compressed layers: a decode step's time at the contexts a CPU
reaches, beside each layout's bytes held per sequence and read per step (docs/layouts-v4.md has the full
presets by formula at 8k, 128k and 1M tokens).

model=small with 6 layers: MLA (attention=mla), DSA (MLA, each query its top 256 tokens) and V4's layers
(2 sliding, 2 CSA m = 4 with the top 64 entries, 2 HCA m' = 128; a ring of 128, head_dim 64, one K=V
head), each from the same seed. At each context every variant's cache is prefilled once; then one step of
each in turn per round (the order rotating), the cache restored to the context between steps
(each cache's tensors copied back to their state at the context: a V4 pool cannot roll back). Median ms
per step with a bootstrap 95% interval. 1 torch thread.

    python experiments/v4_layouts.py [--contexts 512 1024 2048 4000] [--rounds 12]
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from _common import Parser, compose_config, out_file, positive_int, run_main, write_report

from kvbench.cache import cache_for
from kvbench.jobs.job_config import to_bench_config
from kvbench.measure.stats import bootstrap_ci, median
from kvbench.tasks.common import build_model
from kvbench.units import human_bytes

OUT = Path(__file__).resolve().parent / "results" / "v4_layouts.md"
SMALL = ["model=small", "model.num_layers=6", "model.ffn_dim=1024", "model.vocab_size=8192",
         "model.max_seq_len=4097", "runtime.dtype=float32"]
V4 = ["attention.window=128", "attention.layer_types=[sliding_attention,compressed_sparse_attention,"
      "heavily_compressed_attention,sliding_attention,compressed_sparse_attention,heavily_compressed_attention]",
      "+model.layer_shapes={compressed:{index_topk:64,index_n_heads:8,index_head_dim:32}}"]
VARIANTS = {"MLA (V3)": ["attention=mla"], "DSA top 256 (V3.2)": ["attention=mla", "attention.index_topk=256"],
            "V4 sliding/CSA/HCA": V4}


def restore(cache, saved, context: int) -> None:
    """``cache`` as it was after the prefill of ``context`` tokens (a V4 pool cannot roll back: its
    tensors are copied back, as every variant's are, outside the timed step)."""
    for t, s in zip(cache.tensors(), saved):
        t.copy_(s)
    cache.length = context
    for layer in cache.layers:
        if hasattr(layer, "length"):
            layer.length = context


def main(argv=None) -> None:
    parser = Parser()
    parser.add_argument("--contexts", type=positive_int, nargs="+", default=[512, 1024, 2048, 4000])
    parser.add_argument("--rounds", type=positive_int, default=12)
    parser.add_argument("--out", type=out_file, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    longest = max(args.contexts)
    models = {}
    for name, extra in VARIANTS.items():
        cfg = to_bench_config(compose_config([*SMALL, *extra]))
        torch.manual_seed(0)
        models[name] = build_model(cfg, torch.device("cpu"))
    tokens = torch.randint(0, 8192, (1, longest + 1), generator=torch.Generator().manual_seed(0))
    rows, load_before = [], os.getloadavg()[0]
    with torch.inference_mode():
        for context in args.contexts:
            caches = {name: cache_for(model, "static", 1, context + 1) for name, model in models.items()}
            saved = {}
            for name, model in models.items():
                model(tokens[:, :context], caches[name], 0)
                saved[name] = [t.clone() for t in caches[name].tensors()]
            times = {name: [] for name in models}
            names = list(models)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    model, cache = models[name], caches[name]
                    restore(cache, saved[name], context)
                    start = time.perf_counter()
                    model(tokens[:, context:context + 1], cache, context)
                    times[name].append((time.perf_counter() - start) * 1e3)
            for name, model in models.items():
                low, high = bootstrap_ci(times[name])
                layouts = model.layouts
                rows.append(f"| {context} | {name} | {human_bytes(layouts.cache_bytes(context, 1, 4))} | "
                            f"{human_bytes(layouts.read_bytes(context, 1, 4))} | {median(times[name]):.2f} | "
                            f"{'-' if low is None else f'{low:.2f} - {high:.2f}'} |")  # too few rounds: none
    command = f"python experiments/v4_layouts.py --contexts {' '.join(map(str, args.contexts))} --rounds {args.rounds}"
    text = "\n".join([
        "# MLA (V3), DSA (V3.2) and DeepSeek-V4's compressed layers: a decode step on a CPU", "",
        "Command (repository root, 1 torch thread, 2 shared cores):", "", "```bash", command, "```", "",
        "model=small with 6 layers (16 heads of 64, d_model 1024), float32, batch 1, eager, the same seed: MLA "
        "(kv_lora_rank 256), DSA (MLA, top 256 tokens per query) and V4's layers (2 sliding, 2 CSA m = 4 keeping "
        "the top 64 entries, 2 HCA m' = 128; a K=V ring of 128 of head_dim 64). Held and read: the layouts' "
        f"formulas (float32). One step of each variant in turn, {args.rounds} rounds per context; median ms per "
        f"step and its bootstrap 95% interval. Load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} "
        f"after, on {os.cpu_count()} CPUs: other sessions' work inflates absolute times; the variants alternate, "
        "so it falls on each.", "",
        "| context | layout | held per sequence | read per step | median ms | 95% interval |",
        "|---:|---|---:|---:|---:|---:|", *rows, "",
        "At these contexts a step is dominated by the weights (171-246 MB in float32, read once per step), so "
        "the times differ far less than the bytes read; the presets at 8k-1M tokens are in docs/layouts-v4.md.",
    ])
    write_report(args.out, text, keys=2)


if __name__ == "__main__":
    run_main(main)
