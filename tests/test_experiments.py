"""The experiment scripts write where ``--out`` says and leave the committed results in
experiments/results/ alone unless told to write there."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "experiments" / "results"


def digests() -> dict:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(COMMITTED.rglob("*")) if p.is_file()}


def test_multiturn_ttft_writes_to_out_and_not_to_the_committed_results(tmp_path):
    before = digests()
    out = tmp_path / "report" / "ttft"
    proc = subprocess.run([sys.executable, "experiments/multiturn_ttft.py", "--model", "tiny", "--warmup", "0",
                           "--repeats", "1", "--batch-size", "1", "--threads", "1", "--runs", str(tmp_path / "runs"),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "WANDB_MODE": "disabled"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = out.with_suffix(".md").read_text()
    assert text.startswith("# Multi-turn chat: TTFT per turn") and "model=tiny" in text
    assert f"wrote {out.with_suffix('.md')}" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["shared_false", "shared_true"]
    assert digests() == before


def test_overhead_experiments_write_to_out_and_not_to_the_committed_results(tmp_path):
    """The NVML-sampler and CPU-threads experiments on the tiny model: each writes its table to
    --out (the sampler's run asserts inside that the sampler thread really sampled)."""
    before = digests()
    for script, head in (("nvml_overhead", "# NVML sampler overhead"), ("cpu_threads", "# CPU threads")):
        out = tmp_path / script
        proc = subprocess.run([sys.executable, f"experiments/{script}.py", "--model", "tiny", "--prompt-len", "8",
                               "--gen-len", "4", "--rounds", "2", "--out", str(out)], cwd=ROOT, capture_output=True,
                              text=True, timeout=600, env={**os.environ, "WANDB_MODE": "disabled"})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert out.with_suffix(".md").read_text().startswith(head)
    assert digests() == before


def test_tpot_pairing_writes_both_designs_to_out(tmp_path):
    """The pairing experiment on the tiny model: a row per variant and design, a ratio per round."""
    before = digests()
    out = tmp_path / "pairing"
    proc = subprocess.run([sys.executable, "experiments/tpot_pairing.py", "--model", "tiny", "--variants", "gqa,mqa",
                           "--batch", "2", "--context", "8", "--rounds", "2", "--pairs", "3", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "WANDB_MODE": "disabled"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line.split(" | ") for line in out.with_suffix(".md").read_text().splitlines() if line.startswith("| gqa")
            or line.startswith("| mqa")]
    assert [(r[0], r[1]) for r in rows] == [("| gqa", "before/after"), ("| gqa", "paired"),
                                             ("| mqa", "before/after"), ("| mqa", "paired")]
    for r in rows:
        ratios = [float(x) for x in r[2].split()]
        assert len(ratios) == 2 and all(x > 0 for x in ratios)
        assert float(r[5].rstrip(" |")) == pytest.approx(max(ratios) / min(ratios), abs=0.02)
    assert digests() == before
