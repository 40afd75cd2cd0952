"""The monitor's sentences (swarm.narration): rounds as a person would tell them, and peers that
left kept on screen with how and when."""

from __future__ import annotations

from typing import Any

from swarm.monitor import Reading, SwarmMonitor
from swarm.narration import RoundSeen, round_sentence
from swarm.records import PeerHeartbeat


def hb(name: str, t: float, outer: int, **kw: Any) -> PeerHeartbeat:
    fields = dict(
        peer_id=f"id-{name}", name=name, stage="training", outer_step=outer, inner_step=1, inner_steps=5
    )
    return PeerHeartbeat.model_validate({**fields, "time": t, **kw})


def reading(t: float, *beats: PeerHeartbeat) -> Reading:
    return Reading(t, "r", {b.peer_id: b for b in beats})


def test_a_round_where_everyone_averaged_names_the_last_to_arrive() -> None:
    monitor = SwarmMonitor()
    monitor.ingest(reading(1.0, *(hb(n, 1.0, 2) for n in ("peer-0", "peer-1", "peer-2", "peer-3"))))
    done = dict(group_size=4, last_round_spread=1.83, last_round_last="peer-2")
    snapshot = monitor.ingest(
        reading(2.0, *(hb(n, 2.0, 3, **done) for n in ("peer-0", "peer-1", "peer-2", "peer-3")))
    )
    rounds = [e.message for e in snapshot.new_events if e.kind == "round"]
    assert rounds == ["round 3: 4 peers averaged (peer-2 arrived 1.8 s after the first)"]


def test_a_round_is_told_once_every_training_peer_finished_it() -> None:
    monitor = SwarmMonitor()
    monitor.ingest(reading(1.0, hb("a", 1.0, 0), hb("b", 1.0, 0)))
    first = monitor.ingest(reading(2.0, hb("a", 2.0, 1, group_size=2, last_round_last="b"), hb("b", 2.0, 0)))
    assert not [e for e in first.new_events if e.kind == "round"]  # b is still training round 1
    both = monitor.ingest(
        reading(
            3.0,
            hb("a", 3.0, 1, group_size=2, last_round_last="b"),
            hb("b", 3.0, 1, group_size=2, last_round_last="b"),
        )
    )
    assert [e.message for e in both.new_events if e.kind == "round"] == [
        "round 1: 2 peers averaged (all arrived within 0.1 s)"
    ]


def test_a_fallback_says_who_stepped_alone_and_why_and_who_was_not_there() -> None:
    monitor = SwarmMonitor()
    monitor.ingest(reading(1.0, hb("a", 1.0, 4), hb("b", 1.0, 4), hb("c", 1.0, 4), hb("d", 1.0, 4)))
    pair = dict(group_size=2, last_round_spread=0.4, last_round_last="b")
    why = "averaging failed: AllreduceException: could not find a group"
    snapshot = monitor.ingest(
        reading(
            2.0,
            hb("a", 2.0, 5, **pair),
            hb("b", 2.0, 5, **pair),
            hb("c", 2.0, 5, group_size=1, last_round_alone=why),
            hb("d", 2.0, 4, stage="downloading"),
        )
    )
    assert [e.message for e in snapshot.new_events if e.kind == "round"] == [
        "round 5: 2 peers averaged (b arrived 0.4 s after the first); "
        f"c stepped alone ({why}); d was downloading the state"
    ]


def test_a_peer_that_took_the_state_at_the_step_did_not_step_alone_there() -> None:
    """A peer that just downloaded the state (or resumed from a checkpoint) has had no round at
    its step (group size 0): a fresh monitor, as every `workbench status` starts, told it
    "stepped alone (no reason given)" in a round it never ran, and a swarm that had all just
    resumed as "no group formed"."""
    pair = dict(group_size=2, last_round_spread=0.2, last_round_last="b")
    monitor = SwarmMonitor()
    snapshot = monitor.ingest(
        reading(1.0, hb("a", 1.0, 345, **pair), hb("b", 1.0, 345, **pair), hb("c", 1.0, 345))
    )
    assert [e.message for e in snapshot.new_events if e.kind == "round"] == [
        "round 345: 2 peers averaged (b arrived 0.2 s after the first); c joined at this step"
    ]
    resumed = SwarmMonitor().ingest(reading(1.0, hb("a", 1.0, 345), hb("b", 1.0, 345)))
    assert not [e for e in resumed.new_events if e.kind == "round"]


def test_sentences_for_several_groups_and_for_no_group() -> None:
    pair = RoundSeen("x", 2, 0.0, "", "")
    seen = {"a": pair, "b": pair, "c": pair, "d": pair}
    assert round_sentence(7, seen, {}) == "round 7: 4 peers averaged in groups of 2 and 2"
    alone = {
        "a": RoundSeen("a", 1, 0.0, "", "no other peer in this round"),
        "b": RoundSeen("b", 1, 0.0, "", ""),
    }
    behind = {"c": hb("c", 0.0, 5)}
    assert round_sentence(7, alone, behind) == (
        "round 7: no group formed; a stepped alone (no other peer in this round); "
        "b stepped alone (no reason given); c was 2 rounds behind"
    )


def test_a_peer_that_leaves_stays_with_how_and_when_until_cleared_or_five_minutes() -> None:
    monitor = SwarmMonitor()
    monitor.ingest(reading(1.0, hb("a", 1.0, 1), hb("b", 1.0, 1), hb("c", 1.0, 1)))
    monitor.note_killed("id-b")
    snapshot = monitor.ingest(reading(2.0, hb("a", 2.0, 1), hb("c", 2.0, 1, stage="leaving")))
    assert {d.heartbeat.name: (d.how, d.time) for d in snapshot.departed.values()} == {
        "b": ("killed from the monitor", 2.0),
        "c": ("clean exit", 2.0),
    }
    lefts = sorted(e.message for e in snapshot.new_events if e.kind == "left")
    assert lefts == [
        "b left at outer step 1 (killed from the monitor)",
        "c left at outer step 1 (clean exit)",
    ]
    assert [d["name"] for d in snapshot.to_json()["departed"]] == ["b", "c"]
    # b comes back: no longer departed, and the event says so
    back = monitor.ingest(reading(3.0, hb("a", 3.0, 1), hb("b", 3.0, 1)))
    assert set(back.departed) == {"id-c"}
    assert [e.message for e in back.new_events] == ["b joined again (cpu, outer step 1)"]
    assert set(monitor.ingest(reading(303.0, hb("a", 303.0, 1), hb("b", 303.0, 1))).departed) == set()
    monitor.ingest(reading(304.0, hb("a", 304.0, 1)))
    monitor.clear_departed()
    assert monitor.ingest(reading(305.0, hb("a", 305.0, 1))).departed == {}


def test_a_peer_ignored_for_lying_is_kept_as_such() -> None:
    monitor = SwarmMonitor()
    monitor.ingest(reading(1.0, hb("a", 1.0, 1), hb("b", 1.0, 1)))
    snapshot = monitor.ingest(
        Reading(2.0, "r", {"id-a": hb("a", 2.0, 1), "id-b": hb("b", 2.0, 1)}, ignored={"id-b": "absurd loss"})
    )
    assert snapshot.departed["id-b"].how == "ignored for lying: absurd loss"
    assert [e.kind for e in snapshot.new_events] == ["ignored"]


def test_a_peer_reads_its_rounds_arrivals_from_the_members_info_and_skips_malformed_ones() -> None:
    from types import SimpleNamespace

    from workbench.run.telemetry import RoundStats

    stats = RoundStats()
    infos = [
        {"arrived": 100.0, "name": "a"},
        {"arrived": 101.8, "name": "b" * 100},
        {"arrived": float("nan"), "name": "liar"},
        {"arrived": True, "name": "bool"},
        {"arrived": "soon", "name": "str"},
        "not a dict",
    ]
    for junk in ("x]\x1b[2J", "x²", "a½"):  # not peer names (the last two: to the schema, not to Python's re)
        stats.arrivals(
            SimpleNamespace(group_size=3, error=None, group_info=[*infos, {"arrived": 101.9, "name": junk}])
        )
        assert (round(stats.last_round_spread, 3), stats.last_round_last) == (1.9, ""), junk
        PeerHeartbeat.model_validate(
            dict(peer_id="p", name="n", stage="training", outer_step=1, inner_step=0, inner_steps=5, time=0.0)
            | dict(last_round_last=stats.last_round_last)
        )
    stats.arrivals(SimpleNamespace(group_size=3, error=None, group_info=infos))
    assert (round(stats.last_round_spread, 3), stats.last_round_last, stats.last_round_alone) == (
        1.8,
        "b" * 64,
        "",
    )
    stats.arrivals(SimpleNamespace(group_size=1, error="averaging failed: x", group_info=[]))
    assert (stats.last_round_spread, stats.last_round_last, stats.last_round_alone) == (
        0.0,
        "",
        "averaging failed: x",
    )
    PeerHeartbeat.model_validate(
        dict(peer_id="p", name="n", stage="training", outer_step=1, inner_step=0, inner_steps=5, time=0.0)
        | dict(
            last_round_spread=stats.last_round_spread,
            last_round_last=stats.last_round_last,
            last_round_alone=stats.last_round_alone,
        )
    )


def test_one_peer_claiming_a_far_off_round_tells_nothing_and_is_forgotten() -> None:
    monitor = SwarmMonitor()
    monitor.ingest(reading(1.0, hb("a", 1.0, 1), hb("b", 1.0, 1), hb("liar", 1.0, 1)))
    rounds = []
    for t in range(2, 80):
        step = 1 + t // 5  # the honest peers finish a round every 5 s
        pair = dict(group_size=2)  # a new claim each time from the liar:
        beats = [hb("a", t, step, **pair), hb("b", t, step, **pair), hb("liar", t, 10**9 + t, group_size=1)]
        rounds += [
            e.message for e in monitor.ingest(reading(float(t), *beats)).new_events if e.kind == "round"
        ]
    assert rounds and not any("1000000000" in r for r in rounds)
    assert rounds[-1].startswith("round 16: ")  # the honest rounds are told up to the last
    assert len(monitor._seen) <= 64  # claims nobody follows are dropped (after 60 s, beyond 64)


def test_the_swarm_s_round_is_what_half_its_peers_claim_not_the_highest_claim_ever() -> None:
    """One fresh key claiming outer step 10^9 set the round shown everywhere for the monitor's
    lifetime (a running maximum), and every honest peer was shown lagging."""
    monitor = SwarmMonitor()
    honest = [hb(p, 1.0, 7) for p in "abc"]
    snapshot = monitor.ingest(reading(1.0, *honest, hb("liar", 1.0, 10**9)))
    assert snapshot.outer_round == 7 and not snapshot.lagging
    snapshot = monitor.ingest(reading(30.0, *[hb(p, 30.0, 9) for p in "abc"]))  # the liar is gone
    assert snapshot.outer_round == 9
    # A real laggard is still one, in a run of two too (who of two tells the truth is not known).
    snapshot = monitor.ingest(reading(31.0, hb("a", 31.0, 9), hb("b", 31.0, 4)))
    assert snapshot.outer_round == 9 and snapshot.lagging == ["id-b"]


def test_what_the_monitor_keeps_per_peer_goes_with_the_peer(monkeypatch) -> None:
    """Keys are free: a flood of fresh keys, each seen for a moment, must not grow the monitor
    (history, names, departed) or the board's key cache for the rest of the run."""
    from swarm import monitor as monitor_module
    from swarm import progress

    monitor = SwarmMonitor()
    for i in range(3000):  # one new peer a second, each gone at the next reading
        t = float(i)
        monitor.ingest(reading(t, hb("a", t, 1, loss=1.0), hb(f"x{i}", t, 1, loss=2.0)))
    kept = set(monitor._history) | set(monitor._names)
    assert "id-a" in kept and len(kept) <= 3 + monitor_module.DEPARTED_SECONDS, len(kept)
    assert len(monitor.ingest(reading(3000.0, hb("a", 3000.0, 1))).departed) <= monitor_module.MAX_DEPARTED
    kept_points = monitor._history["id-a"]["loss"].points()  # a live peer's history stays, bounded
    assert 256 < len(kept_points) <= 512 and kept_points[0][0] == 0.0  # from its first heartbeat on

    from swarm import identity

    derived = []
    monkeypatch.setattr(identity, "peer_id_of", lambda key: derived.append(key) or f"id-{key}")
    board = progress.ProgressBoard.__new__(progress.ProgressBoard)
    board._peer_ids, board._lock = progress.OrderedDict(), progress.threading.Lock()
    assert board.peer_id_of("k0") == "id-k0"
    for i in range(1, progress.MAX_KEYS + 100):
        board.peer_id_of(f"k{i}")
        board.peer_id_of("k0")  # in use: kept
    assert len(board._peer_ids) == progress.MAX_KEYS and derived.count("k0") == 1
