"""The GPU check's layouts steps without a GPU (scripts/gpu_check.py imported, not run): the plans
name the new layouts, the exactness step runs tests/test_layouts_device.py on the plan's device and
judges pytest's summary, and the bytes check passes a real task=compare record of the dry run's
variants and names what is wrong with a tampered one. tests/test_gpu_check.py runs the whole
script (e2e)."""

import importlib.util
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
from conftest import compose

from kvbench.jobs.runner import run_job

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_check"]


def test_both_plans_compare_the_new_layouts_and_run_the_exact_step_after_them(gpu_check):
    for plan in gpu_check.PLANS.values():
        (variants,) = [o for o in plan["layouts"] if o.startswith("compare.variants=")]
        assert {"mha:d3", "mha:s2"} <= set(variants.split("=", 1)[1].strip("[]").split(","))
        assert gpu_check.variant_count(plan["layouts"]) == 7 and gpu_check.layer_count(plan["layouts"]) == 6
    assert "mla:k1024" in gpu_check.PLANS["gpu"]["layouts"][4] and "mla:k16" in gpu_check.PLANS["cpu"]["layouts"][4]
    keys = list(gpu_check.STEPS)
    assert keys.index("exact") == keys.index("layouts") + 1 and gpu_check.STEPS["exact"] == ("layouts exact",
                                                                                             "layouts_exact")


def test_an_unknown_step_is_refused_in_one_line(gpu_check, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--steps", "layouts,exactt"])
    assert exit_.value.code == 2 and "--steps='layouts,exactt': unknown ['exactt']" in capsys.readouterr().err


def _check(gpu_check, tmp_path, dry_run):
    return gpu_check.Check(Namespace(dry_run=dry_run, out=str(tmp_path / "out"), work=str(tmp_path / "work"),
                                     budget_s=60, steps="exact"))


@pytest.mark.parametrize("dry_run,device", [(False, "cuda"), (True, "cpu")])
def test_the_exact_step_runs_the_device_tests_on_the_plans_device(gpu_check, tmp_path, dry_run, device):
    check = _check(gpu_check, tmp_path, dry_run)
    cmd, env = check.layouts_exact_command()
    assert cmd[1:4] == ["-m", "pytest", str(ROOT / "tests" / "test_layouts_device.py")]
    assert Path(cmd[3]).is_file() and env["KVBENCH_LAYOUTS_DEVICE"] == device


@pytest.mark.parametrize("output,code,verdict", [
    ("......\n6 passed in 3.21s\n", 0, "pass"),
    ("....s.\n5 passed, 1 skipped in 3.0s\n", 0, "FAIL"),  # a skip checked nothing
    ("..F...\n1 failed, 5 passed in 3.0s\n", 1, "FAIL"),
    ("ERROR: file or directory not found\n", 4, "FAIL"),
])
def test_the_exact_steps_verdict_is_pytests_summary(gpu_check, tmp_path, output, code, verdict):
    check = _check(gpu_check, tmp_path, True)
    check.run = lambda cmd, timeout, env=None: subprocess.CompletedProcess(cmd, code, output, "")
    step = gpu_check.Step("layouts exact")
    check.layouts_exact(step)
    assert step.verdict == verdict and step.detail.startswith("on cpu: ")


@pytest.fixture(scope="module")
def dry_run_record(gpu_check, tmp_path_factory):
    """The dry run's layouts job, in this process: the cpu plan's model and overrides."""
    plan = gpu_check.PLANS["cpu"]
    model = [o for o in plan["model"] if not o.startswith(("model.num_layers=", "runtime.isolate", "runtime.peak"))]
    overrides = [o for o in plan["layouts"] if not o.startswith("runtime.repeats")] + ["runtime.repeats=2"]
    rec = run_job(compose(*model, *overrides), tmp_path_factory.mktemp("layouts"))
    assert rec.status == "ok", rec.error
    return rec.tables["compare"]


def test_the_bytes_of_every_new_layout_pass_and_a_wrong_one_is_named(gpu_check, dry_run_record):
    rows = [dict(r) for r in dry_run_record]
    assert [r["layout"] for r in rows] == ["mha kv=8", "gqa kv=2", "mla r=32", "mha kv=8 w=16 5:1",
                                           "mha kv=8 gdn 2:1", "mla r=32 topk=16", "mha kv=8 kvshare=2"]
    assert gpu_check.layout_faults(rows, 7, 6) == []
    gdn, share = rows[4], rows[6]
    assert gdn["kv_state_bytes"] > 0 and gdn["kv_bytes_per_1k_ctx"] * 3 == rows[0]["kv_bytes_per_1k_ctx"]
    tampered = [*rows[:4], {**gdn, "kv_bytes_per_1k_ctx": rows[0]["kv_bytes_per_1k_ctx"]}, rows[5],
                {**share, "kv_cache_bytes": share["kv_cache_bytes"] + 1}]
    faults = gpu_check.layout_faults(tampered, 7, 6)
    assert len(faults) == 2 and faults[0].startswith("mha_kv8_kvshare2 allocated ")
    assert faults[1].startswith("mha_kv8_gdn_2to1: state ") and "(want a state and 1/3)" in faults[1]
    assert gpu_check.layout_faults(rows[:6], 7, 6) == ["6 variants of 7"]
