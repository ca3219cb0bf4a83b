"""Does fusing the projections help a decode step on this machine? One matmul for q/k/v and
one for gate/up (concatenated weights, split after) against today's separate matmuls.

    python experiments/fused_projections.py --threads 1

The fused forward is built here, on a copy of the small model's weights (kvbench keeps the
separate projections unless this shows a gain). Per (batch, prompt, variant): both forms
decode ``--steps`` steps from the end of the same prompt on the same static cache, alternating
ABBA round by round; a form's time is the median over rounds of its round's median step, and
the fused/separate ratio is taken per round (so drift between rounds cancels), then its median
and range are reported, by the wall clock and by CPU time. Both forms give identical logits
(checked). Writes ``--out`` (default ``outputs/experiments/fused_projections.md``; the
committed copy is ``experiments/results/fused_projections.md``).
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import Parser, batch_x_prompt, list_of, out_file, positive_int, progress_row, run_main, write_report

from kvbench.cache import cache_for
from kvbench.config.model import AttentionConfig, ModelConfig, attention_type
from kvbench.layouts.kv_heads_attention import KVHeadsAttention as Attention
from kvbench.layouts.kv_heads_attention import grouped_attention
from kvbench.mlp.dense import MLP
from kvbench.model import Decoder
from kvbench.rope import apply_rope

ROOT = Path(__file__).resolve().parents[1]
# Wall clock, and this process's CPU time, which is not charged while it waits for a core.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
SMALL = ModelConfig(name="small", num_layers=4, d_model=1024, num_heads=16, preset_kv_heads=4, ffn_dim=2816,
                    vocab_size=32000, max_seq_len=4096)


def fused_attention(self, x, cos, sin, cache, pos):
    B, T, _ = x.shape
    H, H_kv, D = self.num_heads, self.num_kv_heads, self.head_dim
    q, k, v = F.linear(x, self.wqkv).split([H * D, H_kv * D, H_kv * D], dim=-1)  # one matmul, then views
    q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
    k = k.view(B, T, H_kv, D).transpose(1, 2)  # (B, H_kv, T, D)
    v = v.view(B, T, H_kv, D).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    att = cache.update(k, v, pos)
    out = grouped_attention(q, att.k, att.v, att.mask, att.prefix)
    return self.wo(out.transpose(1, 2).reshape(B, T, -1))


def fused_mlp(self, x):
    gate, up = F.linear(x, self.w_gate_up).chunk(2, dim=-1)
    return self.w_down(F.silu(gate) * up)


@contextmanager
def fused(on: bool):
    saved = Attention.forward, MLP.forward
    if on:
        Attention.forward, MLP.forward = fused_attention, fused_mlp
    try:
        yield
    finally:
        Attention.forward, MLP.forward = saved


def add_fused_weights(model: Decoder) -> None:
    for block in model.blocks:
        a, m = block.attn, block.mlp
        a.wqkv = torch.cat([a.wq.weight, a.wk.weight, a.wv.weight]).detach()  # (H*D + 2*H_kv*D, C)
        m.w_gate_up = torch.cat([m.w_gate.weight, m.w_up.weight]).detach()  # (2*ffn, C)


@torch.inference_mode()
def measure(batch: int, prompt_len: int, kv: int, steps: int, rounds: int) -> dict:
    torch.manual_seed(0)
    model = Decoder(SMALL, AttentionConfig.for_heads(SMALL.num_heads, kv)).eval()
    add_fused_weights(model)
    prompt = torch.randint(0, SMALL.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(1))
    cache = cache_for(model, "static", batch, prompt_len + steps)
    token = model(prompt, cache, 0, last_only=True)[:, -1].argmax(-1, keepdim=True)
    with fused(True):
        a = model(token, cache, prompt_len)
    b = model(token, cache, prompt_len)
    assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
    load = os.getloadavg()[0]
    times = {(on, clock): [] for on in (True, False) for clock in CLOCKS}
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            with fused(on):
                per_step = {clock: [] for clock in CLOCKS}
                for i in range(steps):
                    t0 = {clock: fn() for clock, fn in CLOCKS.items()}
                    model(token, cache, prompt_len + i)
                    for clock, fn in CLOCKS.items():
                        per_step[clock].append((fn() - t0[clock]) * 1e3)
            for clock in CLOCKS:
                times[on, clock].append(statistics.median(per_step[clock]))
    out = dict(batch=batch, prompt_len=prompt_len, variant=f"{attention_type(SMALL.num_heads, kv)} ({kv})",
               rounds=rounds, load=(load, os.getloadavg()[0]))
    for clock in CLOCKS:
        ratios = [f / s for f, s in zip(times[True, clock], times[False, clock])]
        out[clock] = dict(separate_ms=statistics.median(times[False, clock]),
                          fused_ms=statistics.median(times[True, clock]),
                          ratio=statistics.median(ratios), ratio_range=(min(ratios), max(ratios)))
    return out


def main(argv=None) -> None:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=list_of(batch_x_prompt), default="1x512,8x1024", help="BATCHxPROMPT list")
    p.add_argument("--kv-heads", type=list_of(positive_int), default="16,4,1")
    p.add_argument("--steps", type=positive_int, default=16)
    p.add_argument("--rounds", type=positive_int, default=12)
    p.add_argument("--threads", type=positive_int, default=None)
    p.add_argument("--out", type=out_file, default=ROOT / "outputs" / "experiments" / "fused_projections.md",
                   help="the committed results change only with --out experiments/results/fused_projections.md")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lines = ["| B | prompt | variant | clock | separate ms/step | fused ms/step | fused / separate (median, "
             "range over rounds) | load |", "|---|---|---|---|---|---|---|---|"]
    start = time.perf_counter()
    for shape in args.shapes.split(","):
        batch, prompt_len = map(int, shape.split("x"))
        for kv in map(int, args.kv_heads.split(",")):
            r = measure(batch, prompt_len, kv, args.steps, args.rounds)
            for clock in CLOCKS:
                t = r[clock]
                lines.append(f"| {r['batch']} | {r['prompt_len']} | {r['variant']} | {clock} | "
                             f"{t['separate_ms']:.2f} | {t['fused_ms']:.2f} | {t['ratio']:.3f} "
                             f"({t['ratio_range'][0]:.3f}-{t['ratio_range'][1]:.3f}, {r['rounds']} rounds) | "
                             f"{r['load'][0]:.1f}-{r['load'][1]:.1f} |")
                progress_row(lines)
    command = "python experiments/fused_projections.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v is not None)
    text = (f"# Fused q/k/v and gate/up projections vs separate ones, model small, float32, CPU "
            f"({torch.get_num_threads()} torch threads), torch {torch.__version__}\n\n"
            f"Reproduce: `{command}` ({(time.perf_counter() - start) / 60:.0f} min).\n\n" + "\n".join(lines) + "\n")
    write_report(args.out, text, keys=4)  # B, prompt, variant and clock name a row


if __name__ == "__main__":
    run_main(main)
