"""Quality against KV-cache size: MHA, GQA and MQA trained from scratch, and mean-pool
conversions of the trained MHA checkpoint (Ainslie et al. 2023) with and without uptraining.

    python experiments/quality_tradeoff.py [--steps 1000] [--uptrain-steps 100]

Runs go through kvbench.quality.train.run_train (the code behind ``task=train``) with the default
TrainConfig, model=train_small and the default corpus (the standard library's sources).
Writes the table to ``--out`` (default outputs/experiments/quality_tradeoff.{md,json}; ``--out
experiments/results/quality_tradeoff`` refreshes the committed copy, on purpose only);
checkpoints go under ``--runs`` (default outputs/quality_tradeoff/, git-ignored).
"""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from _common import Parser, natural_int, out_dir, out_path, positive_float, positive_int, run_main, say, write_report
from omegaconf import OmegaConf

from kvbench.checkpoint import read_checkpoint
from kvbench.config.bench import BenchConfig, CacheConfig, RuntimeConfig, WandbConfig
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.config.train import DataConfig, TrainConfig
from kvbench.config.workload import DecodeWorkload
from kvbench.jobs.job_config import check_job
from kvbench.layouts.build import build_layouts
from kvbench.quality.train import CHECKPOINT_NAME, run_train

ROOT = Path(__file__).resolve().parents[1]


def bench_config(model: ModelConfig, num_kv_heads: int, train: TrainConfig, seed: int,
                 threads: int) -> BenchConfig:
    return check_job(BenchConfig(task="train", model=model,
                                 attention=AttentionConfig.for_heads(model.num_heads, num_kv_heads),
                                 workload=DecodeWorkload(prompt_len=64, gen_len=16), cache=CacheConfig(),
                                 runtime=RuntimeConfig(device="cpu", seed=seed, threads=threads),
                                 wandb=WandbConfig(mode="disabled"), data=DataConfig(), train=train))


def run(name: str, cfg: BenchConfig, out_root: Path, reuse: bool) -> dict:
    out = out_root / name
    if reuse and (out / CHECKPOINT_NAME).is_file():
        say(f"{name}: reusing {out / CHECKPOINT_NAME}")
        return {**_row(name, cfg, out, read_checkpoint(out / CHECKPOINT_NAME)["metrics"]), "reused": True}
    say(f"[{time.strftime('%H:%M:%S')}] {name}: kv_heads={cfg.attention.num_kv_heads} "
        f"steps={cfg.train.steps} init_from={cfg.train.init_from}")

    def on_log(step, m):
        if "val_loss" in m:
            say(f"    step {step:5d}  train {m['train_loss']:.4f}  val {m['val_loss']:.4f}  "
                f"ppl {m['perplexity']:.3f}")

    row = _row(name, cfg, out, run_train(cfg, torch.device("cpu"), out, on_log=on_log))
    say(f"    -> ppl {row['perplexity']:.3f}"
        + (f" (before uptraining {row['ppl_before_uptrain']:.3f})" if "ppl_before_uptrain" in row else ""))
    return row


def _row(name: str, cfg: BenchConfig, out: Path, metrics: dict) -> dict:
    m = cfg.model
    return {"run": name, "num_kv_heads": cfg.attention.num_kv_heads,
           "kv_bytes_per_token_fp16": build_layouts(m, cfg.attention).bytes_per_token(2),
           **metrics, "checkpoint": str(out / CHECKPOINT_NAME)}


def main(argv=None) -> None:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=positive_int, default=TrainConfig().steps)
    ap.add_argument("--uptrain-steps", type=natural_int, default=100)
    ap.add_argument("--uptrain-lr", type=positive_float, default=1e-3)
    ap.add_argument("--seed", type=natural_int, default=0)
    # One thread: on a shared 2-core machine two OpenMP threads per process thrash (6x slower).
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--reuse", action="store_true", help="keep runs whose checkpoint.pt exists")
    ap.add_argument("--runs", type=out_dir, default=ROOT / "outputs" / "quality_tradeoff", help="checkpoints")
    ap.add_argument("--out", type=out_path, default=ROOT / "outputs" / "experiments" / "quality_tradeoff",
                    help="report path without suffix (.md and .json are written)")
    args = ap.parse_args(argv)

    model = ModelConfig(**OmegaConf.to_container(OmegaConf.load(ROOT / "conf/model/train_small.yaml")))
    H = model.num_heads
    train = TrainConfig(steps=args.steps)
    uptrain = replace(train, steps=args.uptrain_steps, lr=args.uptrain_lr,
                      warmup_steps=max(1, args.uptrain_steps // 10),
                      eval_every=max(1, args.uptrain_steps))
    start = time.perf_counter()
    rows = []
    for kv in (H, H // 4, 1):  # MHA, GQA (H/4), MQA from scratch
        cfg = bench_config(model, kv, train, args.seed, args.threads)
        rows.append({"how": "from scratch", **run(f"scratch_kv{kv}", cfg, args.runs, args.reuse)})
    mha_ckpt = rows[0]["checkpoint"]
    for kv in (H, H // 2, H // 4, 1):  # kv == H: the identity, uptrained as a control
        cfg = bench_config(model, kv, replace(uptrain, init_from=mha_ckpt), args.seed, args.threads)
        row = run(f"meanpool_kv{kv}_uptrain", cfg, args.runs, args.reuse)
        rows.append({**row, "how": "MHA mean-pool", "perplexity": row["ppl_before_uptrain"],
                     "val_loss": row["val_loss_before_uptrain"],
                     "bits_per_byte": row["bits_per_byte_before_uptrain"],
                     "train_seconds": 0.0, "tokens_seen": 0, "steps": 0})
        rows.append({**row, "how": f"MHA mean-pool + {args.uptrain_steps} steps uptrain"})
    total = time.perf_counter() - start

    header = ("| how | KV heads | KV bytes/token (fp16) | params | val loss | perplexity | bits/byte "
              "| train s |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    lines = [header]
    for r in rows:
        lines.append(f"| {r['how']} | {r['num_kv_heads']} | {r['kv_bytes_per_token_fp16']} | "
                     f"{r['num_params']:,} | {r['val_loss']:.4f} | {r['perplexity']:.4f} | "
                     f"{r['bits_per_byte']:.4f} | {r['train_seconds']:.0f} |")
    table = "\n".join(lines)
    reused = sorted({r["run"] for r in rows if r.get("reused")})
    train_total = sum(r["train_seconds"] for r in rows)
    setup = (f"model=train_small ({model.num_layers} layers, d_model {model.d_model}, {H} heads, "
             f"head_dim {model.head_dim}, ffn {model.ffn_dim}); byte tokenizer; default corpus (Python "
             f"{platform.python_version()} standard library *.py, first {DataConfig().max_bytes:,} bytes, "
             f"last {DataConfig().val_fraction:.0%} validation); {args.steps} steps × "
             f"{train.batch_size}×{train.seq_len} tokens, lr {train.lr}; uptraining {args.uptrain_steps} "
             f"steps at lr {args.uptrain_lr}; seed {args.seed}; torch {torch.__version__}, "
             f"{args.threads} CPU thread(s) per run on a shared 2-core machine (other jobs running, so "
             f"seconds are indicative only); training time summed over runs {train_total / 60:.1f} min, "
             f"this invocation {total / 60:.1f} min."
             + (f" Reused from an earlier invocation (train s as measured then): {', '.join(reused)}."
                if reused else ""))
    text = (
        "# Quality vs KV-cache size (MHA / GQA / MQA, mean-pool conversion)\n\n"
        + setup + "\n\nPerplexity is per byte on the validation split, the same fixed windows for "
        "every row. 'MHA mean-pool' rows convert the trained MHA checkpoint with no further training; "
        "the kv=8 uptrain row is the control (MHA trained for the same extra steps).\n\n" + table + "\n")
    payload = {"setup": setup, "args": {k: str(v) for k, v in vars(args).items()},
               "model": asdict(model), "train": asdict(train), "uptrain": asdict(uptrain),
               "total_seconds": total, "rows": rows}
    write_report(args.out.with_suffix(".md"), text, keys=2, data=payload)  # how and KV heads name a row


if __name__ == "__main__":
    sys.exit(run_main(main))
