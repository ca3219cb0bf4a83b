"""MkDocs hooks: the pages may link to files of the repository outside docs/ (the measurements
under experiments/results/, written as ``../experiments/...`` so that the links also work where the
Markdown is read on its own). Such a target that exists is added to the site under its repository
path, and the link is rewritten to it, so that ``mkdocs build --strict`` still fails on a link to a
file that does not exist."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(\]\()([^)#\s]+)")


def _outside(page_uri: str, target: str) -> str | None:
    """The repository path of ``target`` as linked from docs page ``page_uri``, when it leaves docs/."""
    if "://" in target or target.startswith(("/", "#", "mailto:")):
        return None
    path = posixpath.normpath(posixpath.join("docs", posixpath.dirname(page_uri), target))
    return None if path.startswith(("docs/", "../")) or path == "docs" else path


def on_files(files: Files, config) -> Files:
    for page in [f for f in files if f.is_documentation_page()]:
        text = Path(page.abs_src_path).read_text(encoding="utf-8")
        for _, target in LINK.findall(text):
            path = _outside(page.src_uri, target)
            if path and (ROOT / path).is_file() and files.get_file_from_path(path) is None:
                files.append(File.generated(config, path, abs_src_path=str(ROOT / path),
                                            inclusion=InclusionLevel.NOT_IN_NAV))
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    def rewrite(match: re.Match) -> str:
        path = _outside(page.file.src_uri, match.group(2))
        if path is None:
            return match.group(0)
        return match.group(1) + posixpath.relpath(path, posixpath.dirname(page.file.src_uri) or ".")

    return LINK.sub(rewrite, markdown)
