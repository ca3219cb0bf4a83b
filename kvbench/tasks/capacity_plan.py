"""``task=capacity capacity.plan=true``: the capacity table from formulas and the serving store's plan,
with no model built and no probe run (a preset such as ``llama3_8b`` or ``deepseek_v3`` on a stated GPU
budget, from any machine).

Per context: the weights (the exact parameter count task=inspect prints, in ``runtime.dtype``), the
KV formula of one sequence (its layouts: K/V, a window's ring, a recurrent state) and the largest
batch they leave room for; and what each serving allocator's plan (:mod:`kvbench.serving.allocator`,
the code a served run uses) reserves for one sequence prefilled in ``capacity.prefill_chunk`` chunks
(block rounding, a window kept whole, a state page) and how many such sequences its pools hold. No
activation is in any of them: a measured run's ``activation_fixed_bytes`` is what they leave out.
"""

from __future__ import annotations

from typing import Any, Dict

from kvbench.config.bench import BenchConfig
from kvbench.core.dtypes import DTYPE_BYTES
from kvbench.layouts.build import build_layouts
from kvbench.results import RunResult
from kvbench.serving.allocator import ALLOCATORS, groups_of, make_plan
from kvbench.tasks.capacity_search import SEARCH_LIMIT, contexts, formula_max_batch, kv_bytes, kv_bytes_per_token
from kvbench.tasks.inspect import parameter_count

PLANNED = "memory (planned, not run)"  # what stops a planned batch: the formula, no probe
WEIGHTS = "weights (planned: they alone exceed the budget)"


def _stopped_by(fit: int, limit: int, budget: int, weights: int) -> str:
    """What bounds a planned batch: the weights alone, the search's capacity.max_batch (more would fit), or
    the memory formula."""
    return WEIGHTS if budget <= weights else SEARCH_LIMIT if fit >= limit else PLANNED


def plan_row(cfg: BenchConfig, context: int, budget: int, weights: int) -> Dict[str, Any]:
    """One context's planned figures (see the module's docstring)."""
    element, limit = DTYPE_BYTES[cfg.runtime.dtype], cfg.capacity.max_batch
    positions = context if cfg.workload.name == "multiturn" else context + cfg.workload.gen_len
    fit = formula_max_batch(cfg, context, budget, weights)
    row: Dict[str, Any] = {"context": context, "max_batch": fit, "stopped_by": _stopped_by(fit, limit, budget, weights),
                           "predicted_max_batch": fit,
                           "formula_max_batch": fit, "probes": 0,
                           "kv_bytes_per_sequence": kv_bytes(cfg, context, 2) - kv_bytes(cfg, context, 1)}
    groups = groups_of(build_layouts(cfg.model, cfg.attention, cfg.cache.state_dtype), element, cfg.cache.dtype)
    chunk = cfg.capacity.prefill_chunk or 1
    for allocator in ALLOCATORS:
        plan = make_plan(groups, allocator, cfg.cache.block_size, max(1, budget - weights), positions, chunk)
        row[f"plan_bytes_per_sequence_{allocator}"] = plan.worst_sequence_bytes(positions, chunk)
        row[f"plan_max_batch_{allocator}"] = min(limit, plan.sequences_fit(positions, chunk)) if budget > weights else 0
    return row


def plan_capacity(cfg: BenchConfig, budget: int, result: RunResult) -> None:
    """Every context's :func:`plan_row` into ``tables.capacity`` and the longest's into the metrics."""
    weights = parameter_count(cfg) * DTYPE_BYTES[cfg.runtime.dtype]
    rows = result.tables.setdefault("capacity", [])
    rows.extend(plan_row(cfg, context, budget, weights) for context in contexts(cfg))
    per_token, positions = kv_bytes_per_token(cfg)
    result.metrics.update(memory_budget_bytes=budget, weight_bytes=weights, probes_run=0,
                          memory_method="capacity.plan: formulas and the serving store's plan, nothing run",
                          kv_bytes_per_token=per_token, kv_bytes_per_token_positions=positions,
                          max_batch_longest=rows[-1]["max_batch"], stopped_by_longest=rows[-1]["stopped_by"],
                          # nothing is timed, so the machine's load says nothing about these figures
                          noisy=None, noisy_reason="nothing timed (capacity.plan: formulas only)")
