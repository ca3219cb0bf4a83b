"""The checks every recurrent layer kind gets by being one (the seed of issue 54's conformance suite,
parametrised over the kinds instead of a copy per kind): what it refuses, named in one line with the
key and the value; a quantized K/V cache beside it, which leaves its state's bytes as they are."""

import pytest

from kvbench.config.errors import ConfigError
from kvbench.layouts.base import check_limits
from kvbench.layouts.gated_deltanet import GatedDeltaNet
from kvbench.layouts.kda import KDA
from kvbench.layouts.mamba2 import Mamba2

# one small layer of each recurrent kind (heads whose widths fit every 4-bit block)
KINDS = {
    "gated_deltanet": GatedDeltaNet(None, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                                    linear_value_head_dim=32, linear_conv_kernel_dim=4, num_heads=4, head_dim=32),
    "mamba2": Mamba2(None, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4,
                     chunk_size=16, num_heads=4, head_dim=16),
    "kda": KDA(None, linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4, num_heads=4, head_dim=12,
               v_head_dim=8),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("key,value", [("cache.shared", True), ("runtime.compile", "true")])
def test_what_a_recurrent_layer_refuses_names_the_key_the_value_and_the_kind(kind, key, value):
    lay = KINDS[kind]
    with pytest.raises(ConfigError) as info:
        check_limits([lay], {key: value})
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{key}={value!r}: ") and lay.title in message


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache_dtype", ["int8", "float8_e4m3fn", "nvfp4", "mxfp4"])
def test_a_quantized_kv_cache_leaves_the_state_in_its_own_dtype(kind, cache_dtype):
    """cache.dtype applies to the layers that keep K/V: a state layer takes it, nothing stored per
    position, its state's bytes unchanged (the state keeps cache.state_dtype)."""
    lay = KINDS[kind]
    check_limits([lay], {"cache.dtype": cache_dtype})
    assert lay.bytes_per_position(4, cache_dtype) == lay.positions_held(10 ** 6) == 0
    assert lay.state_bytes(4, cache_dtype) == lay.state_bytes(4) > 0
