"""Prefill cost across KV-head counts (issue 28): attention alone, and the whole model against
transformers' ``LlamaForCausalLM`` with the same weights.

1. ``grouped_attention`` per call at fixed T (new tokens) and S (keys), for H_kv = H ... 1:
   causal prefill (S = T, SDPA's causal path), a prompt after ``--cached`` cached keys
   (S = T + cached, a (T, S) mask with ``enable_gqa``), and a decode step (T = 1) both plain and
   through a shared prefix of ``--cached`` keys (:func:`kvbench.model.prefix_attention`).
2. A whole prefill of ``--prompt-len`` tokens (logits of the last token) by kvbench's decoder and
   by transformers' (SDPA attention), same shapes, weights and dtype.

Every contender is timed in rounds whose order alternates (ABC, CBA, ...), and a figure is the
minimum over rounds: on a shared machine a load that slows everything alike cancels in a ratio,
and the minimum drops the calls another job interrupted.

    python experiments/prefill_heads.py --threads 1 --out experiments/results/prefill_heads.md
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from _common import Parser, natural_int, out_file, positive_int, run_main, write_report
from compare_transformers import hf_model, kvbench_model

from kvbench.config.model import ModelConfig, attention_type
from kvbench.layouts.kv_heads_attention import grouped_attention

ROOT = Path(__file__).resolve().parents[1]


def interleaved_min(calls: dict, rounds: int) -> dict:
    """name -> fn(); each called once per round, in ABC / CBA order; the minimum seconds of each."""
    best = {name: float("inf") for name in calls}
    for fn in calls.values():
        fn()  # warm-up
    names = list(calls)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            calls[name]()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


@torch.inference_mode()
def attention_table(H: int, D: int, T: int, cached: int, rounds: int) -> list[str]:
    heads = [h for h in range(H, 0, -1) if H % h == 0]
    calls = {}
    for kv in heads:
        q = torch.randn(1, H, T, D)
        k, v = torch.randn(1, kv, T + cached, D), torch.randn(1, kv, T + cached, D)
        q1 = torch.randn(4, H, 1, D)  # decode: batch 4, one new token each
        k1, v1 = torch.randn(4, kv, cached + 1, D), torch.randn(4, kv, cached + 1, D)
        kp, vp = k1[:1, :, :cached].clone(), v1[:1, :, :cached].clone()  # the shared prefix
        calls[(kv, "causal")] = lambda q=q, k=k[:, :, :T], v=v[:, :, :T]: grouped_attention(q, k, v)
        calls[(kv, "after")] = lambda q=q, k=k, v=v: grouped_attention(q, k, v)
        calls[(kv, "decode")] = lambda q=q1, k=k1, v=v1: grouped_attention(q, k, v)
        calls[(kv, "decode_prefix")] = (lambda q=q1, k=k1[:, :, cached:], v=v1[:, :, cached:], p=(kp, vp):
                                        grouped_attention(q, k, v, None, p))
    best = interleaved_min(calls, rounds)
    lines = [f"## Attention per call (H={H}, D={D}, batch 1 prefill / batch 4 decode, float32)", "",
             f"| layout | H_kv | prefill S=T={T} ms | prompt of {T} after {cached} cached ms | "
             f"decode over {cached + 1} keys ms | decode, shared prefix of {cached} ms |",
             "|---|---:|---:|---:|---:|---:|"]
    for kv in heads:
        lines.append(f"| {attention_type(H, kv)} | {kv} | {best[(kv, 'causal')] * 1e3:.2f} | "
                     f"{best[(kv, 'after')] * 1e3:.2f} | {best[(kv, 'decode')] * 1e3:.3f} | "
                     f"{best[(kv, 'decode_prefix')] * 1e3:.3f} |")
    for kind, what in (("causal", "prefill"), ("after", "prompt after cached keys")):
        times = [best[(kv, kind)] for kv in heads]
        lines.append(f"\n{what}: slowest / fastest over KV-head counts = {max(times) / min(times):.3f}")
    return lines


@torch.inference_mode()
def model_table(cfg: ModelConfig, T: int, rounds: int) -> list[str]:
    lines = [f"## Whole-model prefill of {T} tokens ({cfg.num_layers} layers, d_model {cfg.d_model}, "
             f"{cfg.num_heads} heads, ffn {cfg.ffn_dim}, vocab {cfg.vocab_size}, float32)", "",
             "| layout | H_kv | kvbench ms | transformers ms | kvbench / transformers |", "|---|---:|---:|---:|---:|"]
    for kv in [h for h in (cfg.num_heads, 2, 1) if cfg.num_heads % h == 0]:
        hf = hf_model(cfg, kv, torch.float32, "cpu")
        ours = kvbench_model(hf, cfg, kv, torch.float32, "cpu")
        prompt = torch.randint(0, cfg.vocab_size, (1, T))
        want = hf(prompt, logits_to_keep=1).logits[:, -1]
        torch.testing.assert_close(ours(prompt, last_only=True)[:, -1], want, atol=1e-4, rtol=1e-4)
        best = interleaved_min({"kvbench": lambda: ours(prompt, last_only=True),
                                "transformers": lambda: hf(prompt, logits_to_keep=1, use_cache=False)}, rounds)
        lines.append(f"| {attention_type(cfg.num_heads, kv)} | {kv} | {best['kvbench'] * 1e3:.1f} | "
                     f"{best['transformers'] * 1e3:.1f} | {best['kvbench'] / best['transformers']:.3f} |")
    return lines


def main(argv=None) -> None:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--prompt-len", type=positive_int, default=2048)
    ap.add_argument("--cached", type=natural_int, default=512, help="cached keys before a prompt / a decode step")
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--out", type=out_file, default=ROOT / "outputs" / "experiments" / "prefill_heads.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = ModelConfig(name="prefill", num_layers=2, d_model=512, num_heads=8, preset_kv_heads=8, ffn_dim=1376,
                      vocab_size=8192, max_seq_len=args.prompt_len + args.cached)
    lines = ["# Prefill across KV-head counts", "",
             f"`python experiments/prefill_heads.py {' '.join(sys.argv[1:] if argv is None else argv)}`"
             f" (torch {torch.__version__}, {args.threads} thread(s), minimum of {args.rounds} interleaved rounds)", ""]
    lines += attention_table(cfg.num_heads, cfg.head_dim, args.prompt_len, args.cached, args.rounds)
    lines += [""] + model_table(cfg, args.prompt_len, args.rounds)
    write_report(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    run_main(main)
