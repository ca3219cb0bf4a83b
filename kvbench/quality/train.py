"""Quality next to speed: train the decoder, and measure its perplexity (``task=train``, ``task=eval``).

- ``evaluate``: validation loss, perplexity = exp(mean cross-entropy per token) and bits per
  byte = mean cross-entropy / ln 2 / (bytes per token).
- ``train``: AdamW, linear warm-up then cosine decay, gradient clipping; curve points go to a
  callback and progress to another, never to a logger or a screen (the CLI owns those).

Notation: B batch, T sequence length, V vocab.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

from kvbench.cache import cache_for
from kvbench.checkpoint import load_checkpoint, load_llama_dir, save_checkpoint, to_layout
from kvbench.config.bench import BenchConfig
from kvbench.config.train import TrainConfig
from kvbench.core.errors import ConfigError
from kvbench.layouts.build import build_layouts
from kvbench.metrics import Metric, metric_table, record_methods
from kvbench.model import Decoder, torch_dtype
from kvbench.quality.data import BYTE_VOCAB, TokenData, batches, byte_data, eval_starts, need_tokens, tokenized_data
from kvbench.results import CHECKPOINT_NAME  # the job directory's file names live with the record

_MAX_EXP = math.log(sys.float_info.max)  # math.exp raises OverflowError above this
# What makes two decoders the same shape (the name and the preset's KV-head count do not).
_SHAPE_KEYS = ("num_layers", "d_model", "num_heads", "head_dim", "ffn_dim", "max_seq_len", "rope_theta",
               "rope_type", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
               "rope_original_max_seq_len", "norm_eps", "qkv_bias", "qk_norm", "o_bias", "mlp_bias", "moe")

_QUALITY_METRICS: Dict[str, Metric] = metric_table(
    Metric("val_loss", "nats/token", "mean next-token cross-entropy over train.eval_batches x train.batch_size fixed "
                "validation sequences of train.seq_len tokens (the same sequences for every run on the same data)"),
    Metric("perplexity", "ratio", "exp(val_loss)"),
    Metric("bits_per_byte", "bits/byte", "val_loss / ln 2 / bytes per token (1 for the byte vocabulary)"),
    Metric("num_params", "count", "parameters of the decoder evaluated, tied tensors once"),
    Metric("num_kv_heads", "count", "KV heads of the decoder evaluated (= attention.num_kv_heads)"),
    Metric("kv_heads_conversion", "text", "none | repeat | mean-pool: how the checkpoint's KV heads were brought to "
                           "attention.num_kv_heads (repeat is exact; mean-pool averages each group, "
                           "Ainslie et al. 2023)"),
)
# Units and methods of what task=train records (merged into the record's ``methods``).
TRAIN_METRICS: Dict[str, Metric] = metric_table(
    *_QUALITY_METRICS.values(),
    Metric("train_loss", "nats/token", "mean training cross-entropy over the last train.log_every steps"),
    Metric("train_seconds", "s", "wall time of the training steps, evaluation excluded"),
    Metric("steps", "count", "optimizer steps taken (train.steps)"),
    Metric("tokens_seen", "tokens",
           "input tokens of all training steps (steps x train.batch_size x train.seq_len for text)"),
    Metric("corpus_bytes", "bytes", "training + validation text read (data.max_bytes caps it)"),
    Metric("init_num_kv_heads", "count", "KV heads of the train.init_from checkpoint before conversion"),
    Metric("ppl_before_uptrain", "ratio",
           "perplexity of the converted train.init_from checkpoint before any training step"),
    Metric("val_loss_before_uptrain", "nats/token", "val_loss of the converted checkpoint before any training step"),
    Metric("bits_per_byte_before_uptrain", "bits/byte",
           "bits_per_byte of the converted checkpoint before any training step"),
    Metric("series.train_step", "", "step number of each logged point"),
    Metric("series.train_loss", "nats/token", "train_loss at each logged step"),
    Metric("tables.curve", "", "one row per logged step: step, train_loss, lr and, every train.eval_every steps, "
                    "val_loss, perplexity, bits_per_byte"),
)
TRAIN_METHODS: Dict[str, str] = record_methods(TRAIN_METRICS)
# Units and methods of what task=eval records.
EVAL_METRICS: Dict[str, Metric] = metric_table(
    *_QUALITY_METRICS.values(),
    Metric("eval_seconds", "s", "wall time of the evaluation"),
    Metric("eval_seq_len", "tokens", "tokens per validation sequence (train.seq_len capped at model.max_seq_len)"),
    Metric("bytes_per_token", "bytes/token", "text bytes per token of the validation split (1 for bytes; more with a "
                       "tokenizer.json)"),
    Metric("checkpoint_num_kv_heads", "count", "KV heads of train.checkpoint as saved, before conversion"),
    Metric("val_loss", _QUALITY_METRICS["val_loss"].unit,
           _QUALITY_METRICS["val_loss"].method + "; with a quantized cache.dtype (the record's config) "
                "each batch of "
                "sequences is written into a static cache of that dtype and every position attends to the dequantized "
                "K/V (quantized per position, so one pass scores what a token-by-token decode through that cache "
                "would); auto: one causal forward, no cache"),
)
EVAL_METHODS: Dict[str, str] = record_methods(EVAL_METRICS)

OnLog = Callable[[int, Dict[str, float]], None]
# Called once per training step; ``description`` is a short status ("train loss 2.31 val 2.40").
Tick = Callable[..., None]


@torch.no_grad()
def evaluate(model: Decoder, data: TokenData, seq_len: int, batches: int, batch_size: int,
             cache_dtype: str = "auto") -> Dict[str, float]:
    """Mean next-token cross-entropy over fixed validation slices, as loss, perplexity, bits/byte;
    with a quantized ``cache_dtype`` (int8, float8_e4m3fn, 4-bit), through a static cache that stores K/V so."""
    per_sequence = sequence_nll(model, data, seq_len, batches, batch_size, cache_dtype)
    loss = per_sequence.sum().item() / (per_sequence.numel() * seq_len)
    return {"val_loss": loss, "perplexity": math.inf if loss > _MAX_EXP else math.exp(loss),
            "bits_per_byte": loss / math.log(2) / data.bytes_per_token}


@torch.no_grad()
def sequence_nll(model: Decoder, data: TokenData, seq_len: int, batches: int, batch_size: int,
                 cache_dtype: str = "auto") -> torch.Tensor:
    """The summed next-token cross-entropy of each fixed validation slice :func:`evaluate` scores
    (float64, one per slice, in order): what a paired comparison of two caches on the same text needs."""
    need_tokens(data.val, seq_len, "validation")
    was_training = model.training
    model.eval()
    starts = eval_starts(len(data.val), seq_len, batches * batch_size)
    offsets = torch.arange(seq_len + 1)
    out = []
    for chunk_starts in starts.split(batch_size):
        chunk = data.val[chunk_starts[:, None] + offsets].to(model.device)  # (B, T + 1)
        cache = None if cache_dtype == "auto" else cache_for(model, "static", len(chunk), seq_len, cache_dtype)
        logits = model(chunk[:, :-1], cache).float()  # (B, T, V)
        nll = F.cross_entropy(logits.transpose(1, 2), chunk[:, 1:], reduction="none")  # (B, T)
        out.append(nll.double().sum(1).cpu())
    model.train(was_training)
    return torch.cat(out)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` at ``steps``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def train(model: Decoder, cfg: TrainConfig, data: Optional[TokenData], on_log: Optional[OnLog] = None,
          tick: Optional[Tick] = None, seed: int = 0, autocast_dtype: Optional[torch.dtype] = None,
          stream: Optional[Iterator[Tuple[torch.Tensor, torch.Tensor]]] = None,
          evaluate_fn: Optional[Callable[[Decoder], Dict[str, float]]] = None) -> dict:
    """Train ``model`` in place for ``cfg.steps`` steps; returns final metrics and the curve.

    ``on_log(step, metrics)`` gets ``train_loss`` and ``lr`` every ``log_every`` steps, plus
    ``val_loss`` / ``perplexity`` / ``bits_per_byte`` every ``eval_every`` steps and at the end.
    ``tick(description=...)`` is called after every step. Evaluation time is excluded from
    ``train_seconds``.

    Other data (the recall tasks): ``stream`` yields (inputs, targets), each (B, T), targets
    -100 where no loss is taken, in place of slices of ``data.train``; ``evaluate_fn(model)``
    replaces the perplexity evaluation (``data`` may then be None).
    """
    device = model.device
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices; norms are not decayed
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    if stream is None:
        stream = batches(data.train, cfg.batch_size, cfg.seq_len, seed, device)
    if evaluate_fn is None:
        def evaluate_fn(m: Decoder) -> Dict[str, float]:
            return evaluate(m, data, cfg.seq_len, cfg.eval_batches, cfg.batch_size)
    curve: List[dict] = []
    last: Dict[str, float] = {}
    running: List[float] = []
    eval_seconds, start, tokens = 0.0, time.perf_counter(), 0
    model.train()
    for step in range(1, cfg.steps + 1):
        x, y = next(stream)
        tokens += x.numel()
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(x)  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        running.append(loss.item())
        if not math.isfinite(running[-1]):  # every later step would be NaN too: stop and say so
            raise FloatingPointError(f"train loss is {running[-1]} at step {step} (train.lr={cfg.lr}, "
                                     f"runtime dtype {autocast_dtype or 'float32'}): training diverged")
        is_eval = step % cfg.eval_every == 0 or step == cfg.steps
        if step % cfg.log_every == 0 or is_eval:
            point = {"train_loss": sum(running) / len(running), "lr": lr}
            running = []
            if is_eval:
                t0 = time.perf_counter()
                point.update(evaluate_fn(model))
                eval_seconds += time.perf_counter() - t0
            last.update(point)
            curve.append({"step": step, **point})
            if on_log:
                on_log(step, point)
        if tick is not None:
            tick(description=f"train loss {last.get('train_loss', loss.item()):.3f}"
                 + (f" val {last['val_loss']:.3f}" if "val_loss" in last else ""))
    seconds = time.perf_counter() - start - eval_seconds
    return {**last, "train_seconds": seconds, "steps": cfg.steps, "tokens_seen": tokens, "curve": curve}


def run_train(cfg: BenchConfig, device: torch.device, out_dir: Path, on_log: Optional[OnLog] = None,
              tick: Optional[Tick] = None) -> Dict[str, float]:
    """``task=train``: build (or load and convert) the decoder, train, evaluate, save the checkpoint.

    Metrics come back flat; ``out_dir/checkpoint.pt`` also holds them and the loss curve.
    With ``train.init_from`` the checkpoint's shape is kept, its KV heads are mean-pooled to
    ``attention.num_kv_heads`` and its perplexity before uptraining is reported as
    ``ppl_before_uptrain``; ``train.steps=0`` then evaluates the conversion alone.
    """
    torch.manual_seed(cfg.runtime.seed)
    data = byte_data(cfg.data)
    metrics: Dict[str, float] = {}
    if cfg.train.init_from:
        base = load_checkpoint(cfg.train.init_from, device)
        if base.config.vocab_size != BYTE_VOCAB:
            raise ConfigError(f"train.init_from={cfg.train.init_from!r}: vocab_size "
                              f"{base.config.vocab_size} is not the byte vocabulary ({BYTE_VOCAB})")
        # The record names model=<preset>: the checkpoint must have that shape, or the record
        # would describe a model that was never trained.
        for key in _SHAPE_KEYS:
            if getattr(base.config, key) != getattr(cfg.model, key):
                raise ConfigError(f"train.init_from={cfg.train.init_from!r}: the checkpoint has model.{key}="
                                  f"{getattr(base.config, key)}, model={cfg.model.name} has "
                                  f"{getattr(cfg.model, key)} (pick the model preset it was trained with)")
        model, how = to_layout(base, cfg.attention)
        model = model.float()
        t = cfg.train
        before = evaluate(model, data, t.seq_len, t.eval_batches, t.batch_size)
        metrics.update(init_num_kv_heads=base.num_kv_heads, kv_heads_conversion=how,
                       ppl_before_uptrain=before["perplexity"], val_loss_before_uptrain=before["val_loss"],
                       bits_per_byte_before_uptrain=before["bits_per_byte"])
        del base
    else:
        model = Decoder(replace(cfg.model, vocab_size=BYTE_VOCAB), cfg.attention).to(device)
    autocast = None if cfg.runtime.dtype == "float32" else torch_dtype(cfg.runtime.dtype)
    result = {}
    if cfg.train.steps:
        result = train(model, cfg.train, data, on_log, tick, cfg.runtime.seed, autocast)
    else:
        t = cfg.train
        result = {**evaluate(model, data, t.seq_len, t.eval_batches, t.batch_size),
                  "train_seconds": 0.0, "tokens_seen": 0, "steps": 0, "curve": []}
    curve = result.pop("curve")
    metrics.update({k: v for k, v in result.items() if k != "lr"})
    metrics.update(num_params=model.num_params(), num_kv_heads=model.num_kv_heads,
                   corpus_bytes=len(data.train) + len(data.val))
    save_checkpoint(Path(out_dir) / CHECKPOINT_NAME, model,
                    {"metrics": metrics, "curve": curve, "data_source": data.source})
    return metrics


def load_for_eval(source: str, dtype: str = "float32", device: torch.device | str = "cpu"):
    """A kvbench checkpoint file or a transformers checkpoint directory: (Decoder, tokenizer or None)."""
    path = Path(source)
    if path.is_dir():
        return load_llama_dir(path, dtype, device)
    return load_checkpoint(path, device).to(torch_dtype(dtype)), None


def checkpoint_for_eval(cfg: BenchConfig, device: torch.device) -> Tuple[Decoder, Any, Dict[str, Any]]:
    """``train.checkpoint`` as the decoder ``attention`` asks for: (model, tokenizer or None,
    what was converted).

    The shape is the checkpoint's (``model=`` is ignored: a record must show what was
    evaluated). ``attention`` is resolved against that shape, the checkpoint's own KV-head
    count being its preset (so ``attention=gqa`` keeps a GQA checkpoint as it is); more heads
    than saved repeat them (exact), fewer mean-pool them, anything else is invalid."""
    if not cfg.train.checkpoint:
        raise ConfigError("train.checkpoint=None: task=eval needs a kvbench checkpoint file or a "
                          "transformers checkpoint directory (config.json + *.safetensors)")
    model, tokenizer = load_for_eval(cfg.train.checkpoint, cfg.runtime.dtype, device)
    saved, own = model.num_kv_heads, model.attention
    # the checkpoint's own layout is its model's (a kvbench checkpoint's config is its preset's), so
    # attention=model evaluates the model as it was saved
    model.config = model.config.with_own_layout(own)
    attention = cfg.attention.as_asked().resolved(model.config)
    build_layouts(model.config, attention).check(cfg.layout_settings())  # as check_job does, once the shape is known
    model, how = to_layout(model, attention)  # with attention's layer pattern
    return model.eval(), tokenizer, {"checkpoint_num_kv_heads": saved, "kv_heads_conversion": how}


def run_eval(cfg: BenchConfig, device: torch.device, loaded: Optional[Tuple[Decoder, Any, Dict[str, Any]]] = None
             ) -> Dict[str, Any]:
    """``task=eval``: perplexity of ``train.checkpoint`` on ``data`` (its tokenizer if it has
    one), as :func:`checkpoint_for_eval` loads it (or ``loaded``, what it returned)."""
    model, tokenizer, converted = loaded or checkpoint_for_eval(cfg, device)
    if tokenizer is not None:
        data = tokenized_data(cfg.data, tokenizer)
    else:
        if model.config.vocab_size < BYTE_VOCAB:
            raise ConfigError(f"train.checkpoint={cfg.train.checkpoint!r}: no tokenizer.json and a "
                              f"vocabulary of {model.config.vocab_size} < {BYTE_VOCAB} bytes")
        data = byte_data(cfg.data)
    seq_len = min(cfg.train.seq_len, model.config.max_seq_len)
    start = time.perf_counter()
    metrics = evaluate(model, data, seq_len, cfg.train.eval_batches, cfg.train.batch_size, cfg.cache.dtype)
    return {**metrics, "eval_seconds": time.perf_counter() - start, "num_params": model.num_params(),
            "num_kv_heads": model.num_kv_heads, "eval_seq_len": seq_len,
            "bytes_per_token": data.bytes_per_token, **converted}
