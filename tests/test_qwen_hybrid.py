"""Qwen3.5, Qwen3-Next and Qwen3.5-MoE on kvbench's decoder: Gated DeltaNet layers beside full attention
with an output gate, partial rotary and zero-centred norms, dense MLPs or mixtures of experts with
a sigmoid-gated shared expert, loaded from config.json +
safetensors and exact against transformers' own classes with random weights (logits, perplexity
within 1e-4 relative, 45 greedy cached decode steps token for token); what does not fit is one
line naming the key."""

import json
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TEXT, edit_config_json, eval_job, transformers_perplexity

from kvbench.cache import cache_for
from kvbench.checkpoint import CheckpointError, load_llama_dir, to_layout
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.core.errors import ConfigError
from kvbench.generate import greedy_generate
from kvbench.layouts.gated_deltanet import GatedDeltaNet, model_shape
from kvbench.layouts.kinds import registered
from kvbench.layouts.kv_heads import KVHeads

VOCAB = 97
# 8 layers: linear, linear, linear, full, twice (full_attention_interval 4); value heads sharing key
# heads, d_k != d_v; head_dim 16 with rotary over its first 4 (transformers' default factor 0.25)
SHAPE = dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=160, rms_norm_eps=1e-5,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
             initializer_range=0.1)
FAMILIES = ["qwen3_5", "qwen3_5_vl", "qwen3_next", "qwen3_5_tied_half_rotary", "qwen3_next_moe", "qwen3_5_moe"]
# 8 experts of 24, 2 per token, and a shared expert of 40 scaled by sigmoid(x . w)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)
MOE_DENSE_LAYERS = {"qwen3_next_moe": [0, 2, 4, 5, 6], "qwen3_5_moe": []}


@pytest.fixture(autouse=True)
def _quiet():
    """transformers logs that flash-linear-attention and causal-conv1d are not installed (its torch
    path is the reference) and that generate's settings were defaulted."""
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


def qwen_dir(tmp_path, family, **overrides):
    """A random transformers model of ``family`` saved with save_pretrained; (dir, model). The norms
    are drawn around their neutral value (zero-centred: around 0), the decays slow enough that the
    state carries across the sequence."""
    import transformers

    torch.manual_seed(0)
    shape = {**SHAPE, **overrides}
    moe = {key: shape.pop(key, value) for key, value in MOE.items()}  # MOE, as overridden
    if family == "qwen3_next":  # dense: every layer's MLP is listed as a plain one
        config = transformers.Qwen3NextConfig(**shape, num_experts=4, mlp_only_layers=list(range(8)))
        hf = transformers.Qwen3NextForCausalLM(config)
    elif family == "qwen3_next_moe":  # experts where (i + 1) % 2 == 0 but in layer 5 (mlp_only_layers)
        config = transformers.Qwen3NextConfig(**shape, **moe, decoder_sparse_step=2, mlp_only_layers=[5])
        hf = transformers.Qwen3NextForCausalLM(config)
    elif family == "qwen3_5_moe":  # experts in every layer (no intermediate_size: no dense MLP)
        config = transformers.Qwen3_5MoeTextConfig(**{k: v for k, v in shape.items() if k != "intermediate_size"},
                                                   **moe)
        hf = transformers.Qwen3_5MoeForCausalLM(config)
    elif family == "qwen3_5_vl":  # the multimodal checkpoint: its language model under model.language_model.
        vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=64, patch_size=4)
        config = transformers.Qwen3_5Config(text_config=shape, vision_config=vision)
        hf = transformers.Qwen3_5ForConditionalGeneration(config)
    else:
        if family == "qwen3_5_tied_half_rotary":
            shape.update(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                                    "partial_rotary_factor": 0.5})
        config = transformers.Qwen3_5TextConfig(**shape)
        hf = transformers.Qwen3_5ForCausalLM(config)
    hf.eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.001, 0.3).log())
            elif name.endswith("dt_bias"):
                p.normal_()
            elif "linear_attn.norm" in name:  # the gated norm's weight is around 1
                p.normal_(1.0, 0.3)
            elif "norm" in name and "visual" not in name:  # zero-centred: (1 + weight)
                p.uniform_(-0.5, 0.5)
    hf.save_pretrained(tmp_path)
    hf.generation_config.eos_token_id = None  # 45 steps whatever is drawn
    return tmp_path, hf


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_each_family_is_transformers_in_logits_perplexity_and_45_greedy_cached_steps(tmp_path, family):
    path, hf = qwen_dir(tmp_path, family)
    model, _ = load_llama_dir(path)
    half = family == "qwen3_5_tied_half_rotary"
    kinds = [type(layer) for layer in model.layouts]
    assert kinds == [GatedDeltaNet, GatedDeltaNet, GatedDeltaNet, KVHeads] * 2
    full = model.layouts[3]
    assert full.output_gate and full.rotary_dim == (8 if half else 4) and model.config.norm_zero_centered
    assert model.config.linear_num_value_heads == 4 and model.layouts[0].linear_value_head_dim == 12
    moe = model.config.moe
    if family in MOE_DENSE_LAYERS:
        assert moe.dense_layers == MOE_DENSE_LAYERS[family] and moe.shared_gate and moe.norm_topk_prob
        assert (moe.num_experts, moe.top_k, moe.expert_ffn_dim, moe.shared_ffn_dim) == (8, 2, 24, 40)
    else:
        assert moe is None

    tokens = torch.randint(0, VOCAB, (2, 150), generator=torch.Generator().manual_seed(1))
    ours, theirs = model(tokens), hf(tokens).logits
    # transformers' delta rule rounds to float32 inside whatever the dtype (1e-6 per linear layer here,
    # also in float64): over 6 linear layers about 2e-5 of logits whose spread is about 1
    assert (ours - theirs).abs().max().item() <= 1e-4 and theirs.std() > 0.5
    ce = [F.cross_entropy(x[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).item() for x in (ours, theirs)]
    assert math.exp(ce[0]) == pytest.approx(math.exp(ce[1]), rel=1e-4)

    prompt = tokens[:, :23]  # a prompt that is no multiple of the chunk, then 45 cached steps
    got = greedy_generate(model, prompt, 45, cache_for(model, "static", 2, 69)).tokens  # (2, 46)
    want = hf.generate(prompt, max_new_tokens=46, do_sample=False, min_new_tokens=46)[:, 23:]
    assert torch.equal(got, want)
    assert len(set(got[0].tolist())) > 5  # the steps do not repeat one token


@pytest.mark.parametrize("family", ["qwen3_5_vl", "qwen3_next_moe"])
@torch.no_grad()
def test_attention_bias_is_a_bias_on_q_k_v_and_o_as_transformers_reads_it(tmp_path, family):
    path, hf = qwen_dir(tmp_path / "drawn", family, attention_bias=True)
    for name, p in hf.named_parameters():
        if name.endswith(".bias"):  # drawn, not transformers' zeros
            p.normal_()
    hf.save_pretrained(tmp_path / "ck")
    model, _ = load_llama_dir(tmp_path / "ck")
    assert model.config.qkv_bias and model.config.o_bias
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", list(MOE_DENSE_LAYERS))
@torch.no_grad()
def test_a_moe_checkpoint_without_a_shared_expert_is_transformers(tmp_path, family):
    """shared_expert_intermediate_size=0: transformers builds a shared expert 0 wide (empty tensors)
    and the gate that scales its output of 0; kvbench builds neither and matches its logits and
    greedy tokens. A shared expert that holds weights beside a width of 0 is still refused."""
    path, hf = qwen_dir(tmp_path / "none", family, shared_expert_intermediate_size=0)
    model, _ = load_llama_dir(path)
    assert model.config.moe.shared_ffn_dim == 0 and not model.config.moe.shared_gate
    assert not any("shared" in name for name in model.state_dict())
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4
    got = greedy_generate(model, tokens[:, :9], 20, cache_for(model, "static", 2, 30)).tokens
    assert torch.equal(got, hf.generate(tokens[:, :9], max_new_tokens=21, do_sample=False, min_new_tokens=21)[:, 9:])
    path, _ = qwen_dir(tmp_path / "one", family)
    edit_config_json(path, shared_expert_intermediate_size=0)
    with pytest.raises(CheckpointError, match=r"unexpected \['model\.layers\.\d\.mlp\.shared_expert\."
                                              r"down_proj\.weight'"):
        load_llama_dir(path)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_task_eval_of_a_hybrid_checkpoint_is_transformers_perplexity(tmp_path, family):
    """task=eval (the record's perplexity) through the decoder's own windows of the byte corpus."""
    from kvbench.quality.train import run_eval

    path, hf = qwen_dir(tmp_path / family, family, vocab_size=256)
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(TEXT)
    model = ModelConfig(num_layers=1, d_model=32, num_heads=4, preset_kv_heads=4, ffn_dim=64, vocab_size=256,
                        max_seq_len=128)  # the checkpoint's shape replaces it (task=eval)
    cfg = eval_job(model, AttentionConfig(), corpus, path, val_fraction=0.25, seq_len=100, batch_size=2)
    m = run_eval(cfg, torch.device("cpu"))
    assert m["perplexity"] == pytest.approx(transformers_perplexity(hf, cfg), rel=1e-4)


def hf_json(**change):
    """A Qwen3-Next config.json as the release writes it (no layer_types, no partial_rotary_factor:
    transformers' defaults apply), scaled down."""
    cfg = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 64,
           "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "intermediate_size": 96, "vocab_size": VOCAB, "max_position_embeddings": 160, "rope_theta": 1e7,
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
           "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
           "num_experts": 512, "decoder_sparse_step": 1, "mlp_only_layers": list(range(8))}
    cfg.update(change)
    return {k: v for k, v in cfg.items() if v is not None}


def test_a_release_style_config_reads_transformers_defaults():
    m = ModelConfig.from_hf_config(hf_json(), "ck/config.json")
    assert m.partial_rotary_factor == 0.25 and m.rotary_dim == 4 and m.attn_output_gate and m.norm_zero_centered
    assert m.preset_layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"]
    assert m.rope_theta == 1e7 and model_shape(m)["linear_num_value_heads"] == 4
    # rope_parameters' factor and theta, as transformers standardises them; the top level's beside
    # another value in rope_parameters is a file that disagrees with itself (tests/test_hostile_round5.py)
    m = ModelConfig.from_hf_config(hf_json(partial_rotary_factor=None, rope_theta=None, rope_parameters={
        "rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}), "ck/config.json")
    assert (m.partial_rotary_factor, m.rope_theta) == (0.5, 1e6)
    with pytest.raises(ConfigError, match=r"^ck/config.json: partial_rotary_factor=0.75 and "
                                          r"rope_parameters.partial_rotary_factor=0.5 disagree"):
        ModelConfig.from_hf_config(hf_json(partial_rotary_factor=0.75, rope_theta=None, rope_parameters={
            "rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}), "ck/config.json")
    assert ModelConfig.from_hf_config(hf_json(partial_rotary_factor=0.75)).rotary_dim == 12
    # every layer's MLP dense another way: no experts
    assert ModelConfig.from_hf_config(hf_json(num_experts=0, mlp_only_layers=None)).num_layers == 8


@pytest.mark.parametrize("change, line", [
    # layers 3.. are mixtures of experts (model.moe), checked as they are read; transformers' default
    # shared expert (512 wide) is not guessed
    ({"mlp_only_layers": [0, 1, 2]}, "ck/config.json: missing key 'shared_expert_intermediate_size'"),
    ({"mlp_only_layers": [0, 1, 2], "moe_intermediate_size": 8, "shared_expert_intermediate_size": 16,
      "num_experts_per_tok": 513},
     "ck/config.json: num_experts_per_tok=513: must be <= num_experts=512 (a token picks k of the experts)"),
    ({"mlp_only_layers": list(range(8)), "decoder_sparse_step": 2, "mlp_only_layers_": None}, None),
    ({"layer_types": ["linear_attention", "mamba"] * 4},
     "ck/config.json: layer_types=['linear_attention', 'mamba', 'linear_attention', 'mamba', 'linear_attention', "
     "'mamba', 'linear_attention', 'mamba']: not supported (each entry sliding_attention or full_attention or "
     "linear_attention)"),
    ({"layer_types": ["linear_attention", "full_attention"]},
     "ck/config.json: layer_types=['linear_attention', 'full_attention']: must name each of "
     "num_hidden_layers=8 layers"),
    ({"linear_num_value_heads": 5}, "ck/config.json: linear_num_value_heads=5: must be a multiple of "
     "linear_num_key_heads=2 (each key head serves the same number of value heads)"),
    ({"full_attention_interval": 0}, "ck/config.json: full_attention_interval=0: must be >= 1 (every k-th layer full "
     "attention)"),
    ({"partial_rotary_factor": 0.1}, "ck/config.json: partial_rotary_factor=0.1: must be in (0, 1] and rotate "
     "an even number >= 2 of the head_dim=16 dimensions (int(head_dim x factor) = 1)"),
])
def test_what_does_not_fit_is_one_line_naming_the_key(change, line):
    change = {k: v for k, v in change.items() if not k.endswith("_")}
    if line is None:  # decoder_sparse_step 2 with every layer listed: still dense
        assert ModelConfig.from_hf_config(hf_json(**change)).num_layers == 8
        return
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf_config(hf_json(**change), "ck/config.json")
    assert str(info.value) == line


def test_linear_layers_are_refused_for_an_architecture_without_them():
    cfg = {**hf_json(), "architectures": ["Qwen3ForCausalLM"], "layer_types": ["linear_attention"] * 8,
           "num_experts": None, "partial_rotary_factor": None}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(ConfigError, match=r"^ck/config.json: layer_types=\['linear_attention', .*: not supported "
                                          r"\(each entry sliding_attention or full_attention\)$"):
        ModelConfig.from_hf_config(cfg, "ck/config.json")
    # the class: a kind read only from its own architecture's file (DeepSeek-V4's compressed layers, Kimi's
    # KDA, Nemotron-H's mamba) is no layer of a Llama-form one, nor offered there
    for kind in registered():
        if (kind.recurrent or kind.named) and kind.layer_types:
            cfg["layer_types"] = [kind.layer_types[0], "full_attention"] * 4
            with pytest.raises(ConfigError) as info:
                ModelConfig.from_hf_config(cfg, "ck/config.json")
            assert str(info.value).endswith(": not supported (each entry sliding_attention or full_attention)")


def test_a_fused_projection_of_the_wrong_shape_names_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = qwen_dir(tmp_path, "qwen3_next")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.linear_attn.in_proj_qkvz.weight"
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        load_llama_dir(path)
    assert str(info.value) == f"{path}: tensor {name} has shape (127, 64), config.json implies (128, 64)"


def test_a_checkpoints_linear_layers_cannot_be_converted_away(tmp_path):
    path, _ = qwen_dir(tmp_path, "qwen3_5")
    model, _ = load_llama_dir(path)
    attention = AttentionConfig(full_attention_interval=0).resolved(model.config)
    with pytest.raises(CheckpointError, match=r"^attention.layer_types=None: the checkpoint's Gated DeltaNet layers "
                                              r"are \[0, 1, 2, 4, 5, 6\] \(converting"):
        to_layout(model, attention)
    # its KV heads still convert (the full layers' only), the linear layers kept
    repeated, how = to_layout(model, AttentionConfig(type="mha").resolved(model.config))
    assert how == "repeat" and [type(x) for x in repeated.layouts] == [type(x) for x in model.layouts]
    tokens = torch.randint(0, VOCAB, (1, 40))
    with torch.no_grad():
        assert (repeated(tokens) - model(tokens)).abs().max() <= 1e-5


def test_the_config_json_written_matches_what_was_read(tmp_path):
    """The keys the reader depends on are where save_pretrained writes them (a guard against a
    transformers version that moves them: the parity above would then test defaults only)."""
    path, _ = qwen_dir(tmp_path, "qwen3_5_vl")
    saved = json.loads((path / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "text_config" in saved
    assert saved["text_config"]["linear_num_value_heads"] == 4
