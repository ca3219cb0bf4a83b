"""kvbench checkpoints, Llama-format loading (parity against transformers) and KV-head conversion."""

import json

import pytest
import torch
from conftest import VOCAB, llama_dir

from kvbench.checkpoint import (
    CheckpointError,
    convert_kv_heads,
    load_checkpoint,
    load_llama_dir,
    read_checkpoint,
    save_checkpoint,
)
from kvbench.config import AttentionConfig, ModelConfig
from kvbench.model import Decoder


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
    with pytest.raises(CheckpointError, match="architecture GPT2LMHeadModel is not supported"):
        load_llama_dir(path)
    _edit_config(path, architectures=["LlamaForCausalLM"], intermediate_size=64)
    with pytest.raises(CheckpointError, match=r"blocks\.0\.mlp\.w_gate\.weight has shape \(48, 32\), "
                                              r"config.json implies \(64, 32\)"):
        load_llama_dir(path)
    _edit_config(path, intermediate_size=48, rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(CheckpointError, match="rope scaling"):
        load_llama_dir(path)
    _edit_config(path, rope_scaling=None, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match=r"missing \['blocks\.2\."):
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
