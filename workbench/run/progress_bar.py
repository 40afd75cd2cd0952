"""Progress bars for long work (loading data, downloading the state), on stderr, only on a
terminal: logs and pipes get nothing extra. rich honours ``NO_COLOR`` (and ``TERM=dumb``)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Protocol


class Bar(Protocol):
    def advance(self, amount: float) -> None: ...
    def show(self, completed: float | None, description: str | None = None) -> None: ...


class _Nothing:
    def advance(self, amount: float) -> None:
        pass

    def show(self, completed: float | None, description: str | None = None) -> None:
        pass


class _RichBar:
    def __init__(self, progress, task) -> None:
        self.progress, self.task = progress, task

    def advance(self, amount: float) -> None:
        self.progress.advance(self.task, amount)

    def show(self, completed: float | None, description: str | None = None) -> None:
        """Set how much is done (None: not known yet), and a new description if given."""
        if description is not None:
            self.progress.update(self.task, description=description)
        if completed is not None:
            self.progress.update(self.task, completed=completed)


@contextlib.contextmanager
def progress(description: str, *, total: float | None = None, unit: str = "") -> Iterator[Bar]:
    """A bar (``total`` known) or a spinner with elapsed time; nothing when stderr is no terminal."""
    if not sys.stderr.isatty():
        yield _Nothing()
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        SpinnerColumn,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = [SpinnerColumn(), TextColumn("{task.description}")]
    if total is not None:
        if unit == "share":  # ``total`` is 1: a percentage
            columns += [BarColumn(), TaskProgressColumn()]
        else:
            columns += [
                BarColumn(),
                DownloadColumn() if unit == "bytes" else TextColumn("{task.completed:.0f}/{task.total:.0f}"),
            ]
        columns += [TimeRemainingColumn()]
    columns += [TimeElapsedColumn()]
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        yield _RichBar(bar, bar.add_task(description, total=total))
