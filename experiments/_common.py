"""What the experiment scripts share: the config of a job composed as the CLI composes it, one
model with a prompt and a static cache for decode loops, and the report written atomically.

Each script runs as ``python experiments/<name>.py``, so this module is imported by its name."""

from __future__ import annotations

from pathlib import Path
from typing import List, Tuple

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from kvbench.cache import cache_for
from kvbench.config.bench import CONF_DIR, BenchConfig, register_configs
from kvbench.job_config import to_bench_config
from kvbench.jsonio import write_text_atomic
from kvbench.sinks.console import stdout
from kvbench.sinks.grid import from_markdown
from kvbench.tasks.common import build_model


def compose_config(overrides: List[str]) -> DictConfig:
    """conf/config.yaml with ``overrides``, as the ``kvbench`` command composes it."""
    register_configs()  # the schemas the YAML files are typed by (the CLI does this on import)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def decode_setup(model: str, prompt_len: int,
                 gen_len: int) -> Tuple[BenchConfig, torch.nn.Module, torch.Tensor, object]:
    """A ``model=`` preset on the CPU, one random prompt (batch 1) and a static cache that holds
    the prompt and ``gen_len`` decode steps: what a decode loop of these scripts times."""
    cfg = to_bench_config(compose_config([f"model={model}", f"workload.prompt_len={prompt_len}",
                                          f"workload.gen_len={gen_len}"]))
    decoder = build_model(cfg, torch.device("cpu"))
    prompt = torch.randint(0, cfg.model.vocab_size, (1, prompt_len))
    return cfg, decoder, prompt, cache_for(decoder, "static", 1, prompt_len + gen_len)


def write_report(out: Path, text: str, keys: int = 1) -> Path:
    """Write ``text`` to ``out`` atomically (a reader never sees half a report), print it and
    where it went: its tables laid out to the terminal's width (a pipe's 100 columns), each split
    into tables led by its first ``keys`` columns where it is wider; the file keeps the Markdown."""
    write_text_atomic(out, text)
    for item in from_markdown(text, keys):
        stdout.print(item, markup=False, highlight=False)
    stdout.print(f"wrote {out}", markup=False, soft_wrap=True)
    return out
