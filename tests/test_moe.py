"""Mixture-of-experts MLPs (model.moe): each router and expert form against transformers' own
modules (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, DeepSeek-V2/V3, GPT-OSS) on random weights; whole
DeepSeek-V3, DeepSeek-V2, Qwen3-MoE and GPT-OSS checkpoints against transformers (prefill
perplexity, 40 greedy cached decode steps); config.json read per family; the presets' parameter
counts against the model cards; the bytes a decode step reads, from its router."""

import inspect
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import VOCAB, compose, deepseek_dir, edit_config_json, reread

from kvbench.cache import cache_for
from kvbench.checkpoint import load_llama_dir
from kvbench.config import hf as hf_config
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.core.errors import ConfigError
from kvbench.core.moe import MoEShape
from kvbench.footprint import parameter_counts
from kvbench.generate import compiled_graphs, compiled_step, greedy_generate
from kvbench.jobs.job_config import to_bench_config
from kvbench.jobs.runner import run_job
from kvbench.measure.roofline import decode_bytes_read, decode_flops
from kvbench.mlp.experts import MoE, record_routing
from kvbench.model import Decoder
from kvbench.results import RunResult
from kvbench.rope import rope_inv_freq

C = 32  # d_model of every small model here


def _randomise(module, scale=0.3):
    """Random weights of a size that makes routing and clamps matter (transformers starts routers
    and biases at zero); norms near 1; DeepSeek's correction bias too (a buffer)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias") or "sinks" in name:
                p.uniform_(-0.5, 0.5)
            else:
                p.normal_(0, scale)
        for name, b in module.named_buffers():
            if "correction_bias" in name:
                b.uniform_(-0.3, 0.3)


def _deinterleave(t):  # GPT-OSS's gate, up, gate, up ... columns -> gate then up
    return torch.cat([t[..., ::2], t[..., 1::2]], -1)


def _copy_moe(ours: MoE, theirs) -> None:
    """transformers' MoE block weights into kvbench's (module names of each family)."""
    sd = theirs.state_dict()
    gpt_oss = "router.bias" in sd
    with torch.no_grad():
        router = "router" if gpt_oss else "gate"
        ours.router.weight.copy_(sd[f"{router}.weight"])
        if gpt_oss:
            ours.router.bias.copy_(sd["router.bias"])
            ours.experts.w_gate_up.copy_(_deinterleave(sd["experts.gate_up_proj"]).transpose(1, 2))
            ours.experts.b_gate_up.copy_(_deinterleave(sd["experts.gate_up_proj_bias"]))
            ours.experts.w_down.copy_(sd["experts.down_proj"].transpose(1, 2))
            ours.experts.b_down.copy_(sd["experts.down_proj_bias"])
        else:
            ours.experts.w_gate_up.copy_(sd["experts.gate_up_proj"])
            ours.experts.w_down.copy_(sd["experts.down_proj"])
        if "gate.e_score_correction_bias" in sd:
            ours.correction_bias.copy_(sd["gate.e_score_correction_bias"])
        for prefix in ("shared_expert.", "shared_experts."):
            for mine, hf in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
                if f"{prefix}{hf}.weight" in sd:
                    getattr(ours.shared, mine).weight.copy_(sd[f"{prefix}{hf}.weight"])
        if "shared_expert_gate.weight" in sd:
            ours.shared_gate.weight.copy_(sd["shared_expert_gate.weight"])


def _block(name):
    """(transformers' MoE block, kvbench's MoEShape of it) for each family."""
    import transformers
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    common = dict(hidden_size=C, moe_intermediate_size=16, num_experts_per_tok=3)
    if name == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, num_experts=8, norm_topk_prob=False)
        return Qwen3MoeSparseMoeBlock(cfg), MoEShape(8, 3, 16)
    if name == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(**common, num_experts=8, shared_expert_intermediate_size=24)
        return Qwen3NextSparseMoeBlock(cfg), MoEShape(8, 3, 16, norm_topk_prob=True, shared_ffn_dim=24,
                                                      shared_gate=True)
    if name == "qwen3_5_moe":
        cfg = transformers.Qwen3_5MoeTextConfig(**common, num_experts=8, shared_expert_intermediate_size=24)
        return Qwen3_5MoeSparseMoeBlock(cfg), MoEShape(8, 3, 16, norm_topk_prob=True, shared_ffn_dim=24,
                                                       shared_gate=True)
    if name == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(**common, n_routed_experts=16, n_group=4, topk_group=2,
                                            n_shared_experts=2, routed_scaling_factor=2.5)
        return DeepseekV3MoE(cfg), MoEShape(16, 3, 16, router="sigmoid", norm_topk_prob=True,
                                            routed_scaling_factor=2.5, n_group=4, topk_group=2, shared_ffn_dim=32)
    if name == "deepseek_v2":
        cfg = transformers.DeepseekV2Config(**common, n_routed_experts=16, n_group=4, topk_group=2, n_shared_experts=1,
                                            topk_method="group_limited_greedy", routed_scaling_factor=1.5)
        return DeepseekV2Moe(cfg), MoEShape(16, 3, 16, routed_scaling_factor=1.5, n_group=4, topk_group=2,
                                            shared_ffn_dim=16)
    # GPT-OSS: a low clamp, so that the clamped SwiGLU's limits are reached
    cfg = transformers.GptOssConfig(hidden_size=C, intermediate_size=16, num_local_experts=8, num_experts_per_tok=3,
                                    swiglu_limit=0.6, swiglu_alpha=1.3)
    return GptOssMLP(cfg), MoEShape(8, 3, 16, router="softmax_topk", router_bias=True, expert_bias=True,
                                    swiglu_limit=0.6, swiglu_alpha=1.3)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_next", "qwen3_5_moe", "deepseek_v3", "deepseek_v2", "gpt_oss"])
def test_each_moe_block_is_transformers_own_module(name):
    """kvbench's MoE against transformers' block of each family on 60 tokens: the same output
    (float32, <= 1e-5), so its router picks the same experts with the same weights. Qwen3-Next's
    and Qwen3.5-MoE's whole models need their Gated DeltaNet layers loaded from a checkpoint, which
    kvbench's loader does not read yet: their MoE is checked here, at the module."""
    theirs, shape = _block(name)
    _randomise(theirs)
    ours = MoE(ModelConfig(d_model=C, num_heads=4, preset_kv_heads=4, moe=shape))
    _copy_moe(ours, theirs.eval())
    x = torch.randn(3, 20, C, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(x)
        want = want[0] if isinstance(want, tuple) else want  # GPT-OSS returns its router scores too
        got = ours(x)
    assert (got - want).abs().max().item() <= 1e-5
    assert want.abs().max().item() > 0.1  # the experts' outputs are not vanishing
    if name == "gpt_oss":  # the clamp is exercised: some gate and up values pass the limit
        h = torch.einsum("nc,eic->nei", x.reshape(-1, C), ours.experts.w_gate_up)
        assert (h.abs() > 0.6).any()


# ---- whole checkpoints ----------------------------------------------------------------------

STEPS = 40
_SHAPE = dict(hidden_size=C, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
              max_position_embeddings=128, rms_norm_eps=1e-5)
_MLA = dict(num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=6, qk_rope_head_dim=4,
            v_head_dim=5, intermediate_size=48, moe_intermediate_size=16)
FAMILIES = {
    # layer 0 dense (first_k_dense_replace), 1-2 experts: sigmoid, the best 2 of 4 groups, a shared expert
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(_MLA, first_k_dense_replace=1, n_routed_experts=8, n_group=4, topk_group=2,
                         num_experts_per_tok=3, n_shared_experts=1)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(_MLA, first_k_dense_replace=1, n_routed_experts=8, n_group=4, topk_group=2,
                         num_experts_per_tok=3, n_shared_experts=2, topk_method="group_limited_greedy",
                         routed_scaling_factor=1.5)),
    # layer 1 dense (mlp_only_layers)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])),
    # sinks, windows of 6 on layers 0 and 2, q/k/v/o biases, yarn with truncate=false, a clamp that bites
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=8, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=6,
                     swiglu_limit=1.0)),
}


def moe_dir(tmp_path, family, **overrides):
    """A tiny random transformers checkpoint of ``family`` (:data:`FAMILIES`) saved with
    save_pretrained; returns (dir, hf model)."""
    import transformers

    config_name, model_name, shape = FAMILIES[family]
    cfg = getattr(transformers, config_name)(**{**_SHAPE, **shape, **overrides})
    cfg._attn_implementation = "eager"
    hf = getattr(transformers, model_name)(cfg).eval()
    _randomise(hf, scale=0.2)
    hf.save_pretrained(tmp_path)
    return tmp_path, hf


def _hf_greedy(hf, prompt, steps):
    """transformers' own greedy decode through its cache: the tokens after the prompt (B, steps)."""
    past_name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = hf(prompt, use_cache=True)
        tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]
        for _ in range(steps - 1):
            out = hf(tokens[-1], **{past_name: out.past_key_values}, use_cache=True)
            tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(tokens, 1)


def _perplexity(logits, tokens):
    return math.exp(F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).item())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_moe_checkpoint_is_transformers_over_prefill_and_40_greedy_cached_steps(tmp_path, family):
    """A whole random checkpoint loaded from its directory: perplexity of a 64-token prefill within
    1e-4 relative of transformers', and 40 greedy decode steps through kvbench's cache the tokens
    transformers' own cached decode picks. GPT-OSS: sinks, alternating windows (decoded well past
    the window of 6), biases on q/k/v/o and its experts, yarn with truncate=false."""
    path, hf = moe_dir(tmp_path, family)
    model, _ = load_llama_dir(path)
    assert model.config.moe is not None and any(isinstance(b.mlp, MoE) for b in model.blocks)
    gen = _assert_exact(model, hf, "cpu")
    assert len(set(gen.tokens.flatten().tolist())) > 4  # not one token repeated


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_a_deepseek_checkpoint_with_no_shared_expert_is_transformers(tmp_path, family):
    """n_shared_experts=0: transformers builds a shared expert 0 wide (empty tensors in the file, an
    output of 0); kvbench builds none and reads the rest: the same perplexity and greedy tokens. A
    shared expert that holds weights beside n_shared_experts=0 is still refused, naming them."""
    path, hf = moe_dir(tmp_path / "none", family, n_shared_experts=0)
    model, _ = load_llama_dir(path)
    experts = [b.mlp for b in model.blocks if isinstance(b.mlp, MoE)]
    assert model.config.moe.shared_ffn_dim == 0 and experts and all(m.shared is None for m in experts)
    _assert_exact(model, hf, "cpu")
    path, _ = moe_dir(tmp_path / "one", family)
    edit_config_json(path, n_shared_experts=0)
    with pytest.raises(ConfigError, match=r"unexpected \['model\.layers\.1\.mlp\.shared_experts\.down_proj\.weight'"):
        load_llama_dir(path)


def _assert_exact(model, hf, device):
    """Perplexity of a 64-token prefill within 1e-4 relative of transformers', and STEPS greedy
    cached steps its tokens; returns kvbench's generation."""
    tokens = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        ours, theirs = _perplexity(model(tokens), tokens), _perplexity(hf(tokens).logits, tokens)
    assert ours == pytest.approx(theirs, rel=1e-4)
    prompt = tokens[:, :16]
    with torch.no_grad():
        gen = greedy_generate(model, prompt, STEPS, cache_for(model, "static", 2, 16 + STEPS))
    assert torch.equal(gen.tokens[:, :STEPS], _hf_greedy(hf, prompt, STEPS))
    return gen


@pytest.mark.parametrize("family, drop, changes, windows", [
    # GPT-OSS left without keys: GptOssConfig's alternating layers, yarn over theta 150000, eps 1e-5
    ("gpt_oss", ("layer_types", "rope_parameters", "rms_norm_eps"), {}, [6, None, 6]),
    # Qwen3-MoE's window is on every layer: max_window_layers and layer_types are not its keys
    ("qwen3_moe", (), {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 1}, [4, 4, 4]),
    ("qwen3_moe", (), {"sliding_window": 4, "use_sliding_window": True,
                       "layer_types": ["full_attention", "sliding_attention", "full_attention"]}, [4, 4, 4]),
])
def test_moe_config_json_is_read_as_its_transformers_class_reads_it(tmp_path, family, drop, changes, windows):
    """Window keys the class does not read, and its own defaults for keys left out: the windows, and
    the logits of 24 tokens (past the windows) against transformers reading the same file."""
    path, _ = moe_dir(tmp_path, family)
    edit_config_json(path, drop, **changes)
    model, _ = load_llama_dir(path)
    assert list(model.layouts.windows) == windows
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(tokens) - reread(path)(tokens).logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32"])
def test_a_deepseek_v3_config_json_without_first_k_dense_replace_has_transformers_three_dense_layers(
        tmp_path, family):
    """DeepseekV3Config and DeepseekV32Config default first_k_dense_replace to 3 (V2's to 0): a
    config.json that leaves it out (and V3.2's mlp_layer_types) has three dense layers, not none
    (read as 0, the dense layers' tensors were refused as not the model's)."""
    dsa = dict(index_topk=8, index_n_heads=8, index_head_dim=8) if family == "deepseek_v32" else {}
    path, hf = deepseek_dir(tmp_path, family, num_hidden_layers=4, first_k_dense_replace=3,
                            moe_intermediate_size=8, **dsa)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(
        {k: v for k, v in config.items() if k not in ("first_k_dense_replace", "mlp_layer_types")}))
    model, _ = load_llama_dir(path)
    assert model.config.moe.dense_layers == [0, 1, 2]
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 1e-5


def test_gpt_oss_yarn_is_transformers_untruncated_ramp(tmp_path):
    """GPT-OSS's yarn (truncate=false: the ramp's ends not rounded) gives transformers' inverse
    frequencies, which the rounded ramp would not."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path, hf = moe_dir(tmp_path, "gpt_oss")
    model, _ = load_llama_dir(path)
    assert model.config.rope_truncate is False and model.config.rope_type == "yarn"
    theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](hf.config, "cpu")
    torch.testing.assert_close(rope_inv_freq(model.config).float(), theirs, rtol=1e-6, atol=0)
    rounded = ModelConfig(**{**vars(model.config), "rope_truncate": True, "moe": vars(model.config.moe)})
    assert not torch.allclose(rope_inv_freq(rounded).float(), theirs, rtol=1e-4, atol=0)


# ---- config.json per family --------------------------------------------------------------------

def test_the_sparse_layers_of_each_family_follow_transformers_rules():
    """Qwen3-MoE: not in mlp_only_layers and (i + 1) a multiple of decoder_sparse_step; DeepSeek:
    from first_k_dense_replace on; Qwen3.5-MoE and GPT-OSS: every layer; Qwen3-Next and Qwen3.5
    have a sigmoid-gated shared expert; no experts: a dense model."""
    qwen = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    moe = hf_config._hf_moe({**qwen, "decoder_sparse_step": 2, "mlp_only_layers": [3]}, "Qwen3MoeForCausalLM", 6)
    assert moe["moe"]["dense_layers"] == [0, 2, 3, 4] and moe["moe"]["norm_topk_prob"] is False
    moe = hf_config._hf_moe({**qwen, "shared_expert_intermediate_size": 24, "norm_topk_prob": False,
                             "decoder_sparse_step": 2}, "Qwen3_5MoeForCausalLM", 4)["moe"]
    assert (moe["dense_layers"], moe["norm_topk_prob"], moe["shared_ffn_dim"], moe["shared_gate"]) == \
        ([], True, 24, True)
    moe = hf_config._hf_moe({**qwen, "shared_expert_intermediate_size": 24}, "Qwen3NextForCausalLM", 2)["moe"]
    assert (moe["norm_topk_prob"], moe["shared_gate"]) == (True, True)
    assert hf_config._hf_moe({**qwen, "num_experts": 0}, "Qwen3MoeForCausalLM", 2) == {}
    ds = {"n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 8, "first_k_dense_replace": 3}
    moe = hf_config._hf_moe(ds, "DeepseekV3ForCausalLM", 5)["moe"]
    assert (moe["dense_layers"], moe["router"], moe["n_group"], moe["topk_group"], moe["shared_ffn_dim"],
            moe["routed_scaling_factor"]) == ([0, 1, 2], "sigmoid", 8, 4, 8, 2.5)
    moe = hf_config._hf_moe(ds, "DeepseekV2ForCausalLM", 5)["moe"]  # greedy: no groups
    assert (moe["router"], moe["n_group"], moe["norm_topk_prob"], moe["shared_ffn_dim"]) == ("softmax", 1, False, 16)
    assert hf_config._hf_moe({**ds, "first_k_dense_replace": 5}, "DeepseekV3ForCausalLM", 5) == {}
    v32 = {**ds, "mlp_layer_types": ["dense", "sparse", "dense", "sparse", "sparse"]}  # DeepSeek-V3.2 names each layer
    assert hf_config._hf_moe(v32, "DeepseekV32ForCausalLM", 5)["moe"]["dense_layers"] == [0, 2]
    assert hf_config._hf_moe({"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16},
                             "GptOssForCausalLM", 2)["moe"]["dense_layers"] == []


# ---- parameters ---------------------------------------------------------------------------------

MOE_SHAPES = [dict(num_experts=8, top_k=2, expert_ffn_dim=16, dense_layers=[0]),
              dict(num_experts=8, top_k=3, expert_ffn_dim=16, router="sigmoid", n_group=4, topk_group=2,
                   shared_ffn_dim=24, dense_layers=[1]),
              dict(num_experts=4, top_k=2, expert_ffn_dim=8, router="softmax_topk", router_bias=True, expert_bias=True,
                   swiglu_limit=7.0, shared_ffn_dim=8, shared_gate=True)]


@pytest.mark.parametrize("moe", MOE_SHAPES)
@pytest.mark.parametrize("attention", [AttentionConfig(type="gqa", num_kv_heads=2), AttentionConfig(type="mla")])
def test_parameter_counts_without_building_are_the_built_decoders(moe, attention):
    """The footprint's counts (one block per kind of layer on the meta device) equal the decoder's
    own, dense and expert layers mixed; active = total - the embedding table - the experts a token
    is not routed to (the MoEShape formula, by hand)."""
    model = ModelConfig(num_layers=3, d_model=C, num_heads=4, preset_kv_heads=4, ffn_dim=48, vocab_size=VOCAB,
                        moe=moe)
    counts = parameter_counts(model, attention)
    built = Decoder(model, attention)
    assert counts.total == built.num_params()
    expert = built.blocks[2].mlp.experts
    per_expert = sum(p[0].numel() for p in expert.parameters())
    assert per_expert == model.moe.expert_params(C)
    sparse = 3 - len(model.moe.dense_layers)
    unused = sparse * (model.moe.num_experts - model.moe.top_k) * per_expert
    assert counts.active == counts.total - VOCAB * C - unused and counts.embedding == VOCAB * C
    assert sum(p.numel() for p in built.blocks[2].mlp.parameters()) == model.moe.layer_params(C)


@pytest.mark.parametrize("dense", [[], [0], [1, 3], [0, 1, 2, 3]])
def test_parameter_counts_of_linear_shared_and_dense_layers_mixed_are_the_built_decoders(dense):
    """Gated DeltaNet, attention and K/V-sharing layers, each dense or a mixture of experts: the
    footprint counts each kind from where the linear and dense layers are, as the built decoder."""
    moe = None if len(dense) == 4 else dict(num_experts=4, top_k=2, expert_ffn_dim=8, dense_layers=dense)
    model = ModelConfig(num_layers=4, d_model=C, num_heads=4, preset_kv_heads=4, ffn_dim=48, vocab_size=VOCAB,
                        moe=moe)
    attention = AttentionConfig(type="gqa", num_kv_heads=2, kv_shared_layers=1,
                                layer_types=["linear_attention", "full_attention", "linear_attention",
                                             "full_attention"]).resolved(model)
    with torch.device("meta"):
        assert parameter_counts(model, attention).total == Decoder(model, attention).num_params()


# (preset, total, active as the card counts it, with the embedding table?) from the model cards, as
# each preset's YAML cites them (written without internet access, from memory of the cards)
CARDS = [("deepseek_v3", 671e9, 36.7e9, False),  # README_WEIGHTS.md: 671B main model, 36.7B activated
         ("gpt_oss_120b", 116.83e9, 5.13e9, False),  # the gpt-oss model card's table: 116.83B, 5.13B
         ("qwen3_235b_a22b", 235e9, 22e9, True)]  # the Qwen3 card: 235B in total, 22B activated


@pytest.mark.parametrize("preset, total, active, with_embedding", CARDS)
def test_the_presets_count_what_the_model_cards_say(preset, total, active, with_embedding):
    cfg = to_bench_config(compose(f"model={preset}", "task=inspect"))
    counts = parameter_counts(cfg.model, cfg.attention)
    assert counts.total == pytest.approx(total, rel=0.01)
    assert counts.active + (counts.embedding if with_embedding else 0) == pytest.approx(active, rel=0.01)


def test_deepseek_v32_is_deepseek_v3_and_its_indexer_by_hand():
    """V3.2's MLPs are V3's; each of its 61 layers adds DSA's indexer (transformers'
    DeepseekV32Indexer): wq_b (1536 -> 64 heads x 128), wk (7168 -> 128), k_norm (a LayerNorm of
    128, weight and bias), weights_proj (7168 -> 64); every token runs it."""
    v3, v32 = (parameter_counts((cfg := to_bench_config(compose(f"model={p}", "task=inspect"))).model, cfg.attention)
               for p in ("deepseek_v3", "deepseek_v32"))
    indexer = 61 * (1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64)
    assert (v32.total, v32.active, v32.embedding) == (v3.total + indexer, v3.active + indexer, v3.embedding)
    assert v32.total == 671_877_929_216


# ---- what a decode step reads ---------------------------------------------------------------------

def _small_moe_decoder(**moe):
    torch.manual_seed(0)
    return Decoder(ModelConfig(num_layers=3, d_model=C, num_heads=4, preset_kv_heads=4, ffn_dim=48, vocab_size=VOCAB,
                               max_seq_len=64, moe={"num_experts": 8, "top_k": 2, "expert_ffn_dim": 16,
                                                    "dense_layers": [0], **moe})).eval()


def test_a_steps_bytes_are_the_distinct_experts_its_router_chose(monkeypatch):
    """A fixed routing: the 3 sequences of a batch go to experts (0, 1), (1, 2) and (5, 1), so each
    of the 2 MoE layers runs 4 distinct experts, and a step reads 2 x 4 experts' weights, not all
    16 (nor the 2 x 6 = min(8, 3 x 2) per layer that a step could read at most)."""
    table = torch.tensor([[0, 1], [1, 2], [5, 1]])

    def fixed(moe, logits, correction_bias=None):
        n = logits.shape[0]  # token n of a batch-major (B, T) input is sequence n // T
        return torch.full((n, 2), 0.5), table[torch.arange(n) // (n // 3)]

    monkeypatch.setattr("kvbench.mlp.experts.route", fixed)
    model = _small_moe_decoder()
    with record_routing(model) as routing, torch.no_grad():
        cache = cache_for(model, "static", 3, 12)
        model(torch.zeros(3, 8, dtype=torch.long), cache, 0)  # prefill
        model(torch.zeros(3, 1, dtype=torch.long), cache, 8)  # one decode step
    assert routing.forwards() == [(4, 4), (4, 4)]
    per_expert = (2 * 16 * C + C * 16) * 4  # w_gate_up and w_down of one expert, float32
    assert routing.bytes_per_forward() == [2 * 4 * per_expert] * 2
    params = sum(p.numel() for p in model.parameters())
    dense = (params - 2 * 8 * (3 * 16 * C) - VOCAB * C + 3 * C) * 4  # all but the experts; 3 rows of the embedding
    total, kv = decode_bytes_read(model, 3, 9, routed_bytes=2 * 4 * per_expert)
    assert kv == model.layouts.cache_bytes(9, 3, 4) and total == dense + 2 * 4 * per_expert + kv
    assert decode_bytes_read(model, 3, 9)[0] == dense + 2 * 6 * per_expert + kv  # no routing: the most it can read
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2) - VOCAB * C
    assert decode_flops(model, 3, 9) == 3 * (2.0 * (matrices + 2 * 2 * 3 * 16 * C) + model.layouts.step_flops(9))


def test_a_decode_record_reads_the_bytes_its_router_chose_and_is_plausible(tmp_path):
    """model=tiny_moe end to end: the record's routed experts per step (a series, counted from the
    router as the timed steps ran), its bytes read per step from them, and no figure flagged
    implausible (the roofline does not count the 8 experts of which a step reads a few)."""
    result = run_job(compose("wandb.mode=disabled", "runtime.peak_gb_per_s=10", "model=tiny_moe",
                             "workload.prompt_len=16", "workload.gen_len=6", "workload.batch_size=3",
                             "runtime.repeats=1"), tmp_path)
    m, series = result.metrics, result.series["routed_experts"]
    assert result.status == "ok", result.error
    assert len(series) == 6 and all(1 <= n <= 6 for n in series)  # one MoE layer: at most min(8, 3 x 2)
    assert m["routed_experts_per_step"] == pytest.approx(sum(series) / 6)
    per_expert = (2 * 64 * 64 + 64 * 64) * 4
    assert m["routed_expert_bytes_per_step"] == pytest.approx(m["routed_experts_per_step"] * per_expert)
    model = Decoder(to_bench_config(compose("model=tiny_moe")).model)
    weights = (sum(p.numel() for p in model.parameters()) - 8 * 3 * 64 * 64 - 256 * 64 + 3 * 64) * 4
    kv = m["kv_bytes_read_per_step"]
    assert m["bytes_read_per_step"] == pytest.approx(weights + m["routed_expert_bytes_per_step"] + kv)
    assert result.implausible == []
    assert {"routed_experts_per_step", "series.routed_experts", "routed_expert_bytes_per_step"} <= set(result.methods)


def test_a_compiled_fixed_shape_step_is_refused_for_a_mixture_of_experts():
    with pytest.raises(ConfigError) as err:
        to_bench_config(compose("model=tiny_moe", "runtime.compile=graph", "cache.impl=static"))
    assert str(err.value).startswith("runtime.compile=graph: the mixture-of-experts MLP") and "\n" not in str(err.value)


@pytest.mark.e2e
def test_a_mixture_of_experts_compiles_with_dynamic_shapes_and_decodes_as_eager():
    """runtime.compile=default: the experts' loop runs eagerly between compiled graphs (it follows the
    routing), the tokens are eager's and a second generation compiles nothing new. Two MoE layers
    and no dense one: a dense block beside them is a second block type, whose guards recompile the
    block's graphs (14 graphs instead of 11), and 4 new tokens reach the dynamic decode graph as 6 do."""
    torch.manual_seed(0)
    model = Decoder(ModelConfig(num_layers=2, d_model=C, num_heads=4, preset_kv_heads=4, ffn_dim=48, vocab_size=VOCAB,
                                max_seq_len=64, moe={"num_experts": 8, "top_k": 2, "expert_ffn_dim": 16})).eval()
    prompt = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    eager = greedy_generate(model, prompt, 4, cache_for(model, "static", 2, 20), keep_logits=True)
    compiled, step = compiled_step("default", model, torch.device("cpu"))
    first = greedy_generate(compiled, prompt, 4, cache_for(model, "static", 2, 20), keep_logits=True, step=step)
    graphs = compiled_graphs()
    again = greedy_generate(compiled, prompt, 4, cache_for(model, "static", 2, 20), keep_logits=True, step=step)
    assert torch.equal(first.tokens, eager.tokens) and torch.equal(again.tokens, eager.tokens)
    assert (first.logits - eager.logits).abs().max().item() <= 1e-5 and compiled_graphs() == graphs


@pytest.mark.parametrize("preset, printed", [
    ("gpt_oss_120b", ["parameters: 116,829,156,672", "active parameters per token: 5,132,849,472 without the "
                      "embedding table", "mixture of experts in 36 of 36 layers: 128 experts of 2880, top 4"]),
    ("deepseek_v3", ["parameters: 671,026,404,352", "36,625,603,584 without", "37,552,282,624 with it",
                     "58 of 61 layers (dense MLP of 18432 in layers 0, 1, 2)", "the best 4 of 8 groups"]),
])
def test_inspect_prints_total_and_active_parameters(preset, printed):
    """kvbench task=inspect model=gpt_oss_120b (docs/moe.md): what it prints, in process."""
    from kvbench.tasks.inspect import describe

    text = describe(to_bench_config(compose(f"model={preset}", "task=inspect")))
    for line in printed:
        assert line in text


def test_capacity_counts_every_expert_in_the_weights():
    """task=capacity on model=tiny_moe: the weights it measures are every expert's (the footprint's
    count x 4 bytes), and its memory-only prediction under a budget of those weights + 3.5
    sequences' KV is 3 sequences (with one expert's weights instead of 8 it would be more)."""
    from kvbench.tasks import capacity
    from kvbench.tasks.common import build_model

    torch.set_num_threads(1)
    weights = parameter_counts(to_bench_config(compose("model=tiny_moe")).model).total * 4
    per_sequence = 2 * 2 * 8 * 8 * (16 + 2) * 4  # layers x K and V x heads x head_dim x positions x bytes
    budget_gb = (weights + 3.5 * per_sequence) / 1e9
    cfg = to_bench_config(compose("task=capacity", "model=tiny_moe", "capacity.context_lens=[16]",
                                  "capacity.max_batch=8", "workload.gen_len=2", "runtime.warmup=0", "runtime.repeats=1",
                                  f"runtime.memory_budget_gb={budget_gb}", "slo.tpot_ms=100000", "slo.stat=p50"))
    model = build_model(cfg, torch.device("cpu"))
    result = RunResult(status="ok", config={})
    capacity.run_probes(cfg, model, torch.device("cpu"), result, capacity.baseline_bytes(torch.device("cpu")))
    assert result.metrics["weight_bytes_measured"] == weights == model.num_params() * 4
    assert result.tables["capacity"][0]["formula_max_batch"] == 3


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_an_moe_checkpoint_on_cuda_is_transformers_on_cuda(tmp_path, family):
    """The same checkpoints on a GPU (float32, TF32 off): perplexity within 1e-4 relative and 40
    greedy cached steps token for token against transformers on the same GPU."""
    torch.backends.cuda.matmul.allow_tf32 = False
    path, hf = moe_dir(tmp_path, family)
    model, _ = load_llama_dir(path, device="cuda")
    _assert_exact(model, hf.cuda(), "cuda")



_LOADS_DYNAMO = """import importlib, pkgutil, runpy, sys
import kvbench
for module in pkgutil.walk_packages(kvbench.__path__, "kvbench."):
    importlib.import_module(module.name)
print("torch._dynamo" in sys.modules)
sys.argv = ["kvbench", *sys.argv[1:]]
try:
    runpy.run_module("kvbench.cli", run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
print("torch._dynamo" in sys.modules)
"""


@pytest.mark.e2e
@pytest.mark.parametrize("model", ["gpt_oss_120b", "qwen3_next_80b", "deepseek_v32"])
def test_importing_kvbench_and_inspecting_a_model_do_not_load_torch_dynamo(tmp_path, model):
    """torch._dynamo costs about 1.3 s of CPU to import: only a compiled step may pay it. A decorator
    such as torch.compiler.disable, applied at import, would load it in every job; inspect builds
    the model's layers on the meta device, where initialising a tensor would load it too."""
    run = subprocess.run([sys.executable, "-c", _LOADS_DYNAMO, "task=inspect", f"model={model}",
                          f"hydra.run.dir={tmp_path}"], env=dict(os.environ, WANDB_MODE="disabled"),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()  # loaded after the imports, after the job
    assert "parameters:" in run.stdout and (lines[0], lines[-1]) == ("False", "False")
