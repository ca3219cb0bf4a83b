"""The capacity report's per-GPU part: for the presets a fleet splits over a node (DeepSeek-V3 at TP=8
vs DP=8, Llama 3 70B at TP=4 and 8, GPT-OSS-120B, the Qwen3.5 / Qwen3-Next hybrids), per split of a
node of 8 GPUs (TP: tensor-parallel ranks per copy of the model, DP: copies, EP: the routed experts
split by expert), what one rank holds of a sequence's cache (per token and at the context), the
replication the split makes (a layout of fewer heads than ranks, MLA's one latent, is held whole on
every rank), the weights a rank holds (the decoder cut as `runtime.tensor_parallel` runs it, as the
checkpoint stores them), and the sequences that fit per GPU and per node. Computed, nothing run:
kvbench/parallel/per_gpu.py, the same figures `task=capacity` records as `tables.per_gpu`.
docs/capacity-per-gpu.md derives the DeepSeek-V3 rows by hand.

    python experiments/capacity_per_gpu.py                  # 8 x 141 GB (H200) at 0.9, 8192 tokens
    python experiments/capacity_per_gpu.py --gpu-gb 80 --out /tmp/per_gpu.md
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Parser, compose_config, out_file, positive_float, positive_int, run_main, write_report  # noqa: E402

from kvbench.jobs.job_config import to_bench_config  # noqa: E402
from kvbench.parallel.per_gpu import per_gpu_table  # noqa: E402
from kvbench.parallel.plan import Split  # noqa: E402
from kvbench.tasks.common import variant_label  # noqa: E402
from kvbench.units import human_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "experiments" / "results" / "capacity_per_gpu.md"
# (preset, the splits compared on a node of 8; None: every split of the node that cuts the model whole)
PRESETS = (("deepseek_v3", [Split(8), Split(8, 1, 8), Split(1, 8, 8), Split(1, 8)]),
           ("llama3_70b", [Split(1, 8), Split(2, 4), Split(4, 2), Split(8)]),
           ("gpt_oss_120b", None), ("qwen3_5_9b", None), ("qwen3_next_80b", None))
# vLLM's default share of a GPU's memory for weights and KV (gpu_memory_utilization)
MEMORY_FRACTION = 0.9


def splits_of(named: Optional[List[Split]], gpus: int) -> Optional[List[Split]]:
    """The named splits are of a node of 8: on another node (``--gpus 4``) a DP=8 row would count
    sequences on GPUs the node has not, so only those of the node's size are kept, else (None) every
    split of the node."""
    return [split for split in named or () if split.gpus == gpus] or None


def rows_of(model: str, splits: Optional[List[Split]], context: int, gpu_bytes: int, gpus: int) -> List[Dict]:
    splits = splits_of(splits, gpus)
    cfg = to_bench_config(compose_config([f"model={model}", "runtime.dtype=bfloat16"]))
    label = variant_label(cfg.attention, num_layers=cfg.model.num_layers)
    return [{"model": model, "label": label, "stored": cfg.model.weights_stored or "bfloat16", **row}
            for row in per_gpu_table(cfg.model, cfg.attention, "bfloat16", "auto", [context], gpu_bytes, gpus, splits)]


def main(argv: Optional[List[str]] = None) -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=positive_int, default=8192)
    parser.add_argument("--gpu-gb", type=positive_float, default=141.0, help="GB (1e9 bytes) of one GPU")
    parser.add_argument("--gpus", type=positive_int, default=8, help="GPUs of a node")
    parser.add_argument("--out", type=out_file, default=OUT)
    args = parser.parse_args(argv)
    gpu_bytes = int(args.gpu_gb * 1e9 * MEMORY_FRACTION)
    if gpu_bytes < 1:  # a GPU's share is whole bytes: less than one is none at all
        parser.error(f"argument --gpu-gb: {args.gpu_gb!r}: less than one byte")
    torch.set_num_threads(1)
    rows = [row for model, splits in PRESETS for row in rows_of(model, splits, args.context, gpu_bytes, args.gpus)]
    command = " ".join(["python experiments/capacity_per_gpu.py", *(argv if argv is not None else sys.argv[1:])])
    lines = [
        "# Capacity per GPU: TP, DP and EP", "",
        f"Made by `{command}`: a node of {args.gpus} GPUs of {args.gpu_gb:g} GB, {MEMORY_FRACTION:g} of each for "
        f"weights and KV (vLLM's default gpu_memory_utilization), sequences of {args.context} tokens, K/V in "
        "bfloat16. Computed, none measured (kvbench/parallel/per_gpu.py; `task=capacity` records the same as "
        "`tables.per_gpu`). `KV / token` and `KV / seq` are one rank's part (each layer's part as its layout "
        "cuts it: K/V heads split over the TP ranks, a layout of fewer heads than ranks replicated); "
        "`replication`, what the TP ranks hold of a sequence together over one copy's; `weights / GPU`, the "
        "decoder cut as `runtime.tensor_parallel` runs it (attention heads and MLP widths over TP, the routed "
        "experts over EP by expert, the embedding and LM head by vocabulary over TP), as the checkpoint stores "
        "them; `KV budget / GPU`, the GPU's share less those weights (activations left out); `seqs / node`, "
        "budget // KV per sequence times the node's TP groups, and `seqs / GPU` that over its GPUs. "
        "docs/capacity-per-gpu.md derives the DeepSeek-V3 rows by hand.", "",
        "| model | variant | weights | split | KV / token / rank | KV / seq / rank | replication | weights / GPU | "
        "KV budget / GPU | seqs / GPU | seqs / node |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        budget = human_bytes(r["kv_budget_bytes_gpu"]) if r["kv_budget_bytes_gpu"] > 0 else "weights do not fit"
        lines.append(f"| {r['model']} | {r['label']} | {r['stored']} | {r['split']} | "
                     f"{r['kv_bytes_per_token_rank']:,.0f} | {human_bytes(r['kv_bytes_per_sequence_rank'])} | "
                     f"{r['kv_replication']:.3g}x | {human_bytes(r['weight_bytes_rank'])} | {budget} | "
                     f"{r['sequences_per_gpu']:,.4g} | {r['sequences_per_node']:,} |")
    write_report(args.out, "\n".join(lines) + "\n", keys=4, data=rows)


if __name__ == "__main__":
    run_main(main)
