"""The config's layout methods, on every preset (windowed: Gemma 3, Gemma 3n with KV sharing, GPT-OSS,
Mistral v0.1; hybrid linear: Qwen3.5, Qwen3-Next; latent: DeepSeek-V3/V3.2; and plain ones): the same
attention without its layer pattern (``AttentionConfig.without_pattern``, ``ModelConfig.without_pattern``)
and a model whose own layout is a resolved attention (``ModelConfig.with_own_layout``), checked against
the hand-written replace()s they stand for and against the layouts they build; the fields an attention asks
for its type, as task=eval resolves them against a checkpoint (``AttentionConfig.as_asked``)."""

from dataclasses import fields, replace
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from conftest import compose, deepseek_dir, hf_dir

from kvbench.config.model import MLA_FIELDS, AttentionConfig, MLAShape, ModelConfig
from kvbench.core.errors import ConfigError
from kvbench.footprint import parameter_counts
from kvbench.jobs.job_config import to_bench_config
from kvbench.layouts.build import build_layouts
from kvbench.layouts.chunked import Chunked
from kvbench.layouts.kinds import attention_kind, registered
from kvbench.model import Decoder

PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "model").glob("*.yaml")
                 if not p.stem.endswith("_dir"))  # the *_dir presets need a checkpoint
PATTERN = ("preset_window", "preset_global_every", "preset_layer_types", "preset_kv_shared_layers", "preset_chunk")


@lru_cache(maxsize=None)  # composing is the slow part; the tests replace(), never change, a config
def preset(name):
    cfg = to_bench_config(compose(f"model={name}", "task=inspect"))
    return cfg.model, cfg.attention


def every_layer_full(model, attention):
    """Independent of without_pattern: the layouts of ``attention`` over ``model`` with each layer's
    window (a chunk: Llama 4's local layers) and donor dropped, its layers without rotary embeddings kept
    (Llama 4's NoPE layers are full already), and a layer of a kind chosen by its layer type, not by
    attention.type (a recurrent one: Gated DeltaNet, KDA, Mamba-2; DeepSeek-V4's compressed layers and
    the sliding ones beside them), replaced by the layer attention.type's kind builds without a window."""
    layouts = build_layouts(model, attention)
    by_layer_type = tuple(kind.layout for kind in registered() if kind.recurrent or kind.named)
    lead = attention_kind(attention.type).build(model, attention, None)

    def full(layer):
        return replace(layer.unchunked() if isinstance(layer, Chunked) else layer, window=None, kv_source=None)
    return tuple(lead if isinstance(layer, by_layer_type) else full(layer) for layer in layouts)


def attentions(model, own):
    """``own`` and the other layouts a run may ask of ``model`` (those it accepts): no window, a window
    on every other layer, Gated DeltaNet layers gone, a latent."""
    asks = [dict(type="mha", window=0), dict(type="mqa", window=8, global_every=2, full_attention_interval=0),
            dict(type="gqa", full_attention_interval=0), dict(type="mla")]
    out = [own]
    for ask in asks:
        try:
            a = AttentionConfig(**ask).resolved(model)
            build_layouts(model, a)
        except ConfigError:  # e.g. a latent beside Gated DeltaNet layers, or reading a donor's latent
            continue
        out.append(a)
    return out


@pytest.mark.parametrize("name", PRESETS)
def test_an_attention_without_its_pattern_keeps_its_layout_with_every_layer_full(name):
    model, own = preset(name)
    plain = own.without_pattern()
    assert tuple(build_layouts(model, plain.resolved(model))) == every_layer_full(model, own)
    # the hand-written forms it replaces: footprint's (its layer_types set per small model) ...
    assert replace(plain, full_attention_interval=None) == replace(
        own, window=0, global_every=None, layer_types=None, full_attention_interval=None, kv_shared_layers=0, chunk=0)
    # ... and task=compare's MHA base (which kept the model's KV sharing)
    H = model.num_heads
    by_hand = AttentionConfig(type="mha", num_kv_heads=H, window=0, full_attention_interval=0, kv_shared_layers=0,
                              chunk=0)
    assert build_layouts(model, by_hand.resolved(model)) == build_layouts(
        model, AttentionConfig.for_heads(H, H).without_pattern().resolved(model))


@pytest.mark.parametrize("name", PRESETS)
def test_a_model_without_its_pattern_is_its_shape_with_every_layer_full(name):
    model, own = preset(name)
    plain = model.without_pattern()
    assert plain == replace(model, preset_window=None, preset_global_every=None, preset_layer_types=None,
                            preset_kv_shared_layers=0, preset_chunk=0)
    assert all(getattr(plain, f.name) == getattr(model, f.name) for f in fields(model) if f.name not in PATTERN)
    # its own layout (attention=model) is the model's own, every layer full attention
    assert tuple(build_layouts(plain, AttentionConfig().resolved(plain))) == every_layer_full(model, own)


@pytest.mark.parametrize("name", PRESETS)
def test_a_model_with_an_attention_as_its_own_layout_runs_that_attention(name):
    """attention=model over ``with_own_layout(a)`` is ``a``, sinks and KV sharing included; the
    fields are those task=eval wrote by hand."""
    model, own = preset(name)
    for a in attentions(model, own):
        mine = model.with_own_layout(a)
        by_hand = replace(model, preset_kv_heads=a.num_kv_heads, preset_window=a.window or None,
                          preset_global_every=a.global_every if a.window else None,
                          # kept with a window, or where some layer is recurrent (Gated DeltaNet, Mamba-2, KDA)
                          # or compressed (DeepSeek-V4's, each with its own ring)
                          preset_layer_types=a.layer_types if a.window or set(a.layer_types or ()) - {"full_attention"}
                          else None,
                          preset_mla=MLAShape(**{k: getattr(a, k) for k in MLA_FIELDS}) if a.latent else None,
                          preset_sinks=bool(a.sinks), preset_kv_shared_layers=a.kv_shared_layers or 0,
                          preset_chunk=a.chunk or 0, preset_k_eq_v=a.k_eq_v or 0)
        assert mine == by_hand, a
        assert build_layouts(mine, AttentionConfig().resolved(mine)) == build_layouts(model, a), a


@pytest.mark.parametrize("name", PRESETS)
def test_parameter_counts_are_the_built_decoders_for_every_preset(name):
    """The footprint's small models (the pattern dropped) count what the whole decoder holds, built on
    the meta device (no memory)."""
    model, own = preset(name)
    with torch.device("meta"):
        built = Decoder(model, own).num_params()
    assert parameter_counts(model, own).total == built


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "deepseek_v3"])
def test_a_checkpoint_directory_without_its_pattern_is_not_read_again(tmp_path, family):
    """A config with model.path reads its checkpoint on every replace(): without_pattern drops the
    path, so the pattern stays dropped and the footprint's small models are small; their counts are
    the whole decoder's (Mistral: a window on every layer)."""
    if family == "deepseek_v3":
        path, _ = deepseek_dir(tmp_path)
    else:
        path, _ = hf_dir(tmp_path, 2, family=family, **({"sliding_window": 16} if family == "mistral" else {}))
    model = ModelConfig(path=str(path))
    assert (model.preset_window == 16) == (family == "mistral")
    plain = model.without_pattern()
    assert plain.path is None and plain.preset_window is None and replace(plain, num_layers=1).num_layers == 1
    assert all(getattr(plain, f.name) == getattr(model, f.name) for f in fields(model)
               if f.name not in (*PATTERN, "path"))
    assert parameter_counts(model).total == Decoder(model).num_params()


def by_hand_for_eval(a):
    """task=eval's field-by-field form of the attention it resolves against a checkpoint (what
    ``AttentionConfig.as_asked`` stands for)."""
    from kvbench.config.layer_options import PRESET_OPTIONS

    asked = {name: getattr(a, name) for name in (*(MLA_FIELDS if a.latent else ()), *(o.key for o in PRESET_OPTIONS))}
    return AttentionConfig(type=a.type, num_kv_heads=a.num_kv_heads, window=a.window, global_every=a.global_every,
                           layer_types=a.layer_types, full_attention_interval=a.full_attention_interval,
                           mla_decode=a.mla_decode, **asked)


def test_an_attention_as_asked_is_the_fields_task_eval_wrote_by_hand():
    model, _ = preset("deepseek_v32")
    asks = [AttentionConfig(), AttentionConfig(type="gqa", num_kv_heads=2, window=8, global_every=2),
            AttentionConfig(type="mqa", window=16, layer_types=["sliding_attention", "full_attention"]),
            AttentionConfig(type="gqa", full_attention_interval=4, kv_shared_layers=3),
            AttentionConfig(type="mha", window=0, sinks=True), AttentionConfig(type="gqa", sinks=False),
            AttentionConfig(type="mla", kv_lora_rank=64, q_lora_rank=96, index_n_heads=4, index_head_dim=32,
                            index_topk=16, mla_decode="expanded"),
            AttentionConfig(type="mla", window=32, global_every=4, index_topk=0),
            AttentionConfig(type="mla").resolved(model)]  # resolved: every latent and indexer field set
    stale = AttentionConfig(type="mla", kv_lora_rank=64)
    stale.type = "gqa"  # a latent rank left on a K/V-head type: not one of its fields
    for a in (*asks, stale):
        mine = a.as_asked()
        assert mine == by_hand_for_eval(a) and mine is not a, a
    assert stale.as_asked().kv_lora_rank is None and asks[6].as_asked().index_topk == 16
