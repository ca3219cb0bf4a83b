"""A search (hydra/sweeper=optuna, experiment=search) whose trials return no objective: one line
each, never two. Optuna's sweeper logged "Failed experiment: Return value must be float-castable.
Got 'None'." under kvbench's own "objective: none, why"; an invalid trial's reason was printed by
its job and again in the objective line; a search of invalid trials ended on two lines (the
sweeper's "No trials are completed yet." and kvbench's "every job ... is invalid") and exit 1."""

import pytest
from conftest import kvbench_forked

SEARCH = ["experiment=search", "model=tiny", "workload.prompt_len=8", "workload.gen_len=2", "runtime.warmup=0",
          "runtime.repeats=1", "runtime.fidelity=false", "runtime.isolate=false", "runtime.threads=1",
          "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.seed=0"]


def lines(text: str) -> list:
    """stderr less the progress lines and the job headers (kvbench job N/M: its overrides, wrapped)."""
    return [line for line in text.splitlines() if line.startswith(("kvbench: ", "  objective", "[HYDRA]", "["))
            and "A new study created" not in line]


@pytest.mark.e2e
def test_search_trials_without_an_objective_are_one_line_each(tmp_path):
    over, invalid = kvbench_forked([
        (["-m", *SEARCH, "objective_caps.kv_cache_bytes=1", f"hydra.sweep.dir={tmp_path / 'over'}"], tmp_path),
        (["-m", *SEARCH, "attention.num_kv_heads=choice(3)", f"hydra.sweep.dir={tmp_path / 'invalid'}"], tmp_path)])
    # every trial over a 1-byte cap: its line, then the search's one line, exit 1
    assert over.returncode == 1, over.stdout + over.stderr
    said = lines(over.stderr)
    assert "Failed experiment" not in over.stderr and "float-castable" not in over.stderr
    assert [s.split(" is above")[0].rsplit("=", 1)[0] for s in said[:-1]] == ["  objective: none, kv_cache_bytes"] * 2
    assert said[-1] == "kvbench: the sweeper failed: ValueError: No trials are completed yet."
    # every trial invalid: the job's line once, no objective line, the sweep's one line, exit 2 (a grid's code)
    assert invalid.returncode == 2, invalid.stdout + invalid.stderr
    assert lines(invalid.stderr) == 2 * [
        "kvbench: job invalid: attention.num_kv_heads=3: must divide model.num_heads=8 (every KV group needs the "
        "same number of query heads)"] + ["kvbench: every job of the sweep is invalid (their records say why)"]
    assert (tmp_path / "invalid" / "summary.md").is_file() and (tmp_path / "over" / "summary.md").is_file()
