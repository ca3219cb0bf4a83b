"""A transformers checkpoint directory's safetensors files, read as their headers first.

The weights are in the files ``model.safetensors.index.json`` names (as transformers reads a
sharded checkpoint), else in every ``*.safetensors`` file. :func:`read_headers` reads only the
headers (a few kilobytes), so a checkpoint is checked against its config.json before anything is
built; :func:`load_tensors` then reads the tensors.

A tensor in two files, an index naming a missing or wrong file, a missing shard of a
``-NNNNN-of-MMMMM`` series: each is a :class:`CheckpointError`, since one dict over every file
would run with whichever copy sorted last (a duplicated shard, a stray file). :func:`check_tensors`
checks what was read (headers, or a kvbench checkpoint's tensors) against what the decoder needs.
"""

from __future__ import annotations

import re
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from kvbench.core.errors import ConfigError
from kvbench.jsonio import read_json

INDEX_FILE = "model.safetensors.index.json"
# An index maps names to files: tens of kilobytes for a model of hundreds of billions of weights.
MAX_INDEX_BYTES = 16 * 2**20
# safetensors' names of floating-point dtypes (its header's "dtype")
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
# a quantized weight's header once folded with its scales (kvbench.quant_weights): float values when read
DEQUANTISED_DTYPES = ("MXFP4", "NVFP4")
_SHARD = re.compile(r"-(\d+)-of-(\d+)\.safetensors$")


class CheckpointError(ConfigError):
    """A checkpoint the decoder cannot read: the user's input is at fault (a run records ``invalid``)."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a safetensors header describes it (dtype in safetensors' names: F32, BF16 ...)."""

    file: Path
    name: str
    shape: tuple
    dtype: str

    @property
    def is_floating_point(self) -> bool:
        return self.dtype in FLOAT_DTYPES + DEQUANTISED_DTYPES


@dataclass(frozen=True)
class Derived(StoredTensor):
    """A tensor ``build`` makes from the stored ``parts`` once they are read (a quantized weight and its
    scales, :mod:`kvbench.quant_weights`); its header fields are the result's, its ``name`` the file's
    weight, so that a refusal names what the file holds."""

    parts: Tuple[StoredTensor, ...] = ()
    build: Callable[[List[torch.Tensor]], torch.Tensor] = lambda ts: ts[0]


def reading(path: Path | str, what: str, read: Callable[[], Any]) -> Any:
    """``read()``, any failure but running out of memory as a CheckpointError naming ``path``: torch,
    safetensors and tokenizers each raise their own types (torch with a page of advice)."""
    try:
        with warnings.catch_warnings():  # torch warns about a file's pickle protocol before refusing it
            warnings.simplefilter("ignore")
            return read()
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 — whatever the parser raises, the file is at fault
        raise CheckpointError(f"{path}: not a readable {what} ({type(exc).__name__}: {_gist(exc)})") from None


def _gist(exc: Exception) -> str:
    """The part of a reader's error that is about the file: torch's weights-only loader wraps
    its one-line reason (``WeightsUnpickler error: ...``) in a paragraph of advice."""
    text = str(exc)
    match = re.search(r"WeightsUnpickler error:(.*?)(?:Check the documentation|$)", text, flags=re.S)
    return f"the weights-only loader refused it: {' '.join(match.group(1).split())}" if match else text


def _regular(path: Path) -> Path:
    # safetensors would block opening a FIFO; a dangling link or a directory is no weights file
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path}: not a regular file")
    return path


def _index(directory: Path) -> Optional[Dict[str, str]]:
    """The index's ``weight_map`` (tensor -> file name), checked; None without an index."""
    path = directory / INDEX_FILE
    if not path.exists() and not path.is_symlink():
        return None
    index = reading(path, "safetensors index (JSON)", lambda: read_json(path, MAX_INDEX_BYTES))
    weight_map = index.get("weight_map") if isinstance(index, Mapping) else None
    if not isinstance(weight_map, Mapping) or not weight_map:
        raise CheckpointError(f"{path}: no weight_map (a JSON object of tensor name -> file) in it")
    for name, file in weight_map.items():
        # a plain file name of this directory: an index must not send the reader elsewhere
        if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
            raise CheckpointError(f"{path}: weight_map[{name!r}]={file!r}: not a file name in {directory}")
    return dict(weight_map)


def weight_files(directory: Path | str) -> List[Path]:
    """The files holding the weights: the index's, else every ``*.safetensors``, checked."""
    return _files(Path(directory), _index(Path(directory)))


def _files(directory: Path, weight_map: Optional[Dict[str, str]]) -> List[Path]:
    if weight_map is not None:
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{directory / INDEX_FILE}: names {f.name}, which is not in {directory}")
    else:
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{directory}: no *.safetensors files (only safetensors weights are read)")
    _check_series(directory, files)
    return [_regular(f) for f in files]


def _check_series(directory: Path, files: Iterable[Path]) -> None:
    series: Dict[tuple, set] = {}
    for f in files:
        match = _SHARD.search(f.name)
        if match:
            stem = f.name[: match.start()]
            series.setdefault((stem, int(match.group(2)), len(match.group(2))), set()).add(int(match.group(1)))
    for (stem, total, digits), present in series.items():
        absent = sorted(set(range(1, total + 1)) - present)
        if absent:
            name = f"{stem}-{absent[0]:0{digits}d}-of-{total:0{digits}d}.safetensors"
            raise CheckpointError(f"{directory}: shard {name} is missing ({len(present)} of {total} present)")


def read_headers(directory: Path | str) -> Dict[str, StoredTensor]:
    """Every tensor of the checkpoint ``directory`` by its stored name, from the headers only."""
    from safetensors import safe_open

    directory = Path(directory)
    weight_map = _index(directory)
    stored: Dict[str, StoredTensor] = {}
    for f in _files(directory, weight_map):
        def header(f: Path = f) -> Dict[str, StoredTensor]:
            with safe_open(str(f), framework="pt") as handle:
                return {name: StoredTensor(f, name, tuple(handle.get_slice(name).get_shape()),
                                           handle.get_slice(name).get_dtype()) for name in handle.keys()}
        for name, tensor in reading(f, "safetensors file", header).items():
            if name in stored:
                raise CheckpointError(f"{directory}: tensor {name} is in both {stored[name].file.name} and "
                                      f"{f.name}: which copy is the model's is not defined (remove one file, "
                                      f"or list each tensor once in {INDEX_FILE})")
            if weight_map is not None and weight_map.get(name) != f.name:
                where = f"places it in {weight_map[name]}" if name in weight_map else "does not list it"
                raise CheckpointError(f"{directory / INDEX_FILE}: {where}, but tensor {name} is in {f.name}")
            stored[name] = tensor
    for name, file in (weight_map or {}).items():
        if name not in stored:
            raise CheckpointError(f"{directory / INDEX_FILE}: places tensor {name} in {file}, which does not hold it")
    return stored


def load_tensors(stored: Mapping[str, StoredTensor]) -> Dict[str, torch.Tensor]:
    """The tensors ``stored`` describes (any key -> its header entry), read from their files,
    by the same keys; keys of one entry (a tied weight) get the same tensor, read once. A
    :class:`Derived` entry is built from its parts, each read as any other."""
    from safetensors import safe_open

    def leaves(tensor: StoredTensor) -> List[StoredTensor]:
        return [leaf for part in tensor.parts for leaf in leaves(part)] if isinstance(tensor, Derived) else [tensor]

    by_file: Dict[Path, set] = {}
    for tensor in (leaf for t in stored.values() for leaf in leaves(t)):
        by_file.setdefault(tensor.file, set()).add(tensor.name)
    read: Dict[tuple, torch.Tensor] = {}
    for f, names in by_file.items():
        def tensors(f: Path = f, names: set = names) -> Dict[str, torch.Tensor]:
            with safe_open(str(f), framework="pt") as handle:
                return {name: handle.get_tensor(name) for name in sorted(names)}
        read.update({(f, name): t for name, t in reading(f, "safetensors file", tensors).items()})
    built: Dict[int, torch.Tensor] = {}

    def value(tensor: StoredTensor) -> torch.Tensor:
        if not isinstance(tensor, Derived):
            return read[(tensor.file, tensor.name)]
        if id(tensor) not in built:  # a tied weight's entry is built once
            built[id(tensor)] = tensor.build([value(part) for part in tensor.parts])
        return built[id(tensor)]
    return {key: value(tensor) for key, tensor in stored.items()}


def load_finite_tensors(directory: Path, stored: Mapping[str, StoredTensor]) -> Dict[str, torch.Tensor]:
    """:func:`load_tensors`, each floating-point tensor checked finite as the file holds it: a NaN in
    one expert is named by that expert's tensor, not by the stacked weight it becomes."""
    tensors = load_tensors(stored)
    seen = set()
    for key, t in tensors.items():
        where = (stored[key].file, stored[key].name)
        if where not in seen and t.is_floating_point() and not torch.isfinite(t).all():
            raise CheckpointError(f"{directory}: tensor {stored[key].name} holds NaN or infinite values")
        seen.add(where)
    return tensors


def check_tensors(where: Path | str, expected: Mapping[str, torch.Size], tensors: Mapping[str, Any],
                  config_name: str = "config.json", model: str = "the decoder its saved config describes",
                  names: Optional[Mapping[str, str]] = None) -> None:
    """Check ``tensors`` are the ones a decoder needs, by name and shape, finite floating point; ``tensors``
    may be headers (:class:`~kvbench.hf_weights.StoredTensor`), whose values are not checked yet.
    ``names``: the decoder's name -> the file's, so that every refusal names the tensor as the file
    does (a transformers checkpoint's ``model.embed_tokens.weight``, not ``embed.weight``)."""
    def named(key: str) -> str:
        return (names or {}).get(key, key)

    missing = sorted(named(k) for k in expected.keys() - tensors.keys())
    # Rotary inverse frequencies some exporters store are recomputed, not loaded.
    unexpected = sorted(named(k) for k in tensors.keys() - expected.keys()
                        if not str(k).endswith("rotary_emb.inv_freq"))
    if missing or unexpected:
        raise CheckpointError(f"{where}: tensor names do not match {model}: "
                              f"missing {missing[:5]}{' …' if len(missing) > 5 else ''}, "
                              f"unexpected {unexpected[:5]}{' …' if len(unexpected) > 5 else ''}")
    for name, shape in expected.items():
        t = tensors[name]
        header = isinstance(t, StoredTensor)
        floating = t.is_floating_point if header else isinstance(t, torch.Tensor) and t.is_floating_point()
        if floating == (name.rpartition(".")[2] in INTEGER_TENSORS):  # a table of ids holds whole numbers
            raise CheckpointError(f"{where}: tensor {named(name)} is {getattr(t, 'dtype', type(t).__name__)}, "
                                  f"not {'an integer' if floating else 'a floating-point'} tensor")
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{where}: tensor {named(name)} has shape {tuple(t.shape)}, "
                                  f"{config_name} implies {tuple(shape)}")
        if not header and not torch.isfinite(t).all():
            raise CheckpointError(f"{where}: tensor {named(name)} holds NaN or infinite values")


INTEGER_TENSORS = ("tid2eid",)  # the decoder's integer tensors by last name: DeepSeek-V4's token-id -> experts
