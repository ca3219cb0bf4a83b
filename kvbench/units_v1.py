"""The unit of every metric a schema-1 record can hold, as data.

A schema-1 record kept a metric's unit only inside the prose of its ``methods`` line. Since only
schema 2 is written, the names a schema-1 record can hold are a closed set: every metric declared
when schema 2 replaced it, and retired ones (``tokens_per_s_warning``). ``tests/test_views.py``
checks this table against the registry and every committed schema-1 record.
"""

from __future__ import annotations

from typing import Dict, Tuple

# unit -> the names (or patterns, ``<v>_step_ms_ctx<C>``) of the metrics in it
_BY_UNIT: Dict[str, Tuple[str, ...]] = {
    "": (
        "ci_trials", "kv_cost", "paired_ratio", "series.train_step", "tables.accuracy",
        "tables.capacity", "tables.capacity_probes", "tables.compare", "tables.curve",
        "tables.serving_rate_curve", "tables.serving_requests", "tables.serving_samples",
        "tables.train_curve", "tables.trials", "tables.turns",
    ),
    "%": (
        "percent_of_peak",
    ),
    "FLOP": (
        "flops_per_step",
    ),
    "GB/s": (
        "achieved_gb_per_s", "peak_gb_per_s", "probe_copy_gb_per_s", "probe_gemv_gb_per_s",
    ),
    "GFLOP/s": (
        "peak_gflops",
    ),
    "W": (
        "power_limit_w",
    ),
    "bits/byte": (
        "bits_per_byte", "bits_per_byte_before_uptrain",
    ),
    "bool": (
        "block_waste_within_bound", "noisy", "slo_met",
    ),
    "bytes": (
        "<v>_kv_bytes_ctx<C>", "<v>_kv_bytes_per_token", "<v>_kv_cache_bytes",
        "<v>_kv_cache_bytes_formula", "block_waste_bound_bytes_max", "block_waste_bytes_max",
        "block_waste_bytes_mean", "bytes_read_per_step", "corpus_bytes", "kv_budget_bytes",
        "kv_bytes_per_token", "kv_bytes_read_per_step", "kv_cache_bytes", "kv_cache_bytes_formula",
        "kv_cache_bytes_nvml", "kv_cache_bytes_torch", "kv_store_bytes", "kv_store_bytes_formula",
        "memory_budget_bytes", "nvml_device_used_bytes", "nvml_peak_used_bytes",
        "nvml_process_used_bytes", "peak_rss_bytes", "series.serving_block_waste_bytes",
        "torch_peak_allocated_bytes", "torch_peak_reserved_bytes", "weight_bytes",
        "weight_bytes_measured",
    ),
    "bytes per 1,000 tokens of context": (
        "<v>_kv_bytes_per_1k_ctx_below_w", "<v>_kv_bytes_per_1k_ctx_past_w",
    ),
    "bytes/token": (
        "bytes_per_token",
    ),
    "count": (
        "accuracy_seeds", "block_waste_over_bound_samples", "checkpoint_num_kv_heads",
        "compiled_graphs", "decode_ms_p50_n", "decode_ms_p90_n", "decode_ms_p99_n", "e2e_ms_p50_n",
        "e2e_ms_p90_n", "e2e_ms_p99_n", "good_requests", "init_num_kv_heads", "iterations",
        "itl_ms_p50_n", "itl_ms_p90_n", "itl_ms_p99_n", "kv_blocks_total", "kv_blocks_used_max",
        "max_rate_non_monotone", "max_rate_probes", "mean_ttft_ms_turns_2_n_n", "num_kv_heads",
        "num_params", "nvml_samples", "preemptions", "prefill_ms_n", "probes_run", "queue_ms_p50_n",
        "queue_ms_p90_n", "queue_ms_p99_n", "recompiles", "requests", "requests_finished",
        "requests_never_scheduled", "requests_unfinished", "rounds", "running_max", "samples",
        "series.serving_kv_blocks_used", "series.serving_running", "series.serving_waiting", "steps",
        "tokens_per_s_n", "tpot_ms_p50_n", "tpot_ms_p90_n", "tpot_ms_p99_n", "trials_run",
        "ttft_ms_p50_n", "ttft_ms_p90_n", "ttft_ms_p99_n", "turn1_ttft_ms_n", "usable_cpus",
        "waiting_max",
    ),
    "fraction": (
        "<v>_kv_share_ctx<C>", "dtype_top1_agreement", "fidelity_top1_agreement",
        "kv_pool_top1_agreement", "kvq_top1_agreement", "mla_forms_top1_agreement", "overhead_share",
    ),
    "logits": (
        "dtype_max_abs_logit_diff", "fidelity_max_abs_logit_diff", "kvq_max_abs_logit_diff",
        "mla_forms_max_abs_logit_diff",
    ),
    "mJ": (
        "energy_mj",
    ),
    "mJ/token": (
        "energy_mj_per_token",
    ),
    "ms": (
        "<v>_decode_ms_at_ctx0", "<v>_step_ms_ctx<C>", "attainable_ms", "decode_ms_at_ctx0",
        "decode_ms_mean", "decode_ms_p50", "decode_ms_p50_ci_high", "decode_ms_p50_ci_low",
        "decode_ms_p50_longest", "decode_ms_p90", "decode_ms_p99", "decode_ms_p99_ci_high",
        "decode_ms_p99_ci_low", "e2e_ms", "e2e_ms_mean", "e2e_ms_p50", "e2e_ms_p50_ci_high",
        "e2e_ms_p50_ci_low", "e2e_ms_p90", "e2e_ms_p99", "e2e_ms_p99_ci_high", "e2e_ms_p99_ci_low",
        "gemm_ms_at_batch", "itl_ms_mean", "itl_ms_p50", "itl_ms_p50_ci_high", "itl_ms_p50_ci_low",
        "itl_ms_p90", "itl_ms_p99", "itl_ms_p99_ci_high", "itl_ms_p99_ci_low", "mean_ttft_ms_turns_2_n",
        "mean_ttft_ms_turns_2_n_ci_high", "mean_ttft_ms_turns_2_n_ci_low", "overhead_ms_per_step",
        "prefill_ms", "prefill_ms_ci_high", "prefill_ms_ci_low", "queue_ms_mean", "queue_ms_p50",
        "queue_ms_p50_ci_high", "queue_ms_p50_ci_low", "queue_ms_p90", "queue_ms_p99",
        "queue_ms_p99_ci_high", "queue_ms_p99_ci_low", "roofline_ms", "series.decode_ms",
        "tpot_ms_mean", "tpot_ms_p50", "tpot_ms_p50_ci_high", "tpot_ms_p50_ci_low", "tpot_ms_p90",
        "tpot_ms_p99", "tpot_ms_p99_ci_high", "tpot_ms_p99_ci_low", "ttft_ms_mean", "ttft_ms_p50",
        "ttft_ms_p50_ci_high", "ttft_ms_p50_ci_low", "ttft_ms_p90", "ttft_ms_p99",
        "ttft_ms_p99_ci_high", "ttft_ms_p99_ci_low", "turn1_ttft_ms_ci_high", "turn1_ttft_ms_ci_low",
        "turn<k>_ttft_ms",
    ),
    "nats per position": (
        "kv_pool_kl_nats",
    ),
    "nats/token": (
        "series.train_loss", "train_loss", "val_loss", "val_loss_before_uptrain",
    ),
    "positions": (
        "window_split_ctx",
    ),
    "ratio": (
        "<v>_kv_bytes_ratio", "<v>_past_w_slope_ratio", "<v>_slope_ratio", "<v>_slope_ratio_past_w",
        "<v>_step_ratio_ctx<C>", "accuracy", "accuracy_before_uptrain", "accuracy_ci_high",
        "accuracy_ci_low", "chance_accuracy", "kv_block_usage_max", "max_rate_resolution", "perplexity",
        "ppl_before_uptrain", "prefix_hit_rate", "x_attainable", "x_roofline",
    ),
    "requests/s": (
        "goodput", "max_rate_at_least", "max_rate_failed_at", "max_rate_under_slo",
        "request_throughput", "timeline_rate",
    ),
    "runnable tasks": (
        "load_avg_after", "load_avg_before",
    ),
    "s": (
        "compile_s", "duration_s", "energy_window_s", "eval_seconds", "series.serving_t_s",
        "tables.serving_tokens", "train_seconds",
    ),
    "sequences": (
        "max_batch_longest",
    ),
    "text": (
        "<v>_<metric>_ci_reason", "accuracy_interval_reason", "decode_ms_p50_ci_reason",
        "decode_ms_p50_warning", "decode_ms_p90_warning", "decode_ms_p99_ci_reason",
        "decode_ms_p99_warning", "decode_us_per_1k_ctx_reason", "e2e_ms_p50_ci_reason",
        "e2e_ms_p50_warning", "e2e_ms_p90_warning", "e2e_ms_p99_ci_reason", "e2e_ms_p99_warning",
        "energy_reason", "goodput_reason", "goodput_slo", "itl_ms_p50_ci_reason", "itl_ms_p50_warning",
        "itl_ms_p90_warning", "itl_ms_p99_ci_reason", "itl_ms_p99_warning",
        "kv_cache_bytes_alloc_reason", "kv_heads_conversion", "kv_store", "max_rate_bound",
        "max_rate_non_monotone_rates", "max_rate_under_slo_reason", "mean_ttft_ms_turns_2_n_ci_reason",
        "mean_ttft_ms_turns_2_n_warning", "memory_method", "noisy_reason", "nvml_device_uuid",
        "nvml_driver_version", "nvml_memory_api", "nvml_process_reason", "nvml_reason", "peak_method",
        "peak_note", "peak_rss_reason", "prefill_ms_ci_reason", "prefill_ms_warning",
        "queue_ms_p50_ci_reason", "queue_ms_p50_warning", "queue_ms_p90_warning",
        "queue_ms_p99_ci_reason", "queue_ms_p99_warning", "requests_unfinished_reason",
        "roofline_bound", "slo_missed", "stopped_by_longest", "timing_method", "tokens_per_s_ci_reason",
        "tokens_per_s_warning", "tpot_ms_p50_ci_reason", "tpot_ms_p50_warning", "tpot_ms_p90_warning",
        "tpot_ms_p99_ci_reason", "tpot_ms_p99_warning", "ttft_ms_p50_ci_reason", "ttft_ms_p50_warning",
        "ttft_ms_p90_warning", "ttft_ms_p99_ci_reason", "ttft_ms_p99_warning",
        "turn1_ttft_ms_ci_reason", "turn1_ttft_ms_warning",
    ),
    "tokens": (
        "block_size", "eval_tokens_per_window", "output_tokens", "prefix_hit_tokens",
        "prefix_query_tokens", "tokens_seen", "total_prefill_tokens", "total_reused_tokens",
    ),
    "tokens/s": (
        "output_throughput", "tokens_per_s", "tokens_per_s_ci_high", "tokens_per_s_ci_low",
        "tokens_per_s_longest", "tokens_per_s_mean", "total_token_throughput",
    ),
    "µs per 1,000 positions": (
        "decode_us_per_1k_ctx", "decode_us_per_1k_ctx_ci_high", "decode_us_per_1k_ctx_ci_low",
    ),
    "µs per 1,000 tokens of context": (
        "<v>_decode_us_per_1k_ctx", "<v>_decode_us_per_1k_ctx_below_w",
        "<v>_decode_us_per_1k_ctx_past_w",
    ),
}

V1_UNITS: Dict[str, str] = {name: unit for unit, names in _BY_UNIT.items() for name in names}
