"""Hostile and careless input to Gated DeltaNet hybrids (attention.layer_types' linear_attention,
attention.full_attention_interval, the model's linear_* shape, Qwen3.5's partial rotary): each is
one line naming the key and the value, raised from the config before anything is built. In
process, through the config path the CLI composes (tests/conftest.compose)."""

import pytest
from conftest import compose

from kvbench.core.errors import ConfigError
from kvbench.jobs.job_config import to_bench_config

HYBRID = ["model=tiny", "attention.full_attention_interval=2"]
LINEAR_FULL = "[linear_attention,full_attention]"


def refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        to_bench_config(compose(*overrides))
    [line] = str(info.value).splitlines()
    return line


@pytest.mark.parametrize("overrides, line", [
    (["model=tiny", "attention.full_attention_interval=-1"],
     "attention.full_attention_interval=-1: must be >= 0 (0: no linear layer; k: every k-th layer full attention, "
     "the others linear) or null"),
    ([*HYBRID, f"attention.layer_types={LINEAR_FULL}"],
     "attention.full_attention_interval=2: and attention.layer_types both say which layers are linear; give one"),
    ([*HYBRID, "attention.window=16"],
     "attention.full_attention_interval=2: beside a window (attention.window=16): list which layers are sliding, "
     "full and linear in attention.layer_types (or set attention.window=0)"),
    (["model=tiny", "attention.layer_types=[linear_attention,full_attention,full_attention]"],
     "attention.layer_types=['linear_attention', 'full_attention', 'full_attention']: must name each of "
     "model.num_layers=2 layers"),
    (["model=tiny", "attention.layer_types=[linear_attention,lstm]"],
     "attention.layer_types=['linear_attention', 'lstm']: each entry must be one of sliding_attention, "
     "full_attention, compressed_sparse_attention, heavily_compressed_attention, linear_attention, kda, mamba"),
    # a window over layers none of which is sliding applied to nothing (silently, before)
    (["model=tiny", "attention.window=16", "attention.layer_types=[full_attention,full_attention]"],
     "attention.window=16: applies to the sliding_attention layers of attention.layer_types, and it lists none"),
    (["model=qwen3_5_9b", "attention.window=64"],
     "attention.window=64: applies to the sliding_attention layers of attention.layer_types, and it lists none"),
    (["model=qwen3_5_9b", "attention.window=64", "attention.global_every=4"],
     "attention.global_every=4: would replace model qwen3_5_9b's layer pattern, which has linear_attention layers; "
     "list each layer in attention.layer_types"),
    ([*HYBRID, "attention=mla"], "attention.type='mla': mla beside linear_attention (Gated DeltaNet) layers is not "
                                 "built; use a K/V-head type"),
    (["model=qwen3_5_9b", "attention=mla"],
     "model.attn_output_gate=True: is a property of K/V-head attention; attention=mla has none"),
    ([*HYBRID, "model.linear_num_key_heads=2", "model.linear_num_value_heads=3"],
     "model.linear_num_value_heads=3: must be a multiple of model.linear_num_key_heads=2 (each key head serves the "
     "same number of value heads)"),
    ([*HYBRID, "model.linear_key_head_dim=0"], "model.linear_key_head_dim=0: must be >= 1"),
    (["model=tiny", "model.partial_rotary_factor=0"],
     "model.partial_rotary_factor=0.0: must be in (0, 1] and rotate an even number >= 2 of the head_dim=8 "
     "dimensions (int(head_dim x factor) = 0)"),
    (["model=tiny", "model.partial_rotary_factor=1.5"],
     "model.partial_rotary_factor=1.5: must be in (0, 1] and rotate an even number >= 2 of the head_dim=8 "
     "dimensions (int(head_dim x factor) = 12)"),
    # cache.dtype applies to the attention layers (their head_dim=8 is no whole block of 4-bit codes)
    ([*HYBRID, "cache.dtype=nvfp4"],
     "cache.dtype='nvfp4': stores blocks of 16 values of a head, and head_dim=8 is not a multiple of 16; use "
     "cache.dtype=int8 or float8_e4m3fn"),
    ([*HYBRID, "runtime.compile=graph"],
     "runtime.compile='graph': the fixed-shape step reads a context bucket of K/V; a Gated DeltaNet layer's state "
     "has no such view (not built); use false or default"),
    ([*HYBRID, "workload=multiturn", "cache.shared=true"],
     "cache.shared=True: a shared prefix holds K/V once for many sequences; a Gated DeltaNet layer's state is each "
     "sequence's own (prefix caching for state layers is not built); use cache.shared=false"),
])
def test_each_is_one_line_naming_the_key(overrides, line):
    assert refusal(*overrides) == line


def test_the_models_own_linear_layers_stay_unless_asked_away():
    """A preset's linear layers are its own layout (attention=model, or a KV-head count); 0 asks for
    every layer full attention, a listed pattern replaces them, a window of 0 keeps them."""
    own = to_bench_config(compose("model=qwen3_5_9b", "task=inspect", "attention=gqa", "attention.window=0"))
    assert own.attention.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 8
    none = to_bench_config(compose("model=qwen3_5_9b", "task=inspect", "attention.full_attention_interval=0"))
    assert none.attention.layer_types is None
    two = to_bench_config(compose("model=tiny", "attention.layer_types=[linear_attention,full_attention]"))
    assert two.attention.layer_types == ["linear_attention", "full_attention"] and two.attention.window is None
