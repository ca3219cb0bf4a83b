"""Kimi Linear checkpoints through kvbench's loader (model.path), exact against transformers'
KimiLinearForCausalLM with random weights saved by save_pretrained (Kimi's own file format: the
forget gate's tensors at the top of self_attn, a convolution per q, k, v, the MLPs under
block_sparse_moe, experts as w1 / w2 / w3): KDA layers beside latent layers without rotary
embeddings, a dense MLP beside DeepSeek-V3-like experts. Logits and perplexity within 1e-5
relative, 40 greedy cached decode steps token-equal to generate after a prompt longer than the
delta rule's chunk of 64; task=eval's perplexity against transformers'; a hub-style config.json
(linear_attn_config's 1-indexed layer lists, Kimi's own key names) read as transformers reads it;
what the reader refuses, in one line naming the key."""

import json

import pytest
import torch
from conftest import edit_config_json
from hf_parity import check_greedy_steps, check_logits_and_perplexity, check_task_eval

from kvbench.checkpoint import load_llama_dir
from kvbench.config.model import ModelConfig
from kvbench.core.errors import ConfigError
from kvbench.footprint import parameter_counts
from kvbench.layouts.kda import KDA
from kvbench.layouts.latent import Latent

VOCAB = 256  # the byte corpus of task=eval
TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
KIMI = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=8, linear_head_dim=16, linear_num_heads=4, num_local_experts=8, num_experts_per_tok=2,
            n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=1.5, initializer_range=0.1,
            layer_types=TYPES, mlp_layer_types=["dense", "sparse", "sparse", "dense"], pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
PROMPT, STEPS = 70, 40  # a prompt past the delta rule's chunk (64), then cached steps

# transformers' warnings off: it falls back to the torch path compared with (conftest.quiet_transformers)
pytestmark = pytest.mark.usefixtures("quiet_transformers")


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """A random KimiLinearForCausalLM saved with save_pretrained, its norms and correction biases off
    their initial values; (dir, model). Built once for the module."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(0)
    hf = KimiLinearForCausalLM(KimiLinearConfig(**KIMI)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
        for layer in (1, 2):  # a correction bias moves the choice of experts, not their weights
            hf.model.layers[layer].mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    path = tmp_path_factory.mktemp("kimi")
    hf.save_pretrained(path)
    hf.generation_config.eos_token_id = None  # every step whatever is drawn
    return path, hf


@torch.no_grad()
def test_a_kimi_linear_checkpoint_is_transformers_in_logits_perplexity_and_40_greedy_cached_steps(kimi,
                                                                                                 one_torch_thread):
    path, hf = kimi
    model, _ = load_llama_dir(path)
    assert [type(layer) for layer in model.layouts] == [KDA, Latent, KDA, KDA]
    assert model.layouts[1].rotary is False and model.layouts.rotary_dim() == 0
    moe = model.config.moe
    assert (moe.num_experts, moe.top_k, moe.router, moe.n_group, moe.shared_ffn_dim, moe.dense_layers) == (
        8, 2, "sigmoid", 2, 32, [0, 3])
    assert model.num_params() == hf.num_parameters() == parameter_counts(model.config, model.attention).total

    tokens = torch.randint(0, VOCAB, (2, 100), generator=torch.Generator().manual_seed(1))
    check_logits_and_perplexity(model, hf, tokens, spread=0.3)
    # two chunks of the delta rule, then the recurrent step 40 times
    check_greedy_steps(model, hf, tokens[:, :PROMPT], STEPS)


def test_task_eval_of_a_kimi_linear_checkpoint_is_transformers_perplexity(kimi, tmp_path, one_torch_thread):
    """model.path's route (task=eval reads the checkpoint whole): the record's perplexity within 1e-5
    relative of transformers' over the same slices of the byte corpus (slices past one chunk)."""
    path, hf = kimi
    model = check_task_eval(path, hf, tmp_path, seq_len=80)
    assert model.preset_layer_types == ["kda", "full_attention", "kda", "kda"] and model.rope_type == "none"


def hub_config(cfg: dict) -> dict:
    """``cfg`` (a config.json as save_pretrained writes it) as Kimi's hub files write it: the KDA
    sizes and 1-indexed layer lists in linear_attn_config, first_k_dense_replace for the dense MLPs."""
    kinds = cfg.pop("layer_types")
    cfg.pop("mlp_layer_types")
    sizes = {key: cfg.pop(key) for key in ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim")}
    return {**cfg, "first_k_dense_replace": 1, "linear_attn_config": {
        "head_dim": sizes["linear_head_dim"], "num_heads": sizes["linear_num_heads"],
        "short_conv_kernel_size": sizes["linear_conv_kernel_dim"],
        "kda_layers": [i + 1 for i, t in enumerate(kinds) if t == "linear_attention"],
        "full_attn_layers": [i + 1 for i, t in enumerate(kinds) if t == "full_attention"]}}


def test_a_hub_config_json_reads_as_transformers_reads_it(kimi):
    """Kimi's hub layout of the same model (linear_attn_config, first_k_dense_replace, the hub's key
    names): the shape transformers' KimiLinearConfig gives it, layer for layer and expert for expert."""
    from transformers import KimiLinearConfig

    path, _ = kimi
    hub = hub_config(json.loads((path / "config.json").read_text()))
    theirs = KimiLinearConfig(**{k: v for k, v in hub.items() if k != "architectures"})
    ours = ModelConfig.from_hf_config(hub)
    kinds = {"linear_attention": "kda", "full_attention": "full_attention"}
    assert ours.preset_layer_types == [kinds[t] for t in theirs.layer_types] == ["kda", "full_attention", "kda", "kda"]
    assert ours.moe.dense_layers == [i for i, t in enumerate(theirs.mlp_layer_types) if t == "dense"] == [0]
    assert (ours.moe.num_experts, ours.moe.top_k, ours.moe.n_group, ours.moe.norm_topk_prob) == (
        theirs.num_local_experts, theirs.num_experts_per_tok, theirs.n_group, theirs.norm_topk_prob)
    assert ours.layer_shapes["kda"] == {"linear_num_heads": theirs.linear_num_heads,
                                        "linear_head_dim": theirs.linear_head_dim,
                                        "linear_conv_kernel_dim": theirs.linear_conv_kernel_dim}
    assert ours.max_seq_len == theirs.max_position_embeddings and ours.head_dim == theirs.qk_head_dim


@pytest.mark.parametrize("changes, line", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu': not supported in a KDA layer (silu only)"),
    ({"attention_bias": True}, "attention_bias=True: a latent layer has no projection biases (use false)"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2: must equal num_attention_heads=4 in a latent layer"),
    ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types=['dense', 'sparse']: must name each of "
                                               "num_hidden_layers=4 layers dense or sparse"),
    ({"num_experts_per_token": 9}, "num_experts_per_token=9: must be <= num_experts=8"),
    ({"num_expert_group": 3}, "num_expert_group=3: must divide num_experts=8"),
    ({"num_experts": "8"}, "num_experts='8': must be an integer"),
    ({"layer_types": ["linear_attention", "mamba", "full_attention", "linear_attention"]}, "layer_types="),
])
def test_a_config_json_it_cannot_run_is_refused_in_one_line_naming_the_key(kimi, tmp_path, changes, line):
    """Each refusal names the file, then config.json's key and value; nothing is built."""
    path, _ = kimi
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text((path / "config.json").read_text())
    edit_config_json(ck, **changes)
    with pytest.raises(ConfigError) as info:
        ModelConfig(path=str(ck))
    message = str(info.value)
    assert "\n" not in message and f"config.json: {line}" in message, message
