"""experiment=layouts, experiment=choose and experiment=recall expand to the jobs their YAML and
their committed results say, each with a Gated DeltaNet hybrid (and DSA and KV sharing where a
compare takes them); the committed results' tables regenerate from the committed records by the
report code."""

import itertools
import re
from pathlib import Path

import pytest
from conftest import compose

from kvbench.config.layer_pattern import variant_label
from kvbench.core.errors import ConfigError
from kvbench.jobs.job_config import to_bench_config

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"


def sweep_jobs(experiment: str):
    """Each job's overrides, as Hydra's basic sweeper expands the experiment's sweeper params."""
    params = compose(f"experiment={experiment}", hydra=True).hydra.sweeper.params
    axes = [[f"{key}={value}" for value in str(values).split(",")] for key, values in params.items()]
    return [[f"experiment={experiment}", *job] for job in itertools.product(*axes)]


def test_layouts_times_eight_layouts_the_new_ones_beside_the_old():
    cfg = to_bench_config(compose("experiment=layouts"))
    labels = [variant_label(a, num_layers=cfg.model.num_layers) for a in cfg.compare.attentions(cfg.model)]
    assert labels == ["mha kv=16", "gqa kv=4", "mla r=256", "mha kv=16 w=1024 5:1", "mha kv=16 gdn 2:1",
                      "mla r=256 topk=1024", "mha kv=16 kvshare=2", "mha kv=16 w=1024 5:1 k=v",
                      "mha kv=16 kda 2:1", "mha kv=16 w=1024 5:1 chunk=1024"]
    # three contexts or more on each side of W = k = 1024: a slope below and past both
    assert sum(c <= 1024 for c in cfg.compare.contexts) >= 3 and sum(c >= 1024 for c in cfg.compare.contexts) >= 3


def test_choose_is_21_jobs_and_only_the_shared_chats_of_the_recurrent_hybrids_are_refused():
    """Seven variants x decode, chat, chat_shared; a Gated DeltaNet or KDA state is each sequence's
    own, so their shared chats are refused in one line when the job starts (the sweep goes on)."""
    jobs = sweep_jobs("choose")
    assert len(jobs) == 21
    refused, typed = [], {}
    for overrides in jobs:
        try:
            cfg = typed[tuple(overrides)] = to_bench_config(compose(*overrides))
        except ConfigError as exc:
            refused.append((overrides, str(exc)))
            continue
        assert cfg.task == "capacity" and cfg.capacity.context_lens == [32, 64, 128, 256]
    assert [overrides[1:] for overrides, _ in refused] == [["attention=choose/gdn", "scenario=chat_shared"],
                                                           ["attention=choose/kda", "scenario=chat_shared"]]
    for (_, line), title in zip(refused, ("Gated DeltaNet", "KDA")):
        assert line.startswith("cache.shared=True") and "\n" not in line and title in line
    overrides = refused[0][0]
    gdn = typed[(overrides[0], "attention=choose/gdn", "scenario=decode")]  # the hybrid's decode job
    assert gdn.attention.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"]
    kda = typed[(overrides[0], "attention=choose/kda", "scenario=decode")]  # Kimi Linear's 3:1 of the same model
    assert kda.attention.layer_types == [t.replace("linear_attention", "kda") for t in gdn.attention.layer_types]
    assert kda.attention.num_kv_heads == gdn.attention.num_kv_heads == 2


def test_recall_trains_eight_variants_two_of_them_gated_deltanet_one_kda():
    jobs = sweep_jobs("recall")
    attentions = [job[1].split("=", 1)[1] for job in jobs]
    assert attentions == ["mha", "gqa", "mqa", "recall/mla", "recall/swa", "recall/gdn", "recall/gdn_pure",
                          "recall/kda"]
    kinds = [to_bench_config(compose(*job)).attention.layer_types for job in jobs[-3:]]
    assert kinds == [["linear_attention", "full_attention"], ["linear_attention"] * 2, ["kda", "full_attention"]]


@pytest.mark.parametrize("directory", ["layouts_compare", "layouts_kda", "choose", "recall/mqar"])
def test_the_committed_reports_regenerate_from_the_committed_records(directory, tmp_path):
    """summary.md under experiments/results is what the report code writes from the records
    beside it today (the directory line and the plots' paths aside)."""
    import shutil

    from kvbench.sinks.report import write_report

    src = RESULTS / directory
    dst = tmp_path / "copy"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.png", "summary.*", "README.md"))
    write_report(dst, dst)

    def body(path: Path) -> str:
        text = path.read_text()
        return re.sub(r"^# kvbench report: .*$", "", text, count=1, flags=re.M)

    assert body(dst / "summary.md") == body(src / "summary.md")


@pytest.mark.parametrize("entry, label, global_tensors", [("choose/chunked", "gqa kv=2 w=64 3:1 chunk=64", 2),
                                                          ("choose/k_eq_v", "gqa kv=2 w=64 3:1 k=v", 1)])
def test_choose_takes_a_chunked_and_a_k_eq_v_hybrid_by_their_labels_and_bytes(entry, label, global_tensors):
    """attention=choose/chunked (Llama 4's local layers) and choose/k_eq_v (Gemma 4's global layers) on
    choose's model (8 layers, 2 KV heads of 256 / 8 = 32): the label; what a sequence holds by hand, 2 global
    layers of every position (K and V, or K=V's one tensor) and 6 local ones of 64 at the most (a chunk's
    worst case is its window's); their shared chats refused in one line; an invalid job's record (its
    attention unresolved) keeps the pattern and names the variant as its ok jobs do."""
    from kvbench.config.layer_pattern import job_variant_label, variant_label
    from kvbench.config.record import attention_record
    from kvbench.core.dtypes import DTYPE_BYTES
    from kvbench.tasks.capacity_search import kv_bytes

    cfg = to_bench_config(compose("experiment=choose", f"attention={entry}", "scenario=decode"))
    assert job_variant_label(cfg) == label
    element, gen = DTYPE_BYTES[cfg.runtime.dtype], cfg.workload.gen_len
    for context in (32, 64, 128, 256):
        L = context + gen
        want = 2 * global_tensors * 2 * 32 * L + 6 * 2 * 2 * 32 * min(L, 64)
        assert kv_bytes(cfg, context, 3) == 3 * want * element
    with pytest.raises(ConfigError) as info:
        to_bench_config(compose("experiment=choose", f"attention={entry}", "scenario=chat_shared"))
    assert str(info.value).startswith("cache.shared=True: ") and "\n" not in str(info.value)
    asked = dict(compose("experiment=choose", f"attention={entry}").attention)  # as an invalid job's record has it
    kept = attention_record({k: v for k, v in asked.items() if v is not None})
    assert kept["global_every"] == 4 and variant_label({**kept, "num_kv_heads": 2}, num_layers=8) == label
