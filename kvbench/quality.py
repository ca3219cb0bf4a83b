"""Quality next to speed: trained perplexity per attention variant, and cache / dtype fidelity.

- Data: text read as bytes (a byte-level tokenizer, vocab 256; nothing to download), by default
  the Python standard library's own ``*.py`` sources in a fixed (hashed) order. The last
  ``data.val_fraction`` of the byte stream is validation, so the split never moves.
- ``evaluate``: validation loss, perplexity = exp(mean cross-entropy per token) and bits per
  byte = mean cross-entropy / ln 2 / (bytes per token).
- ``train``: AdamW, linear warm-up then cosine decay, gradient clipping; curve points go to a
  callback, never to a logger (the CLI owns the sinks).
- Fidelity: a cached greedy decode against a full recompute of the same tokens, and a
  low-precision model against a float32 copy of the same weights.

Notation: B batch, T sequence length, P prompt length, N decode steps, V vocab.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import sysconfig
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

from kvbench.cache import cache_for
from kvbench.checkpoint import convert_kv_heads, load_checkpoint, load_llama_dir, save_checkpoint
from kvbench.cluster import resolve_device
from kvbench.config import BenchConfig, ConfigError, DataConfig, TrainConfig
from kvbench.model import Decoder
from kvbench.scenarios import greedy_generate

BYTE_VOCAB = 256
CHECKPOINT_NAME = "checkpoint.pt"
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}

OnLog = Callable[[int, Dict[str, float]], None]


@dataclass
class TokenData:
    """Token ids of the train and validation text, (N,) int64 each."""

    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int = BYTE_VOCAB
    bytes_per_token: float = 1.0  # of the validation text; 1 for the byte tokenizer
    source: str = ""


# ---- data -----------------------------------------------------------------------------------

def default_corpus_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(path: Optional[str]) -> List[Path]:
    """The files of the corpus in a fixed order.

    A directory: every non-hidden file, sorted by relative path (binary files are skipped when
    read). Default: the standard library's ``*.py`` (installed packages excluded), ordered by a
    hash of the relative path: a fixed order in which the ``max_bytes`` cap and the validation
    tail sample the whole library, not its first modules alphabetically (which would put the
    ``encodings/`` codec tables in validation).
    """
    root = Path(path) if path else default_corpus_root()
    if not root.exists():
        raise ConfigError(f"data.path={path!r}: no such file or directory")
    if root.is_file():
        return [root]
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".")]
        found += [Path(folder, f) for f in files
                  if not f.startswith(".") and (path or f.endswith(".py"))]

    def key(p: Path) -> str:
        rel = p.relative_to(root).as_posix()
        return rel if path else hashlib.sha256(rel.encode()).hexdigest()

    return sorted(found, key=key)


def read_corpus(cfg: DataConfig) -> bytes:
    """The corpus as one byte string, files joined in order, cut at ``data.max_bytes``."""
    parts, total = [], 0
    for f in corpus_files(cfg.path):
        blob = f.read_bytes()
        if b"\x00" in blob[:4096]:
            continue  # binary
        parts.append(blob)
        total += len(blob)
        if cfg.max_bytes and total >= cfg.max_bytes:
            break
    text = b"".join(parts)[: cfg.max_bytes or None]
    if not text:
        raise ConfigError(f"data.path={cfg.path!r}: no text found")
    return text


def _split(ids: torch.Tensor, val_fraction: float) -> Tuple[torch.Tensor, torch.Tensor]:
    cut = int(len(ids) * (1 - val_fraction))
    return ids[:cut], ids[cut:]


def byte_data(cfg: DataConfig) -> TokenData:
    """The corpus as byte ids, the last ``val_fraction`` of the stream held out."""
    text = read_corpus(cfg)
    ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    train, val = _split(ids, cfg.val_fraction)
    return TokenData(train, val, BYTE_VOCAB, 1.0, cfg.path or str(default_corpus_root()))


def tokenized_data(cfg: DataConfig, tokenizer) -> TokenData:
    """The corpus through a ``tokenizers.Tokenizer``; the split is on characters."""
    text = read_corpus(cfg).decode("utf-8", errors="replace")
    cut = int(len(text) * (1 - cfg.val_fraction))

    def encode(s: str) -> torch.Tensor:
        return torch.tensor(tokenizer.encode(s, add_special_tokens=False).ids, dtype=torch.long)

    train, val = encode(text[:cut]), encode(text[cut:])
    return TokenData(train, val, tokenizer.get_vocab_size(),
                     len(text[cut:].encode("utf-8")) / max(len(val), 1),
                     cfg.path or str(default_corpus_root()))


def batches(tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0,
            device: torch.device | str = "cpu") -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Endless random windows: (inputs, next-token targets), each (B, T), from a seeded generator."""
    _need(tokens, seq_len, "train")
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=gen)
        chunk = tokens[starts[:, None] + offsets].to(device)  # (B, T + 1)
        yield chunk[:, :-1], chunk[:, 1:]


def eval_windows(num_tokens: int, seq_len: int, count: int) -> torch.Tensor:
    """Start offsets of ``count`` windows spread evenly over the split: every model sees the same."""
    last = num_tokens - seq_len - 1
    return torch.linspace(0, last, count).round().long().unique()


def _need(tokens: torch.Tensor, seq_len: int, split: str) -> None:
    if len(tokens) <= seq_len:
        raise ConfigError(f"train.seq_len={seq_len}: the {split} split has only {len(tokens)} tokens "
                          "(use more data or a shorter train.seq_len / other data.val_fraction)")


# ---- evaluation and training ----------------------------------------------------------------

@torch.no_grad()
def evaluate(model: Decoder, data: TokenData, seq_len: int, batches: int, batch_size: int
             ) -> Dict[str, float]:
    """Mean next-token cross-entropy over fixed validation windows, as loss, perplexity, bits/byte."""
    _need(data.val, seq_len, "validation")
    was_training = model.training
    model.eval()
    device = model.lm_head.weight.device
    starts = eval_windows(len(data.val), seq_len, batches * batch_size)
    offsets = torch.arange(seq_len + 1)
    nll, count = 0.0, 0
    for chunk_starts in starts.split(batch_size):
        chunk = data.val[chunk_starts[:, None] + offsets].to(device)  # (B, T + 1)
        logits = model(chunk[:, :-1]).float()  # (B, T, V)
        nll += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
        count += chunk[:, 1:].numel()
    model.train(was_training)
    loss = nll / count
    return {"val_loss": loss, "perplexity": math.exp(loss),
            "bits_per_byte": loss / math.log(2) / data.bytes_per_token}


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` at ``steps``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _progress_bar(enabled: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeRemainingColumn(), console=Console(stderr=True), disable=not enabled,
                    transient=False)


def train(model: Decoder, cfg: TrainConfig, data: TokenData, on_log: Optional[OnLog] = None,
          progress: bool = True, seed: int = 0, autocast_dtype: Optional[torch.dtype] = None) -> dict:
    """Train ``model`` in place for ``cfg.steps`` steps; returns final metrics and the curve.

    ``on_log(step, metrics)`` gets ``train_loss`` and ``lr`` every ``log_every`` steps, plus
    ``val_loss`` / ``perplexity`` / ``bits_per_byte`` every ``eval_every`` steps and at the end.
    Evaluation time is excluded from ``train_seconds``.
    """
    device = model.lm_head.weight.device
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices; norms are not decayed
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    stream = batches(data.train, cfg.batch_size, cfg.seq_len, seed, device)
    curve: List[dict] = []
    last: Dict[str, float] = {}
    running: List[float] = []
    eval_seconds, start = 0.0, time.perf_counter()
    model.train()
    with _progress_bar(progress) as bar:
        task = bar.add_task("train", total=cfg.steps)
        for step in range(1, cfg.steps + 1):
            x, y = next(stream)
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
            is_eval = step % cfg.eval_every == 0 or step == cfg.steps
            if step % cfg.log_every == 0 or is_eval:
                point = {"train_loss": sum(running) / len(running), "lr": lr}
                running = []
                if is_eval:
                    t0 = time.perf_counter()
                    point.update(evaluate(model, data, cfg.seq_len, cfg.eval_batches, cfg.batch_size))
                    eval_seconds += time.perf_counter() - t0
                last.update(point)
                curve.append({"step": step, **point})
                if on_log:
                    on_log(step, point)
            bar.update(task, advance=1, description=f"train loss {last.get('train_loss', loss.item()):.3f}"
                       + (f" val {last['val_loss']:.3f}" if "val_loss" in last else ""))
    seconds = time.perf_counter() - start - eval_seconds
    return {**last, "train_seconds": seconds, "steps": cfg.steps,
            "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len, "curve": curve}


# ---- fidelity -------------------------------------------------------------------------------

def _compare(logits: torch.Tensor, reference: torch.Tensor) -> Tuple[float, float]:
    """Max |difference| and the fraction of positions with the same argmax."""
    diff = (logits.float() - reference.float()).abs().max().item()
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    return diff, agree


@torch.inference_mode()
def cache_fidelity(model: Decoder, prompt: torch.Tensor, gen_len: int, impl: str = "static"
                   ) -> Dict[str, float]:
    """A cached greedy decode against one uncached forward pass over the same tokens.

    The full pass over prompt + generated tokens (B, P + N) gives, at positions P - 1 .. P + N - 1,
    the logits that chose each of the N + 1 generated tokens; they are compared with the logits
    the cached decode used.
    """
    B, P = prompt.shape
    gen = greedy_generate(model, prompt, gen_len, cache_for(model, impl, B, P + gen_len),
                          keep_logits=True)  # tokens (B, N + 1), logits (B, N + 1, V)
    seq = torch.cat([prompt, gen.tokens[:, :-1]], dim=1)  # (B, P + N)
    full = model(seq)[:, P - 1:]  # (B, N + 1, V)
    diff, agree = _compare(gen.logits, full)
    return {"fidelity_max_abs_logit_diff": diff, "fidelity_top1_agreement": agree}


def float32_copy(model: Decoder) -> Decoder:
    """The same weights, upcast to float32: the reference for a low-precision run."""
    return copy.deepcopy(model).float()


@torch.inference_mode()
def dtype_fidelity(model_lowp: Decoder, model_fp32: Optional[Decoder], prompt: torch.Tensor,
                   gen_len: int) -> Dict[str, float]:
    """A float16/bfloat16 model against float32 with the same weights, teacher-forced.

    The low-precision model decodes greedily (static cache); both models then score that same
    sequence in one pass each and their logits at the generated positions are compared.
    """
    model_fp32 = model_fp32 or float32_copy(model_lowp)
    B, P = prompt.shape
    gen = greedy_generate(model_lowp, prompt, gen_len, cache_for(model_lowp, "static", B, P + gen_len))
    seq = torch.cat([prompt, gen.tokens[:, :-1]], dim=1)  # (B, P + N)
    diff, agree = _compare(model_lowp(seq)[:, P - 1:], model_fp32(seq)[:, P - 1:])
    return {"dtype_max_abs_logit_diff": diff, "dtype_top1_agreement": agree}


# ---- task entries (called by the CLI) -------------------------------------------------------

def num_params(model: Decoder) -> int:
    return sum(p.numel() for p in model.parameters())


def _eval_metrics(model: Decoder, data: TokenData, cfg: TrainConfig) -> Dict[str, float]:
    return evaluate(model, data, cfg.seq_len, cfg.eval_batches, cfg.batch_size)


def run_train(cfg: BenchConfig, out_dir: Path, on_log: Optional[OnLog] = None,
              progress: bool = True) -> Dict[str, float]:
    """``task=train``: build (or load and convert) the decoder, train, evaluate, save the checkpoint.

    Metrics come back flat; ``out_dir/checkpoint.pt`` also holds them and the loss curve.
    With ``train.init_from`` the checkpoint's shape is kept, its KV heads are mean-pooled to
    ``attention.num_kv_heads`` and its perplexity before uptraining is reported as
    ``ppl_before_uptrain``; ``train.steps=0`` then evaluates the conversion alone.
    """
    device = resolve_device(cfg.runtime.device)
    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    torch.manual_seed(cfg.runtime.seed)
    data = byte_data(cfg.data)
    metrics: Dict[str, float] = {}
    if cfg.train.init_from:
        base = load_checkpoint(cfg.train.init_from, device)
        if base.config.num_heads != cfg.model.num_heads:
            raise ConfigError(f"train.init_from={cfg.train.init_from!r}: the checkpoint has "
                              f"{base.config.num_heads} query heads, model.num_heads is "
                              f"{cfg.model.num_heads} (pick the model preset it was trained with)")
        if base.config.vocab_size != BYTE_VOCAB:
            raise ConfigError(f"train.init_from={cfg.train.init_from!r}: vocab_size "
                              f"{base.config.vocab_size} is not the byte vocabulary ({BYTE_VOCAB})")
        model = convert_kv_heads(base, cfg.attention.num_kv_heads).float()
        before = _eval_metrics(model, data, cfg.train)
        metrics.update(init_num_kv_heads=base.num_kv_heads, ppl_before_uptrain=before["perplexity"],
                       val_loss_before_uptrain=before["val_loss"],
                       bits_per_byte_before_uptrain=before["bits_per_byte"])
        del base
    else:
        model = Decoder(replace(cfg.model, vocab_size=BYTE_VOCAB), cfg.attention).to(device)
    if cfg.train.seq_len > model.config.max_seq_len:
        raise ConfigError(f"train.seq_len={cfg.train.seq_len}: longer than model.max_seq_len="
                          f"{model.config.max_seq_len}")
    autocast = None if cfg.runtime.dtype == "float32" else getattr(torch, cfg.runtime.dtype)
    result = {}
    if cfg.train.steps:
        result = train(model, cfg.train, data, on_log, progress, cfg.runtime.seed, autocast)
    else:
        result = {**_eval_metrics(model, data, cfg.train), "train_seconds": 0.0, "tokens_seen": 0,
                  "steps": 0, "curve": []}
    curve = result.pop("curve")
    metrics.update({k: v for k, v in result.items() if k != "lr"})
    metrics.update(num_params=num_params(model), num_kv_heads=model.num_kv_heads,
                   corpus_bytes=len(data.train) + len(data.val))
    save_checkpoint(Path(out_dir) / CHECKPOINT_NAME, model,
                    {"metrics": metrics, "curve": curve, "data_source": data.source})
    return metrics


def load_for_eval(source: str, dtype: str = "float32", device: torch.device | str = "cpu"):
    """A kvbench checkpoint file or a Llama-format directory: (Decoder, tokenizer or None)."""
    path = Path(source)
    if path.is_dir():
        return load_llama_dir(path, dtype, device)
    return load_checkpoint(path, device).to(getattr(torch, dtype)), None


def run_eval(cfg: BenchConfig, out_dir: Path) -> Dict[str, float]:
    """``task=eval``: perplexity of ``train.checkpoint`` on ``data`` (its tokenizer if it has one).

    ``out_dir`` is accepted for symmetry with :func:`run_train`; nothing is written there.
    """
    if not cfg.train.checkpoint:
        raise ConfigError("train.checkpoint=None: task=eval needs a kvbench checkpoint file or a "
                          "Llama-format directory")
    device = resolve_device(cfg.runtime.device)
    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    model, tokenizer = load_for_eval(cfg.train.checkpoint, cfg.runtime.dtype, device)
    if tokenizer is not None:
        data = tokenized_data(cfg.data, tokenizer)
    else:
        if model.config.vocab_size < BYTE_VOCAB:
            raise ConfigError(f"train.checkpoint={cfg.train.checkpoint!r}: no tokenizer.json and a "
                              f"vocabulary of {model.config.vocab_size} < {BYTE_VOCAB} bytes")
        data = byte_data(cfg.data)
    seq_len = min(cfg.train.seq_len, model.config.max_seq_len)
    start = time.perf_counter()
    metrics = evaluate(model, data, seq_len, cfg.train.eval_batches, cfg.train.batch_size)
    return {**metrics, "eval_seconds": time.perf_counter() - start, "num_params": num_params(model),
            "num_kv_heads": model.num_kv_heads, "eval_tokens_per_window": seq_len,
            "bytes_per_token": data.bytes_per_token}
