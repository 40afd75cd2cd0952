"""Unit tests for the run's records: keys, validators, identity, fingerprints, monitor, steering."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer

from optim.averager import LocalAverager
from optim.diloco import DiLoCo, DiLoCoConfig
from swarm.errors import SwarmError
from swarm.identity import create_identity, key_hash, load_private_key, peer_id_of, public_key_text
from swarm.manifest import check_fingerprint, model_fingerprint
from swarm.monitor import Reading, SwarmMonitor, Trail, replay
from swarm.records import ControlState, PeerHeartbeat, RunKeys, RunManifest
from swarm.steering import Steering
from swarm.validators import RunSecretValidator, record_validators


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory):
    return create_identity(tmp_path_factory.mktemp("keys") / "peer.key")


@pytest.fixture(scope="module")
def private_key(key_file):
    return load_private_key(key_file)


# --- keys and identity -----------------------------------------------------------------------------


def test_run_keys_without_a_secret_use_the_run_id() -> None:
    keys = RunKeys("my-run")
    assert (keys.manifest, keys.peers, keys.control) == ("my-run_manifest", "my-run_peers", "my-run_control")
    assert keys.group("diloco") == "my-run_diloco"


def test_a_secret_hides_the_run_keys() -> None:
    private, other = RunKeys("my-run", "correct horse battery"), RunKeys("my-run", "another secret!")
    assert private.namespace != "my-run" and private.namespace != other.namespace
    assert private.namespace == RunKeys("my-run", "correct horse battery").namespace  # deterministic
    assert "correct" not in private.peers
    assert "my-run" not in private.group("diloco")  # (it names the run's handlers, listed to any caller)


def test_a_short_secret_is_refused() -> None:
    with pytest.raises(SwarmError, match="at least 8"):
        RunKeys("my-run", "short")


def test_peer_id_of_a_key_is_the_libp2p_peer_id(key_file, private_key) -> None:
    assert peer_id_of(public_key_text(private_key)) == PeerID.from_identity(key_file.read_bytes()).to_base58()
    assert len(key_hash(public_key_text(private_key))) == 16


def test_a_garbage_key_file_gives_a_clear_error(tmp_path) -> None:
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"not a key at all")
    with pytest.raises(SwarmError, match="not a workbench/hivemind key file"):
        load_private_key(bad)
    with pytest.raises(SwarmError, match="cannot read"):
        load_private_key(tmp_path / "missing.key")


def test_a_key_file_marked_rsa_holding_another_key_gives_a_clear_error(tmp_path) -> None:
    """An EC key in a file marked RSA loaded, and the peer's first signature raised a TypeError
    traceback (a review, stop 72)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from hivemind.proto import crypto_pb2

    der = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    bad = tmp_path / "ec.key"
    bad.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString())
    with pytest.raises(SwarmError, match="not a workbench/hivemind key file"):
        load_private_key(bad)


# --- validators --------------------------------------------------------------------------------------


def record(key: str, subkey: bytes, value: Any, expiration: float | None = None) -> DHTRecord:
    from hivemind.dht.routing import DHTID
    from hivemind.utils import get_dht_time

    expiration = get_dht_time() + 5 if expiration is None else expiration

    return DHTRecord(
        key=DHTID.generate(source=key).to_bytes(),
        subkey=MSGPackSerializer.dumps(subkey),
        value=MSGPackSerializer.dumps(value),
        expiration_time=expiration,
    )


def beat(peer_id: str, **overrides: Any) -> dict[str, Any]:
    fields = dict(
        peer_id=peer_id, name="a", stage="training", outer_step=1, inner_step=0, inner_steps=5, time=1.0
    )
    return PeerHeartbeat.model_validate({**fields, **overrides}).model_dump(mode="json")


def composite(keys: RunKeys, private_key) -> CompositeValidator:
    return CompositeValidator(record_validators(keys, private_key))


@pytest.mark.parametrize("secret", [None, "a long run secret"])
def test_a_signed_record_validates_and_a_tampered_one_does_not(private_key, secret) -> None:
    keys = RunKeys("run", secret)
    validator = composite(keys, private_key)
    subkey = b"[owner:" + public_key_text(private_key).encode() + b"]"
    plain = record(keys.peers, subkey, beat("QmX"))
    signed = dataclasses.replace(plain, value=validator.sign_value(plain))
    assert validator.validate(signed)
    assert validator.strip_value(signed) == plain.value
    if secret is None:
        tampered = signed.value.replace(b"training", b"averaging")
    else:  # sealed: a bit flipped in what it holds
        assert b"training" not in signed.value
        tampered = signed.value[:-20] + bytes([signed.value[-20] ^ 1]) + signed.value[-19:]
    assert not validator.validate(dataclasses.replace(signed, value=tampered))


def test_a_record_under_another_key_cannot_be_signed(private_key, tmp_path) -> None:
    """Stores under somebody else's public key stay unsigned, so every node refuses them."""
    victim = load_private_key(create_identity(tmp_path / "victim.key"))
    keys = RunKeys("run")
    validator = composite(keys, private_key)
    subkey = b"[owner:" + public_key_text(victim).encode() + b"]"
    plain = record(keys.control, subkey, ControlState(version=3, outer_lr=0.1).model_dump(mode="json"))
    assert not validator.validate(dataclasses.replace(plain, value=validator.sign_value(plain)))


def test_the_schema_refuses_a_malformed_heartbeat(private_key) -> None:
    keys = RunKeys("run")
    validator = composite(keys, private_key)
    subkey = b"[owner:" + public_key_text(private_key).encode() + b"]"
    plain = record(keys.peers, subkey, {**beat("QmX"), "outer_step": -5})
    assert not validator.validate(dataclasses.replace(plain, value=validator.sign_value(plain)))


@pytest.mark.parametrize("secret", [None, "a long run secret"])
def test_a_record_too_large_or_too_long_lived_is_refused(private_key, secret) -> None:
    """Signed 1 MB heartbeats with a year's expiration, from fresh keys, were stored by every
    node of the run and held for that year. Each kind of record now has a size and a lifetime;
    honest ones at their fields' limits pass."""
    from hivemind.utils import get_dht_time

    from swarm.records import HEARTBEAT_TTL, LONG_TTL

    keys = RunKeys("run", secret)
    validator = composite(keys, private_key)
    subkey = b"[owner:" + public_key_text(private_key).encode() + b"]"

    def signed(key: str, value: Any, seconds: float) -> DHTRecord:
        plain = record(key, subkey, value, get_dht_time() + seconds)
        return dataclasses.replace(plain, value=validator.sign_value(plain))

    widest = beat(
        "Q" * 128,
        name="n" * 64,
        addresses=["/ip6/" + "f" * 39 + "/tcp/65535/p2p/" + "Q" * 52] * 16,
        ignored={f"{i:03d}" + "x" * 125: "r" * 200 for i in range(16)},
        last_error="e" * 300,
        last_round_alone="a" * 200,
        final_theta=[1.2345678901234] * 16,
    )
    assert validator.validate(signed(keys.peers, widest, HEARTBEAT_TTL))
    assert not validator.validate(signed(keys.peers, {**beat("QmX"), "junk": "A" * 1_000_000}, HEARTBEAT_TTL))
    assert not validator.validate(signed(keys.peers, beat("QmX"), 365 * 86400))  # a ghost for a year
    steering = ControlState(version=2, paused=["p" * 128] * 256).model_dump(mode="json")
    assert validator.validate(signed(keys.control, steering, LONG_TTL))
    assert not validator.validate(signed(keys.control, steering, 2 * LONG_TTL))
    assert not validator.validate(signed(keys.control, {**steering, "paused": ["p" * 129]}, 60))
    assert validator.validate(record("another-key", b"x", "A" * 1_000_000, 1e10))  # not the run's


def test_without_the_secret_a_store_is_refused(private_key) -> None:
    keys = RunKeys("run", "the real secret")
    outsider = RunSecretValidator(RunKeys("run", "a wrong secret"))
    insider = RunSecretValidator(keys)
    plain = record(keys.peers, b"x", beat("QmX"))
    assert not insider.validate(plain)  # not sealed at all
    # An outsider's seal is made with another secret (and for other key names).
    forged = dataclasses.replace(plain, value=outsider.sign_value(plain))
    assert not insider.validate(forged)
    sealed = dataclasses.replace(plain, value=insider.sign_value(plain))
    assert insider.validate(sealed) and insider.strip_value(sealed) == plain.value
    # Bound to where it was stored: moved under another subkey, or kept longer, it does not open.
    assert not insider.validate(dataclasses.replace(sealed, subkey=b"y"))
    assert not insider.validate(dataclasses.replace(sealed, expiration_time=sealed.expiration_time + 1))
    assert outsider.validate(record("someone-elses-key", b"x", 1))  # other keys are not its business


def test_a_private_run_s_records_are_unreadable_without_its_secret() -> None:
    """A review (stop 64) found a private run's heartbeats, manifest and steering stored in the
    clear (an HMAC beside them) on whichever nodes were nearest their keys, an outsider's among
    them: the run id, peer names, steps, addresses. They are sealed now, the matchmaking
    declarations too (which carried no HMAC: anybody who knew the names wrote there)."""
    keys = RunKeys("myprivaterun", "the real secret")
    insider = RunSecretValidator(keys)
    secret_beat = {**beat("QmX"), "name": "alice-laptop"}
    for key in (
        keys.peers,
        keys.manifest,
        keys.control,
        keys.donors[0],
        keys.matchmaking[0],
        keys.matchmaking[-1],
    ):
        stored = record(key, b"x", secret_beat)
        sealed = insider.sign_value(stored)
        assert b"alice-laptop" not in sealed and b"QmX" not in sealed, key
        assert not insider.validate(stored), key  # an outsider's write (no seal) is refused there too


# --- records -------------------------------------------------------------------------------------------


def test_control_state_refuses_bad_values() -> None:
    from pydantic import ValidationError

    for bad in (
        dict(version=0),
        dict(version=1, codec="zip"),
        dict(version=1, outer_lr=-1.0),
        dict(version=1, inner_steps=0),
    ):
        with pytest.raises(ValidationError):
            ControlState.model_validate(bad)
    control = ControlState(version=2, outer_lr=0.5, paused=["peer-3"])
    assert control.changes() == {"outer_lr": 0.5, "paused": ["peer-3"]}
    assert control.pauses("Qm...", "peer-3") and not control.pauses("Qm...", "peer-4")


# --- fingerprints -------------------------------------------------------------------------------------


def test_the_fingerprint_covers_architecture_shapes_and_optimizer() -> None:
    torch.manual_seed(0)
    small, wide = torch.nn.Linear(4, 4), torch.nn.Linear(4, 8)
    base = model_fingerprint(small, {"outer_lr": 0.7})
    assert base == model_fingerprint(torch.nn.Linear(4, 4), {"outer_lr": 0.7})  # weights do not matter
    assert base != model_fingerprint(wide, {"outer_lr": 0.7})
    assert base != model_fingerprint(small, {"outer_lr": 0.5})
    assert base != model_fingerprint(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), {"outer_lr": 0.7}
    )


def test_a_fingerprint_mismatch_names_both() -> None:
    manifest = RunManifest(
        run_id="r", owner="0" * 16, fingerprint="aaaaaaaaaaaaaaaa", summary="tiny", created=1.0
    )
    check_fingerprint(manifest, "aaaaaaaaaaaaaaaa", "tiny")
    with pytest.raises(SwarmError, match="aaaaaaaaaaaaaaaa.*bbbbbbbbbbbbbbbb"):
        check_fingerprint(manifest, "bbbbbbbbbbbbbbbb", "small")


# --- monitor -------------------------------------------------------------------------------------------


def hb(peer_id: str, name: str, t: float, outer: int, **kw: Any) -> PeerHeartbeat:
    fields = dict(peer_id=peer_id, name=name, stage="training", outer_step=outer, inner_step=1, inner_steps=5)
    # group size 1: each had a round of its own at that step (0 is "took the state there")
    return PeerHeartbeat.model_validate(
        {**fields, "time": t, "loss": 3.0 - outer / 10, "group_size": 1, **kw}
    )


def readings() -> list[Reading]:
    control = ControlState(version=1, outer_lr=0.5)
    return [
        Reading(1.0, "r", {"A": hb("A", "a", 1.0, 0)}),
        Reading(2.0, "r", {"A": hb("A", "a", 2.0, 1), "B": hb("B", "b", 2.0, 1)}),
        Reading(3.0, "r", {"A": hb("A", "a", 3.0, 4), "B": hb("B", "b", 3.0, 1)}, control=control),
        Reading(
            4.0,
            "r",
            {"A": hb("A", "a", 4.0, 4, control_version=1), "B": hb("B", "b", 4.0, 1, stage="leaving")},
        ),
        Reading(5.0, "r", {"A": hb("A", "a", 5.0, 5, control_version=1)}),
    ]


def test_the_monitor_derives_events() -> None:
    monitor = SwarmMonitor()
    kinds = [[e.kind for e in monitor.ingest(r).new_events] for r in readings()]
    # Round 4 is told once every training peer finished it: here when the laggard b leaves.
    # a was there before the monitor looked: "present", not "joined" (b joins while it watches).
    assert kinds == [["present"], ["joined", "round"], ["lagging"], ["control", "left", "round"], ["round"]]
    assert monitor.ingest(Reading(5.5, "r", {"A": hb("A", "a", 5.5, 5)})).new_events == []
    snapshot = monitor.ingest(Reading(16.0, "r", {}))
    assert [e.kind for e in snapshot.new_events] == ["left"]
    assert snapshot.new_events[0].message == "a left at outer step 5 (heartbeat expired)"
    assert snapshot.peers == {} and snapshot.outer_round == 5
    assert {d.heartbeat.name: d.how for d in snapshot.departed.values()} == {
        "a": "heartbeat expired",
        "b": "clean exit",
    }


def test_the_monitor_keeps_bounded_history_that_reaches_back_to_the_start() -> None:
    """Bounded, newest half at full resolution, the rest of the run coarser: a ring of 512
    heartbeats a second apart held 8.5 minutes, and the loss chart's 1 h window showed those."""
    monitor = SwarmMonitor(history=8)
    for t in range(100):
        snapshot = monitor.ingest(Reading(float(t), "r", {"A": hb("A", "a", float(t), t)}))
    steps = [v for _, v in snapshot.history["A"]["outer_step"]]
    assert len(steps) <= 8 and steps[-4:] == [96.0, 97.0, 98.0, 99.0] and steps[0] < 20
    assert steps == sorted(steps) and snapshot.applied() == (1, 1)
    trail, end = Trail(512), 8 * 3600  # the monitor's default, over an 8-hour run, a heartbeat a second
    for t in range(end):
        trail.add((float(t), 3.0))
    points = [t for t, _ in trail.points()]
    assert len(points) <= 512 and points[0] == 0 and points[-1] == end - 1
    assert sum(t >= end - 3600 for t in points) > 100  # the 1 h window has a curve to draw


def test_record_and_replay_round_trip(tmp_path) -> None:
    path = tmp_path / "run.jsonl"
    live = SwarmMonitor(record_to=path)
    expected = [json.dumps(live.ingest(r).to_json()) for r in readings()]
    live.close()
    assert [json.dumps(s.to_json()) for s in replay(path)] == expected


def test_a_recording_cut_short_replays_up_to_the_cut_and_records_on_after_it(tmp_path, caplog) -> None:
    """A recorder stopped mid-write (a crash, a full disk) leaves half a line: the whole file was
    refused, and recording more into it glued the next reading to the half line (or, kept as a
    bad line, made everything recorded after it unreadable)."""
    path = tmp_path / "run.jsonl"
    live = SwarmMonitor(record_to=path)
    for reading in readings()[:3]:
        live.ingest(reading)
    live.close()
    whole = path.read_text()
    path.write_text(whole[: whole.rindex("\n", 0, len(whole) - 1) + 30])  # the last reading cut
    assert len(list(replay(path))) == 2 and "ends mid-line (cut short)" in caplog.text
    again = SwarmMonitor(record_to=path)
    for reading in readings()[3:]:
        again.ingest(reading)
    again.close()
    replayed = list(replay(path))  # the cut reading dropped, the ones recorded after it kept
    assert [s.time for s in replayed] == [1.0, 2.0, 4.0, 5.0]
    assert len(path.read_text().splitlines()) == 5 and all(
        json.loads(line) for line in path.read_text().splitlines()
    )


def test_a_replay_source_tells_each_event_once_and_reads_as_it_goes(tmp_path) -> None:
    """A finished replay showed its last reading's events again at every poll."""
    from workbench.sources import ReplaySource

    path = tmp_path / "run.jsonl"
    live = SwarmMonitor(record_to=path)
    for reading in readings():
        live.ingest(reading)
    live.close()
    source = ReplaySource(path)
    events = [e.kind for _ in range(8) for e in source.poll().new_events]
    assert events == [e.kind for s in replay(path) for e in s.new_events] and "left" in events
    assert source.poll().time == 5.0 and source.position == 9
    (tmp_path / "empty.jsonl").write_text(path.read_text().splitlines()[0] + "\n")
    with pytest.raises(SwarmError, match="holds no readings"):
        ReplaySource(tmp_path / "empty.jsonl")


def test_replay_of_a_bad_file_says_what_it_is(tmp_path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello\n")
    with pytest.raises((SwarmError, ValueError)):
        list(replay(path))
    with pytest.raises(SwarmError, match="cannot read"):
        list(replay(tmp_path / "missing.jsonl"))


def test_propagation_counts_active_peers() -> None:
    peers = {
        "A": hb("A", "a", 1.0, 3, control_version=2),
        "B": hb("B", "b", 1.0, 3, control_version=1),
        "C": hb("C", "c", 1.0, 3, stage="paused"),
    }
    assert Steering.propagation(peers, 2) == (1, 2)
    # The monitor (the TUI's and the widget's "1/2 applied v2") counts the same: a paused peer
    # applies nothing until it is resumed (it said 1/3 for as long as c was paused).
    assert SwarmMonitor().ingest(Reading(1.0, "r", peers)).applied(2) == (1, 2)


# --- retune (what steering calls) ---------------------------------------------------------------------


def test_retune_changes_settings_between_rounds() -> None:
    model = torch.nn.Linear(3, 3)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    outer = DiLoCo(model, inner, LocalAverager(), DiLoCoConfig(inner_steps=5))
    assert outer.retune(outer_lr=0.3, inner_steps=7, codec="int8") == {
        "outer_lr": 0.3,
        "inner_steps": 7,
        "codec": "int8",
    }
    assert outer.outer_optimizer.param_groups[0]["lr"] == 0.3 and outer.config.inner_steps == 7
    assert type(outer.codec).__name__.lower().startswith("int8")
    assert outer.retune(outer_lr=0.3) == {}
    with pytest.raises(ValueError):
        outer.retune(outer_lr=-1.0, inner_steps=9)
    assert outer.config.inner_steps == 7 and outer.outer_optimizer.param_groups[0]["lr"] == 0.3  # untouched


@pytest.mark.parametrize(
    "name",
    ["[/b]", "[@click=app.export('../.bashrc')]x[/]", "a\x1b[2J\x1b]0;pwned\x1b\\", "", "x" * 65, " lead"],
)
def test_a_heartbeat_whose_name_is_markup_or_a_terminal_command_is_refused(name) -> None:
    """A name "[/b]" crashed `workbench status` and the TUI (Rich's MarkupError); "[@click=...]"
    put an action in a TUI label; an escape sequence cleared the reader's terminal. Every node
    refuses such a heartbeat, and a peer cannot be started with such a --name."""
    from swarm.records import parse_record

    assert parse_record(PeerHeartbeat, beat("QmX", name="peer-1")) is not None
    assert parse_record(PeerHeartbeat, {**beat("QmX"), "name": name}) is None
    assert parse_record(PeerHeartbeat, {**beat("QmX"), "device": "cuda\x1b[2J"}) is None
    assert parse_record(PeerHeartbeat, {**beat("QmX"), "peer_id": "Qm[b]"}) is None
    with pytest.raises(ValueError, match="invalid peer name"):
        from workbench.config import PeerConfig

        PeerConfig(name=name)


def test_free_text_from_the_network_reaches_the_terminal_as_text(capsys) -> None:
    """Errors and reasons are free text: control characters arrive escaped, and Rich markup in
    them is printed, not applied."""
    from swarm.records import parse_record
    from workbench.cli.status import render

    heard = parse_record(
        PeerHeartbeat,
        {**beat("QmX"), "last_error": "boom\x1b[2J", "ignored": {"QmY": "[/b] lied\x1b]0;pwned\x07"}},
    )
    assert heard.last_error == "boom\\x1b[2J" and heard.ignored == {"QmY": "[/b] lied\\x1b]0;pwned\\x07"}
    peer = dict(
        name="a", stage="training", outer_step=1, inner_step=0, inner_steps=5, loss=None,
        samples_per_second=0.0, bytes_sent=0, peer_id="QmX", device="cpu",
    )  # fmt: skip
    render(
        {
            "run_id": "r",
            "outer_round": 1,
            "peers": [peer],
            "ignored": [{"peer_id": "QmY", "reason": heard.ignored["QmY"]}],
            "departed": [{"name": "b", "time": 0.0, "how": "[/i] crashed", "outer_step": 1}],
        }
    )
    out = capsys.readouterr().out
    assert "\x1b]0;" not in out and "[/b] lied" in out and "[/i] crashed" in out


def test_a_pause_names_one_live_peer_by_id_and_a_shared_name_is_refused():
    """A name is anyone's to take: a stranger named like an honest peer must not get both paused
    by `steer --pause NAME`, the TUI or the widget. A pause resolves to the one live peer's id."""
    from swarm.steering import live_peer_id

    live = {"id-a": SimpleNamespace(name="alice"), "id-b": SimpleNamespace(name="bob")}
    assert live_peer_id("alice", live) == "id-a" and live_peer_id("id-b", live) == "id-b"
    with pytest.raises(SwarmError, match=r"no live peer is named carol \(live: alice, bob\)"):
        live_peer_id("carol", live)
    live["id-x"] = SimpleNamespace(name="alice")
    with pytest.raises(
        SwarmError, match=r"2 live peers are named alice \(id-a, id-x\): pause one by its peer id"
    ):
        live_peer_id("alice", live)
    assert live_peer_id("id-x", live) == "id-x"


def test_non_owners_steering_records_are_logged_once_per_key_and_at_most_once_a_minute(monkeypatch, caplog):
    """Keys are free: steering records from non-owners (a new version every poll, from many
    keys) were one warning line per key and version. Now: one per key, one a minute at most,
    the rest counted; the owner's record is still taken."""
    import swarm.identity
    from swarm import steering

    clock = [1000.0]
    monkeypatch.setattr(steering.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(swarm.identity, "key_hash", lambda key: key)
    records: dict[str, ControlState] = {}
    store = SimpleNamespace(read=lambda key, schema: dict(records))
    watcher = steering.ControlWatcher(store, SimpleNamespace(control="k"), owner="owner", period=0.0)
    caplog.set_level("WARNING", logger="swarm.steering")
    for version in range(1, 50):
        clock[0] += 1.0
        records.update({f"stranger{i}": ControlState(version=version, outer_lr=5.0) for i in range(version)})
        records["owner"] = ControlState(version=3, outer_lr=0.5)
        assert watcher.poll().outer_lr == 0.5
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("ignored steering changes from stranger0 (version 1)")
    clock[0] += 61.0
    records["stranger99"] = ControlState(version=1)
    watcher.poll()
    assert (
        len(caplog.records) == 2
        and "(and 48 other key(s) since the last such line)" in caplog.records[1].getMessage()
    )
    clock[0] += 1.0
    records["stranger100"] = ControlState(version=1)
    watcher.poll()  # within the minute: counted
    clock[0] += 61.0
    watcher.poll()  # no new key, but one is still untold
    assert [r.getMessage() for r in caplog.records[2:]] == [
        "ignored steering changes from 1 more key(s): only the run owner owner can steer"
    ]


def test_status_into_a_pipe_keeps_every_cell_whole(capsys, monkeypatch) -> None:
    """Into a file or a pipe rich assumed 80 columns and cut names, stages and losses to "…"."""
    from workbench.cli.status import render

    monkeypatch.delenv("COLUMNS", raising=False)
    peer = dict(
        name="a-rather-long-peer-name", stage="averaging", outer_step=123456, inner_step=4, inner_steps=5,
        loss=2.345678, samples_per_second=12345.0, bytes_sent=123_456_789_000, peer_id="Qm" + "x" * 44,
        device="cuda:0", last_round_steps=5, group_size=12, control_version=3,
    )  # fmt: skip
    render({"run_id": "r", "outer_round": 1, "peers": [peer]})
    out = capsys.readouterr().out
    assert "…" not in out, out
    assert "a-rather-long-peer-name" in out and "averaging" in out and "2.346" in out, out


def test_a_name_is_judged_as_the_heartbeat_schema_judges_it() -> None:
    """Python's re and pydantic's regex engine read \\w differently: "x²" passed check_name (and a
    round mate's name check) and then failed the heartbeat's schema, which stopped the peer."""
    from swarm.errors import SwarmError
    from swarm.records import check_name, is_name

    for name in ("x²", "a½", "x]", "", "a" * 65):
        assert not is_name(name)
        with pytest.raises(SwarmError, match="invalid peer name"):
            check_name(name)
    for name in ("alice", "ü-3", "٣", "peer 0", "a" * 64):
        assert is_name(name) and check_name(name) == name
        PeerHeartbeat(
            peer_id="p", name=name, stage="training", outer_step=0, inner_step=0, inner_steps=1, time=0.0
        )


@pytest.mark.parametrize("secret", [None, "a long run secret"])
def test_a_donors_declaration_is_its_writers_alone(key_file, private_key, tmp_path, secret) -> None:
    """hivemind declares the peers that serve the state under their bare peer ids, which anybody
    could write: an outsider stored None under every donor's id for a year, their renewals were
    refused, and every joiner found no donor. A run's declarations are signed, short-lived and
    small; only the writer's own ``[owner:...]`` subkey passes (so a peer withdraws only its own)."""
    from hivemind.utils import get_dht_time

    from swarm.records import STATE_GROUPS

    keys = RunKeys("run", secret)
    validator = composite(keys, private_key)
    own = b"[owner:" + public_key_text(private_key).encode() + b"]"
    stranger = load_private_key(create_identity(tmp_path / "stranger.key"))
    theirs = composite(keys, stranger)  # the stranger's node signs with its own key
    peer_id = PeerID.from_identity(key_file.read_bytes())

    def declared(key: str, subkey: bytes, value: Any, seconds: float, by=validator) -> bool:
        plain = record(key, subkey, value, get_dht_time() + seconds)
        return validator.validate(dataclasses.replace(plain, value=by.sign_value(plain)))

    assert len(keys.donors) == len(STATE_GROUPS) and all(k.endswith(".all_averagers") for k in keys.donors)
    assert f"{keys.group('diloco')}.all_averagers" in keys.donors  # SwarmAverager's default group
    for key in keys.donors:
        assert declared(key, own, 7, 10)
        assert declared(key, own, None, 10)  # a withdrawal, by the peer itself
        assert not declared(key, peer_id.to_bytes(), None, 365 * 86400, by=theirs)  # hivemind's bare id
        assert not declared(key, peer_id.to_bytes(), 7, 10)
        assert not declared(key, own, None, 10, by=theirs)  # the donor's subkey, not its signature
        assert not declared(key, own, 7, 365 * 86400)  # for a year
        assert not declared(key, own, "x" * 4096, 10)
    assert validator.validate(
        record(f"{keys.group('fragment1')}.all_averagers", b"x", None, 1e10)
    )  # nobody reads it


@pytest.mark.parametrize("secret", [None, "a long run secret"])
def test_a_matchmaking_declaration_is_its_writers_alone(key_file, private_key, tmp_path, secret) -> None:
    """hivemind declares an averager looking for a group under its bare peer id: an outsider
    stored "not looking" under every peer's id for a year, and every round was alone for good
    (a review, 2026-12-06). A run's declarations (swarm.signed_groups) are its writer's own,
    small and no longer-lived than a matchmaking window can be."""
    from hivemind.utils import get_dht_time

    from swarm.records import MATCHMAKING_TTL, MAX_FRAGMENTS
    from swarm.signed_groups import peer_of

    keys = RunKeys("run", secret)
    validator = composite(keys, private_key)
    own = b"[owner:" + public_key_text(private_key).encode() + b"]"
    stranger = load_private_key(create_identity(tmp_path / "stranger.key"))
    theirs = composite(keys, stranger)
    peer_id = PeerID.from_identity(key_file.read_bytes())

    def declared(key: str, subkey: bytes, value: Any, seconds: float, by=validator) -> bool:
        plain = record(key, subkey, value, get_dht_time() + seconds)
        return validator.validate(dataclasses.replace(plain, value=by.sign_value(plain)))

    groups = [keys.group(g) + ".0b" for g in ("diloco", "fragment0", f"fragment{MAX_FRAGMENTS - 1}")]
    assert (
        set(groups) <= set(keys.matchmaking)
        and keys.group(f"fragment{MAX_FRAGMENTS}") + ".0b" not in keys.matchmaking
    )
    for key in groups:
        assert declared(key, own, True, MATCHMAKING_TTL)
        assert declared(key, own, False, 10)  # a withdrawal, by the peer itself
        assert not declared(key, peer_id.to_bytes(), False, 365 * 86400, by=theirs)  # hivemind's bare id
        assert not declared(key, peer_id.to_bytes(), True, 10)
        assert not declared(key, own, False, 10, by=theirs)  # the peer's subkey, not its signature
        assert not declared(key, own, True, 365 * 86400)  # for a year
        assert not declared(key, own, "x" * 4096, 10)
    assert (
        peer_of(own) == peer_id and peer_of(peer_id.to_bytes()) is None and peer_of(b"[owner:junk]") is None
    )


def test_the_fragments_bound_and_the_matchmaking_keys_agree() -> None:
    from swarm.bounds import BOUNDS
    from swarm.records import MAX_FRAGMENTS

    assert BOUNDS["fragments"].high == MAX_FRAGMENTS


async def test_a_step_leads_follows_and_takes_in_only_the_peers_it_was_allowed(
    key_file, private_key, tmp_path
) -> None:
    """A fresh key declared itself a leader every 0.1 s just ahead of everyone, accepted each
    follower and never began; another joined every honest group and never came to its ring:
    every round of a pair ended alone (a red-team review, 2026-12-06). A run's averager now
    follows and takes in only the peers its process read heartbeats from (``allowed``)."""
    from types import SimpleNamespace

    from hivemind.proto import averaging_pb2
    from hivemind.utils import ValueWithExpiration

    from swarm.hivemind_fixes import parse_ids, refuse_strangers
    from swarm.signed_groups import SignedGroupKeys

    own = b"[owner:" + public_key_text(private_key).encode() + b"]"
    honest = PeerID.from_identity(key_file.read_bytes())
    stranger_key = load_private_key(create_identity(tmp_path / "stranger.key"))
    stranger = b"[owner:" + public_key_text(stranger_key).encode() + b"]"
    declared = {own: ValueWithExpiration(True, 2.0), stranger: ValueWithExpiration(True, 1.0)}

    class Dht:
        async def get(self, key, latest, return_future):  # type: ignore[no-untyped-def]
            return ValueWithExpiration(declared, 2.0)

    keys = SignedGroupKeys.__new__(SignedGroupKeys)
    keys.dht, keys.subkey, keys.allowed = Dht(), own, None
    found = await keys._signed_averagers("run_diloco.0b", only_active=True)
    assert len(found) == 2  # nothing allowed: anybody, as hivemind
    keys.allowed = parse_ids(honest.to_base58().encode())
    assert await keys._signed_averagers("run_diloco.0b", only_active=True) == [(honest, 2.0)]

    outsider = PeerID.from_base58("QmWv9Ww7znzgLFyCzf21SR6tUKXrmHCZH9KhebeH4gyE9f")
    matchmaking = SimpleNamespace(_check_reasons_to_reject=lambda request, context: None)
    refuse_strangers(matchmaking)
    assert matchmaking._check_reasons_to_reject(None, SimpleNamespace(remote_id=outsider)) is None
    matchmaking.allowed = {honest}
    refused = matchmaking._check_reasons_to_reject(None, SimpleNamespace(remote_id=outsider))
    assert refused.code == averaging_pb2.NOT_LOOKING_FOR_GROUP
    assert matchmaking._check_reasons_to_reject(None, SimpleNamespace(remote_id=honest)) is None
    assert parse_ids(b"") is None and parse_ids(b"0OIl,x") is None  # not base58


def test_a_recording_that_cannot_be_written_stops_and_the_monitor_goes_on(tmp_path, caplog) -> None:
    """`status --watch --record` on a disk that filled up crashed with an OSError traceback (and
    the TUI's every poll failed before it drew anything): a review, 2026-12-06."""
    monitor = SwarmMonitor(record_to=tmp_path / "run.jsonl")
    monitor._record.close()
    monitor._record = open("/dev/full", "w", buffering=1)  # noqa: SIM115 - every write: ENOSPC
    first, *rest = readings()
    assert monitor.ingest(first).time == first.time
    assert "stopped recording to /dev/full" in caplog.text and monitor._record is None
    assert [monitor.ingest(r).time for r in rest] == [r.time for r in rest]
    monitor.close()


def _matchmaking(**attributes):  # type: ignore[no-untyped-def]
    """hivemind's matchmaking as far as :func:`swarm.hivemind_fixes.watch_leaders` reads it."""
    from types import SimpleNamespace

    async def leader_assemble_group():  # type: ignore[no-untyped-def]
        return SimpleNamespace(group_id=b"led here", peer_ids=())

    async def follower_assemble_group(leader, message):  # type: ignore[no-untyped-def]
        return SimpleNamespace(group_id=message.group_id, peer_ids=())

    return SimpleNamespace(
        peer_id="me",
        leader_assemble_group=leader_assemble_group,
        follower_assemble_group=follower_assemble_group,
        **attributes,
    )


async def test_each_member_knows_for_itself_who_leads_its_group() -> None:
    """The group's board is its matchmaking leader's, the only member that took every member's
    join request: what it says of who never came to the ring is firsthand (a leader can name in
    its group a peer that never joined it, a review, 2026-12-06). Each member learns who leads
    from its own matchmaking, not from what the group's message says."""
    from types import SimpleNamespace

    from swarm.hivemind_fixes import watch_leaders

    led: list[tuple[bytes, str]] = []
    matchmaking = _matchmaking(_servicer_type=None)
    watch_leaders(
        matchmaking, lambda leader, allowed: None, lambda group, leader: led.append((group.group_id, leader))
    )
    assert (await matchmaking.leader_assemble_group()).group_id == b"led here"
    await matchmaking.follower_assemble_group("the leader", SimpleNamespace(group_id=b"followed"))
    assert led == [(b"led here", "me"), (b"followed", "the leader")]


async def test_a_leader_that_accepts_and_then_says_nothing_is_told_as_silent() -> None:
    """A fresh key with a heartbeat led a group, accepted the peers and never began: each
    follower waited out its window, every attempt. The follower now tells such a leader (its
    averager leaves it out of the step, its peer strikes it): one silent past the follower's
    request's expiration, not one that disbanded, nor one whose wait was cut before then."""
    import asyncio
    import contextlib
    from types import SimpleNamespace

    from hivemind.proto import averaging_pb2
    from hivemind.utils import get_dht_time

    from swarm.hivemind_fixes import watch_leaders

    class Stream:
        def __init__(self, *codes: int) -> None:
            self.codes = list(codes)

        async def __anext__(self):  # type: ignore[no-untyped-def]
            if self.codes:
                return averaging_pb2.MessageFromLeader(code=self.codes.pop(0))
            await asyncio.sleep(3600)

        async def aclose(self) -> None:
            pass

    streams = {
        "silent": Stream(averaging_pb2.ACCEPTED),
        "disbands": Stream(averaging_pb2.ACCEPTED, averaging_pb2.GROUP_DISBANDED),
        "early": Stream(averaging_pb2.ACCEPTED),
        # "disbanded" only past the request's expiration, just before hivemind's wait ends (a
        # review of the defence: never blamed, and it held every follower as long)
        "late": Stream(averaging_pb2.ACCEPTED, averaging_pb2.GROUP_DISBANDED),
    }

    class Servicer:
        @staticmethod
        def get_stub(p2p, peer, *, namespace=None):  # type: ignore[no-untyped-def]
            async def rpc_join_group(request):  # type: ignore[no-untyped-def]
                return streams[peer]

            return SimpleNamespace(rpc_join_group=rpc_join_group)

    silent: list[str] = []
    matchmaking = _matchmaking(_servicer_type=Servicer, allowed=None)
    watch_leaders(matchmaking, lambda leader, allowed: silent.append(leader))
    watch_leaders(matchmaking, lambda leader, allowed: silent.append(leader))  # (once: not twice)
    for leader, expiration in (("silent", -2.0), ("disbands", 30.0), ("early", 30.0), ("late", -2.0)):
        stub = matchmaking._servicer_type.get_stub(None, leader, namespace="run")
        answers = await stub.rpc_join_group(SimpleNamespace(expiration=get_dht_time() + expiration))
        assert (await anext(answers)).code == averaging_pb2.ACCEPTED
        with contextlib.suppress(asyncio.TimeoutError):  # hivemind's wait for its next word, cut
            await asyncio.wait_for(anext(answers), 0.05)
        await answers.aclose()
    assert silent == ["silent", "late"]
    # A redirect to a peer outside the step's peers is dropped: hivemind follows a redirect
    # without asking whom it names (a silent key with no heartbeat, behind a leader with one).
    honest = PeerID.from_base58("QmWv9Ww7znzgLFyCzf21SR6tUKXrmHCZH9KhebeH4gyE9f")
    outsider = PeerID.from_base58("QmRGYVtBtZW8BhNqAKDF9WZDgQPqsy7WwTfVfop3SXyTiC")
    matchmaking.allowed = {honest}
    for suggested, kept in ((outsider, b""), (honest, honest.to_bytes())):
        streams["redirects"] = Stream(averaging_pb2.ACCEPTED)
        streams["redirects"].codes.append(averaging_pb2.GROUP_DISBANDED)
        answers = await matchmaking._servicer_type.get_stub(None, "redirects").rpc_join_group(
            SimpleNamespace(expiration=get_dht_time() + 30)
        )
        await anext(answers)
        original = Stream.__anext__

        async def redirecting(self, suggested=suggested, original=original):  # type: ignore[no-untyped-def]
            message = await original(self)
            message.suggested_leader = suggested.to_bytes()
            return message

        Stream.__anext__ = redirecting
        try:
            assert (await anext(answers)).suggested_leader == kept
        finally:
            Stream.__anext__ = original


def test_a_hostile_recording_is_refused_line_by_line_and_shows_nothing_raw(tmp_path, capsys) -> None:
    """A review (stop 69): a recording is a file a user may be handed. Its run id went into
    Rich markup and the terminal ("[/b]": a traceback; an escape cleared the screen), its time
    to time.localtime (NaN, 1e20, 400 digits: tracebacks), its ignored reasons unbounded and
    raw, and a line nested 100,000 deep was a RecursionError."""
    from workbench.cli.command import main

    good = Reading(1000.0, "r", {}).to_json()
    bad_lines = {
        "run id markup": {**good, "run_id": "[/b]"},
        "run id escape": {**good, "run_id": "\x1b[2Jx"},
        "time NaN": '{"time": NaN, "run_id": "r"}',
        "time far": {**good, "time": 1e20},
        "time huge": '{"time": ' + "9" * 400 + ', "run_id": "r"}',
        "time true": {**good, "time": True},
        "many ignored": {**good, "ignored": {f"Qm{i:044d}": "x" for i in range(5000)}},
        "long reason": {**good, "ignored": {"Qm" + "1" * 44: "x" * 1001}},
        "ignored id escape": {**good, "ignored": {"\x1b]0;pwned\x07X": "r"}},
        "nested": "[" * 100_000,
    }
    for why, line in bad_lines.items():
        path = tmp_path / f"{why.replace(' ', '_')}.jsonl"
        text = line if isinstance(line, str) else json.dumps(line)
        path.write_text('{"format": "workbench-monitor/1"}\n' + text + "\n" + json.dumps(good) + "\n")
        with pytest.raises(SwarmError, match=":2: not a monitor reading"):
            list(replay(path))
        assert main(["status", "--replay", str(path)]) == 2, why
        assert "Traceback" not in capsys.readouterr().err
    # A reason with control characters is shown as escapes (a live reader's are its own).
    path = tmp_path / "escapes.jsonl"
    reason = {**good, "ignored": {"Qm" + "1" * 44: "\x1b[2Jmade up"}}
    path.write_text('{"format": "workbench-monitor/1"}\n' + json.dumps(reason) + "\n")
    assert main(["status", "--replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\x1b[2Jmade up" in out


def test_a_recording_of_its_header_alone_without_its_newline_records_on(tmp_path) -> None:
    """A review (stop 69): the next reading was appended on the header's line, and the file was
    no recording any more."""
    path = tmp_path / "run.jsonl"
    path.write_text('{"format": "workbench-monitor/1"}')
    live = SwarmMonitor(record_to=path)
    for reading in readings()[:2]:
        live.ingest(reading)
    live.close()
    assert [s.time for s in replay(path)] == [1.0, 2.0]
