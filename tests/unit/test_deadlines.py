"""Deadlines learned from the last rounds (swarm.deadlines) and the barrier that uses them."""

from __future__ import annotations

import pytest

from swarm.averaging_config import AveragingConfig
from swarm.barrier import RoundBarrier, Verdict
from swarm.deadlines import MATCHMAKING_FLOOR, LearnedDeadline, matchmaking_window
from swarm.records import PeerHeartbeat, Stage
from tests.unit.test_claims import FakeClock


def test_the_configured_value_until_enough_rounds_then_a_high_percentile_within_bounds():
    deadline = LearnedDeadline(ceiling=60.0, floor=5.0, margin=1.0)
    for seconds in (0.5, 0.7, 0.4, 0.6):
        deadline.observe(seconds)
    assert deadline.seconds == 60.0 and not deadline.learned  # 4 rounds: not yet
    deadline.observe(0.8)
    assert deadline.learned and deadline.seconds == 5.0  # 2 x 0.8 + 1 = 2.6, below the floor
    for seconds in (10.0, 12.0, 11.0, 9.0, 14.0, 13.0, 12.0, 10.0, 11.0, 12.0):
        deadline.observe(seconds)
    assert deadline.seconds == pytest.approx(2 * 13.0 + 1.0)  # the 90th percentile of 15 rounds
    for _ in range(20):
        deadline.observe(100.0)
    assert deadline.seconds == 60.0  # never more than configured
    deadline.observe(float("nan"))
    deadline.observe(-1.0)
    assert deadline.seconds == 60.0
    with pytest.raises(ValueError, match="floor"):
        LearnedDeadline(ceiling=1.0, floor=2.0)


class Board:
    def __init__(self, *beats: PeerHeartbeat) -> None:
        self.beats = {b.peer_id: b for b in beats}

    def fetch(self) -> dict[str, PeerHeartbeat]:
        return dict(self.beats)

    def ignore(self, peer_id: str, reason: str) -> None:
        self.beats.pop(peer_id, None)


def beat(peer: str, step: int, stage: Stage) -> PeerHeartbeat:
    return PeerHeartbeat(
        peer_id=peer, name=peer, stage=stage, outer_step=step, inner_step=0, inner_steps=5, time=0.0
    )


def barrier(board: Board) -> RoundBarrier:
    config = AveragingConfig(matchmaking_time=0.5, round_wait=30.0)
    made = RoundBarrier(board=board, peer_id="me", beat=lambda stage: None, config=config)
    made.vouching.averaged_with(["slow"])  # a round mate: waited for the whole (learned) wait
    made.clock = clock = FakeClock()
    made.sleep = clock.sleep
    return made


def test_a_round_mate_that_is_late_every_round_is_left_out_sooner():
    """Round mates used to arrive within a second: a mate still training 10 s after this peer
    came is not waited for the configured 30 s, but the learned 10 s (the floor)."""
    board = Board(beat("slow", 7, Stage.TRAINING))
    swarm = barrier(board)
    for _ in range(5):
        swarm.wait.observe(0.8)
    started = swarm.clock()
    assert swarm.wait_for_round_mates(7) is Verdict.ALONE  # nobody ready: step alone
    assert 10.0 <= swarm.clock() - started < 10.5


def test_a_downloading_peer_still_gets_the_whole_round_wait():
    board = Board(beat("joiner", 0, Stage.DOWNLOADING), beat("slow", 7, Stage.WAITING))
    swarm = barrier(board)
    swarm.config.round_wait = 12.0
    for _ in range(5):
        swarm.wait.observe(0.0)
    started = swarm.clock()
    assert swarm.wait_for_round_mates(7) is Verdict.AVERAGE
    assert 12.0 <= swarm.clock() - started < 12.5  # not the learned 10 s


def test_a_stranger_still_training_at_the_learned_wait_casts_no_doubt_on_downloads():
    """A stranger within its grace (about one of this peer's rounds) when the learned wait ran
    out was struck as if it "said it was downloading", and every joiner's download was doubted
    (not waited for) for the next 10 rounds."""
    board = Board(beat("newcomer", 7, Stage.TRAINING), beat("slow", 7, Stage.WAITING))
    swarm = barrier(board)
    swarm.gap = 20.0  # its grace: 30 s, past the learned 10 s
    for _ in range(5):
        swarm.wait.observe(0.0)
    started = swarm.clock()
    assert swarm.wait_for_round_mates(7) is Verdict.AVERAGE
    assert 10.0 <= swarm.clock() - started < 10.5
    assert swarm.doubted is None and "newcomer" not in swarm.vouching._strikes


def test_a_joiner_that_lands_during_the_wait_is_waited_for_from_its_landing():
    """A downloader is waited for; once it lands it trains the round it landed on (a whole H).
    Its grace and wait counted from the wait's start, so a 15 s download had used them up: it
    was not waited for the moment it landed, struck, found itself behind, downloaded again, and
    after three rounds of that was ignored for good. Still, never past the round wait."""

    class Joining(Board):
        def __init__(self, swarm_clock, lands: float, trains: float) -> None:
            super().__init__()
            self.clock, self.lands, self.trains = swarm_clock, lands, trains
            self.start = swarm_clock()

        def fetch(self) -> dict[str, PeerHeartbeat]:
            t = self.clock() - self.start
            stage = (
                Stage.DOWNLOADING
                if t < self.lands
                else Stage.TRAINING
                if t < self.lands + self.trains
                else Stage.WAITING
            )
            return {"joiner": beat("joiner", 7, stage)}

    for lands, trains, verdict, after in (
        (15.0, 20.0, Verdict.AVERAGE, 35.0),
        (50.0, 20.0, Verdict.AVERAGE, 60.0),
    ):
        swarm = barrier(Board())
        swarm.config.round_wait = 60.0
        swarm.gap = 20.0  # this peer's own round of inner steps took as long as the joiner's will
        swarm.board = Joining(swarm.clock, lands, trains)
        started = swarm.clock()
        assert swarm.wait_for_round_mates(7) is verdict
        waited = swarm.clock() - started
        if lands + trains <= swarm.config.round_wait:
            assert lands + trains <= waited < lands + trains + 1.5 and swarm.expected == ("joiner",)
        else:  # the round wait bounds it all the same
            assert after <= waited < after + 1.5 and swarm.expected == ()


def test_the_barrier_learns_from_how_long_it_waited():
    board = Board(beat("slow", 7, Stage.WAITING))
    swarm = barrier(board)
    assert swarm.wait_for_round_mates(7) is Verdict.AVERAGE  # nobody busy: waited ~0 s
    assert len(swarm.wait._seen) == 1 and swarm.wait._seen[0] < 0.5


def test_the_barrier_expects_its_round_mates_only_when_every_live_peer_is_ready():
    """Matchmaking forms the group as soon as these joined (swarm.hivemind_fixes): the two
    ready mates. A peer that looks neither busy nor ready (a straggler, or its
    heartbeat a round stale) may still come: then nothing is expected and the window decides."""
    board = Board(beat("a", 7, Stage.WAITING), beat("b", 7, Stage.AVERAGING))
    swarm = barrier(board)
    assert swarm.wait_for_round_mates(7) is Verdict.AVERAGE
    assert sorted(swarm.expected) == ["a", "b"]
    board.beats["c"] = beat("c", 6, Stage.TRAINING)
    assert swarm.wait_for_round_mates(7) is Verdict.AVERAGE and swarm.expected == ()
    board.beats = {}
    assert swarm.wait_for_round_mates(8) is Verdict.ALONE and swarm.expected == ()


def test_the_matchmaking_window_is_learned_within_its_bounds():
    """What a peer's window does with the times its last groups took to form."""
    window = matchmaking_window(2.0)
    for _ in range(5):
        window.observe(0.05)  # complete groups, formed at once
    assert window.seconds == MATCHMAKING_FLOOR
    for _ in range(3):
        window.observe(MATCHMAKING_FLOOR)  # groups that waited out the window: a mate came late
    assert window.seconds == pytest.approx(2 * MATCHMAKING_FLOOR + 0.25)
    for _ in range(5):
        window.observe(2.0)
    assert window.seconds == 2.0  # never more than --matchmaking-time


def test_a_group_is_complete_when_the_expected_peers_joined_whoever_else_did():
    """hivemind's leader checks ``len(followers) + 1 >= target_group_size`` on each join."""
    from types import SimpleNamespace

    from hivemind.p2p import PeerID

    from swarm.hivemind_fixes import ExpectedMembers

    me, a, b, stranger = (PeerID(bytes([i]) * 34) for i in range(4))
    leader = SimpleNamespace(peer_id=me, current_followers={})
    target = ExpectedMembers.parse(leader, f"{a.to_base58()},{b.to_base58()}".encode())
    leader.current_followers[stranger] = None
    leader.current_followers[a] = None
    assert not len(leader.current_followers) + 1 >= target  # 3 members, but not b: not yet
    leader.current_followers[b] = None
    assert len(leader.current_followers) + 1 >= target
    assert ExpectedMembers.parse(leader, b"") is None and ExpectedMembers.parse(leader, b"not-an-id!") is None


def test_a_long_wait_reads_the_board_less_and_less_often_and_still_ends_on_time():
    """Every read of the board is a DHT lookup of the run's one heartbeat key: the barrier read
    it ten times a second for as long as it waited (300 lookups for a 30 s wait, from every
    peer waiting out a straggler). Now ten a second in the first second (a mate that comes is
    seen as soon as before), then every tenth of the time waited, a second apart at most; the
    wait still ends when it must."""
    from swarm.barrier import POLL_FIRST, POLL_MOST

    board = Board(beat("slow", 7, Stage.TRAINING))  # a vouched mate that never comes
    swarm = barrier(board)  # round_wait 30 s, all of it for a round mate until 5 rounds are seen
    reads, fetch = [], board.fetch
    board.fetch = lambda: (reads.append(swarm.clock()), fetch())[1]
    started = swarm.clock()
    assert swarm.wait_for_round_mates(7) is Verdict.ALONE
    assert 30.0 < swarm.clock() - started < 30.2
    gaps = [later - earlier for earlier, later in zip(reads, reads[1:])]
    assert all(g == pytest.approx(POLL_FIRST) for g in gaps[:9]), gaps[:9]
    assert all(POLL_FIRST - 1e-9 <= g <= POLL_MOST + 1e-9 for g in gaps), gaps
    assert len(reads) < 60, len(reads)


@pytest.mark.parametrize(
    "other",
    [beat("straggler", 6, Stage.TRAINING), beat("waiting-for-min-peers", 0, Stage.JOINING)],
    ids=["a straggler a round behind", "a peer waiting for its --min-peers"],
)
def test_with_nobody_who_could_average_this_round_the_peer_steps_alone_soon(other) -> None:
    """The barrier said AVERAGE with nobody ready or training this round, and matchmaking then
    waited its whole timeout for nobody: 15-30 s of every round (a review, 2026-12-06). A
    heartbeat a moment stale still gets a few seconds to show the peer ready."""
    swarm = barrier(Board(other))
    started = swarm.clock()
    assert swarm.wait_for_round_mates(7) is Verdict.ALONE
    assert 1.0 <= swarm.clock() - started <= 2.5  # 2 matchmaking windows (2 s at least)

    class Catches(Board):  # a stale heartbeat: ready on the board's third read
        reads = 0

        def fetch(self):  # type: ignore[no-untyped-def]
            self.reads += 1
            return {"late": beat("late", 7 if self.reads >= 3 else 6, Stage.WAITING)}

    swarm = barrier(Catches())
    assert swarm.wait_for_round_mates(7) is Verdict.AVERAGE and swarm.expected == ("late",)


def test_a_round_mate_slower_than_the_learned_wait_is_waited_for_again() -> None:
    """The learned wait grew only from mates that came: a mate slowed down to 20 s rounds
    against a learned 10 s wait was given up every round, downloaded the state every round and
    never averaged again (a review, 2026-12-06). Giving up on a mate it averaged with, the
    barrier forgets what it learned: the next rounds wait up to the round wait."""
    board = Board(beat("slow", 7, Stage.TRAINING))
    swarm = barrier(board)
    for _ in range(5):
        swarm.wait.observe(0.8)
    assert swarm.wait.seconds == 10.0
    assert swarm.wait_for_round_mates(7) is Verdict.ALONE
    assert swarm.wait.seconds == swarm.config.round_wait  # learning anew

    stranger = barrier(Board(beat("newcomer", 7, Stage.TRAINING)))  # never averaged with it
    for _ in range(5):
        stranger.wait.observe(0.8)
    stranger.gap = 20.0  # its grace (30 s) outlasts the learned wait
    stranger.wait_for_round_mates(7)
    assert stranger.wait.seconds == 10.0  # a stranger's claim moves nothing
