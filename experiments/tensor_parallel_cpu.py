"""What tensor parallelism costs a decode step on this machine: model=small (GQA, 4 K/V heads) decoded
by one process and by `runtime.tensor_parallel=2` (two processes, gloo), each rank's collectives timed
(an all-reduce after each block's attention and MLP, the vocabulary-split embedding's all-reduce and the
logits' all-gather: 10 a step). On a CPU the ranks share the machine's cores and
memory bandwidth, so the step is not expected to halve; the all-reduce figure is the cost itself (a
call's time includes its wait for the slower rank).

    python experiments/tensor_parallel_cpu.py
    python experiments/tensor_parallel_cpu.py --gen-len 8 --out /tmp/tp.md
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Parser, compose_config, out_file, positive_int, run_main, write_report  # noqa: E402

from kvbench.jobs.runner import run_job  # noqa: E402
from kvbench.units import human_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "experiments" / "results" / "tensor_parallel_cpu.md"


def main(argv: Optional[List[str]] = None) -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=positive_int, default=128)
    parser.add_argument("--gen-len", type=positive_int, default=32)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--out", type=out_file, default=OUT)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in (1, 2):
            over = ["model=small", "attention=gqa", f"runtime.tensor_parallel={ranks}", "runtime.device=cpu",
                    f"workload.prompt_len={args.prompt_len}", f"workload.gen_len={args.gen_len}",
                    f"runtime.repeats={args.repeats}", "runtime.fidelity=false", "wandb=disabled"]
            record = run_job(compose_config(over), Path(tmp) / str(ranks), over)
            if record.status != "ok":
                raise SystemExit(f"runtime.tensor_parallel={ranks}: {record.status}: {record.error}")
            for row in record.tables.get("ranks") or [{"rank": 0, **record.metrics}]:
                rows.append({"ranks": ranks, "rank": row["rank"], "decode_ms_p50": row["decode_ms_p50"],
                             "allreduce_ms_per_step": row.get("allreduce_ms_per_step"),
                             "kv_cache_bytes": row["kv_cache_bytes"], "weight_bytes": row["weight_bytes"],
                             "load": "{:.1f} -> {:.1f}".format(record.metrics["load_avg_before"],
                                                               record.metrics["load_avg_after"])})
    command = " ".join(["python experiments/tensor_parallel_cpu.py", *(argv if argv is not None else sys.argv[1:])])
    lines = ["# Tensor parallelism on a CPU: the all-reduce's cost a step", "",
             f"Made by `{command}` on this machine ({rows[0]['load']} load average on its CPUs while the "
             f"one-process job ran): model=small, GQA with 4 K/V heads, batch 1, a {args.prompt_len}-token prompt, "
             f"{args.gen_len} decode steps, {args.repeats} trials; the median step. `all-reduce / step`: the median "
             "of a rank's decode-step collectives (T = 1) times their 10 a step (an all-reduce after each block's "
             "attention and MLP, the embedding's all-reduce, the logits' all-gather), each from its call to its "
             "return, so a wait for the slower rank counts. The KV and weight bytes are each rank's, allocated.", "",
             "| ranks | rank | decode step p50 (ms) | all-reduce / step (ms) | share of the step | KV cache | "
             "weights | load average |", "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        ar, step = r["allreduce_ms_per_step"], r["decode_ms_p50"]
        cost = "- | -" if ar is None else f"{ar:.2f} | {ar / step:.0%}"
        lines.append(f"| {r['ranks']} | {r['rank']} | {step:.2f} | {cost} | {human_bytes(r['kv_cache_bytes'])} "
                     f"| {human_bytes(r['weight_bytes'])} | {r['load']} |")
    write_report(args.out, "\n".join(lines) + "\n", keys=2, data=rows)


if __name__ == "__main__":
    run_main(main)
