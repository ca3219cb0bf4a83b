"""The optional layer properties (kvbench.config.layer_options.LAYER_OPTIONS), each derived from the
list: on, it is named in the variant's label and kept in the record; a record without it reads as
off; a model's preset of it is resolved and recorded like the field; a checkpoint asked for other
than its own refuses it by name. A new entry in the list is tested here without a new test."""

from dataclasses import asdict, fields, replace

import pytest
import torch
from conftest import VOCAB

from kvbench.checkpoint import CheckpointError, to_layout
from kvbench.config.layer_options import LAYER_OPTIONS, PRESET_OPTIONS
from kvbench.config.layer_pattern import variant_label
from kvbench.config.model import MLA_FIELDS, AttentionConfig, ModelConfig
from kvbench.config.record import attention_record, model_record
from kvbench.core.errors import ConfigError
from kvbench.model import Decoder
from kvbench.sinks.views import VARIANT_KEYS, Variant

MODEL = ModelConfig(name="t", num_layers=4, d_model=64, num_heads=8, preset_kv_heads=2, ffn_dim=96, vocab_size=VOCAB,
                    max_seq_len=64)
IDS = [option.key for option in LAYER_OPTIONS]


def values(option):
    """Two distinct values of ``option``, the first on (for a bool, or an option with one value that
    means on, the other is off)."""
    if type(option.off) is bool:
        return True, False
    return (option.values[0], option.values[1] if option.values[1:] else option.off) if option.values else (2, 3)


def layout(option):
    """The layout an option is built on: MLA for a field of MLA's shape (DSA's top-k), else K/V heads
    (a query latent given, so that turning an indexer on changes no other field)."""
    return dict(type="mla", q_lora_rank=16) if option.key in MLA_FIELDS else dict(type="gqa", num_kv_heads=2)


def on_label(option, on):
    """The label of a variant with ``option`` at ``on``: its layout's, with the window the option sets
    (a chunk C is its layers' window: ``w=C ... chunk=C``), then the option's part."""
    window = dict(window=on) if option.sets_window else {}
    return Variant.of_attention(AttentionConfig(**layout(option), **window).resolved(MODEL)).label \
        + option.label.format(on)


def test_the_label_names_the_options_in_the_lists_order():
    """The order of the parts is the list's, and each is as it was before the list existed; a kind's
    own options (Llama 4's chunk, Gemma 4's K=V, DSA's top-k) come between sinks and KV sharing."""
    assert [option.key for option in LAYER_OPTIONS] == ["sinks", "chunk", "k_eq_v", "index_topk", "kv_shared_layers"]
    attention = {"type": "gqa", "num_kv_heads": 2, "window": 128, "global_every": 2, "sinks": True, "index_topk": 4,
                 "kv_shared_layers": 3}
    assert variant_label(attention) == "gqa kv=2 w=128 1:1 sinks topk=4 kvshare=3"
    assert Variant.from_config({"attention": attention}).label == "gqa kv=2 w=128 1:1 sinks topk=4 kvshare=3"
    every = {**attention, "chunk": 128, "k_eq_v": 1}  # the chunk is the local layers' window
    assert variant_label(every) == "gqa kv=2 w=128 1:1 sinks chunk=128 k=v topk=4 kvshare=3"
    assert Variant.from_config({"attention": every}).label == "gqa kv=2 w=128 1:1 sinks chunk=128 k=v topk=4 kvshare=3"


@pytest.mark.parametrize("option", LAYER_OPTIONS, ids=IDS)
def test_an_option_on_is_in_the_label_and_the_record_and_a_record_without_it_reads_as_off(option):
    on = values(option)[0]
    plain = AttentionConfig(**layout(option)).resolved(MODEL)
    asked = AttentionConfig(**layout(option), **{option.key: on}).resolved(MODEL)
    base, label = Variant.of_attention(plain).label, on_label(option, on)
    assert getattr(asked, option.key) == on and getattr(plain, option.key) == option.off
    assert Variant.of_attention(asked).label == variant_label(asked) == label
    record = attention_record(asdict(asked))
    assert record[option.key] == on and Variant.from_config({"attention": record}).label == label
    assert dict(Variant.from_config({"attention": record}).options) == {option.key: on}
    # off, the key is left out, as in a record written before the option existed, which reads as off
    without = attention_record(asdict(plain))
    assert option.key not in without and Variant.from_config({"attention": without}).label == base
    assert Variant.from_config({"attention": without}).options == ()
    assert getattr(AttentionConfig(**without).resolved(MODEL), option.key) == option.off
    # a sweep over the option is a row per variant, not a column beside it
    assert f"attention.{option.key}" in VARIANT_KEYS


@pytest.mark.parametrize("option", LAYER_OPTIONS, ids=IDS)
def test_a_value_that_is_not_of_the_options_type_is_not_read_as_on(option):
    # of an option on only at some values (K=V's 1), another of its type is not one of them
    beyond = (max(option.values) + 1,) if option.values else ()
    for value in (None, option.off, "yes", 1.5, [1], 1 if type(option.off) is bool else True, *beyond):
        assert option.on(value) is None, value
        assert Variant.from_config({"attention": {"type": "gqa", "num_kv_heads": 2, option.key: value}}).options == ()


@pytest.mark.parametrize("option", PRESET_OPTIONS, ids=[o.key for o in PRESET_OPTIONS])
def test_a_models_own_option_is_resolved_and_recorded_only_when_on(option):
    """A null attention.<key> is the model's own (model.<preset>); the model's record keeps the
    preset only when on, and a model record without it reads as off."""
    on = values(option)[0]
    assert {f.name: f.default for f in fields(ModelConfig)}[option.preset] == option.off
    own = replace(MODEL, **{option.preset: on})
    assert getattr(AttentionConfig(**layout(option)).resolved(own), option.key) == on
    assert getattr(AttentionConfig(**layout(option), **{option.key: option.off}).resolved(own), option.key) \
        == option.off
    assert model_record(asdict(own))[option.preset] == on
    without = model_record(asdict(MODEL))
    assert option.preset not in without and getattr(ModelConfig.from_dict(without), option.preset) == option.off
    if option.kv_heads_only:  # an MLA layer has none: the model's own does not carry over, asking is refused
        assert getattr(AttentionConfig(type="mla").resolved(own), option.key) == option.off
        with pytest.raises(ConfigError) as info:
            AttentionConfig(type="mla", **{option.key: on}).resolved(MODEL)
        assert str(info.value) == f"attention.{option.key}={on!r}: {option.kv_heads_only}"


@pytest.mark.parametrize("option", LAYER_OPTIONS, ids=IDS)
@pytest.mark.parametrize("reverse", [False, True], ids=["saved-first", "asked-first"])
def test_a_checkpoint_refuses_the_option_asked_other_than_its_own(option, reverse):
    saved, asked = values(option)[::-1] if reverse else values(option)
    torch.manual_seed(0)
    model = Decoder(MODEL, AttentionConfig(**layout(option), **{option.key: saved}))
    with pytest.raises(CheckpointError) as info:
        to_layout(model, AttentionConfig(**layout(option), **{option.key: asked}).resolved(model.config))
    assert str(info.value) == f"attention.{option.key}={asked}: the checkpoint's is {saved} (leave it null)"
