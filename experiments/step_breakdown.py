"""Where a decode step's time goes: the weight matrices (aten::mm / addmm) against the attention
over the KV cache, each set against the bytes it reads and the machine's GEMV rate.

    python experiments/step_breakdown.py --threads 1

The small model, float32, static cache, eager; per (batch, prompt, variant) ``--steps`` decode
steps run under ``torch.profiler`` (CPU, self time per operator), between two GEMV probes. The
matrix products' self time is set against the weight bytes they stream, the attention kernel's
against the K/V bytes it reads; "x GEMV" is each part's time over its bytes at the probe's rate
(1.0 = it reads at the rate a large GEMV does). The rest (norms, rotary, residuals, the cache
write, Python) is reported as one figure. Writes ``--out`` (default
``outputs/experiments/step_breakdown.md``; the committed copy is ``experiments/results/step_breakdown.md``).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
from _common import Parser, batch_x_prompt, list_of, out_file, positive_int, progress_row, run_main, write_report
from torch.profiler import ProfilerActivity, profile

from kvbench.cache import cache_for
from kvbench.config.model import AttentionConfig, ModelConfig, attention_type
from kvbench.measure.roofline import decode_bytes_read, decode_flops, probe_bandwidth
from kvbench.model import Decoder

ROOT = Path(__file__).resolve().parents[1]
SMALL = ModelConfig(name="small", num_layers=4, d_model=1024, num_heads=16, preset_kv_heads=4, ffn_dim=2816,
                    vocab_size=32000, max_seq_len=4096)
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm")
ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu",)


@torch.inference_mode()
def breakdown(batch: int, prompt_len: int, kv: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = Decoder(SMALL, AttentionConfig.for_heads(SMALL.num_heads, kv)).eval()
    prompt = torch.randint(0, SMALL.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(1))
    cache = cache_for(model, "static", batch, prompt_len + steps)
    token = model(prompt, cache, 0, last_only=True)[:, -1].argmax(-1, keepdim=True)
    for i in range(2):  # warm-up
        model(token, cache, prompt_len + i)
    load = os.getloadavg()[0]
    before = probe_bandwidth(torch.device("cpu"), repeats=5)["gemv_gb_per_s"]
    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            t0 = time.perf_counter()
            model(token, cache, prompt_len + i)
            walls.append((time.perf_counter() - t0) * 1e3)
    gemv = statistics.median([before, probe_bandwidth(torch.device("cpu"), repeats=5)["gemv_gb_per_s"]])
    self_ms = {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()}
    mm_ms = sum(self_ms.get(k, 0.0) for k in MATMUL)
    attention_ms = sum(self_ms.get(k, 0.0) for k in ATTENTION)
    step_ms = statistics.median(walls)
    total, kv_bytes = decode_bytes_read(model, batch, prompt_len + (steps + 1) / 2)
    weight_bytes = total - kv_bytes
    flops = decode_flops(model, batch, 0)  # the weight matrices' multiply-adds alone
    return dict(batch=batch, prompt_len=prompt_len, variant=f"{attention_type(SMALL.num_heads, kv)} ({kv})",
                step_ms=step_ms, mm_ms=mm_ms, attention_ms=attention_ms, rest_ms=step_ms - mm_ms - attention_ms,
                weight_mb=weight_bytes / 1e6, kv_mb=kv_bytes / 1e6, gemv=gemv,
                mm_x=mm_ms / (weight_bytes / gemv / 1e6), attention_x=attention_ms / (kv_bytes / gemv / 1e6),
                mm_gflops=flops / (mm_ms / 1e3) / 1e9, x_roofline=step_ms / (total / gemv / 1e6),
                load=(load, os.getloadavg()[0]))


def main(argv=None) -> None:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=list_of(batch_x_prompt), default="1x512,8x1024,8x2048", help="BATCHxPROMPT list")
    p.add_argument("--kv-heads", type=list_of(positive_int), default="16,4,1")
    p.add_argument("--steps", type=positive_int, default=16)
    p.add_argument("--threads", type=positive_int, default=None)
    p.add_argument("--out", type=out_file, default=ROOT / "outputs" / "experiments" / "step_breakdown.md",
                   help="the committed results change only with --out experiments/results/step_breakdown.md")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lines = ["| B | prompt | variant | step ms | x roofline | matmuls ms (weights MB; x GEMV; GFLOP/s) | "
             "attention ms (K/V MB; x GEMV) | rest ms | GEMV GB/s | load |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    start = time.perf_counter()
    for shape in args.shapes.split(","):
        batch, prompt_len = map(int, shape.split("x"))
        for kv in map(int, args.kv_heads.split(",")):
            r = breakdown(batch, prompt_len, kv, args.steps)
            lines.append(f"| {r['batch']} | {r['prompt_len']} | {r['variant']} | {r['step_ms']:.2f} | "
                         f"{r['x_roofline']:.2f} | {r['mm_ms']:.2f} ({r['weight_mb']:.0f}; {r['mm_x']:.2f}; "
                         f"{r['mm_gflops']:.0f}) | {r['attention_ms']:.2f} ({r['kv_mb']:.0f}; "
                         f"{r['attention_x']:.2f}) | "
                         f"{r['rest_ms']:.2f} | {r['gemv']:.1f} | {r['load'][0]:.1f}-{r['load'][1]:.1f} |")
            progress_row(lines)
    command = "python experiments/step_breakdown.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v is not None)
    text = (f"# Where a decode step's time goes, model small, float32, static cache, eager, CPU "
            f"({torch.get_num_threads()} torch threads), torch {torch.__version__}\n\n"
            f"Reproduce: `{command}` ({(time.perf_counter() - start) / 60:.0f} min). Operator self times from "
            "torch.profiler, per step; x GEMV = the part's time / (its bytes / the GEMV rate probed before and "
            "after).\n\n" + "\n".join(lines) + "\n")
    write_report(args.out, text, keys=3)  # B, prompt and variant name a row


if __name__ == "__main__":
    run_main(main)
