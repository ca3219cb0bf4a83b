"""4-bit K/V (``cache.dtype`` nvfp4, mxfp4, nvfp4_rotated; kvbench/quant4.py): codes and scales
bit-exact against an encoder written here from the formats' definitions in plain Python and numpy
(nothing of kvbench's), on random, zero, negative, saturating blocks and ties; NaN refused; the bytes
of a stored vector and of every store (static cache, paged serving pool per_kind and unified) against
the hand formula; a decode through each format beside int8's against the unquantized cache; a Gated
DeltaNet hybrid quantizing its attention layers and keeping its state."""

import math

import numpy as np
import pytest
import torch
from conftest import TEXT, compose, make_decoder, tiny_model_config
from kv_formula import kv_cache_bytes
from test_serving_engine import isolated, run, workload

from kvbench import quant4
from kvbench.cache import StaticLayer, cache_for, make_cache
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.config.train import TrainConfig
from kvbench.core.dtypes import element_bytes
from kvbench.core.errors import ConfigError
from kvbench.jobs.job_config import to_bench_config
from kvbench.kv_store import KVStore
from kvbench.layouts.base import Layouts
from kvbench.layouts.kv_heads import KVHeads
from kvbench.layouts.pages import StatePage
from kvbench.model import Decoder
from kvbench.quality.data import TokenData
from kvbench.quality.fidelity import quantized_cache_fidelity
from kvbench.quality.train import train
from kvbench.serving.paged import PagedStore, SlotStore, plan_for
from kvbench.state_cache import StateLayer
from kvbench.tasks.inspect import describe

FP4 = ["nvfp4", "mxfp4", "nvfp4_rotated"]
BLOCK = {"nvfp4": 16, "nvfp4_rotated": 16, "mxfp4": 32}  # values per scale byte, from the formats' specs

# ---- the reference encoder: the formats as their specs define them, one value at a time ----

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # E2M1 magnitudes by the low 3 bits of the code


def ref_e2m1(v: float) -> int:
    """Round to the nearest grid value, a tie to the even code, saturate at 6; bit 3 the sign (of -0 too)."""
    sign = 8 if math.copysign(1.0, v) < 0 else 0
    if abs(v) >= 6:
        return sign | 7
    return sign | min(range(8), key=lambda i: (abs(GRID[i] - abs(v)), i % 2))


def ref_e4m3(v: float):
    """(byte, value) of 0 <= v <= 448 rounded to E4M3 (bias 7, 3 mantissa bits, subnormals by 2**-9),
    a tie to the even mantissa."""
    if v == 0:
        return 0, 0.0
    e = math.frexp(v)[1] - 1  # v = 1.m * 2**e
    if e < -6:  # subnormal: multiples of 2**-9
        q = round(v / 2 ** -9)  # Python's round: half to even
        return (8 if q == 8 else q), q * 2 ** -9  # 8 steps is the smallest normal, byte 0b0001000
    q = round(v / 2 ** (e - 3))  # 8..16 steps of 2**(e - 3)
    if q == 16:
        e, q = e + 1, 8
    return ((e + 7) << 3) | (q - 8), q * 2 ** (e - 3)


def ref_pack(codes):
    return [codes[i] | codes[i + 1] << 4 for i in range(0, len(codes), 2)]


def ref_nvfp4(x: np.ndarray, g: np.float32):
    """(code bytes, scale bytes) of float32 rows x under per-tensor scale g: block scale
    e4m3(min(amax / (g * 6), 448)), value e2m1(x / (scale * g)), float32 arithmetic."""
    g = g if g > 0 else np.float32(1)
    codes, scales = [], []
    for row in np.asarray(x, np.float32).reshape(-1, x.shape[-1]):
        row_codes, row_scales = [], []
        for block in row.reshape(-1, 16):
            amax = np.float32(np.abs(block).max())
            byte, value = ref_e4m3(min(float(amax / (g * np.float32(6))), 448.0))
            step = np.float32(np.float32(value) * g)
            row_codes += [0] * 16 if step == 0 else [ref_e2m1(float(v / step)) for v in block]
            row_scales.append(byte)
        codes.append(ref_pack(row_codes))
        scales.append(row_scales)
    return np.array(codes, np.uint8), np.array(scales, np.uint8)


def ref_mxfp4(x: np.ndarray):
    """(code bytes, E8M0 bytes) per the OCP MX spec: shared exponent floor(log2(amax)) - 2, clamped to
    [-127, 127] (an all-zero block: -127), value e2m1(x / 2**exponent)."""
    codes, scales = [], []
    for row in np.asarray(x, np.float32).reshape(-1, x.shape[-1]):
        row_codes, row_scales = [], []
        for block in row.reshape(-1, 32):
            amax = float(np.abs(block).max())
            e = math.floor(math.log2(amax)) if amax else -200
            if amax and 2.0 ** e > amax:  # log2 rounded up to a power of two just above amax: step back
                e -= 1
            X = max(-127, min(127, e - 2))
            row_codes += [ref_e2m1(float(v) * 2.0 ** -X) for v in block]
            row_scales.append(X + 127)
        codes.append(ref_pack(row_codes))
        scales.append(row_scales)
    return np.array(codes, np.uint8), np.array(scales, np.uint8)


def sylvester(D: int) -> np.ndarray:
    """The normalized Walsh-Hadamard matrix of order D (Sylvester's construction)."""
    H = np.ones((1, 1))
    while H.shape[0] < D:
        H = np.block([[H, H], [H, -H]])
    return H / math.sqrt(D)


def blocks_to_test(D: int, seed: int = 0) -> np.ndarray:
    """Rows of D values: normal values of magnitudes 1e-3..1e3, an all-zero row, an all-negative row,
    a row with a 30x channel, and a row of near-ties."""
    rng = np.random.default_rng(seed)
    rows = [rng.standard_normal(D) * 10.0 ** rng.integers(-3, 4) for _ in range(6)]
    rows += [np.zeros(D), -np.abs(rng.standard_normal(D)) - 0.1]
    outlier = rng.standard_normal(D)
    outlier[3] *= 30
    rows += [outlier, np.repeat([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], D // 8) * rng.choice([-1, 1], D)]
    return np.array(rows, np.float32)


# ---- bit-exact codes and scales ----

def test_e2m1_rounds_ties_to_the_even_code_and_saturates():
    values = [0.0, -0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.2499, 0.2501, 5.01, 6.0, 7.0, 1e30,
              -0.25, -0.75, -1.75, -3.5, -5.0, -6.5, 1e-30, -1e-30, 2.9, 4.99]
    got = quant4.e2m1(torch.tensor(values, dtype=torch.float32)).tolist()
    assert got == [ref_e2m1(float(np.float32(v))) for v in values]
    assert got[2:9] == [0, 2, 2, 4, 4, 6, 6]  # 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 4
    assert quant4.e2m1(x).tolist() == [ref_e2m1(v) for v in x.tolist()]


@pytest.mark.parametrize("g", [None, 1.0, 1e-6])  # None: the store's own, from the rows; 1e-6: every block saturates
def test_nvfp4_codes_and_scales_are_the_reference_encoders(g):
    x = blocks_to_test(64)
    if g is None:
        g = np.float32(np.abs(x).max()) / np.float32(6 * 448)
    codes, scales = quant4.nvfp4_encode(torch.from_numpy(x), torch.tensor(g, dtype=torch.float32))
    want_codes, want_scales = ref_nvfp4(x, np.float32(g))
    assert codes.dtype == scales.dtype == torch.uint8 and codes.shape == (len(x), 32) and scales.shape == (len(x), 4)
    np.testing.assert_array_equal(codes.numpy(), want_codes)
    np.testing.assert_array_equal(scales.numpy(), want_scales)
    if g == 1e-6:  # a block whose scale would pass 448: the largest scale, its largest value the largest code
        amax = np.abs(x.reshape(len(x), 4, 16)).max(-1)
        over = amax / np.float32(6e-6) > 448
        assert over.sum() > 10 and (scales.numpy()[over] == 0x7E).all()
        magnitudes = np.stack([codes.numpy() & 7, codes.numpy() >> 4 & 7], -1).reshape(len(x), 4, 16)
        assert (magnitudes.max(-1)[over] == 7).all()


def test_nvfp4_ties_zero_and_negative_blocks_decode_to_the_grid():
    """g = 1 and a block whose largest value is 6: its scale is exactly 1, each value a tie of the grid."""
    ties = np.array([[6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -6, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5],
                     [0] * 16, [-1.5] * 16], np.float32)
    g = torch.tensor(1.0)
    codes, scales = quant4.nvfp4_encode(torch.from_numpy(ties), g)
    assert scales.tolist() == [[0x38], [0], [ref_e4m3(0.25)[0]]]  # 1.0 = 0b0_0111_000; zero; 1.5 / 6
    back = quant4.nvfp4_decode(codes, scales, g, torch.float32)
    assert back[0].tolist() == [6, 0, 1, 1, 2, 2, 4, 4, -6, -0.0, -1, -1, -2, -2, -4, -4]
    assert back[1].tolist() == [0] * 16 and back[2].tolist() == [-1.5] * 16


def test_mxfp4_codes_and_scales_are_the_reference_encoders():
    x = np.concatenate([blocks_to_test(64, seed=2),
                        np.array([[7.9] + [0.25] * 31 + [4, 5, 3.5] * 10 + [0.75, -0.75],  # 7.9: X = 0, saturates
                                  [1e-40] * 64, [3e38] * 32 + [-1e-3] * 32], np.float32)])
    codes, scales = quant4.mxfp4_encode(torch.from_numpy(x))
    want_codes, want_scales = ref_mxfp4(x)
    np.testing.assert_array_equal(codes.numpy(), want_codes)
    np.testing.assert_array_equal(scales.numpy(), want_scales)
    assert scales[-3].tolist() == [127, 127] and codes[-3, 0] & 15 == 7  # 2**0; 7.9 -> 6
    assert scales[6].tolist() == [0, 0]  # the zero row: the smallest exponent, -127


def test_the_rotation_is_sylvesters_and_its_own_inverse():
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(3))
    np.testing.assert_allclose(quant4.hadamard(x).numpy(), x.double().numpy() @ sylvester(128), atol=1e-5)
    torch.testing.assert_close(quant4.hadamard(quant4.hadamard(x)), x)


def test_rotated_nvfp4_stores_the_reference_codes_of_the_rotated_heads():
    """Integer values of heads of 64: their rotation (sums of them / 8) is exact in float32, so the
    store's codes must equal the reference nvfp4 of the Sylvester product, bit for bit."""
    x = np.random.default_rng(4).integers(-20, 21, (1, 3, 5, 64)).astype(np.float32)
    x[0, 1, 2] = 0
    rotated = (x.astype(np.float64) @ sylvester(64)).astype(np.float32)
    store = KVStore((1, 3, 8, 64), "nvfp4_rotated", torch.float32, torch.device("cpu"))
    store.write(0, torch.from_numpy(x))
    g = np.float32(np.abs(rotated).max()) / np.float32(6 * 448)
    assert store.global_scale.item() == g
    want_codes, want_scales = ref_nvfp4(rotated, g)
    np.testing.assert_array_equal(store.codes[:, :, :5].reshape(-1, 32).numpy(), want_codes)
    np.testing.assert_array_equal(store.scales[:, :, :5].reshape(-1, 4).numpy(), want_scales)
    # a read turns the decoded rotation back: within nvfp4's step of the original
    back = store.read(5)
    assert back.shape == x.shape and torch.equal(back[0, 1, 2], torch.zeros(64))
    err = (back - torch.from_numpy(x)).norm(dim=-1) / torch.from_numpy(x).norm(dim=-1).clamp(min=1)
    assert err.max() < 0.15  # E2M1's steps are 1/6 to 1/4 of a block's largest value at most


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])  # nvfp4_rotated: the test above
def test_a_store_writes_the_reference_codes_and_calibrates_once(fmt):
    """The store's per-tensor scale (nvfp4) is set by its first write that holds a nonzero value and
    kept: a later, larger write saturates rather than rescaling what is stored."""
    x = blocks_to_test(64, seed=5)[:9].reshape(1, 3, 3, 64)
    store = KVStore((1, 3, 6, 64), fmt, torch.float32, torch.device("cpu"))
    store.write(0, torch.zeros(1, 3, 1, 64))
    store.write(1, torch.from_numpy(x))
    store.write(4, torch.from_numpy(10 * x[:, :, :2]))
    rows = np.concatenate([x, 10 * x[:, :, :2]], 2).reshape(-1, 64)
    if fmt == "mxfp4":
        want = ref_mxfp4(rows)
    else:
        g = np.float32(np.abs(x).max()) / np.float32(6 * 448)
        assert store.global_scale.item() == g
        want = ref_nvfp4(rows, g)
        assert (want[1] == 0x7E).any()  # the later write saturated some blocks
    np.testing.assert_array_equal(store.codes[:, :, 1:].reshape(-1, 32).numpy(), want[0])
    np.testing.assert_array_equal(store.scales[:, :, 1:].reshape(-1, 64 // BLOCK[fmt]).numpy(), want[1])
    assert torch.equal(store.read(1), torch.zeros(1, 3, 1, 64))


@pytest.mark.parametrize("fmt", FP4)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_infinity_is_refused_and_what_was_stored_stays(fmt, bad):
    store = KVStore((2, 1, 4, 32), fmt, torch.float32, torch.device("cpu"))
    good = torch.randn(2, 1, 2, 32)
    store.write(0, good)
    before = store.read(2).clone()
    x = torch.randn(2, 1, 1, 32)
    x[1, 0, 0, 5] = bad
    with pytest.raises(ValueError) as info:
        store.write(2, x)
    assert str(info.value).splitlines() == [str(info.value)]
    assert str(info.value).startswith(f"cache.dtype={fmt}: K/V hold {bad} (non-finite)")
    assert torch.equal(store.read(2), before)
    # refused as the first write, it sets no per-tensor scale: the next write is encoded as if first
    fresh = KVStore((1, 1, 2, 32), fmt, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=f"^cache.dtype={fmt}: K/V hold {bad}"):
        fresh.write(0, x[1:])
    fresh.write(0, good[:1])
    first = KVStore((1, 1, 2, 32), fmt, torch.float32, torch.device("cpu"))
    first.write(0, good[:1])
    assert torch.equal(fresh.codes, first.codes) and torch.equal(fresh.read(2), first.read(2))


# ---- bytes ----

@pytest.mark.parametrize("fmt", FP4)
@pytest.mark.parametrize("D", [32, 64, 128, 256])
def test_a_stored_vector_takes_the_formulas_bytes(fmt, D):
    store = KVStore((1, 1, 1, D), fmt, torch.float32, torch.device("cpu"))
    stored = sum(t.untyped_storage().nbytes() for t in store.tensors())
    assert stored == element_bytes(D, 4, fmt) == D // 2 + D // BLOCK[fmt]
    if D == 128:
        assert stored == (72 if fmt.startswith("nvfp4") else 68)
        assert round(128 * 2 / stored, 2) == (3.56 if fmt.startswith("nvfp4") else 3.76)  # bf16's 256 B


@pytest.mark.parametrize("fmt", FP4)
def test_the_static_cache_allocates_the_formulas_bytes(fmt):
    """Two full layers and a local one of window 6 (a ring), GQA 2 heads of 32, batch 3, 20 positions."""
    windows = [None, 6, None]
    layers = Layouts(KVHeads(w, 4, 2, 32) for w in windows)
    cache = make_cache("static", layers, 3, 20, torch.float32, "cpu", fmt)
    hand = kv_cache_bytes(3, 2, 32, 20, 3, 4, fmt, windows)
    assert cache.nbytes == hand == layers.cache_bytes(20, 3, 4, fmt)
    assert hand == 2 * 2 * 3 * (20 + 6 + 20) * (16 + 32 // BLOCK[fmt])  # K and V, heads, batch, positions, bytes


def hybrid(head_dim=32, kinds=("linear_attention", "sliding_attention", "linear_attention", "full_attention")):
    """Gated DeltaNet, local (window 5), Gated DeltaNet, global; 4 query heads over 2 KV heads of 32."""
    torch.manual_seed(0)
    cfg = tiny_model_config(num_layers=len(kinds), num_heads=4, preset_kv_heads=2, head_dim=head_dim,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                            linear_value_head_dim=12, linear_conv_kernel_dim=4)
    return Decoder(cfg, AttentionConfig(window=5, layer_types=list(kinds))).eval()


STATE = 4 * 8 * 12 * 4 + (2 * 2 * 8 + 4 * 12) * 3 * 4  # H_v d_k d_v float32 + conv tail (K - 1) x channels, float32


@pytest.mark.parametrize("fmt", FP4)
@pytest.mark.parametrize("allocator", ["per_kind", "unified"])
def test_the_serving_pools_allocate_the_formulas_bytes(fmt, allocator):
    """per_kind: each group's blocks of its layers; unified: one byte pool of its pages, each one
    layer's block of the raised size or one layer's state, what the allocator reserves."""
    model = hybrid()
    plan = plan_for(model, 12, 4, fmt, allocator, 40, 8)
    store = PagedStore(model, 0, 4, False, fmt, plan=plan)
    per_position = 2 * 2 * (16 + 32 // BLOCK[fmt])  # K and V, 2 heads of 32, one attention layer
    if allocator == "per_kind":
        want = sum(n * len(g.layers) * (STATE if isinstance(g.spec, StatePage) else plan.block_size * per_position)
                   for g, n in zip(plan.groups, plan.capacity))
        assert store.nbytes == want == plan.storage_bytes == store.storage_bytes
    else:
        want = plan.pages[0] * max(plan.block_size * per_position, STATE)
        assert store.nbytes == want == plan.reserved_bytes == store.storage_bytes
    assert [len(g.layers) for g in plan.groups] == [1, 1, 2]  # full, window, the two states
    # the pool holds codes and reads back what a static cache of the same codes reads
    k = torch.randn(6, 2, 32)
    kv = store.managers[0].stores[0][0]
    kv.write(torch.arange(6), k)
    solo = KVStore((6, 2, 32), fmt, torch.float32, torch.device("cpu"), axis=0)
    solo.write(0, k)
    assert torch.equal(kv.gather(torch.arange(6)), solo.read(6))


@pytest.mark.parametrize("fmt", FP4)
def test_the_slot_store_allocates_the_formulas_bytes(fmt):
    """workload.store=slots: 3 slots of 20 positions in each attention layer (a local layer's slot is not
    trimmed to its window) and a state per slot in each Gated DeltaNet layer."""
    store = SlotStore(hybrid(), 3, 20, fmt)
    assert store.nbytes == 3 * 20 * 2 * (2 * 2 * (16 + 32 // BLOCK[fmt])) + 3 * 2 * STATE


def test_served_requests_get_the_tokens_of_an_isolated_mxfp4_decode():
    """mxfp4's scales are each block's own, so a request served beside others (sharing a prefix's
    blocks) decodes what it decodes alone through a static cache of the same codes (nvfp4's per-layer
    scale is set by whichever request writes first, so its tokens may differ by that; a hybrid's
    chunked state rounds differently from a token-by-token one, which a 4-bit code can amplify)."""
    model = make_decoder(2, head_dim=32)
    requests, prompts = workload(97, prefix=9)
    longest = max(r.prompt_len + r.output_len - 1 for r in requests)
    store = PagedStore(model, 64, 4, True, "mxfp4", plan_for(model, 64, 4, "mxfp4", longest=longest, chunk=8))
    scheduler, timeline = run(model, store, requests, prompts)
    outputs = scheduler.outputs()
    for r, prompt in zip(requests, prompts):
        assert outputs[r.id] == isolated(model, r, prompt, "mxfp4"), r
    assert sum(t.prefix_hit_tokens for t in timeline.traces) > 0


# ---- what a quantized cache does to a decode ----

@pytest.fixture(scope="module")
def trained():
    """A byte decoder with heads of 32 (2 of them), trained on the test text: predictions with margins."""
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=2, d_model=64, num_heads=2, preset_kv_heads=2, ffn_dim=128, vocab_size=256,
                      max_seq_len=96)
    model = Decoder(cfg, AttentionConfig.for_heads(2, 2))
    ids = torch.tensor(list(TEXT))
    train(model, TrainConfig(steps=30, batch_size=8, seq_len=32, lr=1e-2, warmup_steps=3, eval_every=30,
                             eval_batches=1, log_every=30), TokenData(train=ids[:2400], val=ids[2400:]))
    return model.eval()


def test_each_4bit_cache_stays_close_to_the_unquantized_one_int8_closer(trained):
    ids = torch.tensor(list(TEXT))
    prompt = torch.stack([ids[2400 + 37 * b: 2416 + 37 * b] for b in range(3)])
    fid = {fmt: quantized_cache_fidelity(trained, prompt, 24, fmt) for fmt in ["int8", *FP4]}
    for fmt in FP4:
        assert fid[fmt]["kvq_top1_agreement"] >= 0.8, (fmt, fid)
        # 4 bits against int8's 8: further from the unquantized logits, still a fraction of their spread
        assert fid["int8"]["kvq_max_abs_logit_diff"] < fid[fmt]["kvq_max_abs_logit_diff"] < 2.0, (fmt, fid)
    assert fid["int8"]["kvq_top1_agreement"] >= 0.99


# ---- hybrids: cache.dtype applies to the layers that keep K/V ----

@pytest.mark.parametrize("cache_dtype", ["int8", "nvfp4"])
def test_a_gated_deltanet_hybrid_quantizes_its_attention_and_keeps_its_state(cache_dtype):
    model = hybrid()
    plain, quantized = cache_for(model, "static", 2, 24), cache_for(model, "static", 2, 24, cache_dtype)
    for layer, auto in zip(quantized.layers, plain.layers):
        if isinstance(layer, StateLayer):
            assert layer.recurrent.dtype == torch.float32
            assert [t.nbytes for t in layer.tensors()] == [t.nbytes for t in auto.tensors()]
        else:
            assert isinstance(layer, StaticLayer) and all(s.cache_dtype == cache_dtype for s in layer.stores)
    state = 2 * 2 * STATE
    assert plain.nbytes - state == kv_cache_bytes(2, 2, 32, 24, 2, 4, windows=[None, 5])
    assert quantized.nbytes - state == kv_cache_bytes(2, 2, 32, 24, 2, 4, cache_dtype, windows=[None, 5])
    assert model.layouts.state_bytes(4, cache_dtype) == model.layouts.state_bytes(4) == 2 * STATE
    prompt = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(0))
    fid = quantized_cache_fidelity(model, prompt, 8, cache_dtype)
    assert fid["kvq_top1_agreement"] >= 0.8 and fid["kvq_max_abs_logit_diff"] < 0.5


HYBRID = ["model=tiny", "attention.full_attention_interval=2"]


def test_a_hybrid_job_accepts_a_quantized_cache_and_says_which_layers():
    for dtype in ("int8", "nvfp4", "mxfp4", "nvfp4_rotated"):
        to_bench_config(compose(*HYBRID, "model.head_dim=32", f"cache.dtype={dtype}"))
    text = describe(to_bench_config(compose("model=qwen3_5_9b", "task=inspect", "cache.dtype=int8")))
    assert ("cache.dtype=int8: layers 3, 7, 11, 15, 19, 23, 27, 31 (8 of 32) store K/V as int8 codes + a float32 "
            "scale per (position, head); the 24 gated_deltanet layers (0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, 16, "
            "17, 18, 20, 21, 22, 24, 25, 26, 28, 29, 30) keep their state unquantized: recurrent state float32, "
            "convolution inputs float32") in text.splitlines()


@pytest.mark.parametrize("overrides, line", [
    (["cache.dtype=mxfp4"], "cache.dtype='mxfp4': stores blocks of 32 values of a head, and head_dim=8 is not a "
                            "multiple of 32; use cache.dtype=int8 or float8_e4m3fn"),
    (["model.head_dim=48", "cache.dtype=mxfp4"],
     "cache.dtype='mxfp4': stores blocks of 32 values of a head, and head_dim=48 is not a multiple of 32; use "
     "cache.dtype=int8, float8_e4m3fn or nvfp4"),
    (["model.head_dim=48", "cache.dtype=nvfp4_rotated"],
     "cache.dtype='nvfp4_rotated': rotates each head by a Walsh-Hadamard matrix, and head_dim=48 is not a power of "
     "two; use cache.dtype=int8, float8_e4m3fn or nvfp4"),
    ([*HYBRID[1:], "cache.dtype=nvfp4"], "cache.dtype='nvfp4': stores blocks of 16 values of a head, and head_dim=8 "
                                         "is not a multiple of 16; use cache.dtype=int8 or float8_e4m3fn"),
])
def test_a_head_the_blocks_do_not_fit_is_one_line_naming_dtype_and_head_dim(overrides, line):
    with pytest.raises(ConfigError) as info:
        to_bench_config(compose("model=tiny", *overrides))
    assert str(info.value) == line
