"""Cache storage and bookkeeping against the KV-bytes formula and the seed's arithmetic."""

import pytest
import torch
from conftest import make_decoder

from kvbench.cache import SharedPrefixCache, kv_cache_bytes, make_cache


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
            cache.update(layer, 0, k, k)
        held = kv_cache_bytes(2, 2, 8, 10, 3, 4) if expect else 0
        assert cache.nbytes == held
    del model


def test_static_decode_step_allocates_nothing():
    """Decode writes in place: the storage pointers of the cache never change."""
    cache = make_cache("static", 1, 2, 2, 8, 16)
    ptr = cache.k[0].data_ptr()
    cache.update(0, 0, torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8))
    k, v = cache.update(0, 4, torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
    assert k.shape == (2, 2, 5, 8) and k.data_ptr() == ptr and cache.k[0].data_ptr() == ptr


@pytest.mark.parametrize("impl", ["static", "concat"])
def test_overflow_raises(impl):
    cache = make_cache(impl, 1, 1, 1, 4, 8)
    cache.update(0, 0, torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4))
    with pytest.raises(ValueError, match="overflow.*max_seq_len=8"):
        cache.update(0, 6, torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4))


def test_batch_larger_than_cache_raises():
    cache = make_cache("static", 1, 2, 1, 4, 8)
    with pytest.raises(ValueError, match="batch of 3 .* batch_size=2"):
        cache.update(0, 0, torch.randn(3, 1, 1, 4), torch.randn(3, 1, 1, 4))


def test_unknown_impl_names_the_key():
    with pytest.raises(ValueError, match="cache.impl='paged'"):
        make_cache("paged", 1, 1, 1, 4, 8)


@pytest.mark.parametrize("impl", ["static", "concat"])
def test_truncate_then_rewrite(impl):
    cache = make_cache(impl, 1, 1, 1, 2, 8)
    a, b = torch.randn(1, 1, 5, 2), torch.randn(1, 1, 2, 2)
    cache.update(0, 0, a, a)
    cache.truncate(3)
    k, _ = cache.update(0, 3, b, b)
    assert torch.equal(k, torch.cat([a[:, :, :3], b], dim=2)) and cache.length == 5


def test_fixed_window_writes_at_a_tensor_position_and_reads_its_bucket():
    """A fixed-shape step's view: it writes the position given as a tensor, reads the first
    multiple of the bucket that holds it (capped at max_seq_len) and masks the positions after."""
    cache = make_cache("static", 2, 3, 2, 4, 20)
    cache.update(0, 0, torch.randn(3, 2, 11, 4), torch.randn(3, 2, 11, 4))
    cache.update(1, 0, torch.randn(3, 2, 11, 4), torch.randn(3, 2, 11, 4))
    window = cache.window(11, 3, bucket=8)
    assert window.length == 16 and cache.length == 12  # the position counts as held
    k, v = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)
    pos = torch.tensor([11])
    keys, values = window.update(1, pos, k, v)
    assert keys.shape == (3, 2, 16, 4) and keys.data_ptr() == cache.k[1].data_ptr()  # a view, no copy
    assert torch.equal(cache.k[1][:, :, 11:12], k) and torch.equal(cache.v[1][:, :, 11:12], v)
    assert window.mask(pos).tolist() == [[j <= 11 for j in range(16)]]
    assert cache.window(12, 3, bucket=8) is window  # one object per bucket: the compiled step sees the same
    assert [cache.window(p, 3, bucket=8).length for p in (13, 14, 15, 16)] == [16, 16, 16, 20]  # 24 > max_seq_len
    with pytest.raises(ValueError, match="all 3 sequences"):
        cache.window(17, 2, bucket=8)
    with pytest.raises(ValueError, match="gap"):
        cache.window(19, 3, bucket=8)
    for impl in ("concat", "none"):
        with pytest.raises(ValueError, match=f"cache.impl='{impl}' has no fixed-shape window"):
            make_cache(impl, 1, 1, 1, 4, 8).window(0, 1, bucket=8)


def test_fixed_window_over_a_shared_prefix_reads_prefix_then_history():
    """Under a shared prefix of P positions the window's keys are the prefix, then a bucket of
    history; positions stay absolute, so history position p is written at index p - P."""
    P = 5
    cache = SharedPrefixCache(make_cache("static", 1, 2, 1, 4, 12), P)
    prefix = torch.randn(1, 1, P, 4)
    cache.update(0, 0, prefix, prefix)
    history = torch.randn(2, 1, 3, 4)
    cache.update(0, P, history, history)
    with pytest.raises(ValueError, match="after the shared prefix"):
        cache.window(P - 1, 2, bucket=4)
    window = cache.window(P + 3, 2, bucket=4)
    assert window.length == 4 and cache.length == P + 4 and cache.history.length == 4
    k = torch.randn(2, 1, 1, 4)
    pos = torch.tensor([P + 3])
    keys, _ = window.update(0, pos, k, k)
    assert keys.shape == (2, 1, 4, 4) and torch.equal(cache.history.k[0][:, :, 3:4], k)
    assert torch.equal(window.shared_prefix(0, pos)[0], prefix)
    assert window.mask(pos).tolist() == [[j <= P + 3 for j in range(P + 4)]]
