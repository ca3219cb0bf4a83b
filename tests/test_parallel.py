"""Tensor parallelism (kvbench/parallel/): a model cut over ranks decodes token-equal to the whole one,
each rank's cache and weights equal the formula written out by hand (K/V heads split, MQA's head and
MLA's latent replicated), and a split the job cannot run is refused in one line.

The ranks here are threads of this process that sum at a barrier (:class:`ThreadRanks`, standing in
for torch.distributed's all-reduce, same order of summation on every rank); the processes, gloo and the
CLI's record are tests/e2e/test_parallel_ranks.py's.
"""

import copy
import threading
from dataclasses import replace

import pytest
import torch

from kvbench.cache import cache_for
from kvbench.config.model import AttentionConfig
from kvbench.core.errors import ConfigError
from kvbench.generate import greedy_generate
from kvbench.jobs.job_config import to_bench_config
from kvbench.layouts.build import build_layouts
from kvbench.layouts.kinds import registered
from kvbench.model import Decoder
from kvbench.parallel.plan import Split, check_parallel, rank_kv
from kvbench.parallel.tensor import RankGroup, rank_weight_bytes, shard_decoder
from kvbench.quant_weights import checkpoint_bytes
from kvbench.tasks.common import build_model
from kvbench.units import human_bytes
from tests.conftest import compose, tiny_model_config

B, PROMPT, STEPS, RANKS = 2, 5, 6, 2


class ThreadRanks(RankGroup):
    """A rank of threads in one process: the all-reduce is a sum of every rank's tensor at a barrier."""

    def __init__(self, rank, ranks, shared):
        super().__init__(rank, ranks)
        self.shared = shared

    def all_reduce(self, out):
        slots, barrier = self.shared
        slots[self.rank] = out.clone()
        barrier.wait()
        total = sum(slots)  # rank 0's part first on every rank
        barrier.wait()
        self.calls += 1
        return out.copy_(total)

    def all_gather(self, part):
        slots, barrier = self.shared
        slots[self.rank] = part.clone()
        barrier.wait()
        whole = torch.cat(slots, -1)
        barrier.wait()
        self.calls += 1
        return whole


def run_ranks(model, prompt, ranks=RANKS, expert_parallel=1, steps=STEPS):
    """Greedy decode of ``steps`` tokens after ``prompt`` (B, T) by ``model`` cut over ``ranks`` thread
    ranks (the experts by expert with ``expert_parallel``): per rank (tokens, cache bytes, weight bytes)."""
    shared = ([None] * ranks, threading.Barrier(ranks))
    outs = [None] * ranks

    def rank(r):
        part = shard_decoder(copy.deepcopy(model), ranks, r, expert_parallel, ThreadRanks(r, ranks, shared))
        cache = cache_for(part, "static", prompt.shape[0], prompt.shape[1] + steps + 1)
        tokens = greedy_generate(part, prompt, steps, cache).tokens
        outs[r] = (tokens, cache.nbytes, checkpoint_bytes(part, None))  # its weights and persistent buffers

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs


def check_ranks_decode_as_one_process(model, prompt, steps, ranks=RANKS):
    """``model`` cut over ``ranks`` thread ranks decodes ``steps`` greedy tokens after ``prompt`` token-equal to
    the whole; each rank's cache allocates the per-GPU formula's bytes (rank_kv), between 1 / ranks of the
    whole's and all of it, and rank 0's weights are what rank_weight_bytes counts on the meta device (the
    others' at most that: the last rank's share of a vocabulary may be smaller). The check
    every registered kind's examples run (tests/test_layer_kinds.py) and its decode_examples (below)."""
    B, S = prompt.shape[0], prompt.shape[1] + steps + 1
    cache = cache_for(model, "static", B, S)
    whole = greedy_generate(model, prompt, steps, cache)
    formula = rank_kv(model.layouts, ranks, S, torch.finfo(model.dtype).bits // 8).per_sequence * B
    assert cache.nbytes / ranks <= formula <= cache.nbytes
    with torch.device("meta"):
        meta = Decoder(model.config, model.attention, model.state_dtype)
    weights = rank_weight_bytes(meta, Split(ranks))  # rank 0's: the most (a vocabulary's last rank may hold fewer)
    outs = run_ranks(model, prompt, ranks, steps=steps)
    for tokens, cache, rank_weights in outs:
        assert torch.equal(tokens, whole.tokens)
        assert cache == formula
        assert rank_weights <= weights
    assert outs[0][2] == weights


# (attention, model fields): a model of 2 layers, 64 wide, 8 query heads of 8; "bias": the biases a
# row-parallel projection must add once (o_proj's, the MLP's down projection's) and GPT-OSS's sinks
VARIANTS = {"gqa": (AttentionConfig(type="gqa", num_kv_heads=2), {}), "mqa": (AttentionConfig(type="mqa"), {}),
            "mla": (AttentionConfig(type="mla"), {}),
            # ... and a vocabulary of 97: 2 ranks hold 49 + 48 rows (the last rank's logits padded for the gather)
            "bias": (AttentionConfig(type="gqa", num_kv_heads=4, sinks=True),
                     {"o_bias": True, "mlp_bias": True, "vocab_size": 97}),
            # a Gated DeltaNet hybrid: its q | k | v channels cut alike, its state split by heads
            "gdn": (AttentionConfig(type="gqa", num_kv_heads=2, layer_types=["linear_attention", "full_attention"]),
                    {}),
            # Mamba-2 of one group: its heads split, the group's B and C replicated (its norm summed over ranks)
            "mamba2": (AttentionConfig(type="gqa", num_kv_heads=2, layer_types=["mamba", "full_attention"]), {}),
            "kda": (AttentionConfig(type="mla", layer_types=["kda", "full_attention"]), {})}


@pytest.fixture(scope="module")
def decoded():
    """Each variant's (model config, attention, whole greedy decode, its two ranks')."""
    torch.set_num_threads(1)
    out = {}
    for name, (attention, fields) in VARIANTS.items():
        cfg = tiny_model_config(**{"ffn_dim": 128, "vocab_size": 128, **fields})
        attention = attention.resolved(cfg)
        torch.manual_seed(0)
        model = Decoder(cfg, attention).eval()
        prompt = torch.randint(0, cfg.vocab_size, (B, PROMPT), generator=torch.Generator().manual_seed(1))
        whole = greedy_generate(model, prompt, STEPS, cache_for(model, "static", B, PROMPT + STEPS + 1)).tokens
        out[name] = (cfg, attention, whole, run_ranks(model, prompt))
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_ranks_decode_token_equal_to_one_process(decoded, name):
    _, _, whole, ranks = decoded[name]
    for tokens, _, _ in ranks:
        assert torch.equal(tokens, whole)


def test_each_ranks_cache_is_the_formula(decoded):
    """By hand, float32, S = prompt + steps + 1 positions, 2 layers of head_dim 8: GQA's 2 K/V heads split
    (1 a rank), MQA's one head and MLA's latent (kv_lora_rank + qk_rope_head_dim) whole on each rank."""
    S, L, D, f32 = PROMPT + STEPS + 1, 2, 8, 4
    mla = decoded["mla"][1]
    latent = mla.kv_lora_rank + mla.qk_rope_head_dim  # 4 x 8 + 8 / 2 (the defaults of a model without its own)
    assert latent == 36
    expected = {"gqa": 2 * L * 1 * D * S * B * f32, "mqa": 2 * L * 1 * D * S * B * f32,
                "mla": L * latent * S * B * f32, "bias": 2 * L * 2 * D * S * B * f32,
                # GDN (8 key heads, 16 value heads, both 4 wide; a kernel of 4) beside one full layer: half the
                # convolution's q | k | v channels x 3 taps and half the value heads' 4 x 4 states, and 1 K/V head
                "gdn": ((2 * 8 * 4 + 16 * 4) // 2 * 3 + 16 // 2 * 4 * 4) * B * f32 + 2 * 1 * 1 * D * S * B * f32,
                # Mamba-2 (8 heads of 16, one group of state 8, a kernel of 4): 4 heads' x channels and the group's
                # B and C whole (64 + 2 x 8) x 3 taps, 4 heads' 16 x 8 states; GQA's 2 K/V heads split
                "mamba2": ((8 // 2 * 16 + 2 * 8) * 3 + 8 // 2 * 16 * 8) * B * f32 + 2 * 1 * 1 * D * S * B * f32,
                # KDA (8 heads of 8): 4 heads' q, k, v channels x 3 taps and 8 x 8 states; MLA's latent whole
                "kda": (3 * 8 // 2 * 8 * 3 + 8 // 2 * 8 * 8) * B * f32 + latent * S * B * f32}
    for name, nbytes in expected.items():
        assert [cache for _, cache, _ in decoded[name][3]] == [nbytes] * RANKS, name
    # the formula the capacity figures use: the whole model's layouts, each layer's bytes / its tensor_parts
    for name in expected:
        cfg, attention = decoded[name][:2]
        kv = rank_kv(build_layouts(cfg, attention), RANKS, S, f32)
        assert kv.per_sequence * B == expected[name]
        # Mamba-2's group on both ranks: 2 x (80 x 3 + 4 x 16 x 8 + 8 S) over one copy's (144 x 3 + 8 x 16 x 8 + 32 S)
        mamba2 = 2 * (80 * 3 + 512 + 2 * D * S) / (144 * 3 + 1024 + 2 * 2 * D * S)
        assert kv.replication == {"gqa": 1, "mqa": 2, "mla": 2, "bias": 1, "gdn": 1, "mamba2": mamba2,
                                  "kda": (2 * (96 * 3 + 256) + 2 * latent * S) / (192 * 3 + 512 + latent * S)}[name]


def test_each_ranks_weights_are_the_formula(decoded):
    """GQA by hand: per layer wq and wo H/2 heads, wk and wv one K/V head, the MLP's three projections
    ffn/2 wide, two norms; the embedding and the LM head V/2 rows each, the final norm whole on every rank.
    A vocabulary of 97 splits 49 rows on rank 0, 48 on rank 1."""
    C, H, D, F, V, L = 64, 8, 8, 128, 128, 2
    layer = C * (H // 2) * D * 2 + C * 1 * D * 2 + 3 * C * (F // 2) + 2 * C
    expected = 4 * (L * layer + 2 * (V // 2) * C + C)
    assert [w for _, _, w in decoded["gqa"][3]] == [expected] * RANKS
    first, second = [w for _, _, w in decoded["bias"][3]]
    assert first - second == 4 * 2 * (49 - 48) * C


def test_a_rank_of_meta_weights_counts_as_the_built_one(decoded):
    """rank_weight_bytes (the capacity figures' weights per rank, on the meta device) against the built rank's."""
    cfg, attention, _, ranks = decoded["bias"]
    with torch.device("meta"):
        meta = Decoder(cfg, attention)
    assert rank_weight_bytes(meta, Split(RANKS)) == ranks[0][2]


@pytest.mark.parametrize("overrides", [pytest.param(overrides, id=f"{kind.name}-{name}") for kind in registered()
                                       for name, overrides in kind.decode_examples.items()])
def test_each_kinds_decode_examples_run_as_ranks_token_equal_to_one_process(overrides):
    """The forms a kind registers beside its conformance examples (DeepSeek-V4's sliding, CSA and HCA layers,
    Llama 4's chunked and NoPE ones): the job's check lets 2 ranks run it, and they decode as one process."""
    job = to_bench_config(compose(*overrides, "runtime.device=cpu"))
    # on a GPU's terms: a CPU's count of cores, which bounds CPU ranks, is the machine's, not the kind's
    check_parallel(replace(job, runtime=replace(job.runtime, tensor_parallel=RANKS, device="cuda")))
    torch.set_num_threads(1)
    model = build_model(job, torch.device("cpu"))
    prompt = torch.randint(0, model.config.vocab_size, (B, 7), generator=torch.Generator().manual_seed(2))
    check_ranks_decode_as_one_process(model, prompt, 9)


@pytest.fixture(scope="module")
def tiny_job():
    return to_bench_config(compose("model=tiny", "runtime.device=cpu"))


def test_a_split_it_cannot_run_is_one_line_from_the_command_line():
    with pytest.raises(ConfigError, match=r"^runtime\.tensor_parallel=3: must divide model\.num_heads=8 "):
        to_bench_config(compose("model=tiny", "runtime.tensor_parallel=3"))


@pytest.mark.parametrize("runtime, other, line", [
    ({"tensor_parallel": 0}, {}, "runtime.tensor_parallel=0: must be an integer >= 1"),
    ({"tensor_parallel": 4096}, {}, "runtime.tensor_parallel=4096: more ranks than this machine's"),
    ({"tensor_parallel": 2}, {"task": "train"},
     "runtime.tensor_parallel=2: only task=bench workload=decode runs as ranks, and task=inspect, task=capacity and "
     "workload=serving give the split's per-GPU figures, not task=train"),
    ({"tensor_parallel": 2, "compile": "default"}, {}, "runtime.compile='default': with runtime.tensor_parallel=2"),
    ({"tensor_parallel": 8, "device": "cuda"}, {"attention": {"type": "gqa", "num_kv_heads": 4}, "model":
                                                {"num_heads": 12, "preset_kv_heads": 4, "head_dim": 8}},
     "runtime.tensor_parallel=8: must divide model.num_heads=12"),
    ({"tensor_parallel": 2}, {"attention": {"layer_types": ["mamba", "full_attention"]},
                              "model": {"layer_shapes": {"mamba2": {"mamba_num_heads": 12, "n_groups": 3}}}},
     "runtime.tensor_parallel=2: layer 0: its 3 groups of B and C split over ranks in whole groups only"),
    ({"tensor_parallel": 4, "device": "cuda"}, {"attention": {"type": "gqa", "num_kv_heads": 6}, "model":
                                                {"num_heads": 12, "preset_kv_heads": 6, "head_dim": 8}},
     "runtime.tensor_parallel=4: layer 0: the layer's 6 heads split"),
    ({"expert_parallel": 2}, {}, "runtime.expert_parallel=2: splits the experts over"),
])
def test_a_split_it_cannot_run_is_one_line(tiny_job, runtime, other, line):
    job = tiny_job
    fields = {}
    if "model" in other:
        fields["model"] = replace(job.model, **other["model"])
    if "attention" in other:
        fields["attention"] = replace(job.attention, **other["attention"])
    job = replace(job, runtime=replace(job.runtime, **runtime), task=other.get("task", job.task), **fields)
    with pytest.raises(ConfigError) as err:
        check_parallel(job)
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


def test_inspect_prints_a_splits_per_gpu_figures():
    """task=inspect with runtime.tensor_parallel=2 (nothing run as ranks): model=tiny's 2 layers keep MQA's one
    K/V head of 8 on both GPUs (2x) in float32 for 576 positions; a rank's weights by hand: per layer wq and wo 4
    heads, wk and wv one, the MLP 64 of 128 wide, two norms; half the vocabulary of 256 in the embedding and the
    head; the final norm. (GQA's heads split: the serving and capacity records' tests.)"""
    from kvbench.tasks.inspect import describe

    text = " ".join(describe(to_bench_config(compose("model=tiny", "attention=mqa", "task=inspect",
                                                     "runtime.tensor_parallel=2"))).split())
    per_token = 2 * 2 * 1 * 8 * 4
    C, layer = 64, 2 * 64 * 32 + 2 * 64 * 8 + 3 * 64 * 64 + 2 * 64
    weights = 4 * (2 * layer + 2 * 128 * C + C)
    assert f"per GPU under TP=2 (runtime.tensor_parallel=2, runtime.expert_parallel=1): KV {per_token} B per token " \
           f"a GPU, {human_bytes(per_token * 576)} ({per_token * 576:,} B) per sequence of 576; replication 2x" in text
    assert f"weights {human_bytes(weights)} a GPU" in text and weights == 206_080
    assert "by layer: 2 x 1 KV heads: 1 part, each on 2 ranks (replicated)" in text


def _rank_job(job, where, overrides):
    """A rank's job for the launcher tests: what it was handed, as a record."""
    from kvbench.results import RunResult, save

    result = RunResult(status="ok", config={}, metrics={"device": job.runtime.device})
    save(result, where)
    return result


@pytest.mark.parametrize("device_type, backend, device", [("cuda", "nccl", "cuda:1"), ("cpu", "gloo", "cpu")])
def test_the_launcher_joins_gpus_by_nccl_and_cpus_by_gloo(monkeypatch, tmp_path, tiny_job, device_type, backend,
                                                          device):
    """A rank as torch.multiprocessing.spawn starts it (kvbench.parallel.launch._rank, in this process with
    torch.distributed's calls recorded, not made): rank 1 of 2 on CUDA joins by NCCL on cuda:1, on a CPU by gloo;
    its record lands under ranks/1."""
    import torch.distributed as dist

    from kvbench.parallel import launch, tensor

    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda name, **kw: calls.append((name, kw["rank"],
                                                                                      kw["world_size"])))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroyed"))
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(tensor, "_current", None)
    job = replace(tiny_job, runtime=replace(tiny_job.runtime, tensor_parallel=2))
    launch._rank(1, 2, 0, job, str(tmp_path), [], _rank_job, device_type)
    assert calls == [*([("set_device", 1)] if device_type == "cuda" else []), (backend, 1, 2), "destroyed"]
    assert launch.read_record(tmp_path / "ranks" / "1").metrics["device"] == device


@pytest.mark.cuda
def test_one_nccl_rank_on_a_gpu_decodes_through_the_launchers_path(tmp_path):
    """The CUDA path of runtime.tensor_parallel on the one GPU a check has (2 NCCL ranks need 2 GPUs): the
    launcher with one rank (spawn, NCCL on cuda:0, the decoder cut by shard_decoder with its all-reduces, the
    vocabulary's all-gather, CUDA events timing them) runs a decode job; its record gives the rank's allocated
    KV equal to the formula and a measured collective time, and its tokens are the job's without ranks."""
    from kvbench.jobs.runner import run_job
    from kvbench.parallel.launch import run_ranks

    job = to_bench_config(compose("model=tiny", "attention=gqa", "attention.num_kv_heads=2", "runtime.device=cuda",
                                  "workload.prompt_len=8", "workload.gen_len=4", "runtime.warmup=0",
                                  "runtime.repeats=1", "wandb.mode=disabled", "runtime.isolate=false"))
    record = run_ranks(job, tmp_path, [], run_job, torch.device("cuda"))
    assert record.status == "ok", record.error
    (row,) = record.tables["ranks"]
    assert row["status"] == "ok" and row["kv_cache_bytes"] == row["kv_cache_bytes_formula"] > 0
    assert row["allreduce_ms_per_step"] > 0 and record.metrics["tensor_parallel_ranks"] == 1


def test_a_capacity_record_of_a_split_gives_chooses_per_gpu_columns(tmp_path):
    """task=capacity capacity.plan=true with runtime.tensor_parallel=2 (formulas, nothing built or run as ranks):
    model=tiny's MQA head is on both GPUs (2x); a GPU holds its part of (10 MB less a GPU's weights) // its part
    of a sequence of 256, over the TP group's 2 GPUs; experiment=choose's table shows both figures."""
    from kvbench.jobs.runner import run_job
    from kvbench.sinks.choose import choices

    C, D, L = 64, 8, 2
    layer = 2 * C * 32 + 2 * C * 8 + 3 * C * 64 + 2 * C  # a GPU's: 4 query heads, 1 K/V head, half the MLP, norms
    weights = 4 * (L * layer + 2 * 128 * C + C)  # + half the vocabulary of 256 in the embedding and the head
    record = run_job(compose("task=capacity", "model=tiny", "attention=mqa", "capacity.plan=true",
                             "runtime.memory_budget_gb=0.01", "capacity.context_lens=[256]",
                             "runtime.tensor_parallel=2", "runtime.device=cpu", "runtime.isolate=false",
                             "wandb=disabled", "runtime.fidelity=false"), tmp_path)
    assert record.status == "ok", record.error
    m, per_token = record.metrics, 2 * L * 1 * D * 4  # the one K/V head on each GPU, float32
    assert m["gpu_split"] == "TP=2" and m["kv_bytes_per_token_gpu"] == per_token
    assert m["kv_replication_gpus"] == 2 and m["weight_bytes_gpu"] == weights
    assert m["sequences_per_gpu"] == ((10 ** 7 - weights) // (per_token * 256)) / 2 == 149
    (choice,) = choices([record])
    row = dict(zip(choice.header, choice.rows[0]))
    assert row["KV / token / GPU"] == "128 B" and row["seqs / GPU"] == "149"
    assert any(n.startswith("per GPU (TP=2: runtime.tensor_parallel") for n in choice.notes)
