"""The one exception the CLI reports as a user error (one line, exit status 2)."""

from __future__ import annotations

from pathlib import Path


class SwarmError(Exception):
    """A problem the user can fix (bad address, unreachable peer, wrong run id, ...).

    The message is kept to one line: control characters that came from user input (a pasted
    address with a newline, ...) are shown escaped."""

    def __init__(self, message: str = "", *args: object) -> None:
        clean = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(message))
        super().__init__(clean, *args)


def folder_problem(error: OSError, path: Path) -> str:
    """Why making the folder ``path`` (with its parents) failed, in words: mkdir says only
    ``Not a directory`` or ``File exists`` when a part of the path is a file."""
    for part in (path, *path.parents):
        if part.exists() and not part.is_dir():
            return f"{part} is a file, not a folder"
    return str(error.strerror or error)
