"""Hostile and careless model, checkpoint and task input (round 4): what a checkpoint directory
holds against what its config.json says, a config.json's value types, a combination of task and
layout whose model would not be the one its record names, and a job that could only fail after
its expensive part. Each one is ``invalid`` with one line naming the key, value or file (or runs
the model its record names); in process, through the config path the CLI composes."""

import json
import shutil

import pytest
import torch
from conftest import VOCAB, compose, deepseek_dir, edit_config_json, hf_dir, llama_dir
from safetensors.torch import load_file, save_file

import kvbench.checkpoint as checkpoint
from kvbench.checkpoint import CheckpointError, load_llama_dir
from kvbench.config.model import ModelConfig
from kvbench.core.errors import ConfigError
from kvbench.jobs.runner import run_job

FAST = ["wandb=disabled", "runtime.isolate=false", "workload.prompt_len=8", "workload.gen_len=2",
        "runtime.warmup=0", "runtime.repeats=1"]


INDEX_FILE = "model.safetensors.index.json"  # transformers' name (kvbench.hf_weights.INDEX_FILE)


def job(tmp_path, *overrides):
    return run_job(compose(*FAST, *overrides), tmp_path)


def one_line(info) -> str:
    [line] = str(info.value).splitlines()
    return line


# ---- which safetensors files, and which tensor of which file ------------------------------

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One tiny random Llama, DeepSeek-V3 and Qwen3 each (save_pretrained), copied per test."""
    base = tmp_path_factory.mktemp("hf")
    return {"llama": llama_dir(base / "llama", 2, vocab_size=256)[0],
            "deepseek": deepseek_dir(base / "deepseek", vocab_size=256)[0],
            "qwen3": hf_dir(base / "qwen3", 2, family="qwen3", vocab_size=256, sliding_window=8,
                            use_sliding_window=True, max_window_layers=1)[0]}


def copy(checkpoints, tmp_path, family="llama"):
    return shutil.copytree(checkpoints[family], tmp_path / family)


def shard(path, files=("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"), index=True):
    """Split model.safetensors into two shards (layers 0 in the first, the rest in the second), as
    save_pretrained writes a sharded checkpoint, with its index or without."""
    tensors = load_file(path / "model.safetensors")
    first = {k: v for k, v in tensors.items() if k.startswith("model.layers.0.")}
    save_file(first, path / files[0], metadata={"format": "pt"})
    save_file({k: v for k, v in tensors.items() if k not in first}, path / files[1], metadata={"format": "pt"})
    (path / "model.safetensors").unlink()
    if index:
        weight_map = {k: files[0] if k in first else files[1] for k in tensors}
        (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def logits(model):
    tokens = torch.arange(12).reshape(1, 12) % 256
    with torch.no_grad():
        return model(tokens)


def test_a_sharded_checkpoint_with_or_without_its_index_is_the_same_model(checkpoints, tmp_path):
    whole = logits(load_llama_dir(checkpoints["llama"])[0])
    with_index = copy(checkpoints, tmp_path)
    shard(with_index)
    assert torch.equal(logits(load_llama_dir(with_index)[0]), whole)
    without = shutil.copytree(with_index, tmp_path / "without")
    (without / INDEX_FILE).unlink()
    assert torch.equal(logits(load_llama_dir(without)[0]), whole)


def _duplicate_shards(path):
    # two complete copies as the two shards of a series, no index: every tensor in both
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    shutil.copy(path / "model-00001-of-00002.safetensors", path / "model-00002-of-00002.safetensors")


def _stray_file(path):
    # a second file beside model.safetensors holding one of its weights with other values
    save_file({"model.norm.weight": torch.zeros(32)}, path / "extra.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("plant, tensor, files", [
    (_duplicate_shards, "lm_head.weight", ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")),
    (_stray_file, "model.norm.weight", ("extra.safetensors", "model.safetensors")),
])
def test_a_tensor_in_two_files_is_invalid_naming_it_and_both_files(checkpoints, tmp_path, plant, tensor, files):
    """The last file read used to win, and the run was ok: in model=hf_dir and in task=eval."""
    path = copy(checkpoints, tmp_path)
    plant(path)
    with pytest.raises(CheckpointError) as info:
        load_llama_dir(path)
    line = one_line(info)
    assert f"tensor {tensor} is in both {files[0]} and {files[1]}" in line and str(path) in line
    for overrides in (["model=hf_dir", f"model.path={path}"],
                      ["task=eval", f"train.checkpoint={path}", "train.eval_batches=1", "train.batch_size=1",
                       "train.seq_len=8"]):
        result = job(tmp_path / overrides[0].replace("=", "_"), *overrides)
        assert result.status == "invalid", (overrides, result.status, result.error)
        assert f"tensor {tensor} is in both {files[0]} and {files[1]}" in result.error


@pytest.mark.parametrize("edit, needle", [
    # the index places a tensor in the other shard than the one holding it
    (lambda m: {**m, "model.norm.weight": "model-00001-of-00002.safetensors"},
     f"{INDEX_FILE}: places it in model-00001-of-00002.safetensors, but tensor model.norm.weight is in "
     "model-00002-of-00002.safetensors"),
    # a tensor a shard holds that the index does not list
    (lambda m: {k: v for k, v in m.items() if k != "model.norm.weight"},
     f"{INDEX_FILE}: does not list it, but tensor model.norm.weight is in model-00002-of-00002.safetensors"),
    # a file the index names that is not there
    (lambda m: {**m, "model.norm.weight": "model-00003-of-00003.safetensors"},
     f"{INDEX_FILE}: names model-00003-of-00003.safetensors, which is not in"),
    # a tensor the index lists that no file holds
    (lambda m: {**m, "model.layers.9.mlp.up_proj.weight": "model-00001-of-00002.safetensors"},
     f"{INDEX_FILE}: places tensor model.layers.9.mlp.up_proj.weight in model-00001-of-00002.safetensors, "
     "which does not hold it"),
    # a path, not a file of the directory: the index must not send the reader elsewhere
    (lambda m: {**m, "model.norm.weight": "../model-00002-of-00002.safetensors"},
     "weight_map['model.norm.weight']='../model-00002-of-00002.safetensors': not a file name in"),
    (lambda m: [1, 2], "no weight_map"),
])
def test_an_index_that_disagrees_with_the_files_is_invalid_naming_it(checkpoints, tmp_path, edit, needle):
    path = copy(checkpoints, tmp_path)
    shard(path)
    index = json.loads((path / INDEX_FILE).read_text())
    changed = edit(index["weight_map"])
    (path / INDEX_FILE).write_text(json.dumps({**index, "weight_map": changed}))
    with pytest.raises(CheckpointError) as info:
        load_llama_dir(path)
    assert needle in one_line(info)


def test_a_missing_shard_is_named(checkpoints, tmp_path):
    path = copy(checkpoints, tmp_path)
    shard(path, index=False)
    (path / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError) as info:
        load_llama_dir(path)
    assert "shard model-00001-of-00002.safetensors is missing (1 of 2 present)" in one_line(info)


def test_a_config_of_100000_layers_over_2_layers_of_tensors_is_refused_before_anything_is_built(
        checkpoints, tmp_path, monkeypatch):
    """The footprint lets a narrow model of 100,000 layers through; the tensor check came after
    building them (past a job's 120 s bound). The headers say 2 layers: refused from them."""
    path = copy(checkpoints, tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 100_000}))

    def built(*args, **kwargs):
        raise AssertionError("a decoder was built for the checkpoint's config before its tensors were checked")

    monkeypatch.setattr(checkpoint, "_expected_tensors", built)
    with pytest.raises(CheckpointError) as info:
        load_llama_dir(path)
    assert one_line(info) == (f"{path / 'config.json'}: num_hidden_layers=100000, but the safetensors files hold "
                              "tensors of layers 0, 1")


def _drop(path, name):
    tensors = load_file(path / "model.safetensors")
    del tensors[name]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("family, dropped, named", [
    ("deepseek", "model.layers.1.self_attn.kv_b_proj.weight", "a DeepseekV3ForCausalLM (model_type deepseek_v3)"),
    ("qwen3", "model.layers.0.self_attn.q_norm.weight", "a Qwen3ForCausalLM (model_type qwen3)"),
    ("llama", "model.layers.1.mlp.up_proj.weight", "a LlamaForCausalLM (model_type llama)"),
])
def test_a_missing_tensor_names_the_checkpoints_own_architecture(checkpoints, tmp_path, family, dropped, named):
    """A DeepSeek checkpoint with a tensor missing was called 'a Llama decoder'."""
    path = copy(checkpoints, tmp_path, family)
    _drop(path, dropped)
    with pytest.raises(CheckpointError) as info:
        load_llama_dir(path)
    line = one_line(info)
    assert f"tensor names do not match {named} as {path / 'config.json'} describes it" in line
    assert f"missing [{dropped!r}]" in line and "blocks." not in line  # the file's name (it was kvbench's)
    assert family == "llama" or "Llama" not in line


# ---- config.json: every value read is of its JSON type ------------------------------------

@pytest.mark.parametrize("family, key, value", [
    ("deepseek", "qk_nope_head_dim", "6"),    # was: TypeError: can only concatenate str (not "int") to str
    ("deepseek", "qk_rope_head_dim", "4"),
    ("deepseek", "kv_lora_rank", "16"),
    ("deepseek", "q_lora_rank", "twelve"),
    ("deepseek", "first_k_dense_replace", "2"),
    ("deepseek", "rope_interleave", "false"),
    ("deepseek", "hidden_size", "32"),         # OmegaConf converted it silently
    ("qwen3", "max_window_layers", "1"),       # (without layer_types) was: TypeError: '>=' not supported
    ("qwen3", "sliding_window", "8"),
    ("qwen3", "use_sliding_window", "yes"),
    ("qwen3", "head_dim", 8.0),
    ("qwen3", "tie_word_embeddings", "false"),  # a non-empty string tied the head to the embedding
    ("qwen3", "rms_norm_eps", "1e-6"),
    ("qwen3", "max_position_embeddings", [64]),
    ("llama", "architectures", "LlamaForCausalLM"),
])
def test_a_value_of_the_wrong_json_type_in_config_json_is_one_line_naming_key_and_value(
        checkpoints, tmp_path, family, key, value):
    path = copy(checkpoints, tmp_path, family)
    config = json.loads((path / "config.json").read_text())
    if key == "max_window_layers":  # read only where layer_types (transformers >= 5 writes it) is not
        del config["layer_types"]
    (path / "config.json").write_text(json.dumps({**config, key: value}))
    for load, prefix in ((lambda: load_llama_dir(path), f"{path / 'config.json'}: "),
                         (lambda: ModelConfig(path=str(path)), f"model.path={str(path)!r}: {path / 'config.json'}: ")):
        with pytest.raises(ConfigError) as info:
            load()
        line = one_line(info)
        assert line.startswith(f"{prefix}{key}={value!r}: must be "), line
        assert "TypeError" not in line


@pytest.mark.parametrize("rope, key", [
    ({"rope_type": "default", "rope_theta": "500"}, "rope_parameters.rope_theta='500'"),
    ({"rope_type": "linear", "factor": "2"}, "rope_parameters.factor='2'"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": "32"}, "rope_parameters.beta_fast='32'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192.5}, "rope_parameters.original_max_position_embeddings=8192.5"),
    ({"rope_type": 3}, "rope_parameters.rope_type=3"),
])
def test_a_rope_value_of_the_wrong_type_names_its_nested_key(rope, key):
    hf = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48, "vocab_size": VOCAB,
          "max_position_embeddings": 64, "rope_parameters": rope}
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf_config(hf, "ck/config.json")
    assert one_line(info).startswith(f"ck/config.json: {key}: must be ")


# ---- config.json: a bad value is named by the key the file holds it under -----------------

RATIO = "(each key head serves the same number of value heads)"


def _hybrid_config(path, family):
    """The config.json save_pretrained writes for a tiny Qwen3.5 multimodal (its language model's keys
    in text_config) or Qwen3-Next checkpoint; a value refused as the file is read needs no tensors."""
    import transformers

    text = dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=160, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12)
    if family == "qwen3_5_vl":
        vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=64, patch_size=4)
        config = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    else:
        config = transformers.Qwen3NextConfig(**text, num_experts=4, mlp_only_layers=list(range(8)))
    config.architectures = [{"qwen3_5_vl": "Qwen3_5ForConditionalGeneration"}.get(family, "Qwen3NextForCausalLM")]
    path.mkdir()
    config.save_pretrained(path)
    return path


@pytest.mark.parametrize("family, drop, changes, line", [
    ("llama", (), {"max_position_embeddings": 0}, "max_position_embeddings=0: must be >= 1"),
    ("llama", (), {"num_attention_heads": 0}, "num_attention_heads=0: must be >= 1"),
    ("llama", (), {"num_key_value_heads": 3}, "num_key_value_heads=3: must divide num_attention_heads=4"),
    ("llama", (), {"rms_norm_eps": -1}, "rms_norm_eps=-1.0: must be > 0"),
    ("llama", (), {"vocab_size": 0}, "vocab_size=0: must be >= 1"),
    ("llama", (), {"num_hidden_layers": 0}, "num_hidden_layers=0: must be >= 1"),
    ("llama", (), {"intermediate_size": 0}, "intermediate_size=0: must be >= 1"),
    ("llama", (), {"head_dim": 7}, "head_dim=7: must be even and >= 2 (rotary embeddings rotate pairs of dimensions)"),
    # a value the file leaves out is named by the key that would set it, and said to be unset
    ("llama", ("head_dim",), {"hidden_size": 36}, "head_dim=9: must be even and >= 2 (rotary embeddings rotate "
     "pairs of dimensions); config.json sets no head_dim: hidden_size / num_attention_heads"),
    # rope keys by the object the file used (given both, transformers reads rope_scaling)
    ("llama", (), {"rope_scaling": {"rope_type": "linear", "factor": 0}},
     "rope_scaling.factor=0.0: must be >= 1 (the factor positions are stretched by)"),
    ("llama", (), {"rope_parameters": {"rope_type": "linear", "factor": 0}},
     "rope_parameters.factor=0.0: must be >= 1 (the factor positions are stretched by)"),
    ("llama", (), {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}},
     "rope_parameters.original_max_position_embeddings=0: must be >= 1 with rope_parameters.rope_type=yarn "
     "(the pretraining context)"),
    ("llama", ("rope_parameters",), {"rope_scaling": {"type": "yarn", "factor": 4.0},
                                     "original_max_position_embeddings": -1},
     "original_max_position_embeddings=-1: must be >= 1 with rope_scaling.type=yarn (the pretraining context)"),
    ("llama", (), {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 0.5}},
     "rope_parameters.beta_fast=0.5: must be > rope_parameters.beta_slow=1.0 > 0; config.json sets no "
     "rope_parameters.beta_slow: the default"),
    ("deepseek", (), {"kv_lora_rank": 0}, "kv_lora_rank=0: must be >= 1"),
    ("qwen3", (), {"sliding_window": -1}, "sliding_window=-1: must be >= 1 positions, 0 (no window) or null"),
    ("qwen3_next", (), {"layer_types": ["linear_attention", "full_attention"]},
     "layer_types=['linear_attention', 'full_attention']: must name each of num_hidden_layers=8 layers"),
    ("qwen3_next", (), {"linear_num_value_heads": 5},
     f"linear_num_value_heads=5: must be a multiple of linear_num_key_heads=2 {RATIO}"),
    ("qwen3_next", ("linear_num_value_heads",), {"linear_num_key_heads": 3}, "linear_num_value_heads=32: must be a "
     f"multiple of linear_num_key_heads=3 {RATIO}; config.json sets no linear_num_value_heads: the default"),
    ("qwen3_next", (), {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.1}},
     "rope_parameters.partial_rotary_factor=0.1: must be in (0, 1] and rotate an even number >= 2 of the "
     "head_dim=16 dimensions (int(head_dim x factor) = 1)"),
    # a multimodal checkpoint's language model: its keys in text_config
    ("qwen3_5_vl", (), {"num_attention_heads": 0}, "text_config.num_attention_heads=0: must be >= 1"),
    ("qwen3_5_vl", (), {"num_key_value_heads": 3},
     "text_config.num_key_value_heads=3: must divide text_config.num_attention_heads=4"),
    # ... also where the reader itself refuses one, or misses one
    ("qwen3_5_vl", (), {"hidden_act": "gelu"}, "text_config.hidden_act='gelu': not supported (silu only)"),
    ("qwen3_5_vl", (), {"linear_num_value_heads": "4"}, "text_config.linear_num_value_heads='4': must be an integer"),
    ("qwen3_5_vl", (), {"linear_num_value_heads": 5},
     f"text_config.linear_num_value_heads=5: must be a multiple of text_config.linear_num_key_heads=2 {RATIO}"),
    ("qwen3_5_vl", ("vocab_size",), {}, "missing key 'text_config.vocab_size'"),
    ("qwen3_5_vl", (), {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
     "text_config.rope_parameters.rope_type='dynamic': not supported (accepted: default, linear, llama3, yarn)"),
])
def test_a_bad_value_in_config_json_is_named_by_its_key_in_the_file(checkpoints, tmp_path, family, drop, changes,
                                                                      line):
    """ModelConfig's checks named kvbench's fields (model.max_seq_len, model.num_heads), keys a
    user who gave a checkpoint never wrote."""
    if family in checkpoints:
        path = copy(checkpoints, tmp_path, family)
    else:
        path = _hybrid_config(tmp_path / family, family)
    if family == "qwen3_5_vl":
        config = json.loads((path / "config.json").read_text())
        edit_config_json(path, text_config={k: v for k, v in {**config["text_config"], **changes}.items()
                                            if k not in drop})
    else:
        edit_config_json(path, drop, **changes)
    for load, prefix in ((lambda: load_llama_dir(path), f"{path / 'config.json'}: "),
                         (lambda: ModelConfig(path=str(path)), f"model.path={str(path)!r}: {path / 'config.json'}: ")):
        with pytest.raises(ConfigError) as info:
            load()
        assert one_line(info) == prefix + line


def test_a_max_seq_len_the_caller_gives_keeps_kvbenchs_key(checkpoints, tmp_path):
    """max_seq_len passed with the checkpoint is not the file's: its refusal names kvbench's key."""
    path = copy(checkpoints, tmp_path)
    with pytest.raises(ConfigError) as info:
        load_llama_dir(path, max_seq_len=-1)
    assert one_line(info) == f"{path / 'config.json'}: model.max_seq_len=-1: must be >= 1"
    # the file's own max_position_embeddings, when the caller gives none, is named by its key
    edit_config_json(path, max_position_embeddings=-1)
    with pytest.raises(ConfigError) as info:
        load_llama_dir(path)
    assert one_line(info) == f"{path / 'config.json'}: max_position_embeddings=-1: must be >= 1"
    assert load_llama_dir(path, max_seq_len=32)[0].config.max_seq_len == 32


# ---- the model run is the one the record names -------------------------------------------

TRAIN = ["model=train_small", "model.num_layers=2", "model.d_model=32", "model.num_heads=4", "model.preset_kv_heads=4",
         "model.ffn_dim=64", "model.max_seq_len=64", "train.batch_size=2", "train.seq_len=16", "train.eval_batches=1",
         "train.eval_every=1", "train.log_every=1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A kvbench checkpoint of task=train (MHA, no window) and the corpus it learnt."""
    base = tmp_path_factory.mktemp("trained")
    corpus = base / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    result = run_job(compose(*FAST, "task=train", "train.steps=2", f"data.path={corpus}", *TRAIN), base / "train")
    assert result.status == "ok", result.error
    return base / "train" / "checkpoint.pt", corpus


@pytest.mark.parametrize("overrides, windows, kv", [
    (["attention.window=8"], [8, 8], 4),
    (["attention=gqa", "attention.num_kv_heads=2", "attention.window=8", "attention.global_every=2"], [8, None], 2),
])
def test_train_init_from_trains_and_saves_the_window_its_record_names(trained, tmp_path, overrides, windows, kv):
    """It recorded window 8 and trained and saved a model without it."""
    checkpoint_path, corpus = trained
    result = job(tmp_path, "task=train", f"train.init_from={checkpoint_path}", "train.steps=1", f"data.path={corpus}",
                 *TRAIN, *overrides)
    assert result.status == "ok", result.error
    assert result.config["attention"]["window"] == 8
    saved = checkpoint.load_checkpoint(tmp_path / "checkpoint.pt")
    assert list(saved.layouts.windows) == windows and saved.num_kv_heads == kv
    assert saved.attention.window == 8


@pytest.mark.parametrize("overrides, named", [
    (["attention=mla"], "attention.type='mla': the checkpoint has 4 K/V heads"),
    (["attention=gqa", "attention.num_kv_heads=3"], "attention.num_kv_heads=3"),
])
def test_train_init_from_a_layout_its_checkpoint_cannot_become_is_invalid_before_training(
        trained, tmp_path, monkeypatch, overrides, named):
    import kvbench.quality.train as train_module

    def trains(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(train_module, "train", trains)
    checkpoint_path, corpus = trained
    result = job(tmp_path, "task=train", f"train.init_from={checkpoint_path}", "train.steps=1", f"data.path={corpus}",
                 *TRAIN, *overrides)
    assert result.status == "invalid" and named in result.error.splitlines()[0]


def test_a_checkpoint_directory_run_with_another_window_runs_that_window(checkpoints):
    """model=hf_dir attention.window=4 recorded the window and ran the checkpoint without it."""
    from kvbench.jobs.job_config import to_bench_config
    from kvbench.tasks.common import build_model

    cfg = to_bench_config(compose(*FAST, "model=hf_dir", f"model.path={checkpoints['llama']}", "attention.window=4"))
    assert build_model(cfg, torch.device("cpu")).layouts.windows == (4, 4)
    # and a checkpoint's own window can be switched off (0), or kept (null)
    qwen = ["model=hf_dir", f"model.path={checkpoints['qwen3']}"]
    assert build_model(to_bench_config(compose(*FAST, *qwen, "attention.window=0")),
                       torch.device("cpu")).layouts.windows == (None, None)
    assert build_model(to_bench_config(compose(*FAST, *qwen)), torch.device("cpu")).layouts.windows == (None, 8)


RECALL = ["task=recall", "model=tiny", "model.num_layers=2", "model.d_model=32", "model.num_heads=4",
          "model.preset_kv_heads=4", "model.ffn_dim=64", "model.max_seq_len=32", "recall.vocab_size=16",
          "recall.num_pairs=[2]", "recall.seq_len=[12]", "recall.seeds=1", "recall.eval_sequences=8",
          "train.steps=1", "train.batch_size=2", "train.log_every=1"]


@pytest.mark.parametrize("overrides", [["attention=mla"], ["attention=recall/mla"]])
def test_recall_uptrain_of_an_mla_variant_is_refused_naming_the_key(tmp_path, monkeypatch, overrides):
    """It scored a mean-pooled MQA model under the label MLA."""
    import kvbench.tasks.recall as recall

    monkeypatch.setattr(recall, "_fit", lambda *a, **k: (_ for _ in ()).throw(AssertionError("training started")))
    result = job(tmp_path, *RECALL, *overrides, "recall.uptrain_steps=1")
    assert result.status == "invalid"
    [line] = result.error.splitlines()
    assert line == ("recall.uptrain_steps=1: converts K/V heads by mean-pooling them; attention=mla caches a latent, "
                    "which pooling does not make (converting to MLA is not built); use recall.uptrain_steps=null to "
                    "train the variant from scratch")


@pytest.mark.parametrize("overrides, windows", [
    (["attention=gqa", "attention.num_kv_heads=2", "attention.window=4"], [4, 4]),
    (["attention=mqa", "attention.window=4", "attention.layer_types=[full_attention,sliding_attention]"], [None, 4]),
    (["attention=mqa"], [None, None]),
])
def test_recall_uptrain_scores_the_variant_with_its_window(tmp_path, monkeypatch, overrides, windows):
    """With attention.window=4 it scored a model without its window under the windowed label."""
    import kvbench.tasks.recall as recall

    scored = []
    real = recall._scores
    monkeypatch.setattr(recall, "_scores", lambda model, *a: scored.append(
        (list(model.layouts.windows), model.num_kv_heads, model.attention.latent)) or real(model, *a))
    result = job(tmp_path, *RECALL, *overrides, "recall.uptrain_steps=1")
    assert result.status == "ok", result.error
    kv = result.config["attention"]["num_kv_heads"]
    assert scored == [(windows, kv, False)] * 2  # before and after uptraining: the variant both times


def test_recall_at_the_models_full_length_times_its_decode_and_ends_ok(tmp_path):
    """recall.seq_len == model.max_seq_len trained and scored every seed, then the closing decode
    timing needed one more position: `error` after all the training."""
    result = job(tmp_path, *RECALL, "attention=mha", "recall.seq_len=[12,32]")
    assert result.status == "ok", result.error
    assert result.metrics["decode_ms_p50"] > 0


def test_the_recall_gpu_preset_runs_at_its_own_lengths(tmp_path):
    """experiment=recall_gpu (seq_len 512 = max_seq_len 512) failed every job after its training;
    its shapes kept, its budget cut to a step."""
    cfg = compose("experiment=recall_gpu", "attention=recall/swa", "wandb=disabled", "runtime.isolate=false",
                  "runtime.device=cpu", "train.steps=1", "train.batch_size=1", "train.warmup_steps=1",
                  "recall.seeds=1", "recall.eval_sequences=2", "recall.num_pairs=[16]")
    assert max(cfg.recall.seq_len) == cfg.model.max_seq_len == 512
    result = run_job(cfg, tmp_path)
    assert result.status == "ok", result.error


@pytest.mark.parametrize("overrides, line", [
    (["task=train", "train.seq_len=65", "model.max_seq_len=64"], "train.seq_len=65: longer than model.max_seq_len=64"),
    ([*RECALL, "recall.seq_len=[12,40]"], "recall.seq_len=[12, 40]: longer than model.max_seq_len=32"),
])
def test_a_length_past_the_model_is_refused_when_the_config_is_typed(overrides, line):
    """Found before the job's data, checkpoint or first step (the config, as a sweep types each job)."""
    from kvbench.jobs.job_config import to_bench_config

    with pytest.raises(ConfigError) as info:
        to_bench_config(compose(*FAST, *overrides))
    assert one_line(info) == line


# ---- a record's figures agree with each other and with physics ----------------------------

@pytest.mark.parametrize("workload", ["decode", "multiturn"])
def test_a_run_without_a_cache_records_that_it_holds_nothing(tmp_path, workload):
    """cache.impl=none was ok with kv_cache_bytes=0 beside a formula of the layout's bytes, which
    the record's own plausibility check called implausible."""
    chat = ["workload.system_len=16", "workload.turns=2", "workload.user_len=4", "workload.reply_len=2"]
    result = job(tmp_path, "model=tiny", "cache.impl=none", f"workload={workload}",
                 *(chat if workload == "multiturn" else []))  # a short chat: what is held is 0 at any length
    assert result.status == "ok", result.error
    assert result.metrics["kv_cache_bytes"] == result.metrics["kv_cache_bytes_formula"] == 0
    assert result.implausible == []
    assert "cache.impl=none: 0, it holds nothing" in result.methods["kv_cache_bytes_formula"] or workload != "decode"
    static = job(tmp_path / "static", "model=tiny", "cache.impl=static")
    assert static.metrics["kv_cache_bytes"] == static.metrics["kv_cache_bytes_formula"] > 0


PROBE = {"copy_gb_per_s": 11.0, "gemv_gb_per_s": 17.0, "matmul_gflops": 90.0}


@pytest.mark.parametrize("cached", [
    {**PROBE, "gemv_gb_per_s": 1e9},   # was the roofline's peak: percent_of_peak 6e-8, nothing implausible
    {**PROBE, "copy_gb_per_s": 2e5},
    {**PROBE, "matmul_gflops": 1e12},
])
def test_a_physically_impossible_cached_probe_is_probed_again(tmp_path, monkeypatch, cached):
    from kvbench.measure import roofline

    monkeypatch.setattr(roofline, "probe_bandwidth", lambda device: dict(PROBE))
    cache = tmp_path / "bandwidth.json"
    cache.write_text(json.dumps({roofline._machine_key(torch.device("cpu")): {**cached, "probed_at": "then"}}))
    peaks = roofline.machine_peaks(torch.device("cpu"), None, cache)
    assert (peaks["peak_gb_per_s"], peaks["peak_gflops"]) == (17.0, 90.0)
    entry = json.loads(cache.read_text())[roofline._machine_key(torch.device("cpu"))]
    assert {k: entry[k] for k in PROBE} == PROBE and entry["probed_at"] != "then"  # the probe replaced it
    # a plausible entry is still trusted (no probe)
    monkeypatch.setattr(roofline, "probe_bandwidth", lambda device: (_ for _ in ()).throw(AssertionError("probed")))
    assert roofline.machine_peaks(torch.device("cpu"), None, cache)["peak_gb_per_s"] == 17.0


def test_on_cuda_the_ceiling_is_the_devices_own_dram_rate(monkeypatch):
    """An H100 SXM (memory clock 2.619 GHz, 5120-bit bus: 3.35 TB/s) caps a probe at twice that;
    a driver that reports no clock leaves the ceiling every device shares."""
    from types import SimpleNamespace

    from kvbench.config.bench import MAX_GB_PER_S
    from kvbench.measure import roofline

    h100 = SimpleNamespace(memory_clock_rate=2_619_000, memory_bus_width=5120)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: h100)
    ceilings = roofline.physical_ceilings(torch.device("cuda"))
    assert ceilings["gemv_gb_per_s"] == pytest.approx(2 * 2 * 2.619e9 * 640 / 1e9)  # 6,704 GB/s
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace())
    assert roofline.physical_ceilings(torch.device("cuda"))["gemv_gb_per_s"] == MAX_GB_PER_S
    assert roofline.physical_ceilings(torch.device("cpu"))["matmul_gflops"] == roofline.MAX_GFLOPS


def test_a_peak_no_device_reaches_is_refused_naming_the_key():
    from kvbench.jobs.job_config import to_bench_config

    with pytest.raises(ConfigError) as info:
        to_bench_config(compose(*FAST, "runtime.peak_gb_per_s=1e9"))
    assert one_line(info).startswith("runtime.peak_gb_per_s=1000000000.0: must be null or in (0, 1e+05] GB/s")
    assert to_bench_config(compose(*FAST, "runtime.peak_gb_per_s=4800")).runtime.peak_gb_per_s == 4800


# ---- one "KV / token" for a windowed layout ----------------------------------------------

def test_kv_per_token_is_one_figure_at_a_stated_length_in_the_record_and_in_choose():
    """experiment=choose printed 4.00 KiB for the hybrid in the jobs table (one position, the
    window ignored) and 1.73 KiB in its recommendation table (the longest context's sequence)."""
    from kvbench.jobs.job_config import to_bench_config
    from kvbench.sinks.choose import KV_PER_TOKEN, choices
    from kvbench.sinks.tables import fmt
    from kvbench.tasks.capacity_search import kv_bytes, kv_bytes_per_token

    cfg = to_bench_config(compose("experiment=choose", "attention=choose/hybrid", "scenario=decode"))
    per_token, positions = kv_bytes_per_token(cfg)
    assert positions == 256 + 8  # the longest context + gen_len
    # 8 layers of GQA-2 x head_dim 32, K and V in float32 (512 B a position): 2 global hold 264, 6 local a ring of 64
    assert per_token == kv_bytes(cfg, 256, 1) / 264 == (2 * 264 + 6 * 64) * 512 / 264
    assert fmt(per_token, "bytes") == "1.73 KiB"
    full = to_bench_config(compose("experiment=choose", "attention=gqa", "scenario=decode"))
    assert kv_bytes_per_token(full) == (8 * 512, 264)  # no window: any one position's bytes (4.00 KiB)
    record = {"job": "4", "status": "ok",
              "config": {"task": "capacity", "model": {"name": "small"}, "workload": {"name": "decode", "gen_len": 8},
                         "attention": {"type": "gqa", "num_kv_heads": 2, "window": 64, "global_every": 4}},
              "metrics": {"max_batch_longest": 50, "kv_bytes_per_token": per_token,
                          "kv_bytes_per_token_positions": positions},
              "tables": {"capacity": [{"context": 256, "max_batch": 50}]}}
    (choice,) = choices([record])
    [row] = choice.rows
    assert dict(zip(choice.header, row))[KV_PER_TOKEN] == fmt(per_token, "bytes") == "1.73 KiB"


def test_inspect_per_token_of_a_windowed_model_follows_its_per_sequence():
    """task=inspect of a windowed model: 'per token' ignored the window while 'per sequence' did not."""
    from kvbench.jobs.job_config import to_bench_config
    from kvbench.tasks.inspect import describe

    cfg = to_bench_config(compose("model=gemma3_27b", "task=inspect", "runtime.dtype=bfloat16",
                                  "workload.prompt_len=8191", "workload.gen_len=1"))
    text = describe(cfg)
    header = next(line for line in text.splitlines() if line.startswith("KV dtype"))
    assert "per token (at 8192)" in header
    per_sequence = (52 * 1024 + 10 * 8192) * 2 * 16 * 128 * 2  # 52 local layers hold W=1024, 10 global all
    row = next(line for line in text.splitlines() if line.startswith("bfloat16"))
    assert f"({per_sequence // 8192:,})" in row and f"({per_sequence:,})" in row
    assert "per token (at 8192): per sequence / 8192; a local layer holds at most W" in text
    # without a window the column is unchanged: any one position's bytes
    plain = describe(to_bench_config(compose("model=llama2_7b", "task=inspect")))
    assert next(line for line in plain.splitlines() if line.startswith("float16")).split()[1:3] == ["512.00", "KiB"]


@pytest.mark.parametrize("overrides, windows", [([], [8, 8]), (["attention.window=0"], [None, None]),
                                                (["attention.window=4"], [4, 4])])
def test_eval_of_a_windowed_kvbench_checkpoint_is_the_model_it_saved_unless_asked(trained, tmp_path, monkeypatch,
                                                                                 overrides, windows):
    """attention=model (the default) evaluates the checkpoint's own layout: its window too (it was
    dropped, the record saying window null); another window is asked by name."""
    import kvbench.quality.train as train_module
    from kvbench.checkpoint import load_checkpoint, save_checkpoint, to_layout
    from kvbench.config.model import AttentionConfig

    checkpoint_path, corpus = trained
    base = load_checkpoint(checkpoint_path)
    windowed = to_layout(base, AttentionConfig(type="mha", window=8).resolved(base.config))[0]
    path = save_checkpoint(tmp_path / "windowed.pt", windowed)
    seen = []
    real = train_module.evaluate
    monkeypatch.setattr(train_module, "evaluate", lambda model, *a, **k: seen.append(list(model.layouts.windows)) or
                        real(model, *a, **k))
    result = job(tmp_path / "eval", "task=eval", f"train.checkpoint={path}", f"data.path={corpus}", *TRAIN, *overrides)
    assert result.status == "ok", result.error
    assert seen == [windows]
    assert (result.config["attention"].get("window") or None) == windows[0]


def test_a_capacity_search_without_a_cache_counts_no_kv_bytes():
    """The probes' KV formula is what their cache holds: with cache.impl=none, nothing (its
    recomputed K/V are part of the measured activations, not bytes of a cache it does not keep)."""
    from kvbench.jobs.job_config import to_bench_config
    from kvbench.tasks.capacity_search import kv_bytes, kv_bytes_per_token

    cfg = to_bench_config(compose("experiment=choose", "attention=gqa", "scenario=decode", "cache.impl=none",
                                  "slo.tpot_x_batch1=null", "slo.tpot_ms=1000"))
    assert kv_bytes(cfg, 256, 4) == 0 and kv_bytes_per_token(cfg) == (0, 264)
    static = to_bench_config(compose("experiment=choose", "attention=gqa", "scenario=decode"))
    assert kv_bytes(static, 256, 4) == 4 * 264 * 8 * 512
