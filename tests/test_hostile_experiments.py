"""The experiment scripts are run by users too, so they get ``kvbench``'s promises
(docs/reliability.md): a bad argument is one line naming the option and the value as written,
exit 2, before any work and with nothing written; a config kvbench refuses (Hydra's composition
errors included) is one line, exit 2. In process through each script's ``main(argv)``; once end
to end (marked e2e)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"


def script(name, monkeypatch):
    """experiments/<name>.py as a module, imported as ``python experiments/<name>.py`` has it."""
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    spec = importlib.util.spec_from_file_location(f"experiment_{name}", EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refused(name, argv, monkeypatch, capsys) -> str:
    """The one line ``main(argv)`` of experiments/<name>.py exits 2 with."""
    module = script(name, monkeypatch)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    with pytest.raises(SystemExit) as info:
        module.run_main(module.main, argv) if hasattr(module, "run_main") else module.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    [line] = err.splitlines()
    return line


# (script, argv, what the line must hold: the option and the value as written)
CASES = [
    ("capacity_report", ["--presets", "llama3_8b", "nosuch"], "argument --presets: 'nosuch': not a model preset"),
    ("capacity_report", ["--budget-gb", "-5"], "argument --budget-gb: '-5': must be a finite number > 0"),
    ("capacity_report", ["--context", "0"], "argument --context: '0': must be an integer >= 1"),
    ("capacity_report", ["--context", "-1"], "argument --context: '-1': must be an integer >= 1"),
    ("capacity_report", ["--budget-gb", "nan"], "argument --budget-gb: 'nan': must be a finite number > 0"),
    ("capacity_report", ["--tiny-budget-mb", "inf"], "argument --tiny-budget-mb: 'inf'"),
    ("capacity_report", ["--budget-gb", "1e-12"], "argument --budget-gb: 1e-12: less than one byte"),
    ("capacity_report", ["--tiny-context", "1e3"], "argument --tiny-context: '1e3': must be an integer >= 1"),
    ("capacity_per_gpu", ["--gpus", "0"], "argument --gpus: '0': must be an integer >= 1"),
    ("capacity_per_gpu", ["--gpu-gb", "nan"], "argument --gpu-gb: 'nan': must be a finite number > 0"),
    ("capacity_per_gpu", ["--gpu-gb", "1e-12"], "argument --gpu-gb: 1e-12: less than one byte"),
    ("capacity_per_gpu", ["--context", "8k"], "argument --context: '8k': must be an integer >= 1"),
    ("conversations_eviction", ["--attention", "paged"], "argument --attention: 'paged': must be one of"),
    ("conversations_eviction", ["--budgets", "2,-1"], "argument --budgets: '-1'"),
    ("conversations_eviction", ["--budgets", "2,,16"], "argument --budgets: '2,,16'"),
    ("state_checkpoint", ["--repeats", "0"], "argument --repeats: '0': must be an integer >= 1"),
    ("state_checkpoint", ["--rate", "nan"], "argument --rate: 'nan'"),
    ("multiturn_ttft", ["--model", "nosuch"], "argument --model: 'nosuch': must be one of"),
    ("multiturn_ttft", ["--warmup", "-1"], "argument --warmup: '-1': must be an integer >= 0"),
    ("compare_transformers", ["--shapes", "8x0"], "argument --shapes: '0'"),
    ("compare_transformers", ["--contenders", "hf,jit"], "argument --contenders: 'jit': must be one of hf, eager"),
    ("compare_transformers", ["--device", "gpu"], "argument --device: 'gpu': must be cpu, cuda or cuda:N"),
    ("cpu_threads", ["--rounds", "0"], "argument --rounds: '0'"),
    ("fused_projections", ["--kv-heads", "16,0"], "argument --kv-heads: '0'"),
    ("gdn_step", ["--contexts", "256"], "argument --contexts: '256': must be a comma-separated list of 2 entries"),
    ("harness_overhead", ["--prompt-len", "-3"], "argument --prompt-len: '-3'"),
    ("job_overhead", ["--tree", "nosuch"], "argument --tree: 'nosuch': must be NAME=DIR"),
    ("job_overhead", ["--tree", "a=/no/such/dir"], "argument --tree: '/no/such/dir': no such directory"),
    ("kv_precision", ["--batch", "nan"], "argument --batch: 'nan'"),
    ("kv_precision_quality", ["--lm-steps", "0"], "argument --lm-steps: '0'"),
    ("mla_forms", ["--contexts", "512", "0"], "argument --contexts: '0'"),
    ("nvml_overhead", ["--interval-ms", "inf"], "argument --interval-ms: 'inf'"),
    ("prefill_heads", ["--cached", "-1"], "argument --cached: '-1': must be an integer >= 0"),
    ("quality_tradeoff", ["--uptrain-lr", "0"], "argument --uptrain-lr: '0': must be a finite number > 0"),
    ("qwen_hybrid_speed", ["--d-model", "1.5"], "argument --d-model: '1.5'"),
    ("serving_gather", ["--model", "paged"], "argument --model: 'paged'"),
    ("small_batch_gemm", ["--rows", "1,,2"], "argument --rows: '1,,2'"),
    ("step_breakdown", ["--shapes", "8by1024"], "argument --shapes: '8by1024': must be BATCHxPROMPT"),
    ("tensor_parallel_cpu", ["--repeats", "0"], "argument --repeats: '0': must be an integer >= 1"),
    ("v4_layouts", ["--rounds", "0"], "argument --rounds: '0': must be an integer >= 1"),
    ("v4_layouts", ["--contexts", "512", "x"], "argument --contexts: 'x': must be an integer >= 1"),
    ("tensor_parallel_cpu", ["--gen-len", "-1"], "argument --gen-len: '-1': must be an integer >= 1"),
    ("tpot_pairing", ["--variants", "mha,paged"], "argument --variants: 'paged'"),
    ("wandb_unreachable", ["--init-timeout", "nan"], "argument --init-timeout: 'nan'"),
    ("recall_curves", ["/no/such/folder"], "argument folder: '/no/such/folder': no such directory"),
    ("recall_probe", ["64", "8", "48", "0", "64", "2", "1", "0.003"], "argument STEPS: '0'"),
    ("recall_probe", ["64", "8", "48", "600", "64", "2", "1", "-1"], "argument LR: '-1'"),
]


@pytest.mark.parametrize("name, argv, says", CASES, ids=[f"{c[0]}{' '.join(c[1])}" for c in CASES])
def test_a_bad_argument_is_one_line_naming_it_exit_2(name, argv, says, monkeypatch, capsys):
    line = refused(name, argv, monkeypatch, capsys)
    assert line.startswith(f"{name}.py: ") and says in line


def user_scripts():
    return sorted(p.stem for p in EXPERIMENTS.glob("*.py") if 'if __name__ == "__main__"' in p.read_text())


def test_every_script_a_user_runs_parses_through_the_shared_parser_and_has_a_case_here():
    """The class, not the instances: a script added with argparse's own parser (two lines and a
    usage block), a bare sys.argv[1] or no refusal tested here fails this."""
    covered = {name for name, _, _ in CASES}
    for name in user_scripts():
        text = (EXPERIMENTS / f"{name}.py").read_text()
        if name == "recall_mqa_check":  # takes no arguments
            assert "argv" not in text
            continue
        assert "Parser(" in text and "argparse.ArgumentParser" not in text, name
        assert "run_main(main" in text, name
        assert name in covered, name


@pytest.mark.parametrize("where", ["file/x", "file", "dir"])
def test_an_output_that_cannot_be_written_is_refused_before_any_work(where, tmp_path, monkeypatch, capsys):
    """``--out <a file>/x`` raised a traceback after the whole run; a directory where the report
    goes too. Nothing is written."""
    (tmp_path / "file").write_text("kept")
    (tmp_path / "dir").mkdir()
    out = tmp_path / where
    before = sorted(p.name for p in tmp_path.rglob("*"))
    if where == "file":  # a file is a fine report path (it is replaced atomically); a runs folder it is not
        line = refused("state_checkpoint", ["--runs", str(out)], monkeypatch, capsys)
        assert line == f"state_checkpoint.py: argument --runs: {str(out)!r}: is a file, not a directory"
    else:
        line = refused("capacity_report", ["--no-serve", "--out", str(out)], monkeypatch, capsys)
        why = f"cannot write there: {tmp_path / 'file'} is not a directory" if where == "file/x" else \
            "is a directory; name the report file"
        assert line == f"capacity_report.py: argument --out: {str(out)!r}: {why}"
    assert sorted(p.name for p in tmp_path.rglob("*")) == before and (tmp_path / "file").read_text() == "kept"


def test_a_read_only_output_folder_is_refused(tmp_path, monkeypatch, capsys):
    """A folder the user may not write to (faked: the tests run as root here, who writes anywhere,
    so os.access answers no for that folder alone)."""
    (tmp_path / "ro").mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path / "ro" and real(path, mode))
    line = refused("gdn_step", ["--out", str(tmp_path / "ro" / "x.md")], monkeypatch, capsys)
    assert line == f"gdn_step.py: argument --out: {str(tmp_path / 'ro' / 'x.md')!r}: cannot write there: " \
        f"{tmp_path / 'ro'} is not writable"


def test_an_override_hydra_cannot_compose_is_one_config_error_line(monkeypatch):
    """conversations_eviction --attention paged printed Hydra's 56-line traceback: the scripts'
    compose_config raises kvbench's ConfigError, one line naming the override and the options."""
    common = script("_common", monkeypatch)
    from kvbench.core.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        common.compose_config(["model=tiny", "attention=paged"])
    [line] = str(info.value).splitlines()
    assert line.startswith("attention=paged: no such option in attention/ (available: ")
    with pytest.raises(ConfigError) as info:
        common.compose_config(["model=tiny", "atention=mha"])
    assert "atention" in str(info.value) and len(str(info.value).splitlines()) == 1


def test_a_config_kvbench_refuses_and_a_job_not_ok_end_a_script_in_one_line(monkeypatch, capsys):
    common = script("_common", monkeypatch)
    from kvbench.core.errors import ConfigError

    def refuses(argv):
        raise ConfigError("attention.num_kv_heads=3: must divide model.num_heads=4")

    monkeypatch.setattr(sys, "argv", ["x.py"])
    with pytest.raises(SystemExit) as info:
        common.run_main(refuses)
    assert info.value.code == 2
    assert capsys.readouterr().err == "x.py: invalid config: attention.num_kv_heads=3: must divide model.num_heads=4\n"
    for status, code in (("invalid", 2), ("error", 1), ("oom", 1)):
        with pytest.raises(SystemExit) as info:
            common.ok_record({"status": status, "error": "why\nmore"}, "model=tiny attention=mha")
        assert info.value.code == code
        assert capsys.readouterr().err == f"x.py: model=tiny attention=mha: {status}: why more\n"
    assert common.ok_record({"status": "ok", "error": None}, "x")["status"] == "ok"


def test_a_report_that_cannot_be_written_is_cannot_write_path_exit_1(tmp_path, monkeypatch, capsys):
    common = script("_common", monkeypatch)
    monkeypatch.setattr(sys, "argv", ["x.py"])
    (tmp_path / "dir").mkdir()
    with pytest.raises(SystemExit) as info:
        common.run_main(lambda argv: common.write_report(tmp_path / "dir", "text"))
    assert info.value.code == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("x.py: cannot write") and str(tmp_path / "dir") in line


def test_capacity_report_has_no_row_for_a_context_past_a_models_length(tmp_path, monkeypatch):
    """--context 10000 is past llama3_8b's 8192 positions: its rows say so instead of figures for a
    sequence the model cannot hold; the presets that hold it keep theirs."""
    module = script("capacity_report", monkeypatch)
    row = module.formula_row(["model=llama3_8b", "runtime.dtype=bfloat16"], 10000, 40 * 10**9)
    assert row == {"refused": "context 10000: more than model.max_seq_len=8192"}
    assert module.formula_row(["model=gemma3_27b", "runtime.dtype=bfloat16"], 10000, 40 * 10**9)["fit"] >= 1


def test_capacity_report_draws_no_plot_where_no_row_holds_one_sequence(tmp_path, monkeypatch):
    """A budget below one sequence in every row: a log axis of zeros raised ValueError after the rows."""
    module = script("capacity_report", monkeypatch)
    assert module.plot([{"fit": 0}, {"refused": "x"}], tmp_path / "p.png") is False
    assert list(tmp_path.iterdir()) == []


@pytest.mark.e2e  # the scripts in their own interpreters
@pytest.mark.parametrize("argv, says", [
    (["experiments/capacity_report.py", "--budget-gb", "-5"], "argument --budget-gb: '-5'"),
    (["experiments/conversations_eviction.py", "--attention", "paged"], "argument --attention: 'paged'"),
    (["experiments/state_checkpoint.py", "--repeats", "0"], "argument --repeats: '0'"),
])
def test_the_named_scripts_refuse_in_one_line_exit_2_end_to_end(argv, says, tmp_path):
    proc = subprocess.run([sys.executable, *argv, "--out", str(tmp_path / "report")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert says in line
    assert list(tmp_path.iterdir()) == []


def test_capacity_per_gpu_counts_only_the_gpus_of_the_node_it_is_given(monkeypatch):
    """The named splits are of a node of 8: on ``--gpus 4`` a DP=8 row counted sequences on GPUs
    the node has not. A split kept is of the node's GPUs; none left, every split of the node."""
    module = script("capacity_per_gpu", monkeypatch)
    from kvbench.parallel.plan import Split

    for _, named in module.PRESETS:
        assert module.splits_of(named, 8) == named
        assert module.splits_of(named, 3) is None
    named = [Split(8), Split(1, 8), Split(2, 2), Split(4, 1, 4)]
    assert module.splits_of(named, 4) == [Split(2, 2), Split(4, 1, 4)]
