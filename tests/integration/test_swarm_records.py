"""Signed records, private runs, steering and the monitor, with real peers on loopback.

The "attacker" and the observers here are DHT nodes started in the test process with the same
code a peer uses (swarm.session.connect), so they speak the real protocol.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch

from swarm.dht import NetworkConfig, dht_time
from swarm.errors import SwarmError
from swarm.faults import FaultPlan
from swarm.monitor import SwarmMonitor, dht_reader, replay
from swarm.records import ControlState, PeerHeartbeat, RunKeys, Stage
from swarm.session import connect
from swarm.store import SignedStore
from tests.integration.conftest import FAST, interrupt_all, max_abs_diff, steady, workbench, workbench_all
from tests.integration.outsider import asks_for_the_state


def observer(address: str, keys: RunKeys, **options):
    return connect(NetworkConfig(initial_peers=[address], client_mode=True), keys, **options)


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def test_forged_heartbeats_and_foreign_steering_are_rejected(spawn, tmp_path):
    keys = RunKeys("forgery")
    owner = spawn("a", "start", *FAST, "--run-id", "forgery")  # until stopped: alone, rounds are fast
    address = owner.address()
    owner.wait_event("round")
    victim_id = owner.events("started")[0]["peer_id"]
    attacker = observer(address, keys)
    try:
        # 1. A heartbeat under the attacker's own key that claims the owner's peer id: stored, but
        #    every reader drops it (its key does not belong to that peer id).
        fake = PeerHeartbeat(
            peer_id=victim_id,
            name="a",
            stage=Stage.LEAVING,
            outer_step=0,
            inner_step=0,
            inner_steps=5,
            time=dht_time(),
        )
        attacker.store.store(keys.peers, fake, ttl=30, wait=True)
        # 2. The same under the owner's public key (signed with the attacker's key): refused.
        from swarm.identity import load_private_key

        impostor = SignedStore(attacker.dht, attacker.private_key)
        impostor.subkey = b"[owner:" + _public_key(load_private_key(owner.directory / "identity.key")) + b"]"
        assert not impostor.store(keys.peers, fake, ttl=30, wait=True)
        # 3. A steering change signed by somebody who is not the owner: peers ignore it.
        attacker.store.store(
            keys.control, ControlState(version=7, outer_lr=5.0, from_step=0), ttl=60, wait=True
        )

        reader = observer(address, keys)
        try:
            peers = reader.board.fetch(include_leaving=True)
            assert list(peers) == [victim_id] and peers[victim_id].stage is not Stage.LEAVING, peers
        finally:
            reader.close()
        wait_until(
            lambda: "ignored steering changes from" in owner.stderr(), 20, "the owner to log the rejection"
        )
        owner.process.send_signal(signal.SIGINT)
        assert owner.wait() == 0, owner.stderr()
        assert not owner.events("control_applied")
        # Outer lr 5 would have blown θ up for good. (A lone peer's outer momentum can overshoot
        # for a round: eval 3.22, 11.81, 3.27 at rounds 7-9 of one run, hence the median.)
        evals = sorted(r["eval_loss"] for r in owner.events("round"))
        assert evals and evals[len(evals) // 2] < 10, evals
    finally:
        attacker.close()


def _public_key(private_key) -> bytes:
    from swarm.identity import public_key_text

    return public_key_text(private_key).encode()


def test_a_private_run_is_invisible_without_its_secret(spawn):
    secret = "correct horse battery staple"
    # fp16 on hivemind's path (a private run's): see the end of the test.
    private = [*FAST, "--run-id", "private", "--secret", secret, "--codec", "fp16", "--rounds", "8"]
    owner = spawn("a", "start", *private, "--min-peers", "2")
    address = owner.address()
    assert "--secret SECRET" in owner.stdout() and secret not in owner.stdout()

    # Without the secret, status sees nobody and join finds no run; with it, status sees the
    # owner. (Three independent processes: side by side.) The join's --connect-timeout also
    # covers starting its own p2p daemon: 3 s ran out before it reached the owner beside a busy
    # loop on 2 cores ("could not reach any bootstrap peer within 3 s"); 10 s also bounds its
    # wait for a live peer of the run.
    pool = ThreadPoolExecutor(1)
    checked = pool.submit(
        workbench_all,
        ["status", address, "--run-id", "private", "--json"],
        ["join", address, *FAST, "--run-id", "private", "--connect-timeout", "10"],
        ["status", address, "--run-id", "private", "--secret", secret, "--json"],
    )
    pool.shutdown(wait=False)

    # An outsider who somehow learned the key names still cannot write: no HMAC, no store.
    keys = RunKeys("private", secret)
    outsider = observer(address, RunKeys("private"))
    try:
        fake = PeerHeartbeat(
            peer_id=outsider.peer_id,
            name="x",
            stage=Stage.TRAINING,
            outer_step=0,
            inner_step=0,
            inner_steps=5,
            time=dht_time(),
        )
        assert not outsider.store.store(keys.peers, fake, ttl=30, wait=True)
        # Nor read the run's state: its namespace is in the names of its handlers, which libp2p
        # lists to anyone who connects (a review, stop 64). Before, this outsider downloaded θ and
        # the optimizer's moments, and θ's sketches. A joiner (the secret, a first heartbeat) does.
        assert asks_for_the_state(outsider, address, keys) == (0, False)
    finally:
        outsider.close()

    status, joined, visible = checked.result()
    assert status.returncode == 1 and json.loads(status.stdout)["peers"] == [], status.stderr
    assert joined.returncode == 2 and "no live peer of run 'private'" in joined.stderr, joined.stderr
    assert "--secret match" in joined.stderr, joined.stderr  # what a joiner of a private run forgot
    assert visible.returncode == 0 and len(json.loads(visible.stdout)["peers"]) == 1, visible.stderr

    # A node with the secret and a heartbeat under the run's key (one that says it leaves: no
    # round mate for the others, nor a peer for status) is served both.
    insider = observer(address, keys)
    try:
        left = fake.model_copy(update=dict(peer_id=insider.peer_id, stage=Stage.LEAVING, time=dht_time()))
        wait_until(
            lambda: insider.store.store(keys.peers, left, ttl=10, wait=True), 30, "the insider's heartbeat"
        )
        parts, sketched = asks_for_the_state(insider, address, keys)
        assert parts > 0 and sketched
    finally:
        insider.close()

    # A second peer with the secret joins and trains with the owner.
    second = spawn("b", "join", address, *private)
    for peer in (owner, second):
        assert peer.wait() == 0, peer.stderr()
    assert any(r["group_size"] == 2 for r in second.events("round"))

    # The members of a round on hivemind's path hold the same bits (swarm.butterfly). With
    # hivemind's own answers each ended on the mean plus its own fp16 rounding: their θ were apart
    # from the second round on, and the θ check sent one to download the state every few rounds.
    rounds = {p.name: p.events("round") for p in (owner, second)}
    summary = {
        n: [(r["outer_step"], r["group_size"], r["plane"], r["resync"]) for r in rs]
        for n, rs in rounds.items()
    }
    assert all(r["plane"] == "hivemind" for rs in rounds.values() for r in rs if r["group_size"] == 2), (
        summary
    )
    # A failed round (a peer alone, under load) leaves them apart, and the next one sends a peer
    # to download, rightly; any other resync is the rounding.
    alone = {r["outer_step"] for rs in rounds.values() for r in rs if r["group_size"] == 1}
    unexplained = [
        (name, r["outer_step"], r["resync"])
        for name, rs in rounds.items()
        for r in rs
        if r["resync"] and not alone & set(range(r["outer_step"] - 2, r["outer_step"] + 1))
    ]
    assert not unexplained, (unexplained, summary)
    if 8 not in alone:  # nor did either take the other's θ at the end
        assert [p.events("done")[0]["ending_downloads"] for p in (owner, second)] == [0, 0], summary
    params = [p.global_params() for p in (owner, second)]
    assert all(torch.equal(x, y) for x, y in zip(*params))


async def _stored_values(_dht, node) -> list[bytes]:
    """(In a stock DHT node's process.) Every value it stores, as stored."""
    values = []
    for _key, stored in node.protocol.storage.items():
        inner = getattr(stored.value, "data", None)  # a dictionary value: its subkeys' values
        values += [entry.value for entry in inner.values()] if isinstance(inner, dict) else [stored.value]
    return [value if isinstance(value, bytes) else repr(value).encode() for value in values]


def test_a_stock_dht_node_holding_a_private_run_s_records_cannot_read_them():
    """hivemind stores a record on the nodes nearest its key, whoever runs them. A private run's
    heartbeats and manifest were stored there in the clear, an HMAC beside them: an outsider's
    plain hivemind node read the run id, the peers' names, steps and addresses (a review, stop
    64). They are sealed with the secret now; the run's peers still read them."""
    import hivemind

    from swarm.records import HEARTBEAT_TTL, LONG_TTL, RunManifest

    keys = RunKeys("myprivaterun", "correct horse battery staple")
    first = connect(NetworkConfig(), keys)
    try:
        addresses = [str(a) for a in first.dht.get_visible_maddrs()]
        outsider = hivemind.DHT(initial_peers=addresses, start=True)  # no validators, no secret
        second = connect(NetworkConfig(initial_peers=addresses), keys)
        try:
            manifest = RunManifest(
                run_id=keys.run_id,
                owner="0123456789abcdef",
                fingerprint="f" * 16,
                summary="tiny",
                created=dht_time(),
            )
            for session in (first, second):
                assert session.store.store(keys.manifest, manifest, ttl=LONG_TTL, wait=True)
                beat = PeerHeartbeat(
                    peer_id=session.peer_id,
                    name="alice-laptop",
                    stage=Stage.TRAINING,
                    outer_step=3,
                    inner_step=1,
                    inner_steps=5,
                    time=dht_time(),
                    addresses=addresses,
                )
                assert session.store.store(keys.peers, beat, ttl=HEARTBEAT_TTL, wait=True)
            held = wait_until(
                lambda: outsider.run_coroutine(_stored_values), 30, "the outsider to hold records"
            )
            assert len(held) >= 2, held
            for secret in (b"myprivaterun", b"alice-laptop", b"tiny", first.peer_id.encode()):
                assert not any(secret in value for value in held), (secret, held)
            read = second.store.read(keys.peers, PeerHeartbeat)
            assert {beat.name for beat in read.values()} == {"alice-laptop"} and len(read) == 2
        finally:
            second.close()
            outsider.shutdown()
    finally:
        first.close()


def test_a_change_the_run_cannot_take_is_refused_and_steer_says_so(spawn, tmp_path):
    """A streaming run of 4 fragments steered to H=6: `steer` printed "1/1 peers applied v1" and
    exited 0 while the peer refused it, and every later change carried H=6 (a review,
    2026-12-06). The peer applies nothing of it and says why; `steer` exits 1 naming it."""
    common = [*FAST, "--run-id", "refuse", "--method", "streaming", "--inner-steps", "8", "--fragments", "4"]
    first = spawn("a", "start", *common, *steady(tmp_path))
    address = first.address()
    first.wait_event("round")
    key = str(first.directory / "identity.key")
    steer = ["steer", address, "--run-id", "refuse", "--key", key, "--wait", "60"]
    bad = workbench(*steer, "--inner-steps", "6", "--json")
    assert bad.returncode == 1, (bad.stdout, bad.stderr)
    assert (
        "1 peer(s) refused v1 and apply none of its settings: a: streaming on real peers needs" in bad.stderr
    )
    said = json.loads(bad.stdout)
    assert said["applied"] == 0 and list(said["refused"]) == [first.wait_event("started")["peer_id"]]
    good = workbench(*steer, "--inner-steps", "4", "--json")  # a value the run takes: applied
    assert good.returncode == 0 and json.loads(good.stdout)["applied"] == 1, good.stderr
    applied = first.wait_event("control_applied", lambda e: e["version"] == 2, timeout=60)
    assert applied["changes"] == {"inner_steps": 4}, applied
    assert first.wait_event("control_applied", lambda e: e["version"] == 1)["changes"]["error"]
    interrupt_all([first])


def test_steering_reaches_every_peer(spawn, tmp_path):
    # No --rounds: with a fixed length the first peer, alone during the pause, could finish the
    # run before the resume on a loaded machine (its rounds alone take ~0.1 s), and the second
    # would then end it alone on its own θ. Both are stopped with Ctrl+C once they agree again.
    common = [*FAST, "--run-id", "steer", *steady(tmp_path)]
    first = spawn("a", "start", *common, "--min-peers", "2")
    address = first.address()
    second = spawn("b", "join", address, *common)
    second.wait_event("round", lambda e: e["outer_step"] >= 2)
    key = str(first.directory / "identity.key")

    # Not the owner: refused before anything is published. The owner, with a peer name nobody
    # has (a typo): refused, nothing published.
    refused, typo = workbench_all(
        [
            "steer",
            address,
            "--run-id",
            "steer",
            "--key",
            str(second.directory / "identity.key"),
            "--outer-lr",
            "0.3",
        ],
        ["steer", address, "--run-id", "steer", "--key", key, "--pause", "bb"],
    )
    assert refused.returncode == 2 and "only the run owner" in refused.stderr, refused.stderr
    assert typo.returncode == 2 and "no live peer is named bb (live: a, b)" in typo.stderr, typo.stderr

    result = workbench(
        "steer",
        address,
        "--run-id",
        "steer",
        "--key",
        key,
        "--outer-lr",
        "0.35",
        "--inner-steps",
        "4",
        "--round-seconds",  # a box longer than 4 steps take: the run goes on as before
        "30",
        "--json",
        "--wait",
        "60",
    )
    assert result.returncode == 0, result.stderr
    published = json.loads(result.stdout)
    assert published["applied"] == published["peers"] == 2
    version, from_step = published["control"]["version"], published["control"]["from_step"]

    # Pause the second peer: it idles (stage "paused") while the first trains on, then resumes
    # and catches up by downloading the state. (In process: a CLI's start-up, seconds of it,
    # would only add rounds the first peer trains alone before the resume.)
    from swarm.steering import Steering

    owner = observer(address, RunKeys("steer"), signing_key=key)
    try:
        manifest_owner = first.events("started")[0]["owner"]
        steering = Steering(owner.store, owner.keys, owner=manifest_owner, board=owner.board)
        # A step the run is past: each peer would apply it at its own next round, apart.
        with pytest.raises(SwarmError, match="each peer would apply the change at its own next round"):
            steering.publish(outer_lr=0.5, from_step=1)
        steering.pause("b")
        second.wait_event("paused", timeout=30)
        # Its heartbeat says so within a second or two (heartbeats are stored asynchronously).
        wait_until(
            lambda: any(p.name == "b" and p.stage is Stage.PAUSED for p in owner.board.fetch().values()),
            15,
            "the paused peer's heartbeat",
        )
        step = first.events("round")[-1]["outer_step"]
        first.wait_event("round", lambda e: e["outer_step"] >= step + 2)  # the others do not wait for it
        steering.resume("b")
        resumed = second.wait_event("resumed", timeout=30)["time"]
    finally:
        owner.close()
    together = second.wait_event("round", lambda e: e["time"] >= resumed and e["group_size"] >= 2, timeout=60)
    step = together["outer_step"] + 2
    for peer in (first, second):
        peer.wait_event("round", lambda e: e["outer_step"] >= step, timeout=60)
    interrupt_all((first, second), timeout=120)
    for peer in (first, second):
        applied = peer.events("control_applied")
        assert applied[0]["version"] == version
        assert applied[0]["outer_step"] == from_step  # the same step on every peer
        assert applied[0]["changes"] == {"outer_lr": 0.35, "inner_steps": 4, "round_seconds": 30.0}
        assert applied[-1]["version"] == version + 2  # the resume, applied by both
    # Both applied the change at the same round, so they agreed on θ until the pause; the paused
    # peer caught up by downloading the state, so they hold the same θ again after it.
    pause_step = second.events("paused")[0]["outer_step"]
    assert not [
        r for r in second.events("round") if from_step < r["outer_step"] <= pause_step and r["resync"]
    ]
    assert second.events("state_downloaded")[-1]["time"] >= resumed
    norms = [{r["outer_step"]: r["global_norm"] for r in p.events("round")} for p in (first, second)]
    assert math.isclose(norms[0][step], norms[1][step], rel_tol=1e-6), (step, norms)


def test_a_killed_peer_shows_as_left_within_its_ttl(spawn, tmp_path):
    # Until Ctrl+C: alone, the survivor's rounds take about 0.7 s (steady), and the late joiner below
    # needs the run's first peer (its bootstrap) alive for the 5-20 s it takes to start (with
    # --rounds 100 the survivor was at round 45 when the test ended: 11 s to spare).
    common = [*FAST, "--run-id", "crash", "--rounds", "0", *steady(tmp_path)]
    first = spawn("a", "start", *common, "--min-peers", "2")
    address = first.address()
    second = spawn("b", "join", address, *common)
    second.wait_event("round")
    keys = RunKeys("crash")
    session = observer(address, keys)
    recording = tmp_path / "crash.jsonl"
    monitor = SwarmMonitor(dht_reader(session.board, session.store, keys), record_to=recording)
    live = []
    try:
        live.append(monitor.poll())
        assert len(live[-1].peers) == 2 and live[-1].manifest is not None
        victim = second.events("started")[0]["peer_id"]
        # SIGKILL to the peer alone (the OOM killer, `kill -9 PID`): no leaving heartbeat, no
        # clean-up; its DHT (with its p2p daemon) and averager processes end with it all the
        # same (swarm.dht._end_with_parent): they used to run on as orphans for good.
        children = psutil.Process(second.process.pid).children(recursive=True)
        names = [" ".join(p.cmdline()[:3]) for p in children]
        assert sum("workbench" in n for n in names) == 2 and any("p2pd" in n for n in names), names
        second.process.send_signal(signal.SIGKILL)
        killed = time.monotonic()

        def left() -> bool:
            live.append(monitor.poll())
            return any(e.kind == "left" and e.peer_id == victim for e in live[-1].new_events)

        wait_until(left, 25, "the monitor to report the killed peer as left")
        assert time.monotonic() - killed <= session.board.ttl + 5
        assert victim not in live[-1].peers and len(live[-1].peers) == 1
        assert live[-1].departed[victim].how == "heartbeat expired"  # kept on screen, with how
        # The survivor keeps training (alone) instead of waiting for the dead peer.
        step = first.events("round")[-1]["outer_step"]
        first.wait_event("round", lambda e: e["outer_step"] >= step + 2, timeout=60)
        gone, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, [p.cmdline()[:3] for p in alive]
        # A joiner whose --rounds the run is past (it counts the run's rounds, not the joiner's)
        # has nothing to train: said, not silently done (it exited 0 after 0 rounds).
        late = spawn("c", "join", address, *FAST, "--run-id", "crash", "--rounds", "2")
        assert late.wait(timeout=90) == 0, late.stderr()
        assert "past --rounds 2" in late.stderr() and not late.events("round"), late.stderr()[-3000:]
    finally:
        monitor.close()
        session.close()
    interrupt_all([first])
    replayed = list(replay(recording))
    assert [json.dumps(s.to_json()) for s in replayed] == [json.dumps(s.to_json()) for s in live]


def test_a_joiners_download_shows_its_progress_on_the_board(spawn, tmp_path):
    """A donor serving slowly (fault injection: 40 ms per streamed part): the joiner's
    heartbeats say "downloading" with the share received of what the donor announced, rising,
    which the monitor and `status` show ("download 37%")."""
    faults = tmp_path / "faults.json"
    FaultPlan(serve_delay_ms=40).write(faults)
    common = [*FAST, "--run-id", "progress", "--rounds", "300"]
    first = spawn("a", "start", *common, "--fault-file", str(faults))
    first.wait_event("round")
    keys = RunKeys("progress")
    session = observer(first.address(), keys)
    monitor = SwarmMonitor(dht_reader(session.board, session.store, keys))
    shares: list[float] = []
    try:
        joiner = spawn("b", "join", first.address(), *common)

        def downloaded() -> bool:
            snapshot = monitor.poll()
            shares.extend(
                p.download_progress
                for p in snapshot.peers.values()
                if p.name == "b" and p.stage is Stage.DOWNLOADING
            )
            return bool(joiner.events("state_downloaded"))

        wait_until(downloaded, 90, "the joiner's download")
    finally:
        monitor.close()
        session.close()
    seconds = joiner.events("state_downloaded")[0]["seconds"]
    assert any(0 < share < 1 for share in shares), (shares, seconds)
    assert shares == sorted(shares), shares  # one donor, one stream: it only grows


def test_status_needs_an_address():
    result = workbench("status", "--run-id", "x")
    assert result.returncode == 2 and "multiaddr" in result.stderr


def test_doctor_reports_a_reachable_swarm_and_a_dead_port(spawn):
    peer = spawn("a", "start", *FAST, "--run-id", "doctor", "--min-peers", "2")
    address = peer.address()
    result = workbench("doctor", address, "--run-id", "doctor", "--json")
    checks = {c["name"]: c for c in json.loads(result.stdout)}
    assert result.returncode == 0, result.stdout + result.stderr
    assert checks["bootstrap"]["status"] == "ok" and checks["run 'doctor'"]["status"] == "ok"
    assert checks["reachability"]["status"] == "warn" and "--host 0.0.0.0" in checks["reachability"]["fix"]
    owner = peer.events("started")[0]["owner"]
    result = workbench("doctor", address, "--run-id", "doctor", "--owner", "0" * 16, "--json")
    run = {c["name"]: c for c in json.loads(result.stdout)}["run 'doctor'"]
    assert result.returncode == 1 and run["status"] == "fail", result.stdout  # join would fail
    assert f"only one by {owner}" in run["detail"] and "check --owner" in run["fix"], run
    dead = address.replace(address.split("/")[4], "1")  # port 1: nothing listens there
    result = workbench("doctor", dead, "--run-id", "doctor", "--json", "--connect-timeout", "5")
    checks = json.loads(result.stdout)
    assert result.returncode == 1 and any(c["status"] == "fail" and c["fix"] for c in checks)


def test_an_injected_corrupt_update_is_rejected_by_the_group(spawn, tmp_path):
    """The demo's "corrupt update" fault: one peer sends NaN; every member refuses the mean,
    no θ becomes NaN, and the peers still agree at the end. Before it, its "claim 1e9 samples"
    fault: that round averages, each peer counting the claim as 16x the other's weight."""
    faults = tmp_path / "faults.json"
    # Rounds to spare: the claim may take up to 3 tries, and the NaN and oversize rounds each
    # follow a poll of the log (with 14, the oversize round was round 5 of 14 in a full suite).
    common = [*FAST, "--run-id", "corrupt", "--rounds", "24"]
    first = spawn("a", "start", *common, "--min-peers", "2")
    second = spawn("b", "join", first.address(), *common, "--fault-file", str(faults))
    second.wait_event("round", lambda e: e["outer_step"] >= 2)
    for claim in range(1, 4):  # again if that round found no group (a busy machine)
        FaultPlan(overclaim_next=claim).write(faults)
        wait_until(lambda n=claim: second.stderr().count("claiming 1e+09 samples") >= n, 60, "the claim")
        step = second.events("round")[-1]["outer_step"]
        second.wait_event("round", lambda e, after=step: e["outer_step"] > after)
        if "claimed 1e+09 samples" in first.stderr():
            break
    FaultPlan(overclaim_next=claim, corrupt_next=1).write(faults)
    second.wait_event("round", lambda e: e["alone_reason"] and "NaN" in e["alone_reason"])
    # Then a lying peer: 1000x the update it declares. The mean is larger than the declared
    # norms allow, so every member refuses the round (optim.robust).
    FaultPlan(overclaim_next=claim, corrupt_next=1, oversize_next=1).write(faults)
    for peer in (first, second):
        assert peer.wait() == 0, peer.stderr()
    for peer in (first, second):
        rounds = peer.events("round")
        rejected = [r for r in rounds if r["alone_reason"] and "NaN" in r["alone_reason"]]
        assert len(rejected) == 1, rounds
        refused = [r for r in rounds if r["alone_reason"] and "more than it declared" in r["alone_reason"]]
        assert len(refused) == 1, rounds
        assert all(r["eval_loss"] == r["eval_loss"] for r in rounds)  # never NaN
    assert "sending a corrupt (NaN) update" in second.stderr()
    assert "sending 1000x this round's update" in second.stderr()
    for peer in (first, second):  # the claim was counted, named once, and refused no round
        assert peer.stderr().count("claimed 1e+09 samples, counted as") == 1, peer.stderr()[-3000:]
    assert max_abs_diff(first.global_params(), second.global_params()) <= 1e-5


def _p2p_daemon_among(processes) -> bool:
    import psutil

    for p in processes:
        with contextlib.suppress(psutil.Error):
            if any("p2pd" in part for part in p.cmdline()[:1]):
                return True
    return False


def test_closing_the_monitors_terminal_stops_it_and_its_dht_processes(spawn, tmp_path):
    """`workbench monitor` in a terminal (a pty here), then SIGHUP, as when the terminal or the
    SSH session closes: the monitor and the processes it started (hivemind's DHT process and its
    p2p daemon) are gone within 10 s."""
    import os
    import pty

    import psutil

    peer = spawn("a", "start", *FAST, *steady(tmp_path), "--run-id", "hangup", "--rounds", "300")
    peer.wait_event("round")
    leader, follower = pty.openpty()
    monitor = subprocess.Popen(
        [sys.executable, "-m", "workbench", "monitor", peer.address(), "--run-id", "hangup"],
        stdin=follower, stdout=follower, stderr=follower, start_new_session=True,
        env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"},
    )  # fmt: skip
    os.close(follower)
    try:
        process = psutil.Process(monitor.pid)
        deadline = time.monotonic() + 60
        # Its DHT is up once its p2p daemon runs (torch's shared-memory manager, another child,
        # may come first: two children were not enough, and a SIGHUP then came mid-start-up).
        while not _p2p_daemon_among(process.children(recursive=True)):
            assert monitor.poll() is None and time.monotonic() < deadline, "the monitor did not start"
            os.read(leader, 65536) if _readable(leader) else time.sleep(0.2)
        children = process.children(recursive=True)
        time.sleep(2.0)  # the app is drawing
        monitor.send_signal(signal.SIGHUP)
        hung_up = time.monotonic()
        shown = bytearray()  # what it drew and said

        def read_for(seconds: float) -> None:  # the pty kept drained while the monitor runs
            until = time.monotonic() + seconds
            while monitor.poll() is None and time.monotonic() < until:
                if _readable(leader):  # (waits 0.1 s for it)
                    shown.extend(os.read(leader, 65536))

        read_for(15)
        gone, alive = psutil.wait_procs(children, timeout=max(0.1, 10 - (time.monotonic() - hung_up)))
        if monitor.poll() is None:  # where it is stuck: every thread's stack (workbench's SIGUSR1)
            monitor.send_signal(signal.SIGUSR1)
            read_for(2)
        if monitor.poll() is None or alive:
            said = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown.decode(errors="replace"))
            dump = said.find("Thread 0x")  # faulthandler's first line
            said = said[dump : dump + 10000] if dump >= 0 else said[-6000:]
            pytest.fail(
                f"still running: {[p.cmdline()[:3] for p in alive]} after the SIGHUP; it said:\n{said}"
            )
        assert time.monotonic() - hung_up < 10.0
    finally:
        if monitor.poll() is None:
            os.killpg(monitor.pid, signal.SIGKILL)
        os.close(leader)


def _readable(fd: int) -> bool:
    import select

    return bool(select.select([fd], [], [], 0.1)[0])
