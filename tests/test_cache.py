"""Cache storage and bookkeeping against the KV-bytes formula and the seed's arithmetic."""

import pytest
import torch
from conftest import make_decoder
from kv_formula import kv_cache_bytes

from kvbench.cache import Positions
from kvbench.cache import make_cache as make_cache_of
from kvbench.kv_store import dequantize, quantize
from kvbench.layouts.base import Layouts
from kvbench.layouts.kv_heads import KVHeads
from kvbench.shared_prefix import SharedPrefixCache


def make_cache(impl, num_layers, batch_size, num_kv_heads, head_dim, max_seq_len, dtype=torch.float32,
               cache_dtype="auto", windows=None):
    """A cache for ``num_layers`` KV-head layers of ``num_kv_heads`` x ``head_dim``."""
    layers = Layouts(KVHeads(w, num_kv_heads, num_kv_heads, head_dim) for w in windows or [None] * num_layers)
    return make_cache_of(impl, layers, batch_size, max_seq_len, dtype, "cpu", cache_dtype)


def update(cache, layer, start, k, v):
    """One layer's update at positions start.. as the decoder's forward makes it (the positions
    count as held once the last layer has written); (keys, values) to attend over."""
    pos = Positions(start, k.shape[2])
    layers = cache.begin(pos, k.shape[0])
    att = layers[layer].update(k, v, pos)
    if layer == len(layers) - 1:
        cache.commit(pos)
    return att.k, att.v


def test_seed_numbers():
    # 32 heads x head_dim 128, K and V: elements per token per layer
    per_token = kv_cache_bytes(1, 32, 128, 1, 1, 1)
    assert per_token == 8192
    assert kv_cache_bytes(1, 32, 128, 4096, 1, 1) == 33_554_432  # ~33.5 M
    assert kv_cache_bytes(1, 32, 128, 4096, 64, 1) == 2_147_483_648  # ~2.15 G
    # GQA with 8 KV heads holds a quarter of MHA's cache, MQA 1/32
    assert kv_cache_bytes(32, 8, 128, 4096, 1, 2) * 4 == kv_cache_bytes(32, 32, 128, 4096, 1, 2)
    assert kv_cache_bytes(32, 1, 128, 4096, 1, 2) * 32 == kv_cache_bytes(32, 32, 128, 4096, 1, 2)


@pytest.mark.parametrize("dtype, size", [(torch.float32, 4), (torch.float16, 2), (torch.bfloat16, 2)])
@pytest.mark.parametrize("kv", [8, 2, 1])
def test_static_bytes_equal_formula(dtype, size, kv):
    cache = make_cache("static", num_layers=3, batch_size=5, num_kv_heads=kv, head_dim=16,
                       max_seq_len=40, dtype=dtype)
    assert cache.nbytes == 2 * 3 * kv * 16 * 40 * 5 * size
    assert cache.nbytes == kv_cache_bytes(3, kv, 16, 40, 5, size)


def test_concat_grows_and_none_holds_nothing():
    model = make_decoder(2)
    for impl, expect in (("concat", True), ("none", False)):
        cache = make_cache(impl, 2, 3, 2, 8, 32)
        k = torch.randn(3, 2, 10, 8)
        for layer in range(2):
            update(cache, layer, 0, k, k)
        held = kv_cache_bytes(2, 2, 8, 10, 3, 4) if expect else 0
        assert cache.nbytes == held
    del model


def test_static_decode_step_allocates_nothing():
    """Decode writes in place: the storage pointers of the cache never change."""
    cache = make_cache("static", 1, 2, 2, 8, 16)
    keys = cache.layers[0].stores[0].codes
    ptr = keys.data_ptr()
    update(cache, 0, 0, torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8))
    k, v = update(cache, 0, 4, torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
    assert k.shape == (2, 2, 5, 8) and k.data_ptr() == ptr and cache.layers[0].stores[0].codes.data_ptr() == ptr


@pytest.mark.parametrize("impl", ["static", "concat"])
def test_overflow_raises(impl):
    cache = make_cache(impl, 1, 1, 1, 4, 8)
    update(cache, 0, 0, torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4))
    with pytest.raises(ValueError, match="overflow.*max_seq_len=8"):
        update(cache, 0, 6, torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4))


def test_batch_larger_than_cache_raises():
    cache = make_cache("static", 1, 2, 1, 4, 8)
    with pytest.raises(ValueError, match="batch of 3 .* batch_size=2"):
        update(cache, 0, 0, torch.randn(3, 1, 1, 4), torch.randn(3, 1, 1, 4))


def test_unknown_impl_names_the_key():
    with pytest.raises(ValueError, match="cache.impl='paged'"):
        make_cache("paged", 1, 1, 1, 4, 8)


@pytest.mark.parametrize("impl", ["static", "concat"])
def test_truncate_then_rewrite(impl):
    cache = make_cache(impl, 1, 1, 1, 2, 8)
    a, b = torch.randn(1, 1, 5, 2), torch.randn(1, 1, 2, 2)
    update(cache, 0, 0, a, a)
    cache.truncate(3)
    k, _ = update(cache, 0, 3, b, b)
    assert torch.equal(k, torch.cat([a[:, :, :3], b], dim=2)) and cache.length == 5


@pytest.mark.parametrize("impl", ["static", "concat"])
def test_a_refused_truncate_leaves_every_layer_as_it_was(impl):
    """A recurrent layer after a K/V layer refuses a roll back: the K/V layer keeps its tail too (a
    concatenating cache dropped it before the state refused), so the next step equals a recompute."""
    model = make_decoder(2, num_heads=4, preset_kv_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                         preset_layer_types=["full_attention", "linear_attention"])
    ids = torch.randint(model.config.vocab_size, (1, 9))
    cache = make_cache_of(impl, model.layouts, 1, 9)
    with torch.no_grad():
        model(ids[:, :8], cache, 0)
        with pytest.raises(ValueError, match=r"^cannot truncate to 7: a recurrent state folds positions 0\.\.7"):
            cache.truncate(7)
        assert cache.length == 8
        torch.testing.assert_close(model(ids[:, 8:], cache, 8)[:, -1], model(ids)[:, -1], atol=1e-5, rtol=0)


def test_fixed_window_writes_at_a_tensor_position_and_reads_its_bucket():
    """A fixed-shape step's view: it writes the position given as a tensor, reads the first
    multiple of the bucket that holds it (capped at max_seq_len) and masks the positions after."""
    cache = make_cache("static", 2, 3, 2, 4, 20)
    update(cache, 0, 0, torch.randn(3, 2, 11, 4), torch.randn(3, 2, 11, 4))
    update(cache, 1, 0, torch.randn(3, 2, 11, 4), torch.randn(3, 2, 11, 4))
    fixed = cache.fixed(11, 3, bucket=8)
    assert fixed.length == 16 and cache.length == 12  # the position counts as held
    k, v = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)
    pos = Positions.of(torch.tensor([11]))
    att = fixed.begin(pos, 3)[1].update(k, v, pos)
    stored_k, stored_v = (s.codes for s in cache.layers[1].stores)
    assert att.k.shape == (3, 2, 16, 4) and att.k.data_ptr() == stored_k.data_ptr()  # a view, no copy
    assert torch.equal(stored_k[:, :, 11:12], k) and torch.equal(stored_v[:, :, 11:12], v)
    assert att.mask.tolist() == [[j <= 11 for j in range(16)]]
    assert cache.fixed(12, 3, bucket=8) is fixed  # one object per bucket: the compiled step sees the same
    assert [cache.fixed(p, 3, bucket=8).length for p in (13, 14, 15, 16)] == [16, 16, 16, 20]  # 24 > max_seq_len
    with pytest.raises(ValueError, match="all 3 sequences"):
        cache.fixed(17, 2, bucket=8)
    with pytest.raises(ValueError, match="gap"):
        cache.fixed(19, 3, bucket=8)
    for impl in ("concat", "none"):
        with pytest.raises(ValueError, match=f"cache.impl='{impl}' has no fixed-shape view"):
            make_cache(impl, 1, 1, 1, 4, 8).fixed(0, 1, bucket=8)


def test_fixed_window_over_a_shared_prefix_reads_prefix_then_history():
    """Under a shared prefix of P positions the window's keys are the prefix, then a bucket of
    history; positions stay absolute, so history position p is written at index p - P."""
    P = 5
    cache = SharedPrefixCache(make_cache("static", 1, 2, 1, 4, 12), P)
    prefix = torch.randn(1, 1, P, 4)
    update(cache, 0, 0, prefix, prefix)
    history = torch.randn(2, 1, 3, 4)
    update(cache, 0, P, history, history)
    with pytest.raises(ValueError, match="after the shared prefix"):
        cache.fixed(P - 1, 2, bucket=4)
    fixed = cache.fixed(P + 3, 2, bucket=4)
    assert fixed.length == 4 and cache.length == P + 4 and cache.history.length == 4
    k = torch.randn(2, 1, 1, 4)
    pos = Positions.of(torch.tensor([P + 3]))
    att = fixed.begin(pos, 2)[0].update(k, k, pos)
    assert att.k.shape == (2, 1, 4, 4) and torch.equal(cache.history.layers[0].stores[0].codes[:, :, 3:4], k)
    assert torch.equal(att.prefix[0], prefix)
    assert att.mask.tolist() == [[j <= P + 3 for j in range(P + 4)]]


# ---- cache.dtype: int8 / float8_e4m3fn codes with a scale per (sequence, head, position) ----

def _kv_with_outliers(shape=(3, 2, 5, 16), seed=0):
    """Normal values, a channel 20x larger (keys have such channels) and one all-zero vector."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    x[..., 3] *= 20
    x[0, 0, 0] = 0
    return x


def test_int8_round_trip_within_half_a_step():
    x = _kv_with_outliers()
    codes, scale = quantize(x, "int8")
    assert codes.dtype == torch.int8 and scale.shape == x.shape[:-1] + (1,)
    assert codes.abs().max() == 127  # the largest |x| of each vector maps to the largest code
    # Independent bound: rounding to the nearest of 255 levels 'scale' apart errs by <= scale / 2.
    expected = x.abs().amax(-1, keepdim=True) / 127
    torch.testing.assert_close(scale[1:], expected[1:])
    err = (dequantize(codes, scale, torch.float32) - x).abs()
    assert (err <= scale / 2 * (1 + 1e-5)).all()
    assert err.max() > scale.min() / 100  # it does round: not a float copy
    assert torch.equal(dequantize(codes, scale, torch.float32)[0, 0, 0], torch.zeros(16))


def test_float8_round_trip_within_three_mantissa_bits():
    x = _kv_with_outliers()
    codes, scale = quantize(x, "float8_e4m3fn")
    assert codes.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(scale[1:], x.abs().amax(-1, keepdim=True)[1:] / 448)
    err = (dequantize(codes, scale, torch.float32) - x).abs()
    # e4m3: 3 mantissa bits, so half a step is 2**-4 of the value for normal codes; below the
    # smallest normal (2**-6) the step is 2**-9, half of it 2**-10, in units of the scale.
    bound = torch.maximum(x.abs() * 2**-4, scale * 2**-10) * (1 + 1e-5)
    assert (err <= bound).all()


@pytest.mark.parametrize("cache_dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("kv", [8, 2, 1])
def test_quantized_static_bytes_equal_formula(cache_dtype, kv):
    cache = make_cache("static", 3, 5, kv, 16, 40, torch.float32, cache_dtype=cache_dtype)
    # 1-byte codes + a float32 scale per (sequence, head, position), K and V: 2*3*kv*40*5*(16 + 4)
    assert cache.nbytes == sum(t.nbytes for t in cache.tensors()) == 2 * 3 * kv * 40 * 5 * (16 + 4)
    assert cache.nbytes == kv_cache_bytes(3, kv, 16, 40, 5, 4, cache_dtype)
    # the compute dtype does not change what a quantized cache stores
    assert kv_cache_bytes(3, kv, 16, 40, 5, 2, cache_dtype) == kv_cache_bytes(3, kv, 16, 40, 5, 4, cache_dtype)


@pytest.mark.parametrize("cache_dtype", ["int8", "float8_e4m3fn"])
def test_shared_prefix_is_stored_quantized_once(cache_dtype):
    history = make_cache("static", 2, 3, 2, 8, 20, cache_dtype=cache_dtype)
    cache = SharedPrefixCache(history, prefix_len=6)
    once = kv_cache_bytes(2, 2, 8, 6, 1, 4, cache_dtype)  # the prefix, batch 1
    assert cache.nbytes == once + kv_cache_bytes(2, 2, 8, 20, 3, 4, cache_dtype)
    prefix = torch.randn(1, 2, 6, 8)
    k, _ = update(cache, 0, 0, prefix, prefix)
    codes, scale = quantize(prefix, cache_dtype)
    assert torch.equal(k, dequantize(codes, scale, torch.float32))
    assert torch.equal(cache.layers[0].read_prefix()[0], k)


@pytest.mark.parametrize("cache_dtype", ["int8", "float8_e4m3fn"])
def test_quantized_update_returns_what_was_stored(cache_dtype):
    """Quantize on write, dequantize on read: a prefill then a decode step of part of the batch
    read back exactly the dequantized codes of what was written, nothing of other sequences."""
    cache = make_cache("static", 1, 3, 2, 8, 16, cache_dtype=cache_dtype)
    k0, v0 = torch.randn(3, 2, 4, 8), torch.randn(3, 2, 4, 8)
    update(cache, 0, 0, k0, v0)
    k1, v1 = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)
    k, v = update(cache, 0, 4, k1, v1)
    assert k.shape == v.shape == (2, 2, 5, 8) and k.dtype == torch.float32
    expect = lambda x: dequantize(*quantize(x, cache_dtype), torch.float32)
    assert torch.equal(k, torch.cat([expect(k0[:2]), expect(k1)], 2))
    assert torch.equal(v, torch.cat([expect(v0[:2]), expect(v1)], 2))


def test_quantized_cache_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="cache.dtype='int8' needs a preallocated cache.*concat"):
        make_cache("concat", 1, 1, 1, 4, 8, cache_dtype="int8")
    with pytest.raises(ValueError, match="cache.dtype='int4': must be one of auto, int8, float8_e4m3fn"):
        make_cache("static", 1, 1, 1, 4, 8, cache_dtype="int4")
    cache = make_cache("static", 1, 1, 1, 4, 8, cache_dtype="int8")
    with pytest.raises(ValueError, match="cache.dtype='int8' has no fixed-shape view"):
        cache.fixed(0, 1, 4)
