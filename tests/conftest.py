import copy
import logging
import multiprocessing.util
import os
import shlex
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import forked_cli
import hydra_files
import pytest
import torch
from forked_cli import kvbench_forked  # noqa: F401 — the tests import it from here
from joblib.externals.loky.backend import fork_exec as loky_fork_exec
from omegaconf import DictConfig

from kvbench.config.bench import register_configs
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.model import Decoder

# A shell starts a background job (`pytest ... &`, nohup, some CI runners) with SIGINT ignored, and
# an ignored signal stays ignored across exec: every kvbench a test starts would then ignore the
# Ctrl-C the test sends it, and the Ctrl-C tests would wait for a process that never stops. The
# suite runs kvbench as a person at a terminal would, with SIGINT delivered: caught here, so
# each child starts with the default disposition (and Python's KeyboardInterrupt).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# nohup does the same to SIGHUP, which the closed-terminal tests send.
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)

# The signals kvbench takes as "stop": a test that runs kvbench's code in this process may leave one
# ignored or handled, and every kvbench a later test starts would inherit an ignored one.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


@pytest.fixture(autouse=True)
def _restore_stop_signals():
    before = {signum: signal.getsignal(signum) for signum in _STOP_SIGNALS}
    yield
    for signum, handler in before.items():
        if handler is not None and signal.getsignal(signum) is not handler:  # None: not set from Python
            signal.signal(signum, handler)

# Tests compose configs with Hydra's compose API: the schema must be in the ConfigStore.
register_configs()
hydra_files.install()  # a conf file's parse kept by its bytes (tests/hydra_files.py)
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


# What compose made, by its overrides: a compose costs ~0.1 s of CPU (Hydra reads and merges conf/
# again each time) and ~250 tests compose, many the same overrides; a deep copy costs ~5 ms. conf/
# and the ConfigStore do not change during a session, and every interpolation (the run directory's
# ${now:...}, the attention type) resolves when read, not here, so a copy is what a compose would give.
_COMPOSED: dict = {}


def compose(*overrides: str, hydra: bool = False) -> DictConfig:
    """conf/config.yaml with ``overrides``, composed as the CLI composes it; ``hydra``: with the
    ``hydra`` node too (what a sweep's callbacks read). The one helper for every test. Each call
    returns its own copy: a test that edits its config cannot change another's."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    if hydra:  # the hydra node holds this process's cwd and the time: composed fresh each call
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose("config", overrides=list(overrides), return_hydra_config=True)
    if overrides not in _COMPOSED:  # a bad override raises here each time and is not kept
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            _COMPOSED[overrides] = hydra_compose("config", overrides=list(overrides))
    return copy.deepcopy(_COMPOSED[overrides])

# The one-node SLURM of the tests marked slurm, and whether they run (tests/slurm/cluster.py); the
# order of the suite and how -n N --dist loadgroup spreads it (tests/suite_order.py); --cpu-times,
# each test's CPU seconds (tests/cpu_time.py).
pytest_plugins = ["slurm.cluster", "suite_order", "cpu_time"]


def tiny_model_config(**overrides) -> ModelConfig:
    """A decoder small enough for exact CPU tests in milliseconds."""
    fields = dict(name="test", num_layers=2, d_model=64, num_heads=8, preset_kv_heads=8, ffn_dim=96,
                  vocab_size=97, max_seq_len=64)
    fields.update(overrides)
    return ModelConfig(**fields)


# The benchmarks' decoder (tests/benchmarks/benchkit.py). Tests that compile the fixed-shape step
# use it with a batch of 2 and a cache of 129 positions, the benchmark's shapes, so that inductor's
# cache compiles that graph once for all of them (a compile costs 10-60 s on 2 shared cores).
BENCH_SHAPE = dict(d_model=128, ffn_dim=352, vocab_size=512, max_seq_len=512)
BENCH_OVERRIDES = ["model=tiny", "model.d_model=128", "model.ffn_dim=352", "model.vocab_size=512",
                   "model.max_seq_len=512", "workload.batch_size=2", "runtime.threads=1"]


def make_decoder(num_kv_heads: int = 8, seed: int = 0, dtype=torch.float32, **overrides) -> Decoder:
    torch.manual_seed(seed)
    cfg = tiny_model_config(**overrides)
    return Decoder(cfg, AttentionConfig.for_heads(cfg.num_heads, num_kv_heads)).to(dtype).eval()


# A small text corpus for the quality tests: Python-like bytes, a few KB.
TEXT = (b"def add(a, b):\n    return a + b\n\n" b"class Point:\n    x: int = 0\n    y: int = 0\n\n") * 40


@pytest.fixture
def corpus(tmp_path):
    """A directory of two text files (read in sorted order) and a binary file (skipped)."""
    (tmp_path / "b.txt").write_bytes(TEXT[: len(TEXT) // 2])
    (tmp_path / "a.txt").write_bytes(TEXT[len(TEXT) // 2:])
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01binary")
    return tmp_path


def byte_decoder(num_kv_heads=4, seed=0) -> Decoder:
    """A 1-layer byte-level decoder with 4 query heads (MHA 4, GQA 2, MQA 1)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(num_layers=1, d_model=32, num_heads=4, preset_kv_heads=4, ffn_dim=64,
                      vocab_size=256, max_seq_len=64)
    return Decoder(cfg, AttentionConfig.for_heads(4, num_kv_heads))


@pytest.fixture
def quiet_transformers():
    """transformers' warnings off for a test (that an optional kernel package is not installed and it
    falls back to the torch path compared with, or that a batch has no attention mask: it is not padded)."""
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test, restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


@pytest.fixture
def scripted_clock(monkeypatch):
    """The serving scheduler's wall clock replaced by the scripted one (10 ms an iteration, 0.1 ms a
    prefilled token, 1 ms a decoded sequence), for a test whose assertion depends on which requests
    have arrived by which iteration: on the wall clock a loaded machine changes that (a first iteration
    late enough admits every request at once, and none finds a prefix the others cached)."""
    from kvbench.serving import scheduler

    monkeypatch.setattr(scheduler, "WallClock", lambda: scheduler.FakeClock(0.01, 1e-4, 1e-3))


# What makes a test ``e2e`` (pyproject.toml): a fresh interpreter costs ~3 s of importing torch
# before any work, an Inductor compile 10-60 s on 2 shared cores. A test not marked e2e that does
# either fails here, naming the marker, so that `-m "not e2e"` stays the fast loop it says it is.
BIN = Path(sys.executable).parent  # the console scripts kvbench, kvbench-report, wandb, ...
E2E = "starts {what}: mark the test @pytest.mark.e2e (the inner loop, -m 'not e2e', runs none)"


def _starts_an_interpreter(argv) -> bool:
    program = Path(shlex.split(argv)[0] if isinstance(argv, str) else os.fspath(list(argv)[0]))
    if program.name.startswith("python") or program.name in ("bash", "sh"):
        return True
    if program.parent == BIN and program.is_file():  # a console script (kvbench, wandb), not ruff's binary
        head = program.read_bytes()[:200]
        return head.startswith(b"#!") and b"python" in head.split(b"\n")[0]
    return program.resolve() == Path(sys.executable).resolve()


@pytest.fixture(autouse=True)
def _unit_tests_stay_in_process(request, monkeypatch):
    if request.node.get_closest_marker("e2e") is not None:
        return
    popen_init = subprocess.Popen.__init__

    def popen(self, args, *rest, **kwargs):
        if _starts_an_interpreter(args):
            self._child_created = False  # what Popen.__del__ reads of a Popen that never started
            raise AssertionError(E2E.format(what=f"an interpreter ({args if isinstance(args, str) else args[0]})"))
        popen_init(self, args, *rest, **kwargs)

    def compile_(*args, **kwargs):
        raise AssertionError(E2E.format(what="a torch.compile"))

    def spawn(*args, **kwargs):  # multiprocessing's spawn and forkserver, joblib's loky workers
        raise AssertionError(E2E.format(what="a worker process (a fresh interpreter)"))

    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", spawn)
    monkeypatch.setattr(loky_fork_exec, "fork_exec", spawn)
    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(forked_cli, "REFUSE", E2E.format(what="kvbench (conftest.kvbench_forked)"))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip where torch sees no GPU (CI, this machine); the GPU check runs
    them. (The suite's order and its spread over -n workers: tests/suite_order.py.)"""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (runs in scripts/gpu_check.sh)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


VOCAB = 97


# transformers' (config, model) classes of each accepted family, as its save_pretrained writes them.
HF_FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
               "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
               "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
               "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM")}
# A tiny dense DeepSeek attention (every layer's MLP dense: first_k_dense_replace >= the 2 layers).
DEEPSEEK_SHAPE = dict(q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
                      first_k_dense_replace=2, n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2)


def deepseek_dir(tmp_path, family="deepseek_v3", tie=False, **overrides):
    """A tiny random dense DeepSeek-V2/V3 (multi-head latent attention) saved with save_pretrained."""
    return hf_dir(tmp_path, 4, tie, family, **{**DEEPSEEK_SHAPE, **overrides})


def hf_dir(tmp_path, num_kv_heads, tie=False, family="llama", **overrides):
    """A tiny random transformers model of ``family`` saved with save_pretrained; returns
    (dir, hf model). Norm weights and biases are randomised (transformers starts them at 1 and 0,
    where a missing or misplaced one would not show)."""
    import transformers

    config_class, model_class = (getattr(transformers, name) for name in HF_FAMILIES[family])
    torch.manual_seed(0)
    shape = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=num_kv_heads,
                 intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=64, rope_theta=500.0,
                 rms_norm_eps=1e-5, tie_word_embeddings=tie)
    if family == "qwen3":
        shape["head_dim"] = 8  # Qwen3Config's default is 128, not hidden_size // heads
    cfg = config_class(**{**shape, **overrides})
    cfg._attn_implementation = "eager"
    hf = model_class(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    hf.save_pretrained(tmp_path)
    return tmp_path, hf


def eval_job(model: ModelConfig, attention: AttentionConfig, corpus, checkpoint, val_fraction=0.2, seq_len=32,
             batch_size=4):
    """A task=eval job of ``checkpoint`` on the byte corpus: two batches of ``seq_len`` slices."""
    from kvbench.config.bench import BenchConfig, CacheConfig, DataConfig, RuntimeConfig, TrainConfig, WandbConfig
    from kvbench.config.workload import DecodeWorkload
    from kvbench.jobs.job_config import check_job

    return check_job(BenchConfig(
        task="eval", model=model, attention=attention, workload=DecodeWorkload(prompt_len=8, gen_len=8),
        cache=CacheConfig(), runtime=RuntimeConfig(device="cpu"), wandb=WandbConfig(mode="disabled"),
        data=DataConfig(path=str(corpus), val_fraction=val_fraction),
        train=TrainConfig(batch_size=batch_size, seq_len=seq_len, eval_batches=2, checkpoint=str(checkpoint))))


def transformers_perplexity(hf, cfg) -> float:
    """Perplexity of transformers' ``hf`` on the validation slices task=eval of ``cfg`` scores."""
    import math

    import torch.nn.functional as F

    from kvbench.quality.data import byte_data, eval_starts

    val, T = byte_data(cfg.data).val, cfg.train.seq_len
    slices = val[eval_starts(len(val), T, cfg.train.eval_batches * cfg.train.batch_size)[:, None]
                  + torch.arange(T + 1)]
    with torch.no_grad():
        logits = hf(slices[:, :-1]).logits
    return math.exp(F.cross_entropy(logits.flatten(0, 1), slices[:, 1:].flatten()).item())


def edit_config_json(path, drop=(), **changes):
    """The config.json in ``path`` with the keys ``drop`` left out and ``changes`` set, as a person or
    an older exporter would write it (save_pretrained writes every key)."""
    import json

    cfg = {k: v for k, v in json.loads((path / "config.json").read_text()).items() if k not in drop}
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))


def reread(path):
    """transformers' own reading of the checkpoint directory ``path`` (its config.json as it is now)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def llama_dir(tmp_path, num_kv_heads, tie=False, **overrides):
    """A tiny random LlamaForCausalLM saved with save_pretrained; returns (dir, hf model)."""
    return hf_dir(tmp_path, num_kv_heads, tie, "llama", **overrides)


def job_processes(pid: int):
    """The processes measuring a job that the kvbench process ``pid`` started: forked by its fork
    server (named kvbench-job), or new interpreters running child_main (KVBENCH_FORK_SERVER=0)."""
    import psutil

    found = []
    for proc in psutil.Process(pid).children(recursive=True):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:  # ended: its server reaps it as the next request comes
                continue
            if proc.name() == "kvbench-job" or "child_main" in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found


# Processes a test started that must not outlive it: a test that fails while one runs (a timeout
# under load) would otherwise leave it measuring for hours, slowing every later test.
_STARTED: list = []


def reap_after_test(proc):
    """Kill ``proc`` (a Popen) and every process under it when the test ends, if it still runs."""
    _STARTED.append(proc)
    return proc


@pytest.fixture(autouse=True)
def _reap_started_processes():
    yield
    import psutil

    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is not None:
            continue
        try:
            top = psutil.Process(proc.pid)
            tree = [*top.children(recursive=True), top]
        except psutil.NoSuchProcess:  # it ended meanwhile
            tree = []
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait()


class LiveKvbench:
    """A ``python -m kvbench.cli ...`` process driven by a test: its stderr is read as it runs,
    so a test can wait for a line (``  mha kv=8: 0/1000`` when a job's trials start, since
    stderr is not a terminal) and then signal it mid-job, as a person or a scheduler would."""

    def __init__(self, *args, cwd, env=None, start_new_session=False):
        import os
        import subprocess
        import sys
        import threading

        env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="0", **(env or {}))
        self.proc = subprocess.Popen([sys.executable, "-m", "kvbench.cli", *args], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=start_new_session)
        reap_after_test(self.proc)
        self.pid = self.proc.pid
        self.err_lines, self.out_lines = [], []
        self._readers = [threading.Thread(target=self._read, args=(s, lines), daemon=True)
                         for s, lines in ((self.proc.stderr, self.err_lines), (self.proc.stdout, self.out_lines))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, lines):
        for line in stream:
            lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float = 180.0) -> str:
        """The first stderr line matching ``pattern``; fails if the process ends or time runs out."""
        import re
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.err_lines):
                if re.search(pattern, line):
                    return line
            if self.proc.poll() is not None and not self._readers[0].is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"no stderr line matching {pattern!r}; exit {self.proc.poll()}\n" + self.output)

    def job_process(self):
        """The process measuring the current job (runtime.isolate=true)."""
        children = job_processes(self.pid)
        assert len(children) == 1, children
        return children[0]

    def finish(self, timeout: float = 180.0) -> int:
        code = self.proc.wait(timeout)
        for reader in self._readers:
            reader.join(10)
        return code

    @property
    def stdout(self) -> str:
        return "\n".join(self.out_lines)

    @property
    def stderr(self) -> str:
        return "\n".join(self.err_lines)

    @property
    def output(self) -> str:
        return self.stdout + "\n" + self.stderr


def call_with_timeout(fn, timeout=120):
    """``fn()`` in a daemon thread: a call that blocks forever (a read from a FIFO) fails the
    test instead of hanging the suite. Returns fn's value or raises its exception."""
    out = {}

    def call():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 — handed to the test's thread
            out["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} blocked for {timeout} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


@contextmanager
def saved_figures():
    """Every matplotlib Figure saved inside the block, in order (a spy around Figure.savefig)."""
    from matplotlib.figure import Figure  # only the plot tests need matplotlib

    saved = []
    original = Figure.savefig

    def spy(fig, *args, **kwargs):
        saved.append(fig)
        return original(fig, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Figure, "savefig", spy)
        yield saved


