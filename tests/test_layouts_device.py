"""The layouts 2026's open models ship, run on a device and checked against the CPU: a Gated
DeltaNet hybrid and a pure stack (Qwen3.5), DSA with a top-k that binds (DeepSeek-V3.2), learned
sinks over a sliding window (GPT-OSS) and cross-layer KV sharing (Gemma 3n). Each decodes greedily
through its static cache on the device; the reference is the same weights on the CPU, a forward
of the whole sequence without a cache (the path tests/test_gated_deltanet.py, test_dsa.py,
test_sinks.py and test_kv_sharing.py hold exact against transformers). Every step's logits agree
within TOL and every greedy token is the reference's argmax, unless the reference's top two are
closer than TOL (a tie the device may break the other way).

The device is ``KVBENCH_LAYOUTS_DEVICE`` (default cpu: cached decode against a recompute on one
machine); scripts/gpu_check.sh's layouts step runs this file with ``cuda``, float32 with TF32 off,
so a CUDA kernel that drifts from the CPU's arithmetic fails here, not in a benchmark's numbers.
"""

import os

import pytest
import torch
from conftest import tiny_model_config

from kvbench.cache import make_cache
from kvbench.config.model import AttentionConfig
from kvbench.generate import greedy_generate
from kvbench.model import Decoder

DEVICE = os.environ.get("KVBENCH_LAYOUTS_DEVICE", "cpu")
TOL = 1e-4
PROMPT, STEPS = 21, 40

LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
              linear_conv_kernel_dim=4)
# name -> (model fields, attention fields): each a layout of issue-era open models at test size
LAYOUTS = {
    "gdn hybrid 3:1": (dict(num_layers=4, num_heads=4, preset_kv_heads=2, **LINEAR),
                       dict(layer_types=["linear_attention"] * 3 + ["full_attention"])),
    "gdn pure": (dict(num_layers=2, num_heads=4, preset_kv_heads=2, **LINEAR),
                 dict(layer_types=["linear_attention"] * 2)),
    "dsa topk 8": (dict(num_layers=2), dict(type="mla", index_topk=8)),  # 61 positions: the top-k binds
    "sinks w=8 1:1": (dict(num_layers=2), dict(type="gqa", num_kv_heads=2, window=8, global_every=2, sinks=True)),
    "kv sharing 2 of 4": (dict(num_layers=4), dict(type="gqa", num_kv_heads=2, kv_shared_layers=2)),
}


def device() -> torch.device:
    dev = torch.device(DEVICE)
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.fail(f"KVBENCH_LAYOUTS_DEVICE={DEVICE}: torch sees no CUDA device")  # the GPU check must not skip
    return dev


@pytest.fixture
def exact_float32():
    """True float32 matmuls on CUDA (TF32 rounds inputs to 10 bits), restored afterwards."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def build(name: str, seed: int = 0) -> Decoder:
    model_fields, attention = LAYOUTS[name]
    torch.manual_seed(seed)
    model = Decoder(tiny_model_config(max_seq_len=96, **model_fields), AttentionConfig(**attention)).eval()
    with torch.no_grad():  # parameters a fresh model holds at a constant (sinks at 0, norms at 1) drawn off it
        for param_name, param in model.named_parameters():
            if param_name.endswith(("sinks", "norm.weight", "decay_bias", "log_decay_rate")):
                param.add_(torch.randn_like(param) * 0.5)
    return model


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cached_decode_on_the_device_equals_the_cpu_recompute(name, exact_float32):
    dev = device()
    model = build(name)
    prompt = torch.randint(0, model.config.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    ran = model.to(dev)
    run = greedy_generate(ran, prompt.to(dev), STEPS, make_cache("static", ran.layouts, 2, PROMPT + STEPS + 1,
                                                                 ran.dtype, dev), keep_logits=True)
    tokens, logits = run.tokens.cpu(), run.logits.float().cpu()  # (2, STEPS + 1), (2, STEPS + 1, V)
    reference = ran.to("cpu")
    with torch.no_grad():
        want = reference(torch.cat([prompt, tokens[:, :-1]], 1))[:, PROMPT - 1:].float()  # (2, STEPS + 1, V)
    assert logits.shape == want.shape
    assert (logits - want).abs().max().item() <= TOL * max(1.0, want.abs().max().item()), name
    top2 = want.topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) > TOL  # where the reference has a clear argmax
    assert torch.equal(tokens[decided], want.argmax(-1)[decided]), name
    assert decided.float().mean().item() > 0.9  # the check is not vacuous


def test_the_layouts_are_what_their_names_say():
    """Each model above has the layout it is named for: the top-k binds (fewer than the positions
    decoded), the sinks are drawn off zero, two layers store nothing, three layers hold a state."""
    dsa = build("dsa topk 8").layouts
    assert all(layer.fields().get("index_topk") == 8 for layer in dsa) and 8 < PROMPT + STEPS
    sinks = build("sinks w=8 1:1")
    assert any(n.endswith("sinks") and p.abs().min() > 0 for n, p in sinks.named_parameters())
    shared = build("kv sharing 2 of 4").layouts
    assert [layer.bytes_per_position(4) == 0 for layer in shared] == [False, False, True, True]
    hybrid = build("gdn hybrid 3:1").layouts
    assert [layer.state_bytes(4) > 0 for layer in hybrid] == [True, True, True, False]
