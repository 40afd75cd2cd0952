"""Hygiene for every test: process-wide state a test changes does not reach the next one."""

from __future__ import annotations

import signal

import pytest


@pytest.fixture(autouse=True)
def _ctrl_c_as_from_a_terminal():
    """Every test runs with Python's own SIGINT handler (Ctrl+C raises KeyboardInterrupt), as a
    process started from a terminal or by CI has, and leaves none of its own behind:

    - hivemind's averager (``run_in_background``) makes the process that starts it ignore SIGINT.
      A test that starts one in pytest's own process (tests/integration/test_witness.py) left its
      xdist worker ignoring Ctrl+C, and a later test there that interrupts itself
      (tests/unit/test_sim.py's and test_checkpoint.py's Ctrl+C) ran its simulation to the end
      (300 s) and failed, "DID NOT RAISE KeyboardInterrupt"; whether the two met on one worker
      was up to xdist's scheduling.
    - A pytest started as a background job of a shell without job control (``make test &``,
      ``nohup``) inherits SIGINT ignored, and Python keeps it so: those tests passed there only
      if an earlier test on the worker had happened to install Python's handler.
    """
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
