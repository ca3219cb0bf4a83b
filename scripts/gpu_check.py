#!/usr/bin/env python3
"""The GPU check: every CUDA path of kvbench on a real GPU, in one bounded run (docs/gpu-check.md).

Run it through ``scripts/gpu_check.sh`` (which sets up PYTHONPATH and optional wheels). Steps, each
bounded in time and each judged pass / FAIL / inconclusive:

1. preflight: torch, CUDA, the GPU, the driver, the packages kvbench needs;
2. the test suite's ``cuda``-marked tests (CUDA events, NVML, allocation deltas, bf16 decode, OOM as a
   record, cuda:free across processes, graph mode);
3. the eager sweep: bf16, attention=mha,gqa,mqa x prompt 512,4096 x batch 1,16 on llama3_8b shrunk to 2
   layers, every record with NVML readings, torch peaks, the KV formula and the allocation deltas,
   energy per token, and the HBM bandwidth probe's % of peak;
4. a deliberate out-of-memory (a batch far too big) that must come back as a record that says so, never
   ok or error, while the sweep goes on to an ok job: invalid when kvbench's footprint (weights + rotary
   tables + KV formula, kvbench.footprint) already exceeds the device's free memory, before anything is
   allocated; oom when only the allocation finds out;
5. two concurrent jobs with runtime.device=cuda:free on the one GPU: one runs, the other says clearly
   that every GPU is held;
6. the layouts: one task=compare of MHA, GQA, MLA (absorbed decode), a 5:1 hybrid (five layers with a
   window of 1024, one global), a Gated DeltaNet hybrid (4 linear, 2 full), DSA (MLA with a top-k of
   1024) and KV sharing (the last 2 layers read layer 3's) in one process, the variants alternating
   trial by trial: every variant's cache as allocated == the KV formula, the bytes each adds per 1k
   tokens the formula's share of MHA's (the GDN hybrid's only its full layers', with its state apart),
   and each one's KV cost per 1k tokens of context with its interval, below and past W = k; then the
   new layouts exact on the device: tests/test_layouts_device.py (a GDN hybrid and pure stack, DSA
   whose top-k binds, sinks over a window, KV sharing) decodes greedily on CUDA in float32 against the
   same weights' CPU recompute, logits within 1e-4 and every clear argmax the same;
7. the graph-mode sweep (the compiled, fixed-shape decode step; CUDA graphs on a GPU) next to eager, for
   MHA, GQA and MLA (its absorbed decode);
8. the report: records.jsonl, summary.md (the table a person reads), summary.csv and two plots.

``--dry-run`` (or ``GPU_CHECK_DEVICE=cpu``) runs the same steps on the CPU with the tiny model, so
anyone can see the script works; there the CUDA tests skip and cuda:free must be refused.

Output: at most 8 files directly in ``$OUT`` (default ``./gpu_check_out``); the job directories stay
in a work folder (``--work``, default a temporary one). Exit status 0 when every step passed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]

# What each plan sweeps. "gpu" is sized so the whole check stays within ~6 minutes on one H200;
# "cpu" is the dry run (tiny model, < 2 minutes on 2 cores).
PLANS: Dict[str, Dict[str, Any]] = {
    "gpu": {
        "model": ["model=llama3_8b", "model.num_layers=2", "runtime.dtype=bfloat16", "runtime.device=cuda"],
        "trials": ["runtime.warmup=1", "runtime.repeats=3"],
        "eager": ["attention=mha,gqa,mqa", "workload.prompt_len=512,4096", "workload.batch_size=1,16",
                  "workload.gen_len=32"],
        # MLA's absorbed decode in place of MQA (the grouped path GQA already takes), so the graph sweep
        # stays 6 compiled jobs
        "graph": ["attention=mha,gqa,mla", "workload.prompt_len=4096", "workload.batch_size=1,16",
                  "workload.gen_len=32"],
        # llama3_8b's attention shapes over 6 layers (global_every=6: layers 0-4 local, 5 global); MLA at
        # head_dim 128 takes DeepSeek-V3's own ranks (kv_lora_rank 512, rotary 64). Batch 8 so the KV
        # (MHA: 12 GB at 8192) is a visible part of a step; ~1 min (4 prefills of 8 x 8192, 7 rounds).
        "layouts": ["task=compare", "model.num_layers=6", "model.max_seq_len=8193", "workload.batch_size=8",
                    "compare.variants=[mha,gqa,mla,mha:w1024:g6,mha:d3,mla:k1024,mha:s2]",
                    "compare.contexts=[256,512,1024,2048,4096,8192]",
                    "compare.steps=4", "runtime.warmup=1", "runtime.repeats=6", "runtime.compile=false"],
        # A static cache of a million 1001-position sequences (2 layers x 2 x 8 KV heads x 128 x 2 bytes
        # each: ~8 KB a position, 2 TB a tensor) cannot fit; the batch-1 job after it must still run.
        "oom": ["attention=gqa", "workload.prompt_len=1", "workload.gen_len=1000", "workload.batch_size=1000000,1"],
        "free": ["attention=gqa", "workload.prompt_len=4096", "workload.batch_size=16", "workload.gen_len=256",
                 "runtime.device=cuda:free"],
        # 32 MB of KV: MHA's 32 KB a token holds ~2 of the longest requests, so some are preempted
        "serving": ["workload=serving", "attention=mha,gqa,mqa", "workload.num_requests=48", "workload.rate=32",
                    "workload.kv_budget_mb=32", "workload.prefix_len=64", "workload.prefix_fraction=0.5"],
        "budget_s": 540,
    },
    "cpu": {
        # In kvbench's own process: the dry run proves the script; a fresh process per job (a torch
        # import each, 14 jobs) has its own tests.
        "model": ["model=tiny", "runtime.dtype=float32", "runtime.device=cpu", "runtime.threads=1",
                  "runtime.peak_gb_per_s=10", "runtime.isolate=false"],
        "trials": ["runtime.warmup=0", "runtime.repeats=2"],
        "eager": ["attention=mha,mqa", "workload.prompt_len=16,32", "workload.batch_size=1,2", "workload.gen_len=8"],
        "graph": ["attention=mha,mla", "workload.prompt_len=32", "workload.batch_size=1", "workload.gen_len=8"],
        "layouts": ["task=compare", "model.num_layers=6", "model.max_seq_len=64", "workload.batch_size=2",
                    "compare.variants=[mha,gqa,mla,mha:w16:g6,mha:d3,mla:k16,mha:s2]",
                    "compare.contexts=[4,8,16,24,32,48]",
                    "compare.steps=2", "runtime.warmup=0", "runtime.repeats=6", "runtime.compile=false"],
        # Ten million 201-position sequences: a 128 GB tensor per layer, refused by the allocator.
        "oom": ["attention=gqa", "workload.prompt_len=1", "workload.gen_len=200", "workload.batch_size=10000000,1"],
        "free": ["attention=gqa", "workload.prompt_len=32", "workload.batch_size=1", "workload.gen_len=8",
                 "runtime.device=cuda:free"],
        "serving": ["workload=serving", "attention=mha,mqa", "workload.num_requests=8", "workload.rate=50",
                    "workload.prompt.lo=8", "workload.prompt.mean=24", "workload.prompt.hi=48", "workload.output.lo=2",
                    "workload.output.hi=8", "workload.kv_budget_mb=0.1", "workload.prefix_len=16",
                    "workload.prefix_fraction=0.5"],
        "budget_s": 230,
    },
}
# --steps key -> (name in the summary, Check method), in the order they run.
STEPS = {"preflight": ("preflight", "preflight"), "cuda": ("cuda tests", "cuda_tests"),
         "eager": ("eager sweep", "eager"), "oom": ("oom goes on", "oom"), "free": ("cuda:free", "cuda_free"),
         "layouts": ("layouts compare", "layouts"), "exact": ("layouts exact", "layouts_exact"),
         "graph": ("graph sweep", "graph"),
         "serving": ("serving sweep", "serving")}
GRAPH_MODE = os.environ.get("GPU_CHECK_GRAPH_MODE", "graph")  # the value of runtime.compile for step 6


@dataclass
class Step:
    name: str
    verdict: str = "not run"  # pass | FAIL | inconclusive | not run
    seconds: float = 0.0
    detail: str = ""
    records: List[Dict[str, Any]] = field(default_factory=list)


class Check:
    def __init__(self, args: argparse.Namespace):
        self.plan_name = "cpu" if args.dry_run else "gpu"
        self.plan = PLANS[self.plan_name]
        self.out = Path(args.out).resolve()
        self.work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="kvbench-gpu-check-"))
        self.deadline = time.monotonic() + (args.budget_s or self.plan["budget_s"])
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.log_path = self.out / "gpu_check.log"
        self.log_file = self.log_path.open("w")
        self.steps: List[Step] = []

    # -- plumbing --
    def log(self, text: str) -> None:
        self.log_file.write(text.rstrip("\n") + "\n")
        self.log_file.flush()

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log(text)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, cmd: Sequence[str], timeout: float, env: Optional[dict] = None) -> subprocess.CompletedProcess:
        """Run ``cmd`` (its output into the log) for at most ``timeout`` seconds; a timeout kills the
        whole process group (a sweep's children too) and returns exit code 124."""
        timeout = max(5.0, min(timeout, self.left() - 15))
        self.log(f"$ {' '.join(cmd)}   (timeout {timeout:.0f} s)")
        proc = subprocess.Popen(list(cmd), cwd=self.work, env=env or os.environ.copy(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            code = 124
            out += f"\n[gpu_check: killed after {timeout:.0f} s]\n"
        self.log(out)
        return subprocess.CompletedProcess(cmd, code, out, "")

    def kvbench(self, *overrides: str) -> List[str]:
        return [sys.executable, "-m", "kvbench.cli", *overrides]

    def sweep(self, name: str, grid: Sequence[str], extra: Sequence[str] = (), timeout: float = 300,
              wandb: str = "wandb=disabled") -> tuple[subprocess.CompletedProcess, List[Dict[str, Any]]]:
        sweep_dir = self.work / "sweeps" / name
        cmd = self.kvbench("-m", *self.plan["model"], *self.plan["trials"], *grid, *extra, wandb,
                           f"hydra.sweep.dir={sweep_dir}")
        proc = self.run(cmd, timeout)
        return proc, records_under(sweep_dir)

    def step(self, name: str, fn, always: bool = False) -> Step:
        step = Step(name)
        self.steps.append(step)
        if self.left() < 30 and not always:
            step.verdict, step.detail = "not run", "out of time budget"
            self.say(f"[{name}] not run: out of time budget")
            return step
        start = time.monotonic()
        try:
            fn(step)
        except Exception as exc:  # noqa: BLE001 — a broken step is a FAIL in the table, the others still run
            step.verdict, step.detail = "FAIL", f"{type(exc).__name__}: {exc}"
        step.seconds = time.monotonic() - start
        self.say(f"[{name}] {step.verdict} ({step.seconds:.0f} s): {step.detail}")
        return step

    # -- the steps --
    def preflight(self, step: Step) -> None:
        import torch

        lines = [f"python {platform.python_version()} ({sys.executable})", f"torch {torch.__version__} "
                 f"(CUDA {torch.version.cuda}), cuda available: {torch.cuda.is_available()}"]
        for mod in ("hydra", "omegaconf", "wandb", "pynvml", "rich", "matplotlib"):
            try:
                m = __import__(mod)
                lines.append(f"{mod} {getattr(m, '__version__', '?')}")
            except ImportError as exc:
                lines.append(f"{mod} MISSING ({exc})")
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            lines.append(f"GPU 0: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
                         f"{torch.cuda.device_count()} visible")
        smi = shutil.which("nvidia-smi")
        if smi:
            out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,"
                                  "clocks.mem,power.draw", "--format=csv"], capture_output=True, text=True)
            lines.append(out.stdout.strip())
        for line in lines:
            self.log(line)
        missing = [line for line in lines if "MISSING" in line and not line.startswith("wandb")]
        want_cuda = self.plan_name == "gpu"
        ok = not missing and torch.cuda.is_available() == want_cuda
        step.verdict = "pass" if ok else "FAIL"
        step.detail = "; ".join(lines[1:2] + [line for line in lines if line.startswith("GPU 0")] + missing)

    def cuda_tests(self, step: Step) -> None:
        # Only the modules that hold cuda tests: collecting the whole suite costs time the GPU bills.
        files = sorted(str(f) for f in (ROOT / "tests").rglob("test_*.py") if "mark.cuda" in f.read_text())
        proc = self.run([sys.executable, "-m", "pytest", *files, "-m", "cuda", "-q", "-rs",
                         "-p", "no:cacheprovider"], timeout=150)
        summary = next((ln for ln in reversed(proc.stdout.splitlines()) if " in " in ln and "=" in ln), "")
        step.detail = summary.strip("= ").strip() or f"exit {proc.returncode}"
        if self.plan_name == "gpu":
            step.verdict = "pass" if proc.returncode == 0 and "skipped" not in summary else "FAIL"
        else:  # without a GPU every cuda test must skip, and nothing may fail
            step.verdict = "pass" if proc.returncode == 0 and "passed" not in summary else "FAIL"

    def eager(self, step: Step) -> None:
        proc, step.records = self.sweep("main/eager", self.plan["eager"], ["runtime.compile=false"], timeout=240)
        self.judge_sweep(step, proc, expected=grid_size(self.plan["eager"]))

    def graph(self, step: Step) -> None:
        proc, step.records = self.sweep("main/graph", self.plan["graph"], [f"runtime.compile={GRAPH_MODE}"],
                                        timeout=300)
        self.judge_sweep(step, proc, expected=grid_size(self.plan["graph"]))
        recompiles = [r["metrics"].get("recompiles") for r in step.records if r["status"] == "ok"]
        if any(n for n in recompiles if isinstance(n, (int, float))):
            step.verdict = "FAIL"
            step.detail += f"; recompiles during trials: {recompiles}"

    def serving(self, step: Step) -> None:
        """workload=serving per layout: every request finished, the store's bytes the KV formula's,
        the block waste within its bound (the paged store's gathers, writes and masks on the device)."""
        proc, step.records = self.sweep("serving", self.plan["serving"], ["runtime.compile=false"], timeout=180)
        self.judge_sweep(step, proc, expected=grid_size(self.plan["serving"]))
        ok = [r for r in step.records if r["status"] == "ok"]
        for r in ok:
            m = r["metrics"]
            step.detail += (f"; {r['config']['attention']['type']}: {m.get('kv_blocks_total')} blocks, "
                            f"{m.get('preemptions')} preempted, p99 TTFT {_fmt(m.get('ttft_ms_p99'), '{:.1f}')} ms, "
                            f"{_fmt(m.get('output_throughput'), '{:.0f}')} tok/s")
            if not (m.get("requests_finished") == m.get("requests") and m.get("block_waste_within_bound")
                    and m.get("kv_store_bytes") == m.get("kv_store_bytes_formula")):
                step.verdict = "FAIL"
                step.detail += " (unfinished requests, waste over its bound or bytes off the formula)"

    def judge_sweep(self, step: Step, proc, expected: int) -> None:
        statuses = [r["status"] for r in step.records]
        counts = {s: statuses.count(s) for s in sorted(set(statuses))}
        step.detail = f"{len(statuses)}/{expected} jobs: {counts or 'none'}, exit {proc.returncode}"
        bad = [f"{r['job']}: {r['status']}: {(r.get('error') or '')[:160]}"
               for r in step.records if r["status"] != "ok"]
        if bad:
            step.detail += " | " + " | ".join(bad[:4])
        step.verdict = "pass" if proc.returncode == 0 and statuses.count("ok") == expected else "FAIL"

    def oom(self, step: Step) -> None:
        proc, step.records = self.sweep("oom", self.plan["oom"], ["runtime.compile=false"], timeout=120,
                                        wandb="wandb=offline")
        by_batch = {r["config"]["workload"]["batch_size"]: r for r in step.records}
        small, big = (by_batch[b] for b in sorted(by_batch)) if len(by_batch) == 2 else (None, None)
        step.detail = ", ".join(f"batch {b}: {r['status']}" for b, r in sorted(by_batch.items()))
        if big and big["status"] not in ("oom", "invalid"):
            step.detail += f" ({(big.get('error') or '')[:160]})"
        wandb_runs = list((self.work / "sweeps" / "oom").glob("*/wandb/offline-run-*"))
        step.detail += f"; W&B offline runs written: {len(wandb_runs)}"
        fits_not = big is not None and (big["status"] == "oom" or (
            big["status"] == "invalid" and "memory available" in (big.get("error") or "")))
        step.detail += "" if big is None or big["status"] == "oom" else " (refused before any allocation)"
        step.verdict = "pass" if fits_not and small and small["status"] == "ok" and proc.returncode == 0 else "FAIL"

    def cuda_free(self, step: Step) -> None:
        """Two single runs at once on the one GPU with runtime.device=cuda:free."""
        dirs = [self.work / "free" / f"job{i}" for i in (1, 2)]
        model = [o for o in self.plan["model"] if not o.startswith("runtime.device=")]
        cmds = [self.kvbench(*model, *self.plan["trials"], *self.plan["free"], "wandb=disabled",
                             f"hydra.run.dir={d}") for d in dirs]
        self.log("$ (two at once) " + " ;; ".join(" ".join(c) for c in cmds))
        procs = [subprocess.Popen(c, cwd=self.work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True) for c in cmds]
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=max(10.0, min(150.0, self.left() - 20)))[0])
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                outs.append(p.communicate()[0] + "\n[gpu_check: killed]\n")
        for o in outs:
            self.log(o)
        step.records = [rec for d in dirs for rec in records_under(d)]
        statuses = sorted(r["status"] for r in step.records)
        errors = [r.get("error") or "" for r in step.records if r["status"] != "ok"]
        step.detail = f"statuses {statuses}" + (f"; {errors[0][:200]}" if errors else "")
        if self.plan_name == "gpu":
            if statuses == ["invalid", "ok"] and "held" in errors[0]:
                step.verdict = "pass"
            elif statuses == ["ok", "ok"]:
                step.verdict, step.detail = "inconclusive", step.detail + " (the runs did not overlap)"
            else:
                step.verdict = "FAIL"
        else:
            step.verdict = "pass" if statuses == ["invalid", "invalid"] and all(
                "CUDA is not available" in e for e in errors) else "FAIL"

    def layouts(self, step: Step) -> None:
        """task=compare of the plan's variants (eager: task=compare times eager steps). pass: one ok
        record, every variant under its own name, the bytes as :func:`layout_faults` checks them; the
        timings are reported."""
        run_dir = self.work / "layouts"
        model = [o for o in self.plan["model"] if not o.startswith("model.num_layers=")]
        proc = self.run(self.kvbench(*model, *self.plan["layouts"], "wandb=disabled", f"hydra.run.dir={run_dir}"),
                        timeout=180)
        step.records = records_under(run_dir)
        rec = step.records[0] if step.records else {"status": "missing", "error": f"no record (exit {proc.returncode})"}
        if rec["status"] != "ok":
            step.verdict, step.detail = "FAIL", f"{rec['status']}: {(rec.get('error') or '')[:200]}"
            return
        rows = (rec.get("tables") or {}).get("compare") or []
        names = [r["variant"] for r in rows]
        faults = layout_faults(rows, variant_count(self.plan["layouts"]), layer_count(self.plan["layouts"]))
        hybrid = next((r for r in rows if "_w" in r["variant"]), {})
        step.detail = (f"{', '.join(names)}; bytes: {'as the formula' if not faults else '; '.join(faults)}"
                       f"; KV µs/1k ctx: " + ", ".join(f"{r['variant']} {_fmt(r.get('decode_us_per_1k_ctx'), '{:.1f}')}"
                                                     for r in rows)
                       + f"; hybrid past/below W {_fmt(hybrid.get('past_w_slope_ratio'), '{:.2f}')} (bytes 1/6)")
        step.verdict = "FAIL" if faults else "pass"

    def layouts_exact_command(self) -> tuple[List[str], dict]:
        """The exactness tests of the new layouts on this plan's device (cuda, or the dry run's cpu)."""
        dev = "cuda" if self.plan_name == "gpu" else "cpu"
        return ([sys.executable, "-m", "pytest", str(ROOT / "tests" / "test_layouts_device.py"), "-q", "-rs",
                 "-p", "no:cacheprovider"], dict(os.environ, KVBENCH_LAYOUTS_DEVICE=dev))

    def layouts_exact(self, step: Step) -> None:
        """pass: every test ran and passed on the device (a skip is a FAIL: nothing was checked)."""
        cmd, env = self.layouts_exact_command()
        proc = self.run(cmd, timeout=150, env=env)
        summary = next((ln for ln in reversed(proc.stdout.splitlines()) if " in " in ln and "=" in ln or
                        (" passed" in ln or " failed" in ln)), "")
        said = summary.strip("= ").strip() or f"exit {proc.returncode}"
        step.detail = f"on {env['KVBENCH_LAYOUTS_DEVICE']}: {said}"
        step.verdict = "pass" if proc.returncode == 0 and "passed" in summary and "skipped" not in summary else "FAIL"

    # -- the report --
    def report(self, step: Step) -> None:
        from kvbench.sinks.report import write_report

        main = self.work / "sweeps" / "main"
        files: List[Path] = []
        if main.is_dir():
            rep = write_report(main, self.work / "report")
            for name in ("summary.csv", "decode_vs_context.png", "tokens_vs_batch.png"):
                if (self.work / "report" / name).is_file():
                    files.append(shutil.copy(self.work / "report" / name, self.out / name))
        with (self.out / "records.jsonl").open("w") as f:
            for s in self.steps:
                for rec in s.records:
                    f.write(json.dumps({"check_step": s.name, **rec}, default=str) + "\n")
        step.verdict = "pass"
        step.detail = f"wrote {', '.join(p.name for p in files) or 'no plots (no main sweep)'}"
        if main.is_dir():
            step.detail += f"; {len(rep.records)} main jobs"

    def summary(self) -> str:
        eager = next((s.records for s in self.steps if s.name == "eager sweep"), [])
        graph = next((s.records for s in self.steps if s.name == "graph sweep"), [])
        lines = [f"# kvbench GPU check ({self.plan_name} plan)", "",
                 f"{time.strftime('%Y-%m-%d %H:%M:%S')}; work folder {self.work}", "",
                 "| step | verdict | seconds | detail |", "|---|---|---:|---|"]
        for s in self.steps:
            lines.append(f"| {s.name} | {s.verdict} | {s.seconds:.0f} | {s.detail.replace('|', '/')} |")
        env = next((r.get("env") for r in eager + graph if r.get("env")), {}) or {}
        lines += ["", f"Device: {env.get('device_name')}, torch {env.get('torch')}, CUDA {env.get('torch_cuda')}, "
                  f"driver {env.get('gpu_driver_version')}.", ""]
        lines += decode_table(eager, graph)
        lines += layouts_table(next((s.records for s in self.steps if s.name == "layouts compare"), []))
        return "\n".join(lines) + "\n"


def variant_count(overrides: Sequence[str]) -> int:
    """How many compare.variants the plan's layouts step lists."""
    spec = next(o for o in overrides if o.startswith("compare.variants="))
    return len(spec.split("=", 1)[1].strip("[]").split(","))


def layer_count(overrides: Sequence[str]) -> int:
    return int(next(o for o in overrides if o.startswith("model.num_layers=")).split("=", 1)[1])


def layout_faults(rows: List[Dict[str, Any]], expected: int, layers: int) -> List[str]:
    """What is wrong with a task=compare record's rows (empty: nothing): a variant missing or named
    twice, a cache whose allocation is not the KV formula, or bytes that do not grow as the layout
    says against MHA's (the first row): the window hybrid's a sixth past W, the Gated DeltaNet
    hybrid's per 1k tokens its full layers' share with a state apart, KV sharing's its storing
    layers' share, DSA's MLA's latent plus an index key."""
    names = [r.get("variant") for r in rows]
    faults = [] if len(rows) == expected and len(set(names)) == expected else [f"{len(rows)} variants of {expected}"]
    faults += [f"{r['variant']} allocated {r.get('kv_cache_bytes')} != formula {r.get('kv_cache_bytes_formula')}"
               for r in rows if r.get("kv_cache_bytes") != r.get("kv_cache_bytes_formula")]
    if not rows:
        return faults or ["no rows"]
    mha = rows[0]

    def share(row: Dict[str, Any]) -> Optional[float]:
        a, b = row.get("kv_bytes_per_1k_ctx"), mha.get("kv_bytes_per_1k_ctx")
        return a / b if a is not None and b else None

    for r in rows[1:]:
        v, layout = r["variant"], r.get("layout", "")
        if "_w" in v:
            below, past = r.get("kv_bytes_per_1k_ctx_below_w"), r.get("kv_bytes_per_1k_ctx_past_w")
            if not (below and past is not None and abs(past / below - 1 / 6) < 1e-9):
                faults.append(f"{v}: bytes past W {past} not a sixth of below {below}")
        elif "gdn" in layout:
            linear, full = (int(n) for n in layout.rsplit(" ", 1)[1].split(":"))
            if not (r.get("kv_state_bytes") and share(r) is not None
                    and abs(share(r) - full / (linear + full)) < 1e-9):
                faults.append(f"{v}: state {r.get('kv_state_bytes')}, bytes per 1k ctx {share(r)} of MHA's "
                              f"(want a state and {full}/{linear + full})")
        elif "kvshare" in v:
            n = int(v.rsplit("kvshare", 1)[1])
            if share(r) is None or abs(share(r) - (1 - n / layers)) > 1e-9:
                faults.append(f"{v}: bytes per 1k ctx {share(r)} of MHA's (want {layers - n}/{layers})")
        elif "topk" in v:
            latent = next((x for x in rows if x.get("layout", "").startswith("mla") and "topk" not in x["variant"]), {})
            if not latent or not r.get("kv_bytes_per_token", 0) > latent.get("kv_bytes_per_token", 0):
                faults.append(f"{v}: {r.get('kv_bytes_per_token')} bytes per token, not MLA's plus an index key")
    return faults


def grid_size(grid: Sequence[str]) -> int:
    n = 1
    for item in grid:
        n *= len(item.split("=", 1)[1].split(","))
    return n


def records_under(root: Path) -> List[Dict[str, Any]]:
    """Every record under ``root`` as a dict with its ``job`` (read through kvbench.results)."""
    from kvbench.results import RecordError, find_results, read_record

    out = []
    for path in find_results(root):
        try:
            rec = read_record(path).to_dict()
        except RecordError as exc:
            rec = {"status": "unreadable", "error": str(exc), "config": {}, "metrics": {}}
        rec["job"] = str(path.parent.relative_to(root)) if path.parent != root else root.name
        out.append(rec)
    return out


def _fmt(value: Any, spec: str = "{:.3f}") -> str:
    if value is None:
        return "-"
    if spec == "MiB":
        return f"{value / 2**20:.1f}"
    return spec.format(value)


def decode_table(eager: List[Dict[str, Any]], graph: List[Dict[str, Any]]) -> List[str]:
    """variant x prompt x batch: eager next to graph mode, KV bytes by formula / torch / NVML, % of
    the HBM bandwidth probe, energy per token."""
    def key(r):
        c = r["config"]
        return (c["attention"]["type"], c["attention"]["num_kv_heads"], c["workload"]["prompt_len"],
                c["workload"]["batch_size"])

    order = {"mha": 0, "gqa": 1, "mqa": 2, "mla": 3}
    cells: Dict[tuple, Dict[str, Dict[str, Any]]] = {}
    for mode, recs in (("eager", eager), ("graph", graph)):
        for r in recs:
            if r.get("status") == "ok":
                cells.setdefault(key(r), {})[mode] = r["metrics"]
    lines = ["## Decode: eager vs graph mode", "",
             "| attention | KV heads | prompt | batch | decode ms eager | decode ms graph | tok/s eager | "
             "tok/s graph | KV MiB formula | KV MiB torch | KV MiB NVML | % HBM BW eager | % HBM BW graph | "
             "mJ/token eager | compile s | recompiles |", "|" + "---|" * 4 + "---:|" * 12]
    for k in sorted(cells, key=lambda k: (order.get(k[0], 9), k[2], k[3])):
        e, g = cells[k].get("eager", {}), cells[k].get("graph", {})
        m = e or g
        lines.append("| " + " | ".join([
            k[0], str(k[1]), str(k[2]), str(k[3]),
            _fmt(e.get("decode_ms_p50")), _fmt(g.get("decode_ms_p50")),
            _fmt(e.get("tokens_per_s"), "{:.0f}"), _fmt(g.get("tokens_per_s"), "{:.0f}"),
            _fmt(m.get("kv_cache_bytes_formula"), "MiB"), _fmt(m.get("kv_cache_bytes_torch"), "MiB"),
            _fmt(m.get("kv_cache_bytes_nvml"), "MiB"),
            _fmt(e.get("percent_of_peak"), "{:.1f}"), _fmt(g.get("percent_of_peak"), "{:.1f}"),
            _fmt(e.get("energy_mj_per_token"), "{:.2f}"), _fmt(g.get("compile_s"), "{:.1f}"),
            _fmt(g.get("recompiles"), "{}")]) + " |")
    peak = next((c[m].get("peak_gb_per_s") for c in cells.values() for m in c if c[m].get("peak_gb_per_s")), None)
    method = next((c[m].get("peak_method") for c in cells.values() for m in c if c[m].get("peak_method")), None)
    lines += ["", f"Bandwidth peak for % HBM BW: {_fmt(peak, '{:.0f}')} GB/s ({method}). KV MiB torch / NVML: "
              "the allocation seen by torch.cuda.memory_allocated and by NVML around the static cache's creation."]
    return lines


def _ci(row: Dict[str, Any], key: str, spec: str = "{:.1f}") -> str:
    low, high = row.get(f"{key}_ci_low"), row.get(f"{key}_ci_high")
    text = _fmt(row.get(key), spec)
    return text if low is None or high is None else f"{text} [{_fmt(low, spec)}, {_fmt(high, spec)}]"


def layouts_table(records: List[Dict[str, Any]]) -> List[str]:
    """The layouts step's comparison: per variant the KV bytes (allocated, formula), its state per
    sequence and what its cache adds per 1k tokens, the KV cost per 1k tokens of context with its
    interval, and below / past the hybrid's window W."""
    rows = next(((r.get("tables") or {}).get("compare") for r in records if r.get("status") == "ok"), None)
    if not rows:
        return []
    split = next((r["metrics"].get("window_split_ctx") for r in records if r.get("metrics")), None)
    lines = ["", "## Layouts (task=compare, eager, variants alternating)", "",
             f"| variant | layout | weights | KV bytes allocated | = formula | state bytes / sequence | "
             f"KV bytes / 1k ctx | KV µs / 1k ctx | ≤{split} | ≥{split} | past/below W | bytes past/below |",
             "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        below, past = r.get("kv_bytes_per_1k_ctx_below_w"), r.get("kv_bytes_per_1k_ctx_past_w")
        lines.append("| " + " | ".join([
            r["variant"], r.get("layout", ""), r.get("weights", ""), f"{r['kv_cache_bytes']:,}",
            "yes" if r["kv_cache_bytes"] == r["kv_cache_bytes_formula"] else "NO",
            _fmt(r.get("kv_state_bytes"), "{:,}"), _fmt(r.get("kv_bytes_per_1k_ctx"), "{:,.0f}"),
            _ci(r, "decode_us_per_1k_ctx"), _ci(r, "decode_us_per_1k_ctx_below_w"),
            _ci(r, "decode_us_per_1k_ctx_past_w"),
            _ci(r, "past_w_slope_ratio", "{:.2f}"), _fmt(past / below if below else None, "{:.3f}")]) + " |")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", default=os.environ.get("GPU_CHECK_DEVICE") == "cpu",
                        help="the CPU plan (tiny model); also GPU_CHECK_DEVICE=cpu")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out", help="where the files go ($OUT)")
    parser.add_argument("--work", help="where the job directories go (default: a new temporary folder)")
    parser.add_argument("--budget-s", type=float, help="overall time budget in seconds (default: the plan's)")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help=f"which steps, comma-separated (default all: {','.join(STEPS)}); the report always runs")
    args = parser.parse_args(argv)
    unknown = set(args.steps.split(",")) - set(STEPS)
    if unknown:
        parser.error(f"--steps={args.steps!r}: unknown {sorted(unknown)}; choose from {','.join(STEPS)}")
    check = Check(args)
    check.say(f"kvbench GPU check, {check.plan_name} plan: out {check.out}, work {check.work}, "
              f"budget {check.left():.0f} s")
    chosen = args.steps.split(",")
    for key, (name, method) in STEPS.items():
        if key in chosen:
            check.step(name, getattr(check, method))
    check.step("report", check.report, always=True)
    (check.out / "summary.md").write_text(check.summary())
    failed = [s.name for s in check.steps if s.verdict in ("FAIL", "not run")]
    check.say(check.summary())
    check.say(f"gpu_check: {'FAIL: ' + ', '.join(failed) if failed else 'PASS'}")
    check.log_file.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
