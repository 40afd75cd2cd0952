"""Faults survived by real peers on loopback: a frozen straggler, a peer killed mid-run."""

from __future__ import annotations

import math
import os
import signal
import time

import pytest

from tests.integration.conftest import FAST, max_abs_diff


@pytest.mark.faults
def test_a_frozen_straggler_is_not_waited_for_and_catches_up(spawn):
    """SIGSTOP one peer for 12 s: the other keeps training; after SIGCONT the straggler finds
    itself behind, downloads the state and ends with the same global params."""
    common = [*FAST, "--run-id", "straggler", "--rounds", "30", "--averaging-timeout", "8"]
    first = spawn("a", "start", *common, "--min-peers", "2")
    second = spawn("b", "join", first.address(), *common)
    second.wait_event("round", lambda e: e["outer_step"] >= 3)
    os.killpg(second.process.pid, signal.SIGSTOP)
    frozen_at = first.events("round")[-1]["outer_step"]
    started = time.monotonic()
    try:
        # The other peer is not held up: it keeps completing rounds while the straggler sleeps.
        first.wait_event("round", lambda e: e["outer_step"] >= frozen_at + 3, timeout=40)
        progress_seconds = time.monotonic() - started
    finally:
        os.killpg(second.process.pid, signal.SIGCONT)
    for peer in (first, second):
        assert peer.wait() == 0, peer.stderr()
    assert progress_seconds < 30  # within the barrier's wait plus one averaging timeout
    reasons = [d["reason"] for d in second.events("state_downloaded")]
    assert len(reasons) >= 2, reasons  # joining, then catching up after the freeze
    for peer in (first, second):
        assert all(math.isfinite(r["eval_loss"]) for r in peer.events("round"))
    assert max_abs_diff(first.global_params(), second.global_params()) <= 1e-5


@pytest.mark.faults
def test_a_peer_killed_mid_run_does_not_stall_the_others(spawn):
    """SIGKILL one of three peers while they train and average: the two others finish every
    round (falling back or regrouping within one averaging timeout), agree, and never see NaN."""
    common = [*FAST, "--run-id", "kill9", "--rounds", "14", "--averaging-timeout", "8"]
    first = spawn("a", "start", *common, "--min-peers", "3")
    second = spawn("b", "join", first.address(), *common, "--min-peers", "3")
    victim = spawn("c", "join", first.address(), *common, "--min-peers", "3")
    victim.wait_event("round", lambda e: e["outer_step"] >= 3)
    victim.kill()
    killed = time.monotonic()
    step = first.events("round")[-1]["outer_step"]
    first.wait_event("round", lambda e: e["outer_step"] >= step + 2, timeout=60)
    assert time.monotonic() - killed < 8 + 12  # one averaging timeout plus the heartbeat TTL
    for peer in (first, second):
        assert peer.wait() == 0, peer.stderr()
        assert all(math.isfinite(r["eval_loss"]) for r in peer.events("round"))
    assert max_abs_diff(first.global_params(), second.global_params()) <= 1e-5
