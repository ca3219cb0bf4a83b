"""kvbench's decode step vs Hugging Face transformers and the roofline, side by side in one run.

Same shapes, same weights, same dtype: ``LlamaForCausalLM`` with its ``StaticCache`` and SDPA
attention against kvbench's decoder with the static cache, eager (``runtime.compile=false``)
and with the compiled fixed-shape step (``runtime.compile=graph``), for MHA, GQA and MQA.
Writes the table to ``--out`` (default ``outputs/experiments/compare_transformers.md`` and
``.json``; the committed ``experiments/results/compare_transformers.md`` is refreshed with
``--out experiments/results/compare_transformers``).

    python experiments/compare_transformers.py --threads 1                 # small model, CPU, float32
    python experiments/compare_transformers.py --device cuda --dtype bfloat16

Each (shape, variant) is prefilled once per contender; then ``--rounds`` rounds each time
``--gen-len`` decode steps one by one from the end of the prompt, for every contender in an
order that alternates round by round (ABC, CBA, ...), and probe the machine's GEMV and copy
rates (``kvbench.measure.roofline.probe_bandwidth``) between them: the rate a shared machine
gives moves within minutes, so the roofline uses the probes taken next to the steps. A
contender's time is the median over rounds of its round's median step; the spread is the range
of those round medians. The roofline is the bytes a step reads (every weight matrix, K/V at the
positions read: the context for eager and transformers, the context bucket for the fixed-shape
step) over the GEMV rate. Writes ``experiments/results/compare_transformers.md`` and ``.json``.

Every step and probe is timed twice: by the wall clock, and on a CPU by this process's CPU time
(``time.process_time``), which is not charged while the process waits for a core. On a machine
whose cores other jobs keep busy (load average above the core count) the wall clock mostly
measures the wait; both are reported, and "x roofline" uses the same clock for step and probe.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
from _common import (
    Parser,
    batch_x_prompt,
    choice,
    list_of,
    out_path,
    positive_int,
    print_report,
    run_main,
    torch_device,
    write_report,
)
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

from kvbench.cache import cache_for
from kvbench.checkpoint import build_decoder, hf_to_decoder_name
from kvbench.config.model import AttentionConfig, ModelConfig, attention_type
from kvbench.generate import FixedShapeStep, decode_step
from kvbench.layouts.build import build_layouts
from kvbench.measure.roofline import decode_bytes_read, decode_flops, probe_bandwidth
from kvbench.measure.timing import sync

SMALL = ModelConfig(name="small", num_layers=4, d_model=1024, num_heads=16, preset_kv_heads=4, ffn_dim=2816,
                    vocab_size=32000, max_seq_len=4096)
ROOT = Path(__file__).resolve().parents[1]
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


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
    model_cfg = ModelConfig(**{**vars(cfg), "preset_kv_heads": num_kv_heads, "head_dim": None})
    attention = AttentionConfig.for_heads(cfg.num_heads, num_kv_heads)
    layouts = build_layouts(model_cfg, attention.resolved(model_cfg))
    state = {hf_to_decoder_name(k, layouts): v for k, v in hf.state_dict().items() if "rotary_emb" not in k}
    return build_decoder(model_cfg, attention, state, dtype, device).eval()


class Contender:
    """One way to run decode steps: ``step(token, i) -> next token``, ``reset()`` rolls back to
    the end of the prompt, ``first`` is the token the prefill chose."""

    def __init__(self, name, first, step, reset, kv_positions):
        self.name, self.first, self.step, self.reset = name, first, step, reset
        self.kv_positions = kv_positions  # mean positions per KV head a step reads
        self.rounds: list[dict] = []  # per round, the median step by each clock


def transformers_contender(hf, prompt, gen_len, device) -> Contender:
    P = prompt.shape[1]
    # StaticCache sized for the run, positions given explicitly as generate() does.
    cache = StaticCache(config=hf.config, max_cache_len=P + gen_len)
    out = hf(input_ids=prompt, past_key_values=cache, cache_position=torch.arange(P, device=device),
             use_cache=True, logits_to_keep=1)

    def step(token, i):
        position = torch.tensor([P + i], device=device)  # a fresh tensor: HF may update it in place
        logits = hf(input_ids=token, past_key_values=cache, cache_position=position, use_cache=True,
                    logits_to_keep=1).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    def reset():
        # transformers >= 5 keeps the write position in each layer (cumulative_length), not in
        # cache_position; roll it back to the end of the prompt.
        for layer in getattr(cache, "layers", []):
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length.fill_(P)

    return Contender("transformers StaticCache", out.logits[:, -1].argmax(-1, keepdim=True), step, reset,
                     P + (gen_len + 1) / 2)


def kvbench_contender(name, model, prompt, gen_len, step_fn) -> Contender:
    B, P = prompt.shape
    cache = cache_for(model, "static", B, P + gen_len)
    first = model(prompt, cache, 0, last_only=True)[:, -1].argmax(-1, keepdim=True)
    if isinstance(step_fn, FixedShapeStep):
        kv_positions = statistics.mean(step_fn.lengths(cache, range(P, P + gen_len)))
    else:
        kv_positions = P + (gen_len + 1) / 2
    return Contender(name, first, lambda token, i: step_fn(model, token, cache, P + i).argmax(-1, keepdim=True),
                     lambda: cache.truncate(P), kv_positions)


def time_round(c: Contender, steps: int, device) -> dict:
    """Median ms of ``steps`` decode steps from the end of the prompt, by each clock."""
    c.reset()
    token, times = c.first, {clock: [] for clock in CLOCKS}
    for i in range(steps):
        sync(device)
        t0 = {clock: fn() for clock, fn in CLOCKS.items()}
        token = c.step(token, i)
        sync(device)
        for clock, fn in CLOCKS.items():
            times[clock].append((fn() - t0[clock]) * 1e3)
    return {clock: statistics.median(t) for clock, t in times.items()}


def probe(device) -> dict:
    """The GEMV, copy and GEMM probe by each clock (CPU time only means something on a CPU)."""
    return {clock: probe_bandwidth(device, repeats=5, clock=fn) for clock, fn in CLOCKS.items()
            if clock == "wall" or device.type == "cpu"}


@torch.inference_mode()
def compare(batch: int, prompt_len: int, num_kv_heads: int, contenders: list[str], gen_len: int, rounds: int,
            bucket: int, dtype, device) -> list[dict]:
    hf = hf_model(SMALL, num_kv_heads, dtype, device)
    ours = kvbench_model(hf, SMALL, num_kv_heads, dtype, device)
    prompt = torch.randint(0, SMALL.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(device)
    load_before = os.getloadavg()[0]
    made, compile_s = [], {}
    for name in contenders:
        if name == "hf":
            made.append(transformers_contender(hf, prompt, gen_len, device))
        elif name == "eager":
            made.append(kvbench_contender("kvbench eager", ours, prompt, gen_len, decode_step))
        elif name == "graph":
            c = kvbench_contender("kvbench graph", ours, prompt, gen_len, FixedShapeStep(bucket, "graph", device))
            t0 = time.perf_counter()
            time_round(c, gen_len, device)  # compiles every bucket the steps read, untimed
            compile_s[c.name] = time.perf_counter() - t0
            made.append(c)
    tokens = {}
    for c in made:  # warm-up; the same greedy tokens from every contender, or the comparison is void
        c.reset()
        token, seq = c.first, []
        for i in range(gen_len):
            token = c.step(token, i)
            seq.append(token)
        tokens[c.name] = torch.cat(seq, 1)
    probes = []
    for r in range(rounds):
        probes.append(probe(device))
        for c in made if r % 2 == 0 else made[::-1]:
            c.rounds.append(time_round(c, gen_len, device))
    probes.append(probe(device))
    load_after = os.getloadavg()[0]
    rows = []
    for c in made:
        total, kv = decode_bytes_read(ours, batch, c.kv_positions)
        row = dict(impl=c.name, batch=batch, prompt_len=prompt_len, num_kv_heads=num_kv_heads,
                   variant=attention_type(SMALL.num_heads, num_kv_heads), kv_positions=c.kv_positions,
                   bytes_read=total, kv_bytes_read=kv, compile_s=compile_s.get(c.name),
                   same_tokens=bool(torch.equal(tokens[c.name], tokens[made[0].name])),
                   load_before=load_before, load_after=load_after, clocks={})
        for clock in probes[0]:
            ms = statistics.median(r[clock] for r in c.rounds)
            gemv = [p[clock]["gemv_gb_per_s"] for p in probes]
            flops_rate = statistics.median(p[clock]["matmul_gflops"] for p in probes)
            roofline_ms = total / (statistics.median(gemv) * 1e9) * 1e3
            hf = made[0] if made[0].name.startswith("transformers") else None
            row["clocks"][clock] = dict(
                ms=ms, spread_ms=[min(r[clock] for r in c.rounds), max(r[clock] for r in c.rounds)],
                rounds_ms=[r[clock] for r in c.rounds],
                speedup_vs_hf=statistics.median(r[clock] for r in hf.rounds) / ms if hf else None,
                gemv_gb_per_s=statistics.median(gemv), gemv_range=[min(gemv), max(gemv)],
                copy_gb_per_s=statistics.median(p[clock]["copy_gb_per_s"] for p in probes),
                matmul_gflops=flops_rate, roofline_ms=roofline_ms, x_roofline=ms / roofline_ms,
                compute_ms=decode_flops(ours, batch, c.kv_positions) / (flops_rate * 1e9) * 1e3)
        rows.append(row)
    return rows


def table(rows, clock: str) -> str:
    lines = ["| B | prompt | variant | implementation | ms/step (range over rounds) | vs transformers | "
             "roofline ms | x roofline | GEMV GB/s (range) | copy GB/s | FLOP bound ms | same tokens | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["clocks"].get(clock)
        if t is None:
            continue
        vs = f"{t['speedup_vs_hf']:.2f}x" if t["speedup_vs_hf"] else "-"
        lines.append(
            f"| {r['batch']} | {r['prompt_len']} | {r['variant']} ({r['num_kv_heads']}) | {r['impl']} | "
            f"{t['ms']:.2f} ({t['spread_ms'][0]:.2f}-{t['spread_ms'][1]:.2f}) | {vs} | {t['roofline_ms']:.2f} | "
            f"**{t['x_roofline']:.2f}** | {t['gemv_gb_per_s']:.1f} ({t['gemv_range'][0]:.1f}-{t['gemv_range'][1]:.1f}) "
            f"| {t['copy_gb_per_s']:.1f} | {t['compute_ms']:.2f} | {'yes' if r['same_tokens'] else 'NO'} | "
            f"{r['load_before']:.1f}-{r['load_after']:.1f} |")
    return "\n".join(lines)


def variant_table(rows, clock: str) -> str:
    """GQA/MQA vs MHA: the measured time ratio next to the bytes-read ratio, per implementation."""
    lines = ["| B | prompt | implementation | variant | ms/step | time / MHA | bytes read / MHA | difference | "
             "KV share of bytes |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mha = [m for m in rows if (m["batch"], m["prompt_len"], m["impl"]) == (r["batch"], r["prompt_len"], r["impl"])
               and m["variant"] == "mha"]
        if not mha or r["variant"] == "mha" or clock not in r["clocks"]:
            continue
        ms = r["clocks"][clock]["ms"]
        t, b = ms / mha[0]["clocks"][clock]["ms"], r["bytes_read"] / mha[0]["bytes_read"]
        lines.append(f"| {r['batch']} | {r['prompt_len']} | {r['impl']} | {r['variant']} ({r['num_kv_heads']}) | "
                     f"{ms:.2f} | {t:.2f} | {b:.2f} | {t - b:+.2f} | {r['kv_bytes_read'] / r['bytes_read']:.0%} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=list_of(batch_x_prompt), default="1x512,8x1024,8x2048", help="BATCHxPROMPT list")
    p.add_argument("--kv-heads", type=list_of(positive_int), default="16,4,1",
                   help="MHA, GQA, MQA for the small model's 16 heads")
    p.add_argument("--contenders", type=list_of(choice(("hf", "eager", "graph"))), default="hf,eager,graph",
                   help="hf (transformers), eager, graph")
    p.add_argument("--gen-len", type=positive_int, default=32)
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--bucket", type=positive_int, default=256, help="runtime.graph_bucket of the graph contender")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", type=torch_device, default="cuda" if torch.cuda.is_available() else "cpu")
    # The committed results change only on purpose: --out experiments/results/compare_transformers
    p.add_argument("--out", type=out_path,
                   default=str(Path(__file__).parents[1] / "outputs" / "experiments" / "compare_transformers"),
                   help="report path without suffix (.md and .json are written)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    contenders = args.contenders.split(",")
    rows, start = [], time.perf_counter()
    for shape in args.shapes.split(","):
        batch, prompt_len = map(int, shape.split("x"))
        for kv in map(int, args.kv_heads.split(",")):
            rows += compare(batch, prompt_len, kv, contenders, args.gen_len, args.rounds, args.bucket, dtype, device)
            for clock in rows[-1]["clocks"]:
                print_report(f"{clock}\n\n" + table(rows[-len(contenders):], clock), keys=4)
    command = "python experiments/compare_transformers.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v is not None)
    header = (f"# kvbench vs transformers decode and the roofline, model small, {args.dtype} on {device} "
              f"({torch.get_num_threads()} torch threads), torch {torch.__version__}\n\n"
              f"Reproduce: `{command}` ({(time.perf_counter() - start) / 60:.0f} min). "
              f"{args.rounds} rounds of {args.gen_len} steps per contender, interleaved; roofline = bytes read per "
              "step / the GEMV rate probed between the rounds (median; its range beside it), step and probe "
              "timed by the same clock. FLOP bound = FLOP per step / the 1024^3 GEMM rate probed with it. "
              "load = the 1-minute load average before and after the (shape, variant).\n\n")
    out = Path(args.out)
    text = header
    for clock, title in (("cpu", "CPU time (time.process_time)"), ("wall", "Wall clock (time.perf_counter)")):
        if clock in rows[0]["clocks"]:
            text += (f"## {title}\n\n" + table(rows, clock) + "\n\n" + variant_table(rows, clock) + "\n\n")
    write_report(out.with_suffix(".md"), text, keys=4, data=dict(command=command, rows=rows))


if __name__ == "__main__":
    run_main(main)
