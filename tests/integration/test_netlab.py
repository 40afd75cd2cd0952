"""Peers in their own network namespaces behind links capped with tc (workbench.local.netlab).

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from tests.integration.conftest import FAST, NETNS, PeerProcess, lab_peer
from workbench.local import netlab

pytestmark = [
    pytest.mark.skipif(bool(netlab.unavailable()), reason=f"netlab: {netlab.unavailable()}"),
    NETNS,
]

RECEIVE = """
import socket, sys, time
server = socket.create_server((sys.argv[1], 47001)); print("ready", flush=True)
connection, _ = server.accept(); total = len(connection.recv(1 << 20)); started = time.monotonic()
while chunk := connection.recv(1 << 20): total += len(chunk)
print(total, time.monotonic() - started, flush=True)
"""
SEND = """
import socket, sys
connection = socket.create_connection((sys.argv[1], 47001)); block = bytes(1 << 20)
for _ in range(int(sys.argv[2])): connection.sendall(block)
connection.close()
"""


def test_a_capped_link_carries_no_more_than_its_rate():
    with netlab.NetLab(2, rate="40mbit") as lab:
        receiver = subprocess.Popen(
            lab.command(1, [sys.executable, "-c", RECEIVE, lab.address(1)]), stdout=subprocess.PIPE, text=True
        )
        assert receiver.stdout.readline().strip() == "ready"
        subprocess.run(lab.command(0, [sys.executable, "-c", SEND, lab.address(1), "8"]), check=True)
        total, seconds = receiver.communicate(timeout=30)[0].split()
    assert int(total) == 8 << 20
    megabits_per_second = 8 * int(total) / 1e6 / float(seconds)
    # Timed at the receiver, from the first chunk to the last: the cap, give or take tbf's burst.
    assert 0.5 * 40 < megabits_per_second < 1.1 * 40, megabits_per_second


def test_a_lab_takes_names_and_a_subnet_nothing_here_holds():
    """A lab left by a killed run keeps its namespaces, bridge and route: a later lab with the
    same tag (process ids 10,000 apart) failed with "File exists", one 150 tags apart routed
    10.x.0.0/24 twice (a review, stop 59). Each lab now takes the first free tag from its own."""
    with netlab.NetLab(2, rate=None) as first:
        second = netlab.NetLab(2, rate=None)
        second._name(first.tag)  # as a process id 10,000 apart would
        with second:
            assert second.bridge != first.bridge and second.subnet != first.subnet
            routes = subprocess.run(["ip", "-o", "route"], capture_output=True, text=True).stdout
            for lab in (first, second):
                assert routes.count(f"10.{lab.subnet}.0.0/24 dev {lab.bridge}") == 1, routes


@pytest.mark.faults
def test_peers_train_over_capped_links(tmp_path):
    """Two peers, each in its own namespace behind 20 Mbit/s: they find each other across the
    bridge, average every round, and each all-reduce takes at least what the cap allows."""
    rate_mbit = 20
    with netlab.NetLab(2, rate=f"{rate_mbit}mbit") as lab:
        common = [*FAST, "--run-id", "capped", "--rounds", "4", "--averaging-timeout", "20"]
        peers = run_pair(lab, tmp_path, common, lambda i: ["--host", lab.address(i)])
    for peer in peers:
        rounds = peer.events("round")
        assert [r["group_size"] for r in rounds] == [2] * 4, rounds
        for r in rounds:
            floor = 8 * r["bytes_sent"] / (rate_mbit * 1e6)
            assert r["averaging_seconds"] >= 0.9 * floor, (r["averaging_seconds"], floor)


def run_pair(
    lab: netlab.NetLab, tmp_path, common: list[str], network: Callable[[int], list[str]]
) -> list[PeerProcess]:
    """Peer "a" starts a run in namespace 0, "b" joins it from namespace 1 (through a's address
    on the lab's bridge), each with ``network(i)``'s flags; returns both once they exited 0."""
    peers: list[PeerProcess] = []

    def start(i: int, args: list[str]) -> PeerProcess:
        peers.append(lab_peer(lab, i, "ab"[i], [*args, *network(i)], tmp_path))
        return peers[-1]

    try:
        first = start(0, ["start", *common, "--min-peers", "2"])
        address = next(a for a in first.wait_event("started")["addresses"] if lab.address(0) in a)
        start(1, ["join", address, *common])
        for peer in peers:
            assert peer.wait(timeout=180) == 0, peer.stderr()[-3000:]
    finally:
        for peer in peers:
            peer.kill()
    return peers
