"""What a command shows on the terminal: tables that never cut a figure, and progress that a log file sees too.

Rich shrinks a table that is wider than the terminal by cutting cells to ``524,2…``. Here each column is at least
as wide as its longest word (a figure, a unit), so cells may wrap between words but never lose characters; when
even that does not fit, each row is printed as one wrapped line of ``header: value`` pairs instead. Output that
is not a terminal (a pipe, a file) gets the table at its full width.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress
from rich.table import Table
from rich.text import Text


@dataclass
class Grid:
    """What a table shows: a title, column headers, rows of strings, a caption."""

    title: str
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)
    caption: str = ""
    right: tuple[int, ...] = ()  # indexes of right-justified columns (figures)

    def add_row(self, *cells: str) -> None:
        if len(cells) != len(self.header):
            raise ValueError(f"a row of {len(cells)} cells for {len(self.header)} columns")
        self.rows.append([str(c) for c in cells])


STYLE = dict(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)


def _overhead(n_columns: int) -> int:
    """Characters of a row that are not cells: measured on a table of one-character columns in ``STYLE``."""
    table = Table(**STYLE)
    for _ in range(n_columns):
        table.add_column(width=1)
    return Console(width=10**4).measure(table).maximum - n_columns


def column_widths(grid: Grid, width: int) -> list[int] | None:
    """Widths that fit ``width`` columns without cutting a word, or None if none do."""
    columns = [[grid.header[i]] + [row[i] for row in grid.rows] for i in range(len(grid.header))]
    natural = [max(len(line) for cell in col for line in cell.splitlines() or [""]) for col in columns]
    least = [max([len(word) for cell in col for word in cell.split()] or [1]) for col in columns]
    room = width - _overhead(len(columns))
    if sum(natural) <= room:
        return natural
    if sum(least) > room:
        return None
    widths, spare = list(least), room - sum(least)
    # Unwrap the columns that need the fewest extra characters first: as few cells as possible wrap.
    for i in sorted(range(len(widths)), key=lambda j: natural[j] - least[j]):
        grow = min(natural[i] - widths[i], spare)
        widths[i] += grow
        spare -= grow
    return widths


def render(grid: Grid, widths: list[int]) -> Table:
    """The table of ``grid``, its text taken literally (a path ``ck[v2]`` or ``x/[/b]`` is no markup)."""
    table = Table(title=Text(grid.title), caption=Text(grid.caption) if grid.caption else None, **STYLE)
    for i, (name, w) in enumerate(zip(grid.header, widths, strict=True)):
        table.add_column(Text(name), width=w, justify="right" if i in grid.right else "left", overflow="fold")
    for row in grid.rows:
        table.add_row(*map(Text, row))
    return table


def print_grid(grid: Grid, console: Console | None = None) -> None:
    """Print ``grid`` as a table that fits the terminal, or as one line per row where no table fits."""
    console = console or Console(highlight=False)
    if not console.is_terminal:  # a pipe or a file: never squeeze
        full = column_widths(grid, 10**9) or []  # the natural widths: nothing is wider than that
        console = Console(file=console.file, width=sum(full) + _overhead(len(full)), highlight=False)
    widths = column_widths(grid, console.width)
    if widths is not None:
        console.print(render(grid, widths))
        return
    console.print(Text(grid.title, style="italic"))
    for row in grid.rows:
        console.print("; ".join(f"{h}: {c}" for h, c in zip(grid.header, row, strict=True)))
    if grid.caption:
        console.print(Text(grid.caption, style="dim"))


class Progress:
    """Progress of long work on stderr: a bar on a terminal; elsewhere (a pipe, a log file, nohup, CI) one plain
    line every ``every`` seconds (``$ATTNLAB_PROGRESS_SECONDS``, default 30), and one when work that printed such
    lines ends, so a log shows that long work is alive and how far it got, while short work (and a one-line error)
    prints nothing more.

    ``update(completed, total=..., description=..., **fields)``: ``fields`` are figures shown beside the count
    ("loss 5.77", "tok/s 669"), given as strings.
    """

    def __init__(
        self,
        description: str,
        total: int | None = None,
        *,
        fields: tuple[str, ...] = (),
        every: float | None = None,
        transient: bool = False,
        console: Console | None = None,
        enabled: bool = True,
    ) -> None:
        self.console = console or Console(stderr=True)
        self.description, self.total, self.completed = description, total, 0
        self.fields = dict.fromkeys(fields, "-")
        if every is None:  # ATTNLAB_PROGRESS_SECONDS sets the interval of the plain lines (default 30)
            every = float(os.environ.get("ATTNLAB_PROGRESS_SECONDS", "30"))
        self.every, self.transient, self.enabled = every, transient, enabled
        self._bar: RichProgress | None = None
        self._started = self._last = 0.0
        self._lines = 0  # plain lines printed

    def __enter__(self) -> Progress:
        if not self.enabled:
            return self
        self._started = self._last = time.monotonic()
        if self.console.is_terminal:
            columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()]
            columns += [TextColumn(f"{name} {{task.fields[{name}]}}") for name in self.fields]
            columns += [TimeElapsedColumn(), TimeRemainingColumn()]
            self._bar = RichProgress(*columns, console=self.console, transient=self.transient)
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=self.total, **self.fields)
        return self

    def update(
        self,
        completed: int | None = None,
        *,
        total: int | None = None,
        description: str | None = None,
        **fields: str,
    ) -> None:
        if completed is not None:
            self.completed = completed
        if total is not None:
            self.total = total
        if description is not None:
            self.description = description
        self.fields.update(fields)
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(
                self._task, completed=self.completed, total=self.total, description=self.description, **fields
            )
        elif time.monotonic() - self._last >= self.every:
            self._line()

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.stop()
        elif self._lines:
            self._line()

    def _line(self) -> None:
        self._last = time.monotonic()
        self._lines += 1
        count = f"{self.completed}/{self.total}" if self.total else f"{self.completed}"
        if self.total:
            count += f" ({100 * self.completed / self.total:.0f}%)"
        shown = "".join(f", {name} {value}" for name, value in self.fields.items() if value != "-")
        elapsed = self._last - self._started
        self.console.print(
            f"attnlab: {self.description}: {count}{shown}, {elapsed:.0f} s",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
