"""Hostile and careless input to the layouts and tasks added since round 3:
multi-head latent attention's ranks, sliding windows and layer patterns, task=recall's knobs, the
large presets on a CPU, and kvbench-report on malformed recall records. Each is one line naming
the key and the value (a ConfigError: the job is ``invalid``, a single run exits 2), sized from
the config before anything is built; a malformed record is left out of the report, never a crash.
In process, through the config path the CLI composes (tests/conftest.compose)."""

import json
from pathlib import Path

import pytest
import torch
from conftest import compose
from omegaconf import OmegaConf

import kvbench.footprint as footprint
import kvbench.jobs.runner as runner
from kvbench.core.errors import ConfigError
from kvbench.footprint import check_fits, job_footprint
from kvbench.jobs.job_config import to_bench_config
from kvbench.jobs.runner import run_job
from kvbench.results import RecordError, read_record, record_config
from kvbench.sinks.report import MD_FILE, write_report

FAST = ["wandb=disabled", "runtime.isolate=false", "workload.prompt_len=8", "workload.gen_len=2",
        "runtime.warmup=0", "runtime.repeats=1"]
GiB = 2**30


def refusal(*overrides: str) -> str:
    """The one line a job composed from ``overrides`` is refused with (config and footprint)."""
    with pytest.raises(ConfigError) as info:
        check_fits(to_bench_config(compose(*FAST, *overrides)), torch.device("cpu"))
    [line] = str(info.value).splitlines()
    return line


@pytest.fixture
def laptop(monkeypatch):
    """A machine with 8 GiB available, whatever this one has; a task that starts is a failure
    (the footprint let it through), not a 100 GB build on a shared test machine."""
    monkeypatch.setattr(footprint, "available_bytes", lambda device: 8 * GiB)

    def built(*args, **kwargs):
        raise AssertionError("the task started: the footprint did not refuse it")

    for task in runner.TASKS.values():
        monkeypatch.setattr(task, "run", built)


# ---- multi-head latent attention ----------------------------------------------------------

@pytest.mark.parametrize("override, why", [
    ("attention.kv_lora_rank=0", "must be >= 1"),
    ("attention.kv_lora_rank=-4", "must be >= 1"),
    ("attention.kv_lora_rank=1.5", "could not be converted to Integer"),
    ("attention.qk_rope_head_dim=3", "must be even and >= 2"),
    ("attention.qk_rope_head_dim=0", "must be even and >= 2"),
    ("attention.q_lora_rank=-1", "must be >= 0"),
    ("attention.v_head_dim=0", "must be >= 1"),
    ("attention.num_kv_heads=4", "one latent head per token"),
    ("attention.mla_decode=foo", "must be one of absorbed, expanded"),
    ("attention.global_every=2", "there is no window"),  # MLA with a window is a ring of latents (test_mla_window.py)
])
def test_an_mla_rank_out_of_range_is_one_line_naming_it(override, why):
    line = refusal("model=tiny", "attention=mla", override)
    key, value = override.split("=")
    assert line.startswith(f"{key}=") and value in line.split(":")[0] and why in line


def test_an_mla_rank_on_another_layout_is_refused():
    assert refusal("model=tiny", "attention=gqa", "attention.kv_lora_rank=8").startswith(
        "attention.kv_lora_rank=8: is a multi-head latent attention rank; attention.type=gqa has none")


@pytest.mark.parametrize("override", ["attention.kv_lora_rank=1000000000000", "attention.qk_rope_head_dim=1000000000",
                                      "attention.v_head_dim=100000000"])
def test_a_huge_mla_rank_is_refused_before_the_build_naming_the_rank(laptop, override):
    """The footprint's line named only model keys, not the rank that made 1404 TiB of weights."""
    line = refusal("model=tiny", "attention=mla", override)
    assert override in line and "nothing was built" in line


def test_the_footprint_of_an_mla_cache_is_its_latent():
    """The footprint counted K and V heads of head_dim (1.25 KiB for a rank of 10^12): MLA's cache
    is one latent of kv_lora_rank + qk_rope_head_dim per token and layer."""
    job = to_bench_config(compose(*FAST, "model=tiny", "attention=mla", "attention.kv_lora_rank=24",
                                  "attention.qk_rope_head_dim=6", "workload.batch_size=3"))
    by_hand = job.model.num_layers * (8 + 2) * 3 * (24 + 6) * 4  # layers x positions x B x (R + rope) x fp32
    assert job_footprint(job).kv_cache == by_hand


# ---- sliding windows and layer patterns ---------------------------------------------------

@pytest.mark.parametrize("overrides, line_start, why", [
    (["attention.window=-1"], "attention.window=-1:", "must be >= 1 positions, 0 (no window) or null"),
    (["attention.window=1.5"], "attention.window=1.5:", "could not be converted to Integer"),
    (["attention.window=abc"], "attention.window='abc':", "could not be converted to Integer"),
    (["attention.window=100000"], "attention.window=100000:", "must be <= model.max_seq_len=4096"),
    (["attention.window=8", "attention.global_every=-1"], "attention.global_every=-1:", "must be >= 0"),
    (["attention.global_every=2"], "attention.global_every=2:", "there is no window: model tiny has none"),
    (["attention.layer_types=[sliding_attention,full_attention]"], "attention.layer_types=",
     "there is no window"),
    (["attention.window=8", "attention.layer_types=[sliding_attention]"], "attention.layer_types=",
     "must name each of model.num_layers=2 layers"),
    (["attention.window=8", "attention.layer_types=[foo,bar]"], "attention.layer_types=",
     "each entry must be one of sliding_attention, full_attention"),
    (["attention.window=8", "attention.layer_types=sliding_attention"], "attention.layer_types='sliding_attention':",
     "must be a list (brackets: [a,b])"),
    (["attention.window=8", "attention.global_every=2", "attention.layer_types=[sliding_attention,full_attention]"],
     "attention.global_every=2:", "both say which layers are local"),
    (["attention.window=8", "cache=concat"], "cache.impl='concat':", "use cache.impl=static"),
])
def test_a_bad_window_or_layer_pattern_is_one_line_naming_it(overrides, line_start, why):
    line = refusal("model=tiny", *overrides)
    assert line.startswith(line_start) and why in line


def test_a_window_of_zero_or_a_pattern_beside_an_explicit_window_runs():
    """What stays valid: 0 (no window) with a pattern (a sweep over windows 0 and W keeps one
    pattern), and a pattern applied to the model's own window (gemma3's, 1024)."""
    job = to_bench_config(compose(*FAST, "model=tiny", "attention.window=0", "attention.global_every=2"))
    assert job.attention.layer_windows(job.model.num_layers) == [None, None]
    job = to_bench_config(compose(*FAST, "model=gemma3_27b", "attention.global_every=2"))
    assert job.attention.layer_windows(4)[:2] == [1024, None]


# ---- what a task reads is what a layout may refuse ------------------------------------------

# A cache kind and a compiled step a windowed and a Gated DeltaNet layer refuse (and a quantized cache).
UNRUN = [["attention.window=8", "cache.impl=concat", "runtime.compile=graph"],
         ["attention.full_attention_interval=2", "cache.dtype=int8", "runtime.compile=graph"]]


@pytest.mark.parametrize("task", ["train", "recall", "eval", "compare", "bench", "capacity", "inspect"])
def test_a_layout_is_refused_only_the_settings_its_task_reads(task):
    """Each setting a layer's Limit is asked about is a key the task's record keeps (what it reads,
    results.record_config): a training job that builds no cache is not refused cache.impl=concat."""
    job = to_bench_config(compose("model=tiny", f"task={task}"))
    kept = record_config(OmegaConf.to_container(compose("model=tiny", f"task={task}"), resolve=True))
    for key in job.layout_settings():
        if "." in key:  # else the task's own setting (recall's kv_conversion)
            section, name = key.split(".")
            assert name in kept.get(section, {}), (task, key)
    asked = {f"{section}.{name}" for section in ("cache", "runtime") for name in kept.get(section, {})}
    assert asked & {"cache.impl", "cache.dtype", "runtime.compile"} <= set(job.layout_settings())


@pytest.mark.parametrize("unrun", UNRUN)
@pytest.mark.parametrize("task", ["train", "recall"])
def test_a_task_that_builds_no_cache_runs_any_layout_beside_any_cache_setting(task, unrun):
    job = to_bench_config(compose("model=tiny", f"task={task}", *unrun))
    # recall.uptrain_steps=null: no conversion either; task=recall scores through a static cache of
    # cache.dtype (issue 57), so that one setting is asked, never its cache.impl nor a compiled step
    assert job.layout_settings() == ({"cache.dtype": job.cache.dtype} if task == "recall" else {})
    with pytest.raises(ConfigError, match="^(cache.impl='concat'|cache.dtype='int8'|runtime.compile='graph')"):
        to_bench_config(compose("model=tiny", "task=bench", *unrun))


@pytest.mark.parametrize("overrides, line", [
    (["task=bench", "cache.impl=concat"], "cache.impl='concat': keeps every position; with attention.window=8"),
    (["task=capacity", "runtime.compile=graph"], "runtime.compile='graph': is not supported with a sliding window"),
    (["task=compare", "runtime.compile=graph"], "runtime.compile='graph': task=compare times eager steps only"),
])
def test_a_task_that_reads_the_setting_is_refused_it(overrides, line):
    assert refusal("model=tiny", "attention.window=8", *overrides).startswith(line)


def test_each_compare_variant_is_checked_against_its_layers_limits(monkeypatch):
    """A variant's layers' Limits refuse what the job runs it with, naming the variant."""
    from kvbench.layouts.base import LayerLayout, Limit

    own = LayerLayout._window_limits
    monkeypatch.setattr(LayerLayout, "_window_limits", lambda self: own(self) + (
        () if self.window is None else (Limit("cache.impl", ("none",), "refused for the test"),)))
    line = refusal("model=tiny", "task=compare", "compare.variants=[mha,mha:w8]", "compare.contexts=[8]")
    assert line == "compare.variants=['mha', 'mha:w8']: 'mha:w8': cache.impl='static': refused for the test"
    to_bench_config(compose(*FAST, "model=tiny", "task=compare", "compare.variants=[mha,gqa]", "compare.contexts=[8]"))


def test_eval_checks_the_checkpoints_layers_before_it_reads_any_data(tmp_path, monkeypatch):
    """task=eval's shape is its checkpoint's: its layers' Limits are asked once the checkpoint is read,
    before a batch is scored."""
    from kvbench.quality import train

    run_job(compose("model=tiny", "task=train", "attention.full_attention_interval=2", "train.steps=1",
                    "train.eval_batches=1", "wandb=disabled", "runtime.isolate=false"), tmp_path / "train")
    cfg = to_bench_config(compose("model=tiny", "task=eval", f"train.checkpoint={tmp_path / 'train' / 'checkpoint.pt'}",
                                  "cache.dtype=nvfp4", "wandb=disabled"))
    monkeypatch.setattr(train, "evaluate", lambda *a, **k: pytest.fail("scored a batch"))
    blocks = r"^cache.dtype='nvfp4': stores blocks of 16 values of a head, and head_dim=8 is not"
    with pytest.raises(ConfigError, match=blocks):
        train.run_eval(cfg, torch.device("cpu"))


# ---- task=recall --------------------------------------------------------------------------

RECALL = ["experiment=recall", "hydra.mode=RUN"]


@pytest.mark.parametrize("override, line_start, why", [
    ("recall.num_pairs=[100000]", "recall.num_pairs=[100000]:", "need recall.vocab_size >= 200002"),
    ("recall.num_pairs=[31]", "recall.seq_len=[40]:", "31 pairs and their queries need 93 positions"),
    ("recall.seeds=0", "recall.seeds=0:", "must be >= 1"),
    ("recall.num_pairs=4", "recall.num_pairs=4:", "must be a list (brackets: [a,b])"),
    ("recall.num_pairs=[4,4]", "recall.num_pairs=[4, 4]:", "lists a value twice"),
    ("recall.uptrain_steps=-3", "recall.uptrain_steps=-3:", "must be >= 0 or null"),
])
def test_a_recall_knob_out_of_range_is_one_line_naming_it(override, line_start, why):
    line = refusal(*RECALL, override)
    assert line.startswith(line_start) and why in line


def test_a_passkey_distance_past_the_sequence_is_one_line():
    line = refusal(*RECALL, "recall.kind=passkey", "recall.seq_len=[40]", "recall.distances=[100]")
    assert line.startswith("recall.distances=[100]: must be in [5, 35]")


@pytest.mark.parametrize("override, named", [
    ("recall.vocab_size=1000000000", "recall.vocab_size=1000000000"),      # a 5 TB allocation: oom
    ("recall.eval_sequences=1000000000", "recall.eval_sequences=1000000000"),  # 1.2 TB of held-out sets
])
def test_a_recall_that_cannot_fit_is_invalid_before_anything_is_built(laptop, tmp_path, override, named):
    """Both were ``oom`` after torch tried the allocation: the recall model has the task's
    vocabulary (the footprint sized model.vocab_size's), and the held-out sets were not counted."""
    result = run_job(compose(*FAST, *RECALL, override), tmp_path)
    assert result.status == "invalid", result.error
    [line] = result.error.splitlines()
    assert named in line and "nothing was built" in line


def test_the_recall_footprint_counts_the_tasks_vocabulary_and_its_held_out_sets():
    job = to_bench_config(compose(*FAST, *RECALL, "recall.vocab_size=1000", "recall.eval_sequences=100"))
    need = job_footprint(job)
    small = job_footprint(to_bench_config(compose(*FAST, *RECALL, "recall.eval_sequences=100")))
    d = job.model.d_model
    # embedding and output layer of 1000 - 64 more tokens (not tied), 4 bytes a parameter as built
    assert need.weights - small.weights == 2 * (1000 - 64) * d * 4
    # every held-out set at once: 100 rows x 40 positions x (inputs + targets) x int64, per condition
    assert need.data == max(100 * len(job.recall.num_pairs) * 40 * 2 * 8, 100 * (1000 // 2 - 1) * 12)


# ---- the large presets on a CPU -----------------------------------------------------------

@pytest.mark.parametrize("preset", ["deepseek_v3", "gemma3_27b", "gpt_oss_120b"])
def test_a_large_preset_on_a_laptop_is_one_line_invalid_from_the_footprint(laptop, tmp_path, preset):
    """task=bench of each on a machine with 8 GiB available: ``invalid`` with the weights and
    the memory available, before a byte is built (gpt_oss_120b with its 128 experts per layer:
    116.8 B parameters, 435 GiB of weights as built; its dense stand-in of 3.0 B once fit)."""
    result = run_job(compose(*FAST, f"model={preset}", "task=bench"), tmp_path)
    assert result.status == "invalid", result.error
    [line] = result.error.splitlines()
    assert "nothing was built" in line and "8.00 GiB cpu memory available" in line
    job = to_bench_config(compose(*FAST, f"model={preset}"))
    assert job_footprint(job).weights == footprint.parameter_count(job.model, job.attention) * 4


# ---- kvbench-report on malformed recall records -------------------------------------------

GOOD_ROW = {"stage": "final", "kind": "mqar", "num_pairs": 4, "seq_len": 40, "per_seed": [0.5, 0.75]}


def _recall_record(kv: int, accuracy, seeds=2) -> dict:
    return {"status": "ok", "config": {"task": "recall", "model": {"name": "tiny"}, "runtime": {"seed": 0},
                                       "attention": {"type": "mha" if kv == 4 else "mqa", "num_kv_heads": kv},
                                       "recall": {"kind": "mqar", "seeds": seeds}},
            "metrics": {"chance_accuracy": 0.03}, "tables": {"accuracy": accuracy}}


@pytest.mark.parametrize("bad, seeds", [
    ([{k: v for k, v in GOOD_ROW.items() if k != "per_seed"}], 2),   # KeyError
    ([{**GOOD_ROW, "per_seed": "0.5"}], 2),                           # ValueError in the interval
    ([{**GOOD_ROW, "per_seed": ["x", None]}], 2),
    ([{**GOOD_ROW, "stage": 3}], 2),                                  # AttributeError
    ([{**GOOD_ROW, "per_seed": [1e308, -1e308]}], 2),                 # an accuracy is in [0, 1]
    ([{**GOOD_ROW, "seq_len": "forty"}], 2),
    ([GOOD_ROW], "three"),             # TypeError on the seeds; now the config's type: unreadable
])
def test_report_leaves_out_a_malformed_recall_record_and_says_so(tmp_path, bad, seeds):
    for name, record in (("0", _recall_record(4, [GOOD_ROW])), ("1", _recall_record(1, [GOOD_ROW])),
                         ("2", _recall_record(1, bad, seeds))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(record))
    write_report(tmp_path, plots=False)
    text = (tmp_path / MD_FILE).read_text()
    if isinstance(seeds, int):
        assert "1 recall record left out: its accuracy table is malformed" in text
    else:  # recall.seeds is an int in the schema: the record is not read at all
        assert "1 unreadable" in text and "config.recall.seeds has type str" in text
    assert "0.625" in text  # the two good records are still compared (mean of 0.5 and 0.75)


def test_report_of_good_recall_records_says_nothing_is_left_out(tmp_path):
    for name, kv in (("0", 4), ("1", 1)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(_recall_record(kv, [GOOD_ROW])))
    write_report(tmp_path, plots=False)
    assert "left out" not in Path(tmp_path / MD_FILE).read_text()


# ---- kvbench-report on records of the wrong type, of every kind ---------------------------

COMMITTED = Path(__file__).resolve().parents[1] / "experiments" / "results"


def _copy_sweep(name: str, tmp_path: Path) -> list:
    """The committed sweep ``name`` copied to tmp_path; its records as dicts, in job order."""
    paths = sorted((COMMITTED / name).glob("*/results.json"))
    for path in paths:
        (tmp_path / path.parent.name).mkdir()
        (tmp_path / path.parent.name / "results.json").write_bytes(path.read_bytes())
    return [json.loads(p.read_text()) for p in paths]


def _set(record: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    node = record
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = value


@pytest.mark.parametrize("sweep, dotted, value, unreadable", [
    ("mla_small", "config.model.name", [1, "a"], True),            # TypeError: unhashable (report.py)
    ("mla_small", "config.attention.num_kv_heads", {"a": 1}, True),  # TypeError in the variants' order
    ("choose", "config.train", True, True),                          # AttributeError
    ("choose", "metrics.max_batch_longest", -1, False),              # ValueError: max() of nothing
    ("choose", "tables.capacity.0.context", None, False),            # TypeError: int > None
])
def test_report_on_a_record_of_the_wrong_type_or_meaning_never_crashes(tmp_path, sweep, dotted, value, unreadable):
    """A record read back is checked: an ok record whose config holds another type than the
    schema's is unreadable (its row says so, as for a torn file); a capacity figure that is no
    count is left out of the recommendations. Each crashed kvbench-report before."""
    records = _copy_sweep(sweep, tmp_path)
    _set(records[0], dotted, value)
    first = sorted(tmp_path.iterdir())[0]
    (first / "results.json").write_text(json.dumps(records[0]))
    write_report(tmp_path, plots=False)
    text = (tmp_path / MD_FILE).read_text()
    assert ("unreadable" in text) == unreadable
    if unreadable:
        with pytest.raises(RecordError, match=dotted.replace(".", r"\.") + " has type"):
            read_record(first)
