"""Is what was timed right? A cached greedy decode against a full recompute of the same tokens,
a quantized cache against the unquantized one, and a low-precision model against a float32 copy
of the same weights.

Notation: B batch, P prompt length, N decode steps, V vocab.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from kvbench.cache import Cache, cache_for
from kvbench.checkpoint import convert_kv_heads, with_layer_pattern
from kvbench.config.model import AttentionConfig
from kvbench.generate import decode_step, greedy_generate
from kvbench.layouts.attention import decode_form
from kvbench.metrics import Metric, metric_table, record_methods
from kvbench.model import Decoder

# Units and methods of the metrics below (merged into a decode record's ``methods``).
FIDELITY_METRICS: Dict[str, Metric] = metric_table(
    Metric("fidelity_max_abs_logit_diff", "logits",
           "max |cached decode logits - one full forward over the same tokens|, "
                                   "on up to 2 sequences and 16 steps after timing"),
    Metric("fidelity_top1_agreement", "fraction", "positions where the cached decode and the full forward agree on "
                               "the argmax, same tokens (with a quantized cache.dtype this includes the "
                               "quantization; kvq_* isolates it; a half-precision cache.state_dtype, its rounding)"),
    Metric("kvq_max_abs_logit_diff", "logits",
           "a quantized cache.dtype (int8, float8_e4m3fn, nvfp4, mxfp4, nvfp4_rotated): max |logits of the "
                              "greedy decode through the quantized cache - logits of the same tokens through a "
                              "cache.dtype=auto static cache| "
                              "(prefill, then the generated tokens teacher-forced), up to 2 sequences and 16 steps"),
    Metric("kvq_top1_agreement", "fraction",
           "a quantized cache.dtype: decode positions (prefill's last included) where "
                          "the quantized and the unquantized cache agree on the argmax, same tokens"),
    Metric("mla_forms_max_abs_logit_diff", "logits",
           "attention=mla: max |logits of the greedy decode in the absorbed form - logits of the same tokens "
           "decoded step by step in the expanded form (K/V up-projected per head)|, static cache, up to 2 "
           "sequences and 16 steps; the two forms are the same function, so this is rounding"),
    Metric("mla_forms_top1_agreement", "fraction",
           "attention=mla: decode positions where the absorbed and the expanded form agree on the argmax, "
           "same tokens"),
    Metric("dtype_max_abs_logit_diff", "logits",
           "float16/bfloat16 runs: max |logits - a float32 copy of the same weights|, "
                                "teacher-forced on the low-precision run's greedy tokens"),
    Metric("dtype_top1_agreement", "fraction", "float16/bfloat16 runs: positions where the low-precision model and its "
                            "float32 copy agree on the argmax"),
)
FIDELITY_METHODS: Dict[str, str] = record_methods(FIDELITY_METRICS)


# Units and methods of what :func:`kv_pool_fidelity` measures (task=capacity records them).
KV_POOL_METRICS: Dict[str, Metric] = metric_table(
    Metric("kv_pool_kl_nats", "nats per position", "quality of this KV-head count: the MHA model of the same weights "
                       "(runtime.seed, or model.path brought to MHA by exact repetition) with its K/V projections "
                       "mean-pooled to attention.num_kv_heads (checkpoint.convert_kv_heads, Ainslie et al. 2023), "
                       "mean over positions of KL(MHA || pooled) of the next-token distributions; one forward pass "
                       "each over 2 sequences of runtime.seed random tokens (the longest context searched, at most "
                       "256); the pooled model has the variant's layer pattern (checkpoint.with_layer_pattern: the "
                       "same weights, masked, so a hybrid is scored as itself); 0 for MHA. Randomly "
                       "initialised heads are uncorrelated, so pooling them loses more "
                       "than pooling a trained model's"),
    Metric("kv_pool_top1_agreement", "fraction",
           "positions of the same passes where the mean-pooled model and MHA agree "
                              "on the argmax (1 for MHA)"),
)
KV_POOL_METHODS: Dict[str, str] = record_methods(KV_POOL_METRICS)


def _compare(logits: torch.Tensor, reference: torch.Tensor) -> Tuple[float, float]:
    """Max |difference| (NaN when either holds a NaN) and the fraction of positions with the same
    argmax. A position where either side is not finite never agrees: argmax picks the first
    NaN's index on both sides alike, which would count two broken models as agreeing."""
    diff = (logits.float() - reference.float()).abs().max().item()
    finite = torch.isfinite(logits).all(-1) & torch.isfinite(reference).all(-1)
    agree = ((logits.argmax(-1) == reference.argmax(-1)) & finite).float().mean().item()
    return diff, agree


@torch.inference_mode()
def cache_fidelity(model: Decoder, prompt: torch.Tensor, gen_len: int, impl: str = "static",
                   step=decode_step, cache: Optional[Cache] = None, rows: Optional[int] = None,
                   cache_dtype: str = "auto") -> Dict[str, float]:
    """A cached greedy decode against one uncached forward pass over the same tokens.

    The full pass over prompt + generated tokens (B, P + N) gives, at positions P - 1 .. P + N - 1,
    the logits that chose each of the N + 1 generated tokens; they are compared with the logits
    the cached decode used. ``step`` and ``cache`` decode (default: :func:`decode_step` on a new
    cache); ``rows``: compare only the first sequences (the full pass is the costly part).
    """
    B, P = prompt.shape
    if cache is None:
        cache = cache_for(model, impl, B, P + gen_len, cache_dtype)
    cache.reset()
    gen = greedy_generate(model, prompt, gen_len, cache, keep_logits=True, step=step)  # tokens (B, N + 1)
    seq = torch.cat([prompt, gen.tokens[:, :-1]], dim=1)[:rows]  # (rows, P + N)
    full = model(seq)[:, P - 1:]  # (rows, N + 1, V)
    diff, agree = _compare(gen.logits[:rows], full)
    return {"fidelity_max_abs_logit_diff": diff, "fidelity_top1_agreement": agree}


@torch.inference_mode()
def quantized_cache_fidelity(model: Decoder, prompt: torch.Tensor, gen_len: int, cache_dtype: str
                             ) -> Dict[str, float]:
    """A greedy decode through a static cache stored in ``cache_dtype`` against the same tokens
    through a static cache in the compute dtype (``auto``): the prompt is prefilled, then the
    quantized run's tokens are fed in one chunk, so both score the same sequence and the only
    difference is how K/V were stored."""
    B, P = prompt.shape
    gen = greedy_generate(model, prompt, gen_len, cache_for(model, "static", B, P + gen_len, cache_dtype),
                          keep_logits=True)  # logits (B, N + 1, V)
    reference = cache_for(model, "static", B, P + gen_len)
    first = model(prompt, reference, 0, last_only=True)  # (B, 1, V): chose token 0
    rest = model(gen.tokens[:, :-1], reference, P)  # (B, N, V): chose tokens 1..N
    diff, agree = _compare(gen.logits, torch.cat([first, rest], dim=1))
    return {"kvq_max_abs_logit_diff": diff, "kvq_top1_agreement": agree}


@torch.inference_mode()
def form_fidelity(model: Decoder, prompt: torch.Tensor, gen_len: int, forms: Tuple[str, str]) -> Dict[str, float]:
    """A decode step's two forms of the same arithmetic against each other (MLA's absorbed and
    expanded): the first decodes greedily, the second then steps through the same tokens one at a time."""
    B, P = prompt.shape
    with decode_form(model, forms[0]):
        gen = greedy_generate(model, prompt, gen_len, cache_for(model, "static", B, P + gen_len), keep_logits=True)
    with decode_form(model, forms[1]):
        cache = cache_for(model, "static", B, P + gen_len)
        logits = [model(prompt, cache, 0, last_only=True)]  # (B, 1, V): chose token 0
        logits += [model(gen.tokens[:, i:i + 1], cache, P + i) for i in range(gen_len)]
    diff, agree = _compare(gen.logits, torch.cat(logits, dim=1))
    return {"mla_forms_max_abs_logit_diff": diff, "mla_forms_top1_agreement": agree}


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


def fidelity(model: Decoder, prompt: torch.Tensor, gen_len: int, impl: str, dtype: str,
             step=decode_step, cache: Optional[Cache] = None, cache_dtype: str = "auto") -> Dict[str, Any]:
    """Quality of what was timed, on up to 2 sequences and 16 steps (cheap next to the trials):
    cached decode vs a full recompute, for a quantized cache (``cache_dtype``) vs the unquantized
    one, and for half precision vs float32 with the same weights.

    ``step`` and ``cache``: the timed step and its cache, when a new cache for 2 sequences would
    not run the timed code (a compiled fixed-shape step has its cache's shapes): every sequence
    then decodes, and the first 2 are checked."""
    steps = min(gen_len, 16)
    if cache is None:
        out = cache_fidelity(model, prompt[:2], steps, impl, cache_dtype=cache_dtype)
    else:
        out = cache_fidelity(model, prompt, steps, impl, step, cache, rows=2)
    if cache_dtype != "auto":
        out.update(quantized_cache_fidelity(model, prompt[:2], steps, cache_dtype))
    forms = model.layouts.decode_forms()
    if forms:  # two forms of the same step: they must agree
        out.update(form_fidelity(model, prompt[:2], steps, forms))
    if dtype != "float32":
        out.update(dtype_fidelity(model, None, prompt[:2], steps))
    return out


@torch.inference_mode()
def kv_pool_fidelity(reference: Decoder, num_kv_heads: int, tokens: torch.Tensor,
                     attention: Optional[AttentionConfig] = None, pooled: Optional[Decoder] = None) -> Dict[str, float]:
    """How far mean-pooling ``reference``'s K/V heads to ``num_kv_heads`` moves its outputs on
    ``tokens`` (B, T): KL(reference || pooled) per position, mean, and top-1 agreement. The pooled
    model has the layer pattern of ``attention`` (the variant, resolved; None: the reference's), only a
    mask on the same weights (``pooled``: that model, built already); a pattern pooling cannot make (a
    recurrent layer) is the caller's to refuse (:mod:`kvbench.tasks.capacity_quality`)."""
    if pooled is None:
        pooled = with_layer_pattern(convert_kv_heads(reference, num_kv_heads), attention or reference.attention)
    pooled = pooled.eval()
    log_p = F.log_softmax(reference(tokens).float(), dim=-1)  # (B, T, V)
    log_q = F.log_softmax(pooled(tokens).float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    _, agree = _compare(log_q, log_p)
    return {"kv_pool_kl_nats": kl, "kv_pool_top1_agreement": agree}
