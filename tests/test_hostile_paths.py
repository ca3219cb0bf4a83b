"""A path that is not what its key reads (a directory for a file, a file for a directory, nothing,
a link whose target is gone, a FIFO): one line naming the key, the path as written and what is
there. Each said "no such file" (or "cannot read PATH/config.json") whatever was there."""

import os

import pytest
from conftest import compose

from kvbench.checkpoint import CheckpointError, load_checkpoint
from kvbench.config.model import ModelConfig
from kvbench.core.errors import ConfigError
from kvbench.jobs.runner import run_job
from kvbench.quality.data import corpus_files


@pytest.fixture
def places(tmp_path):
    """name -> (path, what a reader expecting a file says of it)."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "a-file").write_text("{}")
    (tmp_path / "gone").symlink_to(tmp_path / "deleted")
    os.mkfifo(tmp_path / "fifo")
    return tmp_path


def single_line(exc_info) -> str:
    [line] = str(exc_info.value).splitlines()
    return line


@pytest.mark.parametrize("name, why", [
    ("a-file", "a file, not a directory"),
    ("fifo", "a FIFO, not a directory"),
    ("missing", "no such file or directory"),
    ("a-file/sub", "no such file or directory (a parent of it is a file)"),
])
def test_model_path_that_is_no_directory_says_what_it_is(places, name, why):
    path = str(places / name)
    with pytest.raises(ConfigError) as info:
        ModelConfig(path=path)
    assert single_line(info) == f"model.path={path!r}: {why} (a checkpoint directory with config.json)"


def test_model_path_link_to_nothing_names_the_target(places):
    path = str(places / "gone")
    with pytest.raises(ConfigError) as info:
        ModelConfig(path=path)
    assert single_line(info).startswith(f"model.path={path!r}: a link to {places / 'deleted'}, which does not exist")


@pytest.mark.parametrize("name, why", [
    ("missing.pt", "no such file or directory"),
    ("fifo", "a FIFO, not a regular file"),
    ("gone", None),
])
def test_a_kvbench_checkpoint_path_says_what_is_there(places, name, why):
    why = why or f"a link to {places / 'deleted'}, which does not exist"
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(places / name)
    assert single_line(info) == f"checkpoint {places / name}: {why}"


def test_data_path_link_to_nothing_names_the_target(places):
    with pytest.raises(ConfigError) as info:
        corpus_files(str(places / "gone"))
    path = str(places / "gone")
    assert single_line(info) == f"data.path={path!r}: a link to {places / 'deleted'}, which does not exist"


def test_a_job_given_a_file_as_its_model_directory_is_invalid_naming_the_key(places):
    result = run_job(compose("model=hf_dir", f"model.path={places / 'a-file'}", "wandb=disabled",
                             "runtime.isolate=false"), places / "run")
    assert result.status == "invalid"
    assert result.error == f"model.path={str(places / 'a-file')!r}: a file, not a directory (a checkpoint directory " \
                           "with config.json)"


@pytest.mark.parametrize("name, why", [("missing.pt", "no such file or directory"),
                                       ("fifo", "a FIFO, not a regular file")])
def test_an_eval_checkpoint_path_that_is_no_checkpoint_is_invalid_saying_what_is_there(places, name, why):
    result = run_job(compose("task=eval", f"train.checkpoint={places / name}", "model=tiny", "wandb=disabled",
                             "runtime.isolate=false", "train.eval_batches=1", "train.batch_size=1", "train.seq_len=8"),
                     places / "run")
    assert result.status == "invalid", (result.status, result.error)
    assert result.error == f"checkpoint {places / name}: {why}"
