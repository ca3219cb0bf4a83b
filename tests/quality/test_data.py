"""The byte corpus: file order, the train/validation split, the byte cap, seeded batches."""

import pytest
import torch

from kvbench.config import ConfigError, DataConfig
from kvbench.quality.data import batches, byte_data, corpus_files


def test_byte_data_order_split_and_cap(corpus):
    data = byte_data(DataConfig(path=str(corpus), val_fraction=0.25, max_bytes=None))
    stream = (corpus / "a.txt").read_bytes() + (corpus / "b.txt").read_bytes()  # sorted; binary skipped
    assert bytes(data.train.tolist()) + bytes(data.val.tolist()) == stream
    assert len(data.val) == len(stream) - int(len(stream) * 0.75)
    capped = byte_data(DataConfig(path=str(corpus), max_bytes=100))
    assert len(capped.train) + len(capped.val) == 100
    with pytest.raises(ConfigError, match="data.path"):
        byte_data(DataConfig(path=str(corpus / "nope")))


def test_default_corpus_is_sorted_stdlib_sources():
    files = corpus_files(None)
    assert len(files) > 100 and all(f.suffix == ".py" for f in files[:50])
    assert not any("site-packages" in f.parts for f in files)
    data = byte_data(DataConfig(max_bytes=50_000))
    assert len(data.train) + len(data.val) == 50_000


def test_batches_are_seeded_next_token_pairs():
    tokens = torch.arange(100)
    x, y = next(batches(tokens, 4, 8, seed=3))
    assert x.shape == y.shape == (4, 8) and torch.equal(y, x + 1)
    assert torch.equal(next(batches(tokens, 4, 8, seed=3))[0], x)
