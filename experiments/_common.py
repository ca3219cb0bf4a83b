"""What the experiment scripts share: their command lines checked as ``kvbench`` checks its own
(:class:`Parser` and the argparse types below, :func:`run`), the config of a job composed as the
CLI composes it, one model with a prompt and a static cache for decode loops, and the report
written atomically.

A script a user runs gets what ``kvbench`` promises (docs/reliability.md): a bad argument is one
line naming the option and the value as written, exit 2, before any work (a negative budget once
wrote a report of negative capacities, a context of 0 divided by zero, a missing attention option
printed Hydra's 56-line traceback); a config kvbench refuses is that one line, exit 2; a report
that cannot be written is ``cannot write PATH: reason``, exit 1.

Each script runs as ``python experiments/<name>.py``, so this module is imported by its name."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from kvbench.cache import cache_for
from kvbench.config.bench import CONF_DIR, BenchConfig, register_configs
from kvbench.core.errors import ConfigError, config_error_line, is_composition_error, one_line
from kvbench.jobs.job_config import to_bench_config
from kvbench.jsonio import os_error_line, write_text_atomic
from kvbench.sinks.console import stdout
from kvbench.sinks.grid import from_markdown, md_cells
from kvbench.tasks.common import build_model

INVALID, FAILED = 2, 1  # the exit codes of kvbench (kvbench/cli.py): invalid input, a run that failed


# ---- command lines -----------------------------------------------------------------------------

class Parser(argparse.ArgumentParser):
    """argparse whose error is one line, ``script.py: argument --budget-gb: '-5': must be ...``, exit 2
    (argparse prints its usage first; ``--help`` still does)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(INVALID, f"{self.prog}: {one_line(message)}\n")


def _number(text: str, kind: type, ok: Callable[[Any], bool], what: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: must be {what}") from None
    if not math.isfinite(value) or not ok(value):
        raise argparse.ArgumentTypeError(f"{text!r}: must be {what}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a context, a count of rounds, requests or threads)."""
    return _number(text, int, lambda v: v >= 1, "an integer >= 1")


def natural_int(text: str) -> int:
    """argparse type: an integer >= 0 (warm-up rounds, a seed)."""
    return _number(text, int, lambda v: v >= 0, "an integer >= 0")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (a budget, a rate, a learning rate): NaN and infinity,
    which pass every comparison or every lower bound, are refused."""
    return _number(text, float, lambda v: v > 0, "a finite number > 0")


def list_of(item: Callable[[str], Any], count: Optional[int] = None) -> Callable[[str], str]:
    """argparse type: a comma-separated list (``2,16``), each entry checked by ``item`` (``count``
    of them, when given). The text comes back as written: a script splits it where it uses it and
    echoes it in its report's command."""
    def parse(text: str) -> str:
        parts = text.split(",")
        if any(not p.strip() for p in parts) or count is not None and len(parts) != count:
            many = f" of {count} entries" if count else ""
            raise argparse.ArgumentTypeError(f"{text!r}: must be a comma-separated list{many}")
        for part in parts:
            item(part.strip())
        return text
    return parse


def choice(options: Sequence[str], what: str = "") -> Callable[[str], str]:
    """argparse type: one of ``options`` (``what`` names where they come from)."""
    def parse(text: str) -> str:
        if text not in options:
            raise argparse.ArgumentTypeError(f"{text!r}: must be one of {', '.join(options)}{what}")
        return text
    return parse


def conf_option(group: str) -> Callable[[str], str]:
    """argparse type: an option of the config group ``group`` (a ``conf/<group>/<name>.yaml``)."""
    options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    return choice(options, f" (the options of conf/{group}/)")


def batch_x_prompt(text: str) -> Tuple[int, int]:
    """argparse type of one ``BATCHxPROMPT`` entry (``8x1024``): two integers >= 1."""
    batch, x, prompt = text.partition("x")
    if not x:
        raise argparse.ArgumentTypeError(f"{text!r}: must be BATCHxPROMPT (e.g. 8x1024)")
    return positive_int(batch), positive_int(prompt)


def out_path(text: str) -> Path:
    """argparse type: where a report (or a folder of runs) may be written: the nearest existing
    folder above it is a writable directory, so a script never measures for minutes and then fails
    to write (``--out <a file>/x`` raised a traceback at the end)."""
    path = Path(text)
    if not text:
        raise argparse.ArgumentTypeError("'': must be a path")
    parent = path.parent.resolve()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: cannot write there: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: cannot write there: {parent} is not writable")
    return path


def out_file(text: str) -> Path:
    """argparse type: a report file :func:`out_path` allows that is not a directory already."""
    path = out_path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: is a directory; name the report file")
    return path


def out_dir(text: str) -> Path:
    """argparse type: a directory :func:`out_path` allows that is not a file already."""
    path = out_path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: is a file, not a directory")
    return path


def existing_dir(text: str) -> Path:
    """argparse type: a directory that exists (records to read)."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: no such directory")
    return Path(text)


def existing_file(text: str) -> Path:
    """argparse type: a regular file that exists (figures to read)."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: no such file")
    return Path(text)


def named_dir(text: str) -> Tuple[str, Path]:
    """argparse type of ``NAME=DIR`` (a kvbench tree to time): a name and an existing directory."""
    name, eq, directory = text.partition("=")
    if not eq or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: must be NAME=DIR")
    return name, existing_dir(directory).resolve()


def torch_device(text: str) -> str:
    """argparse type: ``cpu``, ``cuda`` or ``cuda:N``, as torch names a device."""
    kind, colon, index = text.partition(":")
    if kind not in ("cpu", "cuda") or colon and not (kind == "cuda" and index.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: must be cpu, cuda or cuda:N")
    return text


def run_main(main: Callable[[Optional[List[str]]], Any], argv: Optional[List[str]] = None) -> Any:
    """``main(argv)`` of a script, its failures as ``kvbench``'s: a config kvbench refuses (Hydra's
    composition errors included) one line, exit 2; a file that cannot be written one line, exit 1."""
    prog = Path(sys.argv[0]).name
    try:
        return main(argv)
    except ConfigError as exc:
        print(f"{prog}: invalid config: {exc}", file=sys.stderr)
    except OSError as exc:
        print(f"{prog}: {one_line(os_error_line(exc))}", file=sys.stderr)
        raise SystemExit(FAILED) from None
    raise SystemExit(INVALID)


def ok_record(record: Any, what: str) -> Any:
    """``record`` (a job's RunResult or its dict) when it is ``ok``; else one line naming ``what``
    ran and why not, exit 2 for ``invalid`` (a config kvbench refuses), else 1."""
    status, error = (record["status"], record["error"]) if isinstance(record, dict) else (record.status, record.error)
    if status != "ok":
        print(f"{Path(sys.argv[0]).name}: {what}: {status}: {one_line(error)}", file=sys.stderr)
        raise SystemExit(INVALID if status == "invalid" else FAILED)
    return record


# ---- configs and models ------------------------------------------------------------------------

def compose_config(overrides: List[str]) -> DictConfig:
    """conf/config.yaml with ``overrides``, as the ``kvbench`` command composes it; an override
    Hydra cannot compose (``attention=paged``) is a :class:`ConfigError` of one line, as the CLI's."""
    register_configs()  # the schemas the YAML files are typed by (the CLI does this on import)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose("config", overrides=overrides)
    except Exception as exc:
        if not is_composition_error(exc):
            raise
        raise ConfigError(config_error_line(exc)) from None


def decode_setup(model: str, prompt_len: int,
                 gen_len: int) -> Tuple[BenchConfig, torch.nn.Module, torch.Tensor, object]:
    """A ``model=`` preset on the CPU, one random prompt (batch 1) and a static cache that holds
    the prompt and ``gen_len`` decode steps: what a decode loop of these scripts times."""
    cfg = to_bench_config(compose_config([f"model={model}", f"workload.prompt_len={prompt_len}",
                                          f"workload.gen_len={gen_len}"]))
    decoder = build_model(cfg, torch.device("cpu"))
    prompt = torch.randint(0, cfg.model.vocab_size, (1, prompt_len))
    return cfg, decoder, prompt, cache_for(decoder, "static", 1, prompt_len + gen_len)


def print_report(text: str, keys: int = 1) -> None:
    """Print a Markdown report as a terminal shows it: its tables laid out to the terminal's width (a
    pipe's 100 columns), each split into tables led by its first ``keys`` columns where it is wider
    (:func:`kvbench.sinks.grid.from_markdown`); its other lines wrapped between words."""
    for item in from_markdown(text, keys):
        stdout.print(item, markup=False, highlight=False, emoji=False)


def say(*parts: Any) -> None:
    """Print ``parts`` as ``print`` would, a line of progress or of figures, wrapped between words to
    the terminal's width (a pipe's 100 columns): a path or a run's accuracies make a line of any length."""
    stdout.print(" ".join(map(str, parts)), markup=False, highlight=False, emoji=False)


def progress_row(lines: Sequence[str]) -> None:
    """Print the last row of the Markdown table ``lines`` (its header first) as the progress of a
    measurement: each cell after its column's name, ``B 8, prompt 1024, ...``, wrapped between the
    cells to the terminal's width (a table row of ten columns is 150 characters; a pipe gets 100)."""
    header, row = md_cells(lines[0]), md_cells(lines[-1])
    say(", ".join(f"{name} {cell}" for name, cell in zip(header, row)))


def write_report(out: Path, text: str, keys: int = 1, data: Any = None) -> Path:
    """Write ``text`` to ``out`` atomically (a reader never sees half a report), print it and
    where it went: its tables laid out to the terminal's width (a pipe's 100 columns), each split
    into tables led by its first ``keys`` columns where it is wider; the file keeps the Markdown.
    ``data``, where given, is written beside it as ``out`` with the suffix ``.json`` (the figures
    behind the tables), after the report: a value JSON cannot hold fails once the report is kept."""
    write_text_atomic(out, text)
    written = [out]
    if data is not None:
        written.append(write_text_atomic(out.with_suffix(".json"), json.dumps(data, indent=1, default=str)))
    print_report(text, keys)
    for path in written:  # a line each: two paths side by side made a line of 120 columns; a path is never folded
        stdout.print(f"wrote {path}", markup=False, emoji=False, soft_wrap=True)
    return out
