"""The end of a finite run (swarm.ending): which θ a finishing peer keeps, whom it waits for, and
that the round barrier of peers running on does not count a finishing peer as a round mate.
tests/integration/test_swarm_training.py plays it with real peers."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.barrier import Verdict
from swarm.ending import final_sketch, parse, same_theta, verdict
from swarm.records import PeerHeartbeat, Stage
from tests.unit.test_claims import NOW, FakeBoard, averager

STEP = 40


def theta(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(300, 70, generator=generator), torch.randn(70, generator=generator)]


A, B = final_sketch(theta(0), STEP), final_sketch(theta(1), STEP)


def beat(
    peer: str,
    sketch=None,
    *,
    step: int = STEP,
    rounds: int = STEP,
    stage=None,
    settled: bool = False,
) -> PeerHeartbeat:
    return PeerHeartbeat(
        peer_id=peer,
        name=peer,
        stage=stage or (Stage.FINISHING if sketch is not None else Stage.TRAINING),
        outer_step=step,
        inner_step=0,
        inner_steps=5,
        time=NOW,
        rounds=rounds,
        final_theta=sketch or [],
        settled=settled,
    )


def test_a_sketch_sees_a_change_that_keeps_every_tensor_s_length():
    params = theta(0)
    swapped = [params[0].clone(), params[1].clone()]
    swapped[0][0, :2] = swapped[0][0, :2].flip(0)  # two values swapped: every length unchanged
    lengths = [float(t.norm()) for t in params], [float(t.norm()) for t in swapped]
    assert lengths[0] == pytest.approx(lengths[1], rel=1e-6)  # the round's fingerprint is blind to it
    assert same_theta(final_sketch(params, STEP), final_sketch([t.clone() for t in params], STEP))
    assert not same_theta(final_sketch(params, STEP), final_sketch(swapped, STEP))
    assert final_sketch(params, STEP) != final_sketch(params, STEP + 1)  # a seed per step


def test_rounding_is_the_same_theta():
    params = theta(0)
    rounded = [t * (1 + 1e-7 * torch.randn(t.shape)) for t in params]
    assert same_theta(final_sketch(params, STEP), final_sketch(rounded, STEP))


@pytest.mark.parametrize(
    "values", [[], [1.0] * 8, [math.nan] * 9, [1.0] * 8 + [-1.0], [1.0] * 8 + [math.inf]]
)
def test_a_malformed_sketch_is_no_vote(values):
    assert parse(values) is None
    alone = verdict("me", A, STEP, [beat("x", None, stage=Stage.FINISHING) for _ in [0]], {"x"})
    assert alone.action == "leave"
    ending = [beat("x", values, stage=Stage.FINISHING), beat("y", B)]
    assert (
        verdict("me", A, STEP, ending, {"x", "y"}).action == "wait"
    )  # only y voted: 1 against 1, "me" < "y"


def test_outvoted_it_downloads_from_the_peers_holding_the_others_theta():
    others = [beat("w", B), beat("x", B), beat("y", B), beat("z", A)]
    ending = verdict("me", A, STEP, others, {"w", "x", "y", "z"})
    assert ending.action == "download" and ending.holders == {"w", "x", "y"} and ending.agreeing == 1
    assert "3 of 5 peers" in ending.why


def test_a_tie_goes_to_the_theta_the_lowest_peer_id_holds():
    assert verdict("b", A, STEP, [beat("a", B)], {"a"}).action == "download"
    assert verdict("a", B, STEP, [beat("b", A)], {"b"}).action == "wait"  # until b holds its θ


def test_peers_that_trust_different_others_do_not_each_wait_for_the_other():
    """p1 averaged only with p2; p2 with p1 and p3, who holds p2's θ. p1 saw a 1-1 tie go to its
    own θ (the lowest id), p2 a 2-1 win: each waited for the other to download, for the whole
    round wait, and they left on different θ. Peers a voter never averaged with do not vote,
    but they break its ties: p1 takes the θ p3 holds too."""
    beats = {"p1": beat("p1", B), "p2": beat("p2", A), "p3": beat("p3", A)}
    trust = {"p1": {"p2"}, "p2": {"p1", "p3"}, "p3": {"p2"}}
    mine = {"p1": B, "p2": A, "p3": A}
    actions = {
        peer: verdict(peer, mine[peer], STEP, [b for p, b in beats.items() if p != peer], trust[peer]).action
        for peer in beats
    }
    assert actions == {"p1": "download", "p2": "wait", "p3": "settle"}  # p3: until p2 is settled
    # A stranger's θ alone is no candidate: it breaks ties between voters' θs only.
    lone = verdict("a", A, STEP, [beat("b", B), beat("s1", final_sketch(theta(2), STEP))], {"b"})
    assert lone.action == "wait"  # the tie goes to a's θ, as without the stranger


def test_it_leaves_once_everyone_ending_with_it_holds_its_theta_and_says_so():
    ending = verdict("me", A, STEP, [beat("x", A), beat("y", A)], {"x", "y"})
    assert ending.action == "settle" and ending.agreeing == 2 and "x, y not settled" in ending.why
    ending = verdict(
        "me", A, STEP, [beat("x", A, settled=True), beat("y", A, stage=Stage.LEAVING)], {"x", "y"}
    )
    assert ending.action == "leave" and ending.agreeing == 2


def _end(
    theta_of: dict[str, list[float]], trust: dict[str, set[str]], order=sorted
) -> dict[str, list[float]]:
    """Every peer's ending played in turns, as `Peer.end_on_the_others_state` does: the θ each
    leaves on (a download takes the θ its holders hold)."""
    held, settled, left = dict(theta_of), dict.fromkeys(theta_of, False), {}
    for _ in range(50):
        for peer in order(theta_of):
            if peer in left:
                continue
            beats = [
                beat(
                    other,
                    held[other],
                    stage=Stage.LEAVING if other in left else None,
                    settled=settled[other],
                )
                for other in theta_of
                if other != peer
            ]
            ending = verdict(peer, held[peer], STEP, beats, trust[peer])
            settled[peer] = ending.action == "settle"
            if ending.action == "leave":
                left[peer] = held[peer]
            elif ending.action == "download":
                held[peer] = held[min(ending.holders)]
        if len(left) == len(theta_of):
            return left
    raise AssertionError(f"not settled in 50 turns: left {sorted(left)}, {settled}")


def test_peers_that_averaged_with_different_others_leave_on_one_theta():
    """P0, P1 and P2 averaged together; P3, late, only with P2; the last round split them into
    {P0, P1} on θa and {P2, P3} on θb. P3 saw its only round mate on its θ and left on θb; P2
    saw a 2-2 tie go to P0's θ and downloaded θa (a review, stop 59: 60 of 434 such 4-peer
    cases). Now P3 waits for P2 to be settled, sees it switch, and follows, whichever of them
    plays first."""
    trust = {"p0": {"p1", "p2"}, "p1": {"p0", "p2"}, "p2": {"p0", "p1", "p3"}, "p3": {"p2"}}
    for order in (sorted, lambda peers: sorted(peers, reverse=True)):
        ended = _end({"p0": A, "p1": A, "p2": B, "p3": B}, trust, order)
        assert all(same_theta(theta, A) for theta in ended.values()), ended


def test_a_peer_whose_mate_left_on_its_theta_keeps_it():
    """Its mate left on this peer's word (it was settled): were it to take another θ now, the
    mate would be the one left on another (a review, stop 59)."""
    others = [beat("mate", A, stage=Stage.LEAVING), beat("b1", B), beat("b2", B)]
    ending = verdict("me", A, STEP, others, {"mate", "b1", "b2"})
    assert ending.action == "wait"  # a 2-2 tie that goes to B (b1 sorts first): it keeps A
    others[0] = beat("mate", A)  # still finishing: it may follow this peer
    assert verdict("me", A, STEP, others, {"mate", "b1", "b2"}).action == "download"


def test_it_waits_for_a_peer_still_in_its_last_round():
    ending = verdict("me", A, STEP, [beat("x", A), beat("slow", step=STEP - 1)], {"x", "slow"})
    assert ending.action == "wait" and "slow" in ending.why


def test_strangers_and_peers_running_on_neither_vote_nor_hold_it():
    others = [
        beat("stranger", B),  # never averaged with this one
        beat("stranger-slow", step=STEP - 1),
        beat("longer", step=STEP + 3, rounds=100),  # runs on
        beat("forever", step=STEP, rounds=0, stage=Stage.WAITING),
        beat("paused", step=STEP - 1, stage=Stage.PAUSED),
    ]
    vouched = {"longer", "forever", "paused"}
    ending = verdict("me", A, STEP, others, vouched)
    assert ending.action == "leave" and ending.agreeing == 0


def test_a_finishing_peer_is_no_round_mate_for_peers_running_on():
    board = FakeBoard(beat("done", A, step=4, rounds=4))
    assert averager(board, vouched=["done"]).wait_for_round_mates(4) is Verdict.ALONE
    board = FakeBoard(beat("done", A, step=4, rounds=4), beat("mate", None, step=4, stage=Stage.WAITING))
    swarm = averager(board, vouched=["done", "mate"])
    assert swarm.wait_for_round_mates(4) is Verdict.AVERAGE and swarm.expected == ("mate",)


def test_a_peer_whose_only_mates_are_paused_says_so():
    """Its mates paused by the owner, a peer said "no other peer in this round" every round (a
    hands-on review, stop 72): alone all the same, saying why."""
    board = FakeBoard(beat("paused", A, step=4, stage=Stage.PAUSED))
    assert averager(board, vouched=["paused"]).wait_for_round_mates(4) is Verdict.PAUSED
    assert averager(FakeBoard(), vouched=[]).wait_for_round_mates(4) is Verdict.ALONE


def test_an_overlapped_last_round_averages_with_the_peers_that_end_with_it():
    """Overlapped, every peer's clock is at the run's length while its last round averages in
    the background: it is a mate for that round (the run ended on as many θ as peers, each
    with its own last update), until it says it is finishing."""
    for stage in (Stage.WAITING, Stage.AVERAGING, Stage.TRAINING):
        mate = beat("mate", step=STEP, rounds=STEP, stage=stage)
        swarm = averager(FakeBoard(mate), vouched=["mate"])
        swarm.overlapped = True
        assert swarm.wait_for_round_mates(STEP - 1) is Verdict.AVERAGE and swarm.expected == ("mate",), stage
    swarm = averager(FakeBoard(beat("mate", A, step=STEP, rounds=STEP)), vouched=["mate"])
    swarm.overlapped = True
    assert swarm.wait_for_round_mates(STEP - 1) is Verdict.ALONE  # finishing: it averaged without us
    blocking = averager(
        FakeBoard(beat("mate", step=STEP, rounds=STEP, stage=Stage.WAITING)), vouched=["mate"]
    )
    assert blocking.wait_for_round_mates(STEP) is Verdict.ALONE  # not overlapped: its rounds are over


def test_a_peer_behind_a_finishing_one_does_not_take_its_theta_in_a_round():
    # It may have ended its last round alone, while the others still average theirs: they
    # settle on one θ when they finish, by vote (swarm.ending), not on whoever finished first.
    board = FakeBoard(beat("done", A, step=4, rounds=4), beat("mate", None, step=3, stage=Stage.WAITING))
    assert averager(board, vouched=["done", "mate"]).wait_for_round_mates(3) is Verdict.AVERAGE


def test_a_peer_that_left_holding_a_theta_still_counts_and_is_not_waited_for():
    gone = beat("x", A, stage=Stage.LEAVING)
    assert verdict("me", A, STEP, [gone], {"x"}).agreeing == 1
    assert verdict("me", A, STEP, [beat("y", step=STEP - 1, stage=Stage.LEAVING)], {"y"}).action == "leave"


def test_while_some_are_in_their_last_rounds_only_a_sure_majority_is_downloaded():
    # c stepped its last round alone and finished first; x, y and me averaged theirs, and x's and
    # y's heartbeats do not say "finishing" yet: a tie of one against one must not send me to c.
    others = [beat("c", B), beat("x", step=STEP - 1, stage=Stage.AVERAGING), beat("y", step=STEP - 1)]
    ending = verdict("me", A, STEP, others, {"c", "x", "y"})
    assert ending.action == "wait" and "x, y still in their last rounds" in ending.why
    sure = [beat("a", B), beat("b", B), beat("c", B), beat("x", step=STEP - 1)]
    assert verdict("me", A, STEP, sure, {"a", "b", "c", "x"}).action == "download"  # 4 against 2 at most


def test_a_peer_done_with_its_rounds_is_no_round_mate_even_while_it_downloads():
    downloading = beat("done", None, step=4, rounds=4, stage=Stage.DOWNLOADING)
    assert downloading.done and not beat("on", None, step=4, rounds=9, stage=Stage.DOWNLOADING).done
    swarm = averager(FakeBoard(downloading), vouched=["done"], round_wait=60.0)
    started = swarm.clock()
    assert swarm.wait_for_round_mates(4) is Verdict.ALONE and swarm.clock() == started  # not waited for
    assert averager(FakeBoard(downloading), vouched=["done"]).wait_for_round_mates(3) is Verdict.ALONE


def _finishing_peer(vouched: set[str], beats: tuple = ()):
    """A peer at the end of its 40 rounds, whose board shows ``beats`` (none: the others left
    before)."""
    from types import SimpleNamespace

    from workbench.run.peer import Peer

    class Probe(Peer):
        def heartbeat(self):  # type: ignore[no-untyped-def]
            return None

    peer = object.__new__(Probe)
    peer.name, peer.peer_id, peer.settled, peer.beat = "slow", "me", False, lambda stage: None
    peer.diloco = SimpleNamespace(outer_step_count=40, read_global=lambda read: [1.0, 2.0])
    config = SimpleNamespace(round_wait=5.0)
    peer.averager = SimpleNamespace(
        barrier=SimpleNamespace(config=config), vouching=SimpleNamespace(vouched=set(vouched))
    )
    shown = {b.peer_id: b for b in beats}
    peer.board = SimpleNamespace(
        fetch=lambda include_leaving=False: dict(shown), publish=lambda *a, **k: None
    )
    return peer


def test_a_peer_that_ends_after_its_mates_left_does_not_say_it_ended_on_their_state(caplog) -> None:
    """A slow peer trained its last rounds alone after the peers it averaged with had left: its
    θ was its own (max-abs 1e-3 off theirs), and its summary said ended_on_others_state: true
    with 0 agreeing peers (a review, 2026-12-06)."""
    with caplog.at_level("WARNING", logger="workbench.run.peer"):
        ended = _finishing_peer({"fast"}).end_on_the_others_state()
    assert ended["ended_on_others_state"] is False and ended["ending_agreeing_peers"] == 0
    assert "ended the run alone at outer step 40" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="workbench.run.peer"):
        alone = _finishing_peer(set()).end_on_the_others_state()  # a run of one peer
    assert alone["ended_on_others_state"] is False and "ended the run alone" not in caplog.text


def test_a_peer_whose_mates_run_on_past_its_rounds_does_not_say_they_left(caplog) -> None:
    """A volunteer's `--rounds` run ended on "the peers it averaged with had left; its final θ
    is its own" while the owner it had just averaged with trained on (a review, stop 64)."""
    owner = beat("owner", step=41, rounds=0, stage=Stage.TRAINING)  # no --rounds: until stopped
    with caplog.at_level("INFO", logger="workbench.run.peer"):
        ended = _finishing_peer({"owner"}, (owner,)).end_on_the_others_state()
    assert ended["ended_on_others_state"] is False
    assert "ended the run alone" not in caplog.text
    assert "done at outer step 40; owner, which it averaged with, runs on past it" in caplog.text


def test_a_peer_left_behind_round_after_round_says_so_once(caplog) -> None:
    """A joiner whose rounds took 12.5 s, where the others waited about 2 s for a stranger,
    downloaded the state 8 times, never averaged, and nothing said why (a review, 2026-12-06)."""
    from types import SimpleNamespace

    from workbench.run.peer import LEFT_BEHIND_ROUNDS, Peer

    peer = object.__new__(Peer)
    peer.name, peer.left_behind = "slow", 0
    behind = SimpleNamespace(stale=True, group_size=1)
    with caplog.at_level("WARNING", logger="workbench.run.peer"):
        for _ in range(LEFT_BEHIND_ROUNDS + 4):
            peer._note_left_behind(behind, 12.5)
    said = [r.getMessage() for r in caplog.records if "slower than they wait for" in r.getMessage()]
    assert len(said) == 1 and "12 s of inner steps" in said[0] and "--round-seconds" in said[0], said
    peer._note_left_behind(SimpleNamespace(stale=False, group_size=2), 1.0)
    assert peer.left_behind == 0


def test_a_round_line_after_a_download_names_the_round_its_loss_is_of(caplog) -> None:
    """A peer frozen in round 6 that then took the swarm's state at step 16 printed "round 16
    loss 3.8014 ...": round 6's loss under the swarm's step (a review, 2026-12-06)."""
    from optim.averager import RoundReport
    from workbench.run.peer import Peer
    from workbench.run.telemetry import RoundStats

    peer = object.__new__(Peer)
    peer.name, peer.emit = "c", lambda *args, **fields: None
    peer.stats = RoundStats()
    peer.stats.last_loss = 3.8014
    peer.diloco = __import__("types").SimpleNamespace(outer_step_count=16)
    report = RoundReport(group_size=1, error="other peers are past this round", stale=True)
    info = {"outer_step": 5, "fingerprint": [1.0]}
    with caplog.at_level("INFO", logger="workbench.run.peer"):
        peer._report_round(report, info, 2.9, "out of step", 0.0, 1.0, True)
        peer.diloco.outer_step_count = 6
        peer._report_round(RoundReport(group_size=2), info, 2.9, None, 0.0, 1.0, True)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("c: round 6  loss 3.8014") and "now at the swarm's outer step 16" in lines[0]
    assert lines[1].startswith("c: round 6  loss") and "swarm's outer step" not in lines[1], lines


def test_a_peer_alone_beside_an_earlier_release_says_they_cannot_average(caplog) -> None:
    """Peers of the release before signed matchmaking declarations never average with this one
    (a review of stop 61): each side saw only rounds alone and nothing said why."""
    from types import SimpleNamespace

    from swarm.records import PROTOCOL, PeerHeartbeat, Stage
    from workbench.run.peer import Peer

    def beat(name: str, protocol: int) -> PeerHeartbeat:
        return PeerHeartbeat(
            peer_id=f"Qm{name}", name=name, stage=Stage.TRAINING, outer_step=3, inner_step=0,
            inner_steps=5, time=0.0, protocol=protocol,
        )  # fmt: skip

    peer = object.__new__(Peer)
    peer.name, peer.other_releases_said = "new", False
    peer.board = SimpleNamespace(last_seen={"a": beat("old", 0), "b": beat("same", PROTOCOL)})
    with caplog.at_level("WARNING", logger="workbench.run.peer"):
        peer._note_other_releases(SimpleNamespace(group_size=2))  # it averaged: nothing to say
        assert not caplog.records
        for _ in range(3):
            peer._note_other_releases(SimpleNamespace(group_size=1))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "old run(s) an earlier release" in said[0] and "same" not in said[0], said


def test_a_rounds_group_weights_are_as_the_group_counted_them() -> None:
    """After a member claimed 1e9 samples (counted as 16x the others' median), the round event
    recorded group_weights [160, 1e9], which `export` shows as the members' weights."""
    from optim.averager import RoundReport
    from workbench.run.telemetry import RoundStats, round_fields

    report = RoundReport(group_size=2, group_info=[{"weight": 160.0}, {"weight": 1e9}])
    fields = round_fields(report, {"fingerprint": [1.0]}, 3, RoundStats(), eval_loss=2.0, resync=None)
    assert fields["group_weights"] == [160.0, 16 * 160.0]


def test_a_peer_s_last_line_counts_the_rounds_it_trained() -> None:
    """A joiner that came at round 1410 ended on "done: 1446 rounds" (the run's round), one that
    trained none on "1375 rounds" (a review, stop 64)."""
    from workbench.run.peer import rounds_said

    assert rounds_said(4, 4) == "4 rounds"
    assert rounds_said(36, 1446) == "36 rounds (to the run's round 1446)"
    assert rounds_said(0, 1375) == "0 rounds (to the run's round 1375)"
