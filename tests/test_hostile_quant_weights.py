"""A quantized checkpoint that does not add up: a scale tensor of the wrong shape or dtype, missing or
left over, a block size that does not divide or is not one, a NaN or infinite scale, an unknown
quant_method. Each is one line naming the tensor or the key as the file writes it, a CheckpointError or
ConfigError (the CLI exits 2 with it, a job records invalid), before any decoder is built; the
headers' faults before a tensor is read."""

import json
import shutil

import pytest
import torch
from conftest import compose, deepseek_dir
from quant_checkpoints import fp8_encoder, mxfp4_encoder, nvfp4_encoder, rewrite
from safetensors.torch import load_file, save_file
from test_quant_weights import FP8, MXFP4, NVFP4, gpt_oss

import kvbench.checkpoint as checkpoint
from kvbench.checkpoint import CheckpointError, load_llama_dir
from kvbench.config.model import ModelConfig
from kvbench.core.errors import ConfigError
from kvbench.jobs.runner import run_job

FAST = ["wandb=disabled", "runtime.isolate=false", "workload.prompt_len=8", "workload.gen_len=2"]
Q_A = "model.layers.0.self_attn.q_a_proj.weight"  # (12, 32): in blocks of 8 x 16, a grid of 2 x 2
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"
O_PROJ = "model.layers.0.self_attn.o_proj.weight"


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """One tiny checkpoint of each format (FP8 in blocks of 8 x 16, so that grids have several blocks)."""
    base = tmp_path_factory.mktemp("quant")
    deepseek, _ = deepseek_dir(base / "deepseek", vocab_size=256, max_position_embeddings=64)
    rewrite(deepseek, base / "fp8", base / "fp8_float", {**FP8, "weight_block_size": [8, 16]}, fp8_encoder((8, 16)))
    narrow, _ = deepseek_dir(base / "narrow", vocab_size=256, max_position_embeddings=64, q_lora_rank=16, v_head_dim=4)
    rewrite(narrow, base / "nvfp4", base / "nvfp4_float", NVFP4, nvfp4_encoder)
    oss, _ = gpt_oss(base / "gpt_oss")
    rewrite(oss, base / "mxfp4", base / "mxfp4_float", MXFP4, mxfp4_encoder)
    return base


def refused(path, needle, error=CheckpointError):
    """The one line loading ``path`` raises; no decoder was built."""
    built = []
    original = checkpoint.build_decoder
    checkpoint.build_decoder = lambda *a, **k: built.append(1) or original(*a, **k)
    try:
        with pytest.raises(error) as info:
            load_llama_dir(path)
    finally:
        checkpoint.build_decoder = original
    [line] = str(info.value).splitlines()
    assert needle in line, line
    assert not built
    return line


def edited(quantized, tmp_path, kind, edit=None, **config):
    """A copy of the ``kind`` checkpoint with its tensors passed through ``edit`` and its quantization_config
    updated by ``config``."""
    path = shutil.copytree(quantized / kind, tmp_path / kind)
    if edit is not None:
        tensors = load_file(path / "model.safetensors")
        edit(tensors)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    if config:
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"] = {**cfg["quantization_config"], **config}
        (path / "config.json").write_text(json.dumps(cfg))
    return path


def _set(name, value):
    return lambda ts: ts.__setitem__(name, value)


def _drop(name):
    return lambda ts: ts.pop(name)


def _nan_at(name, dtype=None):
    def edit(ts):
        t = ts[name].float().clone()
        t.view(-1)[0] = float("nan")
        ts[name] = t.to(dtype or ts[name].dtype)
    return edit


def _inf_at(name):
    def edit(ts):
        ts[name] = ts[name].clone()
        ts[name].view(-1)[0] = float("inf")
    return edit


@pytest.mark.parametrize("fmt, edit, needle", [
    # FP8: a grid that is not ceil(rows / 8) x ceil(columns / 16) (a floor, as if the blocks divided)
    ("fp8", _set(f"{Q_A}_scale_inv", torch.ones(1, 2)),
     f"tensor {Q_A}_scale_inv has shape (1, 2), {Q_A} (12, 32) in quantization_config.weight_block_size=[8, 16] "
     "blocks implies (2, 2)"),
    ("fp8", _drop(f"{Q_A}_scale_inv"), f"tensor {Q_A} has no {Q_A}_scale_inv beside it"),
    ("fp8", _set(f"{Q_A}_scale_inv", torch.ones(2, 2, dtype=torch.int32)), f"tensor {Q_A}_scale_inv is I32, not F32"),
    ("fp8", _nan_at(f"{Q_A}_scale_inv"), f"tensor {Q_A}_scale_inv holds NaN or infinite scales"),
    ("fp8", _inf_at(f"{Q_A}_scale_inv"), f"tensor {Q_A}_scale_inv holds NaN or infinite scales"),
    ("fp8", _drop(Q_A), f"tensor {Q_A}_scale_inv scales {Q_A}, which the files do not hold"),
    ("fp8", _set(Q_A, torch.ones(12, 32, dtype=torch.bfloat16)), f"tensor {Q_A}_scale_inv scales {Q_A}, which is "
                                                                 "BF16, not F8_E4M3"),
    ("fp8", _set(Q_A, torch.ones(12, 32).to(torch.float8_e5m2)), f"tensor {Q_A} is F8_E5M2 of shape (12, 32): "
                                                                 "quantization_config reads F8_E4M3 matrices"),
    # an FP8 value that is NaN (E4M3's 0x7F): named by its weight, as any tensor holding NaN is
    ("fp8", _nan_at(Q_A, torch.float8_e4m3fn), f"tensor {Q_A} holds NaN or infinite values"),
    # MXFP4: 32 values of 4 bits are 16 bytes a group; a group of 24 values does not fill the row of 32
    ("mxfp4", lambda ts: ts.__setitem__(f"{GATE_UP}_blocks", ts[f"{GATE_UP}_blocks"][..., :12].contiguous()),
     f"tensor {GATE_UP}_blocks is U8 of shape (4, 64, 1, 12): MXFP4 blocks are uint8"),
    ("mxfp4", lambda ts: ts.__setitem__(f"{GATE_UP}_scales", ts[f"{GATE_UP}_scales"][:, :32].contiguous()),
     f"tensor {GATE_UP}_scales has shape (4, 32, 1), {GATE_UP}_blocks (one E8M0 exponent per group) implies "
     "(4, 64, 1)"),
    ("mxfp4", _drop(f"{GATE_UP}_scales"), f"tensor {GATE_UP}_blocks has no {GATE_UP}_scales beside it"),
    ("mxfp4", _drop(f"{GATE_UP}_blocks"), f"tensor {GATE_UP}_scales scales {GATE_UP}_blocks, which the files"),
    ("mxfp4", lambda ts: ts[f"{GATE_UP}_scales"].view(-1).__setitem__(0, 255), f"tensor {GATE_UP}_scales holds "
                                                                              "255, E8M0's NaN"),
    # NVFP4: a block of 16 values does not divide 20 columns (10 bytes); scales of another grid, NaN or infinite
    ("nvfp4", _set(O_PROJ, torch.zeros(32, 10, dtype=torch.uint8)), f"tensor {O_PROJ} has shape (32, 10): NVFP4 "
                                                                     "packs a matrix's rows two values a byte"),
    ("nvfp4", _set(f"{O_PROJ}_scale", torch.ones(32, 2).to(torch.float8_e4m3fn)),
     f"tensor {O_PROJ}_scale has shape (32, 2), {O_PROJ} (32 x 16 values, one scale per 16) implies (32, 1)"),
    ("nvfp4", _nan_at(f"{O_PROJ}_scale", torch.float8_e4m3fn), f"tensor {O_PROJ}_scale holds NaN or infinite"),
    ("nvfp4", _inf_at(f"{O_PROJ}_scale_2"), f"tensor {O_PROJ}_scale_2 holds NaN or infinite scales"),
    ("nvfp4", _set(f"{O_PROJ}_scale_2", torch.ones(2)), f"tensor {O_PROJ}_scale_2 has shape (2,): one scale per"),
    ("nvfp4", _drop(f"{O_PROJ}_scale_2"), f"tensor {O_PROJ} has no {O_PROJ}_scale_2 beside it"),
])
def test_a_quantized_tensor_that_does_not_add_up_is_one_line_naming_it(quantized, tmp_path, fmt, edit, needle):
    path = edited(quantized, tmp_path, fmt, edit)
    line = refused(path, needle)
    assert line.startswith(str(path))


@pytest.mark.parametrize("fmt, config, needle", [
    ("fp8", {"weight_block_size": [0, 128]}, "quantization_config.weight_block_size=[0, 128]: must be [rows, columns]"),
    ("fp8", {"weight_block_size": [128]}, "quantization_config.weight_block_size=[128]: must be"),
    ("fp8", {"weight_block_size": "128x128"}, "quantization_config.weight_block_size='128x128': must be"),
    ("fp8", {"weight_block_size": None}, "quantization_config.weight_block_size=None: must be"),
    ("fp8", {"weight_block_size": [128, True]}, "quantization_config.weight_block_size=[128, True]: must be"),
    # the scales were written for blocks of 8 x 16: read as 16 x 16 blocks their grid is another's
    ("fp8", {"weight_block_size": [16, 16]}, "in quantization_config.weight_block_size=[16, 16] blocks implies"),
    ("fp8", {"fmt": "e5m2"}, "quantization_config.fmt='e5m2': not read"),
    ("fp8", {"quant_method": "gptq"}, "quantization_config.quant_method='gptq': not a quantized checkpoint format "
                                      "kvbench reads (accepted: fp8, mxfp4, modelopt"),
    ("nvfp4", {"quant_algo": "W4A8_AWQ"}, "quantization_config.quant_algo='W4A8_AWQ': not read"),
    ("nvfp4", {"group_size": 32}, "quantization_config.group_size=32: NVFP4 scales blocks of 16 values"),
    ("mxfp4", {"quant_method": None}, "quantization_config.quant_method=None: not a quantized checkpoint format"),
])
def test_a_quantization_config_kvbench_does_not_read_is_one_line_naming_its_key(quantized, tmp_path, fmt, config,
                                                                               needle):
    path = edited(quantized, tmp_path, fmt, **config)
    error = CheckpointError if "blocks implies" in needle else ConfigError
    line = refused(path, needle, error)
    assert str(path / "config.json") in line or str(path) in line
    if error is ConfigError:
        with pytest.raises(ConfigError) as info:
            ModelConfig(path=str(path))
        [line] = str(info.value).splitlines()
        assert line.startswith(f"model.path={str(path)!r}: ") and needle in line


def test_a_bad_scale_in_a_job_records_invalid_naming_the_tensor(quantized, tmp_path):
    """task=eval and a bench of model=hf_dir: status invalid with the line (the CLI's exit 2), not a traceback."""
    path = edited(quantized, tmp_path, "fp8", _nan_at(f"{Q_A}_scale_inv"))
    for overrides in (["model=hf_dir", f"model.path={path}"],
                      ["task=eval", f"train.checkpoint={path}", "train.eval_batches=1", "train.batch_size=1",
                       "train.seq_len=8"]):
        result = run_job(compose(*FAST, *overrides), tmp_path / overrides[0].replace("=", "_"))
        assert result.status == "invalid", (overrides, result.status, result.error)
        assert f"tensor {Q_A}_scale_inv holds NaN or infinite scales" in result.error
        assert len(result.error.splitlines()) == 1


@pytest.mark.parametrize("kind, method", [("fp8_float", "fp8"), ("mxfp4_float", "mxfp4"), ("nvfp4_float", "modelopt")])
def test_a_quantization_config_over_float_files_is_one_line(quantized, tmp_path, kind, method):
    """The float copy with the quantized one's config.json: the record would say a format the files do not hold."""
    path = shutil.copytree(quantized / kind, tmp_path / kind)
    shutil.copy(quantized / kind.replace("_float", "") / "config.json", path / "config.json")
    refused(path, f"quantization_config.quant_method={method!r}, but no tensor of the files is stored so")


def test_a_stray_scale_in_a_checkpoint_without_quantization_config_is_named(quantized, tmp_path):
    """A float copy holding a scale tensor (quantization_config dropped, scales kept): the scale is an unexpected
    tensor, by its file's name."""
    path = shutil.copytree(quantized / "fp8", tmp_path / "fp8")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    refused(path, "tensor model.layers.0.mlp.down_proj.weight_scale_inv: the scales of a quantized weight, but "
                  "config.json has no quantization_config")
