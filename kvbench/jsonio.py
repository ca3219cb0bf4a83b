"""Files in and out: bounded reads of regular files, and the one atomic writer.

Every file kvbench writes goes through :func:`atomic_write`: a temporary file beside the
destination, written, fsynced and renamed over it, so a reader or a killed process sees the old
file or the complete new one. The rename replaces a symlink rather than writing through it; the
temporary file is made with ``O_EXCL`` and mode 0666 less the umask (``mkstemp``'s 0600 would
hide results from other users). What cannot be renamed into place (:func:`real_dir`,
:class:`NoFollowFileHandler`) never writes through a link planted at its name either.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import secrets
import stat
import traceback
from pathlib import Path
from typing import IO, Any, Callable, List, Mapping, Optional, Tuple


def as_int(value: Any) -> Optional[int]:
    """``value`` where a document holds an integer (a boolean is not one), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_regular(path: Path | str, limit: Optional[int] = None) -> bytes:
    """At most ``limit`` bytes of ``path``; anything but a regular file is an OSError (a FIFO blocks
    forever, /dev/zero never ends), checked on the non-blocking descriptor so a swapped file cannot
    slip through."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return f.read() if limit is None else f.read(limit)


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"), (stat.S_ISREG, "a file"))


def path_problem(path: Path | str, want: str = "file") -> Optional[str]:
    """Why ``path`` is not the ``want`` ("file": a regular file; "directory") a reader expects, in
    words for a one-line refusal (``a directory, not a file``, ``no such file or directory``, ``a
    link to X, which does not exist``); None when it is one. A single "no such file" hid that the
    user had named a directory, or a link whose target had gone."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        if p.is_symlink():
            return f"a link to {os.readlink(p)}, which does not exist"
        return "no such file or directory"
    except NotADirectoryError:
        return "no such file or directory (a parent of it is a file)"
    except OSError as exc:  # a loop of links, a name too long, a parent not searchable
        return f"cannot be read ({exc.strerror or exc})"
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    if want == "directory":
        return None if stat.S_ISDIR(mode) else f"{kind}, not a directory"
    if stat.S_ISREG(mode):
        return None if os.access(p, os.R_OK) else "not readable (permission denied)"
    return f"{kind}, not a file" if kind == "a directory" else f"{kind}, not a regular file"


def read_json(path: Path | str, limit: Optional[int] = None) -> Any:
    """Parsed JSON of the regular file ``path``; a ValueError for one over ``limit`` bytes (never read
    whole) or nested too deeply."""
    data = read_regular(path, None if limit is None else limit + 1)
    if limit is not None and len(data) > limit:
        raise ValueError(f"{path}: larger than {limit:,} bytes, more than a file of its kind has")
    try:
        return json.loads(data.decode("utf-8"))  # bytes would let json guess UTF-16
    except RecursionError:
        raise ValueError(f"{path}: nested too deeply to parse") from None


def find_named(root: Path | str, name: str, unlisted: Optional[List[Tuple[Path, OSError]]] = None) -> List[Path]:
    """Every entry called ``name`` under ``root``, in path order, links not followed; a directory that
    cannot be listed goes to ``unlisted`` with why (rglob would pass over it without a word)."""
    found: List[Path] = []
    pending = [Path(root)]
    while pending:
        directory = pending.pop()
        try:
            with os.scandir(directory) as listing:
                entries = list(listing)
        except FileNotFoundError:
            continue  # gone meanwhile, or never there
        except OSError as exc:
            if unlisted is not None and directory.is_dir():
                unlisted.append((directory, exc))
            continue
        for entry in entries:
            if entry.name == name:
                found.append(Path(entry.path))
            try:
                if entry.is_dir(follow_symlinks=False):
                    pending.append(Path(entry.path))
            except OSError:
                continue
    return sorted(found)


def atomic_write(path: Path | str, write: Callable[[IO], None], binary: bool = False,
                 newline: Optional[str] = None) -> Path:
    """Call ``write(f)`` on a temporary file beside ``path``, then rename it to ``path`` in one step."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = _create_temp(path)
    except OSError as exc:
        raise _naming(exc, path, None) from None
    try:
        with os.fdopen(fd, "wb" if binary else "w", newline=None if binary else newline) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # renames over a symlink at path, never through it
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise _naming(exc, path, tmp) from None
        raise
    return path


def _naming(exc: OSError, path: Path, tmp: Optional[str]) -> OSError:
    # A full disk fails the write, flush or fsync without a file name (ENOSPC, EFBIG, EDQUOT),
    # the temporary file's name means nothing to a user: the error names the file being written.
    if exc.filename is None or exc.filename == tmp or (tmp is None and str(exc.filename).endswith(".tmp")):
        exc.filename = str(path)
    return exc


def name_the_file(exc: OSError) -> OSError:
    """``exc`` with a ``filename`` when it has none (a write failing at flush or close, a full disk):
    the innermost open, writable file object a frame of its traceback holds."""
    if exc.filename is not None:
        return exc
    for frame, _ in reversed(list(traceback.walk_tb(exc.__traceback__))):
        for value in frame.f_locals.values():
            name = getattr(value, "name", None)
            if isinstance(value, io.IOBase) and isinstance(name, str) and not name.startswith("<") and \
                    any(c in getattr(value, "mode", "") for c in "wax+"):
                exc.filename = name
                return exc
    return exc


def os_error_line(exc: OSError) -> str:
    """``cannot write PATH: reason`` for an OSError about a file, its text otherwise."""
    name_the_file(exc)
    if exc.filename is not None:
        return f"cannot write {exc.filename}: {exc.strerror or exc}"
    return f"{type(exc).__name__}: {exc}"


def write_text_atomic(path: Path | str, text: str, newline: Optional[str] = None) -> Path:
    """Write ``text`` to ``path`` atomically (:func:`atomic_write`)."""
    return atomic_write(path, lambda f: f.write(text), newline=newline)


def write_json_atomic(path: Path | str, data: Any) -> Path:
    """Write ``data`` to ``path`` atomically as strict JSON (a NaN is a ValueError: strict parsers reject it)."""
    def dump(f: IO) -> None:
        json.dump(data, f, indent=2, sort_keys=False, default=_json_default, allow_nan=False)
        f.write("\n")

    return atomic_write(path, dump)


def _create_temp(path: Path) -> tuple[int, str]:
    """A new temporary file beside ``path``, mode 0666 less the umask (module docstring)."""
    while True:
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue


def real_dir(path: Path | str) -> Path:
    """The directory ``path``, made if missing, never a link: a symlink planted at its name is removed
    first, so its target is never touched; a file there raises, as ``mkdir`` would."""
    path = Path(path)
    if path.is_symlink():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    return path


class NoFollowFileHandler(logging.FileHandler):
    """``logging.FileHandler`` that never writes through a link: a symlink at its name, dangling ones
    included (``open(path, "a")`` would create a file through those), is replaced by a regular file;
    any other non-regular file (a FIFO) is an OSError, never waited on."""

    def _open(self):
        flags = (os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                 | (os.O_TRUNC if "w" in self.mode else os.O_APPEND))
        path = Path(self.baseFilename)
        try:
            fd = os.open(path, flags, 0o666)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            path.unlink()  # the link goes, its target is untouched
            fd = os.open(path, flags, 0o666)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "a", encoding=self.encoding, errors=self.errors)


def plain(value: Any) -> Any:
    """A torch / numpy scalar as a plain number (they end up in metrics); anything else as is."""
    return value.item() if hasattr(value, "item") and not isinstance(value, (Mapping, list, tuple)) else value


def _json_default(obj: Any) -> Any:
    value = plain(obj)
    return str(obj) if value is obj else value
