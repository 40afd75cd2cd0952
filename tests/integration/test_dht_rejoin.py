"""Two peers whose DHTs forgot each other find each other again.

hivemind drops a peer from its routing table after one unanswered request. A peer frozen past
its connections' keepalive (a laptop asleep; make faults' frozen straggler) and its round mate
each dropped the other, and with no third node to introduce them, each trained alone for good.
Here two real DHT nodes are made to forget each other exactly so (their routing tables emptied),
and each one's progress board must see the other again once the other's last heartbeat expired.
"""

from __future__ import annotations

import time

import pytest

from swarm.dht import NetworkConfig, dht_time, visible_addresses
from swarm.progress import ProgressBoard
from swarm.records import PeerHeartbeat, RunKeys, Stage
from swarm.session import connect
from tests.integration.conftest import FAST, NETNS, PeerProcess, interrupt_all, lab_peer, readme_flags
from workbench.local import netlab

TTL = 3.0


async def _forget_everyone(_dht, node) -> int:
    """In a DHT's process: empty its routing table, as unanswered requests do."""
    table = node.protocol.routing_table
    uids = list(table.uid_to_peer_id)
    for uid in uids:
        del table[uid]
    return len(uids)


def _beat(session, board: ProgressBoard, name: str, addresses: list[str]) -> None:
    board.publish(
        PeerHeartbeat(
            peer_id=session.peer_id, name=name, stage=Stage.TRAINING, outer_step=3, inner_step=0,
            inner_steps=5, time=dht_time(), addresses=addresses,
        ),
        force=True,
    )  # fmt: skip


def _others_in_sight(sessions, boards, names, addresses, timeout: float) -> list[set[str]]:
    """Every board's view of the other peers, once each sees one (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        for session, board, name, own in zip(sessions, boards, names, addresses):
            _beat(session, board, name, own)
        seen = [
            {p.name for p in board.fetch().values() if p.peer_id != session.peer_id}
            for session, board in zip(sessions, boards)
        ]
        if all(seen) or time.monotonic() > deadline:
            return seen
        time.sleep(0.5)


def test_peers_whose_dhts_forgot_each_other_see_each_other_again():
    keys = RunKeys("rejoin")
    a = connect(NetworkConfig(), keys)
    b = None
    try:
        first = visible_addresses(a.dht)
        b = connect(NetworkConfig(initial_peers=first[:1]), keys)
        sessions = [a, b]
        boards = [ProgressBoard(s.store, keys, ttl=TTL, period=0.0) for s in sessions]
        names, addresses = ["a", "b"], [first, visible_addresses(b.dht)]
        assert _others_in_sight(sessions, boards, names, addresses, 30) == [{"b"}, {"a"}]

        assert [s.dht.run_coroutine(_forget_everyone) for s in sessions] == [1, 1]
        # Each keeps beating (into its own storage only now) until the other's last heartbeat
        # expired there: then neither sees the other, until the boards have their DHTs dial the
        # peers they saw.
        until = time.monotonic() + TTL + 1.0
        while time.monotonic() < until:
            for session, board, name, own in zip(sessions, boards, names, addresses):
                _beat(session, board, name, own)
            time.sleep(0.5)
        started = time.monotonic()
        seen = _others_in_sight(sessions, boards, names, addresses, 60)
        assert seen == [{"b"}, {"a"}], f"still apart after {time.monotonic() - started:.0f} s: {seen}"
    finally:
        for session in (b, a):
            if session is not None:
                session.close()


@pytest.mark.parametrize("address", ["/ip4/127.0.0.1/tcp/1", "nonsense", "/ip4/127.0.0.1/tcp/9/p2p/QmNope"])
def test_a_heartbeat_names_only_its_own_addresses_to_dial(address):
    """A heartbeat's addresses are a claim: only those under its writer's own peer id are kept
    (the connection's handshake then proves who answers)."""
    board = ProgressBoard(object(), RunKeys("rejoin"))
    beat = PeerHeartbeat(
        peer_id="QmWriter", name="w", stage=Stage.TRAINING, outer_step=0, inner_step=0, inner_steps=5,
        time=dht_time(), addresses=[address, "/ip4/127.0.0.1/tcp/2/p2p/QmWriter"],
    )  # fmt: skip
    board._keep_in_touch({"QmWriter": beat})
    assert dict(board._seen) == {"QmWriter": ["/ip4/127.0.0.1/tcp/2/p2p/QmWriter"]}


def test_fresh_keys_do_not_push_round_mates_out_of_the_peers_to_dial_again():
    """The peers dialed again after a freeze are the last 8 seen: 8 fresh keys with addresses
    of their own (their records after the honest ones') left a lone peer dialing none but them.
    Strangers are forgotten first; a peer this one averaged with, last."""
    from swarm.dht import REDIAL_PEERS

    board = ProgressBoard(object(), RunKeys("rejoin"))

    def beat(peer: str) -> PeerHeartbeat:
        return PeerHeartbeat(
            peer_id=peer, name=peer, stage=Stage.TRAINING, outer_step=0, inner_step=0, inner_steps=5,
            time=dht_time(), addresses=[f"/ip4/10.0.0.1/tcp/2/p2p/{peer}"],
        )  # fmt: skip

    honest = ["QmMate1", "QmMate2"]
    board.vouched = set(honest)  # as the averager sets it: its Vouching.vouched
    fakes = [f"QmFake{i}" for i in range(REDIAL_PEERS)]
    board._keep_in_touch({peer: beat(peer) for peer in [*honest, *fakes]})
    assert set(honest) <= set(board._seen) and len(board._seen) == REDIAL_PEERS


@pytest.mark.faults
@NETNS
@pytest.mark.skipif(bool(netlab.unavailable()), reason=f"netlab: {netlab.unavailable()}")
def test_peers_on_two_machines_find_each_other_after_their_link_was_down(tmp_path):
    """Two peers in their own network namespaces, started with the README's multi-machine
    flags (--host 0.0.0.0 --port P --announce /ip4/IP/tcp/P); the joiner's link goes down for
    25 s, and each trains alone meanwhile. Once the link is back both must average in pairs
    again, not train alone for the rest of the run.

    This outage does not leave the DHTs partitioned (measured: the test passes with the redial
    turned off too; a freeze between two rounds does, see the test above and make faults'
    frozen straggler), so it checks the recovery across machines as users deploy, not the
    redial itself."""

    from workbench.local.netlab import _ip

    with netlab.NetLab(2, rate=None) as lab:
        common = [*FAST, "--run-id", "rejoin", "--averaging-timeout", "8"]
        peers: list[PeerProcess] = []

        def start(i: int, args: list[str]) -> PeerProcess:
            peers.append(lab_peer(lab, i, "ab"[i], [*args, *readme_flags(lab, i)], tmp_path))
            return peers[-1]

        try:
            first = start(0, ["start", *common, "--min-peers", "2"])
            address = next(a for a in first.wait_event("started")["addresses"] if lab.address(0) in a)
            second = start(1, ["join", address, *common])
            second.wait_event("round", lambda e: e["outer_step"] >= 3 and e["group_size"] == 2, timeout=120)
            link = f"{lab.namespaces[1]}h"  # the joiner's cable, on the bridge's side
            _ip("link", "set", link, "down")
            try:
                time.sleep(25)
                cut_off = time.time()
                alone = [p.events("round")[-1]["group_size"] for p in peers]
            finally:
                _ip("link", "set", link, "up")
            assert alone == [1, 1], alone  # the outage did separate them
            for peer in peers:
                peer.wait_event("round", lambda e: e["time"] > cut_off and e["group_size"] == 2, timeout=90)
            interrupt_all(peers)
        finally:
            for peer in peers:
                peer.kill()
    for peer in peers:
        assert "frame #" not in peer.stderr() and "Traceback" not in peer.stderr()
