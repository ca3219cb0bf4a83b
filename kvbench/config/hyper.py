"""``model.hyper_connections``: DeepSeek-V4's manifold-constrained hyper-connections (mHC), the
residual kept as ``streams`` parallel copies mixed around every attention and MLP
(:mod:`kvbench.blocks.hyper_connection`); no torch. Null: the plain residual (every other model)."""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.core.errors import check


@dataclass
class HyperConnections:
    """config.json's ``hc_mult`` (``streams``), ``hc_sinkhorn_iters`` and ``hc_eps`` (DeepseekV4Config's
    defaults: 4, 20, 1e-6)."""

    streams: int = 4
    sinkhorn_iters: int = 20
    eps: float = 1e-6

    def __post_init__(self) -> None:
        for key in ("streams", "sinkhorn_iters"):
            value = getattr(self, key)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                  f"model.hyper_connections.{key}", value, "must be an integer >= 1")
        check(isinstance(self.eps, (int, float)) and not isinstance(self.eps, bool) and 0 < self.eps < 1,
              "model.hyper_connections.eps", self.eps, "must be a number in (0, 1)")
