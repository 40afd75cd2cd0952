"""The ``workbench`` command line: :mod:`.command` builds the parser and dispatches; the peer
commands' flags live in :mod:`.options` (and back from a config in :mod:`.argv`), every other
command in its own module (``status``, ``steer``, ``doctor``, ``monitor``, ``simulate``,
``config``, ``export``, ``completion``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """The ``workbench`` command (:func:`workbench.cli.command.main`). Its modules take about half
    a second to import (pydantic's schemas, torch's on demand): a Ctrl+C meanwhile stops it as
    one during the command does, with one line, not an import's traceback."""
    try:
        from workbench.cli.command import main as command
    except KeyboardInterrupt:
        print("stopped.", file=sys.stderr)
        return 130
    return command(argv)
