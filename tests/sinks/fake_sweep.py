"""A sweep directory written by hand as kvbench writes one: ok, invalid, oom, missing and
unreadable jobs, with made-up but distinct numbers that the sink tests check their tables and
plots against. Records carry the config keys their task reads (``record_config``), as the runner
writes them; the Hydra files carry the whole config, as Hydra saves it."""

from dataclasses import asdict
from pathlib import Path

import yaml
from conftest import tiny_model_config
from kv_formula import kv_cache_bytes

from kvbench.config.bench import BenchConfig, CacheConfig, RuntimeConfig, WandbConfig
from kvbench.config.model import AttentionConfig
from kvbench.jobs.job_config import check_job
from kvbench.results import RunResult, record_config

VARIANTS = {"mha": 8, "gqa": 2, "mqa": 1}
PROMPTS, BATCHES, GEN = (16, 32), (1, 2), 8
TURN_TTFT = {True: [40.0, 4.0, 5.0, 6.0], False: [40.0, 50.0, 60.0, 70.0]}


def decode_ms(kv, prompt):
    """A made-up but distinct latency per (variant, context)."""
    return 1.0 + 0.01 * prompt * kv / 8


def bench(kind, kv, prompt=16, batch=1, workload="decode", shared=False):
    return check_job(BenchConfig(model=tiny_model_config(max_seq_len=512),
                                 attention=AttentionConfig(type=kind, num_kv_heads=kv),
                                 workload=dict(name=workload, batch_size=batch, prompt_len=prompt, gen_len=GEN,
                                               system_len=32, turns=4, user_len=8, reply_len=4),
                                 cache=CacheConfig(shared=shared), runtime=RuntimeConfig(device="cpu"),
                                 wandb=WandbConfig(mode="disabled")))


def hydra_files(job_dir, config, overrides):
    (job_dir / ".hydra").mkdir(parents=True)
    (job_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    (job_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))


def build_sweep(root: Path) -> Path:
    """jobs 0-11 ok decode (3 variants x 2 prompts x 2 batches), 12 invalid, 13 missing (killed),
    14 oom, 15-16 ok multiturn with sharing on/off, 17 an unreadable results.json."""
    n = 0
    for kind, kv in VARIANTS.items():
        for prompt in PROMPTS:
            for batch in BATCHES:
                cfg = bench(kind, kv, prompt, batch)
                ms = decode_ms(kv, prompt)
                kv_bytes = kv_cache_bytes(2, kv, 8, prompt + GEN, batch, 4)
                overrides = [f"attention={kind}", f"workload.prompt_len={prompt}", f"workload.batch_size={batch}"]
                hydra_files(root / str(n), asdict(cfg), overrides)
                RunResult("ok", record_config(asdict(cfg)), overrides=overrides, metrics={
                    "prefill_ms": 2.0 * prompt, "decode_ms_p50": ms, "decode_ms_p90": 1.5 * ms,
                    "tokens_per_s": batch * 1000.0 / ms, "kv_cache_bytes": kv_bytes,
                    "kv_cache_bytes_formula": kv_bytes, "nvml_reason": "device is cpu"},
                    series={"decode_ms": [ms] * GEN}).write(root / str(n))
                n += 1
    raw = asdict(bench("gqa", 2))
    raw["attention"]["num_kv_heads"], raw["model"]["head_dim"] = 3, None  # as saved before validation
    hydra_files(root / "12", raw, ["attention.num_kv_heads=3"])
    RunResult("invalid", record_config(raw), error="attention.num_kv_heads=3: must divide model.num_heads=8",
              overrides=["attention.num_kv_heads=3"]).write(root / "12")
    killed = asdict(bench("gqa", 2, prompt=64))
    killed["attention"]["num_kv_heads"] = None  # Hydra saves the config before it is resolved
    hydra_files(root / "13", killed, ["workload.prompt_len=64"])
    oom = asdict(bench("mha", 8, batch=512))
    hydra_files(root / "14", oom, ["workload.batch_size=512"])
    RunResult("oom", record_config(oom), error="OutOfMemoryError: CUDA out of memory",
              overrides=["workload.batch_size=512"],
              metrics={"kv_cache_bytes_formula": 123}).write(root / "14")
    for n, shared in ((15, True), (16, False)):
        cfg = bench("gqa", 2, workload="multiturn", shared=shared)
        overrides = ["workload=multiturn", f"cache.shared={str(shared).lower()}"]
        hydra_files(root / str(n), asdict(cfg), overrides)
        rows = [{"turn": t, "ttft_ms": v, "context_tokens": 32 + 12 * t,
                 "prefill_tokens": 12 if shared else 32 + 12 * t} for t, v in enumerate(TURN_TTFT[shared])]
        RunResult("ok", record_config(asdict(cfg)), overrides=overrides,
                  metrics={"turn1_ttft_ms": rows[0]["ttft_ms"],
                           "mean_ttft_ms_turns_2_n": sum(TURN_TTFT[shared][1:]) / 3},
                  tables={"turns": rows}).write(root / str(n))
    hydra_files(root / "17", asdict(bench("mqa", 1, prompt=64)), ["attention=mqa", "workload.prompt_len=64"])
    (root / "17" / "results.json").write_text('{"status": "ok", "metr')
    return root


