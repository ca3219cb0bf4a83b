"""What the NVML sampler thread costs the decode it measures (issue 14, item 7), on CPU.

The decode workload times its trials inside a :class:`~kvbench.measure.memory.MemoryMonitor`,
whose background thread reads device memory every ``runtime.nvml_interval_ms``. On a GPU that
thread competes with the timed loop for the GIL (and a core). Here the monitor runs its real code
path, sampler thread included, against a fake ``pynvml`` (each read returns at once, so this is
the cost of the thread's wake-ups and GIL hand-overs; a real NVML read adds its own ~µs in C with
the GIL released) while the decode runs on CPU. Rounds alternate without and with the monitor
(ABBA, so drift hits both alike); the overhead is the paired ratio of the per-trial decode times,
with its bootstrap interval and the spread of the per-round ratios.

    python experiments/nvml_overhead.py                          # small, prompt 256, 64 steps, 10 ms
    python experiments/nvml_overhead.py --interval-ms 1          # a 10x faster sampler
    python experiments/nvml_overhead.py --out experiments/results/nvml_overhead   # refresh the committed one

Writes ``--out`` + ``.md`` (default ``outputs/experiments/nvml_overhead.md``).
"""

from __future__ import annotations

import sys
import time
import types
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from _common import Parser, conf_option, decode_setup, out_path, positive_float, positive_int, run_main, write_report

from kvbench.measure import memory
from kvbench.measure.stats import paired_ratio
from kvbench.workloads.decode import time_decode

ROOT = Path(__file__).resolve().parents[1]
UUID = "GPU-00000000-0000-0000-0000-000000000000"


class FakeNVML(types.ModuleType):
    """The pynvml calls the monitor makes, answered at once."""

    nvmlMemory_v2 = 0x02000028

    def __init__(self):
        super().__init__("pynvml")
        self.reads = 0

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlSystemGetDriverVersion(self):
        return "fake"

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return object()

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        self.reads += 1
        return types.SimpleNamespace(used=1 << 30, total=1 << 34, free=1 << 33)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return 0

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return []


def fake_gpu() -> FakeNVML:
    """Make ``MemoryMonitor("cuda")`` run its NVML path (thread and all) on a CPU-only machine."""
    fake = FakeNVML()
    sys.modules["pynvml"] = fake
    memory._torch_device_uuid = lambda device: UUID.removeprefix("GPU-")
    memory._torch_reset_peak = lambda device: None
    memory._torch_peaks = lambda device: (0, 0)
    return fake


def main(argv=None) -> None:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=conf_option("model"), default="small")
    p.add_argument("--prompt-len", type=positive_int, default=256)
    p.add_argument("--gen-len", type=positive_int, default=64)
    p.add_argument("--rounds", type=positive_int, default=20)
    p.add_argument("--interval-ms", type=positive_float, default=10.0,
                   help="sampling period (runtime.nvml_interval_ms)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads")
    p.add_argument("--out", type=out_path, default=ROOT / "outputs" / "experiments" / "nvml_overhead",
                   help="the committed result changes only with --out experiments/results/nvml_overhead")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg, model, prompt, cache = decode_setup(args.model, args.prompt_len, args.gen_len)
    fake = fake_gpu()
    device = torch.device("cpu")

    def trial(monitored: bool) -> float:
        ctx = memory.MemoryMonitor("cuda", args.interval_ms) if monitored else nullcontext()
        with ctx as mon:
            t = time_decode(model, prompt, args.gen_len, cache, 0, 1, device)
        if monitored:
            assert mon.result()["nvml_samples"] >= 1, mon.result()  # the sampler did run
        return sum(t.decode_ms[0])

    time_decode(model, prompt, args.gen_len, cache, 2, 0, device)  # warm up
    off, on = [], []
    for r in range(args.rounds):  # ABBA: each arm goes first in every other round
        order = (False, True) if r % 2 == 0 else (True, False)
        got = {m: trial(m) for m in order}
        off.append(got[False])
        on.append(got[True])
    ratio, low, high = paired_ratio(off, on)
    per_round = np.asarray(on) / np.asarray(off)
    q1, q3 = np.percentile(per_round, [25, 75])
    reads = fake.reads
    overhead = 100 * (ratio - 1)
    interval = (f"[{low:.4f}, {high:.4f}]" if low is not None and high is not None
                else f"none ({args.rounds} rounds are too few for one)")
    if low is not None and low > 1.01:
        verdict = "above 1 %: move sampling out of the timed process or lengthen the interval"
    elif high is not None and high < 1.01:
        verdict = "below 1 % (the whole interval): sampling stays in the timed process"
    else:
        verdict = ("not resolved by the A/B on this machine (the interval spans 1 %); the sampler's own CPU time "
                   "below bounds what it can take from the timed loop")
    # Noise-free bound: the process's CPU time while only the sampler runs (the main thread
    # sleeps) is what the thread takes from the cores and, at most, from the GIL.
    idle_s = 3.0
    cpu0 = time.process_time()
    time.sleep(idle_s)
    idle_cpu = time.process_time() - cpu0
    cpu0, reads0 = time.process_time(), fake.reads
    with memory.MemoryMonitor("cuda", args.interval_ms):
        time.sleep(idle_s)
    sampler_cpu = time.process_time() - cpu0 - idle_cpu
    samples = fake.reads - reads0
    lines = [
        "# NVML sampler overhead on the timed decode",
        "",
        f"`python experiments/nvml_overhead.py --model {args.model} --prompt-len {args.prompt_len} --gen-len "
        f"{args.gen_len} --rounds {args.rounds} --interval-ms {args.interval_ms:g} --threads {args.threads}`",
        "",
        f"CPU, torch threads {args.threads}, fake pynvml (reads return at once; {reads} reads in all), "
        f"{args.rounds} ABBA rounds of one {args.gen_len}-step decode trial without and with the monitor's sampler "
        f"thread (every {args.interval_ms:g} ms).",
        "",
        "| | decode ms per trial (median) | min | max |",
        "|---|---|---|---|",
        f"| without sampler | {np.median(off):.2f} | {min(off):.2f} | {max(off):.2f} |",
        f"| with sampler | {np.median(on):.2f} | {min(on):.2f} | {max(on):.2f} |",
        "",
        f"with / without: **{ratio:.4f}** ({overhead:+.2f} %), 95% paired bootstrap interval {interval}; "
        f"per-round ratios: median {np.median(per_round):.4f}, "
        f"IQR [{q1:.4f}, {q3:.4f}], range [{per_round.min():.4f}, {per_round.max():.4f}].",
        "",
        f"Sampler alone ({idle_s:g} s, main thread asleep): {samples} reads, {1e3 * sampler_cpu:.1f} ms of CPU "
        f"time = **{100 * sampler_cpu / idle_s:.3f} %** of one core ({1e6 * sampler_cpu / max(samples, 1):.0f} µs per "
        f"read): the most the thread can take from the timed loop.",
        "",
        f"Verdict: {verdict}.",
        "",
    ]
    write_report(args.out.with_suffix(".md"), "\n".join(lines))


if __name__ == "__main__":
    run_main(main)
