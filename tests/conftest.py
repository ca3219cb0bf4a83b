import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvbench.config import AttentionConfig, ModelConfig, register_configs
from kvbench.model import Decoder

# Tests compose configs with Hydra's compose API: the schema must be in the ConfigStore.
register_configs()


def tiny_model_config(**overrides) -> ModelConfig:
    """A decoder small enough for exact CPU tests in milliseconds."""
    fields = dict(name="test", num_layers=2, d_model=64, num_heads=8, preset_kv_heads=8, ffn_dim=96,
                  vocab_size=97, max_seq_len=64)
    fields.update(overrides)
    return ModelConfig(**fields)


def make_decoder(num_kv_heads: int = 8, seed: int = 0, dtype=torch.float32, **overrides) -> Decoder:
    torch.manual_seed(seed)
    cfg = tiny_model_config(**overrides)
    return Decoder(cfg, AttentionConfig.for_heads(cfg.num_heads, num_kv_heads)).to(dtype).eval()


# A small text corpus for the quality tests: Python-like bytes, a few KB.
TEXT = (b"def add(a, b):\n    return a + b\n\n" b"class Point:\n    x: int = 0\n    y: int = 0\n\n") * 40


@pytest.fixture
def corpus(tmp_path):
    """A directory of two text files (read in sorted order) and a binary file (skipped)."""
    (tmp_path / "b.txt").write_bytes(TEXT[: len(TEXT) // 2])
    (tmp_path / "a.txt").write_bytes(TEXT[len(TEXT) // 2:])
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01binary")
    return tmp_path


def byte_decoder(num_kv_heads=4, seed=0) -> Decoder:
    """A 1-layer byte-level decoder with 4 query heads (MHA 4, GQA 2, MQA 1)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(num_layers=1, d_model=32, num_heads=4, preset_kv_heads=4, ffn_dim=64,
                      vocab_size=256, max_seq_len=64)
    return Decoder(cfg, AttentionConfig.for_heads(4, num_kv_heads))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip where torch sees no GPU (CI, this machine); the GPU check runs them."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (runs in scripts/gpu_check.sh)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


VOCAB = 97


def llama_dir(tmp_path, num_kv_heads, tie=False, **overrides):
    """A tiny random LlamaForCausalLM saved with save_pretrained; returns (dir, hf model)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=num_kv_heads, intermediate_size=48,
                      vocab_size=overrides.pop("vocab_size", VOCAB),
                      max_position_embeddings=64, rope_theta=500.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=tie, **overrides)
    cfg._attn_implementation = "eager"
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms start at 1: make them matter so a misplaced norm weight shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path)
    return tmp_path, hf
