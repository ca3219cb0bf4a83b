"""How fast can this CPU stream a weight matrix when a decode step multiplies it by B rows?

    python experiments/small_batch_gemm.py --threads 1

The GEMV roofline (bytes read / the rate of ``torch.mv`` on a large matrix) assumes a decode
step streams its weights at the GEMV rate whatever the batch. A step at batch B multiplies each
weight matrix by B rows (a GEMM with M = B), which reads the same bytes but does B times the
FLOP; whether it still runs at the GEMV rate depends on the GEMM kernel at small M. This
script measures, for the small model's matrix shapes and M = 1, 2, 4, 8, 16, the weight bytes
per second of ``F.linear`` (what kvbench and transformers call: MKL's sgemm on a CPU build),
of oneDNN's linear on the same weights, and of MKL's packed GEMM (weights packed once, as an
inference server would), next to ``torch.mv`` and a 1024^3 GEMM's FLOP rate.

Each matrix is cycled through enough copies to exceed the caches (~300 MB), each form runs
``--repeats`` times interleaved round by round, and a form's rate is its median by this
process's CPU time (``time.process_time``; on a shared machine the wall clock mostly measures
the wait for a core). Writes ``--out`` (default ``outputs/experiments/small_batch_gemm.md``; the
committed copy is ``experiments/results/small_batch_gemm.md``).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import Parser, list_of, out_file, positive_int, progress_row, run_main, write_report

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"wq/wo (1024x1024)": (1024, 1024), "w1/w3 (2816x1024)": (2816, 1024),
          "w2 (1024x2816)": (1024, 2816), "lm head (32000x1024)": (32000, 1024)}


def forms(weights, rows: int):
    """name -> fn(i) computing rows x weights[i]^T, every form on the same weights."""
    x = torch.randn(rows, weights[0].shape[1])
    packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
    dnn_w, dnn_x = [w.to_mkldnn() for w in weights], x.to_mkldnn()
    out = {"F.linear (MKL sgemm)": lambda i: F.linear(x, weights[i]),
           "oneDNN linear": lambda i: torch._C._nn.mkldnn_linear(dnn_x, dnn_w[i]),
           "MKL packed GEMM": lambda i: torch.ops.mkl._mkl_linear(x, packed[i], weights[i], None, rows)}
    if rows == 1:
        out["torch.mv"] = lambda i: torch.mv(weights[i], x[0])
    for name, fn in out.items():  # same numbers from every form
        got = fn(0).to_dense() if name.startswith("oneDNN") else fn(0)
        torch.testing.assert_close(got.reshape(rows, -1), F.linear(x, weights[0]), rtol=1e-4, atol=1e-3)
    return out


def measure(shape, rows: int, repeats: int) -> dict:
    n, k = shape
    copies = max(1, int(300e6 // (n * k * 4)))
    weights = [torch.randn(n, k) for _ in range(copies)]
    fns = forms(weights, rows)
    times = {name: [] for name in fns}
    order = list(fns)
    for r in range(repeats):
        for name in (order if r % 2 == 0 else order[::-1]):  # interleaved, the order alternating
            i = r % copies
            t0 = time.process_time()
            fns[name](i)
            times[name].append(time.process_time() - t0)
    nbytes = n * k * 4
    return {name: nbytes / statistics.median(ts) / 1e9 for name, ts in times.items()}


def main(argv=None) -> None:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=list_of(positive_int), default="1,2,4,8,16", help="M: the decode batch")
    p.add_argument("--repeats", type=positive_int, default=24)
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", type=out_file, default=ROOT / "outputs" / "experiments" / "small_batch_gemm.md")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    square = torch.randn(1024, 1024)
    square @ square
    t = []
    for _ in range(8):
        t0 = time.process_time()
        square @ square
        t.append(time.process_time() - t0)
    gemm_gflops = 2 * 1024**3 / statistics.median(t) / 1e9
    lines = ["| M (batch) | matrix | " + " | ".join(["F.linear (MKL sgemm)", "oneDNN linear", "MKL packed GEMM",
                                                    "torch.mv"]) + " | F.linear GFLOP/s |",
             "|---|---|---|---|---|---|---|"]
    for rows in map(int, args.rows.split(",")):
        for label, shape in SHAPES.items():
            rates = measure(shape, rows, args.repeats)
            lin = rates["F.linear (MKL sgemm)"]
            cells = [f"{rates[f]:.1f}" if f in rates else "-" for f in
                     ("F.linear (MKL sgemm)", "oneDNN linear", "MKL packed GEMM", "torch.mv")]
            lines.append(f"| {rows} | {label} | " + " | ".join(cells) + f" | {lin * rows / 2:.1f} |")
            progress_row(lines)
    load = os.getloadavg()[0]
    command = "python experiments/small_batch_gemm.py" + (f" --threads {args.threads}" if args.threads else "")
    text = (f"# Weight bytes streamed per second (GB/s) by a GEMM with M = batch rows, float32 on the CPU "
            f"({torch.get_num_threads()} torch threads), torch {torch.__version__}\n\n"
            f"Reproduce: `{command}` ({(time.perf_counter() - start):.0f} s, load average {load:.1f} at the end). "
            "Median of "
            f"{args.repeats} interleaved calls by CPU time; each matrix cycled over ~300 MB of copies. "
            f"A 1024^3 GEMM ran at {gemm_gflops:.0f} GFLOP/s. The last column is F.linear's FLOP rate "
            "(2·M FLOP per 4-byte weight).\n\n" + "\n".join(lines) + "\n")
    write_report(args.out, text)


if __name__ == "__main__":
    run_main(main)
