"""``kvbench``'s own process imports no torch when its jobs run in their own processes
(``runtime.isolate=true``, the default): it composes the config, claims the job directory,
starts the job's process and prints, reports and tracks the record that process hands back.
torch costs more than a second of CPU and ~300 MB per kvbench process (and per joblib or
submitit worker); only the job's process needs it."""

import json
import subprocess
import sys

import pytest

from kvbench.results import read_record

pytestmark = pytest.mark.e2e  # a fresh interpreter: what `kvbench` imports

RUN = ["model=tiny", "workload.prompt_len=12", "workload.gen_len=6", "runtime.warmup=0", "runtime.repeats=1",
       "wandb.mode=disabled"]

# One interpreter: what `import kvbench.cli` loaded, then a forked process per command, each
# running kvbench.cli.main() as the `kvbench` console script does and saying, once the command
# has exited, which of torch, the runner and the tasks its own process imported.
_DRIVER = r"""
import json, os, sys, traceback

def heavy():
    return sorted(m for m in sys.modules if m.split(".")[0] == "torch" or m == "kvbench.jobs.runner"
                  or m.startswith("kvbench.tasks.") or m == "kvbench.model")

import kvbench.cli
print(json.dumps(heavy()), flush=True)
for argv, cwd, out, err, said in json.loads(sys.stdin.read()):
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.chdir(cwd)
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.argv = ["kvbench", *argv]
        code = 0
        try:
            kvbench.cli.main()
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            traceback.print_exc()
            code = "raised"
        with open(said, "w") as f:
            json.dump({"code": code, "heavy": heavy()}, f)
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(0)
    os.waitpid(pid, 0)
"""


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parent")
    commands = {"run": [*RUN, f"hydra.run.dir={tmp / 'run'}"],
                "sweep": ["-m", *RUN, "attention=mqa", f"hydra.sweep.dir={tmp / 'sweep'}"]}  # a sweep of one job
    cases = [(argv, str(tmp), str(tmp / f"{name}.out"), str(tmp / f"{name}.err"), str(tmp / f"{name}.json"))
             for name, argv in commands.items()]
    proc = subprocess.run([sys.executable, "-c", _DRIVER], input=json.dumps(cases), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = {}
    for name, (_, _, out, err, result) in zip(commands, cases):
        with open(result) as f:
            said[name] = {**json.load(f), "stderr": open(err).read(), "stdout": open(out).read()}
    return tmp, json.loads(proc.stdout.splitlines()[0]), said


def test_importing_the_kvbench_cli_loads_no_torch(parent):
    _, imported, _ = parent
    assert imported == []


def test_an_isolated_run_and_sweep_measure_in_their_jobs_processes_only(parent):
    """The jobs measured, with torch (their records' env says which torch and its thread count),
    and the process that ran the command never imported torch, the runner or a task."""
    tmp, _, said = parent
    for name, dirs in (("run", [tmp / "run"]), ("sweep", [tmp / "sweep" / "0"])):
        assert said[name]["code"] == 0, said[name]["stderr"]
        assert said[name]["heavy"] == [], name
        for directory in dirs:
            record = read_record(directory)
            assert record.status == "ok" and record.metrics["decode_ms_p50"] > 0, record.error
            assert record.env["torch"] and record.env["torch_num_threads"] >= 1
    assert "kvbench sweep" in said["sweep"]["stdout"] and "1 ok" in said["sweep"]["stdout"]
