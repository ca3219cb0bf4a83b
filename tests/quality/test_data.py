"""The byte corpus: file order, the train/validation split, the byte cap, seeded batches."""

import os
import socket
import subprocess
import sys

import pytest
import torch
from conftest import TEXT, call_with_timeout

from kvbench.config.train import DataConfig
from kvbench.core.errors import ConfigError
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


def read_in_thread(cfg):
    return call_with_timeout(lambda: byte_data(cfg))


def test_only_regular_files_are_read(corpus):
    """A FIFO in the corpus directory once blocked the job forever; sockets, devices and broken
    links are not text either."""
    os.mkfifo(corpus / "pipe")
    (corpus / "zero").symlink_to("/dev/zero")
    (corpus / "dangling").symlink_to(corpus / "gone")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(corpus / "sock"))
        data = read_in_thread(DataConfig(path=str(corpus), val_fraction=0.25, max_bytes=None))
    stream = (corpus / "a.txt").read_bytes() + (corpus / "b.txt").read_bytes()
    assert bytes(data.train.tolist()) + bytes(data.val.tolist()) == stream
    for special in ("pipe", "zero"):
        with pytest.raises(ConfigError, match=f"data.path='.*{special}': not a regular file or a directory"):
            read_in_thread(DataConfig(path=str(corpus / special)))


@pytest.mark.e2e
def test_the_cap_bounds_what_is_read_not_only_what_is_kept(tmp_path):
    """A 16 GiB (sparse) file under data.max_bytes=1000: exactly 1000 bytes are read. Run with
    the address space limited to 1 GiB more than the process uses, so reading the file whole
    (as kvbench once did, before cutting it to the cap) is a MemoryError, not a machine out of
    memory."""
    big = tmp_path / "big.txt"
    with big.open("wb") as f:
        f.write(TEXT)
        f.truncate(16 * 2**30)
    code = f"""
import resource
from kvbench.config.train import DataConfig
from kvbench.quality.data import byte_data
with open("/proc/self/statm") as f:
    used = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + 2**30, resource.RLIM_INFINITY))
data = byte_data(DataConfig(path={str(tmp_path)!r}, max_bytes=1000))
print(len(data.train) + len(data.val), bytes(data.train[:20].tolist()).decode())
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split(maxsplit=1) == ["1000", TEXT[:20].decode() + "\n"]
