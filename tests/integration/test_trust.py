"""The data plane as an outsider and as a user deploying across machines see it (docs/security.md).

Real peers in separate processes; the outsider is this test process with a stock hivemind p2p
node and plain sockets, knowing everything a network observer could (every listening port, the
run id, the peers' ids)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from swarm.faults import FaultPlan
from swarm.state_transfer import MAX_CONNECTIONS, TOKEN_WAIT
from tests.integration.conftest import (
    FAST,
    NETNS,
    README_PORT,
    STEADY_MS,
    PeerProcess,
    interrupt_all,
    kill_group,
    lab_peer,
    max_abs_diff,
    readme_flags,
    steady,
)
from workbench.local import netlab


def _listeners(pid: int) -> list[tuple[str, int]]:
    """Every TCP socket that a process and its children listen on."""
    found = []
    for process in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            found += [c.laddr for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
    return [(address.ip, address.port) for address in found]


PROBE = """
import datetime, os, sys, threading, time
import torch

def probe(port):
    try:
        store = torch.distributed.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=1)
        )
        print(f"a TCPStore answered on {port}: keys {store.list_keys()}", flush=True)
    except Exception:  # refused, timed out, not a store: all fine here
        pass

threads = [threading.Thread(target=probe, args=(int(p),), daemon=True) for p in sys.argv[1:]]
for thread in threads:
    thread.start()
deadline = time.monotonic() + 15
for thread in threads:
    thread.join(max(0.0, deadline - time.monotonic()))
print("probed", len(threads), "ports;", sum(t.is_alive() for t in threads), "never answered", flush=True)
os._exit(0)
"""


def _as_tcpstore_client(ports: list[int]) -> str:
    """What a torch TCPStore client gets from each port (the old rendezvous answered everyone),
    all at once. In a process of its own: a client that reached a listener speaking another
    protocol (gloo's, the p2p daemon's) can wait for an answer for ever."""
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, *map(str, ports)], capture_output=True, text=True, timeout=120
    )
    assert "probed" in probe.stdout, probe.stderr[-2000:]
    return probe.stdout


async def _ask_boards(address: str, prefix: str, peer_ids: list[str]) -> list[dict]:
    """A stock hivemind node asks the peers' rendezvous boards for anything it can think of."""
    from hivemind.p2p import P2P, PeerID
    from hivemind.proto import averaging_pb2

    from swarm.group_averager import GroupAverager
    from swarm.rendezvous import pack, unpack

    p2p = await P2P.create(initial_peers=[address], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    answers = []
    try:
        for peer in peer_ids:
            stub = GroupAverager.get_stub(p2p, PeerID.from_base58(peer), namespace=prefix)
            for request in [
                {"g": b"\0" * 32, "op": "get", "k": "ring0/0"},
                {"g": b"\0" * 32, "op": "set", "k": "ring0/0", "v": b"\0" * 60_000},
                {"g": b"x", "op": "list", "k": ""},
                {"g": b"x", "op": "get", "k": "", "want": ["sketch/0", "sketch/1"]},
            ]:
                reply = await stub.rpc_plane_board(
                    averaging_pb2.DownloadData(metadata=pack(request)), timeout=5
                )
                answers.append(unpack(reply.metadata))
    finally:
        await p2p.shutdown()
    return answers


def test_outsiders_reach_no_ring_and_no_board(spawn, tmp_path):
    """Two peers average over the direct plane while an outsider probes every port they listen
    on as a TCPStore client and asks their boards for ring keys: it gets nothing, nothing
    listens wider than --host, and every round is a direct pair round on the same θ."""
    from swarm.records import RunKeys

    # No --rounds: a fixed-length run could end on a loaded machine before the probes ran
    # (then they prove nothing). The peers train until the probes are done and they have
    # averaged 3 more rounds, and are then stopped together with Ctrl+C.
    common = [*FAST, "--min-peers", "2", "--run-id", "outsider", *steady(tmp_path)]
    first = spawn("a", "start", *common)
    second = spawn("b", "join", first.address(), *common)
    first.wait_event("round", lambda e: e["outer_step"] >= 1)
    peer_ids = [p.wait_event("started")["peer_id"] for p in (first, second)]
    answers = asyncio.run(_ask_boards(first.address(), RunKeys("outsider").group("diloco"), peer_ids))
    assert answers and all(not a.get("ok") and "v" not in a and "vals" not in a for a in answers), answers
    ports = []
    for peer in (first, second):
        listeners = _listeners(peer.process.pid)
        assert listeners and all(ip == "127.0.0.1" for ip, _ in listeners), listeners
        ports += [port for _, port in listeners]
    probed_from = max(e["outer_step"] for e in first.events("round"))
    probed = _as_tcpstore_client(ports)
    assert "a TCPStore answered" not in probed, probed
    step = max(e["outer_step"] for e in first.events("round")) + 3
    for peer in (first, second):
        peer.wait_event("round", lambda e: e["outer_step"] >= step, timeout=120)
    interrupt_all((first, second))
    for peer in (first, second):
        # Up to `step` (the last round may be cut by Ctrl+C).
        rounds = [r for r in peer.events("round") if r["outer_step"] <= step]
        assert [r["outer_step"] for r in rounds] == list(range(1, step + 1))
        # Nothing the outsider did failed a ring (no tampered sum, no ring that could not be set
        # up), and the rounds while it probed were direct pair rounds like the others.
        assert not [r for r in rounds if "direct data plane" in (r["alone_reason"] or "")], rounds
        during = [
            (r["outer_step"], r["group_size"], r["plane"]) for r in rounds if r["outer_step"] > probed_from
        ]
        assert all(g == 2 and plane == "direct" for _, g, plane in during), during
    norms = [{r["outer_step"]: r["global_norm"] for r in p.events("round")} for p in (first, second)]
    assert math.isclose(norms[0][step], norms[1][step], rel_tol=1e-6), (step, norms)


def test_a_private_run_keeps_its_updates_on_the_encrypted_path(spawn):
    common = [*FAST, "--rounds", "2", "--min-peers", "2", "--run-id", "private", "--secret", "s3cret-words"]
    first = spawn("a", "start", *common)
    second = spawn("b", "join", first.address(), *common)
    for peer in (first, second):
        assert peer.wait() == 0, peer.stderr()[-3000:]
        assert [(r["group_size"], r["plane"]) for r in peer.events("round")] == [(2, "hivemind")] * 2
        assert "hivemind's encrypted path" in peer.stderr()


def test_a_peer_behind_nat_falls_back_to_hivemind_cleanly(spawn):
    """A peer in client mode (it accepts no connections, as behind NAT) says nothing of a direct
    plane: its groups average over hivemind's path, every round, with no error in any log."""
    common = [*FAST, "--rounds", "3", "--min-peers", "2", "--run-id", "behind-nat"]
    first = spawn("a", "start", *common)
    second = spawn("b", "join", first.address(), *common, "--client-mode")
    for peer in (first, second):
        assert peer.wait() == 0, peer.stderr()[-3000:]
        assert [(r["group_size"], r["plane"]) for r in peer.events("round")] == [(2, "hivemind")] * 3
        assert "Traceback" not in peer.stderr() and "direct data plane" not in peer.stderr()
    assert max_abs_diff(first.global_params(), second.global_params()) <= 1e-5


@NETNS
@pytest.mark.skipif(bool(netlab.unavailable()), reason=f"netlab: {netlab.unavailable()}")
def test_the_readme_multi_machine_flags_get_the_direct_plane(tmp_path):
    """Two peers in their own network namespaces, started exactly as the README says for
    machines on a network (--host 0.0.0.0 --port P --announce /ip4/IP/tcp/P): every round is
    averaged as a pair over the direct plane, and the logs hold no C++ stack dump. The joiner
    lies about its weight in its first round (the lab's fault: 1e9 samples claimed): both count
    it as 16x the other's (optim.robust.counted_weights), name it, and still agree."""
    from tests.integration.test_netlab import run_pair

    faults = tmp_path / "faults.json"
    FaultPlan(overclaim_next=1).write(faults)
    with netlab.NetLab(2, rate=None) as lab:
        common = [*FAST, "--run-id", "readme", "--rounds", "4"]

        def network(i: int) -> list[str]:
            return [*readme_flags(lab, i), *(["--fault-file", str(faults)] if i == 1 else [])]

        peers = run_pair(lab, tmp_path, common, network)
    for peer in peers:
        assert [(r["group_size"], r["plane"]) for r in peer.events("round")] == [(2, "direct")] * 4
        assert "frame #" not in peer.stderr() and "Traceback" not in peer.stderr()
        assert peer.stderr().count("claimed 1e+09 samples, counted as") == 1, peer.stderr()[-3000:]
    assert "fault injection: claiming 1e+09 samples" in peers[1].stderr()
    assert max_abs_diff(peers[0].global_params(), peers[1].global_params()) <= 1e-5


def _ports_in_its_namespace(pid: int, skip: str) -> set[int]:
    """The TCP ports that a process in a network namespace of its own and its children (but
    those named ``skip``) listen on (psutil reads this process's namespace's tables)."""
    inodes = set()
    for process in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, FileNotFoundError):
            if process.name() != skip:
                for fd in os.listdir(f"/proc/{process.pid}/fd"):
                    with contextlib.suppress(OSError):
                        link = os.readlink(f"/proc/{process.pid}/fd/{fd}")
                        if link.startswith("socket:["):
                            inodes.add(link[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


FLOOD_EVERY_PORT = """
import os, socket, struct, sys, time
host, count, stop, ports = sys.argv[1], int(sys.argv[2]), sys.argv[3], [int(p) for p in sys.argv[4:]]
held, opened = [], {}
for port in ports:
    opened[port] = 0
    for sequence in range(count):
        try:
            connection = socket.create_connection((host, port), timeout=3)
            connection.sendall(struct.pack("<Q", 10**6 + sequence))  # a ring's sequence number nobody waits for
        except OSError:  # closed under it (the ring's listener), or refused
            break
        held.append(connection)
        opened[port] += 1
print("opened", opened, flush=True)
deadline = time.monotonic() + 20
while not os.path.exists(stop) and time.monotonic() < deadline:
    time.sleep(0.05)  # held until the test has seen the peer's answer (its watch looks every 0.2 s)
for connection in held:
    connection.close()
"""


@NETNS
@pytest.mark.skipif(bool(netlab.unavailable()), reason=f"netlab: {netlab.unavailable()}")
def test_a_flood_from_another_machine_at_a_peer_s_ports_costs_it_no_round(tmp_path):
    """Two machines with the README's flags average as a pair over the direct plane; from a
    third, an outsider opens FLOOD + 100 connections to every port the first peer listens on
    but its p2p port (the kept ring's gloo listener, which keeps each one for the ring's life,
    and the state listener among them), each sending a sequence number no round waits for.
    The peer closes its kept ring and says so, and the pair goes on averaging in pairs over the
    direct plane on one θ (before, 500 such connections were 500 open files and gloo aborted
    the process at the open-files limit)."""
    from swarm.dataplane import FLOOD

    with netlab.NetLab(3, rate=None) as lab:
        common = [*FAST, "--min-peers", "2", "--run-id", "flood"]
        first = lab_peer(lab, 0, "a", ["start", *common, *readme_flags(lab, 0)], tmp_path)
        peers = [first]
        try:
            address = next(a for a in first.wait_event("started")["addresses"] if lab.address(0) in a)
            peers.append(lab_peer(lab, 1, "b", ["join", address, *common, *readme_flags(lab, 1)], tmp_path))
            first.wait_event("round", lambda e: e["outer_step"] >= 2 and e["plane"] == "direct", timeout=120)
            flooded_from = max(e["outer_step"] for e in first.events("round"))
            floods = []
            for attempt in range(3):  # a ring set up again meanwhile listens on another port
                ports = sorted(_ports_in_its_namespace(first.process.pid, skip="p2pd"))
                stop = tmp_path / f"flood-{attempt}"
                flood = subprocess.Popen(
                    lab.command(2, [sys.executable, "-c", FLOOD_EVERY_PORT, lab.address(0), str(FLOOD + 100)])
                    + [str(stop), *map(str, ports)],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                )  # fmt: skip
                deadline = time.monotonic() + 20
                while "no round mate made" not in first.stderr() and time.monotonic() < deadline:
                    time.sleep(0.1)
                stop.touch()
                floods.append(flood.communicate(timeout=60))
                if "no round mate made" in first.stderr():
                    break
            step = max(e["outer_step"] for e in first.events("round")) + 3
            for peer in peers:
                peer.wait_event("round", lambda e: e["outer_step"] >= step, timeout=120)
            interrupt_all(peers)
        finally:
            for peer in peers:
                peer.kill()
    log = first.stderr()
    assert "connections that no round mate made" in log, (floods, log[-3000:])
    for peer in peers:
        assert "frame #" not in peer.stderr() and "Traceback" not in peer.stderr()
        rounds = [r for r in peer.events("round") if flooded_from < r["outer_step"] <= step]
        assert [r["outer_step"] for r in rounds] == list(range(flooded_from + 1, step + 1)), rounds
        # Every round a pair round; the one the flood hit may have fallen back to hivemind's path
        # (its ring set up again beside the strangers' connections), the rest are direct.
        assert all(r["group_size"] == 2 for r in rounds), rounds
        assert sum(r["plane"] != "direct" for r in rounds) <= 1 and rounds[-1]["plane"] == "direct", rounds
    norms = [{r["outer_step"]: r["global_norm"] for r in p.events("round")} for p in peers]
    assert math.isclose(norms[0][step], norms[1][step], rel_tol=1e-6), (step, norms)


@NETNS
@pytest.mark.skipif(bool(netlab.unavailable()), reason=f"netlab: {netlab.unavailable()}")
def test_a_second_peer_cannot_squat_a_running_peers_port_or_folder(tmp_path):
    """On one machine (namespace), with the README's flags: a second `workbench start` on the
    port a peer listens on used to start (hivemind's daemon binds with SO_REUSEPORT) and take
    some of the connections meant for the first; one on its --run-dir shared its key, so its
    peer id. Both are refused with one line, and a peer from another machine still joins the
    first and averages with it."""
    port = README_PORT
    with netlab.NetLab(2, rate=None) as lab:
        common = [*FAST, "--run-id", "squat", "--rounds", "2"]
        first = lab_peer(lab, 0, "a", ["start", *common, "--min-peers", "2", *readme_flags(lab, 0)], tmp_path)
        peers = [first]
        try:
            address = next(a for a in first.wait_event("started")["addresses"] if lab.address(0) in a)
            attempts = {
                "port": [*readme_flags(lab, 0), "--run-dir", str(tmp_path / "c")],
                "folder": ["--run-dir", str(tmp_path / "a")],
            }
            for what, flags in attempts.items():
                squatter = subprocess.run(
                    lab.command(0, [sys.executable, "-m", "workbench", "start", *common, *flags]),
                    capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL,
                )  # fmt: skip
                errors = [line for line in squatter.stderr.splitlines() if line.startswith("error: ")]
                expected = (
                    f"port {port} on 0.0.0.0 is already in use" if what == "port" else "is in use by another"
                )
                assert squatter.returncode == 2 and len(errors) == 1 and expected in errors[0], (
                    squatter.stderr
                )
            joiner = lab_peer(lab, 1, "b", ["join", address, *common, *readme_flags(lab, 1)], tmp_path)
            peers.append(joiner)
            for peer in peers:
                assert peer.wait(timeout=180) == 0, peer.stderr()[-3000:]
        finally:
            for peer in peers:
                peer.kill()
    assert [r["group_size"] for r in joiner.events("round")] == [2, 2]
    assert first.events("started")[0]["peer_id"] != joiner.events("started")[0]["peer_id"]


@NETNS
@pytest.mark.skipif(bool(netlab.unavailable()), reason=f"netlab: {netlab.unavailable()}")
def test_a_private_run_across_machines_averages_on_hivemind_s_path(tmp_path):
    """A private run between two network namespaces, started with the README's multi-machine
    flags: its rounds go over hivemind's encrypted streams between the announced addresses
    (the members' check through the leader's board too), and with fp16 both peers end on the
    same bits (swarm.butterfly). The same flags' public run takes the direct plane (above)."""
    from tests.integration.test_netlab import run_pair

    with netlab.NetLab(2, rate=None) as lab:
        common = [*FAST, "--run-id", "readme-private", "--secret", "two machines", "--codec", "fp16"]
        peers = run_pair(lab, tmp_path, [*common, "--rounds", "4"], lambda i: readme_flags(lab, i))
    for peer in peers:
        log = peer.stderr()
        assert "hivemind's encrypted path" in log and "frame #" not in log and "Traceback" not in log
        rounds = [(r["outer_step"], r["group_size"], r["plane"], r["resync"]) for r in peer.events("round")]
        assert [r[1:3] for r in rounds] == [(2, "hivemind")] * 4, rounds
        assert not any(r[3] for r in rounds), rounds  # the same bits after every round: no resync
    params = [p.global_params() for p in peers]
    assert all(torch.equal(x, y) for x, y in zip(*params))


STRANGER = """
import json, os, socket, sys, threading, time
from swarm.state_transfer import INDEX, MAX_CONNECTIONS, TOKEN_BYTES
host, port = sys.argv[1], int(sys.argv[2])
results = {}

def attack(name, payload):
    started, got = time.monotonic(), b""
    try:
        with socket.create_connection((host, port), timeout=20) as s:
            try:
                s.sendall(payload)
            except OSError:  # reset by the donor: what it sent before is still read below
                pass
            try:
                while chunk := s.recv(65536):
                    got += chunk
            except TimeoutError:  # still open after 20 s
                got = None
            except OSError:  # reset: closed
                pass
    except OSError as error:  # could not connect at all
        results[name] = {"bytes": -2, "error": repr(error)}
        return
    results[name] = {"bytes": -1 if got is None else len(got), "seconds": time.monotonic() - started}

def together(attacks):
    threads = [threading.Thread(target=attack, args=item) for item in attacks.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

# The token check first (each connection gets a slot), then a flood of idle connections.
together({"silent": b"", "a made-up token": os.urandom(TOKEN_BYTES) + INDEX.pack(0), "garbage": os.urandom(4096)})
together({f"flood {i}": b"" for i in range(MAX_CONNECTIONS + 8)})
print(json.dumps(results))
"""
"""A stranger on another machine at a donor's state listener, as the README deploys it: no
token, a made-up one and garbage at once, then a flood of idle connections."""


@NETNS
@pytest.mark.skipif(bool(netlab.unavailable()), reason=f"netlab: {netlab.unavailable()}")
def test_a_joiner_on_another_machine_downloads_over_the_direct_transport(tmp_path):
    """Three network namespaces, the README's multi-machine flags: a joiner that comes in while
    two peers train gets its offers over hivemind, its slices over TCP from the donors'
    listeners on their announced addresses, checks them, and then averages with both. The
    first donor lies in its offer, naming a service on the joiner's own loopback as its
    listener: the joiner ignores that offer, the service gets no connection (so no token), and
    the honest donor serves. A stranger on the joiner's machine then tries the first donor's
    listener without the token of an offer: it gets not one byte, every connection is closed
    within the token's wait, and the three go on averaging."""
    service = README_PORT + 1
    # Its own fault file (after common's, which paces the others: steady) paces it as well.
    FaultPlan(offer_loopback_port=service, throttle_ms=STEADY_MS).write(tmp_path / "liar.json")
    with netlab.NetLab(3, rate=None) as lab, _service_on_loopback(lab, 2, service) as connections:
        peers, _, together, attacked = _a_third_machine_joins(
            lab,
            tmp_path,
            [*FAST, "--run-id", "readme-join", *steady(tmp_path)],
            first_flags=["--fault-file", str(tmp_path / "liar.json")],
            after_download=lambda first: _stranger_at_the_state_listener(lab, first),
        )
    first, joiner = peers[0], peers[2]
    log = joiner.stderr()
    assert "downloaded the state at outer step" in log, log[-3000:]  # the direct transport
    # ...and checked by the third peer across namespaces (its θ's sketches under the joiner's
    # seed), not taken because "no other peer answered".
    assert "confirmed by" in log or "moved past outer step" in log, log[-3000:]
    assert connections() == [], connections()  # the joiner never sent its token there
    liar = first.wait_event("started")["peer_id"][-8:]
    assert f"ignoring {liar}'s direct state offer" in log, log[-3000:]
    assert "frame #" not in log and "Traceback" not in log
    assert together["plane"] == "direct"
    assert len(attacked) == 3 + MAX_CONNECTIONS + 8, attacked
    assert all(r["bytes"] == 0 for r in attacked.values()), attacked
    assert max(r["seconds"] for r in attacked.values()) < TOKEN_WAIT + 5, attacked
    # The same θ at every round the three averaged together (each round's all-gathered
    # fingerprints would have sent one of them to download the state otherwise).
    mates = {r["outer_step"]: r for r in first.events("round") if r["group_size"] == 3}
    shared = [r for r in joiner.events("round") if r["group_size"] == 3 and r["outer_step"] in mates]
    assert shared and all(not r["resync"] for r in shared), shared


FRESH_KEYS = """
import asyncio, json, os, socket, sys, time
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2
from swarm.group_averager import GroupAverager
from swarm.rendezvous import pack, unpack
from swarm.state_transfer import INDEX

address, prefix, donor, keys, here, stop = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6]

def alive(connection):  # what the donor sent is read (a peek would see it after the donor closed)
    try:
        while connection.recv(1 << 16, socket.MSG_DONTWAIT):
            pass
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False

async def main():
    nodes = [await P2P.create(initial_peers=[address], host_maddrs=[f"/ip4/{here}/tcp/0"]) for _ in range(keys)]
    held, most, served = {}, 0, 0
    while not os.path.exists(stop):
        for i, node in enumerate(nodes):  # each key keeps a connection served, or gets a new offer
            if i in held and alive(held[i]):
                continue
            held.pop(i, None)
            stub = GroupAverager.get_stub(node, PeerID.from_base58(donor), namespace=prefix)
            try:
                answer = await stub.rpc_state_offer(averaging_pb2.DownloadData(metadata=pack({})), timeout=10)
                offer = unpack(answer.metadata)
                host, port = offer["address"]
                connection = socket.create_connection((host, port), timeout=5)
                connection.sendall(offer["token"] + INDEX.pack(0))  # then asks for nothing more
                connection.settimeout(2)
                if connection.recv(65536):
                    held[i], served = connection, served + 1
                else:
                    connection.close()
            except Exception:  # refused, reset, no offer: try again next pass
                pass
        most = max(most, len(held))
        print(json.dumps({"holding": len(held)}), flush=True)
        await asyncio.sleep(0.5)
    print(json.dumps({"most": most, "served": served}), flush=True)
    for node in nodes:
        await node.shutdown()

asyncio.run(main())
"""
"""Fresh keys on one machine, each asking a donor for an offer and keeping a connection with
its token served (asking for nothing after the first slice; a new offer once it is cut),
until the ``stop`` file appears."""


@contextlib.contextmanager
def _fresh_keys_beside_a_peer(
    tmp_path: Path, lab: Any, run_id: str, flags: list[str], script: str, count: int
) -> Iterator[Any]:
    """On the lab's machine 0, peer a of run ``run_id`` (FAST, ``flags`` and the README's
    flags), two rounds in; on machine 1, ``script`` for ``count`` fresh keys (its argv: a's
    address, its group's key prefix, its peer id, ``count``, machine 1's address, the stop
    file). Yields ``run``: ``keys`` (their process, stdout piped), ``peers`` (a, and those
    ``run.join(machine, name)`` started), ``stop``; when the block ends the stop file is
    touched and every process killed."""
    from types import SimpleNamespace

    from swarm.records import RunKeys

    stop = tmp_path / "stop"
    common = [*FAST, "--run-id", run_id, *flags]
    first = lab_peer(lab, 0, "a", ["start", *common, *readme_flags(lab, 0)], tmp_path)
    run = SimpleNamespace(peers=[first], keys=None, stop=stop)
    try:
        started = first.wait_event("started")
        address = next(a for a in started["addresses"] if lab.address(0) in a)
        first.wait_event("round", lambda e: e["outer_step"] >= 2, timeout=120)
        argv = [address, RunKeys(run_id).group("diloco"), started["peer_id"]]
        argv += [str(count), lab.address(1), str(stop)]
        run.keys = subprocess.Popen(
            lab.command(1, [sys.executable, "-c", script, *argv]),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip

        def join(machine: int, name: str):
            argv = ["join", address, *common, *readme_flags(lab, machine)]
            run.peers.append(lab_peer(lab, machine, name, argv, tmp_path))
            return run.peers[-1]

        run.join = join
        yield run
    finally:
        stop.touch()
        if run.keys is not None:
            kill_group(run.keys)
        for peer in run.peers:
            peer.kill()


@NETNS
@pytest.mark.skipif(bool(netlab.unavailable()), reason=f"netlab: {netlab.unavailable()}")
def test_fresh_keys_on_one_machine_leave_a_joiner_its_direct_download(tmp_path):
    """A peer on one machine with the README's flags; on a second, MAX_CONNECTIONS + 2 fresh
    keys each take an offer of its state and keep a connection served (a new offer whenever it
    is cut); from a third, a joiner. The keys' machine holds at most MAX_PER_ADDRESS of the
    donor's slots, and the joiner downloads over the direct transport beside them (before, the
    keys held every slot, and joiners fell back to hivemind's stream)."""
    from swarm.state_transfer import MAX_PER_ADDRESS

    with (
        netlab.NetLab(3, rate=None) as lab,
        _fresh_keys_beside_a_peer(
            tmp_path, lab, "fresh-keys", steady(tmp_path), FRESH_KEYS, MAX_CONNECTIONS + 2
        ) as run,
    ):
        deadline = time.monotonic() + 180  # the keys hold their slots before the joiner comes
        while time.monotonic() < deadline:
            if not select.select([run.keys.stdout], [], [], 1.0)[0]:
                continue
            line = run.keys.stdout.readline()
            if not line or json.loads(line).get("holding", 0) >= MAX_PER_ADDRESS:
                break
        joiner = run.join(2, "d")
        joiner.wait_event("round", lambda e: e["group_size"] == 2, timeout=120)
        run.stop.touch()
        out, err = run.keys.communicate(timeout=60)
        interrupt_all(run.peers)
    first = run.peers[0]
    verdict = json.loads(out.strip().splitlines()[-1])
    assert verdict["most"] == MAX_PER_ADDRESS, (verdict, err[-2000:])
    log = joiner.stderr()
    assert "downloaded the state at outer step" in log, log[-3000:]  # the direct transport
    assert "direct state download failed" not in log, log[-3000:]
    assert "frame #" not in first.stderr() and "Traceback" not in first.stderr()


STREAM_KEYS = """
import asyncio, json, os, sys
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2
from swarm.group_averager import GroupAverager

address, prefix, donor, keys, here, stop = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6]

async def main():
    nodes = [await P2P.create(initial_peers=[address], host_maddrs=[f"/ip4/{here}/tcp/0"]) for _ in range(keys)]
    held = []
    for node in nodes:  # each key opens the state's stream and reads its first part only
        stub = GroupAverager.get_stub(node, PeerID.from_base58(donor), namespace=prefix)
        try:
            stream = await asyncio.wait_for(stub.rpc_download_state(averaging_pb2.DownloadRequest()), 10)
            await asyncio.wait_for(stream.__anext__(), 10)
            held.append(stream)
        except (Exception, StopAsyncIteration):  # refused: an empty stream
            pass
    print(json.dumps({"held": len(held)}), flush=True)
    while not os.path.exists(stop):
        await asyncio.sleep(0.2)
    for node in nodes:
        await node.shutdown()

asyncio.run(main())
"""
"""Fresh keys on one machine, each opening a donor's hivemind state stream and then reading no
more of it, until the ``stop`` file appears: how many streams they got."""


@NETNS
@pytest.mark.skipif(bool(netlab.unavailable()), reason=f"netlab: {netlab.unavailable()}")
def test_fresh_keys_on_one_machine_leave_a_joiner_a_state_stream(tmp_path):
    """hivemind's state stream (``--data-plane hivemind``; the direct transport's fallback), on
    machines started with the README's flags: MAX_STREAMS fresh keys on one machine each open
    the donor's stream and stop reading. They get one stream between them, and a joiner on a
    third machine downloads the state beside it (before, they held all MAX_STREAMS, and the
    donor refused the joiner until it cut them)."""
    from swarm.state_sharing import MAX_STREAMS

    flags = ["--data-plane", "hivemind", *steady(tmp_path)]
    with (
        netlab.NetLab(3, rate=None) as lab,
        _fresh_keys_beside_a_peer(tmp_path, lab, "stream-keys", flags, STREAM_KEYS, MAX_STREAMS) as run,
    ):
        assert select.select([run.keys.stdout], [], [], 120)[0], "the keys never reported"
        held = json.loads(run.keys.stdout.readline() or "{}")
        joiner = run.join(2, "d")
        joiner.wait_event("round", lambda e: e["group_size"] == 2, timeout=120)
        run.stop.touch()
        run.keys.communicate(timeout=60)
        interrupt_all(run.peers)
    first = run.peers[0]
    assert held == {"held": 1}, held
    joined = joiner.wait_event("started")["peer_id"]
    assert joiner.events("state_downloaded"), joiner.stderr()[-3000:]
    assert f"not serving the state to {joined[-8:]}" not in first.stderr(), first.stderr()[-3000:]
    assert "Traceback" not in first.stderr()


@pytest.mark.faults
@NETNS
@pytest.mark.skipif(bool(netlab.unavailable()), reason=f"netlab: {netlab.unavailable()}")
def test_an_overlapped_run_on_three_machines_takes_in_a_joiner(tmp_path):
    """--overlap across three network namespaces, with the README's multi-machine flags: the
    joiner gets the state over the direct transport while the round in flight is still being
    averaged (overlapped donors keep no ready snapshot: each makes one when asked), another peer
    confirms it, and the three then average with one θ."""
    with netlab.NetLab(3, rate=None) as lab:
        peers, downloaded, _, _ = _a_third_machine_joins(
            lab, tmp_path, [*FAST, "--run-id", "overlap-join", "--overlap"]
        )
    first, joiner = peers[0], peers[2]
    log = joiner.stderr()
    assert downloaded["outer_step"] >= 2, downloaded
    assert "downloaded the state at outer step" in log, log[-3000:]  # the direct transport
    assert "confirmed by" in log or "moved past outer step" in log, log[-3000:]
    for peer in peers:
        assert "frame #" not in peer.stderr() and "Traceback" not in peer.stderr(), peer.stderr()[-3000:]
    # The same θ at every round the three averaged together: no resync after the first.
    mates = {r["outer_step"] for r in first.events("round") if r["group_size"] == 3}
    shared = [r for r in joiner.events("round") if r["group_size"] == 3 and r["outer_step"] in mates]
    assert len(shared) >= 2 and all(not r["resync"] for r in shared), shared
    assert {r["plane"] for r in shared} == {"direct"}, shared


def _a_third_machine_joins(
    lab: netlab.NetLab,
    tmp_path,
    common: list[str],
    *,
    first_flags: Sequence[str] = (),
    after_download: Callable[[PeerProcess], Any] = lambda first: None,
) -> tuple[list[PeerProcess], dict, dict, Any]:
    """Peers a and b train on the lab's machines 0 and 1 (the README's flags, ``common``, a
    with ``first_flags``) until they averaged twice; c joins from machine 2 and downloads the
    state (``after_download(a)`` runs then), the three average 3 more rounds and all are
    stopped with Ctrl+C. Returns [a, b, c], c's first download, its first round of three and what
    ``after_download`` gave."""
    peers: list[PeerProcess] = []

    def start(i: int, args: list[str], flags: Sequence[str] = ()) -> PeerProcess:
        argv = [*args, *common, *flags, "--rounds", "0", *readme_flags(lab, i)]  # flags: after common's
        peers.append(lab_peer(lab, i, "abc"[i], argv, tmp_path))
        return peers[-1]

    try:
        first = start(0, ["start", "--min-peers", "2"], first_flags)
        address = next(a for a in first.wait_event("started")["addresses"] if lab.address(0) in a)
        start(1, ["join", address])
        first.wait_event("round", lambda e: e["outer_step"] >= 2 and e["group_size"] == 2, timeout=120)
        joiner = start(2, ["join", address])
        downloaded = joiner.wait_event("state_downloaded", timeout=120)
        extra = after_download(first)
        # Three rounds of three, then stop all at once (the last round may be cut short).
        together = joiner.wait_event("round", lambda e: e["group_size"] == 3, timeout=120)
        first.wait_event("round", lambda e: e["outer_step"] >= together["outer_step"] + 3, timeout=120)
        interrupt_all(peers)
    finally:
        for peer in peers:
            peer.kill()
    return peers, downloaded, together, extra


SERVICE = """
import socket, sys
with socket.create_server(("127.0.0.1", int(sys.argv[1]))) as server:
    print("listening", flush=True)
    while True:
        connection, address = server.accept()
        connection.settimeout(2)
        try:
            got = connection.recv(4096)
        except OSError:
            got = b""
        print(f"connection from {address[0]}: {len(got)} bytes", flush=True)
        connection.close()
"""
"""A TCP service on a machine's loopback that tells who connects to it."""


@contextlib.contextmanager
def _service_on_loopback(lab: netlab.NetLab, i: int, port: int) -> Iterator[Callable[[], list[str]]]:
    """SERVICE on ``lab``'s machine ``i``; yields a call that stops it and returns the
    connections it had."""
    process = subprocess.Popen(
        lab.command(i, [sys.executable, "-c", SERVICE, str(port)]), stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline().strip() == "listening"

        def connections() -> list[str]:
            process.kill()
            return process.communicate(timeout=30)[0].splitlines()

        yield connections
    finally:
        process.kill()
        process.wait(timeout=30)


def _stranger_at_the_state_listener(lab: netlab.NetLab, donor: PeerProcess) -> dict:
    """What the stranger (STRANGER, in namespace 2) got from ``donor``'s state listener, per
    connection: the bytes it received and the seconds until the donor closed it."""
    found = re.search(r"serving the state to joiners on ([\d.]+):(\d+)", donor.stderr())
    assert found, donor.stderr()[-3000:]
    run = subprocess.run(
        lab.command(2, [sys.executable, "-c", STRANGER, *found.groups()]),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@pytest.mark.parametrize(
    "how",
    [
        pytest.param("SIGTERM to the peer", marks=pytest.mark.faults),
        "SIGTERM to its process group",  # the case that printed children's tracebacks
        # its terminal or SSH session closed (the same path; `make test` has the demo's SIGHUP test)
        pytest.param("SIGHUP to its process group", marks=pytest.mark.faults),
        pytest.param("Ctrl+C in its terminal", marks=pytest.mark.faults),
    ],
)
def test_a_stopped_peer_takes_its_children_along_without_a_traceback(spawn, how):
    """A service manager's SIGTERM, a closed terminal's group-wide signal, Ctrl+C: the peer and
    its child processes (hivemind's DHT, averager and p2p daemons) end, with no traceback."""
    import os

    common = [*FAST, "--run-id", f"stop-{len(how)}", "--rounds", "0"]
    first = spawn("a", "start", *common, "--min-peers", "2")
    second = spawn("b", "join", first.address(), *common)
    second.wait_event("round", lambda e: e["outer_step"] >= 2)
    children = psutil.Process(second.process.pid).children(recursive=True)
    assert children
    if how == "SIGTERM to the peer":
        second.process.send_signal(signal.SIGTERM)
    else:
        sent = {"SIGTERM": signal.SIGTERM, "SIGHUP": signal.SIGHUP}.get(how.split()[0], signal.SIGINT)
        os.killpg(second.process.pid, sent)
    stopping = time.monotonic()
    assert second.wait(timeout=30) == 0, second.stderr()[-8000:]
    gone, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, [p.cmdline()[:3] for p in alive]
    assert time.monotonic() - stopping < 10.0  # the peer and all its processes
    assert "Traceback" not in second.stderr() and "Task exception was never retrieved" not in second.stderr()
    first.process.send_signal(signal.SIGINT)
    assert first.wait(timeout=30) == 0
