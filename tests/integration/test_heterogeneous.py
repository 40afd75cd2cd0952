"""Peers of different speeds (issue #18): time-boxed rounds on real peers."""

from __future__ import annotations

import statistics

from swarm.faults import FaultPlan
from tests.integration.conftest import FAST, max_abs_diff


def test_time_boxed_rounds_let_the_fast_peer_train_more_steps(spawn, tmp_path):
    """--round-seconds: a peer slowed by 150 ms a step (the lab's throttle) and a fast one both
    end each round's inner steps after 1 s. The fast one runs several times the steps (it would
    wait at the barrier with a fixed H), each is weighted by its samples in the group's mean,
    every round is averaged as a pair, and they end on the same θ."""
    slow = tmp_path / "slow.json"
    FaultPlan(throttle_ms=150).write(slow)
    common = [*FAST, "--inner-steps", "200", "--round-seconds", "1", "--rounds", "4", "--run-id", "boxes"]
    first = spawn("a", "start", *common, "--min-peers", "2")
    second = spawn("b", "join", first.address(), *common, "--fault-file", str(slow))
    for peer in (first, second):
        assert peer.wait() == 0, peer.stderr()[-3000:]
    fast, throttled = ([r["inner_steps"] for r in p.events("round")] for p in (first, second))
    assert all(1 <= h < 200 for h in fast + throttled), (fast, throttled)  # the box ended each round
    assert statistics.median(fast) >= 2 * statistics.median(throttled), (fast, throttled)
    for peer in (first, second):
        rounds = peer.events("round")
        assert [(r["outer_step"], r["group_size"]) for r in rounds] == [(s, 2) for s in range(1, 5)]
        # the mean weighs each member by its samples: unequal weights, the fast peer's larger
        weights = [r["group_weights"] for r in rounds]
        assert all(len(w) == 2 and w[1] >= 2 * w[0] for w in weights), weights
    assert max_abs_diff(first.global_params(), second.global_params()) <= 1e-5
