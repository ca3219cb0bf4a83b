"""Cache storage and bookkeeping against the KV-bytes formula and the seed's arithmetic."""

import pytest
import torch
from conftest import make_decoder

from kvbench.cache import kv_cache_bytes, make_cache


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
