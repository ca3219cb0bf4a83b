"""``task=compare``'s section of the config (:class:`CompareConfig`): attention variants timed in one
process, and what the task reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

from kvbench.config.layer_options import LAYER_OPTIONS
from kvbench.config.layer_pattern import interval_layer_types, variant_label
from kvbench.config.model import ATTENTION_TYPES, AttentionConfig, ModelConfig, attention_type
from kvbench.core.errors import ConfigError, check, check_positive
from kvbench.core.task import ALL, TIMED_RUNTIME, Task
from kvbench.layouts.kinds import registered

# compare.variants options after the layout (``gqa:w1024:g6``) and the AttentionConfig field each sets:
# a window's and KV sharing's, then each kind's own (LayerKind.letters: a rank, a top-k, a recurrent
# kind's full_attention_interval ...), each with the words an error shows for it.
_WORDS = {"w": "window", "c": "chunk", "g": "every k-th layer global", "s": "kv_shared_layers"}
_SYMBOLS = {"window": "W", "chunk": "C", "global_every": "k", "kv_shared_layers": "N",
            "layer_types": "n"}  # a kind's: its own name
VARIANT_OPTIONS = {"w": "window", "c": "chunk", "g": "global_every", "s": "kv_shared_layers",
                   **{letter: key for kind in registered() for letter, key in kind.letters.items()}}
# A recurrent kind's interval letter (the letter it gives full_attention_interval): every k-th layer full
# attention, the others that kind's layer type, whose layer_types compare builds for the model
# (attention.full_attention_interval itself names one kind's layers only).
INTERVAL = "full_attention_interval"
_INTERVAL_TYPES = {letter: kind.layer_types[0] for kind in registered() if kind.recurrent
                   for letter, key in kind.letters.items() if key == INTERVAL}
_WORDS.update({letter: f"{INTERVAL} of {t} layers" for letter, t in _INTERVAL_TYPES.items()})
# A kind's pattern letter (its letter of layer_types: DeepSeek-V4's): its count is the kind's layer pattern for
# the model (LayerKind.pattern), made once the model's number of layers is known
_PATTERNS = {letter: kind for kind in registered() for letter, key in kind.letters.items() if key == "layer_types"}
_WORDS.update({letter: f"{kind.label} pattern" for letter, kind in _PATTERNS.items()})
# the layer options a model may have of its own (a preset field) that compare has a letter for
LETTERED_OPTIONS = tuple(o for o in LAYER_OPTIONS if o.preset and o.key in VARIANT_OPTIONS.values())
_SYNTAX = ", ".join(f":{letter}<{_WORDS.get(letter, key)}>" for letter, key in VARIANT_OPTIONS.items())
_OPTIONS = ", ".join(f":{letter}<{_SYMBOLS.get(key, key)}>" for letter, key in VARIANT_OPTIONS.items())


def variant_fields(spec: str, variants: Any = None) -> Dict[str, Any]:
    """AttentionConfig fields of one ``compare.variants`` entry: ``<type or KV-head count>`` then
    options :w<W> (a window on local layers), :c<C> (local layers chunked instead, Llama 4's: ``gqa:c8192:g4``),
    :g<k> (every k-th layer global, needs :w or :c), :s<N> (the
    last N layers share K/V) and each registered kind's letters (``LayerKind.letters``, each setting
    the ``attention.*`` field it names: ``mla:r64``; a recurrent kind's interval, ``gqa:d4`` or ``gqa:m2``,
    every k-th layer full attention and the others that kind's; a kind's pattern, ``1:w128:p2``, its
    ``LayerKind.pattern`` of that count); an option left out is none of it."""
    where = ("compare.variants", spec if variants is None else variants)
    head, *options = str(spec).split(":")
    check(head in ATTENTION_TYPES or (head.isdigit() and int(head) >= 1), *where,
          f"{spec!r} is neither an attention type ({', '.join(ATTENTION_TYPES)}) nor a KV-head count >= 1 "
          f"(options: {_SYNTAX}, e.g. gqa:w1024:g6, gqa:d4)")
    out: Dict[str, Any] = {"type": head} if head in ATTENTION_TYPES else {"num_kv_heads": int(head)}
    for option in options:
        key = VARIANT_OPTIONS.get(option[:1])
        check(key is not None and option[1:].isdigit() and int(option[1:]) >= 1 and key not in out, *where,
              f"{spec!r}: option {option!r} must be one of "
              f"{_OPTIONS} "
              "with a number >= 1, each once")
        out[key] = int(option[1:])
        if option[:1] in _PATTERNS:  # the kind's pattern of that count, for the model (CompareConfig.attentions)
            out["pattern_letter"] = option[:1]
        if key == INTERVAL:  # which recurrent kind's layers the interval asks for (one letter per variant)
            out["interval_layer_type"] = _INTERVAL_TYPES[option[:1]]
    check("global_every" not in out or "window" in out or "chunk" in out, *where,
          f"{spec!r}: :g<k> says which layers are global, and needs a window (:w<W>) or a chunk (:c<C>) for the others")
    out.setdefault("window", 0)  # no option: no window, whatever the model's own
    out.setdefault("chunk", 0)  # nor chunk
    out.setdefault("kv_shared_layers", 0)  # nor sharing
    out.setdefault(INTERVAL, 0)  # and no recurrent layer
    for option in LETTERED_OPTIONS:  # nor a layer option a model has of its own (K=V), unless its letter asks
        out.setdefault(option.key, option.off)
    return out


@dataclass
class CompareConfig:
    """``task=compare``: attention variants timed in one process, alternating trial by trial.

    ``variants``: attention types (``mha``, ``gqa``, ``mqa``, ``mla``) or KV-head counts, each
    optionally with a window (``mha:w1024``: every layer local; ``gqa:w1024:g6``: Gemma 3's five
    local to one global) or MLA's rank (``mla:r256``), see :func:`variant_fields`; the first is
    the baseline of every ratio. ``contexts``: the context lengths (positions already in the
    cache) a decode step is timed at; three or more distinct ones give the KV cost slope (three on
    each side of a window give the slope below and past it). ``steps``: timed steps per context
    per trial."""

    variants: List[str] = field(default_factory=lambda: ["mha", "gqa", "mqa"])
    contexts: List[int] = field(default_factory=lambda: [256, 512, 1024, 1536, 2048])
    steps: int = 8

    def __post_init__(self) -> None:
        check_positive("compare", self, ("steps",))
        check(len(self.variants) >= 2, "compare.variants", self.variants, "needs two or more variants to compare")
        for v in self.variants:
            variant_fields(v, self.variants)
        check(len(self.contexts) >= 1 and all(c >= 1 for c in self.contexts), "compare.contexts", self.contexts,
               "must list one or more context lengths >= 1")
        check(len(set(self.contexts)) == len(self.contexts), "compare.contexts", self.contexts,
               "lists a context length twice")

    def attentions(self, model: "ModelConfig") -> List["AttentionConfig"]:
        """Each variant as a resolved :class:`AttentionConfig` for ``model`` (a count is typed by
        :func:`attention_type`); a variant the model cannot have names ``compare.variants``."""
        out = []
        for v in self.variants:
            fields_ = variant_fields(v, self.variants)
            letter = fields_.pop("pattern_letter", None)
            try:
                if letter is not None:
                    fields_["layer_types"] = list(_PATTERNS[letter].pattern(fields_["layer_types"], model.num_layers))
            except ConfigError as exc:
                raise ConfigError(f"compare.variants={self.variants!r}: {v!r}: {exc}") from None
            name = fields_.pop("interval_layer_type", None)
            if name is not None:  # the asked kind's layers by the interval, as layer_types (none: every layer full)
                types = interval_layer_types(fields_[INTERVAL], model.num_layers, name)
                fields_.update(layer_types=types, **{INTERVAL: None if types else 0})
            if "num_kv_heads" in fields_:
                fields_["type"] = attention_type(model.num_heads, fields_["num_kv_heads"])
            try:
                out.append(AttentionConfig(**fields_).resolved(model))
            except ConfigError as exc:
                raise ConfigError(f"compare.variants={self.variants!r}: {v!r}: {exc}") from None
        labels = [variant_label(a, num_layers=model.num_layers) for a in out]
        check(len(set(labels)) == len(labels), "compare.variants", self.variants,
               f"two variants are the same layout ({', '.join(labels)})")
        return out


def check_compare_run(cfg: Any) -> None:
    """The rules across groups; the variants were resolved before (:func:`compare_attentions`)."""
    longest = max(cfg.compare.contexts)
    check(longest < cfg.model.max_seq_len, "compare.contexts", cfg.compare.contexts,
          f"a step at context {longest} needs {longest + 1} positions, more than model.max_seq_len="
          f"{cfg.model.max_seq_len}")
    check(cfg.cache.impl == "static", "cache.impl", cfg.cache.impl,
          "task=compare sets the filled length of a preallocated cache; use cache.impl=static")
    check(cfg.runtime.compile == "false", "runtime.compile", cfg.runtime.compile,
          "task=compare times eager steps only (use task=bench for compiled decoding)")


def compare_attentions(cfg: Any) -> List[Tuple[str, AttentionConfig]]:
    """Each variant's attention, after what a refusal of it names."""
    return [(f"compare.variants={cfg.compare.variants!r}: {v!r}: ", attention)
            for v, attention in zip(cfg.compare.variants, cfg.compare.attentions(cfg.model))]


# Many variants, none of them the record's attention; of the workload only its batch size.
COMPARE = Task(reads={"workload": ("batch_size",), "cache": ("impl", "state_dtype"), "runtime": TIMED_RUNTIME,
                      "compare": ALL},
               check=check_compare_run, attentions=compare_attentions)
