"""The commands of the README and of the docs pages (docs/**/*.md), run as a new user runs them:
every command of their ```bash blocks is either run here (as written, or with the tiny overrides
listed below appended, so CI stays cheap) and its promise checked against what it printed and
wrote, or listed in NOT_RUN with why.
A command in neither list fails the first test, so a new command (or a new page with commands)
cannot go untried.

The ```python block runs too, and the numbers the docs quote from `task=inspect` are compared
with what it prints.
"""

import contextlib
import io
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from conftest import TEXT, compose, llama_dir

pytestmark = pytest.mark.e2e  # every test runs README commands as a user does: fresh processes

ROOT = Path(__file__).resolve().parents[1]
# The README and every hand-written docs page (the generated references hold no commands).
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "reference" not in p.parts)]
README = "\n".join(p.read_text() for p in PAGES)
BIN = Path(sys.executable).parent  # where pip put the console scripts kvbench, kvbench-report, ...


def readme_commands() -> List[str]:
    """Every command of the ```bash blocks of the README and the docs pages: continuation lines
    joined, comments dropped, whitespace normalised; a command shown on two pages counts once."""
    out = []
    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                if line.strip() and not line.strip().startswith("#"):
                    command = " ".join(shlex.split(line, comments=True))
                    if command not in out:
                        out.append(command)
    return out


# Appended to the README's command so that it runs in seconds on a CPU (later overrides win). Jobs
# run in kvbench's own process: a fresh one per job costs a torch import each (24 in the flagship
# sweep), and isolation has its own tests (tests/test_isolation.py, tests/test_sweeps.py).
QUICK = ["runtime.warmup=0", "runtime.repeats=1", "runtime.threads=1", "wandb=disabled", "runtime.isolate=false"]
TINY = ["model=tiny", "workload.gen_len=2", *QUICK]
SWEEP = [*TINY, "runtime.fidelity=false"]  # a sweep's jobs check nothing the single run does not
CHAT = ["model=tiny", "workload.system_len=16", "workload.turns=2", "workload.user_len=4", "workload.reply_len=3",
        *QUICK]
SMALL_TEXT = ["train.batch_size=2", "train.seq_len=32", "train.eval_batches=1", "data.max_bytes=20000",
              "runtime.threads=1", "wandb=disabled", "runtime.isolate=false"]
TRAIN = ["train.steps=2", "train.log_every=1", "train.eval_every=2", *SMALL_TEXT]


@dataclass
class Step:
    """How one README command is run: ``extra`` appended, ``swap`` substituted in the command
    (the README's placeholders, or a swept value made small), ``path``: PATH holds only the
    console scripts (no SLURM)."""

    extra: List[str] = field(default_factory=list)
    swap: Dict[str, str] = field(default_factory=dict)
    path: str = "normal"


# Commands in the order they run, one chain per test (a later command may use what an earlier one
# of its chain wrote): each chain is its own test, so pytest-xdist spreads them over the workers.
TRAIN_MHA = "kvbench task=train model=train_small attention=mha runtime.threads=1"
CHAINS: Dict[str, Dict[str, Step]] = {
    "quick start": {"kvbench": Step(TINY)},
    "flagship": {
        "kvbench -m attention=mha,gqa,mqa workload.prompt_len=512,2048 workload.batch_size=1,8 "
        "runtime.dtype=float32,bfloat16": Step([*SWEEP, "hydra.sweep.dir=multirun/flagship"],
                                                {"workload.prompt_len=512,2048": "workload.prompt_len=16,32"}),
    },
    "inspect": {
        "kvbench task=inspect model=llama2_70b attention=gqa": Step(),
        "kvbench task=inspect model=llama2_7b attention=mha workload.prompt_len=4000 workload.gen_len=96 "
        "workload.batch_size=64": Step(),
        "kvbench task=inspect model=llama2_7b": Step(),
        "kvbench task=inspect model=gpt_oss_120b": Step(),
    },
    "sinks": {"kvbench model=tiny attention=gqa attention.sinks=true": Step(TINY)},
    "chunked": {"kvbench model=tiny attention=gqa attention.chunk=8": Step(TINY),
                "kvbench task=inspect model=llama4_scout": Step()},
    # model=small's shape, tiny's size: heads of 32 take nvfp4's blocks of 16 (tiny's 8 do not)
    "kv precision": {"kvbench model=small cache.dtype=nvfp4": Step([*TINY, "model.head_dim=32"]),
                     "kvbench task=recall model=tiny model.num_heads=4 model.preset_kv_heads=4 model.head_dim=32 "
                     "cache.dtype=nvfp4 train.steps=20 recall.seeds=2":
                         Step(["wandb=disabled", "runtime.isolate=false", "runtime.threads=1"])},
    "dsa": {"kvbench model=tiny attention=mla attention.index_topk=64": Step(TINY),
            "kvbench task=inspect model=deepseek_v32": Step()},
    "kv sharing": {"kvbench model=tiny attention=gqa attention.kv_shared_layers=1": Step(TINY),
                   "kvbench task=inspect model=gemma3n_e4b": Step()},
    "gdn": {
        "kvbench task=inspect model=qwen3_5_9b": Step(),
        "kvbench task=inspect model=qwen3_next_80b": Step(),
        "kvbench task=inspect model=qwen3_5_9b cache.dtype=int8": Step(),
        "kvbench task=inspect model=qwen3_5_9b cache.state_dtype=bfloat16": Step(),
        "kvbench model=tiny attention.full_attention_interval=2": Step(TINY),
        "kvbench task=compare model=tiny compare.variants=[gqa,gqa:d2]": Step(
            ["compare.contexts=[8,16,32]", "compare.steps=1", *QUICK]),
    },
    "slurm": {
        "kvbench -m hydra/launcher=slurm hydra.launcher.partition=gpu attention=mha,gqa,mqa "
        "workload.prompt_len=512,2048 workload.batch_size=1,8 hydra.sweep.dir=multirun/kv_sweep": Step(path="no slurm"),
    },
    "multiturn": {
        "kvbench -m model=tiny workload=multiturn attention=mha,gqa,mqa cache.shared=false,true "
        "runtime.threads=1": Step([*CHAT, "hydra.sweep.dir=multirun/chat"]),
        "kvbench model=tiny workload=multiturn cache.shared=true": Step(CHAT),
    },
    "choose": {
        # choose's model shrunk to tiny's width (2 layers of 64, not 8 of 256): 1.6x less time
        "kvbench experiment=choose": Step(["model.num_layers=2", "model.d_model=64", "model.ffn_dim=128",
                                           "capacity.context_lens=[16,32]",
                                           "capacity.max_batch=4", "workload.gen_len=2", "workload.system_len=16",
                                           "workload.user_len=4", "workload.reply_len=2", "runtime.isolate=false",
                                           "slo.tpot_x_batch1=null", "wandb=disabled",
                                           # 3 of its 5 variants: MHA, and the two beyond the article's
                                           "attention=mha,mla,choose/hybrid", "hydra.sweep.dir=multirun/choose"]),
    },
    "training": {
        TRAIN_MHA: Step(TRAIN),
        "kvbench task=eval attention=mha train.checkpoint=outputs/<date>/<time>/checkpoint.pt": Step(SMALL_TEXT),
        "kvbench task=train model=train_small data.path=/path/to/text": Step(TRAIN),
        # the README uptrains the MHA checkpoint, the chain's first (a later training's is not taken)
        "kvbench -m task=train model=train_small attention=gqa,mqa "
        "train.init_from=outputs/<date>/<time>/checkpoint.pt train.steps=0,100": Step(
            [*TRAIN[1:], "hydra.sweep.dir=multirun/uptrain"], {"train.steps=0,100": "train.steps=0,2"}),
    },
    "llama checkpoint": {
        "kvbench task=eval attention=mha train.checkpoint=/path/to/llama data.path=/path/to/text.txt": Step(SMALL_TEXT),
        "kvbench model=llama_dir model.path=/path/to/llama attention=mha": Step(
            ["workload.prompt_len=16", "workload.gen_len=2", *QUICK]),
    },
    "llama32": {
        # the worked example of "Your own checkpoint": the directory is made in this chain's cwd
        "python scripts/make_hf_dir.py --out llama32_tiny": Step(swap={"scripts/": f"{ROOT}/scripts/"}),
        "kvbench -m model=hf_dir model.path=llama32_tiny attention=gqa,mqa workload.prompt_len=128 "
        "hydra.sweep.dir=multirun/llama32": Step(["workload.gen_len=2", "runtime.isolate=false", *QUICK]),
        "kvbench -m task=eval train.checkpoint=llama32_tiny attention=gqa,mqa hydra.sweep.dir=multirun/llama32_eval":
            Step(["runtime.isolate=false", *SMALL_TEXT]),
    },
    "moe": {
        # docs/moe.md: a random GPT-OSS directory (sinks, windows, experts) benchmarked as it is
        "python scripts/make_hf_dir.py --family gpt_oss --out gpt_oss_tiny":
            Step(swap={"scripts/": f"{ROOT}/scripts/"}),
        "kvbench model=hf_dir model.path=gpt_oss_tiny workload.prompt_len=64": Step(["workload.gen_len=3", *QUICK]),
    },
    "capacity": {  # docs/capacity.md: each allocator's capacity beside the formula's, in the report
        "kvbench -m model=tiny model.num_layers=4 workload=serving workload.kv_budget_mb=2 workload.num_requests=8 "
        "attention.layer_types=[sliding_attention,full_attention,sliding_attention,full_attention],"
        "[linear_attention,sliding_attention,linear_attention,full_attention] attention.window=64 "
        "workload.allocator=per_kind,unified hydra.sweep.dir=multirun/capacity": Step(QUICK),
        "kvbench-report multirun/capacity": Step(),
    },
    "demo": {
        "kvbench -m model=tiny attention=mha,gqa,mqa workload.prompt_len=64,256 workload.batch_size=1,4 "
        "workload.gen_len=16 hydra.sweep.dir=multirun/kv_demo": Step(SWEEP, {"workload.prompt_len=64,256":
                                                                               "workload.prompt_len=16,32"}),
        "kvbench-report multirun/kv_demo": Step(),
        "kvbench-report multirun/kv_demo --out report_kv_demo --no-plots": Step(),
        # never saved from a test (a developer's own W&B login would get a workspace)
        "kvbench-dashboard multirun/kv_demo": Step(["--no-publish"]),
    },
}
RUN = {command: step for chain in CHAINS.values() for command, step in chain.items()}

# The commands of docs/slurm.md: its tests submit them to a real one-node SLURM (tests/slurm/).
SLURM_PAGE_COMMANDS = [c for c in readme_commands() if c.startswith("kvbench -m ") and (
    "hydra.launcher.partition=debug" in c or c.endswith("workload.gen_len=6 runtime.threads=1 attention=mha,mqa"))]

NOT_RUN = {
    "kvbench task=compare model=tiny compare.variants=[gqa:c8:g2,gqa:w8:g2,gqa] compare.contexts=[8,16,24]":
        "three variants timed in turn (a minute); tests/test_llama4.py reads them by compare's syntax and "
        "tests/test_layer_kinds.py round-trips the chunked label through it",
    "kvbench experiment=serving": "4 rate searches of up to 12 serving runs each (4-5 minutes on 2 vCPUs); composed "
                                  "and validated below; experiments/results/serving/ holds a run",
    "kvbench-report experiments/results/serving": "would rewrite the committed report; tests/sinks/"
                                                  "test_serving_sinks.py builds a serving report in process",
    "kvbench model=tiny workload=serving": "32 requests arriving over ~8 s of wall clock; tests/workloads/"
                                           "test_serving.py runs it in process (composed and validated below)",
    "kvbench -m model=tiny workload=serving attention=mha,gqa,mqa workload.rate=2,8,32 "
    "hydra.sweep.dir=multirun/serving": "9 such runs (a minute or more); composed and validated below",
    "kvbench -m model=tiny workload=serving attention=mha,gqa,mqa workload.search.enabled=true slo.ttft_ms=500 "
    "slo.tpot_ms=50": "3 searches of up to 10 serving runs each (minutes); composed and validated below; "
                      "tests/workloads/test_serving.py runs a search in process",
    "kvbench model=tiny workload=conversations": "16 conversations over ~30 s of wall clock; "
                                                 "tests/test_serving_conversations.py runs a smaller one in process "
                                                 "(composed and validated below)",
    "kvbench -m model=tiny workload=conversations attention=mha,mqa workload.kv_budget_mb=2,16 "
    "hydra.sweep.dir=multirun/conversations": "4 such runs (2-3 minutes); experiments/conversations_eviction.py runs "
                                              "the same jobs and committed their table",
    "kvbench model=tiny workload=conversations workload.sharegpt=docs/examples/sharegpt_sample.json "
    "workload.num_requests=4": "~15 s of think times; tests/test_hostile_conversations.py reads ShareGPT files and "
                               "plans their turns in process",
    "kvbench model=tiny workload=conversations workload.arrival=trace "
    "workload.trace=docs/examples/conversation_turns.csv": "~6 s of arrivals; tests/test_hostile_conversations.py "
                                                           "reads turn traces in process",
    "kvbench model=tiny workload=serving workload.arrival=trace workload.trace=/path/to/trace.jsonl":
        "a placeholder trace; tests/workloads/test_serving.py serves a trace file in process",
    "pip install torch==2.13.0 && pip install -c .ci/constraints.txt -e .[dev]": "installs packages: .ci/run does "
                                                                          "exactly this",
    "python -m pytest -n 3 --dist loadgroup": "the suite this test is part of",
    "kvbench experiment=recall": "7 variants trained on 4 seeds each (~20 minutes); tests/quality/test_recall.py "
                                 "trains and scores the task on a tiny model (composed and validated below)",
    "kvbench experiment=recall recall.kind=passkey recall.seeds=3": "the same preset on passkey (minutes; "
                                                                    "composed and validated below)",
    "kvbench experiment=recall recall.uptrain_steps=100 attention=gqa,mqa":
        "the converted variants' recall (minutes); tests/quality/test_recall.py runs the uptraining path",
    "kvbench experiment=recall_gpu": "sized for a GPU (composed and validated below)",
    "kvbench model=hf_dir model.path=/path/to/deepseek-v3.2": "a placeholder directory; tests/test_dsa.py loads "
                                                              "DeepseekV32ForCausalLM directories",
    "kvbench model=hf_dir model.path=/path/to/deepseek-v4": "a placeholder directory; tests/test_deepseek_v4_model.py "
                                                            "loads DeepseekV4ForCausalLM directories",
    "kvbench model=hf_dir model.path=/path/to/gemma-4": "a placeholder directory; tests/test_gemma4.py loads "
                                                        "Gemma4ForCausalLM directories",
    "kvbench model=small attention=gqa runtime.tensor_parallel=2 runtime.device=cpu":
        "two processes of model=small; tests/test_parallel_ranks.py runs two gloo ranks from the CLI",
    "kvbench model=tiny attention=gqa attention.num_kv_heads=2 attention.k_eq_v=1":
        "tests/test_layer_kinds.py runs the K=V form (its global_heads example) through bench, cache and serving",
    "kvbench task=inspect model=deepseek_v4_flash": "tests/test_deepseek_v4_presets.py composes it and checks the "
                                                    "held and read bytes the page derives by hand",
    "kvbench task=inspect model=deepseek_v4_pro": "as deepseek_v4_flash (tests/test_deepseek_v4_presets.py)",
    "kvbench task=inspect model=gemma4_31b": "tests/test_gemma4.py runs inspect on it and checks the bytes the page "
                                             "derives by hand",
    "kvbench task=inspect model=gemma4_e4b": "tests/test_gemma4.py composes it and checks its parameters and bytes",
    "kvbench task=inspect model=tiny model.num_layers=3 attention.window=6 attention.layer_types=[sliding_attention,"
    "compressed_sparse_attention,heavily_compressed_attention] +model.layer_shapes={compressed:{index_topk:2,"
    "compress_rates:{compressed_sparse_attention:4,heavily_compressed_attention:8}}}":
        "tests/test_deepseek_v4_model.py builds this model=tiny decoder of V4 layers and checks its cache against "
        "the formula inspect prints",
    "kvbench-report <sweep dir>": "a placeholder for the recall sweep's directory; the demo sweep's report runs here",
    "kvbench model=tiny attention=mla": "tests/test_mla.py runs this command end to end",
    "kvbench -m model=small attention=mha,gqa,mqa,mla": "minutes on model=small; experiments/results/mla_small.md "
                                                        "has the run (composed and validated below)",
    "kvbench experiment=layouts": "~20 minutes of model=small decode steps to 4096 tokens of context; "
                                  "tests/workloads/test_compare_layouts.py runs the first four layouts on model=tiny, "
                                  "tests/test_gpu_check_plan.py all seven, tests/test_experiment_layouts.py composes "
                                  "the preset; experiments/results/layouts_compare.md has the run",
    "kvbench experiment=layouts compare.variants=[gqa,gqa:w1024:g6,mla,mla:w1024:g6]":
        "the same preset with other variants (minutes); composed and validated below",
    "kvbench -m model=small attention=mha,gqa,mqa,mla attention.window=null,256 workload.prompt_len=512 "
    "workload.gen_len=32": "eight model=small jobs (minutes); tests/sinks/test_layout_names.py checks the eight "
                           "names side by side (composed and validated below)",
    "kvbench task=capacity model.num_layers=6 attention=mha attention.window=256 attention.global_every=6 "
    "runtime.memory_budget_gb=1 capacity.context_lens=[1024,2048]": "minutes of model=small probes; "
        "tests/workloads/test_capacity_layouts.py probes a hybrid on model=tiny (composed and validated below)",
    "kvbench -m experiment=choose attention=mha,gqa,mqa,mla": "12 capacity searches (minutes); "
        "the article table's sweep with MLA, composed and validated below",
    "kvbench -m experiment=choose attention=mha,gqa,mqa,mla attention.window=64": "12 capacity searches (minutes) "
        "with every layer local; "
        "tests/workloads/test_capacity_layouts.py probes windowed caches (composed and validated below)",
    "kvbench task=inspect model=deepseek_v3": "tests/test_mla.py runs it and checks the 70,272 bytes it prints",
    "kvbench model=hf_dir model.path=/path/to/deepseek attention=mla": "a placeholder path; tests/test_mla.py "
                                                                       "builds DeepSeek directories with transformers",
    "sudo scripts/slurm_local.sh install": "installs packages (.ci/run runs it)",
    "scripts/refresh_constraints.sh": "a fresh virtualenv and the whole suite on the latest releases (the weekly "
                                      "latest-deps workflow runs it)",
    "sudo scripts/slurm_local.sh start": "the slurm tests' fixture starts the cluster (tests/slurm/cluster.py)",
    "sinfo": "needs the cluster the slurm tests start",
    "sudo scripts/slurm_local.sh stop": "the slurm tests' fixture stops it",
    "KVBENCH_SLURM=1 python -m pytest -m slurm": "the slurm part of this suite (CI runs it)",
    **{command: "runs on the one-node SLURM in tests/slurm/test_slurm.py (marker slurm; CI runs it), which checks "
                "docs/slurm.md gives its commands" for command in SLURM_PAGE_COMMANDS},
    "kvbench experiment=ab": "minutes of model=small decode steps at 2048 tokens of context; "
                             "tests/workloads/test_compare.py runs task=compare on model=tiny",
    "python experiments/compare_transformers.py --threads 1": "minutes: model=small decode loops against "
                                                              "transformers; tests/test_experiments.py runs --out",
    "python experiments/harness_overhead.py --threads 1": "tens of seconds of model=small decode rounds",
    "kvbench -m hydra/launcher=slurm hydra.launcher.partition=gpu attention=mha,gqa,mqa "
    "workload.prompt_len=512,2048 workload.batch_size=1,8 hydra.sweep.dir=multirun/kv_sweep rerun=true":
        "the same refusal as the command without rerun=true, which runs here",
    "kvbench -m hydra/launcher=local model=tiny attention=mha,gqa,mqa hydra.sweep.dir=multirun/try_cluster":
        "three processes at once; tests/test_sweeps.py runs this launcher on model=tiny",
    "kvbench -m hydra/launcher=joblib hydra.launcher.n_jobs=4 runtime.device=cuda:free attention=mha,gqa,mqa "
    "workload.batch_size=1,8,32 hydra.sweep.dir=multirun/node_sweep": "needs 4 GPUs (scripts/gpu_check.sh runs "
                                                                      "cuda:free on a GPU machine; composed below)",
    "kvbench -m workload=multiturn cache.shared=false,true": "minutes on model=small; the next README command runs "
                                                             "the same sweep on model=tiny",
    "wandb leet inspect --summary multirun/kv_demo/0/wandb/latest-run": "needs the sweep's W&B runs (offline mode); "
                                                                        "tests/sinks/test_tracking.py reads a real "
                                                                        "offline sweep back with this command",
    "wandb login": "needs a W&B account and the network",
    "pip install -e .[search]": "installs packages: the dev extra includes it (.ci/run)",
    "kvbench experiment=search": "20 model=small trials; tests/test_sweeps.py runs the preset end to end "
                                 "on model=tiny (6 trials)",
    "kvbench task=capacity model=llama2_7b attention=mha runtime.dtype=float16 workload.gen_len=96 "
    "capacity.context_lens=[4000] slo=llama2_70b_interactive": "needs a GPU with room for Llama-2-7B's "
                                                                "13.5 GB of weights (composed and validated below)",
    "kvbench -m model=tiny attention=mha,gqa,mqa cache.dtype=auto,int8 runtime.threads=1":
        "six isolated jobs (a torch import each); tests/workloads/test_decode.py runs an int8 decode job and "
        "tests/sinks/test_compare.py the comparison of {MHA, MQA} x {auto, int8}",
    "wandb sync multirun/kv_demo/*/wandb/offline-run-*": "needs a W&B account and the network",
    "python -m pytest tests/benchmarks --benchmark-enable --benchmark-only": "times the benchmarks (minutes); "
                                                                             "the test command runs each once",
    "python -m pytest tests/benchmarks --benchmark-enable --benchmark-only --benchmark-json=bench.json":
        "times the benchmarks (minutes)",
    "python scripts/bench_gate.py --base origin/main": "6 timed pytest runs (~80 s); tests/test_bench_gate.py runs "
                                                       "a one-round gate",
    "python scripts/bench_gate.py --base HEAD --inject-slowdown 0.4": "the same; tests/test_bench_gate.py injects "
                                                                      "a slowdown and must fail",
    "python -m pytest tests/benchmarks --benchmark-enable --benchmark-only --benchmark-timer=time.process_time "
    "--benchmark-save=before": "times the benchmarks (minutes)",
    "python -m pytest tests/benchmarks --benchmark-enable --benchmark-only --benchmark-timer=time.process_time "
    "--benchmark-compare --benchmark-compare-fail=median:25%": "times the benchmarks (minutes)",
    "python experiments/step_breakdown.py --threads 1": "minutes of model=small decode rounds, by two clocks",
    "python experiments/fused_projections.py --threads 1": "minutes of interleaved model=small rounds",
    "python experiments/small_batch_gemm.py --threads 1": "a minute or two of ~300 MB matrix streams per shape",
    "scripts/gpu_check.sh": "needs an NVIDIA GPU; tests/test_gpu_check.py runs the same script with --dry-run",
    "OUT=/tmp/check scripts/gpu_check.sh --steps preflight,cuda,eager": "needs an NVIDIA GPU (the dry run covers "
                                                                        "the script)",
    "scripts/gpu_check.sh --fetch-wheels": "downloads ~28 MB of wheels from PyPI",
}


def test_every_readme_command_is_run_here_or_listed_with_why():
    commands = readme_commands()
    assert not set(RUN) & set(NOT_RUN)
    assert sorted(set(commands) - set(RUN) - set(NOT_RUN)) == [], "a README or docs command is neither run nor listed"
    assert sorted((set(RUN) | set(NOT_RUN)) - set(commands)) == [], "listed here but no longer on any page"


Ran = Dict[str, Tuple[subprocess.CompletedProcess, List[str], Path]]


def places(name: str, data: Path) -> Dict[str, str]:
    """The README's placeholder paths that chain ``name`` uses, made real under ``data``: a text
    directory, a text file, a GQA checkpoint."""
    data.mkdir()
    (data / "text").mkdir()
    (data / "text" / "a.txt").write_bytes(TEXT)
    (data / "text.txt").write_bytes(TEXT)
    found = {"/path/to/text.txt": str(data / "text.txt"), "/path/to/text": str(data / "text")}
    if any("/path/to/llama" in command for command in CHAINS[name]):
        llama, _ = llama_dir(data / "llama", num_kv_heads=2, vocab_size=256)  # a GQA checkpoint, byte vocabulary
        found["/path/to/llama"] = str(llama)
    return found


def run_chain(name: str, cwd: Path, places: Dict[str, str]) -> Ran:
    """The commands of CHAINS[name] in order, in ``cwd`` as a user's working directory (a fresh
    one per chain: two single runs started in the same second would share outputs/<date>/<time>):
    command -> (finished process, the argv that ran, its working directory)."""
    # pytest-xdist's workers export COLUMNS=80 and LINES=24: a user's pipe has neither (kvbench's
    # piped output is then 100 columns wide, which the README's examples show)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HYDRA_", "WANDB_")) and k not in ("COLUMNS", "LINES")}
    env.update(WANDB_MODE="disabled", PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    results: Ran = {}
    checkpoint = None
    for command, step in CHAINS[name].items():
        text = command
        for old, new in {**places, **step.swap}.items():
            text = text.replace(old, new)
        if "outputs/<date>/<time>/checkpoint.pt" in text:
            assert checkpoint, f"{command}: no checkpoint printed by an earlier command"
            text = text.replace("outputs/<date>/<time>/checkpoint.pt", checkpoint)
        argv = shlex.split(text) + step.extra
        start = time.perf_counter()
        proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600,
                              env={**env, "PATH": str(BIN)} if step.path == "no slurm" else env)
        print(f"{time.perf_counter() - start:6.1f} s  {command[:100]}", file=sys.stderr)
        results[command] = (proc, argv, cwd)
        # outputs/<date>/<time>/checkpoint.pt is the first training's (the MHA one the README uptrains)
        printed = re.search(r"^checkpoint: (.+)$", proc.stdout, re.M)
        checkpoint = checkpoint or (printed.group(1) if printed else None)
    return results


@pytest.fixture
def ran(request, tmp_path) -> Ran:
    """The chain a test names with ``@chain(name)``, run in a fresh working directory."""
    (tmp_path / "user").mkdir()
    return run_chain(request.param, tmp_path / "user", places(request.param, tmp_path / "data"))


def chain(name: str):
    return pytest.mark.parametrize("ran", [name], indirect=True, ids=[name.replace(" ", "_")])


def result(ran: Ran, command: str) -> subprocess.CompletedProcess:
    proc, argv, _ = ran[command]
    why = f"{shlex.join(argv)}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, why
    return proc


def records(directory: Path) -> List[dict]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*/results.json"))]


def written(proc: subprocess.CompletedProcess) -> dict:
    """The record a single run printed the path of."""
    return json.loads(Path(re.search(r"^results: (.+)$", proc.stdout, re.M).group(1)).read_text())


def comparison_rows(out: str) -> List[List[str]]:
    """The header and the cells of the last side-by-side table a sweep printed, row by row: where
    its columns did not fit the output's width it is printed as several tables, each led by the
    columns naming a row (their titles say "(continued)"), joined back here."""
    titles = [m.start() for m in re.finditer("attention variants side by side", out)]
    start = max(t for t in titles if "(continued)" not in out[t:out.index("┏", t)])
    split = lambda line: [c.strip() for c in re.split("[│┃]", line)[1:-1]]  # noqa: E731
    parts: List[List[List[str]]] = []
    text, table = "", None
    for line in out[start:].splitlines():
        if line.startswith("┏"):
            if parts and "(continued)" not in text:
                break
            table = []
        elif table is not None and line[:1] in "│┃":
            table.append(line)
        elif table is not None and line.startswith("└"):
            head = [" ".join(w for w in col if w) for col in zip(*(split(x) for x in table if x[0] == "┃"))]
            parts.append([head, *(split(x) for x in table if x[0] == "│")])
            text, table = "", None
        elif table is None:
            text += line + "\n"
    if len(parts) == 1:
        return parts[0]
    keys = next(i for i, (a, b) in enumerate(zip(parts[0][0], parts[1][0])) if a != b)
    return [row + [c for part in parts[1:] for c in part[n][keys:]] for n, row in enumerate(parts[0])]


@chain("quick start")
def test_quick_start_runs_the_default_benchmark(ran):
    out = result(ran, "kvbench").stdout
    path = Path(re.search(r"^results: (.+)$", out, re.M).group(1))
    rec = written(result(ran, "kvbench"))
    # the default layout is the model's own: model=tiny (the fast stand-in for small) is MHA
    assert rec["status"] == "ok" and rec["config"]["attention"] == {"type": "mha", "num_kv_heads": 8}
    assert rec["kv_conversion"] is None
    assert "tok/s" in out and (path.parent / "summary.md").is_file()
    assert "- `decode_vs_context.png` not drawn: needs >= 2 values" in (path.parent / "summary.md").read_text()


@chain("flagship")
def test_flagship_sweep_has_24_jobs_and_ends_with_the_variants_side_by_side(ran):
    command = next(c for c in RUN if c.startswith("kvbench -m attention=mha,gqa,mqa workload.prompt_len=512,2048"))
    out = result(ran, command).stdout
    recs = records(ran[command][2] / "multirun" / "flagship")
    assert len(recs) == 24 and {r["status"] for r in recs} == {"ok"}
    cells = {(r["config"]["attention"]["type"], r["config"]["workload"]["prompt_len"],
              r["config"]["workload"]["batch_size"], r["config"]["runtime"]["dtype"]) for r in recs}
    assert len(cells) == 24  # every point once: no job doubled by an axis decode does not read
    assert "decode: attention variants side by side, value (ratio to mha kv=8 of the same row)" in out
    header, *rows = comparison_rows(out)
    assert header == ["B", "prompt", "dtype", "metric", "mha kv=8", "gqa kv=2", "mqa kv=1"]
    kv = [row for row in rows if row[3] == "KV cache"]
    # one block per (batch, prompt, dtype); KV bytes follow the formula exactly: GQA (2 of 8 heads)
    # and MQA hold 1/4 and 1/8 of MHA's
    assert len(kv) == 8 and all(r[5].endswith("(0.250×)") and r[6].endswith("(0.125×)") for r in kv)


@chain("gdn")
def test_the_gated_deltanet_page_runs_and_its_table_is_what_inspect_prints(ran):
    """docs/layouts-gdn.md: each preset's state per sequence and per token as inspect prints them in
    its KV table (bfloat16 rows), a hybrid benchmarked, GQA compared with its hybrid."""
    for preset, per_token, state in (("qwen3_5_9b", "32.00 KiB", "49.12 MiB"),
                                     ("qwen3_next_80b", "24.00 KiB", "73.69 MiB")):
        out = result(ran, f"kvbench task=inspect model={preset}").stdout
        row = next(line for line in out.splitlines() if line.startswith("bfloat16"))
        assert row.split()[1:3] == per_token.split() and state in row, row
        page_row = next(line for line in (ROOT / "docs" / "layouts-gdn.md").read_text().splitlines()
                        if line.startswith(f"| `{preset}` |"))
        assert per_token in page_row and state in page_row, page_row
    assert written(result(ran, "kvbench model=tiny attention.full_attention_interval=2"))["status"] == "ok"
    compared = written(result(ran, "kvbench task=compare model=tiny compare.variants=[gqa,gqa:d2]"))
    assert [r["layout"] for r in compared["tables"]["compare"]] == ["gqa kv=2", "gqa kv=2 gdn 1:1"]
    lines = result(ran, "kvbench task=inspect model=qwen3_5_9b cache.dtype=int8").stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("cache.dtype=int8: "))
    rest = itertools.takewhile(lambda line: line.startswith("  "), lines[first + 1:])  # wrapped to the width
    line = " ".join([lines[first], *(part.strip() for part in rest)])
    assert line.startswith("cache.dtype=int8: layers 3, 7, 11, 15, 19, 23, 27, 31 (8 of 32) store K/V as int8 ")
    assert line.endswith("keep their state unquantized: recurrent state float32, convolution inputs float32")
    # docs/kv-precision.md: a bfloat16 state halves the recurrent part, 24 layers x 32 value heads x 128 x 128
    # (48 MiB in float32, 24 MiB) beside the convolution's 3 inputs of 8,192 channels in bfloat16 (1.125 MiB)
    out = result(ran, "kvbench task=inspect model=qwen3_5_9b cache.state_dtype=bfloat16").stdout
    row = next(line for line in out.splitlines() if line.startswith("bfloat16"))
    assert "state=bfloat16" in out and f"({24 * 2 ** 20 + 24 * 3 * 8192 * 2:,})" in row, row


@chain("kv precision")
def test_a_4bit_cache_records_the_hand_formulas_bytes_and_its_fidelity(ran):
    """docs/kv-precision.md: 2 layers x 8 KV heads x (prompt + gen) positions, K and V, each vector of 32
    values in 16 bytes of codes and 2 scale bytes."""
    rec = written(result(ran, "kvbench model=small cache.dtype=nvfp4"))
    w = rec["config"]["workload"]
    hand = 2 * 2 * 8 * (w["prompt_len"] + w["gen_len"]) * w["batch_size"] * (16 + 2)
    m = rec["metrics"]
    assert m["kv_cache_bytes"] == m["kv_cache_bytes_formula"] == hand
    assert 0 < m["kvq_max_abs_logit_diff"] < 1 and m["kvq_top1_agreement"] > 0.5
    assert m["kv_quantized_layers"].startswith("cache.dtype=nvfp4: layers 0, 1 (2 of 2) store K/V as E2M1 codes")
    recall = written(result(ran, "kvbench task=recall model=tiny model.num_heads=4 model.preset_kv_heads=4 "
                                 "model.head_dim=32 cache.dtype=nvfp4 train.steps=20 recall.seeds=2"))
    # the comment on the page: 2 layers x K,V x 4 heads x (16 bytes of codes + 2 scale bytes)
    assert recall["status"] == "ok" and recall["metrics"]["kv_bytes_per_token"] == 2 * 2 * 4 * (16 + 2) == 288


@chain("inspect")
def test_inspect_prints_the_numbers_the_readme_quotes(ran):
    result(ran, "kvbench task=inspect model=llama2_70b attention=gqa")
    result(ran, "kvbench task=inspect model=llama2_7b")  # per-token KV bytes of every KV dtype: it runs
    printed = result(ran, "kvbench task=inspect model=llama2_7b attention=mha workload.prompt_len=4000 "
                          "workload.gen_len=96 workload.batch_size=64").stdout
    assert max(len(line) for line in printed.splitlines()) <= 100  # a pipe's width: sentences wrap between words
    out = " ".join(printed.split())
    quoted = re.search(r"`(elements per layer \(K\+V\): [^`]+)`", README).group(1)
    assert quoted in out
    # and they are the article's arithmetic: 32 heads x 128 dims x 2, x 4096 positions, x 64
    per_token = 32 * 128 * 2
    assert all(f"{n:,}" in quoted for n in (per_token, per_token * 4096, per_token * 4096 * 64))
    assert ("elements per layer (K+V): per token 8,192 · per sequence (4096) 33,554,432 ≈ 33.6 M · "
            "per batch (x64) 2,147,483,648 ≈ 2.15 G") in out
    # 2 * 32 layers * 32 heads * 128 * 2 bytes = 512 KiB per token; x 4096 x 64 in float16
    assert f"{2 * 32 * 32 * 128 * 4096 * 64 * 2:,}" in out
    # cache.dtype=int8: 1-byte codes + a 4-byte scale per (sequence, head, position), K and V
    assert "int8 " in out and f"{2 * 32 * 32 * (128 + 4) * 4096 * 64:,}" in out
    assert "query head 31 → KV head 31" in out
    # inspect measures nothing: the run directory Hydra made for it (an empty log) is removed with it
    _, _, cwd = ran["kvbench task=inspect model=llama2_7b"]
    assert list(cwd.iterdir()) == []


@chain("slurm")
def test_a_slurm_sweep_without_slurm_is_one_line(ran):
    proc, argv, _ = ran[next(c for c in RUN if "hydra/launcher=slurm" in c)]
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("kvbench: invalid config: hydra/launcher=slurm: no SLURM on this machine")


@chain("training")
def test_training_prints_its_checkpoint_and_progress_eval_records_it_and_uptraining_converts_it(ran):
    """One training of the README's MHA model serves its eval and its uptraining to GQA and MQA."""
    trained = result(ran, "kvbench task=train model=train_small attention=mha runtime.threads=1")
    checkpoint = Path(re.search(r"^checkpoint: (.+)$", trained.stdout, re.M).group(1))
    assert checkpoint.is_file()
    assert "train: 2/2" in trained.stderr  # a progress line without a terminal
    train_rec = json.loads((checkpoint.parent / "results.json").read_text())
    assert "workload" not in train_rec["config"] and "cache" not in train_rec["config"]
    evaluated = written(result(ran, "kvbench task=eval attention=mha train.checkpoint=outputs/<date>/<time>/"
                                    "checkpoint.pt"))
    assert evaluated["config"]["model"] == train_rec["config"]["model"]  # the checkpoint's, which it trained
    assert evaluated["metrics"]["kv_heads_conversion"] == "none"
    assert evaluated["metrics"]["val_loss"] == pytest.approx(train_rec["metrics"]["val_loss"], rel=1e-5)
    rec = written(result(ran, "kvbench task=train model=train_small data.path=/path/to/text"))
    assert rec["status"] == "ok" and rec["config"]["data"]["path"].endswith("text")
    # the uptraining of the same chain: from the first (MHA) training's checkpoint
    command = next(c for c in RUN if "train.init_from" in c)
    assert f"train.init_from={checkpoint}" in ran[command][1]
    result(ran, command)
    recs = {(r["config"]["attention"]["type"], r["config"]["train"]["steps"]): r
            for r in records(ran[command][2] / "multirun" / "uptrain")}
    assert sorted(recs) == [("gqa", 0), ("gqa", 2), ("mqa", 0), ("mqa", 2)]
    for (kind, steps), rec in recs.items():
        m = rec["metrics"]
        assert rec["status"] == "ok" and m["init_num_kv_heads"] == 8 and m["kv_heads_conversion"] == "mean-pool"
        assert m["num_kv_heads"] == {"gqa": 2, "mqa": 1}[kind]
        if steps == 0:
            assert m["perplexity"] == m["ppl_before_uptrain"]


@chain("llama checkpoint")
def test_a_gqa_llama_checkpoint_is_evaluated_and_benchmarked_as_mha(ran):
    for command in ("kvbench task=eval attention=mha train.checkpoint=/path/to/llama data.path=/path/to/text.txt",
                    "kvbench model=llama_dir model.path=/path/to/llama attention=mha"):
        rec = written(result(ran, command))
        assert rec["status"] == "ok"
        assert rec["config"]["attention"] == {"type": "mha", "num_kv_heads": 4}
        assert (rec["config"]["model"]["num_layers"], rec["config"]["model"]["d_model"]) == (2, 32)  # not small's
        assert rec["config"]["model"]["preset_kv_heads"] == 2 and rec["metrics"]["kv_heads_conversion"] == "repeat"


@chain("llama32")
def test_the_llama32_example_benchmarks_and_evaluates_gqa_and_pooled_mqa(ran):
    """The worked example: a random Llama-3.2-shaped directory (llama3 rope scaling, 32/8 heads,
    tied) benchmarked and evaluated as its own GQA and as MQA mean-pooled from it."""
    result(ran, "python scripts/make_hf_dir.py --out llama32_tiny")
    bench = next(c for c in RUN if "multirun/llama32 " in c + " ")
    evals = next(c for c in RUN if "multirun/llama32_eval" in c)
    cwd = ran[bench][2]
    assert "gqa kv=8" in result(ran, bench).stdout and "mqa kv=1" in result(ran, bench).stdout
    for command, directory in ((bench, "llama32"), (evals, "llama32_eval")):
        result(ran, command)
        recs = records_by_kv(cwd / "multirun" / directory)
        assert sorted(recs) == [1, 8] and {r["status"] for r in recs.values()} == {"ok"}
        model = recs[8]["config"]["model"]
        shape = (model["num_layers"], model["num_heads"], model["rope_type"], model["rope_factor"])
        assert shape == (3, 32, "llama3", 32.0)
        assert recs[8]["metrics"]["kv_heads_conversion"] == "none"
        assert recs[1]["metrics"]["kv_heads_conversion"] == "mean-pool"
    perplexity = {kv: r["metrics"]["perplexity"] for kv, r in records_by_kv(cwd / "multirun" / "llama32_eval").items()}
    assert 100 < perplexity[8] < 1000 and perplexity[1] != perplexity[8]  # a random model over 256 bytes


@chain("moe")
def test_a_gpt_oss_directory_is_benchmarked_with_its_experts_routing(ran):
    """docs/moe.md's example: a random GPT-OSS directory benchmarked as GPT-OSS (sinks, its
    alternating windows, 16 experts), the bytes each step read counted from its router."""
    result(ran, "python scripts/make_hf_dir.py --family gpt_oss --out gpt_oss_tiny")
    rec = written(result(ran, "kvbench model=hf_dir model.path=gpt_oss_tiny workload.prompt_len=64"))
    assert rec["status"] == "ok" and rec["implausible"] == []
    assert rec["config"]["attention"]["sinks"] is True and rec["config"]["model"]["moe"]["num_experts"] == 16
    assert rec["series"]["routed_experts"] == [12, 12, 12]  # batch 1: 4 experts in each of 3 layers
    assert rec["metrics"]["routed_expert_bytes_per_step"] < rec["metrics"]["weight_bytes"] / 3


def records_by_kv(directory: Path) -> Dict[int, dict]:
    return {r["config"]["attention"]["num_kv_heads"]: r for r in records(directory)}


@chain("multiturn")
def test_multiturn_commands_print_their_ttft_tables(ran):
    command = next(c for c in RUN if c.startswith("kvbench -m model=tiny workload=multiturn"))
    assert "multi-turn TTFT: cache.shared=false vs true" in result(ran, command).stdout
    recs = records(ran[command][2] / "multirun" / "chat")
    assert len(recs) == 6 and all(len(r["tables"]["turns"]) == 2 for r in recs)
    single = result(ran, "kvbench model=tiny workload=multiturn cache.shared=true")
    assert "turns (cache.shared=True)" in single.stdout


@pytest.mark.parametrize("ran", ["sinks", "dsa", "kv sharing", "chunked"], indirect=True,
                         ids=["sinks", "dsa", "kv_sharing", "chunked"])
def test_the_layout_pages_commands_run_and_name_their_layout(ran):
    """docs/layouts-sinks.md, layouts-dsa.md, layouts-kv-sharing.md and layouts-chunked.md: each run is an
    ok record of the layout the page names; each inspect prints bytes per token and per sequence."""
    for command in ran:
        proc = result(ran, command)
        if "task=inspect" in command:
            assert "per token" in proc.stdout and "per sequence" in proc.stdout
            continue
        rec = written(proc)
        a = rec["config"]["attention"]
        assert rec["status"] == "ok" and (a.get("sinks") or a.get("index_topk") == 64 or a.get("kv_shared_layers") == 1
                                          or a.get("chunk") == 8)


@chain("choose")
def test_experiment_choose_prints_the_article_table_and_writes_its_plot(ran):
    proc = result(ran, "kvbench experiment=choose")
    assert "which attention to deploy" in proc.stdout and "memory tight:" in proc.stdout
    sweep = ran["kvbench experiment=choose"][2] / "multirun" / "choose"
    recs = records(sweep)
    assert [r["config"]["task"] for r in recs] == ["capacity"] * 9
    # per variant: decode at the two contexts, then the chat without and with the shared cache
    assert [(r["config"]["workload"]["name"], r["config"]["cache"].get("shared")) for r in recs[:3]] == [
        ("decode", None), ("multiturn", False), ("multiturn", True)]
    assert all(r["status"] == "ok" and len(r["tables"]["capacity"]) == (2 if i % 3 == 0 else 1)
               for i, r in enumerate(recs))
    # the console's titles; a column's header may wrap at 100 columns, the report's table has it whole
    assert "multi-turn: concurrent conversations" in proc.stdout
    assert "quality: KL vs MHA" in (sweep / "summary.md").read_text()
    # one article table whose rows are the variants, MLA and the hybrid among them
    assert proc.stdout.count("which attention to deploy") == 1
    assert [r["config"]["attention"]["type"] for r in recs[::3]] == ["mha", "mla", "gqa"]
    assert recs[6]["config"]["attention"]["window"] == 64
    assert (sweep / "capacity_vs_context.png").is_file()


@chain("capacity")
def test_the_capacity_sweep_reports_each_allocator_beside_the_formula(ran):
    """docs/capacity.md's sweep: a windowed and a Gated DeltaNet hybrid under each allocator, each
    record's reserve per sequence at least the formula's, and the report's capacity table and plot."""
    command = next(c for c in RUN if "multirun/capacity" in c and c.startswith("kvbench -m"))
    result(ran, command)
    sweep = ran[command][2] / "multirun" / "capacity"
    recs = records(sweep)
    assert [r["status"] for r in recs] == ["ok"] * 4
    assert sorted(r["metrics"]["kv_allocator"] for r in recs) == ["per_kind", "per_kind", "unified", "unified"]
    for r in recs:
        m = r["metrics"]
        assert m["kv_sequence_reserved_bytes"] >= m["kv_sequence_bytes_formula"] > 0
        assert 0 < m["kv_sequences_fit"] <= m["kv_sequences_fit_formula"]
    result(ran, "kvbench-report multirun/capacity")
    summary = (sweep / "summary.md").read_text()
    assert "## Serving capacity per layout, KV precision and allocator" in summary
    assert (sweep / "serving_capacity.png").is_file()


@chain("demo")
def test_the_demo_sweep_and_its_reports(ran):
    command = next(c for c in RUN if "multirun/kv_demo" in c and c.startswith("kvbench -m"))
    result(ran, command)
    demo = ran[command][2] / "multirun" / "kv_demo"
    assert len(records(demo)) == 12
    listed = result(ran, "kvbench-report multirun/kv_demo").stdout
    assert "12 jobs (12 ok)" in listed
    for png in ("decode_vs_context", "tokens_vs_batch", "kv_bytes_vs_heads", "kv_memory"):
        assert (demo / f"{png}.png").is_file() and f"{png}.png" in listed
    result(ran, "kvbench-report multirun/kv_demo --out report_kv_demo --no-plots")
    assert sorted(p.name for p in (ran[command][2] / "report_kv_demo").iterdir()) == ["summary.csv", "summary.md"]
    assert "workspace: multirun/kv_demo/workspace.md" in result(ran, "kvbench-dashboard multirun/kv_demo").stdout
    board = (demo / "workspace.md").read_text()
    axes = ("attention.type", "attention.num_kv_heads", "workload.batch_size", "workload.prompt_len")
    assert "Swept axes: " + ", ".join(f"`{a}`" for a in axes) + "." in board
    assert (demo / "workspace.json").is_file()


def test_the_python_example_runs_and_counts_its_tokens():
    [block] = re.findall(r"```python\n(.*?)```", README, re.S)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, "docs/multiturn.md", "exec"), {})
    lines = printed.getvalue().splitlines()
    # system prompt 16, 2 conversations, messages of 8, replies of 4: turn 1 prefills the system
    # prompt once and both messages; later turns the last reply token and the message
    P, B, U, R = 16, 2, 8, 4
    for k, line in enumerate(lines[:3], start=1):
        prefill = P + B * U if k == 1 else B * (1 + U)
        context = P + (k - 1) * (U + R) + U
        turn, prefilled, reused, _ = line.split(maxsplit=3)
        assert (int(turn), int(prefilled), int(reused)) == (k, prefill, B * context - prefill)
    assert lines[3].startswith("segment") and any(line.startswith("system") for line in lines[4:])


# The commands of NOT_RUN that start kvbench itself (for a GPU, a cluster, or minutes of CPU) are
# checked for what can be checked here: every job of the command composes and validates.
# (A placeholder such as <sweep dir> or /path/to/... names no real input.)
COMPOSED = sorted(c for c in NOT_RUN if c.startswith("kvbench ") and "<" not in c and "/path/to/" not in c)


def composed_jobs(command: str) -> List[List[str]]:
    """The overrides of each job ``command`` would run: ``-m`` dropped, every comma list of a
    sweep expanded (a bracketed list or a braced dict is one value), the jobs in Hydra's order."""
    args = [a for a in shlex.split(command)[1:] if a != "-m"]
    axes = [[f"{a.split('=', 1)[0]}={v}" for v in a.split("=", 1)[1].split(",")]
            if "=" in a and not a.split("=", 1)[1].startswith(("[", "'[", "{")) else [a] for a in args]
    return [list(job) for job in itertools.product(*axes)]


@pytest.mark.e2e
@pytest.mark.parametrize("command", COMPOSED)
def test_a_command_not_run_here_composes_and_every_job_validates(command):
    from kvbench.jobs.job_config import to_bench_config

    jobs = composed_jobs(command)
    for overrides in jobs:
        # the hydra/... overrides too (a launcher preset and its keys must exist) ...
        compose(*overrides, hydra=True)
        # ... and the job's own config types and validates, as each job does when it starts
        bench = to_bench_config(compose(*[o for o in overrides if not o.startswith("hydra")]))
        assert bench.task in ("bench", "capacity", "compare", "recall", "inspect")
    if "hydra/launcher=joblib" in command:  # the multi-GPU form: one job per GPU, each taking a free one
        assert len(jobs) == 9 and all("runtime.device=cuda:free" in job for job in jobs)
