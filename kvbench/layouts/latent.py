"""Latent layers: multi-head latent attention (DeepSeek-V2/V3, ``attention=mla``), as
transformers' DeepseekV3Attention, and DeepSeek Sparse Attention (DSA, DeepSeek-V3.2:
``attention.index_topk``), as its DeepseekV32Attention.

Each token's keys and values come from one latent c (R = kv_lora_rank, RMS-normed) through
``wkv_b``, plus one rotary key (d_rope) shared by all heads; the cache holds [c, k_rope]
(B, 1, S, R + d_rope). With DSA a lightning indexer also caches one key of ``index_head_dim``
per token, scores every cached token for each query (``index_n_heads`` ReLU'd dot products,
weighted per token) and each query attends only the ``index_topk`` best of those it may see: a
decode step reads every index key but only k latents. Kimi Linear's full layers (transformers'
KimiLinearAttention) are latent layers with ``rotary`` false: the shared key part is held and read
as projected, never rotated (positions enter that model through its KDA layers only), so the decoder
builds no rotary tables for them; what a layer caches, reads and spends is the same (their
config.json: :mod:`kvbench.layouts.kda`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Mapping, Optional, Tuple

from kvbench.core.dtypes import CACHE_DTYPE_BYTES, DTYPE_BYTES, SCALE_BYTES, element_bytes
from kvbench.core.errors import ConfigError
from kvbench.core.hf_keys import Source
from kvbench.core.hf_read import REQUIRED, get
from kvbench.layouts.base import LayerLayout, Limit, bytes_cell, elements_line, fp4_bytes_lines
from kvbench.layouts.kv_heads import KVHeads
from kvbench.layouts.latent_config import INDEX_FIELDS, MLA_FIELDS
from kvbench.layouts.pages import positions_spec
from kvbench.layouts.registry import LayerKind, LayerOption, register


@dataclass(frozen=True)
class Latent(LayerLayout):
    """A layer that caches one latent of ``kv_lora_rank`` plus a rotary key per token (``rotary``
    false: a key part of the same width left unrotated, Kimi Linear's)."""

    num_heads: int = 1
    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    absorbed: bool = True  # attention.mla_decode: how a decode step reads the latents
    # DSA's lightning indexer, DeepSeek-V3.2's names (index_topk 0: none, every visible token attended)
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    rotary: bool = True  # whether the qk_rope_head_dim parts are rotated (Kimi Linear's full layers: not)

    kind = "latent"
    width_names = ("kv_lora_rank + qk_rope_head_dim", "index_head_dim")

    @property
    def stored(self) -> Tuple[int, Tuple[int, ...]]:
        # with an indexer, its key is a second tensor per position (what the cache calls V)
        return 1, (self.kv_lora_rank + self.qk_rope_head_dim,) + ((self.index_head_dim,) if self.index_topk else ())

    def page_spec(self, element: int, cache_dtype: str = "auto"):
        """What a serving store keeps of a sequence here: positions in blocks, a window's ring
        (:mod:`kvbench.layouts.pages`), or nothing where the layer reads another's K/V."""
        return positions_spec(self, element, cache_dtype)

    def shard(self, ranks: int) -> "Latent":
        # the latent (and an indexer's key) is every head's: each rank's heads read a whole copy
        return replace(self, num_heads=self.num_heads // ranks)

    def attended(self, context: float) -> float:
        """Latents one decode step of one sequence attends at ``context`` positions."""
        held = self.positions_held(context)
        return min(held, self.index_topk) if self.index_topk else held

    def read_bytes(self, context: float, element: int, cache_dtype: str = "auto") -> float:
        if not self.index_topk:
            return super().read_bytes(context, element, cache_dtype)
        # every index key, but only the k selected latents
        latent, index = (element_bytes(w, element, cache_dtype) for w in self.stored[1])
        return self.positions_held(context) * index + self.attended(context) * latent

    @property
    def rotary_dim(self) -> int:
        return self.qk_rope_head_dim if self.rotary else 0  # unrotated: held and read as projected

    def step_flops(self, context: float) -> float:
        # the absorbed form: each head's query against R + d_rope latent elements, its output over R;
        # the indexer: each of its heads' query against every index key, and the weighted sum over heads
        latents = 2.0 * self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim) * self.attended(context)
        return latents + 2.0 * self.index_n_heads * (self.index_head_dim + 1) * self.positions_held(context) \
            if self.index_topk else latents

    def as_mha(self) -> LayerLayout:
        return KVHeads(None, self.num_heads, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim,
                       v_head_dim=self.v_head_dim)

    def fields(self) -> Dict[str, Any]:
        return {"kv_lora_rank": self.kv_lora_rank, **super().fields(),
                **({"index_topk": self.index_topk} if self.index_topk else {})}

    def limits(self, index: Optional[int] = None):
        # a model's K/V heads repeated or mean-pooled (checkpoint.convert_kv_heads) make no latent
        own = (Limit("kv_conversion", ("none",), "converts K/V heads by mean-pooling them; attention=mla caches a "
                     "latent, which pooling does not make (converting to MLA is not built)"),)
        if self.index_topk:
            why = f"attention.index_topk={self.index_topk} (DSA's top-k selection) is not built for"
            own += (Limit("cache.shared", (False, None), f"{why} a shared prefix; use cache.shared=false"),
                    Limit("runtime.compile", ("false", "default"), f"{why} the fixed-shape step; use false or default"))
        return super().limits(index) + own

    # ---- what the tasks ask of it ----

    size_keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    decode_forms = ("absorbed", "expanded")  # attention.mla_decode

    # ---- how inspect describes it ----

    def in_words(self) -> str:
        return "multi-head latent attention" + ("" if self.rotary else " without rotary embeddings")

    def describe_layers(self, layers, attention, seq_len: int, batch_size: int) -> List[str]:
        width = self.kv_lora_rank + self.qk_rope_head_dim
        index = self.index_head_dim if self.index_topk else 0
        q = f"q_lora_rank {self.q_lora_rank}" if self.q_lora_rank else "q by a full-rank projection"
        dsa = (f"; DSA: an indexer of {self.index_n_heads} heads x {self.index_head_dim} keeps a key of "
               f"{self.index_head_dim} per token and each query attends its top index_topk = {self.index_topk} "
               "tokens") if self.index_topk else ""
        attending = sum(layer.state is None for layer in layers)  # the others hold a constant state instead
        recurrent = next((layer for layer in layers if layer.state is not None), None)
        linear = "" if recurrent is None else f"; {len(layers) - attending} of {len(layers)} layers " \
            f"{recurrent.in_words()}"
        return [
            f"attention mla: multi-head latent attention, one latent per token and layer (kv_lora_rank "
            f"{self.kv_lora_rank} + qk_rope_head_dim {self.qk_rope_head_dim} = {width}) for all {self.num_heads} "
            f"query heads (qk_nope_head_dim {self.qk_nope_head_dim}, v_head_dim {self.v_head_dim}, {q}); decode "
            f"{'absorbed' if self.absorbed else 'expanded'}{dsa}{linear}",
            "",
            f"KV cache = layers · (kv_lora_rank + qk_rope_head_dim{' + index_head_dim' if index else ''}) · seq_len · "
            f"batch · bytes = {attending} · {width + index} · seq_len · batch · bytes",
            elements_line(width + index, seq_len, batch_size, "latent + index key" if index else "latent"),
            f"cache.dtype {' / '.join(CACHE_DTYPE_BYTES)}: bytes = 1 per element + a {SCALE_BYTES}-byte scale per "
            "(sequence, position), one per latent" + (" and one per index key" if index else ""),
            *fp4_bytes_lines(layers),
        ]

    def memory_lines(self, layers, dtype: str, element: int) -> List[str]:
        # the same model with K/V heads, for comparison (vs MHA in the table is the ratio)
        mha = layers.as_mha()
        widths = self.as_mha().stored[1]
        per_token = ", ".join(f"{d} {bytes_cell(mha.bytes_per_token(size))}" for d, size in DTYPE_BYTES.items())
        return [f"the same model as MHA ({self.num_heads} heads, K {widths[0]} + V {widths[1]} per head) holds per "
                f"token: {per_token}"]

    def closing_lines(self, layers, seq_len: int, dtype: str, element: int) -> List[str]:
        """What DSA's top-k changes: a decode step reads every index key but at most index_topk latents."""
        if not self.index_topk:
            return []
        k, width = self.index_topk, self.kv_lora_rank + self.qk_rope_head_dim
        return ["", f"DSA: a decode step at context S reads every index key and min(S, index_topk={k}) latents "
                f"(layers · (S · {self.index_head_dim} + min(S, {k}) · {width}) · bytes); in {dtype} at S = "
                f"{seq_len}: {bytes_cell(layers.read_bytes(seq_len, 1, element))} read of "
                f"{bytes_cell(layers.cache_bytes(seq_len, 1, element))} held per sequence"]



# ---- config.json ---------------------------------------------------------------------------

def _count(cfg: Mapping[str, Any], key: str, default: int, least: int = 1) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{key}={value!r}: must be an integer >= {least}")
    return value


# DeepSeek-V2/V3 (kv_lora_rank in config.json) and V3.2 (+ DSA's indexer, index_topk in config.json), with
# the switches their attention needs; their mixtures of experts: kvbench.config.hf.MOE_FAMILIES
ARCHITECTURES = {arch: {"qkv_bias": False, "qk_norm": False}
                 for arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")}


def rope_interleaved(cfg: Mapping[str, Any]) -> bool:
    """Whether a DeepSeek checkpoint rotates its rope dimensions in interleaved pairs: V2 always
    (complex rotation), V3.2 always (its latent attention; its indexer rotates halves), V3 with
    ``rope_interleave`` (its default)."""
    archs = get(cfg, "architectures", "list", [])
    return bool({"DeepseekV2ForCausalLM", "DeepseekV32ForCausalLM"} & set(archs)) or \
        get(cfg, "rope_interleave", "bool", True)


def hf_fields(cfg: Mapping[str, Any], arch: str, keys: Dict[str, Any]) -> Dict[str, Any]:
    """ModelConfig's latent fields (``model.preset_mla``) from a DeepSeek-V2/V3/V3.2 config.json;
    ``keys``: where each was read (as :func:`kvbench.config.hf.model_fields` keeps them)."""
    shape = {k: get(cfg, k, "int", REQUIRED) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                       "v_head_dim")}
    shape["q_lora_rank"] = get(cfg, "q_lora_rank", "int") or 0
    if "index_topk" in cfg:  # DeepSeek-V3.2's lightning indexer (DSA)
        shape.update({k: get(cfg, k, "int", REQUIRED) for k in ("index_topk", "index_n_heads", "index_head_dim")})
    rope_interleaved(cfg)  # read by the loader: checked here, where the file is named
    keys.update({f"preset_mla.{k}": k for k in shape}, preset_kv_heads="num_attention_heads",
                head_dim=Source("qk_nope_head_dim + qk_rope_head_dim"))
    # head_dim: the query/key head width (transformers' qk_head_dim; its config.json head_dim is the rope's)
    return {"preset_mla": shape, "head_dim": shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"],
            "preset_kv_heads": get(cfg, "num_attention_heads", "int", REQUIRED)}


def build(model, attention, window: Optional[int]) -> Latent:
    """A layer of ``model`` (a ModelConfig) under a resolved ``attention=mla``: its ranks, decode form
    and indexer; its shared key part unrotated in a model without rotary embeddings (``rope_type``
    none: Kimi Linear's)."""
    return Latent(window, model.num_heads, attention.q_lora_rank, attention.kv_lora_rank,
                  attention.qk_nope_head_dim, attention.qk_rope_head_dim, attention.v_head_dim,
                  attention.mla_decode == "absorbed", attention.index_n_heads or 0,
                  attention.index_head_dim or 0, attention.index_topk or 0, rotary=model.rope_type != "none")


# DSA's top-k: part of the latent shape (its model's own is model.preset_mla's), labelled as an option
TOPK = LayerOption("index_topk", " topk={}", 0, every_position="selects among every cached token", positions=True,
                   with_keys=tuple(k for k in INDEX_FIELDS if k != "index_topk"))

KIND = register(LayerKind(
    "latent", Latent, module="kvbench.layouts.latent_attention:LatentAttention",
    letters={"r": "kv_lora_rank", "k": "index_topk"}, attention_types=("mla",),
    title="multi-head latent attention", shape_keys=MLA_FIELDS, preset="preset_mla",
    record_keys=(*MLA_FIELDS, "mla_decode"),
    options=(TOPK,), build=build, architectures=ARCHITECTURES, hf_fields=hf_fields,
    examples={"mla": ("model=tiny", "attention=mla"),
              "dsa": ("model=tiny", "attention=mla", "attention.index_topk=4")}))
