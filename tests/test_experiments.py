"""The experiment scripts write where ``--out`` says and leave the committed results in
experiments/results/ alone unless told to write there."""

import hashlib
import importlib
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "experiments" / "results"



def experiment(name: str):
    """``experiments/<name>.py`` imported as a module (the scripts import their ``_common`` beside them)."""
    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "experiments"))


def digests() -> dict:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(COMMITTED.rglob("*")) if p.is_file()}


@pytest.mark.e2e  # the experiment script in its own interpreter
def test_multiturn_ttft_writes_to_out_and_not_to_the_committed_results(tmp_path):
    before = digests()
    out = tmp_path / "report" / "ttft"
    proc = subprocess.run([sys.executable, "experiments/multiturn_ttft.py", "--model", "tiny", "--warmup", "0",
                           "--repeats", "1", "--batch-size", "1", "--threads", "1", "--runs", str(tmp_path / "runs"),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "WANDB_MODE": "disabled"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = out.with_suffix(".md").read_text()
    assert text.startswith("# Multi-turn chat: TTFT per turn") and "model=tiny" in text
    assert f"wrote {out.with_suffix('.md')}" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["shared_false", "shared_true"]
    assert digests() == before


@pytest.mark.e2e  # the experiment script in its own interpreter
def test_overhead_experiments_write_to_out_and_not_to_the_committed_results(tmp_path):
    """The NVML-sampler and CPU-threads experiments on the tiny model: each writes its table to
    --out (the sampler's run asserts inside that the sampler thread really sampled)."""
    before = digests()
    for script, head in (("nvml_overhead", "# NVML sampler overhead"), ("cpu_threads", "# CPU threads")):
        out = tmp_path / script
        proc = subprocess.run([sys.executable, f"experiments/{script}.py", "--model", "tiny", "--prompt-len", "8",
                               "--gen-len", "4", "--rounds", "2", "--out", str(out)], cwd=ROOT, capture_output=True,
                              text=True, timeout=600, env={**os.environ, "WANDB_MODE": "disabled"})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert out.with_suffix(".md").read_text().startswith(head)
    assert digests() == before


@pytest.mark.e2e  # the experiment script in its own interpreter
def test_tpot_pairing_writes_both_designs_to_out(tmp_path):
    """The pairing experiment on the tiny model: a row per variant and design, a ratio per round."""
    before = digests()
    out = tmp_path / "pairing"
    proc = subprocess.run([sys.executable, "experiments/tpot_pairing.py", "--model", "tiny", "--variants", "gqa,mqa",
                           "--batch", "2", "--context", "8", "--rounds", "2", "--pairs", "3", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "WANDB_MODE": "disabled"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line.split(" | ") for line in out.with_suffix(".md").read_text().splitlines() if line.startswith("| gqa")
            or line.startswith("| mqa")]
    assert [(r[0], r[1]) for r in rows] == [("| gqa", "before/after"), ("| gqa", "paired"),
                                             ("| mqa", "before/after"), ("| mqa", "paired")]
    for r in rows:
        check_pairing_row(r)
    assert digests() == before


def check_pairing_row(r):
    """A row of the pairing table, split on " | ", is consistent with itself. The table prints each
    ratio and the spread to 2 decimals, the spread taken from the unrounded ratios: the printed
    spread must lie in the range of max / min over every pair of ratios that print as these (each
    within half a step), widened by its own rounding. (A fixed tolerance of 0.02 flaked under load,
    where ratios spread: 0.605 and 1.975 print as 0.60 and 1.98 with a spread of 3.26, and
    1.98 / 0.60 = 3.30.)"""
    ratios = [float(x) for x in r[2].split()]
    assert len(ratios) == 2 and all(x > 0 for x in ratios)
    low, high = min(ratios), max(ratios)
    spread = float(r[5].rstrip(" |"))
    half = 0.005 + 1e-9  # half a printed step, and float slack at its edges
    assert (high - half) / (low + half) - half <= spread <= (high + half) / (low - half) + half, r
    assert r[3] == f"{low:.2f}-{high:.2f}" and float(r[4]) == pytest.approx((low + high) / 2, abs=2 * half)


def test_the_pairing_row_check_holds_for_any_ratios_a_loaded_machine_measures():
    """In this process, the script's own row formatting: ratios from 0.1 to 10 (a loaded machine
    spreads them that far) never fail the check above, and a spread that is not max / min does."""
    table_row = experiment("tpot_pairing").table_row
    rng = random.Random(0)
    for _ in range(20000):
        ratios = [math.exp(rng.uniform(math.log(0.1), math.log(10))) for _ in range(2)]
        check_pairing_row(table_row("gqa", "paired", ratios).split(" | "))
    check_pairing_row(table_row("gqa", "paired", [0.605, 1.975]).split(" | "))  # 0.02 off the printed values
    wrong = table_row("gqa", "paired", [0.60, 1.98]).replace("| 3.30 |", "| 3.20 |").split(" | ")
    with pytest.raises(AssertionError):
        check_pairing_row(wrong)


def test_serving_gather_writes_its_table_to_out_in_process(tmp_path):
    """experiments/serving_gather.py on the tiny model, in this process: a row per layout with the
    ratio of the step times it printed, and the committed results untouched."""
    serving_gather = experiment("serving_gather")
    before = digests()
    out = tmp_path / "gather.md"
    assert serving_gather.main(["--model", "tiny", "--batch", "2", "--context", "8", "--steps", "2",
                                "--out", str(out)]) == 0
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith(("| mha", "| gqa", "| mqa"))]
    assert [r[1] for r in rows] == ["8", "2", "1"]  # tiny's KV heads per layout
    assert digests() == before


def test_gdn_step_prints_the_long_over_short_ratios_in_process(tmp_path):
    """experiments/gdn_step.py on a small stack, in this process: a row per stack with its ratios,
    the bytes of a Gated DeltaNet stack the same at both contexts, the committed results untouched."""
    gdn_step = experiment("gdn_step")
    before = digests()
    out = tmp_path / "gdn_step.md"
    assert gdn_step.main(["--contexts", "8,40", "--layers", "1", "--d-model", "64", "--rounds", "2",
                          "--out", str(out)]) == 0
    text = out.read_text()
    rows = {line.split(" | ")[0]: line.split(" | ") for line in text.splitlines()
            if line.startswith(("| gdn", "| gqa"))}
    assert sorted(rows) == ["| gdn", "| gqa"]
    assert all(float(rows[k][i]) > 0 for k in rows for i in (3, 4, 5))
    short_bytes, long_bytes = rows["| gdn"][6].strip(" |").split(" / ")
    assert short_bytes == long_bytes and "Gated DeltaNet: a step at 40 positions takes" in text
    assert digests() == before


def test_kv_precision_quality_pairs_each_precision_with_auto_in_process(tmp_path):
    """experiments/kv_precision_quality.py at a few steps, in this process: each precision's bytes by hand,
    auto its own reference (no difference, no interval), the quantized rows paired against it, the
    committed results untouched."""
    kv_precision_quality = experiment("kv_precision_quality")
    before = digests()
    out = tmp_path / "kvq.md"
    args = ["--precisions", "auto,int8,nvfp4", "--lm-steps", "2", "--lm-slices", "16", "--gen", "2",
            "--corpus-bytes", "100000", "--recall-sequences", "16", "--recall-steps", "2", "--seeds", "2"]
    kv_precision_quality.main([*args, "--out", str(out)])
    data = json.loads(out.with_suffix(".json").read_text())
    lm = {r["precision"]: r for r in data["language_model"]}
    # 4 layers x K,V x 4 heads of 32: bf16 2 B a value; int8 1 B + a 4 B scale per head; nvfp4 16 + 2 scales of 1 B
    assert [lm[p]["bytes_per_token"] for p in ("auto", "int8", "nvfp4")] == [4 * 2 * 4 * 32 * 2, 4 * 2 * 4 * 36,
                                                                            4 * 2 * 4 * 18]
    assert lm["auto"]["delta"] == 0 and lm["auto"]["delta_low"] is None and lm["auto"]["top1"] == 1
    for row in lm.values():
        assert row["perplexity"] == pytest.approx(math.exp(row["loss"]))
        assert row["delta"] == pytest.approx(row["loss"] - lm["auto"]["loss"], abs=1e-9)
    assert lm["nvfp4"]["positions"] == 8 * 3 and lm["nvfp4"]["top1_low"] <= lm["nvfp4"]["top1"]
    for part in ("recall", "passkey"):  # MQAR and passkey, each paired per seed
        recall = {r["precision"]: r for r in data[part]}
        assert recall["auto"]["delta"] == 0 and len(recall["int8"]["per_seed"]) == 2
        assert recall["int8"]["delta"] == pytest.approx(recall["int8"]["accuracy"] - recall["auto"]["accuracy"])
    text = out.read_text()
    assert "| nvfp4 |" in text and "## What each precision costs" in text and "## Recall: passkey accuracy" in text
    again = tmp_path / "again.md"  # the report rewritten from its figures, training nothing
    kv_precision_quality.main(["--from-json", str(out.with_suffix(".json")), "--out", str(again)])
    assert again.read_text() == text
    # --reuse keeps the parts a run of the same settings measured and measures the rest
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({k: v for k, v in data.items() if k != "passkey"}))
    kv_precision_quality.main([*args, "--reuse", str(partial), "--out", str(tmp_path / "reused.md")])
    reused = json.loads((tmp_path / "reused.json").read_text())
    assert reused["language_model"] == data["language_model"] and reused["passkey"] == data["passkey"]
    with pytest.raises(SystemExit) as exit_info:  # other settings: refused, nothing measured
        kv_precision_quality.main([*args[:-1], "3", "--reuse", str(partial), "--out", str(tmp_path / "x.md")])
    assert exit_info.value.code == 2 and digests() == before


def test_qwen_hybrid_speed_prints_kvbench_over_transformers_in_process(tmp_path):
    """experiments/qwen_hybrid_speed.py on a small Qwen3.5 checkpoint, in this process: a row for
    the prefill and one for the decode step with their ratios, the two greedy continuations equal,
    the committed results untouched."""
    qwen_hybrid_speed = experiment("qwen_hybrid_speed")
    before = digests()
    out = tmp_path / "speed.md"
    assert qwen_hybrid_speed.main(["--d-model", "128", "--layers", "4", "--vocab", "97", "--prompt", "70",
                                   "--steps", "3", "--rounds", "2", "--out", str(out)]) == 0
    text = out.read_text()
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith(("| prefill", "| decode"))]
    assert [r[0] for r in rows] == ["| prefill of 70 tokens", "| decode step (median of 3)"]
    assert all(float(r[i].strip(" |").split()[0]) > 0 for r in rows for i in range(1, 6))
    assert "Greedy tokens of the two equal in every round: True." in text
    assert digests() == before


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "experiments").glob("*.py")
                                          if 'if __name__ == "__main__"' in p.read_text()))
def test_every_experiment_script_imports(script, monkeypatch):
    """An experiment that runs only when asked must still import against today's package: one
    that names a moved or removed function (kv_cache_bytes, once) fails here, not on the day it
    is needed."""
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "experiments"))  # as `python experiments/<script>` has it
    spec = importlib.util.spec_from_file_location(f"experiment_{script[:-3]}", ROOT / "experiments" / script)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


@pytest.mark.e2e  # 14 small serving jobs in its own interpreter
def test_state_checkpoint_writes_its_table_to_out(tmp_path):
    """experiments/state_checkpoint.py with 3 requests: a row per prefix length, allocator and
    policy; the prefix that fills no unified block gets no hit there, the aligned one does."""
    before = digests()
    out = tmp_path / "checkpoint"
    proc = subprocess.run([sys.executable, "experiments/state_checkpoint.py", "--requests", "3", "--repeats", "1",
                           "--runs", str(tmp_path / "runs"), "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "WANDB_MODE": "disabled"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line.split(" | ") for line in out.with_suffix(".md").read_text().splitlines() if line.startswith("| 40 ")
            or line.startswith("| 96 ")]
    assert len(rows) == 14
    hits = {(r[0].strip("| "), r[1], r[2]): float(r[4]) for r in rows}
    assert all(hits[("40", "unified", p)] == 0 for p in ("block", "every_n (96)", "prompt_end"))
    assert hits[("40", "per_kind", "block")] > 0 and hits[("96", "unified", "block")] > 0
    assert digests() == before


@pytest.mark.e2e  # ~45 configurations composed as the CLI composes them
def test_capacity_report_writes_its_table_and_plot_to_out_in_process(tmp_path):
    """experiments/capacity_report.py without the rate searches: a row per preset and tiny variant
    and precision, the formula's bytes, the plot beside it; the committed results and docs untouched."""
    capacity_report = experiment("capacity_report")
    before, docs_png = digests(), (ROOT / "docs" / "capacity_report.png").read_bytes()
    out = tmp_path / "report" / "capacity.md"
    capacity_report.main(["--no-serve", "--presets", "llama3_8b", "--out", str(out)])  # one preset of the default
    rows = {tuple(c.strip() for c in line.split("|")[1:4]): line.split("|") for line in out.read_text().splitlines()
            if line.startswith("| tiny")}
    mha = rows[("tiny", "mha kv=8", "auto")]
    assert mha[6].strip() == "1,024" and mha[7].strip() == "512.00 KiB"  # 2 layers x K,V x 8 heads x 8 x 4 B
    assert mha[9].strip() == "3"  # 2 MB // 512 KiB
    # each allocator: whole blocks of 16 of 512 positions reserve the formula's bytes, 3 sequences fit
    assert [mha[i].strip() for i in (10, 11, 13, 14, 15)] == ["512.00 KiB", "3", "16", "512.00 KiB", "3"]
    gdn = rows[("tiny", "gqa kv=2 gdn 1:1", "auto")]  # unified raises the block until a page holds a state
    assert gdn[13].strip() == "32" and int(gdn[15]) < int(gdn[11]) <= int(gdn[9])
    # a hybrid quantizes its attention layers and keeps its state: 1 of 2 layers K,V x 2 heads x (8 + a 4 B
    # scale) per token, and the same 2.5 KiB state as auto's row
    gdn_int8 = rows[("tiny", "gqa kv=2 gdn 1:1", "int8")]
    assert gdn_int8[6].strip() == "48" and gdn_int8[7].strip() == "26.50 KiB" and gdn[7].strip() == "66.50 KiB"
    assert len(rows) == 18 and (tmp_path / "report" / "capacity_report.png").is_file()
    assert {line.split("|")[1].strip() for line in out.read_text().splitlines()[6:] if line.startswith("| ")} == {
        "llama3_8b", "tiny"}
    # per GPU on a node of 8 H200s (126.9 GB each for weights and KV): TP=8 holds one of Llama 3 8B's 8 K/V heads a
    # layer; DP=8 a whole bfloat16 copy (8,030,261,248 parameters) beside 1 GiB a sequence of 8192; no experts
    llama = next(line.split("|") for line in out.read_text().splitlines() if line.startswith("| llama3_8b | gqa kv=8 | "
                                                                                                "auto |"))
    assert [llama[i].strip() for i in (17, 18, 19, 21, 22)] == [
        "TP=8", f"{2 * 32 * 1 * 128 * 2:,}", "1x", str((126_900_000_000 - 2 * 8_030_261_248) // 2 ** 30), "-"]
    assert mha[17].strip() == "-"  # model=tiny: no node of GPUs
    assert "![sequences that fit per layout and precision](capacity_report.png)" in out.read_text()
    assert digests() == before and (ROOT / "docs" / "capacity_report.png").read_bytes() == docs_png


# ---- what a pipe gets: 100 columns, no cell broken ---------------------------------------------

PIPE = 100
SCRIPTS = sorted(p for p in (ROOT / "experiments").glob("*.py") if p.name != "_common.py")
# what writes to the terminal or a file of its own: a script prints through _common (say, progress_row,
# print_report, write_report), which lays its lines and tables out to the terminal's width
OWN_OUTPUT = {"print", "pprint", "write", "writelines", "write_text", "write_bytes", "dump"}


def _own_output(path: Path) -> list:
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name in OWN_OUTPUT:
                found.append(f"{path.name}:{node.lineno}: {name}()")
        if isinstance(node, ast.Attribute) and node.attr in ("stdout", "stderr")\
                and getattr(node.value, "id", "") == "sys":
            found.append(f"{path.name}:{node.lineno}: sys.{node.attr}")
    return found


@pytest.mark.parametrize("script", [p.name for p in SCRIPTS])
def test_no_experiment_script_prints_or_writes_its_report_itself(script):
    """A script's lines and tables reach the terminal through _common, never print(): a Markdown row
    printed as it is was 150 to 1,358 characters on a 100-column pipe (code in a string, the child
    process of wandb_unreachable, is no output of the script's)."""
    assert _own_output(ROOT / "experiments" / script) == []


def _tables(markdown: str) -> list:
    """Each Markdown table of ``markdown`` as (header, rows) of cells as written ("\\|" is a "|" in its cell)."""
    tables, previous = [], ""
    for line in markdown.splitlines():
        if line.startswith("|") and not set(line) <= set("|-: "):
            row = [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if previous.startswith("|"):
                tables[-1][1].append(row)
            else:
                tables.append((row, []))
        previous = line
    return tables


def _assert_piped(printed: str, markdown: str) -> None:
    """No line wider than the pipe, no Markdown table row; each cell whole on one line where it fits
    one beside its row's first column (a wider one wraps between its words), each header word whole."""
    # "wrote PATH" keeps a path whole, however long (a test's temporary folder is 90 columns)
    lines = [line for line in printed.splitlines() if not line.startswith("wrote /")]
    assert lines and max(map(len, lines)) <= PIPE, max(lines, key=len)
    assert not any(line.startswith("|") for line in lines)  # tables laid out, not Markdown
    words = []
    for header, rows in _tables(markdown):
        words += [word for name in header for word in name.split()]
        key = max(len(row[0]) for row in rows) if rows else 0
        for cell in (cell for row in rows for cell in row):
            if key + len(cell) + 7 > PIPE:  # no table of the pipe's width holds it: wrapped between its words
                words += cell.split()
            else:
                assert any(cell in line for line in lines), f"cell broken across lines: {cell!r}"
    for word in words:
        assert any(re.search(rf"(^|[\s│┃]){re.escape(word)}($|[\s│┃])", line) for line in lines), word


@pytest.fixture
def piped(monkeypatch):
    """_common's console as a 100-column pipe; what it printed."""
    import io

    from rich.console import Console

    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    import _common

    console = Console(file=io.StringIO(), width=PIPE, highlight=False, color_system=None)
    monkeypatch.setattr(_common, "stdout", console)
    return _common, lambda: console.file.getvalue()


@pytest.mark.parametrize("report", sorted(p.name for p in COMMITTED.glob("*.md")))
def test_every_committed_report_prints_to_a_pipe_in_100_columns(report, piped, tmp_path):
    """Each committed report as write_report prints it: the file keeps the Markdown byte for byte;
    the pipe gets no line over 100 columns, each table cell whole on one line."""
    common, printed = piped
    text = (COMMITTED / report).read_text()
    out = common.write_report(tmp_path / report, text)
    assert out.read_text() == text
    _assert_piped(printed(), text)
    assert printed().rstrip().endswith(f"wrote {out}")


def test_a_report_with_its_json_and_a_progress_row_in_100_columns(piped, tmp_path):
    """write_report's data goes beside the report as JSON; progress_row prints a 10-column row as
    its cells after their column names, wrapped between cells to the pipe."""
    common, printed = piped
    header = "| " + " | ".join(f"column number {i} of ten" for i in range(10)) + " |"
    row = "| " + " | ".join(f"{i}.25 ({i}.00-{i}.50)" for i in range(10)) + " |"
    common.progress_row([header, "|" + "---|" * 10, row])
    progress = " ".join(printed().split())
    assert len(header) > PIPE and max(map(len, printed().splitlines())) <= PIPE
    assert progress == ", ".join(f"column number {i} of ten {i}.25 ({i}.00-{i}.50)" for i in range(10))
    out = common.write_report(tmp_path / "r.md", "# r\n\n" + header + "\n|" + "---|" * 10 + "\n" + row + "\n",
                              data={"rows": [1.5, float("nan")], "path": tmp_path})
    assert json.loads((tmp_path / "r.json").read_text(), parse_constant=str) == {"rows": [1.5, "NaN"],
                                                                                  "path": str(tmp_path)}
    assert printed().rstrip().endswith(f"wrote {out}\nwrote {tmp_path / 'r.json'}")


def test_fused_projections_prints_its_progress_and_report_in_100_columns(piped, tmp_path):
    """experiments/fused_projections.py in this process, one shape of a few steps: its progress and
    its 8-column table (a 150-character header) reach a pipe in 100 columns, the file keeps the Markdown."""
    import fused_projections

    _, printed = piped
    out = tmp_path / "fused.md"
    fused_projections.main(["--shapes", "1x8", "--kv-heads", "4", "--steps", "2", "--rounds", "1",
                            "--threads", "1", "--out", str(out)])
    text = out.read_text()
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table) == 4 and len(table[0]) > PIPE  # header, rule, a row per clock; the header is wider
    _assert_piped(printed(), text)
    progress = " ".join(printed().split())  # a row per clock as it was measured, each cell after its name
    for row in table[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert f"B {cells[0]}, prompt {cells[1]}, variant {cells[2]}, clock {cells[3]}, separate ms/step {cells[4]}," \
            in progress
