"""The GPU check's dry run (scripts/gpu_check.sh --dry-run): the same script on the CPU with the
tiny model, one group of steps per test through its own ``--steps`` (the report always runs), each
group's asserts beside it, so that no test runs all ten interpreter starts. What a GPU run would
bring back must fit the copy-back rules: at most 8 plain files directly in $OUT, simple names; only
the report writes there, so any run that has the main sweeps (eager and graph) writes the files a
full run does."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # the GPU check script, dry run: a shell and its interpreters

ROOT = Path(__file__).resolve().parents[1]
# The script's steps in four groups of about 10 s of CPU each (the whole run is ~50 s): one test each.
GROUPS = {"main": "eager,graph", "no cuda": "preflight,cuda,free", "oom and serving": "oom,serving",
          "layouts": "layouts,exact"}
ALL_FILES = {"gpu_check.log", "records.jsonl", "summary.md", "summary.csv", "decode_vs_context.png",
             "tokens_vs_batch.png"}


def dry_run(tmp_path, steps):
    """Run the script's dry run on ``steps``; its records by step and its summary.md. Every chosen
    step and the report must pass, and what lands in $OUT must fit the copy-back rules."""
    out = tmp_path / "out"
    # The graph sweep runs eager here: this test is about the script (steps, verdicts, files); the
    # compiled step itself is tested in tests/workloads and tests/benchmarks, and compiling it on a
    # loaded 2-core machine took 66 s per job, which ran the step out of its time budget.
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out), GPU_CHECK_DEVICE="cpu",
               GPU_CHECK_GRAPH_MODE=os.environ.get("GPU_CHECK_GRAPH_MODE", "false"))
    # A generous budget: the verdicts, not the speed of a shared machine, are under test.
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--work", str(tmp_path / "work"),
                           "--budget-s", "600", "--steps", steps], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check: PASS" in proc.stdout

    files = sorted(p for p in out.rglob("*"))
    assert 1 <= len(files) <= 8 and all(p.is_file() and p.parent == out for p in files), files
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", p.name) for p in files)
    assert {p.name for p in files} <= ALL_FILES

    by_step = {}
    for line in (out / "records.jsonl").read_text().splitlines():
        rec = json.loads(line)
        by_step.setdefault(rec["check_step"], []).append(rec)
    summary = (out / "summary.md").read_text()
    names = [name for name, _ in (scripts_steps()[key] for key in steps.split(","))]
    assert [line.split(" | ")[0].lstrip("| ") for line in summary.splitlines()
            if line.startswith("| ") and " | pass | " in line] == [*names, "report"]
    return by_step, summary, {p.name for p in files}


def scripts_steps():
    """scripts/gpu_check.py's STEPS (--steps key -> (name in the summary, method)), read from its source."""
    import ast

    tree = ast.parse((ROOT / "scripts" / "gpu_check.py").read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "STEPS"]
    return ast.literal_eval(node.value)


def test_the_main_sweeps_write_the_table_and_every_file_a_gpu_run_brings_back(tmp_path):
    by_step, summary, files = dry_run(tmp_path, GROUPS["main"])
    assert files == ALL_FILES  # the report's plots and tables come from the main sweeps
    assert set(by_step) == {"eager sweep", "graph sweep"}
    assert [r["status"] for r in by_step["eager sweep"]] == ["ok"] * 8
    assert [r["status"] for r in by_step["graph sweep"]] == ["ok"] * 2
    eager = by_step["eager sweep"][0]["metrics"]
    assert eager["kv_cache_bytes_torch"] is None and "CUDA only" in eager["kv_cache_bytes_alloc_reason"]
    assert "| eager sweep | pass |" in summary and "| attention | KV heads | prompt | batch |" in summary
    assert summary.count("| mha | 8 |") == 4 and summary.count("| mqa | 1 |") == 4
    assert summary.count("| mla | 1 |") == 1  # graph mode only (the absorbed decode, fixed-shape)


def test_preflight_the_cuda_tests_and_cuda_free_are_judged_for_a_machine_without_cuda(tmp_path):
    by_step, summary, _ = dry_run(tmp_path, GROUPS["no cuda"])
    assert [r["status"] for r in by_step["cuda:free"]] == ["invalid", "invalid"]
    assert all("CUDA is not available" in r["error"] for r in by_step["cuda:free"])
    assert "| preflight | pass |" in summary and "| cuda tests | pass |" in summary


def test_an_oom_is_refused_as_a_record_and_the_serving_sweep_finishes_every_request(tmp_path):
    by_step, summary, _ = dry_run(tmp_path, GROUPS["oom and serving"])
    oom = {r["config"]["workload"]["batch_size"]: r["status"] for r in by_step["oom goes on"]}
    # refused from its footprint before any allocation (kvbench.footprint), and the sweep went on
    assert oom == {10_000_000: "invalid", 1: "ok"}
    serving = by_step["serving sweep"]
    assert [r["status"] for r in serving] == ["ok"] * 2
    assert all(r["metrics"]["requests_finished"] == 8 and r["metrics"]["block_waste_within_bound"] for r in serving)
    assert "| serving sweep | pass |" in summary


def test_the_layouts_compare_each_cache_by_formula_and_are_exact_on_the_device(tmp_path):
    # the layouts: one task=compare record of MHA, GQA, MLA, the 5:1 hybrid, the Gated DeltaNet
    # hybrid, DSA and KV sharing, each cache the formula; then the new layouts exact on the device
    by_step, summary, _ = dry_run(tmp_path, GROUPS["layouts"])
    (layouts,) = by_step["layouts compare"]
    assert layouts["status"] == "ok"
    assert [r["variant"] for r in layouts["tables"]["compare"]] == [
        "mha_kv8", "gqa_kv2", "mla_r32", "mha_kv8_w16_5to1", "mha_kv8_gdn_2to1", "mla_r32_topk16", "mha_kv8_kvshare2"]
    assert "| layouts compare | pass |" in summary and "| mha_kv8_w16_5to1 | mha kv=8 w=16 5:1 |" in summary
    assert "| mha_kv8_gdn_2to1 | mha kv=8 gdn 2:1 |" in summary
    assert "| layouts exact | pass |" in summary and "on cpu: 6 passed" in summary


def test_the_groups_above_run_every_step_of_the_script():
    """The four groups together are the whole check: a step added to the script needs a test here."""
    chosen = [key for group in GROUPS.values() for key in group.split(",")]
    assert sorted(chosen) == sorted(scripts_steps()) and len(set(chosen)) == len(chosen)
