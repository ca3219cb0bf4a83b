"""The environment record against torch's own answers."""

import os

import torch

from kvbench.measure.env import collect_env


def test_collect_env_matches_torch():
    env = collect_env(torch.device("cpu"))
    assert env["torch"] == torch.__version__
    assert env["torch_num_threads"] == torch.get_num_threads()
    assert env["cpu_count"] == os.cpu_count() and env["device_type"] == "cpu"
    assert env["torch_cuda"] == torch.version.cuda
    assert env["git_commit"] is None or len(env["git_commit"]) == 40
