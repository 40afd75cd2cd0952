"""Errors a user can fix; the CLI prints them as one line, never a traceback."""

from __future__ import annotations


class SwarmError(Exception):
    """A problem with the swarm or its inputs; the message says what to do."""
