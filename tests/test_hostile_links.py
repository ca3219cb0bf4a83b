"""Links planted where kvbench, Hydra or W&B write in a run's or a sweep's directory (round 4), and
a single run into a directory that holds another run's ok record. Nothing is written through a
link (the link is replaced, its target untouched, a dangling one creates nothing), and a run that
would replace another's measurement is refused in one line before anything is written."""

import json
import os

import hydra.core.utils
import pytest
from conftest import compose, kvbench_forked

import kvbench.cli_job  # noqa: F401 — installs the writer of Hydra's .hydra/ files
from kvbench.cli_sweep import SweepCallback, SweepRefused, check_run_dir
from kvbench.core.errors import ConfigError
from kvbench.jsonio import NoFollowFileHandler, real_dir
from kvbench.results import RunResult, read_record

TINY = ["model=tiny", "workload.prompt_len=8", "workload.gen_len=4", "runtime.warmup=0", "runtime.repeats=1",
        "runtime.isolate=false", "runtime.threads=1", "wandb=disabled", "runtime.fidelity=false"]


def victim(tmp_path):
    """A file and a directory outside the run that a planted link points at."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("precious\n")
    (outside / "dir").mkdir()
    return outside


def untouched(outside):
    assert (outside / "precious.txt").read_text() == "precious\n"
    assert sorted(p.name for p in outside.iterdir()) == ["dir", "precious.txt"]  # nothing created beside them
    assert list((outside / "dir").iterdir()) == []


def regular(*paths):
    for path in paths:
        assert path.is_file() and not path.is_symlink(), path


# ---- the writers, in process -----------------------------------------------------------------

def test_real_dir_replaces_a_link_and_keeps_its_target(tmp_path):
    outside = victim(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "wandb").symlink_to(outside / "dir")
    made = real_dir(tmp_path / "run" / "wandb")
    assert made.is_dir() and not made.is_symlink()
    (made / "x").write_text("run's own")
    untouched(outside)
    (tmp_path / "run" / "afile").write_text("")
    with pytest.raises(FileExistsError):
        real_dir(tmp_path / "run" / "afile")


@pytest.mark.parametrize("planted", ["file", "dangling"])
def test_the_job_log_never_writes_through_a_link(tmp_path, planted):
    outside = victim(tmp_path)
    log = tmp_path / "cli.log"
    log.symlink_to(outside / ("precious.txt" if planted == "file" else "created.log"))
    handler = NoFollowFileHandler(str(log))
    handler.emit(__import__("logging").makeLogRecord({"msg": "hello"}))
    handler.close()
    regular(log)
    assert log.read_text() == "hello\n"
    untouched(outside)  # a dangling link made `open(path, "a")` create the file outside the run


def test_the_job_log_refuses_a_fifo_without_waiting(tmp_path):
    os.mkfifo(tmp_path / "cli.log")
    with pytest.raises(OSError):
        NoFollowFileHandler(str(tmp_path / "cli.log"))


@pytest.mark.parametrize("planted", [".hydra/config.yaml", ".hydra"])
def test_hydras_own_files_are_written_beside_a_planted_link(tmp_path, planted):
    """What Hydra's run_job calls for .hydra/config.yaml, hydra.yaml and overrides.yaml."""
    outside = victim(tmp_path)
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True) if planted != ".hydra" else run.mkdir()
    (run / planted).symlink_to(outside / ("precious.txt" if planted.endswith(".yaml") else "dir"))
    hydra.core.utils._save_config(compose("model=tiny"), "config.yaml", run / ".hydra")
    regular(run / ".hydra" / "config.yaml")
    assert not (run / ".hydra").is_symlink() and "name: tiny" in (run / ".hydra" / "config.yaml").read_text()
    untouched(outside)


def run_config(run_dir, *overrides):
    cfg = compose(*overrides, hydra=True)
    cfg.hydra.overrides.task = list(overrides)
    cfg.hydra.run.dir = str(run_dir)
    return cfg


def test_a_single_run_into_another_runs_ok_record_is_refused_naming_both(tmp_path):
    RunResult("ok", {"task": "bench"}, metrics={"decode_ms_p50": 1.0},
              overrides=["model=tiny", "workload.gen_len=4"]).write(tmp_path)
    with pytest.raises(ConfigError) as err:
        check_run_dir(run_config(tmp_path, "model=tiny", "workload.gen_len=8"))
    assert str(err.value) == (f"hydra.run.dir={str(tmp_path)!r}: holds the ok record of another run, which this one "
                              "would replace (that run had workload.gen_len=4, this one has workload.gen_len=8); "
                              "give this run a new hydra.run.dir")
    with pytest.raises(SweepRefused):  # Hydra turns an Exception from a callback into a warning
        SweepCallback().on_run_start(run_config(tmp_path, "model=tiny"))
    # the same job again (in another order, tracked otherwise): measured again, as before
    check_run_dir(run_config(tmp_path, "workload.gen_len=4", "model=tiny", "wandb=disabled"))


@pytest.mark.parametrize("status", ["invalid", "error", "interrupted"])
def test_a_run_over_a_record_that_measured_nothing_is_not_refused(tmp_path, status):
    RunResult(status, {"task": "bench"}, overrides=["model=tiny"], error="x").write(tmp_path)
    check_run_dir(run_config(tmp_path, "model=tiny", "workload.gen_len=8"))
    check_run_dir(run_config(tmp_path / "new", "model=tiny"))  # an empty directory


# ---- end to end: kvbench with links planted -----------------------------------------------------

@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """kvbench runs, one forked process each (conftest.kvbench_forked): a single run, a sweep and a
    sweep run by joblib's worker processes, with links planted at every name Hydra writes, then a
    second single run into the first's directory with another override, and a third with the
    first's overrides."""
    root = tmp_path_factory.mktemp("planted")
    outside = victim(root)
    run, sweep, again, workers = root / "run", root / "sweep", root / "again", root / "workers"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").symlink_to(outside / "precious.txt")
    (run / ".hydra" / "overrides.yaml").symlink_to(outside / "overrides.yaml")  # dangling
    (run / "cli.log").symlink_to(outside / "cli.log")  # dangling: the job log
    (sweep / "0").mkdir(parents=True)
    (sweep / "multirun.yaml").symlink_to(outside / "precious.txt")
    (sweep / "0" / ".hydra").symlink_to(outside / "dir")
    (sweep / "0" / "cli.log").symlink_to(outside / "precious.txt")
    # a launcher's worker process (joblib's, as submitit's): the job's function is unpickled there
    (workers / "0" / ".hydra").mkdir(parents=True)
    (workers / "0" / ".hydra" / "config.yaml").symlink_to(outside / "precious.txt")
    (workers / "0" / "cli.log").symlink_to(outside / "worker.log")
    base = [o for o in TINY if not o.startswith("workload.gen_len=")]
    commands = [([*TINY, f"hydra.run.dir={run}"], root),
                (["-m", *base, "workload.gen_len=4,5", f"hydra.sweep.dir={sweep}"], root),
                (["-m", "hydra/launcher=joblib", *TINY, f"hydra.sweep.dir={workers}"], root),
                ([*TINY, f"hydra.run.dir={again}"], root),
                ([*base, "workload.gen_len=5", f"hydra.run.dir={again}"], root),
                ([*reversed(TINY), "wandb.project=other", f"hydra.run.dir={again}"], root)]
    done = kvbench_forked(commands[:4])
    before = [(again / ".hydra" / "overrides.yaml").read_text(), (again / "results.json").read_bytes()]
    [other] = kvbench_forked(commands[4:5])
    after = [(again / ".hydra" / "overrides.yaml").read_text(), (again / "results.json").read_bytes()]
    [same] = kvbench_forked(commands[5:])
    return dict(root=root, outside=outside, run=run, sweep=sweep, workers=workers, again=again, done=done,
                other=other, same=same, before=before, after=after)


@pytest.mark.e2e
def test_nothing_is_written_through_a_link_hydra_or_kvbench_meets(planted):
    for proc in planted["done"]:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    untouched(planted["outside"])  # config.yaml once overwrote precious.txt; cli.log was created outside
    run, sweep = planted["run"], planted["sweep"]
    regular(*(run / ".hydra" / n for n in ("config.yaml", "hydra.yaml", "overrides.yaml")), run / "cli.log",
            run / "results.json", sweep / "multirun.yaml", sweep / "0" / "cli.log",
            *(sweep / j / ".hydra" / "overrides.yaml" for j in ("0", "1")))
    assert "workload.gen_len=4" in (sweep / "0" / ".hydra" / "overrides.yaml").read_text()
    regular(planted["workers"] / "0" / ".hydra" / "config.yaml", planted["workers"] / "0" / "cli.log")
    assert read_record(run).status == "ok" and read_record(sweep / "1").status == "ok"


@pytest.mark.e2e
def test_a_second_single_run_into_the_same_directory_is_refused_with_the_first_kept(planted):
    proc, again = planted["other"], planted["again"]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line == (f"kvbench: invalid config: hydra.run.dir={str(again)!r}: holds the ok record of another run, "
                    "which this one would replace (that run had workload.gen_len=4, this one has "
                    "workload.gen_len=5); give this run a new hydra.run.dir")
    assert proc.stdout == ""
    # nothing written: the record and Hydra's files are the first run's
    assert planted["after"] == planted["before"]
    # the first run's own overrides again (another order, another W&B project): it is measured again
    assert planted["same"].returncode == 0, planted["same"].stdout + planted["same"].stderr
    assert json.loads((again / "results.json").read_text())["status"] == "ok"


@pytest.mark.e2e
def test_a_planted_wandb_link_does_not_send_the_run_into_its_target(tmp_path, monkeypatch):
    """The job's wandb/ directory: W&B followed the link and wrote the run into its target."""
    from kvbench.sinks.tracking import track

    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / sub))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    outside = victim(tmp_path)
    job = tmp_path / "job"
    job.mkdir()
    (job / "wandb").symlink_to(outside / "dir")
    result = RunResult("ok", {"task": "bench", "model": {"name": "tiny"}}, metrics={"decode_ms_p50": 1.0})
    result.write(job)
    run_dir = track(result, {"mode": "offline", "project": "kvbench"}, job)
    assert run_dir is not None and run_dir.parent == job / "wandb" and not (job / "wandb").is_symlink()
    untouched(outside)
