"""DeepSeek-V4 checkpoints through kvbench's loader (model.path) into kvbench's own decoder, exact against
transformers' DeepseekV4ForCausalLM with random weights: its three layer types (sliding, CSA m = 4, HCA
m' = 8), the hyper-connection residual streams, a hash-routed then learned mixture of experts with its
clamped SwiGLU and shared expert, query and output LoRA, the compressed branch's rotary base. Logits and
perplexity within 1e-5 relative, 40 greedy cached steps after a 21-token prompt (no multiple of 4 or 8:
the compressors' buffers carry across the prefill and the steps) token-equal to generate, the parameter
count transformers' own, task=eval's perplexity transformers'; DeepSeek's own tensor names and
transformers' load alike; what the reader refuses, one line naming the key."""

import json

import pytest
import torch
from conftest import edit_config_json
from hf_parity import check_greedy_steps, check_logits_and_perplexity, check_task_eval

from kvbench.cache import cache_for
from kvbench.checkpoint import CheckpointError, load_llama_dir
from kvbench.config.model import ModelConfig
from kvbench.core.errors import ConfigError
from kvbench.footprint import parameter_counts
from kvbench.layouts.compressed import CSA, HCA, SLIDING, hf_names
from kvbench.mlp.experts import MoE

VOCAB = 256  # the byte corpus of task=eval
# 4 heads of 32 (rope on the last 8), q LoRA 24, output LoRA 2 groups of 16, a ring of 6, CSA m = 4 with
# 16 indexer heads of 16 keeping the top 3, HCA m' = 8, 2 residual streams, 4 experts (2 per token) of 32
V4 = dict(vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32,
          q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=4, sliding_window=6, hc_mult=2, o_groups=2,
          o_lora_rank=16, index_n_heads=16, index_head_dim=16, index_topk=3, partial_rotary_factor=0.25,
          initializer_range=0.1, num_hidden_layers=3, layer_types=[SLIDING, CSA, HCA],
          mlp_layer_types=["hash_moe", "moe", "moe"], compress_rates={CSA: 4, HCA: 8}, max_position_embeddings=256,
          swiglu_limit=0.5)

pytestmark = pytest.mark.usefixtures("quiet_transformers", "one_torch_thread")


def v4_dir(path):
    """A random DeepseekV4ForCausalLM saved with save_pretrained (DeepSeek's own tensor names); (dir, model).
    The weights transformers starts at 0 or 1 (sinks, position biases, norms, the hash table, the
    correction bias) moved off them, so that each one counts; a SwiGLU limit the activations reach."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(0)
    hf = DeepseekV4ForCausalLM(DeepseekV4Config(**V4)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                p.normal_()
            elif name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
        for layer in hf.model.layers:
            if layer.mlp.is_hash:
                layer.mlp.gate.tid2eid.copy_(torch.randint(0, 4, layer.mlp.gate.tid2eid.shape))
            else:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    hf.save_pretrained(path)
    hf.generation_config.eos_token_id = None  # every step whatever is drawn
    return path, hf


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path, hf = v4_dir(tmp_path_factory.mktemp("v4"))
    return path, hf, load_llama_dir(path)[0]


@torch.no_grad()
def test_a_deepseek_v4_checkpoint_is_transformers_in_logits_perplexity_and_40_greedy_cached_steps(loaded):
    path, hf, model = loaded
    assert [lay.layer_type for lay in model.layouts] == [SLIDING, CSA, HCA]
    assert [lay.compress_rate for lay in model.layouts] == [0, 4, 8] and model.layouts[1].index_topk == 3
    assert model.config.hyper_connections.streams == 2 and model.hc_head is not None
    assert [block.mlp.tid2eid is not None for block in model.blocks] == [True, False, False]
    assert all(isinstance(block.mlp, MoE) for block in model.blocks)
    assert model.num_params() == hf.num_parameters()
    # counted from the config alone (its sliding layer a V4 one, not a K/V-head layer), as task=inspect does
    assert parameter_counts(model.config, model.attention).total == hf.num_parameters()

    tokens = torch.randint(0, VOCAB, (2, 61), generator=torch.Generator().manual_seed(1))
    check_logits_and_perplexity(model, hf, tokens)
    # 5 CSA windows and 2 HCA windows closed, a remainder buffered in each, then 40 cached steps
    check_greedy_steps(model, hf, tokens[:, :21])


@torch.no_grad()
def test_in_bfloat16_what_transformers_keeps_in_float32_stays_float32_and_the_logits_are_its(loaded):
    """The checkpoint in bfloat16 (transformers' from_pretrained: its _keep_in_fp32_modules_strict) and
    kvbench's in bfloat16: the same tensors stay float32 (hyper-connections, norms, sinks, position biases,
    the router's correction bias) with the checkpoint's values, and the streams in bfloat16 between the
    blocks as transformers keeps them; the logits differ by the rounding of bfloat16 operations in another
    order, no more than transformers' bfloat16 differs from float32, and their top-1 agrees at 95% of
    positions. (Greedy steps are not compared: on this random model they part at a near tie.)"""
    from transformers import DeepseekV4ForCausalLM

    from kvbench.checkpoint import hf_to_decoder_name

    path, _, model32 = loaded
    hf = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    hf.generation_config.eos_token_id = None
    model = load_llama_dir(path, torch.bfloat16)[0].eval()
    kept = {n for n, t in {**dict(hf.named_parameters()), **dict(hf.named_buffers())}.items()
            if t.dtype == torch.float32 and "rotary" not in n and "inv_freq" not in n}
    ours = {n for n, t in model.state_dict().items() if t.dtype == torch.float32 and not n.startswith("rope_")}
    assert {hf_to_decoder_name(hf_names(hf.config.to_dict())(n), model.layouts) for n in kept} == ours
    assert torch.equal(model.blocks[1].attn_hc.fn, model32.blocks[1].attn_hc.fn)  # not rounded on the way
    tokens = torch.randint(0, VOCAB, (2, 61), generator=torch.Generator().manual_seed(1))
    theirs, got, exact = hf(tokens).logits.float(), model(tokens).float(), model32(tokens)
    # bfloat16 against bfloat16: as far apart as transformers' own bfloat16 is from float32 (the order of
    # a few rounded operations differs; an expert or an index entry chosen by a near tie can flip)
    assert (got - theirs).abs().mean() <= 1.25 * (theirs - exact).abs().mean()
    assert (got.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.95


@torch.no_grad()
def test_transformers_tensor_names_load_as_deepseeks_own(loaded, tmp_path):
    """The same weights under transformers' own names (its state dict: stacked experts, ``self_attn``,
    ``attn_hc``, ``mlp.gate.tid2eid``) give the same decoder; every name of either spelling is read."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path, hf, model = loaded
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "model.safetensors")
    again = load_llama_dir(tmp_path)[0]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    with safe_open(path / "model.safetensors", "pt") as f:
        original = list(f.keys())
    assert any(".ffn.experts.0.w1." in name for name in original)  # DeepSeek's own spelling was read above
    renamed = hf_names(json.loads((path / "config.json").read_text()))
    assert all(renamed(name) is not None for name in [*original, *hf.state_dict()])


def test_task_eval_of_a_deepseek_v4_checkpoint_is_transformers_perplexity(loaded, tmp_path):
    """model.path's route (task=eval reads the checkpoint whole): the record's perplexity within 1e-5
    relative of transformers' over the same slices of the byte corpus (windows of 40: longer than the
    ring and than several m')."""
    path, hf, _ = loaded
    model = check_task_eval(path, hf, tmp_path, seq_len=40)
    assert model.preset_layer_types == [SLIDING, CSA, HCA] and model.moe.hash_layers == [0]


@pytest.mark.parametrize("change,line", [
    ({"scoring_func": "softmax"}, "scoring_func='softmax': "),
    ({"n_shared_experts": 2}, "n_shared_experts=2: "),
    ({"attention_bias": True}, "attention_bias=True: "),
    ({"hc_mult": 0}, "hc_mult=0: "),
    ({"swiglu_limit": "10"}, "swiglu_limit='10': "),
    ({"mlp_layer_types": ["hash_moe", "dense", "moe"]}, "mlp_layer_types=['hash_moe', 'dense', 'moe']: "),
])
def test_a_deepseek_v4_config_json_it_cannot_run_is_refused_in_one_line_naming_the_key(loaded, tmp_path, change,
                                                                                      line):
    path, _, _ = loaded
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    edit_config_json(tmp_path, **change)
    with pytest.raises(ConfigError) as info:
        ModelConfig(path=str(tmp_path))
    message = str(info.value)
    assert "\n" not in message and line in message, message


# ---- V4 layers in any model: kvbench's decoder of model=tiny with a sliding, a CSA and an HCA layer ------------

@pytest.fixture(scope="module")
def tiny_v4():
    from conftest import compose

    from kvbench.jobs.job_config import to_bench_config
    from kvbench.layouts.compressed import EXAMPLE
    from kvbench.tasks.common import build_model

    job = to_bench_config(compose(*EXAMPLE))
    return job, build_model(job, torch.device("cpu"))


@torch.no_grad()
def test_a_decoder_of_v4_layers_decodes_from_its_cache_as_a_recompute_and_allocates_the_formula(tiny_v4):
    """A prompt of 13 in two chunks (5 and 8: each ends mid-window of 4 and 8, longer than the ring of 6),
    then 12 steps: the logits of a forward of the whole sequence without a cache; the static cache holds
    the layouts' bytes (ring, pool, buffers) from its allocation on; cache.impl=none re-feeds the sequence."""
    from kvbench.generate import decode_step, prefill

    job, model = tiny_v4
    assert [lay.layer_type for lay in model.layouts] == [SLIDING, CSA, HCA]
    ids = torch.randint(0, model.config.vocab_size, (2, 25), generator=torch.Generator().manual_seed(3))
    want = model(ids)
    cache = cache_for(model, "static", 2, 25)
    assert cache.nbytes == model.layouts.cache_bytes(25, 2, 4)
    got = [prefill(model, ids[:, :5], cache), prefill(model, ids[:, 5:13], cache, 5)]
    got += [decode_step(model, ids[:, p:p + 1], cache, p) for p in range(13, 25)]
    torch.testing.assert_close(torch.stack(got, 1), want[:, [4] + list(range(12, 25))], atol=1e-5, rtol=0)
    none = cache_for(model, "none", 2, 25)
    torch.testing.assert_close(prefill(model, ids, none), want[:, -1], atol=1e-5, rtol=0)


def test_what_a_decoder_of_v4_layers_cannot_do_is_one_line(tiny_v4):
    """A concatenating cache and a roll back inside the pool's windows are refused in one line naming
    them; back to 0 starts afresh."""
    _, model = tiny_v4
    with pytest.raises(ConfigError, match=r"^cache.impl='concat': [^\n]*DeepSeek-V4"):
        cache_for(model, "concat", 2, 16)
    cache = cache_for(model, "static", 2, 16)
    with torch.no_grad():
        model(torch.zeros(2, 9, dtype=torch.long), cache)
    with pytest.raises(ValueError, match=r"^cannot truncate to 8: [^\n]*pool folds each window of 4 [^\n]*only 0 "
                                         r"or 9 works$"):
        cache.truncate(8)  # within the sliding layer's ring, not the CSA layer's pool
    with pytest.raises(ValueError, match=r"^cannot truncate to 2: a ring of 6 positions already overwrote position"):
        cache.truncate(2)
    cache.truncate(0)
    assert cache.length == 0


@pytest.mark.parametrize("change", [{"hc_mult": 10 ** 12}, {"hidden_size": 2 ** 62}])
def test_a_deepseek_v4_config_json_whose_tensors_torch_cannot_index_is_refused_in_one_line(loaded, tmp_path, change):
    """hc_mult of 10**12: a hyper-connection's (2 + N) N x N d weight has more than 2**63 elements, which
    torch cannot size even on the meta device (a TypeError from torch.zeros escaped the memory check)."""
    path, _, _ = loaded
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    edit_config_json(tmp_path, **change)
    with pytest.raises((ConfigError, CheckpointError)) as info:
        load_llama_dir(str(tmp_path))
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(tmp_path)), message
