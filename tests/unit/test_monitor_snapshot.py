"""What the monitor shows when peers pause or its DHT stops answering (no real DHT)."""

from __future__ import annotations

import json
from unittest import mock

import pytest

import swarm.dht
from swarm.errors import SwarmError
from swarm.monitor import Reading, SwarmMonitor
from swarm.progress import ProgressBoard
from swarm.records import HEARTBEAT_TTL, RunKeys, Stage, mate_tag
from tests.ui.fake import heartbeat, peer_id


def tags(ids) -> list[str]:
    return [mate_tag(i) for i in ids]


def test_a_paused_peer_adds_nothing_to_the_swarms_speed() -> None:
    """Stop 57, a review: a paused peer's heartbeat keeps its last round's rate, and the TUI's
    tokens/s (and its sparkline) added it in, where samples/s did not."""
    beats = {
        peer_id(0): heartbeat(0, 1000.0, 3, stage=Stage.TRAINING),
        peer_id(1): heartbeat(1, 1000.0, 3, stage=Stage.PAUSED),
    }
    snapshot = SwarmMonitor().ingest(Reading(1000.0, "r", beats))
    assert snapshot.tokens_per_second == beats[peer_id(0)].tokens_per_second
    assert snapshot.samples_per_second == beats[peer_id(0)].samples_per_second


def test_a_board_whose_dht_stops_answering_lets_its_peers_expire() -> None:
    """Stop 57, a review: the last peers seen were returned for good: a monitor whose DHT had
    stopped answering showed them live 300 s later."""
    clock = [1000.0]

    class Store:
        reads = 0

        def read(self, key, model):
            Store.reads += 1
            if Store.reads > 1:
                raise SwarmError("the DHT did not answer")
            return {"KEY": heartbeat(0, clock[0], 5)}

    board = ProgressBoard(Store(), RunKeys("r"))
    board.peer_id_of = lambda key: peer_id(0)
    with mock.patch.object(swarm.dht, "dht_time", lambda: clock[0]):
        assert list(board.fetch()) == [peer_id(0)]
        clock[0] += 30
        assert list(board.fetch()) == [peer_id(0)]  # within its lifetime (and the clocks' slack)
        clock[0] += 300 + HEARTBEAT_TTL
        assert board.fetch() == {}


def test_the_charts_mean_loss_carries_each_peers_last_value_and_stays_a_few_hundred_points() -> None:
    """Stop 57, a review: computed per peer and per time, it took 0.7-1.8 s a refresh with 200
    peers whose heartbeats come at different times; now one pass in time order."""
    from tui.widgets import MEAN_POINTS, _mean_series

    two = [[(1.0, 1.0), (3.0, 2.0)], [(2.0, 5.0), (3.0, 1.0), (4.0, 0.0)]]
    assert _mean_series(two) == [(2.0, 3.0), (3.0, 1.5), (4.0, 1.0)]  # from when both reported
    many = [[(1000.0 + k + i / 1000, 3.0) for k in range(130)] for i in range(200)]
    mean = _mean_series(many)
    assert len(mean) <= MEAN_POINTS + 1 and mean[-1][0] == max(t for s in many for t, _ in s)
    assert all(v == 3.0 for _, v in mean)


def test_a_peer_flagged_again_after_it_came_back_is_shown_as_ignored_not_dropped() -> None:
    """Most peers flag a liar (ignored, shown as departed), a flagger restarts (no majority: the
    liar is back, "joined again"), then it flags it again: the liar vanished with no row and no
    event, since it had been told once already."""
    monitor, liar = SwarmMonitor(), peer_id(3)

    def read(t: float, flaggers: set[int]):
        beats = {
            peer_id(i): heartbeat(i, t, 5, ignored=({liar: "claimed outer step 99"} if i in flaggers else {}))
            for i in range(4)
        }
        return monitor.ingest(Reading(t, "r", beats))

    read(1000, set())
    assert liar in read(1001, {0, 1, 2}).departed
    assert liar in read(1002, {0, 1}).peers
    again = read(1003, {0, 1, 2})
    assert liar in again.departed and "ignored for lying" in again.departed[liar].how
    assert [e.kind for e in again.new_events if e.peer_id == liar] == ["ignored"]
    assert [e.kind for e in read(1004, {0, 1, 2}).new_events if e.peer_id == liar] == []  # once


def test_fresh_keys_outnumbering_the_honest_peers_cannot_flag_them_out_of_sight(capsys) -> None:
    """Stop 67's list (docs/security.md, Sybils): every live peer's flags counted, so one fresh
    key more than the honest peers, each flagging them all, hid every honest peer from `status`,
    the TUI and the widget. Now only peers linked to the owner's peer by rounds averaged
    together, both sides saying so, vote: the keys naming the honest peers (and each other) as
    round mates link nothing."""
    owner, mate, keys = peer_id(0), peer_id(1), [peer_id(i) for i in range(2, 5)]
    monitor = SwarmMonitor()

    def read(t: float, owner_here: bool = True, **reading):
        beats = {
            owner: heartbeat(
                0, t, 5, averaged_with=tags([mate]), ignored={keys[0]: "never came, 3 rounds running"}
            ),
            mate: heartbeat(
                1, t, 5, averaged_with=tags([owner]), ignored={keys[0]: "never came, 3 rounds running"}
            ),
            **{
                key: heartbeat(
                    i + 2,
                    t,
                    5,
                    averaged_with=tags([owner, mate, *(k for k in keys if k != key)]),
                    ignored={owner: "made up", mate: "made up"},
                )
                for i, key in enumerate(keys)
            },
        }
        if not owner_here:
            del beats[owner]
        return monitor.ingest(Reading(t, "r", beats, **reading))

    snapshot = read(1000, owner_peer=owner)
    assert {owner, mate} <= set(snapshot.peers) and snapshot.flag_voters == sorted([owner, mate])
    assert set(snapshot.ignored) == {keys[0]}  # the voters' own flags count
    from workbench.cli.status import render

    render(json.loads(json.dumps(snapshot.to_json())))
    said = " ".join(capsys.readouterr().out.split())  # (wrapped at the terminal's width)
    assert "flags are counted from 2: the owner's peer and its round mates" in said
    assert (
        snapshot.to_json()["flag_voters"] == sorted([owner, mate])
        and snapshot.to_json()["flags_from"] == "owner"
    )
    # The owner gone, the peers linked to it before still vote (not the keys).
    later = read(1001, owner_here=False)
    assert mate in later.peers and later.flag_voters == [mate] and later.flags_from == "mates"
    # A monitor that never saw the owner's peer cannot tell: every live peer votes, as before.
    blind = SwarmMonitor().ingest(Reading(1002, "r", {p: b for p, b in later.peers.items() if p != owner}))
    assert sorted(blind.flag_voters) == sorted([mate, *keys[1:]]) and blind.to_json()["flags_from"] == "all"


def test_a_vote_needs_a_round_with_the_owners_peer_by_both_sides_word() -> None:
    from swarm.monitor import owners_mates

    beats = {
        peer_id(0): heartbeat(0, 1000, 5, averaged_with=tags([peer_id(1), peer_id(4)])),
        peer_id(1): heartbeat(1, 1000, 5, averaged_with=tags([peer_id(0), peer_id(2)])),
        peer_id(2): heartbeat(2, 1000, 5, averaged_with=tags([peer_id(1)])),  # the owner's mate's mate
        peer_id(3): heartbeat(3, 1000, 5, averaged_with=tags([peer_id(0), peer_id(1)])),  # one-sided
        peer_id(4): heartbeat(4, 1000, 5),  # named by the owner's peer, naming nobody
    }
    assert owners_mates(peer_id(0), beats) == {peer_id(1)}
    assert owners_mates("gone", beats) == set() and owners_mates(None, beats) == set()


def test_a_key_that_averaged_once_cannot_bring_fresh_keys_in_to_vote() -> None:
    """A review (stop 68) of the first version, which followed links from mate to mate: a key
    R that averaged once with an honest peer named five fresh keys that named it back, and the
    seven outvoted the honest pair, the owner's own peer hidden too. Now only the owner's peer
    and its own round mates vote, and the owner's peer is never hidden by flags."""
    owner, honest, r = peer_id(0), peer_id(1), peer_id(2)
    fresh = [peer_id(i) for i in range(3, 8)]
    lie = {owner: "made up", honest: "made up"}
    beats = {
        owner: heartbeat(0, 1000, 5, averaged_with=tags([honest])),
        honest: heartbeat(1, 1000, 5, averaged_with=tags([owner, r])),
        r: heartbeat(2, 1000, 5, averaged_with=tags([honest, *fresh]), ignored=lie),
        **{
            k: heartbeat(3 + i, 1000, 5, averaged_with=tags([r, *fresh]), ignored=lie)
            for i, k in enumerate(fresh)
        },
    }
    snapshot = SwarmMonitor().ingest(Reading(1000, "r", beats, owner_peer=owner))
    assert {owner, honest} <= set(snapshot.peers) and snapshot.flag_voters == sorted([owner, honest])
    # A key that averaged with the owner's peer itself votes, but cannot hide it.
    beats[owner] = heartbeat(0, 1000, 5, averaged_with=tags([honest, r]))
    beats[r] = heartbeat(2, 1000, 5, averaged_with=tags([owner, *fresh]), ignored=lie)
    beats[honest] = heartbeat(1, 1000, 5, averaged_with=tags([owner]), ignored={r: "never came"})
    snapshot = SwarmMonitor().ingest(Reading(1000, "r", beats, owner_peer=owner))
    assert owner in snapshot.peers and snapshot.flag_voters == sorted([owner, honest, r])


def test_the_owners_mates_are_remembered_while_they_live_not_replaced() -> None:
    """A review (stop 68): the first version replaced its memory with each reading's voters, so
    one reading of the owner's peer naming nobody (restarted) left the owner alone in it, and
    once it left every live peer voted again: three keys hid the honest pair."""
    owner, mates, keys = peer_id(0), [peer_id(1), peer_id(2)], [peer_id(i) for i in range(3, 6)]
    monitor = SwarmMonitor()

    def read(t: float, owner_names: list[str] | None):
        beats = {m: heartbeat(i + 1, t, 5, averaged_with=tags([owner])) for i, m in enumerate(mates)}
        beats.update(
            {k: heartbeat(3 + i, t, 5, ignored=dict.fromkeys(mates, "made up")) for i, k in enumerate(keys)}
        )
        if owner_names is not None:
            beats[owner] = heartbeat(0, t, 5, averaged_with=tags(owner_names))
        return monitor.ingest(Reading(t, "r", beats, owner_peer=owner if owner_names is not None else None))

    assert read(1000, mates).flag_voters == sorted([owner, *mates])
    assert read(1001, []).flag_voters == sorted([owner, *mates])  # restarted: names nobody yet
    gone = read(1002, None)
    assert gone.flag_voters == sorted(mates) and set(mates) <= set(gone.peers)
    # Forgotten once they have not been seen for as long as departed peers are shown.
    from swarm.narration import DEPARTED_SECONDS

    monitor.ingest(Reading(1003, "r", {k: heartbeat(3, 1003, 5) for k in keys[:1]}))
    later = monitor.ingest(
        Reading(1004 + DEPARTED_SECONDS, "r", {k: heartbeat(3, 1004 + DEPARTED_SECONDS, 5) for k in keys[:1]})
    )
    assert later.flag_voters == [keys[0]]  # nobody remembered is live: every live peer votes


def test_a_readings_owner_peer_survives_a_recording_and_a_bad_one_is_refused() -> None:
    reading = Reading(1000.0, "r", {peer_id(0): heartbeat(0, 1000.0, 5)}, owner_peer=peer_id(0))
    assert Reading.from_json(json.loads(json.dumps(reading.to_json()))).owner_peer == peer_id(0)
    old = {k: v for k, v in reading.to_json().items() if k != "owner_peer"}  # an earlier recording
    assert Reading.from_json(old).owner_peer is None
    with pytest.raises(ValueError, match="owner_peer"):
        Reading.from_json({**reading.to_json(), "owner_peer": "[/b]"})


def test_a_heartbeat_names_its_latest_round_mates_and_no_struck_one() -> None:
    from swarm.claims import MAX_MATES, STRIKES, Vouching

    vouching = Vouching()
    for round_ in range(MAX_MATES + 1):
        vouching.averaged_with(["me", f"m{round_}"], me="me")
    vouching.averaged_with(["me", "m3"], me="me")  # again: most recent
    assert list(vouching.mates)[-2:] == [f"m{MAX_MATES}", "m3"] and len(vouching.mates) == MAX_MATES
    assert "m0" not in vouching.mates  # the oldest forgotten
    for step in range(STRIKES):
        vouching.strike("m3", step)
    assert "m3" not in vouching.mates


def test_in_a_big_group_two_members_name_each_other_or_neither() -> None:
    """A review (stop 68): every member kept the last 16 of hivemind's member order, the same
    for all, so in a group of 24 the first 8 were named by nobody (the owner's peer among them
    in 19 of 50 rounds: it voted alone). Now the 8 either side of each member by id."""
    from swarm.claims import MAX_MATES, Vouching

    group = [f"p{k:02d}" for k in range(30)]
    named = {}
    for me in group:
        vouching = Vouching()
        vouching.averaged_with(group[::-1], me=me)
        named[me] = set(vouching.mates)
        assert len(named[me]) == MAX_MATES and me not in named[me]
    assert all((b in named[a]) == (a in named[b]) for a in group for b in group)
    small = Vouching()
    small.averaged_with(group[:5], me="p00")
    assert list(small.mates) == group[1:5]


def test_a_heartbeat_names_its_mates_in_twelve_characters_each() -> None:
    """Tags, not peer ids: 16 ids doubled a heartbeat (765 -> 1,631 bytes), read by every board
    read of every peer and monitor."""
    import msgpack
    from pydantic import ValidationError

    ids = [f"12D3KooW{k:044d}" for k in range(16)]
    assert len({mate_tag(i) for i in ids}) == 16 and all(len(mate_tag(i)) == 20 for i in ids)
    plain = len(msgpack.packb(heartbeat(0, 1000.0, 5).model_dump(mode="json")))
    full = len(msgpack.packb(heartbeat(0, 1000.0, 5, averaged_with=tags(ids)).model_dump(mode="json")))
    assert full - plain < 16 * 22
    # An entry that is not a tag (a whole peer id, another release's form) is dropped, not the
    # heartbeat (a review: the whole peer vanished from every board read).
    assert heartbeat(0, 1000.0, 5, averaged_with=[ids[0], *tags(ids[1:3])]).averaged_with == tags(ids[1:3])
    with pytest.raises(ValidationError):
        heartbeat(0, 1000.0, 5, averaged_with=tags(ids) * 2)  # 32: over the bound


def test_a_tag_two_live_peers_share_counts_for_neither(monkeypatch) -> None:
    """A review (stop 68): a pair of keys made to share a tag (72 bits then: a birthday search of
    2^36), one of them a real round mate of the owner's peer, brought the other in to vote."""
    import swarm.monitor

    owner, mate, twin = peer_id(0), peer_id(1), peer_id(2)
    real = swarm.monitor.mate_tag
    monkeypatch.setattr(swarm.monitor, "mate_tag", lambda pid: real(mate) if pid == twin else real(pid))
    beats = {
        owner: heartbeat(0, 1000, 5, averaged_with=tags([mate])),
        mate: heartbeat(1, 1000, 5, averaged_with=tags([owner])),
        twin: heartbeat(2, 1000, 5, averaged_with=tags([owner])),
    }
    assert swarm.monitor.owners_mates(owner, beats) == set()
    del beats[twin]
    assert swarm.monitor.owners_mates(owner, beats) == {mate}


def test_a_monitor_that_never_saw_the_owners_peer_counts_the_peers_it_joined_through(capsys) -> None:
    """Stop 68's list (docs/security.md, Sybils): a one-shot `status` after the owner's peer
    left counted every live peer's flags, and three fresh keys flagging an honest pair hid it
    again. Now the peers its user joined through (``anchors``) and their round mates, both
    sides saying so, vote; an anchor is never hidden by flags; a key naming the anchor as its
    mate, unnamed by it, is no voter."""
    from workbench.cli.status import render

    a, b, keys = peer_id(0), peer_id(1), [peer_id(i) for i in range(2, 5)]
    flags = {a: "made up", b: "made up"}
    beats = {
        a: heartbeat(0, 1000, 5, averaged_with=tags([b])),
        b: heartbeat(1, 1000, 5, averaged_with=tags([a]), ignored={keys[0]: "claimed outer step 99"}),
        **{
            key: heartbeat(i + 2, 1000, 5, averaged_with=tags([a, b, *keys]), ignored=flags)
            for i, key in enumerate(keys)
        },
    }
    blind = SwarmMonitor().ingest(Reading(1000, "r", beats))  # the old way: the keys win
    assert blind.flags_from == "all" and not {a, b} & set(blind.peers)

    for anchors in [(a,), (b, peer_id(9)), (peer_id(9), a)]:  # a gone peer in the list: no matter
        snapshot = SwarmMonitor().ingest(Reading(1000, "r", beats, anchors=anchors))
        assert snapshot.flags_from == "joined" and snapshot.flag_voters == sorted([a, b]), anchors
        assert {a, b} <= set(snapshot.peers) and set(snapshot.ignored) == set(), anchors
        # (b's flag on keys[0] is one vote of two: not most)

    # An anchor alone (no mates) is not hidden by every key flagging it, and its flags count.
    alone = {k: v for k, v in beats.items() if k != b}
    alone[a] = heartbeat(0, 1000, 5, ignored={keys[1]: "claimed outer step 99"})
    snapshot = SwarmMonitor().ingest(Reading(1000, "r", alone, anchors=(a,)))
    assert snapshot.flag_voters == [a] and a in snapshot.peers and set(snapshot.ignored) == {keys[1]}
    render(json.loads(json.dumps(snapshot.to_json())))
    said = " ".join(capsys.readouterr().out.split())  # (wrapped at the terminal's width)
    assert "counted from 1: the peers given on the command line and their round mates" in said
    # Its own mates flagging it cannot hide it either (a review: nothing tested that).
    mates = [peer_id(i) for i in (5, 6)]
    flagged = {
        a: heartbeat(0, 1000, 5, averaged_with=tags(mates)),
        **{
            m: heartbeat(i + 5, 1000, 5, averaged_with=tags([a]), ignored={a: "made up"})
            for i, m in enumerate(mates)
        },
    }
    snapshot = SwarmMonitor().ingest(Reading(1000, "r", flagged, anchors=(a,)))
    assert snapshot.flag_voters == sorted([a, *mates]) and a in snapshot.peers and not snapshot.ignored
    # Nor can an owner's peer and its mates: without --owner the oldest manifest names the
    # owner, and a back-dated one made an attacker "the owner" (a review, stop 69).
    fake, fakes = peer_id(7), keys
    beats_of_a_fake_owner = {
        a: heartbeat(0, 1000, 5),
        fake: heartbeat(7, 1000, 5, averaged_with=tags(fakes), ignored={a: "made up"}),
        **{
            k: heartbeat(i + 2, 1000, 5, averaged_with=tags([fake]), ignored={a: "made up"})
            for i, k in enumerate(fakes)
        },
    }
    snapshot = SwarmMonitor().ingest(Reading(1000, "r", beats_of_a_fake_owner, owner_peer=fake, anchors=(a,)))
    assert snapshot.flags_from == "owner" and len(snapshot.flag_voters) == 4 and a in snapshot.peers
    # The owner's peer, when there, outranks the anchors as voters: a key given on the command
    # line votes with nobody's support.
    snapshot = SwarmMonitor().ingest(Reading(1000, "r", beats, owner_peer=a, anchors=(keys[0],)))
    assert snapshot.flags_from == "owner" and snapshot.flag_voters == sorted([a, b])
    # A monitor that remembers the owner's mates keeps them over its anchors.
    monitor = SwarmMonitor()
    monitor.ingest(Reading(1000, "r", beats, owner_peer=a))
    later = monitor.ingest(Reading(1001, "r", {k: v for k, v in beats.items() if k != a}, anchors=(keys[0],)))
    assert later.flags_from == "mates" and later.flag_voters == [b] and b in later.peers


def test_a_watching_monitor_remembers_its_anchors_round_mates_after_the_anchor_left() -> None:
    """A review (stop 69): the anchors' mates were not remembered as the owner's are, so a TUI
    whose anchor left fell back to every live peer voting, and the keys hid the anchor's mate."""
    a, b, keys = peer_id(0), peer_id(1), [peer_id(i) for i in range(2, 5)]
    beats = {
        a: heartbeat(0, 1000, 5, averaged_with=tags([b])),
        b: heartbeat(1, 1000, 5, averaged_with=tags([a])),
        **{
            k: heartbeat(i + 2, 1000, 5, averaged_with=tags([a, b]), ignored={a: "made up", b: "made up"})
            for i, k in enumerate(keys)
        },
    }
    monitor = SwarmMonitor()
    assert monitor.ingest(Reading(1000, "r", beats, anchors=(a,))).flag_voters == sorted([a, b])
    gone = {k: v for k, v in beats.items() if k != a}
    later = monitor.ingest(Reading(1001, "r", gone, anchors=(a,)))
    assert later.flags_from == "joined" and later.flag_voters == [b] and b in later.peers
    assert b not in SwarmMonitor().ingest(Reading(1001, "r", gone, anchors=(a,))).peers  # a fresh one: all
    # Forgotten 5 minutes after it was last seen live, as the owner's mates are.
    absent = {k: v for k, v in gone.items() if k != b}
    monitor.ingest(Reading(1400, "r", {k: v.model_copy(update={"time": 1400}) for k, v in absent.items()}))
    back = monitor.ingest(
        Reading(1401, "r", {k: v.model_copy(update={"time": 1401}) for k, v in gone.items()})
    )
    assert back.flags_from == "all"


def test_a_readings_anchors_survive_a_recording_and_bad_ones_are_refused() -> None:
    reading = Reading(1000.0, "r", {peer_id(0): heartbeat(0, 1000.0, 5)}, anchors=(peer_id(0), peer_id(1)))
    again = Reading.from_json(json.loads(json.dumps(reading.to_json())))
    assert again.anchors == (peer_id(0), peer_id(1))
    old = {k: v for k, v in reading.to_json().items() if k != "anchors"}  # an earlier recording
    assert Reading.from_json(old).anchors == ()
    for bad in ["[/b]", [1], ["[/b]"], [peer_id(0)] * 65, "", 0, False, {}]:
        with pytest.raises(ValueError, match="anchors"):
            Reading.from_json({**reading.to_json(), "anchors": bad})


def test_the_peers_a_view_joins_through_are_its_anchors() -> None:
    """`status`, `workbench monitor` and the notebook's view hand the monitor the peer ids of
    the multiaddrs they join through."""
    from swarm.addresses import AddressError, peer_ids

    first, second = (
        "QmXyzB8iV6WGF5CqH3HbXiFNPbYcvMk1pW6uDSpBX3mJ5U",
        "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
    )
    one = f"/ip4/127.0.0.1/tcp/31337/p2p/{first}"
    assert peer_ids([one, f"/dns/example.org/tcp/4/p2p/{second}", one]) == [first, second]
    # Through a relay: the peer after it, not the relay (a review).
    assert peer_ids([f"{one}/p2p-circuit/p2p/{second}"]) == [second]
    with pytest.raises(AddressError, match="lacks the peer id"):
        peer_ids(["/ip4/127.0.0.1/tcp/31337"])
