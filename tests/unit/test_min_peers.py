"""``--min-peers``: who counts as present before the first round."""

from __future__ import annotations

import time

import pytest

import workbench.run.joining as peer_module
from swarm.errors import SwarmError
from swarm.records import PeerHeartbeat, Stage
from workbench.run.joining import wait_for_peers


def _beat(peer: str, stage: Stage) -> PeerHeartbeat:
    return PeerHeartbeat(
        peer_id=peer, name=peer, stage=stage, outer_step=0, inner_step=0, inner_steps=5, time=time.time()
    )


class Board:
    """The newcomer downloads the state for the first ``downloading`` reads, then waits to train."""

    def __init__(self, downloading: int) -> None:
        self.reads = 0
        self.downloading = downloading

    def fetch(self) -> dict[str, PeerHeartbeat]:
        self.reads += 1
        stage = Stage.DOWNLOADING if self.reads <= self.downloading else Stage.JOINING
        return {"a": _beat("a", Stage.JOINING), "b": _beat("b", stage)}


def _wait(board: Board, min_peers: int, wait_timeout: float = 60.0) -> None:
    wait_for_peers(board, lambda stage: None, wanted=min_peers, timeout=wait_timeout, name="a")


def test_a_peer_still_downloading_the_state_is_not_counted_yet(monkeypatch):
    monkeypatch.setattr(peer_module.time, "sleep", lambda seconds: None)
    board = Board(downloading=5)
    _wait(board, min_peers=2)
    assert board.reads == 6  # returned at the first read that showed b ready to train


def test_min_peers_still_gives_up_after_the_wait_timeout(monkeypatch):
    monkeypatch.setattr(peer_module.time, "sleep", lambda seconds: None)
    board = Board(downloading=10**9)
    started = time.monotonic()
    _wait(board, min_peers=2, wait_timeout=0.2)
    assert 0.2 <= time.monotonic() - started < 5.0 and board.reads > 1


class EmptyBoard:
    def fetch(self, *, include_leaving: bool = False) -> dict[str, PeerHeartbeat]:
        return {}


def _waited(connect_timeout: float) -> float:
    """Seconds check_run_exists waits for a run nobody is in (on a fake clock)."""
    clock = [0.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    with pytest.raises(SwarmError, match="no live peer of run 'gone'") as error:
        peer_module.check_run_exists(
            EmptyBoard(), "gone", connect_timeout, clock=lambda: clock[0], sleep=sleep
        )
    assert f"within {min(max(connect_timeout, 3), 10):.0f} s" in str(error.value)
    return clock[0]


def test_a_joiner_waits_for_its_run_as_long_as_its_connect_timeout_says_within_3_to_10_s():
    assert 5.0 <= _waited(5.0) < 5.4
    assert 3.0 <= _waited(1.0) < 3.4
    assert 10.0 <= _waited(20.0) < 10.4


def test_a_joiner_that_finds_only_leaving_peers_is_told_the_run_is_over():
    """A joiner of a run whose peers had just finished was told to check --run-id and --secret
    (both right): the leaving heartbeats it could read say the run is over."""

    class Ended:
        def fetch(self, *, include_leaving: bool = False) -> dict[str, PeerHeartbeat]:
            if not include_leaving:
                return {}
            return {
                p: PeerHeartbeat(
                    peer_id=p,
                    name=p,
                    stage=Stage.LEAVING,
                    outer_step=step,
                    inner_step=0,
                    inner_steps=10,
                    rounds=20,
                    time=time.time(),
                )
                for p, step in (("a", 20), ("b", 20))
            }

    with pytest.raises(SwarmError) as error:
        peer_module.check_run_exists(
            Ended(), "ended", 3.0, clock=iter(range(100)).__next__, sleep=lambda s: None
        )
    message = str(error.value)
    assert "run 'ended' is over" in message and "outer step 20 after their last round" in message
    assert "--secret" not in message and "\n" not in message


def test_a_joiner_mid_round_trusts_its_round_mates_then_the_median_claim():
    """A joiner runs only the steps left in the round, from the others' heartbeats. A fresh key
    claiming inner step 99 of 100 cut an honest joiner's first round to one step; now a claim
    is believed from a round mate, otherwise the median of the peers training the round."""

    def training(peer: str, inner: int, step: int = 7) -> PeerHeartbeat:
        return PeerHeartbeat(
            peer_id=peer, name=peer, stage=Stage.TRAINING, outer_step=step, inner_step=inner,
            inner_steps=100, time=time.time(),
        )  # fmt: skip

    class Beats:
        def __init__(self, *beats: PeerHeartbeat) -> None:
            self.beats = {b.peer_id: b for b in beats}

        def fetch(self) -> dict[str, PeerHeartbeat]:
            return self.beats

    honest, liar = training("h", 30), training("liar", 99)
    steps = peer_module.steps_this_round
    assert steps(Beats(honest, liar, training("old", 90, step=6)), "me", 7, 100) == 70
    assert steps(Beats(honest, training("g", 40), liar), "me", 7, 100) == 60  # the median of three
    assert steps(Beats(honest, liar), "me", 7, 100, vouched={"liar"}) == 1  # a round mate is believed
    assert steps(Beats(training("me", 50)), "me", 7, 100) == 100  # nobody else: the whole round
    # A peer that averaged with its mates last round starts this one with them, whatever a
    # mate's heartbeat published a step in says.
    assert steps(Beats(training("h", 1)), "me", 7, 100, vouched={"h"}) == 99
    assert steps(Beats(training("h", 1)), "me", 7, 100, vouched={"h"}, in_step=True) == 100
