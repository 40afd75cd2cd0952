"""Hygiene for every test: process-wide state a test changes does not reach the next one."""

from __future__ import annotations

import signal

import pytest


@pytest.fixture(autouse=True)
def _sigint_handler_restored():
    """hivemind's averager (``run_in_background``) makes the process that starts it ignore
    SIGINT. A test that starts one in pytest's own process (tests/integration/test_witness.py)
    left its xdist worker ignoring Ctrl+C, and a later test on that worker that interrupts itself
    (tests/unit/test_sim.py's and test_checkpoint.py's Ctrl+C) then ran its simulation to the end
    (300 s) and failed: "DID NOT RAISE KeyboardInterrupt". Whether the two met on one worker was
    up to xdist's scheduling (stop 55 saw them meet in a run of some files). Each test now ends
    with the SIGINT handler it started with."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    if signal.getsignal(signal.SIGINT) is not handler:
        signal.signal(signal.SIGINT, handler)
