"""task=inspect's text: the head→group map, and the whole text laid out for a pipe."""

import pytest
from conftest import compose

from kvbench.cli_job import _remove_inspect_dir
from kvbench.jobs.job_config import to_bench_config
from kvbench.layouts.base import Layouts
from kvbench.layouts.kv_heads import KVHeads, describe_kv_groups, kv_group_map
from kvbench.tasks.inspect import describe, kv_memory_table


def test_group_map_32_query_8_kv_heads():
    mapping = kv_group_map(32, 8)
    assert mapping == [h // 4 for h in range(32)]
    assert [mapping.count(g) for g in range(8)] == [4] * 8
    text = describe_kv_groups(32, 8).splitlines()
    assert text[0] == "query heads 0-3 → KV head 0"
    assert text[7] == "query heads 28-31 → KV head 7"
    assert describe_kv_groups(4, 4).splitlines()[2] == "query head 2 → KV head 2"


def test_kv_table_has_a_row_per_cache_dtype():
    """Llama-2-7B's shape (32 layers, 32 KV heads, head_dim 128): 512 KiB per token in float16;
    an int8 cache stores 128 one-byte codes + one 4-byte scale per head, K and V, per layer; nvfp4
    64 bytes of codes + 8 one-byte scales (72 B, 3.56x fewer than float16), mxfp4 64 + 4."""
    llama2_7b = Layouts([KVHeads(None, 32, 32, 128)] * 32)
    rows = {r["dtype"]: r for r in kv_memory_table(llama2_7b, 4096, 2)}
    assert list(rows) == ["float32", "float16", "bfloat16", "int8", "float8_e4m3fn", "nvfp4", "mxfp4",
                          "nvfp4_rotated"]
    assert rows["nvfp4"]["per_token"] == rows["nvfp4_rotated"]["per_token"] == 2 * 32 * 32 * 72 == 147_456
    assert rows["mxfp4"]["per_token"] == 2 * 32 * 32 * 68
    assert round(rows["float16"]["per_token"] / rows["nvfp4"]["per_token"], 2) == 3.56
    assert rows["float16"]["per_token"] == 2 * 32 * 32 * 128 * 2 == 524_288
    assert rows["int8"]["per_token"] == rows["float8_e4m3fn"]["per_token"] == 2 * 32 * 32 * (128 + 4) == 270_336
    assert rows["int8"]["per_batch"] == 270_336 * 4096 * 2


# ---- what a person reads from a pipe ------------------------------------------------------------------

PRESETS = ("gpt_oss_120b", "deepseek_v32", "gemma3n_e4b", "qwen3_5_9b", "deepseek_v3")


@pytest.mark.parametrize("preset", PRESETS)
def test_inspect_fits_100_columns_and_loses_nothing(preset):
    """Sentences wrap between words (lines of 251-339 characters before) and a table wider than the
    console is printed as several, each led by its first column: every cell is still printed whole."""
    job = to_bench_config(compose(f"model={preset}", "task=inspect"))
    full, fitted = describe(job), describe(job, 100)
    assert max(len(line) for line in fitted.splitlines()) <= 100 < max(len(line) for line in full.splitlines())
    words = lambda text: sorted(w for w in text.split() if w.strip("-"))  # noqa: E731
    # the same words, apart from a table's first column and header, which lead each part of it
    assert set(words(full)) == set(words(fitted))


def test_inspect_names_the_variant_as_its_tables_do_and_says_sinks():
    job = to_bench_config(compose("model=gpt_oss_120b", "task=inspect"))
    text = " ".join(describe(job, 100).split())
    assert "variant: gqa kv=8 w=128 1:1 sinks (its name in progress lines and tables)" in text
    assert "learned attention sinks in 36 of 36 layers" in text  # said in words, where the layout is described
    assert "sinks" not in describe(to_bench_config(compose("model=llama3_8b", "task=inspect")))
    # a mean of whole bytes per token is shown to the byte: gemma3n_e4b's was "(74,638.2)"
    text = describe(to_bench_config(compose("model=gemma3n_e4b", "task=inspect")))
    float32 = next(line for line in text.splitlines() if line.startswith("float32"))
    assert "(≈74,638)" in float32 and ".2)" not in text


def test_inspects_empty_run_directory_is_removed_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "earlier").mkdir(parents=True)

    def hydra_dir(path):
        (path / ".hydra").mkdir(parents=True)
        for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
            (path / ".hydra" / name).write_text("x: 1\n")
        (path / "cli.log").write_text("")
        return path

    _remove_inspect_dir(hydra_dir(tmp_path / "outputs" / "2026-12-06" / "19-00-00"))
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["earlier"]  # the date's folder too
    logged = hydra_dir(tmp_path / "outputs" / "d" / "t")
    (logged / "cli.log").write_text("a line\n")  # something written: kept
    _remove_inspect_dir(logged)
    assert (logged / "cli.log").read_text() == "a line\n"
    monkeypatch.chdir(hydra_dir(tmp_path / "here"))  # hydra.run.dir=.: the working directory itself is kept
    _remove_inspect_dir(tmp_path / "here")
    assert (tmp_path / "here" / "cli.log").exists()


def _presets_leaving_out():
    import pathlib

    import yaml
    files = sorted(pathlib.Path(__file__).parents[1].joinpath("conf", "model").glob("*.yaml"))
    return {f.stem: yaml.safe_load(f.read_text()).get("left_out") for f in files}


def test_a_preset_that_leaves_part_of_its_model_out_says_so_in_inspect_and_in_its_record():
    """Kimi K3's count (5.49 T with its experts on the full width) is not the card's 2.8 T: a preset that
    does not build all of its published model says what, beside the figures, and its record keeps it."""
    from omegaconf import OmegaConf

    from kvbench.config.record import model_record

    presets = _presets_leaving_out()
    assert {"kimi_k3", "nemotron3_super", "llama4_scout"} <= {k for k, v in presets.items() if v}
    for preset in ("kimi_k3", "llama3_8b"):
        cfg = compose(f"model={preset}", "task=inspect")
        text = " ".join(describe(to_bench_config(cfg)).split())
        said = f"left out of this preset: {presets[preset]}"
        assert (said in text) == bool(presets[preset]) and ("left out of this preset" in text) == bool(presets[preset])
        record = model_record(OmegaConf.to_container(cfg.model, resolve=True))
        assert record.get("left_out") == presets[preset]
