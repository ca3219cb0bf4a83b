"""What a record keeps of its job's config: the sections and keys its task reads, its workload
option's own fields, the attention fields its layout uses. Frozen here as the records of every task,
workload option and attention kind were written before each workload option had a dataclass of
its own: a key added to or dropped from a record changes its schema (raise
kvbench.results.SCHEMA_VERSION and keep reading the old one)."""

from dataclasses import asdict, fields

import pytest
from conftest import compose

from kvbench.config.bench import TASKS
from kvbench.config.model import ModelConfig
from kvbench.config.record import MODEL_ABSENT_AS_BEFORE
from kvbench.config.workload import WORKLOADS
from kvbench.jobs.job_config import to_bench_config
from kvbench.jobs.runner import TASKS as TASK_CODE
from kvbench.jobs.runner import _as_given
from kvbench.results import record_config
from kvbench.tasks.bench import WORKLOADS as WORKLOAD_CODE

TIMED = ("compile device dtype expert_parallel fidelity graph_bucket isolate min_time_s nvml_interval_ms "
         "peak_gb_per_s probe repeats seed tensor_parallel threads warmup")
TRAIN = ("batch_size eval_batches eval_every grad_clip init_from log_every lr min_lr_ratio seq_len steps warmup_steps "
         "weight_decay")
MLA = "kv_lora_rank mla_decode num_kv_heads q_lora_rank qk_nope_head_dim qk_rope_head_dim type v_head_dim"
WANDB = "entity group init_timeout_s mode project tags"
WANDB_GIVEN = "entity group mode project tags"  # conf/wandb's files: init_timeout_s is the schema's default
SERVING = ("allocator arrival burstiness duration_s kv_budget_blocks kv_budget_mb max_prefill_tokens max_running "
           "name num_requests output prefix_caching prefix_fraction prefix_groups prefix_len prompt rate search seed "
           "slot_len state_checkpoint state_checkpoint_tokens store trace")
CONVERSATIONS = SERVING + " sharegpt think turns"
SLO = "e2e_ms name stat tpot_ms tpot_x_batch1 ttft_ms"
TOP = {"rerun": None, "objective": None, "objective_caps": ""}

# overrides (with model=tiny) -> section -> its keys, sorted ("": an empty section; None: a value)
VALID = {
    'task=bench': {
        'attention': 'num_kv_heads type', 'workload': 'batch_size gen_len name prompt_len', 'cache': 'dtype impl',
        'runtime': TIMED, 'wandb': WANDB, **TOP},
    'task=bench workload=multiturn': {
        'attention': 'num_kv_heads type', 'workload': 'batch_size name reply_len system_len turns user_len',
        'cache': 'dtype impl shared', 'runtime': TIMED, 'wandb': WANDB, **TOP},
    'task=bench workload=serving': {
        'attention': 'num_kv_heads type', 'workload': SERVING, 'cache': 'block_size dtype', 'runtime': TIMED,
        'wandb': WANDB, 'slo': SLO, **TOP},
    'task=bench workload=conversations': {
        'attention': 'num_kv_heads type', 'workload': CONVERSATIONS, 'cache': 'block_size dtype', 'runtime': TIMED,
        'wandb': WANDB, 'slo': SLO, **TOP},
    'task=capacity runtime.memory_budget_gb=1': {
        'attention': 'num_kv_heads type', 'workload': 'gen_len name', 'cache': 'dtype impl',
        'runtime': TIMED + ' memory_budget_gb', 'wandb': WANDB, 'slo': SLO,
        'capacity': 'batch_step context_lens copy_prompts gpus_per_node max_batch plan prefill_chunk tpot_pairs',
        **TOP},
    'task=capacity workload=multiturn runtime.memory_budget_gb=1': {
        'attention': 'num_kv_heads type', 'workload': 'name reply_len system_len turns user_len',
        'cache': 'dtype impl shared', 'runtime': TIMED + ' memory_budget_gb', 'wandb': WANDB, 'slo': SLO,
        'capacity': 'batch_step gpus_per_node max_batch', **TOP},
    'task=compare': {
        'workload': 'batch_size', 'cache': 'impl', 'runtime': TIMED, 'wandb': WANDB,
        'compare': 'contexts steps variants', **TOP},
    'task=train': {
        'attention': 'num_kv_heads type', 'runtime': 'device dtype seed threads', 'wandb': WANDB,
        'data': 'max_bytes path val_fraction',
        'train': TRAIN,
        **TOP},
    'task=eval': {
        'attention': 'num_kv_heads type', 'cache': 'dtype', 'runtime': 'device dtype seed threads', 'wandb': WANDB,
        'data': 'max_bytes path val_fraction', 'train': 'batch_size checkpoint eval_batches seq_len', **TOP},
    'task=recall': {
        'attention': 'num_kv_heads type', 'cache': 'dtype', 'runtime': 'device dtype seed threads', 'wandb': WANDB,
        'train': 'batch_size eval_every grad_clip log_every lr min_lr_ratio steps warmup_steps weight_decay',
        'recall': 'digits distances eval_sequences kind num_pairs seeds seq_len uptrain_steps vocab_size', **TOP},
    'task=bench attention=mla': {
        'attention': MLA,
        'workload': 'batch_size gen_len name prompt_len', 'cache': 'dtype impl', 'runtime': TIMED, 'wandb': WANDB,
        **TOP},
    'task=bench attention=gqa attention.window=64 attention.global_every=2': {
        'attention': 'global_every layer_types num_kv_heads type window',
        'workload': 'batch_size gen_len name prompt_len', 'cache': 'dtype impl', 'runtime': TIMED, 'wandb': WANDB,
        **TOP},
    'task=bench attention=gqa attention.sinks=true': {
        'attention': 'num_kv_heads sinks type', 'workload': 'batch_size gen_len name prompt_len',
        'cache': 'dtype impl', 'runtime': TIMED, 'wandb': WANDB, **TOP},
    'task=train attention=mla': {
        'attention': MLA,
        'runtime': 'device dtype seed threads', 'wandb': WANDB, 'data': 'max_bytes path val_fraction',
        'train': TRAIN,
        **TOP},
}
INVALID = {
    'task=bench workload.batch_size=0': {
        'attention': 'num_kv_heads type', 'workload': 'batch_size gen_len name prompt_len', 'cache': 'dtype impl',
        'runtime': TIMED, 'wandb': WANDB_GIVEN, **TOP},
    'task=bench workload=serving workload.rate=-1': {
        'attention': 'num_kv_heads type', 'workload': SERVING, 'cache': 'dtype', 'runtime': TIMED,
        'wandb': WANDB_GIVEN, 'slo': SLO, **TOP},
    'task=capacity workload=multiturn workload.turns=0': {
        'attention': 'num_kv_heads type', 'workload': 'name reply_len system_len turns user_len',
        'cache': 'dtype impl shared', 'runtime': TIMED + ' memory_budget_gb', 'wandb': WANDB_GIVEN, 'slo': SLO,
        'capacity': 'batch_step gpus_per_node max_batch', **TOP},
    'task=train train.lr=-1': {
        'attention': 'num_kv_heads type', 'runtime': 'device dtype seed threads', 'wandb': WANDB_GIVEN,
        'data': 'max_bytes path val_fraction',
        'train': TRAIN,
        **TOP},
    'task=compare compare.steps=0': {
        'workload': 'batch_size', 'cache': 'impl', 'runtime': TIMED, 'wandb': WANDB_GIVEN,
        'compare': 'contexts steps variants', **TOP},
    'experiment=choose scenario=decode runtime.memory_budget_gb=-1': {
        'attention': 'num_kv_heads type', 'workload': 'gen_len name', 'cache': 'dtype impl',
        'runtime': TIMED + ' memory_budget_gb', 'wandb': WANDB_GIVEN, 'slo': SLO,
        'capacity': 'batch_step context_lens copy_prompts gpus_per_node max_batch plan prefill_chunk tpot_pairs',
        **TOP},
    'experiment=choose scenario=chat runtime.memory_budget_gb=-1': {
        'attention': 'num_kv_heads type', 'workload': 'name reply_len system_len turns user_len',
        'cache': 'dtype impl shared', 'runtime': TIMED + ' memory_budget_gb', 'wandb': WANDB_GIVEN, 'slo': SLO,
        'capacity': 'batch_step gpus_per_node max_batch', **TOP},
}


def key_sets(config):
    return {k: " ".join(sorted(v)) if isinstance(v, dict) else None for k, v in config.items() if k != "model"}


def expected(sections):
    return {"task": None, **{k: " ".join(sorted(v.split())) if isinstance(v, str) else v for k, v in sections.items()}}


@pytest.mark.parametrize("overrides", list(VALID))
def test_a_valid_jobs_record_keeps_what_its_task_reads(overrides):
    config = asdict(to_bench_config(compose("model=tiny", *overrides.split())))
    kept = record_config(config)
    assert key_sets(kept) == expected(VALID[overrides])
    # the whole model, but for the switches of newer layouts at the value every older record meant
    default = {k for k, v in MODEL_ABSENT_AS_BEFORE.items() if config["model"][k] == v}
    assert kept["model"] == {k: v for k, v in config["model"].items() if k not in default}
    assert set(kept["model"]) | default == {f.name for f in fields(ModelConfig)}
    assert list(kept) == [k for k in config if k in kept]  # in the config's order


@pytest.mark.parametrize("overrides", list(INVALID))
def test_an_invalid_jobs_record_keeps_what_its_task_reads_of_the_config_as_given(overrides):
    given = _as_given(compose("model=tiny", *overrides.split()))
    kept = record_config(given)
    assert key_sets(kept) == expected(INVALID[overrides])
    assert kept["model"] == given["model"]


def test_a_config_of_an_unknown_task_keeps_everything():
    given = _as_given(compose("model=tiny"))
    assert record_config({**given, "task": "nope"}) == {**given, "task": "nope"}


def test_every_task_and_workload_is_declared_where_its_code_is_registered():
    """A task= value's reads (config.bench.TASKS) and its code (jobs.runner.TASKS; task=inspect
    prints in the CLI), a workload= option's dataclass and its code: one name, both sides."""
    assert set(TASKS) - {"inspect"} == set(TASK_CODE)
    assert set(WORKLOADS) == set(WORKLOAD_CODE)
