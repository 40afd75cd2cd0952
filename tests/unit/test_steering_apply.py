"""workbench.run.control.Steering: when a peer applies the owner's versions, and which checkpoint
requests it serves, also after a resume (no real DHT: the watcher hands out ControlStates)."""

from __future__ import annotations

from typing import Any

from swarm.records import ControlState, RunKeys
from workbench.run.control import Steering


class Watcher:
    def __init__(self) -> None:
        self.control: ControlState | None = None

    def poll(self, force: bool = False) -> ControlState | None:
        return self.control


class Outer:
    outer_step_count = 10

    def retune(self, **settings: Any) -> dict[str, Any]:
        return {k: v for k, v in settings.items() if v is not None}


def steering(watcher: Watcher, written: list[dict[str, Any]], *, joiner: bool = False) -> Steering:
    """A Steering whose checkpoints record what the peer would save with them."""
    s: Steering

    def checkpoint() -> str:
        written.append(dict(version=s.version, checkpoints=s.checkpoints, settings=dict(s.settings)))
        return f"checkpoint-{len(written)}.pt"

    s = Steering(
        watcher, name="a", peer_id="QmA", joiner=joiner,
        emit=lambda *a, **k: None, publish=lambda: None, beat=lambda stage: None, checkpoint=checkpoint,
    )  # fmt: skip
    return s


def test_a_steered_checkpoint_holds_the_version_and_settings_that_asked_for_it() -> None:
    watcher, written = Watcher(), []
    peer = steering(watcher, written)
    watcher.control = ControlState(version=1, outer_lr=0.35)
    peer.apply(Outer(), data_parallel=False)
    watcher.control = ControlState(version=2, outer_lr=0.35, inner_steps=4, checkpoint=1)
    peer.apply(Outer(), data_parallel=False)
    assert written == [dict(version=2, checkpoints=1, settings={"outer_lr": 0.35, "inner_steps": 4})]


def test_a_peer_resumed_from_a_steered_checkpoint_does_not_write_it_again() -> None:
    """The checkpoint's version and request count come back: the version that asked for it is not
    applied twice (before, the resumed peer wrote a checkpoint at once); a newer request is served."""
    watcher, written = Watcher(), []
    watcher.control = ControlState(version=2, outer_lr=0.35, inner_steps=4, checkpoint=1)
    peer = steering(watcher, written)
    peer.restore(2, {"outer_lr": 0.35, "inner_steps": 4}, Outer(), checkpoints=1)
    peer.apply(Outer(), data_parallel=False)
    watcher.control = ControlState(version=3, outer_lr=0.5, checkpoint=1)  # a new lr, no new request
    peer.apply(Outer(), data_parallel=False)
    assert written == [] and peer.version == 3 and peer.settings["outer_lr"] == 0.5
    watcher.control = ControlState(version=4, outer_lr=0.5, checkpoint=2)
    peer.apply(Outer(), data_parallel=False)
    assert written == [dict(version=4, checkpoints=2, settings={"outer_lr": 0.5, "inner_steps": 4})]


def test_a_data_parallel_peer_refuses_a_change_of_outer_lr_h_or_codec_and_applies_the_rest_later() -> None:
    """On a data-parallel run the owner's `steer --outer-lr` printed "1/1 peers applied" and
    exited 0; the peer logged "ignored", and every later version (carrying the value) said it
    again (a review, stop 71). A version that changes them is refused whole, so `steer` says
    so; a later one carrying the same values applies (a checkpoint request)."""
    watcher, written = Watcher(), []
    peer = steering(watcher, written)
    watcher.control = ControlState(version=1, outer_lr=0.2, round_seconds=30.0)
    peer.apply(Outer(), data_parallel=True)
    assert peer.refused[0] == 1 and "data-parallel" in peer.refused[1]
    assert peer.round_seconds is None  # nothing of it
    v1 = ControlState(version=1, outer_lr=0.2, round_seconds=30.0)
    watcher.control = ControlState(version=2, outer_lr=0.2, checkpoint=1, earlier=[v1.step()])
    peer.apply(Outer(), data_parallel=True)
    assert peer.version == 2 and peer.refused[0] == 1 and len(written) == 1
    # A joiner (or a resumed peer) reading v2 first: it carries v1's lr, changes none (a review
    # of the first version, which refused it, dropping the owner's checkpoint request).
    joiner, joined = steering(watcher, [], joiner=False), []
    joiner.checkpoint = lambda: joined.append(1) or "checkpoint.pt"
    joiner.apply(Outer(), data_parallel=True)
    assert joiner.version == 2 and joiner.refused == (0, "") and joined == [1]


def test_a_checkpoint_refused_while_a_round_averages_is_written_at_a_later_round() -> None:
    """The peer's checkpoint is refused while an overlapped round still averages (it returns
    None): the request was used up unwritten. It is now tried again at each round boundary."""
    watcher, written, refusals = Watcher(), [], [2]
    peer: Steering

    def checkpoint() -> str | None:
        if refusals[0]:
            refusals[0] -= 1
            return None
        written.append(dict(version=peer.version, checkpoints=peer.checkpoints))
        return "checkpoint.pt"

    peer = Steering(
        watcher, name="a", peer_id="QmA", joiner=False,
        emit=lambda *a, **k: None, publish=lambda: None, beat=lambda stage: None, checkpoint=checkpoint,
    )  # fmt: skip
    watcher.control = ControlState(version=1, checkpoint=1)
    peer.apply(Outer(), data_parallel=False)
    assert written == [] and peer.checkpoints == 0 and peer.owed == 1 and peer.version == 1
    peer.apply(Outer(), data_parallel=False)  # still refused
    assert written == [] and peer.owed == 1
    peer.apply(Outer(), data_parallel=False)
    assert written == [dict(version=1, checkpoints=1)] and peer.owed == 0
    peer.apply(Outer(), data_parallel=False)
    assert len(written) == 1  # once
    # A peer without a --run-dir can never write one: the request is not retried every round.
    calls: list[int] = []
    nowhere = Steering(
        watcher, name="b", peer_id="QmB", joiner=False, can_checkpoint=False,
        emit=lambda *a, **k: None, publish=lambda: None, beat=lambda stage: None,
        checkpoint=lambda: calls.append(1),
    )  # fmt: skip
    for _ in range(3):
        nowhere.apply(Outer(), data_parallel=False)
    assert calls == [1] and nowhere.owed == 0


def test_a_joiner_does_not_serve_requests_made_before_it_came() -> None:
    watcher, written = Watcher(), []
    watcher.control = ControlState(version=5, checkpoint=3)
    peer = steering(watcher, written, joiner=True)
    peer.apply(Outer(), data_parallel=False)
    assert written == [] and peer.version == 5
    watcher.control = ControlState(version=6, checkpoint=4)
    peer.apply(Outer(), data_parallel=False)
    assert [w["checkpoints"] for w in written] == [4]


def test_a_joiner_serves_a_request_not_due_when_it_came() -> None:
    """`steer --checkpoint` due at step 12, a joiner landing at step 11: it took the newest
    version's request count as served and never wrote it (a review, stop 59)."""
    watcher, written = Watcher(), []
    old = ControlState(version=5, checkpoint=3, from_step=4)
    watcher.control = ControlState(version=6, checkpoint=4, from_step=12, earlier=[old.step()])
    peer = steering(watcher, written, joiner=True)
    outer = Outer()
    outer.outer_step_count = 11
    peer.apply(outer, data_parallel=False)  # version 5 is due: its requests are old
    assert written == [] and peer.version == 5 and peer.checkpoints == 3
    outer.outer_step_count = 12
    peer.apply(outer, data_parallel=False)
    assert [w["checkpoints"] for w in written] == [4] and peer.version == 6
    # Nothing due yet, the whole history kept (version 1 first): every request is still to come.
    watcher.control = ControlState(
        version=2, checkpoint=1, from_step=30, earlier=[ControlState(version=1, from_step=25).step()]
    )
    late = steering(watcher, written := [], joiner=True)
    outer.outer_step_count = 20
    late.apply(outer, data_parallel=False)
    outer.outer_step_count = 30
    late.apply(outer, data_parallel=False)
    assert [w["checkpoints"] for w in written] == [1]


def test_a_paused_peer_answers_a_joiner_asking_for_its_adamw_state_at_once() -> None:
    """A paused trainer reaches no step boundary: a joiner's request for AdamW's state waited
    5 s for one. The pause's idle loop is a boundary now."""
    import threading
    import time

    import torch

    from optim.state import InnerStateCopies

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    copies = InnerStateCopies(optimizer, wait=30.0)
    copies.boundary()  # this thread trains
    watcher = Watcher()
    watcher.control = ControlState(version=1, paused=["a"])
    peer = steering(watcher, [])
    got = []
    asker = threading.Thread(target=lambda: got.append(copies.take()))
    asker.start()
    threading.Timer(1.0, lambda: setattr(watcher, "control", ControlState(version=2))).start()  # resumed
    start = time.monotonic()
    paused = peer.wait_while_paused(10, None, copies.boundary)
    asker.join(5)
    assert 0.9 <= paused < 5.0  # the seconds paused: the round's time and rate leave them out
    assert got and len(got[0][1]) == 6, got  # 2 moments and a step, for the weight and the bias
    assert time.monotonic() - start < 5.0


def test_a_heartbeat_claiming_to_be_far_ahead_does_not_put_steering_out_of_reach() -> None:
    """The default step (and the --from-step check) followed the most advanced claim: one fresh
    key claiming outer step 10^9 made every change wait for step 10^9 + 2, and refused any
    --from-step the owner could give. The run's step is the upper median of the claims now,
    peers still joining (step 0 until their download lands) and paused ones left out."""
    import time

    import pytest

    from swarm.errors import SwarmError
    from swarm.identity import key_hash
    from swarm.records import PeerHeartbeat, Stage
    from swarm.steering import Steering

    class Store:
        public_key = "the owner's key"
        stored: list = []

        def read(self, key, schema):
            return {}

        def store(self, key, value, **options):
            self.stored.append(value)
            return True

    def beat(peer: str, step: int, stage: Stage = Stage.TRAINING) -> PeerHeartbeat:
        return PeerHeartbeat(
            peer_id=peer, name=peer[-4:], stage=stage, outer_step=step, inner_step=0, inner_steps=5,
            loss=1.0, samples_per_second=1.0, bytes_sent=0, bytes_received=0, device="cpu", time=time.time(),
        )  # fmt: skip

    class Board:
        peers = {
            "QmHonestA": beat("QmHonestA", 40),
            "QmHonestB": beat("QmHonestB", 41),
            "QmLiar": beat("QmLiar", 10**9),
            "QmJoining": beat("QmJoining", 0, Stage.DOWNLOADING),
            **{f"QmPaused{i}": beat(f"QmPaused{i}", 10, Stage.PAUSED) for i in range(3)},  # standing still
        }

        def fetch(self):
            return dict(self.peers)

    store = Store()
    steering = Steering(store, RunKeys("r"), owner=key_hash(Store.public_key), board=Board())
    assert steering.publish(outer_lr=0.5).from_step == 43
    assert steering.publish(outer_lr=0.4, from_step=45).from_step == 45
    with pytest.raises(SwarmError, match="use --from-step 43 or later"):
        steering.publish(outer_lr=0.3, from_step=41)


def test_a_change_is_not_scheduled_at_step_2_when_no_peer_says_where_the_run_is():
    """With every live peer joining or downloading (or none left), the run's step was
    taken as 0: a change "two rounds ahead" was published for outer step 2 of a run at step
    1127, and each peer applied it at its own next round. Now it is refused, unless the owner
    gives the step."""
    from types import SimpleNamespace

    import pytest

    from swarm.errors import SwarmError
    from swarm.records import PeerHeartbeat, Stage
    from swarm.steering import Steering

    stored = []
    steering = Steering.__new__(Steering)
    steering.owner = steering.key = "owner"
    steering.keys = SimpleNamespace(control="control")
    steering.store = SimpleNamespace(store=lambda key, value, **kwargs: stored.append(value) or True)
    steering.watcher = SimpleNamespace(poll=lambda force, strict=False: None, latest=None)
    beat = PeerHeartbeat(
        peer_id="d", name="d", stage=Stage.DOWNLOADING, outer_step=1127, inner_step=0, inner_steps=5, time=1.0
    )
    for peers in ({"d": beat}, {}):
        steering.board = SimpleNamespace(fetch=lambda peers=peers: peers)
        with pytest.raises(SwarmError, match="cannot tell the run's outer step"):
            steering.publish(outer_lr=0.5)
    assert not stored
    assert steering.publish(outer_lr=0.5, from_step=1130).from_step == 1130
    # Every peer paused: nothing trains, so the run stands where they do. A resume was refused
    # for want of a step, and the TUI's form, which has no --from-step, could never resume them.
    paused = {
        p: beat.model_copy(update={"peer_id": p, "name": p, "stage": Stage.PAUSED, "outer_step": 40})
        for p in ("a", "b")
    }
    steering.board = SimpleNamespace(fetch=lambda: paused)
    steering.watcher.poll = lambda force, strict=False: stored[-1]
    resumed = steering.publish(outer_lr=0.4, resume=["a"])
    assert resumed.paused == [] and resumed.from_step == max(42, 1130), resumed
    steering.watcher.poll = lambda force, strict=False: None
    assert steering.publish(outer_lr=0.4, resume=["a"]).from_step == 42


def test_a_peer_that_first_reads_the_next_version_applies_the_one_before_at_its_own_step() -> None:
    """Stop 57, a review: the record held the newest version only. The owner set outer lr 0.5
    from step 10 (v2), then asked for a checkpoint from step 12 (v3); a peer that read the
    record only after v3 applied v2's lr at step 12, and for rounds 10 and 11 it stepped θ with
    another outer lr than the others. Now v3 keeps v2 in ``earlier``."""
    from swarm.steering import Steering as Publisher

    stored: list[ControlState] = []
    publisher = _publisher(stored, {"a": _beat("a", 9)})
    publisher.publish(outer_lr=0.5, from_step=10)
    publisher.publish(checkpoint=True, from_step=12)
    assert isinstance(publisher, Publisher) and [v.version for v in stored[-1].earlier] == [1]
    watcher, written = Watcher(), []
    peer = steering(watcher, written)
    watcher.control = stored[-1]
    outer = Outer()
    lrs = []
    for step in (9, 10, 11, 12):
        outer.outer_step_count = step
        peer.apply(outer, data_parallel=False)
        lrs.append(peer.settings.get("outer_lr"))
    assert lrs == [None, 0.5, 0.5, 0.5] and peer.version == 2 and len(written) == 1


def _beat(peer_id: str, step: int, *, version: int = 0):
    from swarm.records import PeerHeartbeat, Stage

    return PeerHeartbeat(
        peer_id=peer_id, name=peer_id, stage=Stage.TRAINING, outer_step=step, inner_step=0,
        inner_steps=5, time=1.0, control_version=version,
    )  # fmt: skip


def _publisher(stored: list, peers: dict, *, writers: dict | None = None, read=None):
    """The owner's side on a fake store: what it stores goes to ``stored`` and is read back."""
    from types import SimpleNamespace

    from swarm.steering import Steering as Publisher

    publisher = Publisher.__new__(Publisher)
    publisher.owner = publisher.key = "owner"
    publisher.keys = SimpleNamespace(control="control")
    publisher.store = SimpleNamespace(store=lambda key, value, **kwargs: stored.append(value) or True)

    def poll(force=False, strict=False):
        if read is not None:
            return read(strict)
        return stored[-1] if stored else None

    publisher.watcher = SimpleNamespace(poll=poll, latest=None)
    publisher.board = SimpleNamespace(fetch=lambda: peers, writers=writers or {})
    return publisher


def test_fresh_keys_cannot_move_a_change_out_of_reach_or_to_each_peers_next_round() -> None:
    """Stop 57, a review: the step a change applies at was the upper median of every live claim,
    strangers' included: 4 fresh keys claiming step 10^9 against 3 honest peers at 1127 put
    every change out of reach (and refused every --from-step); claiming 0, they had it published
    for step 2, which each peer applied at its own next round. The owner's own peer (its
    heartbeat signed with the owner's key) now says where the run is."""
    honest = {p: _beat(p, 1127) for p in ("owner-peer", "b", "c")}
    for claim in (10**9, 0):
        sybils = {f"s{i}": _beat(f"s{i}", claim) for i in range(4)}
        stored: list = []
        publisher = _publisher(stored, {**honest, **sybils}, writers={"owner-peer": "owner"})
        assert publisher.publish(outer_lr=0.5).from_step == 1129
        assert publisher.publish(inner_steps=20, from_step=1130).from_step == 1130
    # Without a peer of the owner's live, the median of the claims (docs/security.md).
    assert _publisher([], {**honest, "s": _beat("s", 10**9)}).publish(outer_lr=0.5).from_step == 1129


def test_a_steering_record_the_dht_does_not_answer_for_is_not_overwritten_by_version_1() -> None:
    """Stop 57, a review: a read that timed out was taken as "no record": the owner stored
    version 1, which every peer past it ignored (and its pause list was dropped)."""
    import pytest

    from swarm.errors import SwarmError

    def timed_out(strict):
        assert strict
        raise SwarmError("the DHT did not answer a read of control within 10 s")

    stored: list = []
    peers = {p: _beat(p, 50, version=7) for p in ("a", "b", "c")}
    with pytest.raises(SwarmError, match="could not read the run's steering record .* nothing was changed"):
        _publisher(stored, peers, read=timed_out).publish(outer_lr=0.5)
    with pytest.raises(SwarmError, match="could not read"):
        _publisher(stored, peers, read=timed_out).pause("a")
    assert not stored
    # A record the DHT lost for good (read, and nothing there): numbered past the peers' versions.
    assert _publisher(stored, peers).publish(outer_lr=0.5).version == 8


def test_the_owners_peer_stores_the_manifest_and_the_steering_record_again(monkeypatch) -> None:
    """Stop 57, a review: both were stored once (the manifest at the start, the steering record
    at each steer): after their 7 days, or once the DHT nodes holding them left, the owner could
    not steer and joiners went unchecked. The steering record keeps its publisher's expiration
    (a later one would hide a newer version stored meanwhile) until half of it is gone."""
    from types import SimpleNamespace

    import hivemind.utils

    from swarm.identity import key_hash
    from swarm.records import RunManifest
    from swarm.steering import CONTROL_TTL
    from workbench.run import peer as peer_module

    clock = [1000.0]
    monkeypatch.setattr(hivemind.utils, "get_dht_time", lambda: clock[0])
    monkeypatch.setattr(peer_module, "RECORDS_REFRESH", 0.0)
    stored = []
    owner_key = b"owner's public key"
    manifest = RunManifest(run_id="r", owner=key_hash(owner_key), fingerprint="ab" * 8, created=1.0)
    control = ControlState(version=3, outer_lr=0.5, time=900.0)
    peer = SimpleNamespace(
        manifest=manifest, name="p", _records_kept=0.0, _control_kept=(0, 0.0),
        keys=SimpleNamespace(manifest="m", control="c"),
        store=SimpleNamespace(public_key=owner_key, store=lambda key, record, ttl: stored.append((key, record, ttl))),
        steering=SimpleNamespace(watcher=SimpleNamespace(latest=control)),
    )  # fmt: skip
    peer_module.Peer._keep_records(peer)
    assert [(k, r) for k, r, _ in stored] == [("m", manifest), ("c", control)]
    assert stored[1][2] == 900.0 + CONTROL_TTL - 1000.0  # its publisher's expiration
    clock[0] = 900.0 + CONTROL_TTL * 0.6
    stored.clear()
    peer_module.Peer._keep_records(peer)
    assert stored[1][2] == CONTROL_TTL  # past half of it: a new one
    stored.clear()
    peer.store.public_key = b"somebody else"  # not the owner: stores nothing
    peer_module.Peer._keep_records(peer)
    assert stored == []


def test_a_forged_steering_version_cannot_number_the_owners_change_past_what_heartbeats_may_say() -> None:
    """Stop 57, a review of the diff: with no record found, the version followed the peers'
    median (two peers: the larger), and one key claiming 2**53 had the owner publish a version
    that every honest peer applying it then carried in a heartbeat taken for a lie."""
    from swarm.claims import implausible

    forged = _beat("forged", 42, version=2**53)
    honest = _beat("honest", 42, version=0)
    control = _publisher([], {"forged": forged, "honest": honest}).publish(outer_lr=0.5)
    applied = honest.model_copy(update={"control_version": control.version})
    assert implausible(applied, now=applied.time) is None
    # The owner's own peer restarted without its checkpoint (at version 0) does not pull the
    # version below the others'.
    peers = {p: _beat(p, 50, version=7) for p in ("b", "c")} | {"o": _beat("o", 50, version=0)}
    assert _publisher([], peers, writers={"o": "owner"}).publish(outer_lr=0.5).version == 8


def test_a_pause_from_a_ui_changes_the_record_as_it_is_when_published() -> None:
    """Stop 57, a review: the TUI's form (and the widget) sent the whole paused list as the last
    poll showed it: a pause made meanwhile (from the CLI) was dropped."""
    stored: list = []
    publisher = _publisher(stored, {"a": _beat("a", 9)})
    publisher.publish(paused=["QmOther"], from_step=10)  # the CLI's, after the UI's last poll
    control = publisher.publish(pause=["QmMine"])
    assert control.paused == ["QmOther", "QmMine"]
    assert publisher.publish(resume=["QmOther", "other-name"]).paused == ["QmMine"]


def test_two_publishes_at_once_end_every_peer_on_the_record_the_dht_kept() -> None:
    """The CLI and the TUI published at the same moment: two different version-2 records under
    the owner's key, the DHT kept the later, and a peer that had read the first kept it for good
    (watchers took strictly higher versions only): outer lr 0.7 on one peer, 0.5 on another,
    both "on v2" (a review, stop 59). A watcher takes a same-version record that differs; the
    publisher whose record was replaced is told."""
    import pytest

    from swarm.errors import SwarmError
    from swarm.identity import key_hash
    from swarm.steering import ControlWatcher

    first = ControlState(version=2, outer_lr=0.5, from_step=12, time=100.0)
    second = ControlState(version=2, paused=["QmB"], from_step=12, time=100.5)
    records = [first]

    class Store:
        def read(self, key, schema):
            return {"owner key": records[-1]}

    watcher = ControlWatcher(Store(), RunKeys("r"), key_hash("owner key"), period=0.0)
    assert watcher.poll() == first
    records.append(second)  # the DHT keeps the one stored last
    assert watcher.poll() == second
    records.append(first)  # a replica that still holds the other: no flipping back (pause, resume...)
    assert watcher.poll() == second
    records.append(ControlState(version=1, outer_lr=0.1))  # an older version is still not taken
    assert watcher.poll() == second
    # The publisher whose record the other replaced says so; nothing claims it took effect.
    stored: list = []
    publisher = _publisher(
        stored, {p: _beat(p, 10) for p in ("owner-peer", "b")}, writers={"owner-peer": "owner"}
    )
    publisher.watcher.poll = lambda force=False, strict=False: (
        stored[-1].model_copy(update={"outer_lr": 0.9, "time": stored[-1].time + 0.5}) if stored else None
    )
    with pytest.raises(SwarmError, match="published at the same moment and replaced this one"):
        publisher.publish(inner_steps=20)


def test_a_version_the_run_cannot_take_is_refused_whole_and_said() -> None:
    """A streaming run of 4 fragments steered to H=6: the peer logged an error, applied the
    version's time box anyway, and its heartbeat said it had applied it, so `steer` printed
    "1/1 peers applied" (a review, 2026-12-06). Nothing of it applies, and the heartbeat says
    it was refused, and why."""
    from swarm.records import PeerHeartbeat, Stage, applied, refused

    watcher, events = Watcher(), []
    peer = Steering(
        watcher, name="a", peer_id="QmA", joiner=False,
        emit=lambda kind, **fields: events.append((kind, fields)), publish=lambda: None,
        beat=lambda stage: None, checkpoint=lambda: "checkpoint.pt",
        check=lambda control: "H=6 is not divisible by the 4 fragments" if control.inner_steps == 6 else None,
    )  # fmt: skip
    watcher.control = ControlState(version=1, inner_steps=6, round_seconds=5.0, checkpoint=1)
    peer.apply(Outer(), data_parallel=False)
    assert peer.refused == (1, "H=6 is not divisible by the 4 fragments") and peer.version == 1
    assert peer.round_seconds is None and peer.settings == {} and peer.checkpoints == 0
    assert events == [("control_applied", dict(version=1, outer_step=10, changes={"error": peer.refused[1]}))]
    peer.apply(Outer(), data_parallel=False)
    assert len(events) == 1  # said once, not every round

    def beat(applied_version: int, refused_version: int = 0) -> PeerHeartbeat:
        return PeerHeartbeat(
            peer_id="QmA", name="a", stage=Stage.TRAINING, outer_step=10, inner_step=0, inner_steps=8,
            time=0.0, control_version=applied_version, control_refused=refused_version,
            control_refusal="H=6 is not divisible" if refused_version else "",
        )  # fmt: skip

    assert applied([beat(1, 1)], 1) == (0, 1) and refused([beat(1, 1)], 1) == {"QmA": "H=6 is not divisible"}
    watcher.control = ControlState(version=2, inner_steps=8, round_seconds=5.0, checkpoint=1)
    peer.apply(Outer(), data_parallel=False)  # a value it takes: applied whole
    assert peer.version == 2 and peer.round_seconds == 5.0 and peer.checkpoints == 1
    assert applied([beat(2, 1)], 2) == (1, 1) and refused([beat(2, 1)], 2) == {}
    assert applied([beat(0)], 0) == (1, 1) and refused([beat(0)], 0) == {}  # no control yet
    said = {**beat(1, 1).model_dump(), "control_refusal": "\x1b]0;pwned\x07\x1b[2J"}
    assert PeerHeartbeat.model_validate(said).control_refusal == "\\x1b]0;pwned\\x07\\x1b[2J"  # as text


def test_the_runs_own_rules_decide_what_a_peer_takes() -> None:
    from types import SimpleNamespace

    from workbench.cli.command import build_config, build_parser
    from workbench.run.control import steered_problem

    def config(*argv: str):  # type: ignore[no-untyped-def]
        return build_config(build_parser().parse_args(["start", *argv]))

    def change(**values: Any) -> SimpleNamespace:
        return SimpleNamespace(**{"outer_lr": None, "inner_steps": None, "codec": None, **values})

    streaming = config("--method", "streaming", "--inner-steps", "8", "--fragments", "4")
    assert "divisible by --fragments (4)" in steered_problem(streaming, change(inner_steps=6))
    assert steered_problem(streaming, change(inner_steps=12, outer_lr=0.5)) is None
    trimmed = config("--aggregate", "trimmed-mean")
    assert "--aggregate trimmed-mean" in steered_problem(trimmed, change(codec="topk"))
    assert steered_problem(config(), change(codec="topk", outer_lr=0.4)) is None


def _owners_publisher(peers: dict[str, int]) -> Any:
    """A :class:`swarm.steering.Steering` of the owner's key over a board whose live peers train
    at the given steps (no DHT: every store is taken, nothing read back but what was stored);
    ``peers`` may change under it."""
    import time
    from types import SimpleNamespace

    from swarm.identity import key_hash
    from swarm.records import PeerHeartbeat, Stage
    from swarm.steering import Steering

    class Store:
        public_key = "the owner's key"

        def read(self, key, schema):
            return {}

        def store(self, key, value, **options):
            return True

    def board() -> dict[str, PeerHeartbeat]:
        return {
            peer: PeerHeartbeat(
                peer_id=peer,
                name=peer[-4:],
                stage=Stage.TRAINING,
                outer_step=step,
                inner_step=0,
                inner_steps=5,
                loss=1.0,
                samples_per_second=1.0,
                bytes_sent=0,
                bytes_received=0,
                device="cpu",
                time=time.time(),
            )  # fmt: skip
            for peer, step in peers.items()
        }

    return Steering(
        Store(), RunKeys("r"), owner=key_hash(Store.public_key), board=SimpleNamespace(fetch=board)
    )


def test_a_change_before_a_pending_one_replaces_it_and_peers_apply_it_at_its_step(caplog) -> None:
    """One --from-step 10^9 (a typo) held every later change back for the run: a plain change
    followed it (at 10^9) and an earlier --from-step was refused ("changes apply in order"), for
    the record's 7 days (a review, stop 71). A --from-step before a version not applied yet now
    replaces it: the new version is made on the settings the peers hold, the pending one is
    dropped (said), and a peer applies the new one at its step, never the dropped one's lr."""
    import logging

    steering = _owners_publisher({"QmPeer": 40})
    assert steering.publish(inner_steps=50).from_step == 42  # v1: applied by the peers (below)
    typo = steering.publish(outer_lr=0.5, from_step=10**9)  # v2: pending
    with caplog.at_level(logging.WARNING, logger="swarm.steering"):
        follows = steering.publish(codec="fp16")  # v3, no --from-step: after v2, and said so
        assert follows.from_step == 10**9 and "give --from-step 42" in caplog.text
        caplog.clear()
        fixed = steering.publish(outer_lr=0.1, from_step=45)  # v4: replaces v2 and v3
        assert "replaces v2" in caplog.text and "replaces v3" in caplog.text
    assert typo.version == 2 and fixed.version == 4 and fixed.from_step == 45
    assert (fixed.outer_lr, fixed.inner_steps, fixed.codec) == (0.1, 50, None)  # v1's H, not v2/v3's
    assert [v.version for v in fixed.earlier] == [1]
    assert fixed.due(44, after=1) is None and fixed.due(45, after=1).outer_lr == 0.1
    assert fixed.due(10**9, after=1).version == 4  # the dropped versions never come due


def test_a_change_a_live_peer_may_have_applied_is_not_replaced() -> None:
    """A replacement writes None ("keep") for what it drops: a peer past the dropped version's
    step had applied it and kept it while the others never took it (a review of stop 71's first
    version: lr 0.5 on one peer, 0.7 on the other, both at version 2). Refused, saying why."""
    import pytest

    from swarm.errors import SwarmError

    peers = {"QmSlow": 8}
    steering = _owners_publisher(peers)
    steering.publish(outer_lr=0.5, from_step=12)
    peers.update(QmFast=12, QmOther=9)  # one has reached step 12
    with pytest.raises(SwarmError, match="v1 .* applies from outer step 12, which a live peer has reached"):
        steering.publish(inner_steps=8, from_step=11)
