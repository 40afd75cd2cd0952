"""Member processes for tests that run a ring or a DHT between local processes."""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.context import ForkServerContext


def members_context(*preload: str) -> ForkServerContext:
    """A context whose processes fork from a server that imported torch and ``preload`` once
    (per pytest worker). A "spawn" process imported them again each time: 2-4 s of CPU a member
    on a loaded machine, and tests/unit/test_dataplane.py's 30 tests took 63 s (20 s now).
    A fork of pytest's own process would inherit its threads and whatever they hold."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", *preload])
    return context
