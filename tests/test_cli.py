"""The Hydra runner end to end: every conf file composes, a real run writes a record whose
numbers check against the formula, a sweep with an invalid job finishes, Ctrl-C mid-job is
recorded as such, and the README's sweep command works as written."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LiveKvbench, compose, kvbench_forked, llama_dir
from kv_formula import kv_cache_bytes
from omegaconf import OmegaConf, open_dict

from kvbench.config.bench import CONF_DIR, BenchConfig
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.jobs.job_config import to_bench_config, unread_overrides
from kvbench.jobs.sweep import sweep_jobs, sweep_size
from kvbench.results import read_record

REPO = Path(__file__).resolve().parents[1]
TINY = ["model=tiny", "workload.prompt_len=12", "workload.gen_len=6", "runtime.warmup=1",
        "runtime.repeats=2", "wandb.mode=disabled"]
# Jobs in the test's own kvbench process: for tests that are not about process isolation
# (each isolated job costs a process start, ~3 s of importing torch).
IN_PROCESS = [*TINY, "runtime.isolate=false"]


def kvbench(*args, cwd, check=True):
    """Run the installed console script's code in a fresh interpreter, as a user would."""
    env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="0")
    proc = subprocess.run([sys.executable, "-m", "kvbench.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def group_options():
    # Nested groups too: conf/hydra/launcher/slurm.yaml is the option hydra/launcher=slurm; a
    # folder inside one of kvbench's groups is part of the option's name instead
    # (conf/attention/recall/mla.yaml is attention=recall/mla).
    for option in sorted(CONF_DIR.rglob("*.yaml")):
        if option.parent != CONF_DIR:
            group, *folders = option.parent.relative_to(CONF_DIR).parts
            if group == "hydra":
                yield "/".join([group, *folders]), option.stem
            else:
                yield group, "/".join([*folders, option.stem])


@pytest.mark.parametrize("group, option", list(group_options()))
def test_every_conf_file_composes_and_validates(group, option, tmp_path):
    hydra_node = group == "experiment" or group.startswith("hydra/")
    extra = []
    folder = option.split("/")[0] if group == "attention" and "/" in option else None
    if folder in ("choose", "recall"):  # an experiment's own variant: it names that experiment's model's layers
        extra, hydra_node = [f"experiment={folder}"], True
    if option in ("hf_dir", "llama_dir"):  # needs a checkpoint to read its shape from
        extra = [f"model.path={llama_dir(tmp_path, num_kv_heads=2)[0]}", "workload.prompt_len=16",
                 "workload.gen_len=8"]
    cfg = compose(f"{group}={option}", *extra, hydra=hydra_node)
    if group == "experiment":
        # a preset sweeps something, or compares variants in one process (it sets task, which
        # conf/config.yaml also sets: the preset comes after _self_ so its value wins)
        assert OmegaConf.select(cfg, "hydra.sweeper.params") or cfg.task == "compare", option
    if hydra_node:
        with open_dict(cfg):
            del cfg["hydra"]
    bench = to_bench_config(cfg)
    assert isinstance(bench, BenchConfig)
    assert bench.model.num_heads % bench.attention.num_kv_heads == 0


@pytest.mark.parametrize("name, published_params", [
    ("llama2_7b", 6_738_415_616), ("llama2_13b", 13_015_864_320), ("llama2_70b", 68_976_648_192),
    ("llama3_8b", 8_030_261_248), ("mistral_7b", 7_241_732_096)])
def test_preset_shapes_match_published_parameter_counts(name, published_params):
    """The true shapes: the parameter count of the preset equals the published model's."""
    from kvbench.tasks.inspect import parameter_count

    cfg = compose(f"model={name}", "attention=gqa")
    bench = to_bench_config(cfg)
    native = bench.model.preset_kv_heads
    bench.attention = AttentionConfig.for_heads(bench.model.num_heads, native)
    assert parameter_count(bench) == published_params
    assert ModelConfig(**{k: v for k, v in vars(bench.model).items()}).head_dim == 128


@pytest.mark.e2e
def test_single_run_writes_results_matching_formula(tmp_path):
    out = tmp_path / "run"
    proc = kvbench(*TINY, "attention=gqa", "attention.num_kv_heads=2", "workload.batch_size=3",
                   f"hydra.run.dir={out}", cwd=tmp_path)
    rec = json.loads((out / "results.json").read_text())
    assert rec["status"] == "ok", rec["error"]
    m = rec["metrics"]
    # tiny: 2 layers, head_dim 64/8 = 8; 2 KV heads; 12 + 6 positions; batch 3; float32
    assert m["kv_cache_bytes"] == m["kv_cache_bytes_formula"] == 2 * 2 * 2 * 8 * 18 * 3 * 4
    assert m["kv_cache_bytes"] == kv_cache_bytes(2, 2, 8, 18, 3, 4)
    assert 0 < m["decode_ms_p50"] <= m["decode_ms_p90"] <= m["decode_ms_p99"]
    assert m["prefill_ms"] > 0 and m["tokens_per_s"] > 0
    assert m["e2e_ms"] > 0  # (medians over trials of different sums: no order between them is guaranteed)
    assert len(rec["series"]["decode_ms"]) == 6
    assert m["peak_rss_bytes"] > 0 and m["nvml_device_used_bytes"] is None and m["nvml_reason"]
    assert rec["config"]["attention"]["num_kv_heads"] == 2 and rec["config"]["model"]["head_dim"] == 8
    assert rec["env"]["torch"] and rec["methods"]["decode_ms_p50"].startswith("ms")
    assert "results:" in proc.stdout and "tok/s" in proc.stdout


# The bad-input commands below, each as its own `python -m kvbench.cli` process in its own directory.
BAD_INPUT = [
    # Hydra cannot compose these: one line before any job
    (["attention=paged"], "attention=paged: no such option in attention/ (available: gqa, mha, mla, model, mqa)"),
    (["attention=null"], "attention=null: Config group override must be a string"),  # once a traceback
    (["workload=nope"], "workload=nope: no such option in workload/ (available: conversations, decode, multiturn, "
                        "serving)"),
    # a path out of the group: conf/config.yaml composed as a workload, whose error named neither (workload/slo=none)
    (["workload=../config"], "workload=../config: no such option in workload/ (a path is no option; available: "
                             "conversations, decode, multiturn, serving)"),
    (["workload=../workload/decode"], "workload=../workload/decode: no such option in workload/ (a path"),  # it ran
    (["model=/etc/passwd"], "model=/etc/passwd: no such option in model/ (a path is no option; available: "),
    (["hydra/sweeper=../config"], "hydra/sweeper=../config: no such option in hydra/sweeper/ (a path is no option; "
                                  "available: basic, optuna)"),  # it named hydra/sweeper/..=config
    (["workload.prompt_len=["], "workload.prompt_len=[: "),
    # typed before the run's directory is made: the same one line (they were once invalid records)
    (["workload.prompt_len=abc"], "workload.prompt_len='abc': Value 'abc' of type 'str'"),
    (["model=llama_dir"], "model.path=???: a value is required"),  # once: exit 0, a random model
    # a recurrent state's dtype: float32 was hard-coded; a dtype no state is held in is refused as typed
    (["cache.state_dtype=int8"], "cache.state_dtype='int8': must be one of float32, float16, bfloat16"),
]
MINE = ("name: mine\nnum_layers: 3\nd_model: 96\nnum_heads: 12\npreset_kv_heads: 12\nffn_dim: 64\nvocab_size: 50\n"
        "max_seq_len: 128\n")


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    """The short commands of this file's tests (config errors, --help, task=inspect), run once in
    one interpreter that forks a process per command (conftest.kvbench_forked): name -> (the
    finished process, its working directory)."""
    def fresh(name):  # a plain directory name (a "=" or "[" in hydra.run.dir would be Hydra syntax)
        return tmp_path_factory.mktemp(re.sub(r"[^a-z]+", "_", name))

    wanted = {}
    cwd = fresh("bad value")
    wanted["bad value"] = ([*TINY, "attention=gqa", "attention.num_kv_heads=3", f"hydra.run.dir={cwd / 'bad'}"], cwd)
    for args, _ in BAD_INPUT:
        cwd = fresh(args[0])
        wanted[f"bad input {args[0]}"] = ([*TINY, *args, f"hydra.run.dir={cwd / 'run'}"], cwd)
    cwd = fresh("help")
    (cwd / "myconf" / "model").mkdir(parents=True)
    (cwd / "myconf" / "model" / "mine.yaml").write_text(MINE)
    wanted["help"] = (["--help"], cwd)
    wanted["help mine"] = (["--config-dir", str(cwd / "myconf"), "model=mine", "task=inspect", "workload.prompt_len=8",
                            "workload.gen_len=8"], cwd)
    wanted["help cfg job"] = (["--cfg", "job", "model=llama_dir", "runtime.threads=1"], cwd)
    cwd = fresh("renamed override")
    wanted["renamed override"] = (["model.num_kv_heads=4", "task=inspect"], cwd)
    cwd = fresh("renamed yaml")
    (cwd / "model").mkdir()
    (cwd / "model" / "old.yaml").write_text("name: old\nnum_heads: 8\nnum_kv_heads: 2\n")
    wanted["renamed yaml"] = (["--config-dir", str(cwd), "model=old", "task=inspect"], cwd)
    done = kvbench_forked(wanted.values())
    return {name: (proc, cwd) for (name, (_, cwd)), proc in zip(wanted.items(), done)}


@pytest.mark.e2e
def test_single_run_with_bad_value_exits_with_one_line(commands):
    proc, tmp_path = commands["bad value"]
    out = tmp_path / "bad"
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()  # one line, as the README says, and nothing else
    assert "attention.num_kv_heads=3" in line and "model.num_heads=8" in line
    assert proc.stdout.strip() == ""
    assert not out.exists()  # checked before Hydra makes the run's directory: nothing to clean up


@pytest.mark.e2e
def test_multirun_records_invalid_and_finishes(tmp_path):
    sweep = tmp_path / "sweep"
    proc = kvbench("-m", *IN_PROCESS, "attention=gqa", "attention.num_kv_heads=2,3,4",
                   f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    statuses = {}
    for path in sorted(sweep.glob("*/results.json")):
        rec = json.loads(path.read_text())
        statuses[rec["config"]["attention"]["num_kv_heads"]] = rec["status"]
    assert statuses == {2: "ok", 3: "invalid", 4: "ok"}
    assert "2 ok, 1 invalid" in proc.stdout


@pytest.mark.parametrize("args, needle", BAD_INPUT)
@pytest.mark.e2e
def test_bad_input_exits_2_with_one_line_naming_it(commands, args, needle):
    proc, tmp_path = commands[f"bad input {args[0]}"]
    out = tmp_path / "run"
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("kvbench: invalid config: ") and needle in line, line
    assert not out.exists()  # nothing is made for a run that cannot run


@pytest.mark.e2e
def test_a_bad_value_in_a_sweep_is_that_jobs_invalid_record(tmp_path):
    """Hydra once typed every job's config before the first ran: one bad value ended the whole
    sweep, with no record. Now each job is typed when it runs."""
    sweep = tmp_path / "sweep"
    proc = kvbench("-m", *IN_PROCESS, "workload.prompt_len=12,abc,-3", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    records = {p.parent.name: json.loads(p.read_text()) for p in sweep.glob("*/results.json")}
    assert {job: r["status"] for job, r in records.items()} == {"0": "ok", "1": "invalid", "2": "invalid"}
    assert records["1"]["error"].startswith("workload.prompt_len='abc'")
    assert records["2"]["error"].startswith("workload.prompt_len=-3: must be >= 1")
    assert "1 ok, 2 invalid" in proc.stdout


# task=inspect's group map and KV arithmetic (2 * 32 * 32 * 128 * 4096 * 64 * 2 bytes ...) end to end:
# tests/test_readme.py::test_inspect_prints_the_numbers_the_readme_quotes runs the README's same command.


@pytest.mark.e2e
def test_help_lists_groups_and_user_config_dir(commands):
    def ok(name):
        proc, _ = commands[name]
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc

    help_text = ok("help").stdout
    for group in ("model", "attention", "workload", "cache", "runtime", "wandb", "experiment"):
        assert f"{group}:" in help_text
    out = ok("help mine").stdout
    assert "model mine: 3 layers" in out and "12 query heads" in out and "12 KV heads" in out  # its own layout
    # --cfg job: what the YAML files and the command line set (plain values; typed per job)
    job = ok("help cfg job").stdout
    assert "name: llama_dir" in job and "path: ???" in job and "threads: 1" in job and "max_bytes: 4000000" in job


@pytest.mark.e2e
@pytest.mark.parametrize("where", ["override", "yaml"])
def test_the_renamed_preset_kv_heads_key_fails_with_a_one_line_hint(commands, where):
    """model.num_kv_heads became model.preset_kv_heads: the old spelling, on the command line or
    in a user's own model file, exits 2 with one line naming the new key."""
    proc, _ = commands[f"renamed {where}"]
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert "model.num_kv_heads" in line and "model.preset_kv_heads" in line and "attention.num_kv_heads" in line


def test_sweep_size_counts_cli_and_preset_axes():
    cfg = compose("experiment=long_context", hydra=True)
    cfg.hydra.overrides.task = ["experiment=long_context", "workload.batch_size=1,8"]
    assert sweep_size(cfg) == 3 * 3 * 2


@pytest.mark.e2e
def test_the_readme_sweep_command_composes_48_valid_jobs_and_results_land_where_it_says(tmp_path):
    """The README's headline sweep, as written: every key exists, every one of its 48 jobs
    validates; and a multirun without hydra.sweep.dir writes multirun/<date>/<time>/<job>/, as
    docs/sweeps.md says."""
    readme = (REPO / "README.md").read_text()
    [command] = re.findall(r"^kvbench -m attention=mha,gqa,mqa .*$", readme, flags=re.M)
    assert command in (REPO / "docs" / "sweeps.md").read_text()  # the same command as the guide's
    overrides = shlex.split(command)[2:]
    cfg = compose(*[o.split(",")[0] for o in overrides], hydra=True)
    cfg.hydra.overrides.task = overrides
    jobs = sweep_jobs(cfg)
    assert len(jobs) == 24 == 3 * 2 * 2 * 2  # the count the README states
    for job in jobs:
        bench = to_bench_config(compose(*job.overrides))
        assert bench.workload.total_len <= bench.model.max_seq_len
    assert "multirun/<date>/<time>/<job number>/results.json" in (REPO / "docs" / "sweeps.md").read_text()
    assert "cache.shared" not in command  # it would run every decode job twice
    kvbench("-m", *IN_PROCESS, "attention=gqa", cwd=tmp_path)
    [record] = (tmp_path / "multirun").glob("*/*/*/results.json")
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}/\d{2}-\d{2}-\d{2}/0/results.json",
                        record.relative_to(tmp_path / "multirun").as_posix())
    assert read_record(record).status == "ok"


@pytest.mark.e2e
def test_ctrl_c_during_the_trials_records_interrupted_and_exits_130(tmp_path):
    """A real SIGINT to a running kvbench (as Ctrl-C sends it) while its job is inside the
    timed trials: the record says interrupted and keeps what was complete, the measuring child
    is gone, exit 130. (Before: the runner missed KeyboardInterrupt and wrote "ok".)"""
    out = tmp_path / "run"
    run = LiveKvbench("model=tiny", "workload.prompt_len=12", "workload.gen_len=6", "runtime.warmup=0",
                      "runtime.repeats=100000", "runtime.threads=1", "wandb.mode=disabled", f"hydra.run.dir={out}",
                      cwd=tmp_path)
    run.wait_for(r": 0/100000$")
    child = run.job_process()
    run.proc.send_signal(signal.SIGINT)  # to kvbench only: it must pass it on to its job's process
    assert run.finish() == 130, run.output
    assert not child.is_running()
    rec = read_record(out)
    assert rec.status == "interrupted" and "SIGINT" in rec.error, rec.error
    m = rec.metrics
    # what was complete before the trials stays; no latency from a partial set of trials
    assert m["kv_cache_bytes_formula"] == kv_cache_bytes(2, 8, 8, 18, 1, 4) and m["weight_bytes"] > 0  # tiny: MHA
    assert "decode_ms_p50" not in m and "prefill_ms" not in m
    assert run.err_lines[-1] == "kvbench: interrupted by SIGINT" and "Traceback" not in run.stderr
    assert "interrupted" in run.stdout  # the run's table is printed


@pytest.mark.e2e
def test_a_record_the_disk_refuses_is_printed_as_json_in_one_line(tmp_path):
    """The final write fails (here the kernel refuses to grow a file past RLIMIT_FSIZE: EFBIG;
    a full disk, ENOSPC, takes the same path): one line says so, the record follows on stderr
    as one line of JSON, no traceback, exit 1. Hydra's own files (< 8 KiB: hydra.yaml holds the
    help text) still fit; results.json (~25 KiB) does not."""
    import resource

    out = tmp_path / "run"
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (12288, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="0")
    proc = subprocess.run([sys.executable, "-m", "kvbench.cli", *TINY, f"hydra.run.dir={out}"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300, preexec_fn=limit)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert not (out / "results.json").exists() and not list(out.glob(".results.json.*"))
    lines = proc.stderr.strip().splitlines()
    [said] = [i for i, line in enumerate(lines) if "cannot write" in line]
    assert lines[said] == (f"kvbench: cannot write {out / 'results.json'}: File too large; "
                           "the record follows on stderr as JSON")
    record = json.loads(lines[said + 1])
    assert record["status"] == "ok" and record["metrics"]["decode_ms_p50"] > 0
    assert "Traceback" not in proc.stderr


@pytest.mark.e2e
def test_a_job_returns_its_objective_read_from_the_record_its_own_process_wrote(tmp_path, monkeypatch):
    """runtime.isolate=true (the default): the job runs in a child process, and what the Hydra
    task function returns is that child's results.json's metric; a resumed job (already ok)
    returns the same value from disk without running again."""
    from kvbench import cli_job
    from kvbench.jobs import runner

    cfg = compose(*TINY, "runtime.fidelity=false", "objective=-decode_ms_p50")
    assert cfg.runtime.isolate is True
    monkeypatch.setattr(cli_job, "_job_context", lambda: (tmp_path, False, [], None))

    def not_here(*args, **kwargs):
        raise AssertionError("the job ran in the test's own process")

    monkeypatch.setattr(runner, "run_job", not_here)  # this process's copy; the child imports its own
    value = cli_job.hydra_job(cfg)
    record = read_record(tmp_path)
    assert record.status == "ok", record.error
    assert value == -record.metrics["decode_ms_p50"]
    # The same job again in a multirun: skipped as done, its objective still comes back.
    monkeypatch.setattr(cli_job, "_job_context", lambda: (tmp_path, True, [], 0))
    before = (tmp_path / "results.json").read_bytes()
    assert cli_job.hydra_job(cfg) == value and (tmp_path / "results.json").read_bytes() == before
    # No objective (a grid sweep): nothing is returned.
    grid = compose(*TINY, "runtime.fidelity=false")
    assert cli_job.hydra_job(grid) is None


def count_config_work(monkeypatch):
    """How often a job's config is typed (BenchConfig.__post_init__: its checks and rules) and its
    attention resolved against the model (a Decoder's own check of what it is built with aside)."""
    calls = {"typed": 0, "resolved": 0}
    post_init, resolved = BenchConfig.__post_init__, AttentionConfig.resolved

    def typed(self):
        calls["typed"] += 1
        post_init(self)

    def resolving(self, model):
        calls["resolved"] += sys._getframe(1).f_code.co_name != "__init__"  # Decoder.__init__
        return resolved(self, model)

    monkeypatch.setattr(BenchConfig, "__post_init__", typed)
    monkeypatch.setattr(AttentionConfig, "resolved", resolving)
    return calls


def test_a_jobs_config_is_typed_once_and_handed_on(tmp_path, monkeypatch):
    """Typed where the job first needs it (a single run: before Hydra makes its directory; a job
    of a sweep: resume's check), then handed on: the run, its record and its objective take that
    one typed config (each typed it again: three times a job, ~0.1 s each)."""
    from kvbench import cli_job, cli_sweep

    calls = count_config_work(monkeypatch)
    args = [*IN_PROCESS, "runtime.fidelity=false", "objective=tokens_per_s"]
    full = compose(*args, f"hydra.run.dir={tmp_path / 'run'}", hydra=True)
    cli_sweep.check_run_start(full)
    monkeypatch.setattr(cli_job, "_job_context", lambda: (tmp_path / "run", False, [], None))
    assert cli_job.hydra_job(compose(*args)) == read_record(tmp_path / "run").metrics["tokens_per_s"]
    assert calls == {"typed": 1, "resolved": 1}
    for _ in range(2):  # a job of a sweep, then the same job again (resumed: done already)
        calls.update(typed=0, resolved=0)
        monkeypatch.setattr(cli_job, "_job_context", lambda: (tmp_path / "0", True, [], 0))
        assert cli_job.hydra_job(compose(*args)) == read_record(tmp_path / "0").metrics["tokens_per_s"]
        assert calls == {"typed": 1, "resolved": 1}


def test_a_command_line_value_the_task_does_not_read_is_said_in_one_line():
    """task=capacity searches capacity.context_lens: workload.prompt_len=256 on its command line changed
    nothing and said nothing (issue 59's own timing command carried it). Each such key=value is one line;
    group choices, model keys and keys the task reads are not."""
    overrides = ["attention=mqa", "model.num_layers=2", "workload.prompt_len=256", "runtime.threads=2",
                 "+capacity.context_lens=[256]", "compare.contexts=[64]", "wandb.mode=disabled",
                 "objective_caps.kv_cache_bytes=1", "hydra.job.chdir=false"]
    capacity = to_bench_config(compose("model=tiny", "task=capacity"))
    assert unread_overrides(capacity, overrides) == [
        "workload.prompt_len=256: task=capacity does not read it, so it changes nothing (its contexts are "
        "capacity.context_lens)",
        "compare.contexts=[64]: task=capacity does not read it, so it changes nothing"]
    bench = to_bench_config(compose("model=tiny"))
    assert [line.split(":")[0] for line in unread_overrides(bench, overrides)] == [
        "capacity.context_lens=[256]", "compare.contexts=[64]"]
