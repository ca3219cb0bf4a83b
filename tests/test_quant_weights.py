"""Quantized checkpoints dequantized on load (kvbench/quant_weights.py): DeepSeek-V3's FP8 blocks,
GPT-OSS's MXFP4 experts and ModelOpt's NVFP4, each written by the tests' own encoders
(tests/quant_checkpoints.py). The loaded decoder holds exactly the values the encoder's own
element-wise decoding gives; task=eval scores the quantized directory as it scores the dequantized
float copy (1e-5 relative) and as transformers scores that copy; GPT-OSS's MXFP4 directory gives
transformers' own logits (transformers dequantizes MXFP4 on a CPU), and each FP8 and MXFP4 tensor is
transformers' own dequantization function's (its FP8 loader needs accelerate, not installed here).
The stored bytes the roofline, the records and task=inspect count against the files' own bytes."""

import json
import math

import pytest
import torch
import transformers
from conftest import VOCAB, deepseek_dir, eval_job, reread, transformers_perplexity
from quant_checkpoints import (
    e2m1_value,
    fp8_blocks,
    fp8_encoder,
    mxfp4_encoder,
    mxfp4_rows,
    nvfp4_encoder,
    nvfp4_matrix,
    rewrite,
)
from safetensors import safe_open

from kvbench.checkpoint import load_llama_dir
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.core.errors import ConfigError
from kvbench.hf_weights import read_headers
from kvbench.measure.roofline import decode_bytes_read
from kvbench.quality.train import run_eval
from kvbench.quant_weights import E2M1_VALUES, module_stored_bytes

MODEL = ModelConfig(name="t", num_layers=2, d_model=64, num_heads=8, ffn_dim=96, vocab_size=VOCAB, max_seq_len=64)
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                              "model.embed_tokens", "lm_head"]}
NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}


def deepseek_moe(tmp_path, **overrides):
    """A tiny random DeepSeek-V3: layer 0 dense, layer 1 four routed experts of 16 and a shared one."""
    return deepseek_dir(tmp_path, vocab_size=256, max_position_embeddings=64, first_k_dense_replace=1,
                        moe_intermediate_size=16, n_shared_experts=1, **overrides)


def gpt_oss(tmp_path):
    """A tiny random GPT-OSS (experts 32 wide: MXFP4 groups 32 input values, of d_model and of the experts)."""
    cfg = transformers.GptOssConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=8, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                    vocab_size=256, max_position_embeddings=64, sliding_window=6, swiglu_limit=1.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.3)
    hf.save_pretrained(tmp_path)
    return tmp_path, hf


def assert_loads_its_dequantized_values(quant, dequant):
    """The decoder loaded from ``quant`` holds exactly the tensors of the one loaded from ``dequant``."""
    ours, _ = load_llama_dir(quant)
    copy, _ = load_llama_dir(dequant)
    assert ours.config.weights_stored is not None and copy.config.weights_stored is None
    for (name, a), (_, b) in zip(ours.state_dict().items(), copy.state_dict().items()):
        assert torch.equal(a, b), name
    return ours


def assert_same_perplexity(quant, dequant, corpus):
    """task=eval of ``quant``: within 1e-5 relative of the float copy's, and of transformers' on that copy."""
    cfg = eval_job(MODEL, AttentionConfig(type="model"), corpus, quant)
    ours = run_eval(cfg, torch.device("cpu"))["perplexity"]
    copy = run_eval(eval_job(MODEL, AttentionConfig(type="model"), corpus, dequant), torch.device("cpu"))["perplexity"]
    assert ours == pytest.approx(copy, rel=1e-5)
    assert ours == pytest.approx(transformers_perplexity(reread(dequant), cfg), rel=1e-4)


def file_bytes(directory, model):
    """Bytes of the tensors the files hold, by their headers' dtypes and shapes, less ``model``'s persistent
    buffers (DeepSeek's correction bias: a weight the files hold that is not a parameter)."""
    sizes = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "U8": 1}
    buffers = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n in model.state_dict())
    return sum(math.prod(t.shape) * sizes[t.dtype] for t in read_headers(directory).values()) - buffers


def test_e2m1_table_is_the_formats_bit_fields():
    assert E2M1_VALUES == tuple(e2m1_value(c) for c in range(16))


@pytest.mark.parametrize("block", [(128, 128), (8, 16)])
def test_a_deepseek_v3_fp8_checkpoint_loads_and_evaluates_to_its_dequantized_weights(tmp_path, corpus, block):
    """DeepSeek-V3's FP8 blocks, in the published [128, 128] (one block per tiny matrix) and in blocks of 8 x 16,
    which leave partial blocks at the edges (kv_a_proj_with_mqa's 20 rows, q_a_proj's 12)."""
    src, _ = deepseek_moe(tmp_path / "float")
    rewrite(src, tmp_path / "fp8", tmp_path / "dequant", {**FP8, "weight_block_size": list(block)},
            fp8_encoder(block))
    model = assert_loads_its_dequantized_values(tmp_path / "fp8", tmp_path / "dequant")
    assert model.config.weights_stored == f"fp8_e4m3_{block[0]}x{block[1]}"
    bf16, _ = load_llama_dir(tmp_path / "fp8", dtype="bfloat16")  # dequantized, then cast to the compute dtype
    for (name, a), (_, b) in zip(bf16.state_dict().items(), model.state_dict().items()):
        # the router's correction bias stays float32, as transformers keeps e_score_correction_bias
        kept = torch.float32 if name.endswith("correction_bias") else torch.bfloat16
        assert a.dtype == kept and torch.equal(a, b.to(kept)), name
    assert_same_perplexity(tmp_path / "fp8", tmp_path / "dequant", corpus)
    # the bytes as stored (quant_weights.stored_bytes' rule) are the files' own: a byte per weight + the scales
    stored = module_stored_bytes(model, model.config.weights_stored)
    assert stored == file_bytes(tmp_path / "fp8", model)
    assert stored < module_stored_bytes(model, None)


def test_a_gpt_oss_mxfp4_checkpoint_is_transformers_dequantizing_it(tmp_path, corpus):
    """GPT-OSS's MXFP4 experts: the values of the test's decoding, the perplexity of the float copy, and the
    logits transformers computes from the MXFP4 directory itself (Mxfp4Config(dequantize=True) on a CPU)."""
    src, _ = gpt_oss(tmp_path / "float")
    rewrite(src, tmp_path / "mxfp4", tmp_path / "dequant", MXFP4, mxfp4_encoder)
    model = assert_loads_its_dequantized_values(tmp_path / "mxfp4", tmp_path / "dequant")
    assert_same_perplexity(tmp_path / "mxfp4", tmp_path / "dequant", corpus)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "mxfp4", quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager").eval()
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)
    assert module_stored_bytes(model, "mxfp4") == file_bytes(tmp_path / "mxfp4", model)


def test_an_nvfp4_checkpoint_loads_its_dequantized_weights(tmp_path, corpus):
    """ModelOpt's NVFP4 (no CPU reader in transformers): the test's element-wise decoding and the float copy's
    perplexity; the activations' input_scale is left unread."""
    src, _ = deepseek_moe(tmp_path / "float", q_lora_rank=16, v_head_dim=4)  # every matrix 16 values wide
    rewrite(src, tmp_path / "nvfp4", tmp_path / "dequant", NVFP4, nvfp4_encoder)
    with safe_open(str(tmp_path / "nvfp4" / "model.safetensors"), "pt") as f:
        assert any(k.endswith(".input_scale") for k in f.keys())
    model = assert_loads_its_dequantized_values(tmp_path / "nvfp4", tmp_path / "dequant")
    assert_same_perplexity(tmp_path / "nvfp4", tmp_path / "dequant", corpus)
    inputs = sum(4 for k in read_headers(tmp_path / "nvfp4") if k.endswith(".input_scale"))
    assert module_stored_bytes(model, "nvfp4") == file_bytes(tmp_path / "nvfp4", model) - inputs


def test_the_encoders_reach_the_formats_edges():
    """The encoders the checks rest on: saturation at 6 x scale, zero blocks, negative values, FP8's partial blocks."""
    w = torch.zeros(3, 64)
    w[0, :32] = torch.linspace(-5, 7, 32)
    w[1, 32:] = -torch.arange(32.0)
    blocks, scales, out = mxfp4_rows(w)
    assert out[2].abs().sum() == 0 and out[1, :32].abs().sum() == 0
    assert out.abs().max() <= 6 * 2.0 ** (scales.float() - 127).max()
    assert (out[1, 32:] <= 0).all() and (out[1, 40:] < 0).all()  # -1 over a scale of 4: a tie, to zero
    _, scale, _, dequant = nvfp4_matrix(w)
    assert dequant[2].abs().sum() == 0 and (dequant[1, 40:] < 0).all()
    q, s, out = fp8_blocks(torch.randn(20, 24), (8, 16))
    assert s.shape == (3, 2) and out.shape == (20, 24)


def test_the_roofline_counts_the_weights_as_stored(tmp_path):
    """decode_bytes_read of a loaded FP8 checkpoint: its matrices at a byte each plus their scales (the embedding
    table a row per sequence, in the compute dtype)."""
    src, _ = deepseek_moe(tmp_path / "float")
    rewrite(src, tmp_path / "fp8", tmp_path / "dequant", FP8, fp8_encoder((128, 128)))
    quant, _ = load_llama_dir(tmp_path / "fp8")
    copy, _ = load_llama_dir(tmp_path / "dequant")
    total, kv = decode_bytes_read(quant, 1, 16.0, routed_bytes=None)
    total_copy, kv_copy = decode_bytes_read(copy, 1, 16.0, routed_bytes=None)
    assert kv == kv_copy
    # by hand: every layer matrix 4 bytes -> 1 byte + one float32 scale (each tiny matrix is one block)
    matrices = [(n, p) for n, p in copy.named_parameters() if n.startswith("blocks.") and p.dim() >= 2
                and not n.endswith("router.weight")]
    moe = copy.config.moe
    routed = min(moe.num_experts, moe.top_k)  # batch 1: the most one token's step reads
    saved = 0
    for name, p in matrices:
        experts = ".experts." in name
        count = (2 if name.endswith("w_gate_up") else 1) * (p.shape[0] if p.dim() == 3 else 1)
        fraction = routed / moe.num_experts if experts else 1
        saved += fraction * (p.numel() * 3 - 4 * count)
    assert total == pytest.approx(total_copy - saved)


def test_the_record_keeps_the_stored_format_and_an_old_record_reads_as_before(tmp_path):
    from dataclasses import asdict

    from kvbench.config.record import model_record

    src, _ = deepseek_moe(tmp_path / "float")
    rewrite(src, tmp_path / "fp8", tmp_path / "dequant", FP8, fp8_encoder((128, 128)))
    assert model_record(asdict(ModelConfig(path=str(tmp_path / "fp8"))))["weights_stored"] == "fp8_e4m3_128x128"
    assert "weights_stored" not in model_record(asdict(ModelConfig(path=str(tmp_path / "dequant"))))
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"] == FP8


def _fp8_matrix(rows, cols, block=128):
    return rows * cols + 4 * math.ceil(rows / block) * math.ceil(cols / block)


def test_inspect_says_what_the_published_deepseek_v3_and_gpt_oss_files_weigh():
    """task=inspect model=deepseek_v3: its FP8 files by hand from its config.json's shapes (every layer matrix a
    byte per weight + a float32 per 128x128 block, the router, norms, embedding and head in bfloat16);
    model=gpt_oss_120b: the model card's 60.8 GiB of MXFP4 experts and bfloat16 rest."""
    from conftest import compose

    from kvbench.jobs.job_config import to_bench_config
    from kvbench.tasks.inspect import describe
    from kvbench.units import human_bytes

    C, V, L, E, I, F = 7168, 129280, 61, 256, 2048, 18432  # noqa: E741
    attention = (_fp8_matrix(1536, C) + _fp8_matrix(128 * 192, 1536) + _fp8_matrix(576, C)
                 + _fp8_matrix(128 * 256, 512) + _fp8_matrix(C, 128 * 128) + 2 * (2 * C + 1536 + 512))
    dense = 3 * (2 * _fp8_matrix(F, C) + _fp8_matrix(C, F))
    experts = 58 * ((E + 1) * (2 * _fp8_matrix(I, C) + _fp8_matrix(C, I)) + 2 * E * C)  # + the bf16 router
    total = L * attention + dense + experts + 2 * (2 * V * C + C)
    lines = [line for line in describe(to_bench_config(compose("model=deepseek_v3", "task=inspect"))).splitlines()
             if line.startswith("weights as published")]
    assert lines == [f"weights as published (model.weights_stored=fp8_e4m3_128x128): {human_bytes(total)} (FP8 "
                     "matrices: a byte per weight + a float32 scale per 128x128 block; the rest in bfloat16), "
                     "against 1.22 TiB in bfloat16; kvbench dequantizes them on load to runtime.dtype=float32"]
    gpt = describe(to_bench_config(compose("model=gpt_oss_120b", "task=inspect")))
    assert "weights as published (model.weights_stored=mxfp4): 60.77 GiB (MXFP4 experts" in gpt


def test_a_bench_and_a_capacity_job_of_an_fp8_checkpoint_record_its_stored_weights(tmp_path):
    """model=hf_dir over the FP8 directory: the record keeps model.weights_stored, weight_bytes_stored (the files'
    weights) beside the dequantized weight_bytes, and a capacity answer formula_max_batch_stored, the batch the
    memory-only formula fits with the weights as stored (more than with kvbench's float32 copy)."""
    from conftest import compose

    from kvbench.jobs.job_config import to_bench_config
    from kvbench.jobs.runner import run_job
    from kvbench.results import RunResult
    from kvbench.tasks import capacity
    from kvbench.tasks.capacity_search import formula_max_batch, kv_bytes
    from kvbench.tasks.common import build_model

    src, _ = deepseek_moe(tmp_path / "float")
    rewrite(src, tmp_path / "fp8", tmp_path / "dequant", FP8, fp8_encoder((128, 128)))
    result = run_job(compose("model=hf_dir", f"model.path={tmp_path / 'fp8'}", "wandb=disabled",
                             "runtime.isolate=false", "workload.prompt_len=8", "workload.gen_len=2"), tmp_path / "run")
    assert result.status == "ok", result.error
    model, _ = load_llama_dir(tmp_path / "fp8")
    assert result.config["model"]["weights_stored"] == "fp8_e4m3_128x128"
    buffers = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n in model.state_dict())
    assert result.metrics["weight_bytes_stored"] == file_bytes(tmp_path / "fp8", model) + buffers
    assert result.metrics["weight_bytes"] == model.num_params() * 4 + buffers
    assert result.metrics["bytes_read_per_step"] < result.metrics["weight_bytes"]

    def job(budget_gb):
        return to_bench_config(compose(
            "task=capacity", "model=hf_dir", f"model.path={tmp_path / 'fp8'}", "capacity.context_lens=[16]",
            "capacity.max_batch=64", "workload.gen_len=2", "workload.prompt_len=8", "runtime.warmup=0",
            "runtime.repeats=1", f"runtime.memory_budget_gb={budget_gb}", "slo.tpot_ms=100000", "slo.stat=p50"))

    per_sequence = kv_bytes(job(1), 16, 2) - kv_bytes(job(1), 16, 1)
    cfg = job((result.metrics["weight_bytes"] + 2.5 * per_sequence) / 1e9)  # the float32 copy and 2 sequences
    model = build_model(cfg, torch.device("cpu"))
    probes = RunResult(status="ok", config={})
    capacity.run_probes(cfg, model, torch.device("cpu"), probes, capacity.baseline_bytes(torch.device("cpu")))
    [answer] = probes.tables["capacity"]
    budget = probes.metrics["memory_budget_bytes"]
    assert answer["formula_max_batch_stored"] == formula_max_batch(cfg, 16, budget,
                                                                   result.metrics["weight_bytes_stored"])
    assert answer["formula_max_batch"] == 2 and answer["formula_max_batch_stored"] > 2


def test_each_dequantized_tensor_is_transformers_dequantization(tmp_path):
    """Tensor by tensor against transformers' own CPU functions: finegrained_fp8's Fp8Dequantize (which needs
    whole blocks: the matrices blocks of 8 x 16 divide) and mxfp4's convert_moe_packed_tensors."""
    from safetensors.torch import load_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from kvbench.hf_weights import Derived, load_tensors
    from kvbench.quant_weights import read_dequantized_headers

    src, _ = deepseek_moe(tmp_path / "ds")
    rewrite(src, tmp_path / "fp8", tmp_path / "fp8_float", {**FP8, "weight_block_size": [8, 16]}, fp8_encoder((8, 16)))
    src, _ = gpt_oss(tmp_path / "oss")
    rewrite(src, tmp_path / "mxfp4", tmp_path / "mxfp4_float", MXFP4, mxfp4_encoder)
    compared = {"fp8": 0, "mxfp4": 0}
    for kind in compared:
        path = tmp_path / kind
        raw = load_file(path / "model.safetensors")
        headers = read_dequantized_headers(path, json.loads((path / "config.json").read_text()))
        for name, header in headers.items():
            if not isinstance(header, Derived):
                continue
            ours = load_tensors({name: header})[name]
            if kind == "mxfp4":
                theirs = convert_moe_packed_tensors(raw[name + "_blocks"], raw[name + "_scales"], dtype=torch.float32)
            elif header.shape[0] % 8 or header.shape[1] % 16:
                continue  # a partial block: transformers' function refuses it (DeepSeek's own kernel reads it)
            else:
                theirs = Fp8Dequantize(None)._dequantize_one(raw[name], raw[name + "_scale_inv"], torch.float32)
            assert torch.equal(ours, theirs), name
            compared[kind] += 1
    assert compared["fp8"] >= 8 and compared["mxfp4"] == 4


def test_a_multimodal_checkpoints_format_is_its_top_level_quantization_config():
    """Qwen3.5's multimodal release: the language model's keys in text_config, the format at the top (where
    transformers reads it); a format in text_config alone is not the checkpoint's."""
    text = {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "intermediate_size": 64, "vocab_size": 128, "max_position_embeddings": 512}
    top = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text}
    assert ModelConfig.from_hf_config({**top, "quantization_config": FP8}).weights_stored == "fp8_e4m3_128x128"
    assert ModelConfig.from_hf_config({**top, "text_config": {**text, "quantization_config": FP8}}).weights_stored \
        is None
    with pytest.raises(ConfigError, match=r"^config.json: quantization_config.quant_method='awq': not a quantized"):
        ModelConfig.from_hf_config({**top, "quantization_config": {"quant_method": "awq"}})
