"""The one-node SLURM cluster of the ``slurm`` tests (tests/slurm), as a pytest plugin that
tests/conftest.py loads: the tests run where CI=true, KVBENCH_SLURM=1 or ``-m slurm`` asks for
them, and are left out elsewhere with one line saying how to run them. The cluster is started
once for the whole run by scripts/slurm_local.sh (installed by it too where apt-get exists) and
stopped afterwards, unless it was already up."""

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "slurm_local.sh"
HOW = "KVBENCH_SLURM=1 python -m pytest -m slurm"  # docs/slurm.md gives the same command


def slurm_wanted(config) -> bool:
    return (os.environ.get("CI", "").lower() == "true" or os.environ.get("KVBENCH_SLURM") == "1"
            or "slurm" in (config.getoption("markexpr", "") or ""))


def pytest_report_header(config):
    if not slurm_wanted(config):
        return f"slurm: the tests marked slurm are left out; run them with: {HOW}"
    return None


def pytest_collection_modifyitems(config, items):
    if slurm_wanted(config):
        return
    left_out = [item for item in items if item.get_closest_marker("slurm") is not None]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item.get_closest_marker("slurm") is None]


def _run(action: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), action], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running one-node SLURM (its partition's name); a cluster that cannot start fails the
    tests with the script's reason."""
    was_up = subprocess.run("sinfo -h -o %T | grep -qx idle", shell=True).returncode == 0
    if not was_up:
        for action in ("install", "start"):
            proc = _run(action)
            if proc.returncode != 0:
                pytest.fail(f"SLURM could not be started ({SCRIPT.name} {action}, exit {proc.returncode}):\n"
                            f"{proc.stdout}{proc.stderr}", pytrace=False)
    yield "debug"
    if not was_up:
        _run("stop")
