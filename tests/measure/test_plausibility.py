"""Figures against the physics of the machine they were measured on: one test per bound, and the
four instances that were written as true (energy per token, NVML's zero KV bytes, an inherited
peak RSS, the roofline at batch 8)."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from test_memory import UUID, FakeNVML, install

from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.measure import memory, plausibility
from kvbench.measure.memory import MemoryMonitor, allocation_delta
from kvbench.measure.roofline import attainable_metrics, probe_step_gemms, roofline_metrics
from kvbench.model import Decoder
from kvbench.results import RunResult
from kvbench.workloads.decode import energy_per_token

MB = 2**20


def flagged(metrics, config=None, env=None, tables=None):
    record = {"metrics": metrics, "config": config or {}, "env": env or {}, "tables": tables or {}}
    return {item["metric"] for item in plausibility.check(record)}


# ---- one test per bound ----------------------------------------------------------------------

def test_bandwidth_above_the_probed_peak_is_flagged():
    assert flagged({"achieved_gb_per_s": 120.0, "peak_gb_per_s": 100.0}) == {"achieved_gb_per_s"}
    assert flagged({"achieved_gb_per_s": 103.0, "peak_gb_per_s": 100.0}) == set()  # within the probe's error


def test_a_step_faster_than_the_roofline_or_its_own_gemms_is_flagged():
    assert flagged({"decode_ms_p50": 0.5, "roofline_ms": 1.0}) == {"decode_ms_p50"}
    assert flagged({"decode_ms_p50": 0.5, "roofline_ms": 0.1, "gemm_ms_at_batch": 0.8}) == {"decode_ms_p50"}
    assert flagged({"decode_ms_p50": 2.0, "roofline_ms": 1.0, "gemm_ms_at_batch": 1.5}) == set()


def test_power_above_the_enforced_limit_is_flagged():
    # the committed H200 record: 3,197 mJ/token, 33 tokens per 59 ms trial = 1.8 kW on a 700 W board
    h200 = {"energy_mj_per_token": 3197.47, "e2e_ms": 59.02, "power_limit_w": 700.0}
    assert flagged(h200, config={"workload": {"batch_size": 1, "gen_len": 32}}) == {"energy_mj_per_token"}
    assert flagged({"energy_mj": 2_000_000, "energy_span_s": 1.0, "power_limit_w": 700.0}) == {"energy_mj"}
    assert flagged({"energy_mj": 300_000, "energy_span_s": 1.0, "power_limit_w": 700.0}) == set()


def test_an_allocation_that_shows_nothing_is_flagged():
    m = {"kv_cache_bytes_formula": 1 << 20, "kv_cache_bytes": 1 << 20, "kv_cache_bytes_nvml": 0}
    assert flagged(m) == {"kv_cache_bytes_nvml"}
    assert flagged({"weight_bytes": 100 * MB, "peak_rss_bytes": 50 * MB}, env={"device": "cpu"}) == {"peak_rss_bytes"}
    assert flagged({"weight_bytes": 100 * MB, "kv_cache_bytes": 10 * MB, "torch_peak_allocated_bytes": 50 * MB}) \
        == {"torch_peak_allocated_bytes"}


def test_an_estimate_outside_its_own_interval_and_a_negative_kv_cost_are_flagged():
    # mean_ttft_ms_turns_2_n 22.28 outside [20.94, 21.78]; a decode record's -1745 µs per 1k slope
    m = {"mean_ttft_ms_turns_2_n": 22.28, "mean_ttft_ms_turns_2_n_ci_low": 20.94,
         "mean_ttft_ms_turns_2_n_ci_high": 21.78,
         "decode_us_per_1k_ctx": -1745.0, "decode_us_per_1k_ctx_ci_low": -2062.0,
         "decode_us_per_1k_ctx_ci_high": -1431.0}
    assert flagged(m) == {"mean_ttft_ms_turns_2_n", "decode_us_per_1k_ctx"}
    rows = {"compare": [{"variant": "mha", "step_ms_ctx256": 2.0, "step_ms_ctx256_ci_low": 2.1,
                         "step_ms_ctx256_ci_high": 2.3}]}
    assert flagged({}, tables=rows) == {"tables.compare[0].step_ms_ctx256"}


def test_flagging_sets_the_record_field_and_the_console_shows_it():
    from kvbench.sinks.console import run_table, stdout

    result = RunResult(status="ok", config={}, metrics={"achieved_gb_per_s": 500.0, "peak_gb_per_s": 100.0})
    plausibility.flag_implausible(result)
    assert [i["metric"] for i in result.implausible] == ["achieved_gb_per_s"] and result.methods["implausible"]
    with stdout.capture() as out:
        stdout.print(run_table(result.to_dict()))
    text = " ".join(out.get().split())  # the note under the table wraps at the console's width
    assert "implausible achieved_gb_per_s" in text and "faster than this machine's probed peak" in text


def test_the_report_lists_implausible_figures(tmp_path):
    from kvbench.sinks.report import write_report

    result = RunResult(status="ok", config={"task": "bench"},
                       metrics={"decode_ms_p50": 0.1, "roofline_ms": 1.0})
    plausibility.flag_implausible(result)
    result.write(tmp_path / "0")
    write_report(tmp_path, plots=False)
    text = (tmp_path / "summary.md").read_text()
    assert "## Implausible figures" in text and "faster than the roofline" in text


# ---- the instances -----------------------------------------------------------------------------

class PowerNVML(FakeNVML):
    """A board drawing ``watts`` all the time: its energy counter is the clock times the power."""

    def __init__(self, watts, limit_w=700.0):
        super().__init__()
        self.watts, self.limit_mw = watts, int(limit_w * 1000)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return int(time.perf_counter() * self.watts * 1000)  # mJ

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return self.limit_mw


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(memory, "_torch_device_uuid", lambda device: UUID)
    monkeypatch.setattr(memory, "_torch_reset_peak", lambda device: None)
    monkeypatch.setattr(memory, "_torch_peaks", lambda device: (111, 222))
    monkeypatch.setattr(memory, "_torch_empty_cache", lambda device: None)


def test_energy_is_the_energy_of_its_own_span(monkeypatch, fake_cuda):
    """A 300 W board: the monitor's energy over its span is 300 W, and energy per token over the
    trials' own time stays below the board's limit however long the span around them was."""
    install(monkeypatch, PowerNVML(watts=300.0))
    mon = MemoryMonitor("cuda:0", interval_ms=50.0)
    with mon:
        time.sleep(0.2)
    r = mon.result()
    assert r["power_limit_w"] == 700.0
    assert r["energy_mj"] / 1e3 / r["energy_span_s"] == pytest.approx(300.0, rel=0.05)
    # H200 run 1: 422 J over a 16 s span around 3 trials of 59 ms, 33 tokens each
    per_token = energy_per_token(422_066, 16.0, 3 * 0.059, 3 * 33)
    watts = per_token * 33 / 59.0
    assert watts == pytest.approx(422_066 / 1e3 / 16.0, rel=1e-9) and watts < 700
    assert energy_per_token(0, 1.0, 1.0, 10) is None and energy_per_token(5.0, None, 1.0, 10) is None


def test_nvml_kv_bytes_that_the_driver_did_not_see_are_null_with_a_reason(monkeypatch, fake_cuda):
    install(monkeypatch, FakeNVML(memory=(4000, 4000)))  # the driver's count did not move
    allocated = iter([1000, 1000 + (1 << 20)])
    monkeypatch.setattr(memory, "_torch_allocated", lambda device: next(allocated))
    with allocation_delta(torch.device("cuda:0")) as out:
        pass
    assert out["kv_cache_bytes_torch"] == 1 << 20
    assert out["kv_cache_bytes_nvml"] is None and "caching allocator" in out["kv_cache_bytes_alloc_reason"]


CHILD = "from kvbench.measure.memory import peak_rss_bytes; print(peak_rss_bytes())"
PARENT = textwrap.dedent(f"""
    import subprocess, sys, torch
    block = torch.ones(800 * 2**20 // 4)  # 800 MiB, every page written: resident
    out = subprocess.run([sys.executable, "-c", {CHILD!r}], capture_output=True, text=True, check=True)
    print(out.stdout.strip())
""")


@pytest.mark.e2e  # a child interpreter of a parent that holds 800 MiB
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the inherited ru_maxrss is Linux's")
def test_a_child_of_a_large_parent_reports_its_own_peak_rss():
    """ru_maxrss survives fork+exec: a job process of an 800 MiB parent once reported 813 MiB."""
    proc = subprocess.run([sys.executable, "-c", PARENT], capture_output=True, text=True, check=True,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    child_peak = int(proc.stdout.split()[-1])
    assert 0 < child_peak < 800 * MB, child_peak


def test_x_attainable_uses_the_gemms_at_the_runs_batch():
    """At batch 8 the GEMMs cannot stream weights at the GEMV rate: the attainable step is the
    step's own GEMMs at M = 8, timed, plus the KV at the probed peak; a step cannot beat it."""
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=2, d_model=256, num_heads=4, preset_kv_heads=4, ffn_dim=512, vocab_size=512)
    model = Decoder(cfg, AttentionConfig.for_heads(4, 4)).eval()
    gemm_ms = probe_step_gemms(model, 8, torch.device("cpu"))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert gemm_ms > 0 and len(linears) == 2 * 7 + 1
    out = attainable_metrics(decode_ms_p50=2 * gemm_ms, gemm_ms=gemm_ms, kv_bytes=10**9, peak_gb_per_s=100.0)
    assert out["attainable_ms"] == pytest.approx(gemm_ms + 10.0)
    assert out["x_attainable"] == pytest.approx(2 * gemm_ms / (gemm_ms + 10.0))
    roof = roofline_metrics(model, 8, 16, 8, 2 * gemm_ms, 100.0, 1000.0)
    assert "x_roofline" in roof  # reported beside x_attainable, not replaced
