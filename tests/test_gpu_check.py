"""The GPU check's dry run (scripts/gpu_check.sh --dry-run): the same script, end to end, on the CPU
with the tiny model. What a GPU run would bring back must fit the copy-back rules: at most 8 plain
files directly in $OUT, simple names."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # the GPU check script, dry run: a shell and its interpreters

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_passes_and_writes_what_a_gpu_run_brings_back(tmp_path):
    out = tmp_path / "out"
    # The graph sweep runs eager here: this test is about the script (steps, verdicts, files); the
    # compiled step itself is tested in tests/workloads and tests/benchmarks, and compiling it on a
    # loaded 2-core machine took 66 s per job, which ran the step out of its time budget.
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out), GPU_CHECK_DEVICE="cpu",
               GPU_CHECK_GRAPH_MODE=os.environ.get("GPU_CHECK_GRAPH_MODE", "false"))
    # A generous budget: the verdicts, not the speed of a shared machine, are under test.
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--work", str(tmp_path / "work"),
                           "--budget-s", "600"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check: PASS" in proc.stdout

    files = sorted(p for p in out.rglob("*"))
    assert 1 <= len(files) <= 8 and all(p.is_file() and p.parent == out for p in files), files
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", p.name) for p in files)
    assert {p.name for p in files} >= {"gpu_check.log", "records.jsonl", "summary.md", "summary.csv",
                                       "decode_vs_context.png", "tokens_vs_batch.png"}

    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    by_step = {}
    for rec in records:
        by_step.setdefault(rec["check_step"], []).append(rec)
    assert [r["status"] for r in by_step["eager sweep"]] == ["ok"] * 8
    assert [r["status"] for r in by_step["graph sweep"]] == ["ok"] * 2
    oom = {r["config"]["workload"]["batch_size"]: r["status"] for r in by_step["oom goes on"]}
    # refused from its footprint before any allocation (kvbench.footprint), and the sweep went on
    assert oom == {10_000_000: "invalid", 1: "ok"}
    assert [r["status"] for r in by_step["cuda:free"]] == ["invalid", "invalid"]
    serving = by_step["serving sweep"]
    assert [r["status"] for r in serving] == ["ok"] * 2
    assert all(r["metrics"]["requests_finished"] == 8 and r["metrics"]["block_waste_within_bound"] for r in serving)
    eager = by_step["eager sweep"][0]["metrics"]
    assert eager["kv_cache_bytes_torch"] is None and "CUDA only" in eager["kv_cache_bytes_alloc_reason"]

    summary = (out / "summary.md").read_text()
    assert "| eager sweep | pass |" in summary and "| attention | KV heads | prompt | batch |" in summary
    assert summary.count("| mha | 8 |") == 4 and summary.count("| mqa | 1 |") == 4
    assert summary.count("| mla | 1 |") == 1  # graph mode only (the absorbed decode, fixed-shape)
    # the layouts: one task=compare record of MHA, GQA, MLA, the 5:1 hybrid, the Gated DeltaNet
    # hybrid, DSA and KV sharing, each cache the formula; then the new layouts exact on the device
    (layouts,) = by_step["layouts compare"]
    assert layouts["status"] == "ok"
    assert [r["variant"] for r in layouts["tables"]["compare"]] == [
        "mha_kv8", "gqa_kv2", "mla_r32", "mha_kv8_w16_5to1", "mha_kv8_gdn_2to1", "mla_r32_topk16", "mha_kv8_kvshare2"]
    assert "| layouts compare | pass |" in summary and "| mha_kv8_w16_5to1 | mha kv=8 w=16 5:1 |" in summary
    assert "| mha_kv8_gdn_2to1 | mha kv=8 gdn 2:1 |" in summary
    assert "| layouts exact | pass |" in summary and "on cpu: 6 passed" in summary
