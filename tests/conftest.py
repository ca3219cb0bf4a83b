import pytest
import torch

from kvbench.config import AttentionConfig, ModelConfig
from kvbench.model import Decoder


def tiny_model_config(**overrides) -> ModelConfig:
    """A decoder small enough for exact CPU tests in milliseconds."""
    fields = dict(name="test", num_layers=2, d_model=64, num_heads=8, num_kv_heads=8, ffn_dim=96,
                  vocab_size=97, max_seq_len=64)
    fields.update(overrides)
    return ModelConfig(**fields)


def attention_for(num_heads: int, num_kv_heads: int) -> AttentionConfig:
    kind = "mha" if num_kv_heads == num_heads else "mqa" if num_kv_heads == 1 else "gqa"
    return AttentionConfig(type=kind, num_kv_heads=num_kv_heads)


def make_decoder(num_kv_heads: int = 8, seed: int = 0, dtype=torch.float32, **overrides) -> Decoder:
    torch.manual_seed(seed)
    cfg = tiny_model_config(**overrides)
    return Decoder(cfg, attention_for(cfg.num_heads, num_kv_heads)).to(dtype).eval()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
