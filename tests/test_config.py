"""Validation where the config enters: one line, naming the key and the value."""

import pytest

from kvbench.config import (
    AttentionConfig,
    BenchConfig,
    CacheConfig,
    ConfigError,
    ModelConfig,
    RuntimeConfig,
    WandbConfig,
    WorkloadConfig,
    attention_type,
    default_gqa_kv_heads,
)


def one_line_error(fn, needle):
    with pytest.raises(ConfigError) as err:
        fn()
    msg = str(err.value)
    assert needle in msg and "\n" not in msg, msg
    return msg


def test_model_errors_name_the_field():
    one_line_error(lambda: ModelConfig(d_model=100, num_heads=8), "model.d_model=100")
    one_line_error(lambda: ModelConfig(d_model=64, num_heads=8, head_dim=7), "model.head_dim=7")
    one_line_error(lambda: ModelConfig(d_model=68, num_heads=8, head_dim=None), "model.d_model=68")
    one_line_error(lambda: ModelConfig(num_heads=8, preset_kv_heads=3), "model.preset_kv_heads=3")
    # an explicit head_dim may differ from d_model / num_heads
    assert ModelConfig(d_model=64, num_heads=8, head_dim=16).head_dim == 16
    assert ModelConfig(d_model=64, num_heads=8).head_dim == 8


@pytest.mark.parametrize("kind, kv, needle", [
    ("mha", 4, "attention.type='mha'"), ("mqa", 2, "attention.type='mqa'"),
    ("gqa", 1, "attention.type='gqa'"), ("gqa", 32, "attention.type='gqa'"),
    ("gqa", 64, "attention.num_kv_heads=64"), ("gqa", 6, "attention.num_kv_heads=6"),
])
def test_type_must_agree_with_kv_count(kind, kv, needle):
    model = ModelConfig(d_model=4096, num_heads=32, preset_kv_heads=32)
    one_line_error(lambda: AttentionConfig(type=kind, num_kv_heads=kv).resolved(model), needle)


@pytest.mark.parametrize("heads, kv, kind", [(32, 32, "mha"), (32, 8, "gqa"), (32, 2, "gqa"), (32, 1, "mqa"),
                                             (1, 1, "mha")])
def test_attention_type_is_named_by_the_kv_head_count(heads, kv, kind):
    assert attention_type(heads, kv) == kind
    assert AttentionConfig.for_heads(heads, kv) == AttentionConfig(kind, kv)


def test_defaults_per_type():
    llama2 = ModelConfig(d_model=4096, num_heads=32, preset_kv_heads=32)
    llama3 = ModelConfig(d_model=4096, num_heads=32, preset_kv_heads=8)
    assert AttentionConfig("mha").resolved(llama2).num_kv_heads == 32
    assert AttentionConfig("mqa").resolved(llama2).num_kv_heads == 1
    assert AttentionConfig("gqa").resolved(llama2).num_kv_heads == 8  # num_heads / 4
    assert AttentionConfig("gqa").resolved(llama3).num_kv_heads == 8  # the preset's own
    assert default_gqa_kv_heads(ModelConfig(d_model=96, num_heads=12, preset_kv_heads=12)) == 3
    one_line_error(lambda: AttentionConfig("paged"), "attention.type='paged'")


def bench(**workload):
    return BenchConfig(model=ModelConfig(max_seq_len=128), attention=AttentionConfig("mha"),
                       workload=WorkloadConfig(**workload), cache=CacheConfig(),
                       runtime=RuntimeConfig(), wandb=WandbConfig())


def test_sequence_longer_than_max_seq_len():
    one_line_error(lambda: bench(prompt_len=100, gen_len=29), "workload.prompt_len=100")
    assert bench(prompt_len=100, gen_len=28).attention.num_kv_heads == 8
    one_line_error(lambda: bench(name="multiturn", system_len=100, turns=2, user_len=8, reply_len=8),
                   "workload.system_len=100")


@pytest.mark.parametrize("factory, needle", [
    (lambda: RuntimeConfig(dtype="float64"), "runtime.dtype='float64'"),
    (lambda: RuntimeConfig(device="tpu"), "runtime.device='tpu'"),
    (lambda: RuntimeConfig(repeats=0), "runtime.repeats=0"),
    (lambda: CacheConfig(impl="paged"), "cache.impl='paged'"),
    (lambda: WorkloadConfig(batch_size=0), "workload.batch_size=0"),
    (lambda: WandbConfig(mode="sometimes"), "wandb.mode='sometimes'"),
    (lambda: RuntimeConfig(compile="cudagraphs"), "runtime.compile='cudagraphs'"),
    (lambda: RuntimeConfig(graph_bucket=0), "runtime.graph_bucket=0"),
    (lambda: RuntimeConfig(probe="never"), "runtime.probe='never'"),
])
def test_group_errors(factory, needle):
    one_line_error(factory, needle)


@pytest.mark.parametrize("given, mode", [(False, "false"), ("False", "false"), (True, "default"), ("true", "default"),
                                         ("default", "default"), ("graph", "graph")])
def test_compile_modes_keep_the_old_booleans(given, mode):
    """runtime.compile=true|false still work (a YAML boolean arrives typed as 'True'/'False')."""
    assert RuntimeConfig(compile=given).compile == mode


def test_graph_mode_needs_the_static_cache():
    runtime = RuntimeConfig(compile="graph")
    one_line_error(lambda: BenchConfig(model=ModelConfig(), attention=AttentionConfig("mha"), workload=WorkloadConfig(
        prompt_len=8, gen_len=4), cache=CacheConfig(impl="concat"), runtime=runtime, wandb=WandbConfig()),
                   "cache.impl='concat'")
