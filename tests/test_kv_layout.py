"""The model under test is the one named: by default a run measures the named model's own KV-head
count (a preset's ``preset_kv_heads``, a checkpoint's ``num_key_value_heads``); a conversion
happens only when asked for, and the record and the console say it in words."""


import pytest
import yaml
from conftest import hf_dir, transformers_perplexity
from hydra import compose, initialize_config_dir

from kvbench.config.bench import CONF_DIR
from kvbench.config.model import ModelConfig
from kvbench.jobs.job_config import to_bench_config
from kvbench.jobs.runner import run_job
from kvbench.sinks.console import run_table, stdout
from kvbench.tasks.common import job_kv_conversion
from kvbench.tasks.inspect import describe


def compose_job(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


PRESETS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml") if "preset_kv_heads" in p.read_text())


@pytest.mark.parametrize("preset", PRESETS)
def test_a_named_preset_runs_in_its_own_layout_by_default(preset):
    """Every preset: no attention= given -> its own KV-head count, no conversion (once llama2_7b,
    an MHA model, ran as a GQA-8 model that does not exist)."""
    own = yaml.safe_load((CONF_DIR / "model" / f"{preset}.yaml").read_text())
    job = to_bench_config(compose_job(f"model={preset}"))
    if own.get("preset_mla"):  # a latent model's own layout is MLA, whatever its head count
        assert job.attention.type == "mla" and job.attention.kv_lora_rank == own["preset_mla"]["kv_lora_rank"]
        assert job_kv_conversion(job) is None
        return
    assert job.attention.num_kv_heads == own["preset_kv_heads"] == job.model.preset_kv_heads
    assert job.attention.type == ("mha" if own["preset_kv_heads"] == own["num_heads"] else
                                  "mqa" if own["preset_kv_heads"] == 1 else "gqa")
    assert job_kv_conversion(job) is None


def test_inspect_llama2_7b_shows_mha():
    text = describe(to_bench_config(compose_job("model=llama2_7b", "task=inspect")))
    assert "attention mha: 32 KV heads" in text and "no conversion" in text


@pytest.mark.parametrize("overrides, kv", [(["attention=gqa"], 8), (["attention.num_kv_heads=4"], 4),
                                           (["attention=mqa"], 1), (["attention=gqa", "attention.num_kv_heads=2"], 2)])
def test_a_conversion_is_what_the_user_asks_for_and_is_said(overrides, kv):
    job = to_bench_config(compose_job("model=llama2_7b", *overrides))
    assert job.attention.num_kv_heads == kv
    change = job_kv_conversion(job)
    assert change["from_kv_heads"] == 32 and change["to_kv_heads"] == kv and change["method"] == "random-init"
    assert "model llama2_7b has 32 KV heads" in change["text"]
    assert "attention converted" in describe(to_bench_config(compose_job("model=llama2_7b", "task=inspect",
                                                                         *overrides)))


def test_the_default_small_model_keeps_its_gqa_preset():
    """``kvbench`` with no arguments: model=small, whose preset is GQA-4 (16 heads)."""
    job = to_bench_config(compose_job())
    assert (job.model.name, job.attention.type, job.attention.num_kv_heads) == ("small", "gqa", 4)
    assert job_kv_conversion(job) is None


def test_a_checkpoint_directory_is_benchmarked_in_its_own_layout(tmp_path):
    path, _ = hf_dir(tmp_path / "mha", 4)
    short = ["model=hf_dir", f"model.path={path}", "workload.prompt_len=16", "workload.gen_len=4"]
    job = to_bench_config(compose_job(*short))
    assert job.attention.num_kv_heads == 4 and job_kv_conversion(job) is None
    job = to_bench_config(compose_job(*short, "attention=mqa"))
    assert job_kv_conversion(job)["method"] == "mean-pool"


def test_eval_of_an_mha_checkpoint_evaluates_it_unconverted(tmp_path_factory, corpus):
    """task=eval train.checkpoint=DIR on an MHA checkpoint: its own perplexity (transformers'), not a
    mean-pooled GQA model's; asking attention=gqa converts, and the record and console say so."""
    tmp_path = tmp_path_factory.mktemp("eval")  # outside the corpus directory, which is read whole
    path, hf = hf_dir(tmp_path / "mha", 4, vocab_size=256)
    common = ["task=eval", f"train.checkpoint={path}", f"data.path={corpus}", "data.val_fraction=0.2",
              "train.seq_len=32", "train.batch_size=4", "train.eval_batches=2", "runtime.device=cpu",
              "wandb=disabled", "runtime.isolate=false"]
    own = run_job(compose_job(*common), tmp_path / "own")
    assert own.status == "ok", own.error
    assert own.metrics["num_kv_heads"] == 4 and own.kv_conversion is None
    expected = transformers_perplexity(hf, to_bench_config(compose_job(*common)))
    assert own.metrics["perplexity"] == pytest.approx(expected, rel=1e-4)

    pooled = run_job(compose_job(*common, "attention=gqa"), tmp_path / "gqa")
    assert pooled.metrics["num_kv_heads"] == 2
    assert pooled.kv_conversion["from_kv_heads"] == 4 and pooled.kv_conversion["to_kv_heads"] == 2
    assert pooled.kv_conversion["method"] == "mean-pool"
    assert pooled.metrics["perplexity"] != pytest.approx(expected, rel=1e-4)
    with stdout.capture() as captured:
        stdout.print(run_table(pooled.to_dict()))
    text = " ".join(captured.get().split())  # the note under the table wraps at the console's width
    assert "has 4 KV heads" in text and "mean-pooled" in text


def test_model_attention_type_takes_a_count():
    model = ModelConfig(d_model=64, num_heads=8, preset_kv_heads=8)
    from kvbench.config.model import AttentionConfig
    assert AttentionConfig().resolved(model).num_kv_heads == 8
    assert AttentionConfig(num_kv_heads=2).resolved(model).type == "gqa"
    with pytest.raises(Exception, match="attention.num_kv_heads=3"):
        AttentionConfig(num_kv_heads=3).resolved(model)
