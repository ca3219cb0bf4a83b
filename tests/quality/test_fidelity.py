"""Fidelity of what was timed: cached decode vs a full recompute, and half precision vs a float32 copy."""

import math

import torch
from conftest import byte_decoder

from kvbench.quality.fidelity import cache_fidelity, dtype_fidelity, float32_copy


def test_cache_fidelity_float32_is_exact():
    model = byte_decoder(2).eval()
    prompt = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    for impl in ("static", "concat"):
        f = cache_fidelity(model, prompt, gen_len=10, impl=impl)
        assert f["fidelity_max_abs_logit_diff"] < 1e-4
        assert f["fidelity_top1_agreement"] == 1.0


def _sharp(model):
    """Scale the LM head so the argmax is decided by real margins, not float noise of a flat init."""
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    return model


def test_bfloat16_fidelity_is_nonzero_but_bounded():
    model = _sharp(byte_decoder(2)).eval()
    prompt = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    low = float32_copy(model).to(torch.bfloat16)
    # Cached vs recomputed in bfloat16: both round alike, so it may be exact; it must stay small.
    cached = cache_fidelity(low, prompt, gen_len=10)
    assert cached["fidelity_max_abs_logit_diff"] < 1.0
    assert cached["fidelity_top1_agreement"] > 0.5
    d = dtype_fidelity(low, None, prompt, gen_len=10)  # reference: the same weights in float32
    assert 0 < d["dtype_max_abs_logit_diff"] < 1.0
    assert d["dtype_top1_agreement"] > 0.5
    # The default reference is the float32 copy of the same weights, nothing else.
    assert dtype_fidelity(low, float32_copy(low), prompt, gen_len=10) == d


def test_dtype_fidelity_measures_rounding_and_sees_other_weights():
    """Against independent facts rather than the function itself: bfloat16 keeps 8 mantissa
    bits to float16's 11, so it drifts further from float32 on the same weights; and a
    reference with other weights is reported as a large difference, not as agreement."""
    model = _sharp(byte_decoder(2)).eval()
    prompt = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    drift = {dtype: dtype_fidelity(float32_copy(model).to(dtype), model, prompt, gen_len=10)["dtype_max_abs_logit_diff"]
             for dtype in (torch.float16, torch.bfloat16)}
    assert 0 < drift[torch.float16] < drift[torch.bfloat16] / 2
    other = _sharp(byte_decoder(2, seed=1)).eval()
    unrelated = dtype_fidelity(float32_copy(model).to(torch.bfloat16), other, prompt, gen_len=10)
    assert unrelated["dtype_max_abs_logit_diff"] > 10 * drift[torch.bfloat16]
    assert unrelated["dtype_top1_agreement"] < 0.5


def test_nan_logits_never_agree():
    """A model whose logits are NaN agrees with nothing, not even itself (argmax of a NaN row is
    the first NaN's index on both sides, which once read as 100 % agreement)."""
    model = byte_decoder(2).eval()
    with torch.no_grad():
        model.lm_head.weight[3].fill_(float("nan"))  # token 3's logit is NaN at every position
    prompt = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    f = cache_fidelity(model, prompt, gen_len=6)
    assert f["fidelity_top1_agreement"] == 0.0 and math.isnan(f["fidelity_max_abs_logit_diff"])
    d = dtype_fidelity(model, model, prompt, gen_len=6)
    assert d["dtype_top1_agreement"] == 0.0
