"""How numbers are taken: timing (CUDA events or perf_counter) and memory (formula, torch, NVML, RSS)."""
