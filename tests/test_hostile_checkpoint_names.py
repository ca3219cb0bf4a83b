"""Every refusal of a transformers checkpoint names the tensor as the file names it.

Small checkpoints of each family the loader reads (save_pretrained of tiny random configs: Llama,
Qwen2 with biases, Qwen3 with q/k norms, DeepSeek-V3 (latent attention, routed and shared experts),
Qwen3-MoE's per-expert tensors, GPT-OSS's stacked experts and sinks, Qwen3-Next's fused linear
attention), and each kind of tensor in them missing, of another shape, of an integer dtype or
holding a NaN: the one-line error names the file's tensor (``model.embed_tokens.weight``) and never
kvbench's own name for it (``embed.weight``, ``blocks.1.mlp_norm.weight``), which 29 of them did."""

import re
import shutil

import pytest
import torch
from conftest import deepseek_dir, hf_dir
from safetensors.torch import load_file, save_file
from test_moe import moe_dir
from test_qwen_hybrid import qwen_dir

from kvbench.checkpoint import CheckpointError, hf_to_decoder_name, load_llama_dir, read_llama_config
from kvbench.config.model import AttentionConfig
from kvbench.layouts.build import build_layouts

BUILDERS = {
    "llama": lambda p: hf_dir(p, 2),
    "qwen2": lambda p: hf_dir(p, 2, family="qwen2"),
    "qwen3": lambda p: hf_dir(p, 2, family="qwen3"),
    "deepseek_v3_moe": lambda p: deepseek_dir(p, first_k_dense_replace=1, moe_intermediate_size=16,
                                              n_routed_experts=4, n_group=2, topk_group=1, n_shared_experts=1),
    "qwen3_moe": lambda p: moe_dir(p, "qwen3_moe"),
    "gpt_oss": lambda p: moe_dir(p, "gpt_oss"),
    "qwen3_next": lambda p: qwen_dir(p, "qwen3_next_moe", num_hidden_layers=4),
}
FAULTS = ["missing", "shape", "dtype", "nan"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {family: build(tmp_path_factory.mktemp(family))[0] for family, build in BUILDERS.items()}


def kinds(names):
    """One tensor of each kind: the first name of each pattern with layer and expert numbers blanked."""
    seen = {}
    for name in sorted(names):
        seen.setdefault(re.sub(r"\.\d+\.", ".N.", name), name)
    return sorted(seen.values())


def cases():
    for family in BUILDERS:
        for fault in FAULTS:
            yield pytest.param(family, fault, id=f"{family}-{fault}")


def _break(tensors, name, fault):
    t = tensors[name]
    if fault == "missing":
        del tensors[name]
    elif fault == "shape":
        tensors[name] = torch.cat([t, t[:1]])  # one row (or element) more along the first axis
    elif fault == "dtype":
        tensors[name] = torch.zeros(t.shape, dtype=torch.int32)
    else:
        t = t.clone()
        t.view(-1)[-1] = torch.nan
        tensors[name] = t


@pytest.mark.parametrize("family, fault", list(cases()))
def test_every_checkpoint_error_names_the_files_tensor(checkpoints, tmp_path, family, fault):
    source = checkpoints[family]
    [weights] = sorted(source.glob("*.safetensors"))
    original = load_file(weights)
    cfg = read_llama_config(source)
    attention = AttentionConfig(type="mla") if cfg.preset_mla is not None else AttentionConfig.for_heads(
        cfg.num_heads, cfg.preset_kv_heads)
    layouts = build_layouts(cfg, attention.resolved(cfg))
    failures = []
    for name in kinds(original):
        if fault == "missing" and name == "lm_head.weight" and "tie" in name:
            continue
        path = tmp_path / re.sub(r"\W", "_", name)
        shutil.copytree(source, path)
        tensors = dict(original)
        _break(tensors, name, fault)
        save_file(tensors, path / weights.name, metadata={"format": "pt"})
        with pytest.raises(CheckpointError) as info:
            load_llama_dir(path)
        [line] = str(info.value).splitlines()
        ours = hf_to_decoder_name(name, layouts)
        if name not in line or "blocks." in line or (ours != name and re.search(rf"(?<![\w.]){re.escape(ours)}", line)):
            failures.append(f"{name}: {line}")
        shutil.rmtree(path)
    assert not failures, "\n".join(failures)
