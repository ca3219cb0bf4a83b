"""Hostile and careless input, round 5 (issue 53, section 3): two keys of a config.json that
disagree, settings that do nothing for the run they are given to, and sizes that are only found
out by building. Each is refused in one line naming the keys and values as written (``invalid``,
exit 2), before the work; a config.json transformers itself writes is never refused."""

import pytest
import torch
from conftest import compose

from kvbench.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from kvbench.config.hf import WINDOW_KEYS, WINDOW_KEYS_READ
from kvbench.config.hf_agree import check_agreement
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.core.errors import ConfigError
from kvbench.jobs.job_config import to_bench_config
from kvbench.jobs.runner import run_job
from kvbench.layouts.build import build_layouts
from kvbench.model import Decoder


def refusal(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    [line] = str(info.value).splitlines()
    return line


# ---- config.json: keys that say one thing twice --------------------------------------------

def gpt_oss(**changes):
    """A GPT-OSS config.json of 4 layers, 2 KV heads of 16: 128 bytes per token and full layer in float32."""
    cfg = {"architectures": ["GptOssForCausalLM"], "num_hidden_layers": 4, "hidden_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64,
           "vocab_size": 128, "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 512,
           "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 2}
    return {**cfg, **changes}


def test_a_gpt_oss_window_of_zero_beside_sliding_layer_types_is_refused_naming_both():
    """It ran as all full attention: the KV formula of 4 full layers (4 x 2 heads x 16 x 2 x 4 bytes x
    512 positions) where the file's pattern (2 layers of an 8-position window) gives far less."""
    own = ModelConfig.from_hf_config(gpt_oss(), "/ckpt/config.json")
    element, positions = 4, 512
    per_layer = 2 * 16 * 2 * element  # K and V of 2 heads of 16, per position
    layouts = build_layouts(own, AttentionConfig().resolved(own))
    assert layouts.cache_bytes(positions, 1, element, "auto") == per_layer * (2 * positions + 2 * 8)
    line = refusal(ModelConfig.from_hf_config, gpt_oss(sliding_window=0), "/ckpt/config.json")
    assert line.startswith("/ckpt/config.json: sliding_window=0 and layer_types=")
    assert "disagree" in line and "sliding_attention" in line
    line = refusal(ModelConfig.from_hf_config, gpt_oss(sliding_window=None), "/ckpt/config.json")
    assert "sliding_window=None and layer_types=" in line


def qwen(arch="Qwen2ForCausalLM", **changes):
    cfg = {"architectures": [arch], "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 128, "max_position_embeddings": 512}
    return {**cfg, **changes}


SLIDING_FULL = ["sliding_attention", "full_attention"] * 2


@pytest.mark.parametrize("cfg, keys", [
    (qwen(use_sliding_window=False, sliding_window=8, layer_types=SLIDING_FULL), ("use_sliding_window=False",)),
    # left out: Qwen2Config's default (false), which transformers reads before layer_types
    (qwen(sliding_window=8, layer_types=SLIDING_FULL), ("use_sliding_window=False (its default)",)),
    (qwen("Qwen3ForCausalLM", use_sliding_window=True, sliding_window=0, layer_types=SLIDING_FULL),
     ("sliding_window=0",)),
    ({**qwen("MistralForCausalLM", sliding_window=None, layer_types=SLIDING_FULL)}, ("sliding_window=None",)),
    (qwen("Qwen3_5ForCausalLM", head_dim=16, full_attention_interval=2,
          layer_types=["linear_attention"] * 3 + ["full_attention"]), ("full_attention_interval=2",)),
    (qwen(rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
     ("rope_theta=10000.0", "rope_parameters.rope_theta=500000.0")),
    ({**qwen("DeepseekV3ForCausalLM", head_dim=8, kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=6,
             qk_rope_head_dim=4, v_head_dim=5, first_k_dense_replace=4)}, ("head_dim=8", "qk_rope_head_dim=4")),
    (qwen(num_experts=8, num_local_experts=4, architectures=["Qwen3MoeForCausalLM"], moe_intermediate_size=32,
          num_experts_per_tok=2), ("num_experts=8", "num_local_experts=4")),
])
def test_two_keys_of_a_config_json_that_disagree_are_refused_naming_both(cfg, keys):
    line = refusal(ModelConfig.from_hf_config, cfg, "/ckpt/config.json")
    assert line.startswith("/ckpt/config.json: ")
    for key in keys:
        assert key in line
    assert "layer_types=" in line or len(keys) == 2


def test_a_disagreement_in_a_multimodal_checkpoints_text_config_names_the_nested_keys():
    text = qwen("Qwen3_5ForConditionalGeneration", head_dim=16, full_attention_interval=2,
                layer_types=["linear_attention"] * 3 + ["full_attention"])
    del text["architectures"]
    line = refusal(ModelConfig.from_hf_config, {"architectures": ["Qwen3_5ForConditionalGeneration"],
                                                "text_config": text}, "/ckpt/config.json")
    assert "text_config.full_attention_interval=2 and text_config.layer_types=" in line


def saved(config) -> dict:
    """A transformers config as its save_pretrained writes config.json (its to_dict, with the class)."""
    out = config.to_dict()
    out["architectures"] = [config.__class__.__name__.replace("Config", "ForCausalLM")]
    return out


def transformers_configs():
    import transformers as t

    shape = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=64, vocab_size=128, max_position_embeddings=512)
    yield t.GptOssConfig(**shape, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
    yield t.GptOssConfig(**shape, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                         layer_types=["full_attention"] * 4)
    yield t.Qwen2Config(**shape, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    yield t.Qwen2Config(**shape, use_sliding_window=False, sliding_window=8, max_window_layers=1)
    # layer_types given: transformers writes its max_window_layers default (28) beside it, and reads layer_types
    yield t.Qwen3Config(**shape, head_dim=16, use_sliding_window=True, sliding_window=8, layer_types=SLIDING_FULL)
    yield t.MistralConfig(**shape, sliding_window=8)
    yield t.MistralConfig(**shape, sliding_window=None)
    yield t.LlamaConfig(**shape, rope_theta=50000.0)
    yield t.DeepseekV3Config(**shape, kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4,
                             v_head_dim=5, first_k_dense_replace=4)


@pytest.mark.parametrize("config", list(transformers_configs()), ids=lambda c: type(c).__name__)
def test_a_config_json_transformers_writes_is_never_refused_and_reads_as_transformers_reads_it(config):
    """Each pair of keys as transformers derives one from the other: accepted, and the window on the
    layers transformers gives one (its layer_types' sliding layers; none when its window is off)."""
    model = ModelConfig.from_hf_config(saved(config), "/ckpt/config.json")
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if "sliding_window" not in WINDOW_KEYS_READ.get(saved(config)["architectures"][0], WINDOW_KEYS):
        window = None
    elif types is None or type(config).__name__ == "MistralConfig":  # Mistral: every layer (no layer_types read)
        types = ["sliding_attention"] * config.num_hidden_layers
    expected = [window if window and t == "sliding_attention" else None for t in types or [None] * 4]
    layouts = build_layouts(model, AttentionConfig().resolved(model))
    assert list(layouts.windows) == expected


def test_only_keys_the_file_states_are_compared():
    """A key left out takes its class's default, which says nothing against the key that is there."""
    check_agreement({"layer_types": SLIDING_FULL}, {"layer_types": SLIDING_FULL, "sliding_window": 128},
                    WINDOW_KEYS_READ["GptOssForCausalLM"], False)
    ModelConfig.from_hf_config(gpt_oss(sliding_window=8, rope_theta=150000.0,
                                       rope_parameters={"rope_type": "yarn", "factor": 32.0, "rope_theta": 150000.0,
                                                        "original_max_position_embeddings": 64}))


# ---- settings that do nothing -------------------------------------------------------------

@pytest.mark.parametrize("override, value", [
    ("attention.sinks=2", "2"), ("runtime.fidelity=2", "2"), ("runtime.fidelity=0", "0"),
    ("attention.sinks=yes", "'yes'"), ("workload.prefix_caching=3", "3"), ("cache.shared=1.5", "1.5"),
])
def test_a_bool_key_given_anything_but_true_or_false_is_refused(override, value):
    """OmegaConf reads any non-zero number as true: the run had sinks, or a fidelity check, because
    of a value that was meant for another key."""
    key = override.split("=")[0]
    extra = ["workload=serving"] if key.startswith("workload.") else []
    line = refusal(to_bench_config, compose(*extra, override))
    assert line == f"{key}={value}: must be true or false"


def test_true_and_false_still_read_as_bools():
    cfg = to_bench_config(compose("attention.sinks=true", "runtime.fidelity=false"))
    assert cfg.attention.sinks is True and cfg.runtime.fidelity is False


HYBRID = "attention.layer_types=[linear_attention,linear_attention,linear_attention,full_attention]"


# every registered recurrent kind's layer type is named (Gated DeltaNet's, Mamba-2's)
@pytest.mark.parametrize("overrides, says", [
    (["workload.state_checkpoint=every_n", "workload.state_checkpoint_tokens=32"],
     "no linear_attention or kda or mamba layer"),
    (["workload.state_checkpoint=prompt_end"], "no linear_attention or kda or mamba layer"),
    (["workload.state_checkpoint=prompt_end", HYBRID, "workload.prefix_caching=false"],
     "workload.prefix_caching=false"),
])
def test_a_state_checkpoint_policy_where_no_state_is_saved_is_refused(overrides, says):
    line = refusal(to_bench_config, compose("workload=serving", *overrides))
    assert line.startswith("workload.state_checkpoint=") and says in line


def test_a_state_checkpoint_policy_of_a_hybrid_with_prefix_caching_runs():
    cfg = to_bench_config(compose("workload=serving", "workload.state_checkpoint=prompt_end", HYBRID))
    assert cfg.workload.state_checkpoint == "prompt_end"


@pytest.mark.parametrize("overrides, key", [
    (["attention=mla", "attention.index_topk=1000000000000"], "attention.index_topk=1000000000000"),
    (["attention.window=1000000000000"], "attention.window=1000000000000"),
    (["task=compare", "compare.variants=[mha,mla:k1000000000000]"], "attention.index_topk=1000000000000"),
])
def test_a_top_k_longer_than_the_model_is_refused_as_a_window_that_long_is(overrides, key):
    """One bound for both: at most model.max_seq_len positions (tiny's 4096)."""
    line = refusal(to_bench_config, compose(*overrides))
    assert f"{key}: must be <= model.max_seq_len=4096" in line


def test_a_top_k_within_the_model_runs():
    assert to_bench_config(compose("attention=mla", "attention.index_topk=4096")).attention.index_topk == 4096


# ---- bounds before work -------------------------------------------------------------------

def test_a_checkpoint_pt_whose_config_says_100000_layers_is_refused_before_anything_is_built(tmp_path):
    """It built the decoder on the meta device for 70 s, then std::bad_alloc (exit 1); the saved
    config now passes the size check a config.json passes."""
    model = ModelConfig(name="t", num_layers=2, d_model=32, num_heads=4, preset_kv_heads=4, ffn_dim=64,
                        vocab_size=256, max_seq_len=64)
    path = save_checkpoint(tmp_path / "checkpoint.pt", Decoder(model, AttentionConfig().resolved(model)))
    payload = torch.load(path, weights_only=True)
    payload["model"].update(num_layers=100_000, d_model=4096, num_heads=32, preset_kv_heads=32, ffn_dim=14336)
    payload["attention"]["num_kv_heads"] = 32
    torch.save(payload, tmp_path / "huge.pt")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path / "huge.pt")
    [line] = str(info.value).splitlines()
    assert line.startswith(f"checkpoint {tmp_path / 'huge.pt'}: a model of 100000 layers, d_model 4096")
    assert "nothing was built" in line
    result = run_job(compose("task=eval", f"train.checkpoint={tmp_path / 'huge.pt'}", "wandb=disabled",
                             "runtime.isolate=false"), tmp_path / "job")
    assert result.status == "invalid" and "100000 layers" in result.error


def test_compare_variants_too_large_to_hold_are_invalid_before_the_base_is_built(tmp_path):
    """mla:r1e12 was an oom (exit 3) after the base model was built; the variants are sized with
    their caches (what an MLA rank that large holds is far past this machine)."""
    result = run_job(compose("task=compare", "compare.variants=[mha,mla:r1000000000000]", "wandb=disabled",
                             "runtime.isolate=false"), tmp_path)
    assert result.status == "invalid"
    assert result.error.startswith("compare.variants=['mha', 'mla:r1000000000000']: the variants and their base")
    assert "the largest, 'mla:r1000000000000'" in result.error and "\n" not in result.error
    assert not result.metrics.get("decode_ms_p50")
