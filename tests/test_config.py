"""Validation where the config enters: one line, naming the key and the value."""

import math
import os
from dataclasses import asdict
from typing import Optional, get_type_hints

import pytest
from conftest import compose

from kvbench.config.bench import BenchConfig, CacheConfig, RuntimeConfig, WandbConfig, objective_metric
from kvbench.config.model import AttentionConfig, ModelConfig, attention_type, default_gqa_kv_heads
from kvbench.config.train import DataConfig, TrainConfig
from kvbench.config.workload import WORKLOADS, DecodeWorkload
from kvbench.core.errors import MAX_ERROR_CHARS, ConfigError, typed
from kvbench.jobs.job_config import check_job, to_bench_config


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
    return check_job(BenchConfig(model=ModelConfig(max_seq_len=128), attention=AttentionConfig("mha"),
                                 workload=dict(workload), cache=CacheConfig(),
                                 runtime=RuntimeConfig(), wandb=WandbConfig()))


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
    (lambda: DecodeWorkload(batch_size=0), "workload.batch_size=0"),
    (lambda: WandbConfig(mode="sometimes"), "wandb.mode='sometimes'"),
    (lambda: RuntimeConfig(compile="cudagraphs"), "runtime.compile='cudagraphs'"),
    (lambda: RuntimeConfig(graph_bucket=0), "runtime.graph_bucket=0"),
    (lambda: RuntimeConfig(probe="never"), "runtime.probe='never'"),
])
def test_group_errors(factory, needle):
    one_line_error(factory, needle)


# ---- every key, typed per job ----------------------------------------------------------------

GROUPS = [ModelConfig, AttentionConfig, *WORKLOADS.values(), CacheConfig, RuntimeConfig, WandbConfig, DataConfig,
          TrainConfig]
PREFIX = {ModelConfig: "model", AttentionConfig: "attention", **dict.fromkeys(WORKLOADS.values(), "workload"),
          CacheConfig: "cache",
          RuntimeConfig: "runtime", WandbConfig: "wandb", DataConfig: "data", TrainConfig: "train"}


def keys_of_type(kind):
    """(group dataclass, field) for every field typed ``kind`` or ``Optional[kind]``, found from
    the schemas themselves, so a key added later is covered too."""
    for group in GROUPS:
        for name, hint in get_type_hints(group).items():
            if hint is kind or hint == Optional[kind]:
                yield pytest.param(group, name, id=f"{PREFIX[group]}.{name}")


@pytest.mark.parametrize("group, key", list(keys_of_type(float)))
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_every_float_key_rejects_nan_and_infinity(group, key, value):
    one_line_error(lambda: typed(group, {key: value}), f"{PREFIX[group]}.{key}={value}")


@pytest.mark.parametrize("group, key", list(keys_of_type(int)))
def test_every_int_key_rejects_values_torch_cannot_hold(group, key):
    one_line_error(lambda: typed(group, {key: 2**64}), f"{PREFIX[group]}.{key}={2**64}")


@pytest.mark.parametrize("factory, needle", [
    (lambda: ModelConfig(rope_theta=-1.0), "model.rope_theta=-1.0"),
    (lambda: ModelConfig(norm_eps=0.0), "model.norm_eps=0.0"),
    (lambda: RuntimeConfig(threads=-1), "runtime.threads=-1"),
    (lambda: RuntimeConfig(threads=0), "runtime.threads=0"),
    (lambda: RuntimeConfig(threads=(os.cpu_count() or 1) + 1), "runtime.threads="),
    (lambda: RuntimeConfig(min_time_s=-1.0), "runtime.min_time_s=-1.0"),
    (lambda: RuntimeConfig(min_time_s=1e6), "runtime.min_time_s=1000000.0"),
    (lambda: RuntimeConfig(seed=-1), "runtime.seed=-1"),  # torch aliases it to 2**64 - 1
    (lambda: RuntimeConfig(seed=2**63), f"runtime.seed={2**63}"),
    (lambda: RuntimeConfig(device="cuda:abc"), "runtime.device='cuda:abc'"),
    (lambda: RuntimeConfig(device="cuda:-1"), "runtime.device='cuda:-1'"),
    (lambda: RuntimeConfig(device="cuda:0:1"), "runtime.device='cuda:0:1'"),
    (lambda: DataConfig(max_bytes=0), "data.max_bytes=0"),
    (lambda: DataConfig(max_bytes=-5), "data.max_bytes=-5"),
    (lambda: TrainConfig(lr=0.0), "train.lr=0.0"),
    (lambda: TrainConfig(weight_decay=-0.1), "train.weight_decay=-0.1"),
    (lambda: TrainConfig(grad_clip=-1.0), "train.grad_clip=-1.0"),
    (lambda: WandbConfig(init_timeout_s=0.0), "wandb.init_timeout_s=0.0"),
    # an unanswering server held the run (and W&B's service) for as long as this says
    (lambda: WandbConfig(init_timeout_s=1e300), "wandb.init_timeout_s=1e+300: must be in (0, 600] seconds"),
    (lambda: WandbConfig(init_timeout_s=600.5), "wandb.init_timeout_s=600.5"),
])
def test_bounds_of_numeric_keys(factory, needle):
    one_line_error(factory, needle)


def test_values_at_the_bounds_are_accepted():
    assert RuntimeConfig(threads=os.cpu_count() or 1, seed=2**63 - 1, device="cuda:12").seed == 2**63 - 1
    assert RuntimeConfig(device="cuda:free").device == "cuda:free"
    assert RuntimeConfig(min_time_s=0.0).min_time_s == 0.0 and RuntimeConfig(min_time_s=86_400).min_time_s == 86_400
    assert DataConfig(max_bytes=1).max_bytes == 1 and DataConfig(max_bytes=None).max_bytes is None
    assert WandbConfig(init_timeout_s=600).init_timeout_s == 600


@pytest.mark.parametrize("overrides, needle", [
    # a mandatory value left unset: once a random 2-layer model benchmarked as "ok"
    (["model=llama_dir"], "model.path=???: a value is required"),
    (["model=hf_dir"], "model.path=???: a value is required"),
    (["model=tiny", "model.path=???"], "model.path=???"),
    # a typo, with or without +: the nearest real key
    (["+workload.promt_len=5"], "workload.promt_len=5: unknown key (did you mean workload.prompt_len?)"),
    (["runtime.thread=2"], "runtime.thread=2: unknown key (did you mean runtime.threads?)"),
    (["+model.zzz=1"], "model.zzz=1: unknown key (model has name, num_layers"),
    (["workload.prompt_len=abc"], "workload.prompt_len='abc': Value 'abc' of type 'str' could not be converted"),
    (["workload.prompt_len=2.5"], "workload.prompt_len=2.5"),
    (["task=null"], "task=None"),
    (["workload.prompt_len=${nope.key}"], "workload.prompt_len='${nope.key}': Interpolation key 'nope.key' not found"),
    (["model.num_kv_heads=2"], "model.num_kv_heads: renamed to model.preset_kv_heads"),
    (["objective=--tokens_per_s"], "objective='--tokens_per_s': must be a metric name, or -name to minimise it"),
    (["objective=tokens/s"], "objective='tokens/s': must be a metric name"),
    (["objective_caps.kv_cache_bytes=inf"], "objective_caps.kv_cache_bytes=inf: must be a finite number"),
    (["objective_caps.kv_cache_bytes=lots"], "objective_caps.kv_cache_bytes='lots'"),
])
def test_a_composed_config_is_typed_per_job_naming_the_key(overrides, needle):
    """Hydra composes plain values (so one bad job of a sweep cannot stop the others);
    to_bench_config types them, and every failure is one line naming the key."""
    cfg = compose(*overrides)  # composes: nothing is typed yet
    one_line_error(lambda: to_bench_config(cfg), needle)


def test_a_key_the_preset_file_omits_takes_the_schema_default_and_can_be_overridden():
    assert "rope_theta" not in compose("model=tiny").model  # conf/model/tiny.yaml omits it
    assert to_bench_config(compose("model=tiny")).model.rope_theta == ModelConfig().rope_theta
    assert to_bench_config(compose("model=tiny", "model.rope_theta=500")).model.rope_theta == 500.0


def test_config_error_is_one_bounded_line():
    err = ConfigError("model.path='x': " + "bad\n" * 1_000_000)
    assert "\n" not in str(err) and len(str(err)) < MAX_ERROR_CHARS + 100
    assert str(err).startswith("model.path='x': bad bad") and "4,000,016 characters in all" in str(err)


@pytest.mark.parametrize("change, needle", [
    # the config.json key and its value, whatever the type (OmegaConf converted "32" silently)
    ({"num_hidden_layers": "two"}, "num_hidden_layers='two': must be an integer"),
    ({"num_hidden_layers": "2"}, "num_hidden_layers='2': must be an integer"),
    ({"rope_theta": math.nan}, "rope_theta=nan: must be a finite number"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps=-1e-06: must be > 0"),
    ({"num_attention_heads": 0}, "num_attention_heads=0: must be >= 1"),
    ({"rope_parameters": "default"}, "rope_parameters='default': must be a JSON object"),
    ({"hidden_size": [64]}, "hidden_size=[64]: must be an integer"),
])
def test_a_malformed_config_json_names_the_file_and_key(change, needle):
    hf = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 97,
          "max_position_embeddings": 128}
    assert ModelConfig.from_hf_config(hf, "ck/config.json").head_dim == 16
    msg = one_line_error(lambda: ModelConfig.from_hf_config({**hf, **change}, "ck/config.json"), needle)
    assert msg.startswith("ck/config.json: ")
    one_line_error(lambda: ModelConfig.from_hf_config([1, 2], "ck/config.json"), "ck/config.json: not a JSON object")


HF_LLAMA = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 97,
            "max_position_embeddings": 128}
# the same shape as a DeepSeek-V3 with multi-head latent attention (every layer's MLP dense)
HF_DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 16, "qk_nope_head_dim": 8,
               "qk_rope_head_dim": 4, "v_head_dim": 8, "first_k_dense_replace": 2}


@pytest.mark.parametrize("change, needle", [
    ({"architectures": ["MixtralForCausalLM"]},
     # (every architecture a kind registers follows: the list grows with them)
     "architectures=['MixtralForCausalLM']: not supported (accepted: LlamaForCausalLM, MistralForCausalLM, "
     "Qwen2ForCausalLM, Qwen3ForCausalLM, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, "),
    ({"num_local_experts": 8}, "num_local_experts=8: mixture-of-experts is not supported"),
    ({"vision_config": {"hidden_size": 8}}, "vision_config={'hidden_size': 8}: multimodal checkpoints"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}},
     "rope_parameters.rope_type='longrope': not supported (accepted: default, linear, llama3, yarn)"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "truncate": "no"}},
     "rope_parameters.truncate='no': must be true or false"),
    # FP8 blocks, MXFP4 and NVFP4 are dequantized on load (tests/test_quant_weights.py); another format is refused
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}},
     "quantization_config.quant_method='gptq': not a quantized checkpoint format kvbench reads"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type='dynamic': not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor: missing"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0.5}}, "rope_scaling.factor=0.5: must be >= 1"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
     "rope_scaling.high_freq_factor=1.0: must be > rope_scaling.low_freq_factor=4.0"),
    ({"partial_rotary_factor": 0.5, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor=0.5: not supported"),
    ({"layer_types": ["chunked_attention", "full_attention"]},
     "layer_types=['chunked_attention', 'full_attention']: not supported"),
    ({**HF_DEEPSEEK, "attention_bias": True},
     "attention_bias=True: biases on the latent attention's projections are not modelled"),
])
def test_what_the_decoder_does_not_model_is_refused_naming_the_key(change, needle):
    msg = one_line_error(lambda: ModelConfig.from_hf_config({**HF_LLAMA, **change}, "ck/config.json"), needle)
    assert msg.startswith("ck/config.json: ")


@pytest.mark.parametrize("config, window, layer_types", [
    # Qwen2 writes sliding_window but turns it off; transformers >= 5 lists the layers' kinds.
    ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 32, "use_sliding_window": False}, None, None),
    ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 32, "use_sliding_window": True,
      "layer_types": ["full_attention", "full_attention"]}, None, None),
    ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 32, "use_sliding_window": True,
      "layer_types": ["full_attention", "sliding_attention"]}, 32, ["full_attention", "sliding_attention"]),
    # before layer_types: the layers from max_window_layers on are local (transformers' rule)
    ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 32, "use_sliding_window": True,
      "max_window_layers": 1}, 32, ["full_attention", "sliding_attention"]),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 32}, 32, None),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": None}, None, None),
])
def test_a_sliding_window_is_read_where_it_applies(config, window, layer_types):
    from kvbench.config.model import AttentionConfig

    model = ModelConfig.from_hf_config({**HF_LLAMA, **config}, "ck/config.json")
    assert (model.preset_window, model.preset_layer_types) == (window, layer_types)
    local = [window if layer_types is None or t == "sliding_attention" else None for t in layer_types or [0, 0]]
    assert AttentionConfig(type="gqa").resolved(model).layer_windows(2) == local
    assert AttentionConfig(type="gqa", window=0).resolved(model).layer_windows(2) == [None, None]


def test_rope_scaling_read_from_either_spelling():
    llama3 = {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
              "original_max_position_embeddings": 8192}
    new = ModelConfig.from_hf_config({**HF_LLAMA, "rope_parameters": {"rope_theta": 5e5, **llama3}})
    old = ModelConfig.from_hf_config({**HF_LLAMA, "rope_theta": 5e5, "rope_scaling": llama3})
    assert new == old
    assert (new.rope_type, new.rope_factor, new.rope_original_max_seq_len, new.rope_theta) == ("llama3", 8.0, 8192, 5e5)


@pytest.mark.parametrize("given, mode", [(False, "false"), ("False", "false"), (True, "default"), ("true", "default"),
                                         ("default", "default"), ("graph", "graph")])
def test_compile_modes_keep_the_old_booleans(given, mode):
    """runtime.compile=true|false still work (a YAML boolean arrives typed as 'True'/'False')."""
    assert RuntimeConfig(compile=given).compile == mode


def test_graph_mode_needs_the_static_cache():
    runtime = RuntimeConfig(compile="graph")
    one_line_error(lambda: check_job(BenchConfig(model=ModelConfig(), attention=AttentionConfig("mha"),
                                                 workload=DecodeWorkload(prompt_len=8, gen_len=4),
                                                 cache=CacheConfig(impl="concat"), runtime=runtime,
                                                 wandb=WandbConfig())),
                   "cache.impl='concat'")


def test_cache_dtype_choices_and_what_they_need():
    one_line_error(lambda: CacheConfig(dtype="int4"), "cache.dtype='int4': must be one of auto, int8, float8_e4m3fn")
    one_line_error(lambda: CacheConfig(impl="concat", dtype="int8"),
                   "cache.impl='concat': cache.dtype=int8 is stored in a preallocated cache")
    assert CacheConfig(dtype="float8_e4m3fn").dtype == "float8_e4m3fn"
    bench = lambda runtime, dtype: check_job(BenchConfig(
        model=ModelConfig(), attention=AttentionConfig("mha"), workload=DecodeWorkload(prompt_len=8, gen_len=4),
        cache=CacheConfig(dtype=dtype), runtime=runtime, wandb=WandbConfig()))
    one_line_error(lambda: bench(RuntimeConfig(compile="graph"), "int8"),
                   "cache.dtype='int8': runtime.compile=graph is not supported with a quantized cache")
    assert bench(RuntimeConfig(compile="graph"), "auto").cache.dtype == "auto"
    assert bench(RuntimeConfig(compile="default"), "int8").cache.dtype == "int8"


def test_an_objective_and_its_caps_are_typed_and_a_cap_needs_no_plus():
    job = to_bench_config(compose("model=tiny", "objective=-decode_ms_p50", "objective_caps.kv_cache_bytes=1e6"))
    assert (job.objective, job.objective_caps) == ("-decode_ms_p50", {"kv_cache_bytes": 1e6})
    assert objective_metric(job.objective) == ("decode_ms_p50", -1.0)
    assert objective_metric("tokens_per_s") == ("tokens_per_s", 1.0)
    assert to_bench_config(compose("model=tiny")).objective is None  # the default: a grid returns nothing


@pytest.mark.parametrize("kv, kind", [(8, "mha"), (2, "gqa"), (1, "mqa")])
def test_the_attention_type_resolver_names_what_a_kv_head_count_is(kv, kind):
    """experiment=search derives attention.type from the searched count (the resolver is
    config.attention_type); the count still has to divide num_heads."""
    type_of = "attention.type='${kvbench_attention_type:${model.num_heads},${attention.num_kv_heads}}'"
    job = to_bench_config(compose("model=tiny", type_of, f"attention.num_kv_heads={kv}"))
    assert (job.attention.type, job.attention.num_kv_heads) == (kind, kv) == (attention_type(8, kv), kv)
    one_line_error(lambda: to_bench_config(compose("model=tiny", type_of, "attention.num_kv_heads=3")),
                   "attention.num_kv_heads=3: must divide model.num_heads=8")


# ---- one dataclass per workload option ---------------------------------------------------------

def test_a_job_holds_only_its_workload_options_keys():
    """A key only another option has is left out (every job of a sweep over workload options gets
    the sweep's overrides), so a decode job has no chat lengths and its record none either."""
    job = to_bench_config(compose("model=tiny", "workload=decode", "+workload.turns=3", "+workload.rate=2"))
    assert type(job.workload) is WORKLOADS["decode"] and not hasattr(job.workload, "turns")
    assert "turns" not in asdict(job)["workload"] and "rate" not in asdict(job)["workload"]
    chat = to_bench_config(compose("model=tiny", "workload=multiturn", "workload.turns=3", "+workload.prompt_len=9"))
    assert chat.workload.turns == 3 and not hasattr(chat.workload, "prompt_len")


@pytest.mark.parametrize("overrides, needle", [
    (["workload=multiturn", "+workload.turn=3"], "workload.turn=3: unknown key (did you mean workload.turns?)"),
    (["workload=serving", "+workload.rates=3"], "workload.rates=3: unknown key (did you mean workload.rate?)"),
    (["workload.name=nope"], "workload.name='nope': must be one of decode, multiturn, serving"),
    # capacity searched a decode batch with a gen_len serving has no key for, and recorded serving's keys
    (["task=capacity", "workload=serving", "runtime.memory_budget_gb=1"],
     "workload='serving': task=capacity searches the batch of workload=decode or workload=multiturn"),
])
def test_a_workload_key_is_checked_against_its_own_option(overrides, needle):
    one_line_error(lambda: to_bench_config(compose("model=tiny", *overrides)), needle)


def test_a_config_json_read_twice_is_typed_once_and_each_reader_gets_its_own_copy(tmp_path):
    """from_hf_config types a config.json's fields once per distinct content (OmegaConf costs ~35 ms a
    time): the second read equals a fresh typing, and changing what one reader got changes no other's."""
    from kvbench.core import errors

    hf = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
          "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 101, "num_key_value_heads": 2,
          "max_position_embeddings": 64}
    first = ModelConfig.from_hf_config(dict(hf))
    second = ModelConfig.from_hf_config(dict(hf))
    assert first == second and first is not second
    first.num_layers = 7
    assert ModelConfig.from_hf_config(dict(hf)).num_layers == 2 == second.num_layers
    assert ModelConfig.from_hf_config({**hf, "num_hidden_layers": 3}).num_layers == 3  # other content, other entry
    assert any(v.num_layers == 2 for v in errors._TYPED.values())


def test_an_attention_multiplier_on_latent_layers_is_refused_in_one_line():
    """Granite's attention_multiplier scales K/V-head attention logits; a latent layer never reads it, so a
    model that asks for it with attention=mla is refused, naming the key and the value, not run unscaled."""
    from kvbench.config.multipliers import Multipliers

    model = ModelConfig(name="t", num_layers=2, d_model=64, num_heads=4, preset_kv_heads=4, ffn_dim=96,
                        vocab_size=97, max_seq_len=64, multipliers=Multipliers(attention_multiplier=0.5))
    with pytest.raises(ConfigError) as info:
        AttentionConfig(type="mla").resolved(model)
    assert str(info.value).startswith("model.multipliers.attention_multiplier=0.5: ") and "\n" not in str(info.value)
    assert AttentionConfig(type="gqa", num_kv_heads=2).resolved(model).num_kv_heads == 2  # K/V heads take it
