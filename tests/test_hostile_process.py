"""Hostile input to kvbench as a process: signals at any moment (a closed terminal's SIGHUP, a
second Ctrl-C while it exits), a disk that refuses a write, two sweeps started at once into one
directory, a job directory it may not read, and the cost of starting a job's process."""

import copy
import errno
import functools
import os
import pty
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import LiveKvbench, compose, job_processes, reap_after_test

from kvbench.cli_sweep import check_sweep_start
from kvbench.core.errors import ConfigError
from kvbench.results import RunResult, read_record

TRIALS = ["model=tiny", "workload.prompt_len=12", "workload.gen_len=6", "runtime.warmup=0", "runtime.repeats=100000",
          "runtime.threads=1", "wandb.mode=disabled"]


# ---- signals ---------------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.parametrize("isolate", ["true", "false"])
def test_sighup_to_the_process_group_records_interrupted_and_exits_129(tmp_path, isolate):
    """SIGHUP to every process of kvbench's group, as the kernel sends it when the terminal closes:
    the job is recorded interrupted with what was complete, one line, exit 128 + 1. (Before: both
    processes died on the spot; no record, no line, exit -1.)"""
    out = tmp_path / "run"
    run = LiveKvbench(*TRIALS, f"runtime.isolate={isolate}", f"hydra.run.dir={out}", cwd=tmp_path,
                      start_new_session=True)
    run.wait_for(r": 0/100000$")
    measuring = job_processes(run.pid)
    assert len(measuring) == (isolate == "true")
    os.killpg(run.pid, signal.SIGHUP)
    assert run.finish() == 129, run.output
    rec = read_record(out)
    assert rec.status == "interrupted" and rec.error == "interrupted by SIGHUP", rec.error
    assert rec.metrics["weight_bytes"] > 0 and "decode_ms_p50" not in rec.metrics
    assert run.err_lines[-1] == "kvbench: interrupted by SIGHUP" and "Traceback" not in run.stderr
    assert not any(p.is_running() and p.status() != "zombie" for p in measuring)


@pytest.mark.e2e
def test_a_closed_terminal_leaves_an_interrupted_record_and_exit_129(tmp_path):
    """kvbench on a real terminal (a pty, its controlling terminal) that is then closed: the kernel
    hangs it up and signals the foreground group. The record is written although nothing can be
    printed any more (a write to a hung-up terminal fails with EIO), and kvbench exits 129."""
    out = tmp_path / "run"
    master, slave = pty.openpty()
    env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="0")

    def controlling_terminal():
        os.setsid()
        import fcntl
        import termios
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen([sys.executable, "-m", "kvbench.cli", *TRIALS, f"hydra.run.dir={out}"], cwd=tmp_path,
                            env=env, stdin=slave, stdout=slave, stderr=slave, preexec_fn=controlling_terminal)
    reap_after_test(proc)
    os.close(slave)
    seen, deadline = b"", time.monotonic() + 180
    while b" 0/100000" not in seen:  # the progress bar a terminal gets: the trials have started
        assert time.monotonic() < deadline and proc.poll() is None, seen[-500:].decode(errors="replace")
        try:
            seen += os.read(master, 4096)
        except OSError:
            break
    os.close(master)  # the terminal goes away
    assert proc.wait(120) == 129
    rec = read_record(out)
    assert rec.status == "interrupted" and rec.error == "interrupted by SIGHUP", rec.error
    assert rec.metrics["weight_bytes"] > 0


EXIT_HOOK_SIGNALS = """
import atexit, os, signal, sys, time
from kvbench import entry
# What a person's second Ctrl-C (or a parent passing its signal on) does while the interpreter runs
# an exit hook: registered as kvbench starts, as W&B's teardown and torch's finalizers are, or
# before kvbench, so that it runs after all of kvbench's.
signal_then_wait = lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(5))
if sys.argv[1] == "after kvbench's hooks":
    atexit.register(signal_then_wait)
else:
    register, hooked = atexit.register, []
    def register_and_hook(func, *args, **kwargs):  # the hook right after kvbench's first: it runs before
        register(func, *args, **kwargs)
        if not hooked:
            hooked.append(register(signal_then_wait))
        return func
    atexit.register = register_and_hook
sys.argv = ["kvbench", *sys.argv[2:]]
entry.main()
"""


@pytest.mark.e2e
@pytest.mark.parametrize("args, code", [(["--cfg", "job"], 0), (["model.nme=1"], 2)])
@pytest.mark.parametrize("when", ["in an exit hook", "after kvbench's hooks"])
def test_a_signal_while_kvbench_exits_is_one_line_or_nothing_never_a_traceback(tmp_path, args, code, when):
    """A SIGINT inside an exit hook (a job's process interrupted while importing torch exited 130,
    and the parent's forwarded SIGINT reached it in torch's finalizers: 7 lines of traceback) is
    one line and 128 + the signal; after kvbench's last hook, in the interpreter's own teardown
    (where the default handler would kill it without a word), it is ignored: the run's own code."""
    proc = subprocess.run([sys.executable, "-c", EXIT_HOOK_SIGNALS, when, *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, WANDB_MODE="disabled"))
    assert "Traceback" not in proc.stderr
    if when == "in an exit hook":
        assert proc.returncode == 130, proc.stderr
        assert proc.stderr.splitlines()[-1] == "kvbench: interrupted by SIGINT"
    else:
        assert proc.returncode == code, proc.stderr
        assert "interrupted" not in proc.stderr


# ---- a config that cannot run: refused before anything is made or imported ------------------

# kvbench as its console script runs it, saying at exit whether torch was ever imported.
TORCH_AT_EXIT = """
import atexit, sys
atexit.register(lambda: print("torch imported:", "torch" in sys.modules, file=sys.stderr))
sys.argv = ["kvbench", *sys.argv[1:]]
from kvbench.entry import main
main()
"""


@pytest.mark.e2e
@pytest.mark.parametrize("override, line", [
    ("model.nme=x", "model.nme='x': unknown key (did you mean model.name?)"),
    ("model.name=${oops}", "model.name='${oops}': Interpolation key 'oops' not found"),
    ("workload.prompt_len=abc", "workload.prompt_len='abc': Value 'abc' of type 'str'"),
    ("runtime.threads=-1", "runtime.threads=-1"),
])
@pytest.mark.parametrize("task", ["bench", "inspect"])
def test_a_config_that_cannot_run_is_one_line_before_any_directory_or_torch(tmp_path, override, line, task):
    """A misspelled key, an interpolation to nothing, a wrong type, a value out of range: one line
    naming the key, exit 2, no outputs/ directory and no torch imported. (Before: the misspelled
    key was reported after 7-11 s of importing torch, into an outputs/ directory with an invalid
    record; the interpolation was Hydra's two lines naming no key.)"""
    proc = subprocess.run([sys.executable, "-c", TORCH_AT_EXIT, "model=tiny", f"task={task}", override],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="0"))
    assert proc.returncode == 2, proc.stderr
    said, torch_line = proc.stderr.strip().splitlines()
    assert said.startswith("kvbench: invalid config: ") and line in said, said
    assert torch_line == "torch imported: False"
    assert list(tmp_path.iterdir()) == [] and proc.stdout == ""


# ---- --help --------------------------------------------------------------------------------

@pytest.mark.e2e
def test_help_names_every_task_workload_and_preset_and_imports_no_torch(tmp_path):
    """`kvbench --help` was Hydra's generic page (the composed config, no list of tasks) after 5 s:
    now each task, workload and experiment preset on a line of its own, the groups, how to see
    every key; from the config files alone, without torch; the same text Hydra prints."""
    from kvbench.config.bench import CONF_DIR, TASKS

    env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="0")
    proc = subprocess.run([sys.executable, "-c", TORCH_AT_EXIT, "--help"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0 and proc.stderr.strip() == "torch imported: False", proc.stderr
    text = proc.stdout
    lines = text.splitlines()
    for section, names in (("Tasks (task=...)", TASKS),
                           ("Workloads (workload=...", [p.stem for p in (CONF_DIR / "workload").glob("*.yaml")]),
                           ("Experiments (experiment=...", [p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")])):
        start = next(i for i, line in enumerate(lines) if line.startswith(section))
        block = lines[start + 1:lines.index("", start)]
        assert sorted(line.split()[0] for line in block) == sorted(names), block
        assert all(len(line.split(maxsplit=1)) == 2 for line in block)  # each says what it is
    groups = [p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra"]
    assert all(any(line.startswith(f"{group}: ") for line in lines) for group in groups)
    assert "kvbench --cfg job" in text and "kvbench --hydra-help" in text
    # What kvbench wrote fits 100 columns (the groups' lines are Hydra's listing of the options).
    assert all(len(line) <= 100 for line in lines if ": " not in line or line.startswith(" "))
    hydra = subprocess.run([sys.executable, "-m", "kvbench.cli", "--help"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120, env=env)
    assert hydra.returncode == 0 and hydra.stdout == text


# ---- two sweeps into one directory at once -------------------------------------------------

def sweep_config(sweep_dir, *task):
    """The config a sweep's callbacks see for the command line ``task``."""
    cfg = compose(*[o.split(",")[0] for o in task], hydra=True)
    cfg.hydra.overrides.task = list(task)
    cfg.hydra.sweep.dir = str(sweep_dir)
    return cfg


@functools.cache
def _composed(task: tuple):
    """``sweep_config`` of ``task``, composed once: the races below repeat 45 times, and a compose
    costs ~0.3 s where the race itself takes milliseconds."""
    return sweep_config("unset", *task)


def start_together(sweep_dir, *commands):
    """``check_sweep_start`` of each command's sweep into ``sweep_dir``, all released at once
    from one barrier: each one's ConfigError, or None when it may run."""
    configs = [copy.deepcopy(_composed(tuple(c))) for c in commands]
    for config in configs:
        config.hydra.sweep.dir = str(sweep_dir)
    barrier, outcome = threading.Barrier(len(configs)), [None] * len(configs)

    def start(i):
        barrier.wait()
        try:
            check_sweep_start(configs[i])
        except ConfigError as exc:
            outcome[i] = exc

    threads = [threading.Thread(target=start, args=(i,)) for i in range(len(configs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcome


A, B = ["model=tiny", "attention=mha,mqa"], ["model=tiny", "attention=gqa,mqa"]


def test_a_sweep_directory_is_the_first_sweeps_even_before_its_jobs_start(tmp_path):
    """The check read multirun.yaml, which Hydra's sweeper writes only after the check: a second
    sweep started before that (at the same instant, in 1 of 3 tries) found nothing and both ran."""
    check_sweep_start(sweep_config(tmp_path, *A))
    with pytest.raises(ConfigError, match="holds another sweep .*attention=mha,mqa"):
        check_sweep_start(sweep_config(tmp_path, *B))
    check_sweep_start(sweep_config(tmp_path, *A))  # the same sweep again: a resume


def test_two_sweeps_released_at_once_into_one_directory_never_both_start(tmp_path):
    """Two sweeps with other overrides released from one barrier, 40 times (two threads, two
    opens of the lock file: flock excludes them as it excludes two processes): exactly one of
    each pair starts. Two starts of the same sweep both may (their jobs' claims share them out)."""
    for i in range(40):
        refused = [exc is not None for exc in start_together(tmp_path / f"other{i}", A, B)]
        assert sorted(refused) == [False, True], (i, refused)
    for i in range(5):
        assert start_together(tmp_path / f"same{i}", A, A) == [None, None]


@pytest.mark.e2e
def test_two_kvbench_sweeps_started_together_into_one_directory_one_is_refused(tmp_path):
    """The real thing, three times: two kvbench processes started at once with other overrides;
    one runs its sweep, the other exits 2 in one line naming the directory, having run nothing."""
    env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="0")
    jobs = ["workload.prompt_len=12", "workload.gen_len=6", "runtime.warmup=0", "runtime.repeats=1",
            "runtime.isolate=false", "wandb.mode=disabled"]
    for i in range(3):
        sweep = tmp_path / f"sweep{i}"
        procs = [subprocess.Popen([sys.executable, "-m", "kvbench.cli", "-m", *a, *jobs, f"hydra.sweep.dir={sweep}"],
                                  cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for a in (A, B)]
        outs = [p.communicate(timeout=300) for p in procs]  # reads the pipes as it waits: p.wait on a full one blocks
        done = [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]
        assert sorted(code for code, _, _ in done) == [0, 2], done
        [(_, _, err)] = [d for d in done if d[0] == 2]
        [line] = err.strip().splitlines()
        assert line.startswith(f"kvbench: invalid config: hydra.sweep.dir='{sweep}': holds another sweep (")
        assert len(list(sweep.glob("*/results.json"))) == 2  # the winner's two jobs, nothing of the other's


# ---- a job directory kvbench may not read ----------------------------------------------------

@contextmanager
def unreadable(directory: Path):
    """``directory`` as mode 000 makes it for anyone but root (these tests run as root too): listing
    it, and reaching anything inside it, fails with EACCES."""
    import errno

    inside = str(directory)

    def refused(path) -> bool:
        path = os.fspath(path) if not isinstance(path, int) else ""
        path = os.path.abspath(path) if path else path
        return path == inside or path.startswith(inside + os.sep)

    def guard(real, only_inside=False):
        def call(path, *args, **kwargs):
            p = os.path.abspath(os.fspath(path)) if not isinstance(path, int) else ""
            if (p.startswith(inside + os.sep) if only_inside else refused(path)):
                raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
            return real(path, *args, **kwargs)
        return call

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "scandir", guard(os.scandir))
        for name in ("stat", "lstat", "open"):  # the directory itself can be stat'ed, as with mode 000
            mp.setattr(os, name, guard(getattr(os, name), only_inside=True))
        yield


def two_jobs(sweep: Path):
    for job, kv in (("0", 2), ("1", 4)):
        RunResult("ok", {"task": "bench", "attention": {"num_kv_heads": kv}}, metrics={"decode_ms_p50": 1.0},
                  overrides=["model=tiny", f"attention.num_kv_heads={kv}"]).write(sweep / job)


def test_an_unreadable_job_directory_is_an_unreadable_row_naming_it_in_the_report(tmp_path, capsys):
    """A sweep whose job 1 kvbench may not read (mode 000): its row says unreadable and names the
    directory, in the report and in kvbench-report's count. (Before: the job vanished, no row,
    no warning: "1 jobs (1 ok)".)"""
    from kvbench.cli_tools import report_main
    from kvbench.sinks.report import MD_FILE, collect

    sweep = tmp_path / "sweep"
    two_jobs(sweep)
    with unreadable(sweep / "1"):
        rows = {r["job"]: r for r in collect(sweep)}
        assert report_main([str(sweep), "--no-plots"]) == 0
    assert rows["0"]["status"] == "ok"
    assert rows["1"]["status"] == "unreadable" and rows["1"]["error"] == f"{sweep / '1'}: cannot be listed " \
                                                                         "(Permission denied)"
    assert "2 jobs (1 ok, 1 unreadable)" in capsys.readouterr().out
    assert f"{sweep / '1'}: cannot be listed" in (sweep / MD_FILE).read_text()


def test_the_end_of_a_sweep_counts_an_unreadable_job_directory_as_unreadable(tmp_path):
    """The sweep's own end table reads each job directory it launched: one it may not read is
    unreadable (pathlib's exists() raised PermissionError and the table was lost)."""
    from kvbench.jobs.sweep import sweep_records

    sweep = tmp_path / "sweep"
    two_jobs(sweep)
    with unreadable(sweep / "1"):
        rows = sweep_records(sweep, sweep_config(sweep, "model=tiny", "attention.num_kv_heads=2,4"))
    assert [r["status"] for r in rows] == ["ok", "unreadable"]
    assert "Permission denied" in rows[1]["error"] and str(sweep / "1") in rows[1]["error"]


@pytest.mark.e2e
def test_a_mode_000_job_directory_is_unreadable_for_kvbench_report_for_real(tmp_path):
    """The same with the kernel saying no: chmod 000, kvbench-report as a process that the mode
    binds (root without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH, as setpriv drops them)."""
    sweep = tmp_path / "sweep"
    two_jobs(sweep)
    (sweep / "1").chmod(0)
    try:
        command = [sys.executable, "-c", "from kvbench.entry import report_main; report_main()", str(sweep),
                   "--no-plots", "--out", str(tmp_path / "report")]
        if os.geteuid() == 0:
            caps = "-dac_override,-dac_read_search"
            command = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", *command]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, MPLBACKEND="Agg"))
    finally:
        (sweep / "1").chmod(0o755)
    assert proc.returncode == 0, proc.stderr
    assert "2 jobs (1 ok, 1 unreadable)" in proc.stdout
    assert f"{sweep / '1'}: cannot be listed (Permission denied)" in (tmp_path / "report" / "summary.md").read_text()


# ---- a disk that refuses a write: the one line names the file ---------------------------------

def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as the kernel raises it: no file name


@pytest.mark.parametrize("write", ["summary.csv", "plot.png", "checkpoint.pt", "workspace.json"])
def test_a_file_the_disk_refuses_is_named_in_the_error(tmp_path, monkeypatch, write):
    """Every file kvbench writes goes through jsonio.atomic_write: a full disk fails its write,
    flush or fsync with no file name (or the temporary file's), and the lines built from the error
    named nothing ("report failed: OSError: [Errno 28] No space left on device")."""
    from kvbench.jsonio import atomic_write, os_error_line

    monkeypatch.setattr(os, "fsync", no_space)
    target = tmp_path / "out" / write
    with pytest.raises(OSError) as err:
        atomic_write(target, lambda f: f.write("x"))
    assert err.value.filename == str(target)
    assert os_error_line(err.value) == f"cannot write {target}: No space left on device"
    assert os.listdir(target.parent) == []  # no temporary file left behind


def test_a_checkpoint_the_disk_refuses_names_the_checkpoint(tmp_path, monkeypatch):
    from conftest import make_decoder

    from kvbench.checkpoint import save_checkpoint

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError) as err:
        save_checkpoint(tmp_path / "checkpoint.pt", make_decoder(), {"step": 1})
    assert err.value.filename == str(tmp_path / "checkpoint.pt")


def test_a_report_the_disk_refuses_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    from kvbench.cli_job import report

    two_jobs(tmp_path)
    monkeypatch.setattr(os, "fsync", no_space)
    report(tmp_path, plots=False)
    err = capsys.readouterr().err.strip()
    assert err == (f"kvbench: report failed: cannot write {tmp_path / 'summary.csv'}: No space left on device "
                   f"(run kvbench-report {tmp_path})")


def test_an_error_txt_the_disk_refuses_is_said_in_the_record(tmp_path, monkeypatch):
    """A job that fails writes its traceback to error.txt; when the disk refuses that, the record
    (still written) says so, naming the file, instead of nothing."""
    from kvbench.jobs import runner

    def crash(job, device, out_dir, result, progress):
        raise RuntimeError("boom")

    monkeypatch.setattr(runner.TASKS["bench"], "run", crash)
    monkeypatch.setattr(runner, "write_text_atomic", no_space)
    cfg = compose("model=tiny", "runtime.device=cpu", "wandb.mode=disabled")
    result = runner.run_job(cfg, tmp_path)
    assert result.status == "error" and result.error.startswith("RuntimeError: boom"), result.error
    assert f"(traceback not saved: cannot write {tmp_path / 'error.txt'}: No space left on device)" in result.error
    assert read_record(tmp_path).error == result.error


def test_a_claim_file_the_disk_refuses_names_it(tmp_path, monkeypatch):
    import io

    from kvbench.jobs import claim

    class Full(io.TextIOWrapper):
        def flush(self):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(claim.os, "fdopen", lambda fd, mode: Full(io.FileIO(fd, "r+")))
    with pytest.raises(OSError) as err:
        claim.claim_job(tmp_path)
    assert err.value.filename == str(tmp_path / claim.CLAIM_FILE)


def test_a_log_file_the_disk_refuses_is_one_line_not_a_traceback_per_record(tmp_path, capsys):
    """Hydra's job log (<job>.log beside results.json) on a full disk: logging printed '--- Logging
    error ---' and a traceback for every record; now one line naming the file, then no more."""
    import logging

    from kvbench.cli_job import guard_log_files

    class Full(logging.FileHandler):
        def flush(self):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    handler = Full(tmp_path / "cli.log")
    logging.getLogger().addHandler(handler)
    try:
        guard_log_files()
        for _ in range(3):
            logging.getLogger("kvbench.test").warning("a line for the log")
    finally:
        logging.getLogger().removeHandler(handler)
        handler.stream.close()  # what the disk refused stays unwritten
    err = capsys.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err
    assert err.count(f"kvbench: cannot write {tmp_path / 'cli.log'}: No space left on device") == 1


@pytest.mark.e2e
def test_hydras_own_file_refused_by_the_disk_is_one_line_naming_it(tmp_path):
    """The kernel refuses to grow a file past RLIMIT_FSIZE (EFBIG; a full disk's ENOSPC takes the
    same path): Hydra's .hydra/config.yaml, written before the job, is named. (Before:
    'kvbench: OSError: [Errno 28] No space left on device'.)"""
    import resource

    out = tmp_path / "run"
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (200, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    proc = subprocess.run([sys.executable, "-m", "kvbench.cli", "model=tiny", "wandb.mode=disabled",
                           f"hydra.run.dir={out}"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="0"), preexec_fn=limit)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"kvbench: cannot write {out / '.hydra' / 'config.yaml'}: "
                                                "File too large"]
