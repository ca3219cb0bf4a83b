"""A model's mixture-of-experts MLPs (``model.moe``): how many experts, how a token is routed to its
top k, the shared expert beside them and which layers keep a dense MLP instead.

Three routers, as transformers computes them (:mod:`kvbench.mlp.router` runs them):

- ``softmax`` (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, DeepSeek-V2): a softmax over every expert's
  logit, the top k of it (DeepSeek-V2: from the ``topk_group`` groups with the highest maximum),
  renormalised to sum 1 with ``norm_topk_prob``;
- ``sigmoid`` (DeepSeek-V3/V3.2): a sigmoid per expert; the choice adds a learned correction bias
  and keeps the ``topk_group`` groups whose two best experts score highest; the weights are the
  sigmoids themselves, renormalised with ``norm_topk_prob``;
- ``softmax_topk`` (GPT-OSS): the top k logits (the router has a bias), then a softmax over those;
- ``sigmoid_topk`` (Llama 4): the top k logits, each through a sigmoid; with ``weigh_inputs`` a
  token is scaled by its weight before the expert (Llama4TextMoe), not the expert's output after.
- ``sqrtsoftplus`` (DeepSeek-V4): sqrt(softplus(logit)) per expert, chosen with the correction bias
  as the sigmoid router's (no groups); in ``hash_layers`` a token's experts are instead a fixed
  table's row for its token id (transformers' DeepseekV4HashRouter), the scores still weighing them.

Every router's weights are then multiplied by ``routed_scaling_factor``. An expert is a SwiGLU of
``expert_ffn_dim``; GPT-OSS's clamps it (``swiglu_limit``), adds one to up (``swiglu_up_shift``) and
biases (``expert_bias``); DeepSeek-V4's clamps it alone (alpha 1, shift 0: SiLU). Imports
no torch: inspect, capacity and the footprint check count experts from these fields alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, List, Mapping, Optional

from kvbench.core.errors import ConfigError, check, check_choice

ROUTERS = ("softmax", "sigmoid", "softmax_topk", "sigmoid_topk", "sqrtsoftplus")
# kvbench's key of each field whose value another field is checked against
# The config.json key a family's own files count their routed experts with (kvbench.config.hf's
# MOE_FAMILIES; transformers maps the other names onto it): the key a file without a count is told to
# add (a GPT-OSS file was told num_experts, which its files never hold).
EXPERTS_KEY = {"gpt_oss": "num_local_experts", "deepseek_v2": "n_routed_experts", "deepseek_v3": "n_routed_experts"}
_KEYS = {f: f"model.moe.{f}" for f in ("num_experts", "top_k", "expert_ffn_dim", "router", "n_group", "topk_group",
                                      "routed_scaling_factor", "shared_ffn_dim", "shared_gate", "swiglu_limit",
                                      "dense_layers", "hash_layers")}


@dataclass
class MoEShape:
    """The mixture-of-experts MLP of every layer not in ``dense_layers`` (those keep the dense
    SwiGLU of ``model.ffn_dim``). Field names are kvbench's; transformers' config.json keys are in
    the comments."""

    num_experts: int = 8  # E routed experts (n_routed_experts, num_experts, num_local_experts)
    top_k: int = 2  # k experts per token (num_experts_per_tok)
    expert_ffn_dim: int = 64  # each expert's SwiGLU width (moe_intermediate_size; GPT-OSS: intermediate_size)
    router: str = "softmax"  # softmax | sigmoid | softmax_topk | sigmoid_topk (the module docstring)
    weigh_inputs: bool = False  # the router's weight scales the token going in, not what comes out (Llama 4)
    norm_topk_prob: bool = False  # the k weights renormalised to sum 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1  # experts in n_group equal groups; a token's k come from its topk_group best groups
    topk_group: int = 1
    router_bias: bool = False  # a bias on the router's logits (GPT-OSS)
    shared_ffn_dim: int = 0  # a shared expert every token goes through (DeepSeek: n_shared_experts x expert width)
    shared_gate: bool = False  # the shared expert scaled by sigmoid(x . w) (Qwen3-Next, Qwen3.5-MoE)
    expert_bias: bool = False  # biases on the experts' projections (GPT-OSS)
    swiglu_limit: Optional[float] = None  # GPT-OSS: gate clamped above, up to +-limit, (up + 1) * glu
    swiglu_alpha: float = 1.702  # GPT-OSS: glu = gate * sigmoid(alpha * gate)
    swiglu_up_shift: float = 1.0  # with swiglu_limit: (up + shift) * glu (GPT-OSS 1; DeepSeek-V4 0)
    # every token also through the dense MLP of model.ffn_dim, the experts (GeGLU with model.mlp_act gelu_tanh)
    # and router reading the stream under norms of their own, learned router and per-expert scales (Gemma 4
    # 26B-A4B: kvbench.mlp.beside)
    beside_dense: bool = False
    hash_layers: List[int] = field(default_factory=list)  # DeepSeek-V4's hash_moe layers: experts by token id
    dense_layers: List[int] = field(default_factory=list)  # layers with a dense MLP of model.ffn_dim

    def __post_init__(self) -> None:
        check_moe({f.name: getattr(self, f.name) for f in fields(self)}, _KEYS)

    def sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is this mixture of experts (else the dense one)."""
        return layer not in self.dense_layers

    # ---- parameters, from the fields alone -------------------------------------------------

    def expert_params(self, d_model: int, gated: bool = True) -> int:
        """One routed expert's parameters: gate (when ``gated``: model.mlp_act silu) and up (d_model ->
        expert_ffn_dim), down, biases."""
        C, I = d_model, self.expert_ffn_dim  # noqa: E741
        return (3 if gated else 2) * C * I + (2 * I + C if self.expert_bias else 0)

    def layer_params(self, d_model: int) -> int:
        """A mixture-of-experts layer's MLP parameters: the router (and its bias), every routed
        expert, the shared expert and its gate (the sigmoid router's correction bias is a buffer,
        as in transformers: E values per layer, not counted). With ``beside_dense``, the experts' part
        alone: the dense MLP beside them, the norms and the router's scales are the decoder's to count
        (kvbench.footprint counts the built layer)."""
        C, E = d_model, self.num_experts
        router = E * C + (E if self.router_bias else 0)
        shared = 3 * C * self.shared_ffn_dim + (C if self.shared_gate else 0)
        return router + E * self.expert_params(C) + shared

    def active_layer_params(self, d_model: int) -> int:
        """The parameters one token's pass through the layer uses: all but the experts it was not
        routed to."""
        return self.layer_params(d_model) - (self.num_experts - self.top_k) * self.expert_params(d_model)

    def describe(self) -> str:
        """The routing in words, for task=inspect."""
        route = {"softmax": "softmax", "sigmoid": "sigmoid + correction bias", "softmax_topk": "top-k logits, "
                 "softmax over them", "sigmoid_topk": "top-k logits, a sigmoid each",
                 "sqrtsoftplus": "sqrt(softplus) + correction bias"}[self.router]
        if self.weigh_inputs:
            route += ", weighing the expert's input"
        if self.hash_layers:
            route += f"; {len(self.hash_layers)} layers by a token-id table"
        if self.n_group > 1:
            route += f", the best {self.topk_group} of {self.n_group} groups"
        if self.norm_topk_prob:
            route += ", renormalised"
        if self.routed_scaling_factor != 1:
            route += f", x {self.routed_scaling_factor:g}"
        text = f"{self.num_experts} experts of {self.expert_ffn_dim}, top {self.top_k} ({route})"
        if self.shared_ffn_dim:
            text += f" + a shared expert of {self.shared_ffn_dim}" + (" (sigmoid-gated)" if self.shared_gate else "")
        if self.beside_dense:
            text += " beside the dense MLP"
        if self.swiglu_limit is not None:
            text += f"; SwiGLU clamped at {self.swiglu_limit:g}, alpha {self.swiglu_alpha:g}"
        return text


def check_moe(values: Mapping[str, Any], keys: Mapping[str, str]) -> None:
    """The rules a mixture of experts obeys, each refusal one line naming the key and its value;
    ``keys`` names each field as the user wrote it (``model.moe.top_k``, or config.json's
    ``num_experts_per_tok``). ``values`` holds kvbench's fields."""
    E, k = values["num_experts"], values["top_k"]
    for name in ("num_experts", "top_k", "expert_ffn_dim", "n_group", "topk_group"):
        check(values[name] >= 1, keys[name], values[name], "must be >= 1")
    check(k <= E, keys["top_k"], k, f"must be <= {keys['num_experts']}={E} (a token picks k of the experts)")
    check_choice(keys["router"], values["router"], ROUTERS)
    groups, best = values["n_group"], values["topk_group"]
    check(E % groups == 0, keys["n_group"], groups, f"must divide {keys['num_experts']}={E} (groups of equal size)")
    check(best <= groups, keys["topk_group"], best, f"must be <= {keys['n_group']}={groups}")
    check(k <= best * (E // groups), keys["top_k"], k, f"must be <= {keys['topk_group']}={best} groups x "
          f"{E // groups} experts per group (a token's experts come from its best groups)")
    if values["router"] == "sigmoid":  # a group scores by the sum of its two best experts
        check(E // groups >= 2, keys["n_group"], groups, f"leaves {E // groups} expert per group; the sigmoid "
              "router scores a group by its two best experts (at least 2 per group)")
    check(values["routed_scaling_factor"] > 0, keys["routed_scaling_factor"], values["routed_scaling_factor"],
          "must be > 0")
    check(values["shared_ffn_dim"] >= 0, keys["shared_ffn_dim"], values["shared_ffn_dim"], "must be >= 0 (0: none)")
    check(not values["shared_gate"] or values["shared_ffn_dim"] > 0, keys["shared_gate"], values["shared_gate"],
          f"gates a shared expert, and {keys['shared_ffn_dim']}=0 has none")
    limit = values["swiglu_limit"]
    check(limit is None or limit > 0, keys["swiglu_limit"], limit, "must be > 0 or null (no clamp)")
    for key in ("dense_layers", "hash_layers"):
        layers = list(values.get(key) or ())
        check(all(isinstance(i, int) and i >= 0 for i in layers) and len(set(layers)) == len(layers),
              keys.get(key, f"model.moe.{key}"), layers, "must be distinct layer indices >= 0")
    check(not values.get("hash_layers") or values["router"] == "sqrtsoftplus", keys.get("hash_layers", "hash_layers"),
          values.get("hash_layers"), f"route by token id beside DeepSeek-V4's sqrtsoftplus router only (router="
          f"{values['router']})")


def check_run(moe: Optional[MoEShape], settings: Mapping[str, Any]) -> None:
    """Refuse a run setting a mixture of experts does not run with (``settings``: the job's
    :meth:`~kvbench.config.bench.BenchConfig.layout_settings`): the compiled fixed-shape step is one
    graph of fixed shapes, and the experts' loop follows each step's routing on the host."""
    if moe is not None and settings.get("runtime.compile") == "graph":
        raise ConfigError("runtime.compile=graph: the mixture-of-experts MLP (model.moe) runs each routed expert "
                          "on the tokens its router chose, a loop no fixed-shape graph captures; use "
                          "runtime.compile=false or default")
