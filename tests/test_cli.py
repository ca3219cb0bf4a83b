"""The Hydra runner end to end: every conf file composes, a real run writes a record whose
numbers check against the formula, a sweep with an invalid job finishes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import llama_dir
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from kvbench.cache import kv_cache_bytes
from kvbench.cli import sweep_size
from kvbench.config import CONF_DIR, AttentionConfig, BenchConfig, ModelConfig

REPO = Path(__file__).resolve().parents[1]
TINY = ["model=tiny", "workload.prompt_len=12", "workload.gen_len=6", "runtime.warmup=1",
        "runtime.repeats=2", "wandb.mode=disabled"]


def kvbench(*args, cwd, check=True):
    """Run the installed console script's code in a fresh interpreter, as a user would."""
    env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="0")
    proc = subprocess.run([sys.executable, "-m", "kvbench.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def group_options():
    # Nested groups too: conf/hydra/launcher/slurm.yaml is the option hydra/launcher=slurm.
    for option in sorted(CONF_DIR.rglob("*.yaml")):
        if option.parent != CONF_DIR:
            yield option.parent.relative_to(CONF_DIR).as_posix(), option.stem


@pytest.mark.parametrize("group, option", list(group_options()))
def test_every_conf_file_composes_and_validates(group, option, tmp_path):
    hydra_node = group == "experiment" or group.startswith("hydra/")
    extra = []
    if option == "llama_dir":  # needs a checkpoint to read its shape from
        extra = [f"model.path={llama_dir(tmp_path, num_kv_heads=2)[0]}", "workload.prompt_len=16",
                 "workload.gen_len=8"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"{group}={option}", *extra], return_hydra_config=hydra_node)
    if group == "experiment":
        assert OmegaConf.select(cfg, "hydra.sweeper.params"), "an experiment preset sweeps something"
    if hydra_node:
        with open_dict(cfg):
            del cfg["hydra"]
    bench = OmegaConf.to_object(cfg)
    assert isinstance(bench, BenchConfig)
    assert bench.model.num_heads % bench.attention.num_kv_heads == 0


@pytest.mark.parametrize("name, published_params", [
    ("llama2_7b", 6_738_415_616), ("llama2_13b", 13_015_864_320), ("llama2_70b", 68_976_648_192),
    ("llama3_8b", 8_030_261_248), ("mistral_7b", 7_241_732_096)])
def test_preset_shapes_match_published_parameter_counts(name, published_params):
    """The true shapes: the parameter count of the preset equals the published model's."""
    from kvbench.inspection import parameter_count

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={name}", "attention=gqa"])
    bench = OmegaConf.to_object(cfg)
    native = bench.model.preset_kv_heads
    bench.attention = AttentionConfig.for_heads(bench.model.num_heads, native)
    assert parameter_count(bench) == published_params
    assert ModelConfig(**{k: v for k, v in vars(bench.model).items()}).head_dim == 128


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
    assert m["e2e_ms"] >= m["prefill_ms"] + 6 * min(rec["series"]["decode_ms"]) * 0.5
    assert len(rec["series"]["decode_ms"]) == 6
    assert m["peak_rss_bytes"] > 0 and m["nvml_device_used_bytes"] is None and m["nvml_reason"]
    assert rec["config"]["attention"]["num_kv_heads"] == 2 and rec["config"]["model"]["head_dim"] == 8
    assert rec["env"]["torch"] and rec["methods"]["decode_ms_p50"].startswith("ms")
    assert "results:" in proc.stdout and "tok/s" in proc.stdout


def test_single_run_with_bad_value_exits_with_one_line(tmp_path):
    out = tmp_path / "bad"
    proc = kvbench(*TINY, "attention=gqa", "attention.num_kv_heads=3", f"hydra.run.dir={out}",
                   cwd=tmp_path, check=False)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()  # one line, as the README says, and nothing else
    assert "attention.num_kv_heads=3" in line and "model.num_heads=8" in line and str(out) in line
    assert proc.stdout.strip() == ""
    assert json.loads((out / "results.json").read_text())["status"] == "invalid"


def test_multirun_records_invalid_and_finishes(tmp_path):
    sweep = tmp_path / "sweep"
    proc = kvbench("-m", *TINY, "attention=gqa", "attention.num_kv_heads=2,3,4",
                   f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    statuses = {}
    for path in sorted(sweep.glob("*/results.json")):
        rec = json.loads(path.read_text())
        statuses[rec["config"]["attention"]["num_kv_heads"]] = rec["status"]
    assert statuses == {2: "ok", 3: "invalid", 4: "ok"}
    assert "2 ok, 1 invalid" in proc.stdout


def test_inspect_prints_group_map_and_seed_arithmetic(tmp_path):
    proc = kvbench("task=inspect", "model=llama2_7b", "attention=mha", "workload.prompt_len=4000",
                   "workload.gen_len=96", "workload.batch_size=64", cwd=tmp_path)
    out = proc.stdout
    assert ("elements per layer (K+V): per token 8,192 · per sequence (4096) 33,554,432 ≈ 33.6 M · "
            "per batch (x64) 2,147,483,648 ≈ 2.15 G") in out
    # 2 * 32 layers * 32 heads * 128 * 2 bytes = 512 KiB per token; x 4096 x 64 in float16
    assert f"{2 * 32 * 32 * 128 * 4096 * 64 * 2:,}" in out
    assert "query head 31 → KV head 31" in out and not list(tmp_path.iterdir())[1:]


def test_help_lists_groups_and_user_config_dir(tmp_path):
    help_text = kvbench("--help", cwd=tmp_path).stdout
    for group in ("model", "attention", "workload", "cache", "runtime", "wandb", "experiment"):
        assert f"{group}:" in help_text
    mine = tmp_path / "myconf" / "model"
    mine.mkdir(parents=True)
    (mine / "mine.yaml").write_text("name: mine\nnum_layers: 3\nd_model: 96\nnum_heads: 12\n"
                                    "preset_kv_heads: 12\nffn_dim: 64\nvocab_size: 50\nmax_seq_len: 128\n")
    out = kvbench("--config-dir", str(tmp_path / "myconf"), "model=mine", "task=inspect",
                  "workload.prompt_len=8", "workload.gen_len=8", cwd=tmp_path).stdout
    assert "model mine: 3 layers" in out and "12 query heads" in out and "3 KV heads" in out


@pytest.mark.parametrize("where", ["override", "yaml"])
def test_the_renamed_preset_kv_heads_key_fails_with_a_one_line_hint(tmp_path, where):
    """model.num_kv_heads became model.preset_kv_heads: the old spelling, on the command line or
    in a user's own model file, exits 2 with one line naming the new key."""
    if where == "override":
        proc = kvbench("model.num_kv_heads=4", "task=inspect", cwd=tmp_path, check=False)
    else:
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "old.yaml").write_text("name: old\nnum_heads: 8\nnum_kv_heads: 2\n")
        proc = kvbench("--config-dir", str(tmp_path), "model=old", "task=inspect", cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert "model.num_kv_heads" in line and "model.preset_kv_heads" in line and "attention.num_kv_heads" in line


def test_sweep_size_counts_cli_and_preset_axes():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=long_context"], return_hydra_config=True)
    cfg.hydra.overrides.task = ["experiment=long_context", "workload.batch_size=1,8"]
    assert sweep_size(cfg) == 3 * 3 * 2


def test_readme_shows_the_sweep_command_and_where_results_land():
    readme = (REPO / "README.md").read_text()
    assert ("kvbench -m attention=mha,gqa,mqa workload.prompt_len=512,2048 workload.batch_size=1,8 "
            "runtime.dtype=float32,bfloat16\n") in readme  # no cache.shared: it would double every decode job
    assert "multirun/" in readme and "results.json" in readme
