"""KV precision next to fewer KV heads: {MHA, GQA, MQA} x {float32, int8} cache, one process.

    python experiments/kv_precision.py --threads 1

The small model (random weights, float32 compute), ``--batch`` sequences of ``--prompt`` tokens,
static cache, eager. Per variant the prompt is prefilled (in chunks of 512, untimed) into a
float32 cache and into an int8 cache (``cache.dtype=int8``); then ``--steps`` decode steps run
interleaved over all six caches, one step of each in turn (the order rotated every step), so load
drifts hit every configuration alike. The int8 cache decodes greedily; its float32 twin is fed
the same tokens (teacher-forced), so at every step the two differ only in how K/V were stored:
that gives the max |logit difference| and the top-1 agreement (prefill's last position and every
decode step, all sequences). KV bytes: the layouts' formula (``Layouts.cache_bytes``), equal to the cache's
tensors (asserted). Writes ``--out`` (default ``outputs/experiments/kv_precision.md``; the
committed copy is ``experiments/results/kv_precision.md``).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
from _common import Parser, list_of, out_file, positive_int, run_main, say, write_report

from kvbench.cache import cache_for
from kvbench.config.model import AttentionConfig, ModelConfig, attention_type
from kvbench.model import Decoder

ROOT = Path(__file__).resolve().parents[1]
SMALL = ModelConfig(name="small", num_layers=4, d_model=1024, num_heads=16, preset_kv_heads=4, ffn_dim=2816,
                    vocab_size=32000, max_seq_len=4096)  # conf/model/small.yaml
CHUNK = 512


@torch.inference_mode()
def prefill(model, prompt, cache) -> torch.Tensor:
    """The prompt in chunks of CHUNK positions through ``cache``; the last position's logits (B, V)."""
    for start in range(0, prompt.shape[1], CHUNK):
        logits = model(prompt[:, start:start + CHUNK], cache, start, last_only=True)
    return logits[:, -1]


@torch.inference_mode()
def main(argv=None) -> None:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=positive_int, default=8)
    p.add_argument("--prompt", type=positive_int, default=2048)
    p.add_argument("--steps", type=positive_int, default=16)
    p.add_argument("--kv-heads", type=list_of(positive_int), default="16,4,1")
    p.add_argument("--threads", type=positive_int, default=None)
    p.add_argument("--out", type=out_file, default=ROOT / "outputs" / "experiments" / "kv_precision.md",
                   help="the committed results change only with --out experiments/results/kv_precision.md")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start, load0 = time.perf_counter(), os.getloadavg()[0]
    B, P, N = args.batch, args.prompt, args.steps
    prompt = torch.randint(0, SMALL.vocab_size, (B, P), generator=torch.Generator().manual_seed(1))
    runs = []  # one per (variant, cache dtype)
    for kv in map(int, args.kv_heads.split(",")):
        torch.manual_seed(0)
        model = Decoder(SMALL, AttentionConfig.for_heads(SMALL.num_heads, kv)).eval()
        for cache_dtype in ("auto", "int8"):
            cache = cache_for(model, "static", B, P + N, cache_dtype)
            formula = model.layouts.cache_bytes(P + N, B, 4, cache_dtype)
            assert cache.nbytes == sum(t.nbytes for t in cache.tensors()) == formula
            logits = prefill(model, prompt, cache)
            runs.append(dict(kv=kv, cache_dtype=cache_dtype, model=model, cache=cache, logits=[logits], ms=[],
                             bytes=formula))
            say(f"prefilled {attention_type(SMALL.num_heads, kv)} kv={kv} {cache_dtype}")
    pairs = [(runs[i], runs[i + 1]) for i in range(0, len(runs), 2)]  # (float32, int8) per variant
    tokens = {id(q): q["logits"][0].argmax(-1, keepdim=True) for _, q in pairs}  # the int8 run's greedy tokens
    for step in range(N):
        order = runs[step % len(runs):] + runs[:step % len(runs)]
        for run in order:
            twin = run if run["cache_dtype"] == "int8" else next(q for f, q in pairs if f is run)
            t0 = time.perf_counter()
            logits = run["model"](tokens[id(twin)], run["cache"], P + step)[:, -1]
            run["ms"].append((time.perf_counter() - t0) * 1e3)
            run["logits"].append(logits)
        for _, q in pairs:
            tokens[id(q)] = q["logits"][-1].argmax(-1, keepdim=True)
    lines = ["| variant | KV cache | KV bytes (prompt + steps) | vs MHA float32 | decode ms p50 (min-max) | "
             "ratio to float32 | max abs Δlogit vs float32 cache | top-1 agreement |",
             "|---|---|---|---|---|---|---|---|"]
    base_bytes = runs[0]["bytes"]
    for f, q in pairs:
        ref, got = torch.stack(f["logits"], 1), torch.stack(q["logits"], 1)  # (B, N + 1, V)
        diff = (got - ref).abs().max().item()
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        name = f"{attention_type(SMALL.num_heads, f['kv'])} kv={f['kv']}"
        ratio = statistics.median(a / b for a, b in zip(q["ms"], f["ms"]))
        for run, quality in ((f, ("0 (the reference)", "1")), (q, (f"{diff:.3g}", f"{agree:.3f}"))):
            ms = run["ms"]
            lines.append(f"| {name} | {'float32' if run['cache_dtype'] == 'auto' else 'int8'} | "
                         f"{run['bytes'] / 2**20:.1f} MiB | {run['bytes'] / base_bytes:.3f} | "
                         f"{statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f}) | "
                         f"{'1' if run is f else f'{ratio:.2f}'} | {quality[0]} | {quality[1]} |")
    command = "python experiments/kv_precision.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v is not None)
    text = (f"# KV precision next to KV heads: model small (random weights), float32 compute, batch {B}, "
            f"prompt {P}, {N} decode steps, CPU ({torch.get_num_threads()} torch threads), "
            f"torch {torch.__version__}\n\n"
            f"Reproduce: `{command}` ({(time.perf_counter() - start) / 60:.0f} min; load average "
            f"{load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end). Decode ms: per step, {N} steps per "
            "configuration, interleaved; 'ratio to float32' is the median of the per-step ratios int8 / float32 "
            "of the same variant (adjacent steps). Quality: the int8 cache's greedy decode against the float32 "
            f"cache fed the same tokens, over prefill's last position and {N} steps of all {B} sequences.\n\n"
            + "\n".join(lines) + "\n")
    write_report(args.out, text, keys=2)  # variant and KV cache name a row


if __name__ == "__main__":
    run_main(main)
