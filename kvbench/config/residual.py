"""``model.residual``: the residual stream's form from the embedding to the logits where it is not
Llama's, as Gemma 4 trains it (transformers' Gemma4TextModel, Gemma4TextDecoderLayer,
Gemma4ForCausalLM); no torch. Null: Llama's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvbench.core.errors import check


@dataclass
class ResidualForm:
    """``embed_scale``: the embedding times it, the factor cast to the compute dtype first (Gemma's
    sqrt(d_model): 55.5 in bfloat16 for 55.43); ``post_norms``: the attention's and the MLP's outputs
    RMS-normed before they join the stream (Gemma's sandwich norms); ``layer_scalar``: each block's
    output times a learned scalar of its own; ``per_layer_input_dim``: a per-layer input of that width
    (Gemma 4's per-layer embeddings, PLE), a token's row of a table of ``per_layer_vocab_size`` (null:
    the model's vocab_size) rows, one slice per layer, beside a projection of the embedding, gating a
    third branch of each block, 0: none; ``logit_softcap``: logits = cap tanh(logits / cap) (null: none);
    ``shared_mlp_factor``: a layer reading another's K/V (KV sharing) has a dense MLP this many times
    model.ffn_dim wide (Gemma 4 E2B's use_double_wide_mlp: 2)."""

    embed_scale: Optional[float] = None
    post_norms: bool = False
    layer_scalar: bool = False
    per_layer_input_dim: int = 0
    per_layer_vocab_size: Optional[int] = None
    logit_softcap: Optional[float] = None
    shared_mlp_factor: int = 1

    def __post_init__(self) -> None:
        for key in ("post_norms", "layer_scalar"):
            check(isinstance(getattr(self, key), bool), f"model.residual.{key}", getattr(self, key),
                  "must be true or false")
        for key in ("embed_scale", "logit_softcap"):
            value = getattr(self, key)
            check(value is None or isinstance(value, (int, float)) and not isinstance(value, bool)
                  and 0 < value < float("inf"), f"model.residual.{key}", value, "must be a finite number > 0, or null")
        factor = self.shared_mlp_factor
        check(isinstance(factor, int) and not isinstance(factor, bool) and 1 <= factor <= 64,
              "model.residual.shared_mlp_factor", factor, "must be an integer from 1 to 64 (1: as wide as the others)")
        dim, vocab = self.per_layer_input_dim, self.per_layer_vocab_size
        check(isinstance(dim, int) and not isinstance(dim, bool) and 0 <= dim <= 2**20,
              "model.residual.per_layer_input_dim", dim, "must be an integer >= 0 (0: no per-layer input)")
        check(vocab is None or isinstance(vocab, int) and not isinstance(vocab, bool) and 1 <= vocab <= 2**31,
              "model.residual.per_layer_vocab_size", vocab, "must be an integer >= 1, or null (model.vocab_size)")
