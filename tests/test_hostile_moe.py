"""A mixture of experts that does not add up: inconsistent expert counts, a top-k larger than the
experts (or than the groups it is chosen from), a missing, surplus or misshapen expert tensor,
experts where config.json says the MLP is dense. Each is one line naming the key or the tensor,
before anything is built or read."""

import json

import pytest
import torch
from conftest import compose
from safetensors.torch import load_file, save_file
from test_moe import moe_dir

from kvbench.checkpoint import CheckpointError, load_llama_dir
from kvbench.config.model import ModelConfig
from kvbench.core.errors import ConfigError
from kvbench.jobs.job_config import to_bench_config


def one_line(info) -> str:
    [line] = str(info.value).splitlines()
    return line


QWEN = {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48, "vocab_size": 97, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16}
DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 32,
            "num_attention_heads": 4, "intermediate_size": 48, "vocab_size": 97, "kv_lora_rank": 16,
            "qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 5, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_group": 4, "topk_group": 2,
            "first_k_dense_replace": 1}
# Qwen3-Next and Qwen3.5-MoE (Gated DeltaNet hybrids) with a sigmoid-gated shared expert
QWEN_NEXT = {**QWEN, "architectures": ["Qwen3NextForCausalLM"], "shared_expert_intermediate_size": 24}
QWEN3_5_MOE = {**QWEN_NEXT, "architectures": ["Qwen3_5MoeForCausalLM"], "intermediate_size": None}
GPT_OSS = {"architectures": ["GptOssForCausalLM"], "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 16, "vocab_size": 97, "num_local_experts": 8,
           "num_experts_per_tok": 2}


@pytest.mark.parametrize("base, change, needle", [
    (QWEN, {"num_experts_per_tok": 9}, "num_experts_per_tok=9: must be <= num_experts=8"),
    (GPT_OSS, {"num_experts_per_tok": 9}, "num_experts_per_tok=9: must be <= num_local_experts=8"),
    (QWEN, {"num_local_experts": 6}, "num_experts=8, num_local_experts=6: inconsistent expert counts"),
    (DEEPSEEK, {"num_local_experts": 16}, "num_local_experts=16, n_routed_experts=8: inconsistent expert counts"),
    (DEEPSEEK, {"n_group": 3}, "n_group=3: must divide n_routed_experts=8"),
    (DEEPSEEK, {"topk_group": 5}, "topk_group=5: must be <= n_group=4"),
    (DEEPSEEK, {"topk_group": 1, "num_experts_per_tok": 3},
     "num_experts_per_tok=3: must be <= topk_group=1 groups x 2 experts per group"),
    (DEEPSEEK, {"n_group": 8}, "n_group=8: leaves 1 expert per group"),
    (DEEPSEEK, {"mlp_layer_types": ["dense", "moe"]}, "mlp_layer_types=['dense', 'moe']: must name each of "
                                                      "num_hidden_layers=2 layers dense or sparse"),
    (QWEN, {"num_experts_per_tok": None}, "missing key 'num_experts_per_tok'"),
    # transformers' defaults (128 to 512 experts, a shared expert of 512) are not guessed: the model
    # was read as dense, or without its shared expert
    (QWEN, {"num_experts": None}, "missing key 'num_experts'"),
    (QWEN3_5_MOE, {"num_experts": None}, "missing key 'num_experts'"),
    # each family is told the key its own files write (GPT-OSS was told to add num_experts)
    (GPT_OSS, {"num_local_experts": None}, "missing key 'num_local_experts' (a mixture-of-experts GptOssForCausalLM"),
    (DEEPSEEK, {"n_routed_experts": None}, "missing key 'n_routed_experts'"),
    (QWEN_NEXT, {"shared_expert_intermediate_size": None}, "missing key 'shared_expert_intermediate_size'"),
    (QWEN3_5_MOE, {"moe_intermediate_size": None}, "missing key 'moe_intermediate_size'"),
    (QWEN, {"num_experts": "8"}, "num_experts='8': must be an integer"),
    (QWEN, {"moe_intermediate_size": 0}, "moe_intermediate_size=0: must be >= 1"),
    (QWEN, {"decoder_sparse_step": 0}, "decoder_sparse_step=0: must be >= 1"),
    (GPT_OSS, {"swiglu_limit": -1.0}, "swiglu_limit=-1.0: must be > 0"),
    # GPT-OSS's published MXFP4 experts are read (tests/test_quant_weights.py); a format that is not, refused
    (GPT_OSS, {"quantization_config": {"quant_method": "bitsandbytes"}},
     "quantization_config.quant_method='bitsandbytes': not a quantized checkpoint format"),
])
def test_a_config_json_whose_experts_do_not_add_up_is_one_line_naming_its_key(base, change, needle):
    """Each was refused as 'mixture-of-experts is not supported' before experts were read; now the
    key that is wrong is named, with the file."""
    msg = one_line_error(lambda: ModelConfig.from_hf_config({**base, **change}, "ck/config.json"))
    assert msg.startswith("ck/config.json: ") and needle in msg


def one_line_error(fn) -> str:
    with pytest.raises(ConfigError) as info:
        fn()
    return one_line(info)


@pytest.mark.parametrize("override, needle", [
    ("model.moe.top_k=9", "model.moe.top_k=9: must be <= model.moe.num_experts=8"),
    ("model.moe.num_experts=6", "model.moe.n_group"),  # left valid: 6 is fine with one group
    ("model.moe.dense_layers=[5]", "model.moe.dense_layers=[5]: must name layers below model.num_layers=2"),
    ("model.moe.shared_ffn_dim=0", "model.moe.shared_gate=True: gates a shared expert, and "
                                   "model.moe.shared_ffn_dim=0 has none"),
    ("model.moe.router=noaux", "model.moe.router='noaux'"),
])
def test_a_preset_whose_experts_do_not_add_up_is_one_line_naming_its_key(override, needle):
    if override == "model.moe.num_experts=6":  # a count that still adds up is taken
        assert to_bench_config(compose("model=tiny_moe", override)).model.moe.num_experts == 6
        return
    with pytest.raises(ConfigError) as info:
        to_bench_config(compose("model=tiny_moe", override))
    assert needle in one_line(info)


# ---- the checkpoint's tensors against its config.json -----------------------------------------

def _edit_tensors(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _load_error(path) -> str:
    with pytest.raises(CheckpointError) as info:
        load_llama_dir(path)
    return one_line(info)


def test_a_missing_expert_tensor_is_named(tmp_path):
    path, _ = moe_dir(tmp_path, "qwen3_moe")
    _edit_tensors(path, lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight"))
    assert _load_error(path) == (f"{path}: missing tensor model.layers.2.mlp.experts.3.up_proj.weight (config.json: 8 "
                                 "routed experts per layer, layer 2 is a mixture of experts)")


def test_fewer_or_more_experts_than_config_json_says_are_named(tmp_path):
    path, _ = moe_dir(tmp_path, "deepseek_v3")
    _edit_config(path, n_routed_experts=16)  # the files hold 8 per layer
    assert "missing tensor model.layers.1.mlp.experts.8.gate_proj.weight (config.json: 16 routed experts" in \
        _load_error(path)
    _edit_config(path, n_routed_experts=4, n_group=2, topk_group=2)  # the files hold 8
    line = _load_error(path)
    assert "is expert 4, but config.json has 4 routed experts per layer: inconsistent expert counts" in line
    assert "tensor model.layers.1.mlp.experts.4." in line


def test_a_stacked_expert_tensor_of_another_count_or_shape_is_named(tmp_path):
    path, _ = moe_dir(tmp_path, "gpt_oss")
    _edit_config(path, num_local_experts=6)  # GPT-OSS stacks its 8 experts in one tensor per projection
    assert "holds 8 experts, config.json has 6 routed experts per layer: inconsistent expert counts" in \
        _load_error(path)
    _edit_config(path, num_local_experts=8, intermediate_size=12)
    assert "tensor model.layers.0.mlp.experts.down_proj has shape (8, 16, 32), config.json implies (8, 12, 32)" \
        in _load_error(path)


def test_an_expert_tensor_of_another_shape_is_named(tmp_path):
    path, _ = moe_dir(tmp_path, "qwen3_moe")
    _edit_config(path, moe_intermediate_size=12)
    assert "tensor model.layers.0.mlp.experts.0.down_proj.weight has shape (32, 16), config.json implies (32, 12)" \
        in _load_error(path)


def test_experts_in_a_layer_config_json_makes_dense_are_named(tmp_path):
    path, _ = moe_dir(tmp_path, "deepseek_v3")
    _edit_config(path, first_k_dense_replace=2)  # layer 1 holds experts
    assert "tensor model.layers.1.mlp.experts.0.down_proj.weight is an expert of layer 1, whose MLP config.json " \
           "makes dense" in _load_error(path)


def test_experts_stored_in_mixed_dtypes_are_named(tmp_path):
    path, _ = moe_dir(tmp_path, "qwen3_moe")
    _edit_tensors(path, lambda t: t.update({k: t[k].half() for k in ["model.layers.0.mlp.experts.5.gate_proj.weight"]}))
    # the file's tensors, not the decoder's stacked weight (blocks.0.mlp.experts.w_gate_up) they become
    assert ("tensors model.layers.0.mlp.experts.0.gate_proj.weight (F32) and model.layers.0.mlp.experts.5.gate_proj."
            "weight (F16) mix dtypes") in _load_error(path)


def test_a_non_finite_expert_weight_is_named_as_the_file_names_it(tmp_path):
    path, _ = moe_dir(tmp_path, "qwen3_moe")
    _edit_tensors(path, lambda t: t["model.layers.0.mlp.experts.2.down_proj.weight"].__setitem__((0, 0), torch.nan))
    # it named the stacked weight it becomes, blocks.0.mlp.experts.w_down
    assert "tensor model.layers.0.mlp.experts.2.down_proj.weight holds NaN or infinite values" in _load_error(path)


def test_uptraining_a_checkpoint_with_experts_under_a_dense_preset_is_refused_naming_model_moe(tmp_path):
    """train.init_from a model=tiny_moe checkpoint with model=tiny: the record would name a dense
    model while the experts were trained; refused naming model.moe before training."""
    from conftest import TEXT

    from kvbench.checkpoint import save_checkpoint
    from kvbench.jobs.runner import run_job
    from kvbench.model import Decoder

    torch.manual_seed(0)
    save_checkpoint(tmp_path / "moe.pt", Decoder(to_bench_config(compose("model=tiny_moe")).model))
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(TEXT)
    result = run_job(compose("wandb=disabled", "runtime.isolate=false", "task=train", "model=tiny",
                             f"train.init_from={tmp_path / 'moe.pt'}", "train.steps=1", f"data.path={corpus}",
                             "train.batch_size=2", "train.seq_len=16", "train.eval_batches=1"), tmp_path / "job")
    assert result.status == "invalid"
    [line] = result.error.splitlines()
    assert "the checkpoint has model.moe=MoEShape(num_experts=8" in line and "model=tiny has None" in line
