"""Llama 4 and Gemma 4 as Meta and Google publish them: multimodal checkpoints
(``Llama4ForConditionalGeneration``, ``Gemma4ForConditionalGeneration``) whose language model kvbench reads
from ``text_config`` and the tensors under the language model's prefix, leaving the vision tower's unread.
Each is a tiny random checkpoint built and saved by transformers (a vision tower of one layer beside the
text model of tests/test_llama4.py and tests/test_gemma4.py), exact against transformers' whole multimodal
model fed text: logits within 1e-5, perplexity within 1e-5 relative (task=eval's record too), 40 greedy
cached steps token-equal to ``generate``; a refusal names the key where the file holds it. Llama 4's
reference is the multimodal model's ``language_model`` (its Llama4ForCausalLM, the saved tensors): the
multimodal model's own forward fails on text alone in transformers 5.24 (``image_outputs`` of an output
that has none)."""

import json

import pytest
import torch
from hf_parity import check_task_eval
from safetensors import safe_open
from test_gemma4 import BASE, FORMS
from test_llama4 import LLAMA4
from test_mamba2_hybrids import assert_exact

from kvbench.checkpoint import load_llama_dir
from kvbench.config.model import ModelConfig
from kvbench.core.errors import ConfigError

pytestmark = pytest.mark.usefixtures("quiet_transformers")

# one-layer vision towers: their tensors are in the file, and none of them is read
LLAMA4_VISION = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                     vision_output_dim=16, image_size=28, patch_size=14, projector_input_dim=16,
                     projector_output_dim=32)
GEMMA4_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=8, position_embedding_size=64)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each family's multimodal checkpoint saved with save_pretrained, its norms off 1 (Gemma 4's layer
    scalars off their initial values too); {family: (dir, transformers model)}."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Llama4Config, Llama4ForConditionalGeneration

    out = {}
    for family, make in (
            ("llama4", lambda: Llama4ForConditionalGeneration(Llama4Config(text_config=LLAMA4,
                                                                           vision_config=LLAMA4_VISION))),
            # the E-model form: per-layer inputs, which the multimodal model computes on its own path
            ("gemma4", lambda: Gemma4ForConditionalGeneration(Gemma4Config(text_config={**BASE, **FORMS["e_model"]},
                                                                           vision_config=GEMMA4_VISION)))):
        torch.manual_seed(0)
        hf = make().eval()
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if "norm" in name:
                    p.normal_(1.0, 0.3)
            for i, layer in enumerate(getattr(hf.model, "language_model", hf).layers if family == "gemma4" else ()):
                layer.layer_scalar.fill_(0.8 + 0.1 * i)
        path = tmp_path_factory.mktemp(family)
        hf.save_pretrained(path)
        hf = hf.language_model if family == "llama4" else hf  # (the module docstring says why)
        hf.generation_config.eos_token_id = None  # every step whatever is drawn
        out[family] = path, hf
    return out


@pytest.mark.parametrize("family", ["llama4", "gemma4"])
@torch.no_grad()
def test_a_multimodal_checkpoints_language_model_is_transformers_in_logits_perplexity_and_40_greedy_steps(
        checkpoints, family, one_torch_thread):
    path, hf = checkpoints[family]
    saved = json.loads((path / "config.json").read_text())
    assert saved["architectures"] == [f"{family.title()}ForConditionalGeneration"] and "vision_config" in saved
    model, _ = load_llama_dir(path)
    with safe_open(path / "model.safetensors", "pt") as f:  # the vision tower's and projector's tensors are there
        unread = [name for name in f.keys() if "language_model." not in name and name != "lm_head.weight"]
    text = sum(p.numel() for name, p in hf.named_parameters() if family == "llama4" or "language_model" in name
               or name.startswith("lm_head"))
    tied = model.embed.weight.numel() if family == "gemma4" else 0  # Gemma 4's head is its embedding
    assert len(unread) > 10 and model.num_params() - tied == text  # the text model, whole
    got = assert_exact(model, hf, 40, spread=0.1)  # past Llama 4's chunks of 8 and Gemma 4's window of 8
    assert len(set(got[0].tolist())) > 5


def test_task_eval_of_a_multimodal_llama4_checkpoint_is_transformers_perplexity(checkpoints, tmp_path,
                                                                              one_torch_thread):
    """model.path's route (task=eval reads the checkpoint whole) over the byte corpus's slices of 40."""
    path, hf = checkpoints["llama4"]
    check_task_eval(path, hf, tmp_path)


@pytest.mark.parametrize("family, change, line", [
    ("llama4", {"num_key_value_heads": 3}, "text_config.num_key_value_heads=3: must divide "
     "text_config.num_attention_heads=4"),
    ("llama4", {"hidden_act": "gelu"}, "text_config.hidden_act='gelu': not supported"),
    ("gemma4", {"enable_moe_block": True, "num_experts": None, "use_double_wide_mlp": False},
     "text_config.num_experts=None: "
     "text_config.enable_moe_block=True needs it"),
    ("gemma4", {"rope_parameters": {"full_attention": {"rope_type": "yarn"}}},
     "text_config.rope_parameters.full_attention.rope_type='yarn': not supported"),
])
def test_a_multimodal_checkpoints_text_config_refusal_names_the_key_where_the_file_holds_it(
        checkpoints, tmp_path, family, change, line):
    path, _ = checkpoints[family]
    saved = json.loads((path / "config.json").read_text())
    saved["text_config"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ConfigError) as info:
        ModelConfig(path=str(tmp_path))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"model.path={str(tmp_path)!r}: ") and line in message, message


def _file(family):
    """A whole-file reader's config.json contents, as transformers' config class writes them."""
    import transformers
    from test_mamba2_hybrids import GRANITE, NEMOTRON_H

    make, arch = {"llama4": (lambda: transformers.Llama4TextConfig(**LLAMA4), "Llama4ForCausalLM"),
                  "nemotron_h": (lambda: transformers.NemotronHConfig(**NEMOTRON_H), "NemotronHForCausalLM"),
                  "granite": (lambda: transformers.GraniteMoeHybridConfig(**GRANITE), "GraniteMoeHybridForCausalLM")
                  }[family]
    return {**make().to_dict(), "architectures": [arch]}


@pytest.mark.parametrize("family, key, value, line", [
    ("llama4", "head_dim", 7, "head_dim=7: must be even"),
    ("llama4", "rms_norm_eps", -1.0, "rms_norm_eps=-1.0: must be > 0"),
    ("nemotron_h", "layer_norm_epsilon", -1.0, "layer_norm_epsilon=-1.0: must be > 0"),
    ("granite", "rms_norm_eps", 0.0, "rms_norm_eps=0.0: must be > 0"),
    ("multimodal gemma4", "rms_norm_eps", -1.0, "text_config.rms_norm_eps=-1.0: must be > 0"),
])
def test_a_whole_file_readers_model_check_refusal_names_the_files_key(checkpoints, family, key, value, line):
    """A value the decoder's own checks refuse (not the reader's), named as the user's config.json spells it
    (Llama 4's, Nemotron-H's and Granite's readers named kvbench's model.norm_eps), in one line."""
    if family.startswith("multimodal"):
        cfg = json.loads((checkpoints[family.split()[1]][0] / "config.json").read_text())
        cfg["text_config"][key] = value
    else:
        cfg = {**_file(family), key: value}
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf_config(cfg)
    message = str(info.value)
    assert "\n" not in message and "model." not in message and line in message, message


@pytest.mark.parametrize("text, line", [(None, "missing key 'text_config'"),
                                        ([1, 2], "text_config=[1, 2]: must be a JSON object")])
def test_a_multimodal_config_json_without_its_language_models_keys_is_refused_in_one_line(text, line):
    for arch in ("Llama4ForConditionalGeneration", "Gemma4ForConditionalGeneration"):
        cfg = {"architectures": [arch], "vision_config": {"hidden_size": 16}}
        if text is not None:
            cfg["text_config"] = text
        with pytest.raises(ConfigError) as info:
            ModelConfig.from_hf_config(cfg)
        assert "\n" not in str(info.value) and line in str(info.value), str(info.value)
