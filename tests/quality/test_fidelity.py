"""Fidelity of what was timed: cached decode vs a full recompute, a quantized cache vs the
unquantized one, and half precision vs a float32 copy."""

import math

import pytest
import torch
from conftest import TEXT, byte_decoder, make_decoder

from kvbench.checkpoint import convert_kv_heads
from kvbench.config.train import TrainConfig
from kvbench.quality.data import TokenData
from kvbench.quality.fidelity import cache_fidelity, dtype_fidelity, float32_copy, quantized_cache_fidelity
from kvbench.quality.train import train


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


# The stated tolerance of an int8 KV cache against the float32 one on the trained byte decoders
# below: every logit within 0.02 (they span ~9; measured: 0.0025 MHA/GQA, 0.0018 MQA), the argmax
# the same at >= 99 % of the decode positions (measured: all of them).
INT8_LOGIT_TOL = 0.02


@pytest.fixture(scope="module")
def trained():
    """A GQA-2 byte decoder trained on the test text (20 steps), as MHA (its KV heads repeated: the
    same function), GQA and MQA (mean-pooled): predictions with real margins, as a served model's
    have, not a random init's near-ties."""
    ids = torch.tensor(list(TEXT))
    data = TokenData(train=ids[:2400], val=ids[2400:])
    model = byte_decoder(2)
    train(model, TrainConfig(steps=20, batch_size=8, seq_len=32, lr=1e-2, warmup_steps=3, eval_every=20,
                             eval_batches=1, log_every=20), data)
    model.eval()
    return {kv: model if kv == 2 else convert_kv_heads(model, kv).eval() for kv in (4, 2, 1)}


def _text_prompts(batch=3, length=16):
    ids = torch.tensor(list(TEXT))
    return torch.stack([ids[2400 + 37 * b: 2400 + 37 * b + length] for b in range(batch)])


@pytest.mark.parametrize("kv", [4, 2, 1])  # MHA, GQA, MQA of 4 query heads
def test_int8_cache_matches_the_float32_cache_on_a_trained_model(trained, kv):
    f = quantized_cache_fidelity(trained[kv], _text_prompts(), gen_len=24, cache_dtype="int8")
    assert f["kvq_top1_agreement"] >= 0.99
    assert 0 < f["kvq_max_abs_logit_diff"] < INT8_LOGIT_TOL


def test_kvq_measures_the_storage_precision(trained):
    """Independent facts: float8_e4m3fn keeps 3 mantissa bits where int8 keeps ~7 below each
    vector's maximum, so it must drift further; the unquantized cache against itself is exact;
    and the quantized decode against a full recompute (no cache at all) errs by the same amount,
    since a float32 cache equals the recompute to float noise."""
    model, prompt = trained[2], _text_prompts()
    int8 = quantized_cache_fidelity(model, prompt, 24, "int8")["kvq_max_abs_logit_diff"]
    fp8 = quantized_cache_fidelity(model, prompt, 24, "float8_e4m3fn")["kvq_max_abs_logit_diff"]
    assert fp8 > 2 * int8
    assert quantized_cache_fidelity(model, prompt, 24, "auto")["kvq_max_abs_logit_diff"] < 1e-4
    full = cache_fidelity(model, prompt, 24, cache_dtype="int8")["fidelity_max_abs_logit_diff"]
    assert abs(full - int8) < 1e-4


def test_kv_pool_fidelity_against_an_independent_recompute():
    """Mean-pooling an MHA model's K/V heads to G-sized groups computes what an MHA model computes
    whose K/V projections of each group are replaced by the group's mean (every query head then
    reads its group's mean head): KL and top-1 recomputed from that model with scipy."""
    from scipy.special import rel_entr, softmax

    from kvbench.quality.fidelity import kv_pool_fidelity

    mha = _sharp(make_decoder(8, seed=3))
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    assert kv_pool_fidelity(mha, 8, tokens) == {"kv_pool_kl_nats": 0.0, "kv_pool_top1_agreement": 1.0}
    for kv in (2, 1):
        twin = make_decoder(8, seed=3)
        twin.load_state_dict(mha.state_dict())
        with torch.no_grad():
            for block in twin.blocks:
                for proj in (block.attn.wk, block.attn.wv):
                    w = proj.weight.view(kv, 8 // kv, -1, proj.weight.shape[1])  # (H_kv, G, D, C)
                    proj.weight.copy_(w.mean(dim=1, keepdim=True).expand_as(w).reshape(proj.weight.shape))
            p = softmax(mha(tokens).double().numpy(), axis=-1)
            q = softmax(twin(tokens).double().numpy(), axis=-1)
        got = kv_pool_fidelity(mha, kv, tokens)
        assert got["kv_pool_kl_nats"] == pytest.approx(rel_entr(p, q).sum(-1).mean(), rel=1e-3, abs=1e-6)
        assert got["kv_pool_top1_agreement"] == pytest.approx((p.argmax(-1) == q.argmax(-1)).mean())
        assert got["kv_pool_kl_nats"] > 0


def test_kv_pool_fidelity_of_a_hybrid_scores_the_window_too():
    """A hybrid local/global variant is its head count's pooled model with a window on its local
    layers: the recompute is that model (pooled weights, built with the window), and past W it
    differs from the same heads without the window (before: scored as the heads alone)."""
    from scipy.special import rel_entr, softmax

    from kvbench.checkpoint import build_decoder, convert_kv_heads
    from kvbench.config.model import AttentionConfig
    from kvbench.quality.fidelity import kv_pool_fidelity

    mha = _sharp(make_decoder(8, seed=3))
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    hybrid = AttentionConfig(type="gqa", num_kv_heads=2, window=6, global_every=2)
    twin = build_decoder(mha.config, hybrid, convert_kv_heads(mha, 2).state_dict(), device=mha.device).eval()
    assert [w for w in twin.layouts.windows] == [6, None]  # layer 2 of 2 global
    with torch.no_grad():
        p = softmax(mha(tokens).double().numpy(), axis=-1)
        q = softmax(twin(tokens).double().numpy(), axis=-1)
    got = kv_pool_fidelity(mha, 2, tokens, hybrid)
    assert got["kv_pool_kl_nats"] == pytest.approx(rel_entr(p, q).sum(-1).mean(), rel=1e-3, abs=1e-6)
    assert got["kv_pool_kl_nats"] > kv_pool_fidelity(mha, 2, tokens)["kv_pool_kl_nats"] * 1.01


def test_kv_pool_fidelity_of_a_variant_without_the_models_window_scores_no_window():
    """A variant that leaves the model's own window out (attention.window=0) is scored as itself:
    the recompute is its pooled model built without the window (before: the reference's window was
    kept, and the score was that of the same heads with it)."""
    from scipy.special import rel_entr, softmax

    from kvbench.checkpoint import build_decoder, convert_kv_heads
    from kvbench.config.model import AttentionConfig
    from kvbench.quality.fidelity import kv_pool_fidelity

    mha = _sharp(make_decoder(8, seed=3, preset_window=6, preset_global_every=2))
    assert list(mha.layouts.windows) == [6, None]
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    variant = AttentionConfig(type="gqa", num_kv_heads=2, window=0).resolved(mha.config)
    twin = build_decoder(mha.config, variant, convert_kv_heads(mha, 2).state_dict(), device=mha.device).eval()
    assert list(twin.layouts.windows) == [None, None]
    with torch.no_grad():
        p = softmax(mha(tokens).double().numpy(), axis=-1)
        q = softmax(twin(tokens).double().numpy(), axis=-1)
    got = kv_pool_fidelity(mha, 2, tokens, variant)
    assert got["kv_pool_kl_nats"] == pytest.approx(rel_entr(p, q).sum(-1).mean(), rel=1e-3, abs=1e-6)
    own = AttentionConfig(type="gqa", num_kv_heads=2).resolved(mha.config)  # the model's window: pooling alone
    assert kv_pool_fidelity(mha, 2, tokens, own) == kv_pool_fidelity(mha, 2, tokens)
    assert got["kv_pool_kl_nats"] > kv_pool_fidelity(mha, 2, tokens)["kv_pool_kl_nats"] * 1.01
