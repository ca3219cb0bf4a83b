"""W&B against a hostile environment: a server that accepts and never answers, a port that
refuses, directories W&B must write that cannot be written. Each ends in one warning line, the
measurement kept (results.json as it was) and no W&B output of its own on the terminal."""

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvbench.results import RunResult, read_record
from kvbench.sinks.tracking import track

KEY = "k" * 40  # a well-formed API key: login needs no server to accept it


def wandb_home(tmp_path: Path) -> dict:
    """W&B's own files under tmp_path, no WANDB_MODE, no inherited key or server."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ERROR_REPORTING")}
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        env[var] = str(tmp_path / "wandb-home" / sub)
    return env


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    for var, value in wandb_home(tmp_path).items():
        if var.startswith("WANDB_"):
            monkeypatch.setenv(var, value)


class SilentServer:
    """Accepts connections, reads each request's first line and never answers (a network that
    drops replies looks the same to W&B). ``paths`` are the requested paths, in order."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.paths, self.conns = [], []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn = self.sock.accept()[0]
            except OSError:  # closed
                return
            self.conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn):
        try:
            line = conn.recv(4096).split(b"\r\n", 1)[0].decode("latin-1")
        except OSError:
            return
        if line:
            self.paths.append(line.split(" ")[1] if " " in line else line)

    def close(self):
        self.sock.close()
        for conn in self.conns:
            conn.close()


def refused_url() -> str:
    """A local port nothing listens on (bound, then closed)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


def make_result(job_dir: Path) -> RunResult:
    result = RunResult("ok", {"attention": {"type": "gqa", "num_kv_heads": 2}, "workload": {"name": "decode"}},
                       metrics={"prefill_ms": 3.5})
    result.write(job_dir)
    return result


@pytest.mark.e2e
def test_online_against_a_silent_server_costs_init_timeout_and_exits_with_its_result(tmp_path):
    """A job's record tracked online in a fresh interpreter (what the CLI does after a job),
    against a server that never answers. Before: W&B's 10 s here, then its OpenTelemetry exit
    hook asked the server whether it takes telemetry and waited 10 s for the reply after the
    result was printed (and the service 2 s more). Now: init_timeout_s, one line with the exact
    ``wandb sync`` command, exit 0, and no telemetry request (the one whose reply the exit awaited)."""
    server = SilentServer()
    job = tmp_path / "job"
    make_result(job)
    code = ("import sys; from kvbench.results import read_record; from kvbench.sinks.tracking import track; "
            f"job = {str(job)!r}; track(read_record(job), {{'mode': 'online', 'init_timeout_s': 2}}, job); "
            "print('tracked', flush=True)")
    try:
        env = {**wandb_home(tmp_path), "WANDB_BASE_URL": server.url, "WANDB_API_KEY": KEY,
               "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout.readline() == "tracked\n"
        tracked = time.monotonic()
        _, err = proc.communicate(timeout=120)
        tail = time.monotonic() - tracked
    finally:
        server.close()
    assert proc.returncode == 0, err
    assert read_record(job).status == "ok"
    assert "/graphql" in server.paths, f"W&B never tried the server: {server.paths}"
    assert not [p for p in server.paths if "otel" in p], f"W&B's telemetry asked the server: {server.paths}"
    [warned] = err.splitlines()  # the one line (logging's last resort prints the message alone)
    assert warned.startswith("W&B online failed (CommError: ") and "init_timeout setting" not in warned
    assert "no answer within wandb.init_timeout_s=2 s" in warned
    run_dir = Path(re.search(r"`wandb sync (\S+)`", warned).group(1))
    assert run_dir.is_dir() and run_dir.parent == job / "wandb" and run_dir.name.startswith("offline-run-")
    assert tail < 60, tail  # a sanity bound only: the exit hook's wait is ruled out above


def service_pids(pid: int) -> list:
    """W&B's service processes whose parent is ``pid`` (from /proc: ``pgrep`` may be absent)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            name, rest = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        if "wandb-core" in name and int(rest.split()[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.e2e
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_wandb_init_waits_stops_wandbs_service_with_kvbench(tmp_path, signum):
    """Stopped while ``wandb.init`` waits on a server that never answers (the longest wait
    ``wandb.init_timeout_s`` allows), kvbench exits with the signal's code and W&B's service goes
    with it. Before: the exit waited in W&B's teardown for the whole timeout (1e300 never ended),
    and a kvbench killed meanwhile left the service running, holding the caller's pipes, so a
    ``kvbench ... | tee`` never ended. ``communicate`` returning proves the pipes were let go."""
    server = SilentServer()
    job = tmp_path / "job"
    make_result(job)
    code = ("from kvbench.jobs.interrupts import stop_like_ctrl_c; stop_like_ctrl_c(); "
            "from kvbench.results import read_record; from kvbench.sinks.tracking import track; "
            f"job = {str(job)!r}; track(read_record(job), {{'mode': 'online', 'init_timeout_s': 600}}, job)")
    try:
        env = {**wandb_home(tmp_path), "WANDB_BASE_URL": server.url, "WANDB_API_KEY": KEY,
               "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while "/graphql" not in server.paths and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # until wandb.init is asking the server
        services = service_pids(proc.pid)
        assert "/graphql" in server.paths and len(services) == 1, (server.paths, services)
        proc.send_signal(signum)
        try:
            _, err = proc.communicate(timeout=120)  # far below the 600 s W&B would wait
        except subprocess.TimeoutExpired:
            proc.kill()
            for pid in service_pids(1) + service_pids(proc.pid):
                if pid in services:
                    os.kill(pid, signal.SIGKILL)
            raise
    finally:
        server.close()
    assert proc.returncode in (-signum, 128 + signum, 1), err  # KeyboardInterrupt's traceback exits 1
    assert not Path(f"/proc/{services[0]}").exists() or "zombie" in Path(f"/proc/{services[0]}/status").read_text()
    assert read_record(job).status == "ok"


@pytest.fixture
def wandb_used(tmp_path, wandb_env):
    """An offline run made before the test body: W&B is imported and has made a run in this
    process whatever ran before, so its ``wandb`` logger exists when pytest's log capture attaches
    itself to every non-propagating logger (W&B's own ``ERROR wandb: error in wandb.init()`` then
    reaches that capture unless kvbench keeps it to W&B's files)."""
    assert track(make_result(tmp_path / "warm"), {"mode": "offline"}, tmp_path / "warm") is not None


def test_online_against_a_refused_port_is_offline_in_one_line(tmp_path, wandb_used, monkeypatch, caplog, capfd):
    monkeypatch.setenv("WANDB_BASE_URL", refused_url())
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    with caplog.at_level(logging.WARNING, logger="kvbench.sinks.tracking"):
        run_dir = track(make_result(tmp_path), {"mode": "online", "init_timeout_s": 1.0}, tmp_path)
    assert run_dir is not None and run_dir.name.startswith("offline-run-")
    assert [r.getMessage() for r in caplog.records] == [
        f"W&B online failed ({_why(caplog)}): the run is kept offline; upload later with `wandb sync {run_dir}`"]
    assert "connection refused" in caplog.text and "wandb.init_timeout_s=1 s" in caplog.text
    assert capfd.readouterr().err == ""  # nothing of W&B's own on the terminal
    assert read_record(tmp_path).status == "ok"


def _why(caplog) -> str:
    return re.search(r"W&B online failed \((.*)\): the run", caplog.text).group(1)


@pytest.mark.parametrize("var", ["WANDB_CACHE_DIR", "WANDB_DATA_DIR"])
def test_an_unwritable_wandb_directory_is_one_line_and_no_run(tmp_path, wandb_env, monkeypatch, caplog, capfd, var):
    """Reproduced as a user would: the variable names a path below a regular file (root ignores
    a chmod, so a read-only directory is made this way; a read-only tmpfs mount behaves the same).
    Before: 17 lines of wandb-core's log on stderr (WANDB_CACHE_DIR, where it logs) or a half-made
    run marked failed (WANDB_DATA_DIR); now one line before W&B starts, results.json untouched."""
    (tmp_path / "a-file").write_text("not a directory\n")
    monkeypatch.setenv(var, str(tmp_path / "a-file" / "sub"))
    job = tmp_path / "job"
    before = (make_result(job), (job / "results.json").read_bytes())[1]
    with caplog.at_level(logging.WARNING, logger="kvbench.sinks.tracking"):
        assert track(read_record(job), {"mode": "offline"}, job) is None
    assert len(caplog.records) == 1, caplog.text
    message = caplog.records[0].getMessage()
    assert message.startswith(f"W&B run not made: {var} (") and "a-file/sub" in message
    assert "Not a directory" in message and message.endswith("(results.json is unaffected)")
    assert capfd.readouterr().err == ""
    assert (job / "results.json").read_bytes() == before and not (job / "wandb").exists()


def test_a_file_where_the_runs_wandb_directory_goes_is_one_line(tmp_path, wandb_env, caplog, capfd):
    job = tmp_path / "job"
    make_result(job)
    (job / "wandb").write_text("in the way\n")
    with caplog.at_level(logging.WARNING, logger="kvbench.sinks.tracking"):
        assert track(read_record(job), {"mode": "offline"}, job) is None
    assert len(caplog.records) == 1 and caplog.records[0].getMessage().startswith(
        f"W&B run not made: the run directory {job / 'wandb'} is not writable (FileExistsError: File exists)")
    assert capfd.readouterr().err == ""
    assert read_record(job).status == "ok"


def test_an_unwritable_wandb_dir_is_not_used(tmp_path, wandb_env, monkeypatch, caplog, capfd):
    """``WANDB_DIR`` is W&B's default for a run's files; kvbench writes each run under its job
    directory (``wandb.init(dir=...)``), so an unwritable one changes nothing."""
    (tmp_path / "a-file").write_text("not a directory\n")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "a-file" / "sub"))
    with caplog.at_level(logging.WARNING, logger="kvbench.sinks.tracking"):
        run_dir = track(make_result(tmp_path), {"mode": "offline"}, tmp_path)
    assert run_dir is not None and run_dir.parent == tmp_path / "wandb"
    assert caplog.text == "" and capfd.readouterr().err == ""
