"""``cache.state_dtype``: the dtype a recurrent layer's state is held in (float32, or half that as
vLLM's ``mamba_ssm_cache_dtype`` allows). On a Gated DeltaNet hybrid: the bytes the static cache
and the serving store allocate equal a hand formula in either dtype, a bfloat16 state decodes the
same greedy tokens as a float32 one, task=inspect says the dtype, and a bad value is one line."""

from dataclasses import asdict

import pytest
import torch
from conftest import compose, tiny_model_config

from kvbench.cache import make_cache
from kvbench.config.model import AttentionConfig
from kvbench.core.errors import ConfigError
from kvbench.generate import greedy_generate
from kvbench.jobs.job_config import to_bench_config
from kvbench.layouts.base import State
from kvbench.layouts.mamba2 import Mamba2
from kvbench.layouts.pages import StatePage
from kvbench.model import Decoder
from kvbench.serving.paged import PagedStore, plan_for
from kvbench.state_cache import StateLayer
from kvbench.tasks.inspect import describe

H_K, H_V, D_K, D_V, K = 2, 4, 8, 12, 4  # the linear layers' shape
KINDS = ["linear_attention"] * 3 + ["full_attention"]  # Qwen3.5's 3:1 in small
STATE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def hybrid(state_dtype: str, seed: int = 0) -> Decoder:
    cfg = tiny_model_config(num_layers=4, num_heads=4, preset_kv_heads=2, max_seq_len=96,
                            linear_num_key_heads=H_K, linear_num_value_heads=H_V, linear_key_head_dim=D_K,
                            linear_value_head_dim=D_V, linear_conv_kernel_dim=K)
    torch.manual_seed(seed)
    return Decoder(cfg, AttentionConfig(layer_types=KINDS), state_dtype).eval()


def hand_state_bytes(state_dtype: str, element: int = 4) -> int:
    """One linear layer's state of one sequence: the convolution's last K - 1 inputs of q, k, v
    (compute dtype) and H_v states of d_k x d_v in ``state_dtype``."""
    return (2 * H_K * D_K + H_V * D_V) * (K - 1) * element + H_V * D_K * D_V * STATE_BYTES[state_dtype]


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_the_static_cache_allocates_the_formulas_bytes_in_the_state_dtype(state_dtype):
    model, B, S = hybrid(state_dtype), 2, 40
    per_position = 2 * 2 * 16 * 4  # the full layer: K and V, 2 heads of 16, float32
    hand = B * (3 * hand_state_bytes(state_dtype) + S * per_position)
    assert model.layouts.cache_bytes(S, B, 4) == hand
    assert model.layouts.state_bytes(4) == 3 * hand_state_bytes(state_dtype)
    cache = make_cache("static", model.layouts, B, S)
    assert sum(t.untyped_storage().nbytes() for t in cache.tensors()) == hand == cache.nbytes
    states = [layer for layer in cache.layers if isinstance(layer, StateLayer)]
    assert len(states) == 3
    assert all(s.recurrent.dtype == getattr(torch, state_dtype) and s.conv.dtype == torch.float32 for s in states)
    with torch.no_grad():  # a forward keeps the state in its dtype, in place
        model(torch.randint(0, 97, (B, 9)), cache)
    assert all(s.recurrent.dtype == getattr(torch, state_dtype) and s.recurrent.abs().sum() > 0 for s in states)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_the_serving_stores_state_pages_hold_the_state_dtype(state_dtype):
    model, blocks, block_size = hybrid(state_dtype), 6, 4
    store = PagedStore(model, blocks, block_size, plan=plan_for(model, blocks, block_size, longest=24))
    state = next(g for g, group in enumerate(store.plan.groups) if isinstance(group.spec, StatePage))
    assert store.plan.groups[state].page_bytes(block_size) == 3 * hand_state_bytes(state_dtype)
    pages = store.plan.capacity[state]
    kv = sum(n * block_size * 2 * 2 * 16 * 4 for g, n in enumerate(store.plan.capacity) if g != state)
    assert store.nbytes == pages * 3 * hand_state_bytes(state_dtype) + kv
    assert all(recurrent.dtype == getattr(torch, state_dtype) and conv.dtype == torch.float32
               for conv, recurrent in store.managers[state].states)


def test_a_bfloat16_state_decodes_the_float32_states_tokens():
    """Same weights, float32 compute: 12 greedy steps from the same prompts give the same tokens
    and logits within 1e-2 (measured 0.7e-3 to 1.0e-3 over four prompts, logits of about 2: the state
    rounds to bfloat16's 8 bits once per step, the rule computed in float32 as transformers does)."""
    runs = {}
    prompt = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(1))
    for state_dtype in ("float32", "bfloat16"):
        model = hybrid(state_dtype)
        runs[state_dtype] = greedy_generate(model, prompt, 12, make_cache("static", model.layouts, 2, 40),
                                            keep_logits=True)
    assert torch.equal(runs["float32"].tokens, runs["bfloat16"].tokens)
    gap = (runs["float32"].logits - runs["bfloat16"].logits).abs().max()
    assert 0 < gap <= 1e-2  # not 0: the state was held in bfloat16


def test_the_config_key_reaches_the_layouts_and_inspect_says_it():
    overrides = ["model=tiny", "attention.full_attention_interval=2", "workload.batch_size=1"]
    for state_dtype in ("float32", "bfloat16", "float16"):
        cfg = to_bench_config(compose(*overrides, f"cache.state_dtype={state_dtype}"))
        assert cfg.cache.state_dtype == state_dtype
        text = describe(cfg)
        assert f"x d_k x d_v, {state_dtype})" in text  # the Gated DeltaNet layer's memory line
        other = {"float32": "bfloat16", "bfloat16": "float32", "float16": "float32"}[state_dtype]
        assert f"x d_k x d_v, {other})" not in text
    assert to_bench_config(compose(*overrides)).cache.state_dtype == "float32"  # the default
    quantized = to_bench_config(compose(*overrides, "cache.state_dtype=bfloat16", "cache.dtype=int8"))
    assert "recurrent state bfloat16, convolution inputs float32" in describe(quantized)


@pytest.mark.parametrize("value", ["float8_e4m3fn", "int8", "fp32", "auto"])
def test_a_state_dtype_no_state_is_held_in_is_one_line_naming_the_key(value):
    with pytest.raises(ConfigError) as info:
        to_bench_config(compose("model=tiny", f"cache.state_dtype={value}"))
    assert str(info.value) == f"cache.state_dtype={value!r}: must be one of float32, float16, bfloat16"
    with pytest.raises(ConfigError) as info:
        State(8, 3, (2, 4, 4), value)
    assert str(info.value) == f"cache.state_dtype={value!r}: must be one of float32, float16, bfloat16"


def test_a_mamba2_layers_state_is_the_shared_state_in_its_checkpoints_dtype():
    """Mamba-2 holds the same State as Gated DeltaNet, in config.json's mamba_ssm_cache_dtype."""
    layer = Mamba2(None, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=6, n_groups=2, conv_kernel=4,
                   state_dtype="bfloat16")
    assert type(layer.state) is State and layer.state.state_dtype == "bfloat16"
    channels = 4 * 8 + 2 * 2 * 6
    assert layer.state_bytes(4) == channels * 3 * 4 + 4 * 8 * 6 * 2
    cache = StateLayer(layer.state, 3, torch.float32)
    assert cache.recurrent.dtype == torch.bfloat16 and cache.nbytes == 3 * layer.state_bytes(4)


def test_the_label_and_the_record_name_a_half_precision_state():
    """Two jobs that differ only in cache.state_dtype are two rows: the label says a state that is
    not float32, on the layers that hold one; the record keeps the key where it is not float32 (the
    decode workload reads it)."""
    from kvbench.config.layer_pattern import job_variant_label
    from kvbench.results import record_config
    from kvbench.sinks.views import Variant

    hybrid_keys = ["model=tiny", "attention.full_attention_interval=2"]
    labels = {}
    for state_dtype in ("float32", "bfloat16"):
        job = to_bench_config(compose(*hybrid_keys, f"cache.state_dtype={state_dtype}"))
        labels[state_dtype] = job_variant_label(job)
        record = record_config(asdict(job))  # as the runner records a job (kvbench/jobs/runner.py)
        # float32 is left out, as every record written before the key holds it (its schema unchanged)
        assert record["cache"].get("state_dtype", "float32") == state_dtype
        assert ("state_dtype" in record["cache"]) == (state_dtype != "float32")
        assert Variant.from_config(record).label == labels[state_dtype]
    assert labels == {"float32": "mha kv=8 gdn 1:1", "bfloat16": "mha kv=8 gdn 1:1 state=bfloat16"}
    plain = to_bench_config(compose("model=tiny", "cache.state_dtype=bfloat16"))
    assert job_variant_label(plain) == "mha kv=8"  # no layer holds a state: nothing to name
