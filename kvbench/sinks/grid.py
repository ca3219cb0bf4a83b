"""A table that fits the width it is printed at without breaking a cell: :class:`Grid`.

rich lays a table wider than its console out by wrapping cells inside their columns, a few
characters at a time where a column gets narrow (``slop / e / rati / o``), and a pipe or a file is
laid out 100 columns wide. A :class:`Grid` never wraps a cell: it measures its columns when it is
printed and, where they do not fit, prints them as several tables that each repeat the key columns
(the job, the variant), the way a wide spreadsheet is printed on several pages. A header may wrap
between its words. Only a single cell wider than the whole console is folded, as rich would.
"""

from __future__ import annotations

import html
import re
import textwrap
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Union

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

Cell = Union[str, Text]
CONTINUED = "(continued)"


def _text(cell: Cell) -> Text:
    # a str is shown as the text it is: a value such as "[0.6, 0.7]" or a user's override is no markup
    return cell.copy() if isinstance(cell, Text) else Text(str(cell))


def _width(cell: Cell) -> int:
    return max((cell_len(line) for line in _text(cell).plain.splitlines()), default=0)


def _longest_word(text: str) -> int:
    return max((cell_len(word) for word in text.split()), default=0)


def table_width(widths: Sequence[int]) -> int:
    """The width of a boxed table whose columns' contents are ``widths`` wide: a space either side of
    each and a rule between and around them."""
    return sum(widths) + 3 * len(widths) + 1


@dataclass
class Grid:
    """``header`` and ``rows`` of cells (a str is shown as it is, a rich Text keeps its style); the first
    ``keys`` columns name a row and are repeated in every table it is split into; ``right``: the indexes
    of the columns aligned right; ``sections``: the rows a rule follows; ``caption``: printed under the
    last table."""

    title: Optional[str]
    header: List[str]
    rows: List[List[Cell]]
    keys: int = 1
    right: Iterable[int] = ()
    sections: Iterable[int] = ()
    caption: Optional[str] = None
    show_header: bool = True
    key_style: Optional[str] = None
    _right: frozenset = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._right = frozenset(self.right)
        self.sections = frozenset(self.sections)

    @property
    def row_count(self) -> int:
        return len(self.rows)

    def _cells(self) -> List[int]:
        return [max([0, *(_width(row[i]) for row in self.rows if i < len(row))]) for i in range(len(self.header))]

    def narrowest(self) -> List[int]:
        """Each column's narrowest width: its widest cell, and its header's longest word (a header
        may break between its words)."""
        if not self.show_header:
            return self._cells()
        return [max(w, _longest_word(name)) for w, name in zip(self._cells(), self.header)]

    def widths(self, columns: Sequence[int], width: int) -> Dict[int, int]:
        """The width of each of ``columns`` in a table of at most ``width``: the narrowest, then as many
        headers whole (on one line) as the width leaves room for, the closest to whole first."""
        narrow = self.narrowest()
        out = {i: narrow[i] for i in columns}
        slack = width - table_width(list(out.values()))
        whole = {i: cell_len(self.header[i]) if self.show_header else narrow[i] for i in columns}
        for i in sorted(columns, key=lambda i: whole[i] - out[i]):
            if 0 < whole[i] - out[i] <= slack:
                slack -= whole[i] - out[i]
                out[i] = whole[i]
        for i in columns:  # what is left: fewer lines for the headers still broken
            if slack > 0 and out[i] < whole[i]:
                lines = textwrap.wrap(self.header[i], out[i] + slack, break_long_words=False, break_on_hyphens=False)
                wider = max(out[i], *(cell_len(line) for line in lines))
                slack, out[i] = slack - (wider - out[i]), wider
        return out

    def groups(self, width: int) -> List[List[int]]:
        """The columns of each table at ``width``: the key columns, then as many of the others as fit."""
        widths = self.narrowest()
        keys = list(range(min(self.keys, len(self.header))))
        groups: List[List[int]] = []
        current = list(keys)
        for i in range(len(keys), len(self.header)):
            if len(current) > len(keys) and table_width([widths[j] for j in current + [i]]) > width:
                groups.append(current)
                current = list(keys)
            current.append(i)
        groups.append(current)
        return groups

    def _table(self, columns: Sequence[int], title: Optional[str], caption: Optional[str], width: int) -> Table:
        widths = self.widths(columns, width)
        # a title or caption is text, not markup: "[95%]" or "[t-interval]" is shown as it is
        table = Table(title=Text(title) if title else None, title_justify="left",
                      caption=Text(caption) if caption else None, caption_justify="left", show_header=self.show_header)
        fits = table_width(list(widths.values())) <= width
        for i in columns:
            # a header wraps between its words (never at a hyphen: "per-" / "round") to its column's width;
            # a cell never wraps
            name = "\n".join(textwrap.wrap(self.header[i], max(widths[i], 1), break_long_words=False,
                                           break_on_hyphens=False)) or ""
            table.add_column(name, justify="right" if i in self._right else "left", no_wrap=fits,
                             overflow="fold", style=self.key_style if i < self.keys else None)
        for n, row in enumerate(self.rows):
            table.add_row(*(_text(row[i]) if i < len(row) else Text("") for i in columns),
                          end_section=n in self.sections)
        return table

    def tables(self, width: int) -> List[Table]:
        """The tables to print at ``width`` columns."""
        groups = self.groups(width)
        last = len(groups) - 1
        # a part after the first is titled "(continued)" only: the title names one table, printed once
        return [self._table(g, self.title if n == 0 else (CONTINUED if self.title else None),
                            self.caption if n == last else None, width) for n, g in enumerate(groups)]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield from self.tables(options.max_width)


# A Markdown cell as kvbench.sinks.markdown.md_text escapes it, back to its text
_MD_UNESCAPES = (("\\|", "|"), ("\\](", "]("), ("\\][", "]["), ("\\\\", "\\"))


def md_cells(line: str) -> List[str]:
    """The cells of one Markdown table row, unescaped to their text."""
    cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    out = []
    for cell in cells:
        text = cell.strip()
        for escaped, raw in _MD_UNESCAPES:
            text = text.replace(escaped, raw)
        out.append(html.unescape(text))
    return out


def from_markdown(text: str, keys: int = 1) -> List[Union[str, Grid]]:
    """A Markdown report as a terminal prints it: each table a :class:`Grid` (``keys`` columns name
    a row), each other line as it is (a console wraps it between words). The file keeps the
    Markdown; a 1,358-character table row is for a renderer, not a pipe."""
    lines, out = text.splitlines(), []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("|"):
            out.append(lines[i])
            i += 1
            continue
        block = []
        while i < len(lines) and lines[i].startswith("|"):
            block.append(lines[i])
            i += 1
        align = md_cells(block[1]) if len(block) > 1 and re.fullmatch(r"\|[\s:|-]+\|", block[1].strip()) else None
        header = md_cells(block[0])
        rows = [md_cells(line) for line in block[(2 if align is not None else 1):]]
        right = [n for n, a in enumerate(align or []) if a.endswith(":")]
        out.append(Grid(None, header, rows, keys=keys, right=right))
    return out
