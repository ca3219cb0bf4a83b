"""Roofline fields against an independent count of the bytes a decode step reads."""

import json
import os

import pytest
import torch
from conftest import call_with_timeout, make_decoder, tiny_model_config

from kvbench.config.model import AttentionConfig
from kvbench.measure import roofline
from kvbench.measure.roofline import decode_bytes_read, decode_flops, machine_peaks, roofline_metrics
from kvbench.model import Decoder


@pytest.mark.parametrize("kv, dtype, size", [(8, torch.float32, 4), (2, torch.bfloat16, 2), (1, torch.float16, 2)])
def test_decode_bytes_read_counts_weights_and_kv(kv, dtype, size):
    model = make_decoder(kv, dtype=dtype)  # 2 layers, d_model 64, 8 heads, head_dim 8, ffn 96, vocab 97
    d, L, D, V, ffn = 64, 2, 8, 97, 96
    per_layer = d * 8 * D + 2 * d * kv * D + 8 * D * d + 3 * d * ffn + 2 * d  # q, k+v, o, mlp, 2 norms
    weights = (L * per_layer + d + V * d) * size  # + final norm + lm_head; embedding is a lookup:
    weights += 3 * d * size  # B = 3 rows of it
    kv_bytes = 2 * L * kv * D * 100 * 3 * size
    assert decode_bytes_read(model, 3, 100) == (weights + kv_bytes, kv_bytes)


def test_decode_flops_counts_a_multiply_add_per_weight_and_kv_element():
    model = make_decoder(2)  # 2 layers, d_model 64, 8 heads x 8, 2 KV heads, ffn 96, vocab 97
    matrices = 2 * (64 * 64 + 2 * 64 * 16 + 64 * 64 + 3 * 64 * 96) + 97 * 64
    attention = 2 * 2 * 8 * 8 * 30  # 2 layers x (QK^T and PV) x H x D multiply-adds per key, 30 keys
    assert decode_flops(model, 3, 30) == 2 * 3 * (matrices + attention)  # 2 FLOP a multiply-add, B = 3


def test_roofline_metrics_are_consistent():
    model = make_decoder(2)
    m = roofline_metrics(model, batch_size=2, prompt_len=10, gen_len=5, decode_ms_p50=0.5, peak_gb_per_s=20.0,
                         peak_gflops=1e6)
    total, kv = decode_bytes_read(model, 2, 10 + 3)  # mean context of steps 11..15 is 13
    assert m["bytes_read_per_step"] == total and m["kv_bytes_read_per_step"] == kv
    assert m["achieved_gb_per_s"] == pytest.approx(total / 0.5e-3 / 1e9)
    assert m["percent_of_peak"] == pytest.approx(100 * m["achieved_gb_per_s"] / 20.0)
    assert m["roofline_ms"] == pytest.approx(total / 20e9 * 1e3)
    assert m["roofline_bound"] == "memory" and m["x_roofline"] == pytest.approx(0.5 / m["roofline_ms"])
    assert "peak_note" not in m
    too_fast = roofline_metrics(model, 2, 10, 5, decode_ms_p50=total / 40e9 * 1e3, peak_gb_per_s=20.0,
                                peak_gflops=1e6)
    assert too_fast["percent_of_peak"] == pytest.approx(200) and "re-probe" in too_fast["peak_note"]
    # with little compute the FLOP bound binds instead
    slow_cpu = roofline_metrics(model, 2, 10, 5, decode_ms_p50=1.0, peak_gb_per_s=20.0, peak_gflops=0.01)
    flops = decode_flops(model, 2, 13)
    assert slow_cpu["roofline_bound"] == "compute"
    assert slow_cpu["roofline_ms"] == pytest.approx(flops / 0.01e9 * 1e3)


def test_peak_is_the_gemv_rate_overridable_and_probed_cached_or_next_to_the_run(tmp_path, monkeypatch):
    calls = []

    def fake_probe(device):
        calls.append(device)
        return {"copy_gb_per_s": 11.0 + len(calls), "gemv_gb_per_s": 17.0 + len(calls), "matmul_gflops": 90.0}

    monkeypatch.setattr(roofline, "probe_bandwidth", fake_probe)
    cache = tmp_path / "bw.json"
    override = machine_peaks(torch.device("cpu"), 42.0, cache)
    assert (override["peak_gb_per_s"], override["peak_method"]) == (42.0, "runtime.peak_gb_per_s")
    assert (override["probe_gemv_gb_per_s"], override["probe_copy_gb_per_s"], override["peak_gflops"]) == (
        18.0, 12.0, 90.0)  # both probed rates are reported beside an override
    first = machine_peaks(torch.device("cpu"), None, cache)
    # the roofline's peak is the GEMV rate, even where the copy is faster
    assert first["peak_gb_per_s"] == 18.0 and "gemv" in first["peak_method"] and "cached" in first["peak_method"]
    assert len(calls) == 1 and len(json.loads(cache.read_text())) == 1  # probed once, then read from the file
    fresh = machine_peaks(torch.device("cpu"), None, cache, fresh=True)
    assert len(calls) == 2 and fresh["peak_gb_per_s"] == 19.0 and "next to this run" in fresh["peak_method"]
    assert machine_peaks(torch.device("cpu"), None, cache)["peak_gb_per_s"] == 18.0  # the cache is kept


def test_probe_measures_a_plausible_bandwidth():
    probe = roofline.probe_bandwidth(torch.device("cpu"), mib=16, repeats=2)
    assert all(0.1 < v < 10_000 for v in probe.values()), probe


def _peaks(fields):
    return fields["peak_gb_per_s"], fields["peak_gflops"]


@pytest.mark.parametrize("entry", [
    "garbage", 5, {"copy_gb_per_s": 11.0},  # not a probe
    {"copy_gb_per_s": -1.0, "gemv_gb_per_s": 17.0, "matmul_gflops": 90.0},
    {"copy_gb_per_s": 11.0, "gemv_gb_per_s": float("nan"), "matmul_gflops": 90.0},
    {"copy_gb_per_s": "11", "gemv_gb_per_s": 17.0, "matmul_gflops": 90.0},
])
def test_a_damaged_bandwidth_cache_is_probed_again(tmp_path, monkeypatch, entry):
    """The cache is a file in the user's home: an entry that is not a positive finite probe is
    measured again instead of becoming the roofline's peak (or a TypeError)."""
    monkeypatch.setattr(roofline, "probe_bandwidth",
                        lambda device: {"copy_gb_per_s": 11.0, "gemv_gb_per_s": 17.0, "matmul_gflops": 90.0})
    cache = tmp_path / "bw.json"
    cache.write_text(json.dumps({roofline._machine_key(torch.device("cpu")): entry}))
    assert _peaks(machine_peaks(torch.device("cpu"), None, cache)) == (17.0, 90.0)


def test_a_bandwidth_cache_that_is_a_fifo_is_probed_again(tmp_path, monkeypatch):
    monkeypatch.setattr(roofline, "probe_bandwidth",
                        lambda device: {"copy_gb_per_s": 11.0, "gemv_gb_per_s": 17.0, "matmul_gflops": 90.0})
    cache = tmp_path / "bw.json"
    os.mkfifo(cache)  # reading it would block until a writer comes
    assert _peaks(call_with_timeout(lambda: machine_peaks(torch.device("cpu"), None, cache))) == (17.0, 90.0)


def test_a_chunked_layers_bytes_and_flops_per_step_are_the_mean_over_the_steps_not_at_the_mean_context():
    """Chunks of 8, steps at contexts 7..12 (prompt 6, 6 steps): a chunked layer reads 7, 8, then 1, 2, 3,
    4 positions (mean 25/6), where the mean context 9.5 would give 1.5. Counted by hand per step."""
    torch.manual_seed(0)
    cfg = tiny_model_config()  # 2 layers, d_model 64, 8 heads x 8
    model = Decoder(cfg, AttentionConfig(type="gqa", num_kv_heads=2, chunk=8, global_every=2)).eval()
    m = roofline_metrics(model, 1, prompt_len=6, gen_len=6, decode_ms_p50=1.0, peak_gb_per_s=20.0, peak_gflops=1e6)
    position = 2 * 2 * 8 * 4  # K and V, 2 KV heads of 8, float32
    chunked = [7, 8, 1, 2, 3, 4]  # layer 0: positions of the chunk holding the step's token
    full = [7, 8, 9, 10, 11, 12]  # layer 1 (global) attends them all
    assert [getattr(layer, "chunk", None) for layer in model.layouts] == [8, None]
    assert m["kv_bytes_read_per_step"] == pytest.approx(position * (sum(chunked) + sum(full)) / 6)
    attention = 2 * 2 * 8 * 8 * (sum(chunked) + sum(full)) / 6  # 2 FLOP x (QK^T, PV) x H x D per key
    assert m["flops_per_step"] - decode_flops(model, 1, 0) == pytest.approx(attention)
