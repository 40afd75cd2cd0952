"""The one exception the CLI reports as a user error (one line, exit status 2)."""

from __future__ import annotations


class SwarmError(Exception):
    """A problem the user can fix (bad address, unreachable peer, wrong run id, ...).

    The message is kept to one line: control characters that came from user input (a pasted
    address with a newline, ...) are shown escaped."""

    def __init__(self, message: str = "", *args: object) -> None:
        clean = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(message))
        super().__init__(clean, *args)
