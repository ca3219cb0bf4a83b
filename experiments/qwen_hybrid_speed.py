"""A Qwen3.5 hybrid's prefill and decode step in kvbench against transformers' own implementation
of the same checkpoint, interleaved in one run.

One random ``Qwen3_5ForCausalLM`` (scaled down from Qwen3.5-9B's proportions: 3 Gated DeltaNet
layers to 1 gated full-attention layer, partial rotary, zero-centred norms) is saved with
``save_pretrained`` and loaded by kvbench from that directory (``load_llama_dir``), so the two
contenders run the same weights in float32 on ``--threads`` threads: transformers with its
``DynamicCache`` (its torch path for the delta rule and the short convolution: no
flash-linear-attention on a CPU, SDPA for the full layers), kvbench with its static cache. A round
times, for each contender in an order that alternates round by round (AB, BA, ...), one prefill of
``--prompt`` tokens (last-token logits only, as generate() asks) and then ``--steps`` greedy decode
steps after it; a round's decode figure is the median of its steps. The ratios kvbench /
transformers are printed of the medians over rounds with a 95% paired-bootstrap interval over
rounds (``kvbench.measure.stats.paired_ratio``: the headline), of the minima (which drop the rounds
another job interrupted) and as the median of the per-round ratios. Below 1: kvbench faster.

    python experiments/qwen_hybrid_speed.py --threads 1 --out experiments/results/qwen_hybrid_speed.md
"""

from __future__ import annotations

import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import torch
from _common import Parser, out_file, positive_int, run_main, write_report

from kvbench.cache import cache_for
from kvbench.checkpoint import load_llama_dir
from kvbench.generate import decode_step, prefill
from kvbench.measure import stats

ROOT = Path(__file__).resolve().parents[1]


def hf_model(d_model: int, layers: int, vocab: int, positions: int):
    """A random Qwen3.5 text model in Qwen3.5-9B's proportions at width ``d_model`` (9B: 4096):
    heads of 256 -> d_model / 16, 4 query heads per KV head, linear key heads of 128 -> d_model / 32
    with twice as many value heads, intermediate 3 x d_model."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    head, linear = d_model // 16, d_model // 32
    config = Qwen3_5TextConfig(hidden_size=d_model, num_hidden_layers=layers, num_attention_heads=16,
                               num_key_value_heads=4, head_dim=head, intermediate_size=3 * d_model, vocab_size=vocab,
                               max_position_embeddings=positions, linear_num_key_heads=16, linear_num_value_heads=32,
                               linear_key_head_dim=linear, linear_value_head_dim=linear)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(config).eval()


class Transformers:
    name = "transformers"

    def __init__(self, hf, prompt):
        self.hf, self.prompt = hf, prompt

    def prefill(self) -> torch.Tensor:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.hf.config)
        out = self.hf(input_ids=self.prompt, cache=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        out = self.hf(input_ids=token, cache=self.cache, use_cache=True)
        return out.logits[:, -1].argmax(-1, keepdim=True)


class Kvbench:
    name = "kvbench"

    def __init__(self, model, prompt, steps: int):
        self.model, self.prompt = model, prompt
        self.cache = cache_for(model, "static", prompt.shape[0], prompt.shape[1] + steps)

    def prefill(self) -> torch.Tensor:
        self.position = self.prompt.shape[1]
        return prefill(self.model, self.prompt, self.cache).argmax(-1, keepdim=True)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        logits = decode_step(self.model, token, self.cache, self.position)
        self.position += 1
        return logits.argmax(-1, keepdim=True)


def time_round(contender, steps: int):
    """(prefill s, median step s, tokens) of one prefill and ``steps`` greedy steps."""
    t0 = time.perf_counter()
    token = contender.prefill()
    prefill_s = time.perf_counter() - t0
    times, tokens = [], [token]
    for _ in range(steps):
        t0 = time.perf_counter()
        token = contender.step(token)
        times.append(time.perf_counter() - t0)
        tokens.append(token)
    return prefill_s, statistics.median(times), torch.cat(tokens, 1)


def main(argv: Optional[List[str]] = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=positive_int, default=1024)
    parser.add_argument("--layers", type=positive_int, default=8)
    parser.add_argument("--vocab", type=positive_int, default=32000)
    parser.add_argument("--prompt", type=positive_int, default=512)
    parser.add_argument("--steps", type=positive_int, default=16)
    parser.add_argument("--rounds", type=positive_int, default=12)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--out", type=out_file, default=ROOT / "outputs" / "experiments" / "qwen_hybrid_speed.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)  # the fast-path packages are not installed
    load = os.getloadavg()[0]
    hf = hf_model(args.d_model, args.layers, args.vocab, args.prompt + args.steps + 1)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        model, _ = load_llama_dir(tmp, torch.float32, "cpu", max_seq_len=args.prompt + args.steps + 1)
    model.eval()
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    contenders = [Kvbench(model, prompt, args.steps), Transformers(hf, prompt)]
    runs = {c.name: [] for c in contenders}
    with torch.inference_mode():
        for c in contenders:
            time_round(c, 2)  # warm-up
        for r in range(args.rounds):
            for c in contenders if r % 2 == 0 else contenders[::-1]:
                runs[c.name].append(time_round(c, args.steps))
    same = all(torch.equal(a[2], b[2]) for a, b in zip(runs["kvbench"], runs["transformers"]))
    lines = [f"# Qwen3.5 hybrid: kvbench vs transformers on the same checkpoint ({args.layers} layers, "
             f"d_model={args.d_model}, float32, {args.threads} thread(s), {args.rounds} interleaved rounds)", "",
             f"`python experiments/qwen_hybrid_speed.py --threads {args.threads} --rounds {args.rounds} "
             f"--prompt {args.prompt} --steps {args.steps}`; torch {torch.__version__}, transformers "
             f"{_version('transformers')}, {platform.processor() or platform.machine()}, load average {load:.1f} at "
             f"the start on {os.cpu_count()} cores", "",
             f"Layers: {', '.join(type(x).__name__ for x in model.layouts)}; full layers "
             f"{model.layouts[3].num_heads} query / {model.layouts[3].num_kv_heads} KV heads of "
             f"{model.layouts[3].head_dim} (rotary over {model.layouts[3].rotary_dim}, output gate); linear layers "
             f"{model.layouts[0].linear_num_key_heads} key / {model.layouts[0].linear_num_value_heads} value heads of "
             f"{model.layouts[0].linear_key_head_dim}. Greedy tokens of the two equal in every round: {same}.", "",
             "| figure | kvbench ms (median) | transformers ms (median) | kvbench / transformers (medians, "
             "95% paired-bootstrap interval over rounds) | (minima) | (median of per-round ratios) |",
             "|---|---:|---:|---:|---:|---:|"]
    verdicts = []
    for i, what in ((0, f"prefill of {args.prompt} tokens"), (1, f"decode step (median of {args.steps})")):
        ours, theirs = ([run[i] for run in runs[name]] for name in ("kvbench", "transformers"))
        ratio, low, high = stats.paired_ratio(theirs, ours)  # median(ours) / median(theirs)
        interval = "" if low is None else f" ({low:.3f}-{high:.3f})"
        per_round = statistics.median(a / b for a, b in zip(ours, theirs))
        lines.append(f"| {what} | {statistics.median(ours) * 1e3:.2f} | {statistics.median(theirs) * 1e3:.2f} | "
                     f"{ratio:.3f}{interval} | {min(ours) / min(theirs):.3f} | {per_round:.3f} |")
        verdict = ("no interval (too few rounds)" if low is None else "kvbench faster" if high < 1
                   else "kvbench slower" if low > 1 else "no difference resolved: the interval holds 1")
        verdicts.append(f"{what}: kvbench takes {ratio:.3f}x transformers' time, {verdict}")
    lines += ["", "; ".join(verdicts) + "."]
    write_report(args.out, "\n".join(lines) + "\n")
    return 0


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    sys.exit(run_main(main))
