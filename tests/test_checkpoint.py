"""kvbench checkpoints, Llama-format loading (parity against transformers) and KV-head conversion."""

import json

import pytest
import torch
from conftest import VOCAB, edit_config_json, hf_dir, llama_dir, reread

from kvbench.checkpoint import (
    CheckpointError,
    convert_kv_heads,
    load_checkpoint,
    load_llama_dir,
    read_checkpoint,
    save_checkpoint,
)
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.model import Decoder
from kvbench.rope import rope_inv_freq


@pytest.mark.parametrize("num_kv_heads,tie", [(4, False), (2, False), (1, True)],
                         ids=["mha", "gqa", "mqa-tied"])
def test_llama_parity_with_transformers(tmp_path, num_kv_heads, tie):
    path, hf = llama_dir(tmp_path, num_kv_heads, tie)
    model, tokenizer = load_llama_dir(path, torch.float32)
    assert tokenizer is None
    assert model.num_kv_heads == num_kv_heads
    assert model.config.rope_theta == 500.0
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # with D=8, theta=500: high, medium and low bands
PROMPT, STEPS = 64, 16


def rope(parameters):
    """The rope keys of a config: transformers >= 5 takes rope_parameters (theta inside), older
    versions rope_scaling next to rope_theta."""
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {"rope_theta": 500.0, **parameters}}
    return {"rope_scaling": parameters}


def logits_with_cache(model, hf, tokens):
    """(ours, transformers') logits over a PROMPT-token prefill and STEPS cached one-token steps
    of the same tokens, each side with its own KV cache."""
    import inspect

    from kvbench.cache import cache_for

    # transformers 5.24 renamed the forward argument past_key_values to cache
    past_name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    cache = cache_for(model, "static", tokens.shape[0], PROMPT + STEPS)
    with torch.no_grad():
        ours = [model(tokens[:, :PROMPT], cache, 0)]
        out = hf(tokens[:, :PROMPT], use_cache=True)
        theirs, past = [out.logits], out.past_key_values
        for pos in range(PROMPT, PROMPT + STEPS):
            ours.append(model(tokens[:, pos:pos + 1], cache, pos))
            out = hf(tokens[:, pos:pos + 1], **{past_name: past}, use_cache=True)
            theirs.append(out.logits)
            past = out.past_key_values
    return torch.cat(ours, 1), torch.cat(theirs, 1)


@pytest.mark.parametrize("family,overrides,switches", [
    ("llama", rope(LLAMA3_ROPE), {"rope_type": "llama3", "rope_factor": 8.0, "rope_original_max_seq_len": 64}),
    ("llama", rope({"rope_type": "linear", "factor": 2.0}), {"rope_type": "linear", "rope_factor": 2.0}),
    ("llama", rope({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 20}),
     {"rope_type": "yarn", "rope_factor": 4.0, "rope_original_max_seq_len": 20}),
    ("mistral", {}, {"qkv_bias": False, "qk_norm": False}),
    ("qwen2", {}, {"qkv_bias": True, "qk_norm": False}),
    ("qwen3", {}, {"qkv_bias": False, "qk_norm": True}),
    # attention_bias: a bias on each of q, k, v and o where the class reads it, mlp_bias on the MLP's
    # projections (Llama's); Mistral's class ignores both
    ("llama", {"attention_bias": True}, {"qkv_bias": True, "o_bias": True, "mlp_bias": False}),
    ("llama", {"mlp_bias": True}, {"qkv_bias": False, "o_bias": False, "mlp_bias": True}),
    ("qwen3", {"attention_bias": True}, {"qkv_bias": True, "o_bias": True, "qk_norm": True}),
    ("mistral", {"attention_bias": True, "mlp_bias": True}, {"qkv_bias": False, "o_bias": False, "mlp_bias": False}),
])
@pytest.mark.parametrize("num_kv_heads,tie", [(2, False), (1, True)], ids=["gqa", "mqa-tied"])
def test_each_family_matches_transformers_over_prefill_and_cached_decode(tmp_path, family, overrides, switches,
                                                                       num_kv_heads, tie):
    """Max logit difference <= 1e-5 (float32) against transformers' own class for the family over a
    64-token prompt and 16 cached decode steps; the switches read from config.json are the family's."""
    path, hf = hf_dir(tmp_path, num_kv_heads, tie, family, max_position_embeddings=PROMPT + STEPS, **overrides)
    model, _ = load_llama_dir(path, torch.float32)
    assert model.num_kv_heads == num_kv_heads
    assert {k: getattr(model.config, k) for k in switches} == switches
    tokens = torch.randint(0, VOCAB, (2, PROMPT + STEPS), generator=torch.Generator().manual_seed(1))
    ours, theirs = logits_with_cache(model, hf, tokens)
    assert (ours - theirs).abs().max().item() <= 1e-5


@pytest.mark.parametrize("rope_keys", [
    # both spellings: transformers (4 and 5 alike) reads rope_scaling
    {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    # a top-level original_max_position_embeddings overrides the rope's (transformers' rule, for Phi-3)
    {**rope(LLAMA3_ROPE), "original_max_position_embeddings": 16},
    {**rope({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
     "original_max_position_embeddings": 16},
])
def test_rope_keys_given_twice_are_read_as_transformers_reads_them(tmp_path, rope_keys):
    """Where a config.json gives a rope setting twice, kvbench takes the one transformers takes:
    the logits of 32 tokens against transformers reading the same file."""
    path, _ = hf_dir(tmp_path, 2, family="llama", max_position_embeddings=96)
    edit_config_json(path, **rope_keys)
    model, _ = load_llama_dir(path, torch.float32)
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(tokens) - reread(path)(tokens).logits).abs().max().item() <= 1e-5


def test_llama3_frequencies_are_transformers_and_differ_from_plain_rotary(tmp_path):
    """The scaled inverse frequencies equal transformers' rope init for llama3 (so the parity above
    is not luck of short positions), and the scaling changes some bands and keeps others."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path, hf = hf_dir(tmp_path, 2, family="llama", max_position_embeddings=96, **rope(LLAMA3_ROPE))
    model, _ = load_llama_dir(path)
    ours = rope_inv_freq(model.config)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
    torch.testing.assert_close(ours.float(), theirs, rtol=1e-6, atol=0)
    plain = rope_inv_freq(ModelConfig(d_model=32, num_heads=4, preset_kv_heads=4, rope_theta=500.0))
    assert ours[0] == plain[0]  # wavelength 2*pi < 64/4: kept
    torch.testing.assert_close(ours[2:], plain[2:] / 8)  # wavelengths > 64: divided by the factor
    assert plain[1] / 8 < ours[1] < plain[1]  # in between: blended


def test_qwen2_biases_follow_the_kv_heads_when_converted(tmp_path):
    """Repeating KV heads repeats their biases too, so the model is transformers' exactly; pooling
    averages them with the weights."""
    path, hf = hf_dir(tmp_path, 2, family="qwen2")
    model, _ = load_llama_dir(path)
    D = model.config.head_dim
    repeated, pooled = convert_kv_heads(model, 4), convert_kv_heads(model, 1)
    old = model.blocks[0].attn.wk.bias.view(2, D)
    assert torch.equal(repeated.blocks[0].attn.wk.bias.view(4, D), old.repeat_interleave(2, dim=0))
    torch.testing.assert_close(pooled.blocks[0].attn.wv.bias.view(1, D),
                               model.blocks[0].attn.wv.bias.view(2, D).mean(0, keepdim=True))
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(repeated(tokens), hf(tokens).logits, atol=1e-5, rtol=0)


def test_llama_tokenizer_loaded_when_present(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    path, _ = llama_dir(tmp_path, 2)
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    _, loaded = load_llama_dir(path)
    assert loaded.encode("hello world").ids == [1, 2]


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_llama_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_llama_dir(tmp_path)
    path, _ = llama_dir(tmp_path, 2)
    _edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match=r"architectures=\['GPT2LMHeadModel'\]: not supported"):
        load_llama_dir(path)
    _edit_config(path, architectures=["LlamaForCausalLM"], intermediate_size=64)
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.0\.mlp\.gate_proj\.weight has shape \(48, 32\), "
                                              r"config.json implies \(64, 32\)"):
        load_llama_dir(path)
    _edit_config(path, intermediate_size=48, num_hidden_layers=3)
    # the layers the files hold, read from their headers before anything is built
    with pytest.raises(CheckpointError, match=r"num_hidden_layers=3, but the safetensors files hold tensors of "
                                              r"layers 0, 1"):
        load_llama_dir(path)
    for f in path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_llama_dir(path)


def tiny(num_kv_heads=4, num_heads=4, seed=0) -> Decoder:
    torch.manual_seed(seed)
    cfg = ModelConfig(num_layers=2, d_model=32, num_heads=num_heads, preset_kv_heads=num_heads,
                      ffn_dim=48, vocab_size=VOCAB, max_seq_len=64)
    return Decoder(cfg, AttentionConfig.for_heads(num_heads, num_kv_heads)).eval()


def test_save_load_roundtrip(tmp_path):
    model = tiny(2)
    save_checkpoint(tmp_path / "c.pt", model, {"metrics": {"perplexity": 3.5}})
    loaded = load_checkpoint(tmp_path / "c.pt")
    assert loaded.attention == model.attention and loaded.config == model.config
    tokens = torch.randint(0, VOCAB, (1, 16))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))
    assert read_checkpoint(tmp_path / "c.pt")["metrics"] == {"perplexity": 3.5}
    with pytest.raises(CheckpointError, match="no such file"):
        load_checkpoint(tmp_path / "missing.pt")
    torch.save({"x": 1}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a kvbench checkpoint"):
        load_checkpoint(tmp_path / "other.pt")


def test_convert_same_count_is_identity():
    model = tiny(4)
    same = convert_kv_heads(model, 4)
    assert same.attention.type == "mha"
    for (name, a), (_, b) in zip(model.state_dict().items(), same.state_dict().items()):
        assert torch.equal(a, b), name


def _make_groups_identical(model: Decoder, num_kv_heads: int) -> None:
    """Copy the first K/V head of every group over the others (the model stays MHA-shaped)."""
    D, r = model.config.head_dim, model.num_kv_heads // num_kv_heads
    with torch.no_grad():
        for block in model.blocks:
            for lin in (block.attn.wk, block.attn.wv):
                w = lin.weight.view(num_kv_heads, r, D, -1)  # (groups, heads per group, D, C)
                w.copy_(w[:, :1].expand_as(w))


@pytest.mark.parametrize("start,target,kind", [(4, 2, "gqa"), (4, 1, "mqa"), (2, 1, "mqa")])
def test_convert_identical_groups_reproduces_outputs(start, target, kind):
    model = tiny(start)
    _make_groups_identical(model, target)
    converted = convert_kv_heads(model, target)
    assert converted.num_kv_heads == target
    assert converted.attention.type == kind
    tokens = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(converted(tokens), model(tokens), atol=1e-6, rtol=0)


def test_convert_is_group_mean():
    model = tiny(4)
    converted = convert_kv_heads(model, 2)
    D = model.config.head_dim
    old = model.blocks[0].attn.wk.weight.view(4, D, -1)
    new = converted.blocks[0].attn.wk.weight.view(2, D, -1)
    torch.testing.assert_close(new[1], (old[2] + old[3]) / 2)  # query heads 2, 3 → KV head 1
    assert torch.equal(converted.blocks[0].attn.wq.weight, model.blocks[0].attn.wq.weight)


@pytest.mark.parametrize("start,target,kind", [(2, 4, "mha"), (1, 4, "mha"), (1, 2, "gqa")])
def test_more_kv_heads_repeat_them_and_compute_the_same_function(start, target, kind):
    """GQA/MQA → more KV heads: each new head copies the one its query heads read before, so
    the logits are those of the original model (with and without a cache)."""
    from kvbench.cache import cache_for
    from kvbench.generate import greedy_generate

    model = tiny(start)
    converted = convert_kv_heads(model, target)
    assert converted.num_kv_heads == target and converted.attention.type == kind
    D, r = model.config.head_dim, target // start
    old = model.blocks[1].attn.wv.weight.view(start, D, -1)
    new = converted.blocks[1].attn.wv.weight.view(target, D, -1)
    for j in range(target):
        assert torch.equal(new[j], old[j // r])
    tokens = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(converted(tokens), model(tokens), atol=1e-6, rtol=0)
        ours = greedy_generate(model, tokens, 6, cache_for(model, "static", 2, 26), keep_logits=True)
        theirs = greedy_generate(converted, tokens, 6, cache_for(converted, "static", 2, 26), keep_logits=True)
    assert torch.equal(ours.tokens, theirs.tokens)
    torch.testing.assert_close(theirs.logits, ours.logits, atol=1e-6, rtol=0)


def test_a_count_neither_pooled_nor_repeated_is_rejected_naming_the_key():
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=1, d_model=48, num_heads=6, preset_kv_heads=6, ffn_dim=32, vocab_size=VOCAB,
                      max_seq_len=32)
    model = Decoder(cfg, AttentionConfig.for_heads(6, 2))
    why = r"attention.num_kv_heads=3: cannot convert the checkpoint's 2 KV heads \(mean-pooling needs a divisor"
    with pytest.raises(CheckpointError, match=why + r" of 2, repeating a multiple of 2\)"):
        convert_kv_heads(model, 3)
