"""kvbench's decode step vs Hugging Face transformers, side by side in one run.

Same shapes, same weights, same dtype: ``LlamaForCausalLM`` with its ``StaticCache`` and SDPA
attention against kvbench's decoder with each cache implementation, for MHA, GQA and MQA.
Prints per-token decode times, their ratio and the roofline percentage, and writes the table to
``--out`` (default ``outputs/experiments/compare_transformers.md`` and ``.json``; the committed
``experiments/results/compare_transformers.md`` is refreshed with ``--out
experiments/results/compare_transformers``).

    python experiments/compare_transformers.py                      # small model, CPU, float32
    python experiments/compare_transformers.py --device cuda --dtype bfloat16

Each (model, cache) pair is prefilled once; every repeat rolls the cache back to the prompt and
times ``--gen-len`` decode steps one by one (median over all steps of all repeats).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

from kvbench.cache import cache_for
from kvbench.checkpoint import _llama_name, build_decoder
from kvbench.config import AttentionConfig, ModelConfig
from kvbench.measure.roofline import decode_bytes_read, machine_peaks, roofline_metrics
from kvbench.measure.timing import sync

SMALL = ModelConfig(name="small", num_layers=4, d_model=1024, num_heads=16, preset_kv_heads=4, ffn_dim=2816,
                    vocab_size=32000, max_seq_len=4096)


def hf_model(cfg: ModelConfig, num_kv_heads: int, dtype, device) -> LlamaForCausalLM:
    hf_cfg = LlamaConfig(hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=num_kv_heads,
                         intermediate_size=cfg.ffn_dim, vocab_size=cfg.vocab_size,
                         max_position_embeddings=cfg.max_seq_len, rope_theta=cfg.rope_theta,
                         rms_norm_eps=cfg.norm_eps, tie_word_embeddings=False)
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(hf_cfg).to(device=device, dtype=dtype).eval()


def kvbench_model(hf: LlamaForCausalLM, cfg: ModelConfig, num_kv_heads: int, dtype, device):
    state = {_llama_name(k): v for k, v in hf.state_dict().items() if "rotary_emb" not in k}
    model_cfg = ModelConfig(**{**vars(cfg), "preset_kv_heads": num_kv_heads, "head_dim": None})
    return build_decoder(model_cfg, AttentionConfig.for_heads(cfg.num_heads, num_kv_heads), state, dtype, device).eval()


def time_steps(step, first_token, steps: int, repeats: int, reset, device) -> list[float]:
    """ms of each decode step; ``step(token, i) -> next token``; ``reset()`` rolls back."""
    times = []
    for r in range(repeats + 1):  # the first pass warms up
        reset()
        token = first_token
        for i in range(steps):
            sync(device)
            t0 = time.perf_counter()
            token = step(token, i)
            sync(device)
            if r:
                times.append((time.perf_counter() - t0) * 1e3)
    return times


@torch.inference_mode()
def compare(batch: int, prompt_len: int, num_kv_heads: int, impls, gen_len: int, repeats: int,
            dtype, device, peak: float, gflops: float) -> list[dict]:
    hf = hf_model(SMALL, num_kv_heads, dtype, device)
    ours = kvbench_model(hf, SMALL, num_kv_heads, dtype, device)
    prompt = torch.randint(0, SMALL.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(device)
    rows = []

    # transformers: StaticCache sized for the run, positions given explicitly as generate() does.
    cache = StaticCache(config=hf.config, max_cache_len=prompt_len + gen_len)
    out = hf(input_ids=prompt, past_key_values=cache, cache_position=torch.arange(prompt_len, device=device),
             use_cache=True, logits_to_keep=1)
    first = out.logits[:, -1].argmax(-1, keepdim=True)

    def hf_step(token, i):
        position = torch.tensor([prompt_len + i], device=device)  # a fresh tensor: HF may update it in place
        logits = hf(input_ids=token, past_key_values=cache, cache_position=position, use_cache=True,
                    logits_to_keep=1).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    def hf_reset():
        # transformers >= 5 keeps the write position in each layer (cumulative_length), not in
        # cache_position; roll it back to the end of the prompt.
        for layer in getattr(cache, "layers", []):
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length.fill_(prompt_len)

    hf_ms = statistics.median(time_steps(hf_step, first, gen_len, repeats, hf_reset, device))
    total, kv = decode_bytes_read(ours, batch, prompt_len + (gen_len + 1) / 2)
    bound = roofline_metrics(ours, batch, prompt_len, gen_len, 1.0, peak, gflops)
    roof = bound["roofline_ms"]
    rows.append(dict(impl="transformers StaticCache", ms=hf_ms))

    for impl in impls:
        steps = gen_len if impl != "none" else max(2, gen_len // 8)  # a recompute step is a prefill
        kv_cache = cache_for(ours, impl, batch, prompt_len + gen_len)
        first_ours = ours(prompt, kv_cache, 0, last_only=True)[:, -1].argmax(-1, keepdim=True)
        seq = [prompt]

        def step(token, i):
            if kv_cache.stores_history:
                logits = ours(token, kv_cache, prompt_len + i)[:, -1]
            else:
                seq.append(token)
                logits = ours(torch.cat(seq, 1), kv_cache, 0, last_only=True)[:, -1]
            return logits.argmax(-1, keepdim=True)

        def reset():
            if kv_cache.stores_history:
                kv_cache.truncate(prompt_len)
            else:
                del seq[1:]

        ms = statistics.median(time_steps(step, first_ours, steps, repeats, reset, device))
        rows.append(dict(impl=f"kvbench {impl}", ms=ms))
    for row in rows:
        row.update(batch=batch, prompt_len=prompt_len, num_kv_heads=num_kv_heads,
                   speedup_vs_hf=hf_ms / row["ms"], roofline_ms=roof, kv_bytes_read=kv,
                   bytes_read=total, roofline_ratio=row["ms"] / roof, bound=bound["roofline_bound"],
                   percent_of_peak=100 * (total / (row["ms"] / 1e3) / 1e9) / peak)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1x512,8x2048", help="BATCHxPROMPT list")
    p.add_argument("--kv-heads", default="16,4,1", help="MHA, GQA, MQA for the small model's 16 heads")
    p.add_argument("--impls", default="static,concat,none")
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    # The committed results change only on purpose: --out experiments/results/compare_transformers
    p.add_argument("--out", default=str(Path(__file__).parents[1] / "outputs" / "experiments" / "compare_transformers"),
                   help="report path without suffix (.md and .json are written)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    peak, gflops, method = machine_peaks(device)
    rows = []
    for shape in args.shapes.split(","):
        batch, prompt_len = map(int, shape.split("x"))
        for kv in map(int, args.kv_heads.split(",")):
            impls = [i for i in args.impls.split(",") if i != "none" or batch * prompt_len <= 1024]
            rows += compare(batch, prompt_len, kv, impls, args.gen_len, args.repeats, dtype, device, peak, gflops)
            print(table(rows[-len(impls) - 1:]), flush=True)
    header = (f"# kvbench vs transformers decode, model small, {args.dtype} on {device} "
              f"({torch.get_num_threads()} threads), peaks {peak:.1f} GB/s ({method}) and {gflops:.0f} GFLOP/s "
              "(float32 GEMM probe); the roofline is the larger of bytes / bandwidth and FLOP / compute\n\n")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = header + table(rows) + "\n\n" + variant_table(rows) + "\n"
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps(dict(peak_gb_per_s=peak, peak_method=method, rows=rows), indent=1))
    print(text)
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")


def variant_table(rows) -> str:
    """GQA/MQA vs MHA with the static cache: measured time ratio next to the bytes-read ratio."""
    lines = ["| B | prompt | KV heads | kvbench static ms | time / MHA | bytes read / MHA | KV share of bytes |",
             "|---|---|---|---|---|---|---|"]
    static = [r for r in rows if r["impl"] == "kvbench static"]
    for r in static:
        mha = max((m for m in static if (m["batch"], m["prompt_len"]) == (r["batch"], r["prompt_len"])),
                  key=lambda m: m["num_kv_heads"])
        lines.append(f"| {r['batch']} | {r['prompt_len']} | {r['num_kv_heads']} | {r['ms']:.2f} | "
                     f"{r['ms'] / mha['ms']:.2f} | {r['bytes_read'] / mha['bytes_read']:.2f} | "
                     f"{r['kv_bytes_read'] / r['bytes_read']:.0%} |")
    return "\n".join(lines)


def table(rows) -> str:
    lines = ["| B | prompt | KV heads | implementation | ms/token | speed-up vs HF | roofline ms (bound) | x roofline "
             "| % peak BW |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['prompt_len']} | {r['num_kv_heads']} | {r['impl']} | {r['ms']:.2f} | "
                     f"{r['speedup_vs_hf']:.2f} | {r['roofline_ms']:.2f} ({r['bound']}) | {r['roofline_ratio']:.2f} | "
                     f"{r['percent_of_peak']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
