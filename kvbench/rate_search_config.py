"""``workload.search``: the search for the highest arrival rate a variant serves within the SLO
(``workload=serving workload.search.enabled=true``; :mod:`kvbench.serving.rate_search`), checked
where the values enter, each failure one line naming the key and the value."""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.config_errors import check, check_numbers


@dataclass
class RateSearchConfig:
    """Gallop from ``min_rate`` by ``growth`` until a run misses the SLO (or ``max_rate``), then
    bisect until the highest pass and the lowest failure are within ``1 + rel_tol``; at most
    ``max_runs`` serving runs, each of the workload's requests at that rate."""

    enabled: bool = False
    min_rate: float = 0.5  # requests per second
    max_rate: float = 64.0
    growth: float = 2.0
    rel_tol: float = 0.1
    max_runs: int = 10

    def __post_init__(self) -> None:
        check_numbers("workload.search", self)
        check(self.min_rate > 0, "workload.search.min_rate", self.min_rate, "must be > 0 requests per second")
        check(self.max_rate > self.min_rate, "workload.search.max_rate", self.max_rate,
              f"must be > workload.search.min_rate={self.min_rate}")
        check(self.growth > 1, "workload.search.growth", self.growth, "must be > 1 (the gallop's factor)")
        check(self.rel_tol > 0, "workload.search.rel_tol", self.rel_tol, "must be > 0 (a ratio: 0.1 is 10 %)")
        check(self.max_runs >= 2, "workload.search.max_runs", self.max_runs, "must be >= 2 (both ends of a bracket)")


def check_rate_search(cfg) -> None:
    """The SLO's and the search's cross-group rules on a :class:`kvbench.config.BenchConfig`: the
    search is a serving benchmark of a fixed number of generated requests, judged by at least one
    SLO target; serving judges TPOT in ms only, capacity no E2E."""
    w, slo = cfg.workload, cfg.slo
    if w.name == "serving":
        check(slo.tpot_x_batch1 is None, "slo.tpot_x_batch1", slo.tpot_x_batch1,
              "workload=serving judges TPOT against slo.tpot_ms (a multiple of the batch-1 step is task=capacity's)")
    if cfg.task == "capacity":
        check(getattr(slo, "e2e_ms", None) is None, "slo.e2e_ms", getattr(slo, "e2e_ms", None),
              "task=capacity judges TTFT and TPOT only (an E2E target is workload=serving's)")
    if not w.search.enabled:
        return
    check(cfg.task in ("bench", "inspect") and w.name == "serving", "workload.search.enabled", True,
          f"searches the rate of task=bench workload=serving (got task={cfg.task} workload={w.name})")
    check(w.arrival != "trace", "workload.arrival", w.arrival,
          "workload.search.enabled=true draws arrivals at each rate: use poisson or gamma (a trace fixes its times)")
    check(w.num_requests is not None, "workload.num_requests", w.num_requests,
          "workload.search.enabled=true serves the same requests at each rate: set workload.num_requests")
    check(any(getattr(slo, k, None) is not None for k in ("ttft_ms", "tpot_ms", "e2e_ms")), "slo.name", slo.name,
          "workload.search.enabled=true needs an SLO target: slo.ttft_ms, slo.tpot_ms or slo.e2e_ms "
          "(e.g. slo=llama2_70b_server)")
