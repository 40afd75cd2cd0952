"""A witness of a join sketches θ in the peer's own process: it used to fetch the peer's whole
state (θ, momentum, AdamW's moments: 4x θ) through hivemind's hook, which copies it into shared
memory, for every witness request of every join of a state too big to be kept snapshotted."""

from __future__ import annotations

import asyncio
import contextlib
import secrets

import torch


async def _ask(address: str, prefix: str, peer: str, seeds: list[bytes]) -> list:
    """A stock hivemind node asks ``peer`` to witness under each seed: its answers, or errors."""
    from hivemind.p2p import P2P, PeerID
    from hivemind.proto import averaging_pb2

    from swarm.group_averager import GroupAverager
    from swarm.rendezvous import pack, unpack

    p2p = await P2P.create(initial_peers=[address], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    answers: list = []
    try:
        stub = GroupAverager.get_stub(p2p, PeerID.from_base58(peer), namespace=prefix)
        for seed in seeds:
            try:
                reply = await stub.rpc_theta_sketch(
                    averaging_pb2.DownloadData(metadata=pack({"seed": seed})), timeout=30
                )
                answers.append(unpack(reply.metadata))
            except Exception as error:  # noqa: BLE001 - the answer under test
                answers.append(error)
    finally:
        await p2p.shutdown()
    return answers


def test_a_witness_sketches_theta_in_the_peers_process_without_fetching_the_whole_state(monkeypatch):
    import time

    from hivemind import DHT

    import swarm.state_sharing
    from optim.state import OuterState
    from swarm.group_averager import GroupAverager
    from swarm.sketch import state_sketches

    theta = [torch.randn(300, 40), torch.randn(40)]
    asked = {"state": 0, "theta": 0}

    def whole_state() -> OuterState:
        asked["state"] += 1
        return OuterState(outer_step=7, params=theta, momentum=theta, inner=[torch.zeros(12000)] * 2)

    def theta_only() -> OuterState:
        asked["theta"] += 1
        if asked["theta"] == 2:
            time.sleep(4.0)  # answered after the averager process stopped waiting (3 s here)
        if asked["theta"] == 3:
            raise RuntimeError("the outer loop is not built yet")
        return OuterState(outer_step=7, params=[t.clone() for t in theta], momentum=theta)

    monkeypatch.setattr(swarm.state_sharing, "WITNESS_SECONDS", 3.0)  # the averager process forks it

    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = None
    try:
        averager = GroupAverager(
            [torch.zeros(12040)], dht, prefix="witness", state_provider=whole_state, theta_provider=theta_only,
            target_group_size=2, ready_snapshots=False, start=True,
        )  # fmt: skip
        seeds = [secrets.token_bytes(16) for _ in range(4)]
        address = str(dht.get_visible_maddrs()[0])
        answers = asyncio.run(_ask(address, "witness", dht.peer_id.to_base58(), seeds))
        # The second came too late and the third failed in the peer's process; the late answer
        # is not taken for the third's or the fourth's (their seeds differ), and the fourth is
        # answered.
        for index in (0, 3):
            answer = answers[index]
            assert isinstance(answer, dict) and answer["ok"] and answer["outer_step"] == 7, answer
            assert answer["sketches"] == [s.to_bytes() for s in state_sketches(theta, seeds[index])]
        assert isinstance(answers[1], Exception) and "within 3 s" in str(answers[1]), answers[1]
        assert isinstance(answers[2], Exception) and "not built yet" in str(answers[2]), answers[2]
        assert asked == {"state": 0, "theta": 4}
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()


async def _give_up(address: str, prefix: str, peer: str, count: int, after: float) -> None:
    """A stock hivemind node asks ``peer`` to witness ``count`` times, each time giving up
    after ``after`` s (its stream closes and hivemind cancels the handler)."""
    from hivemind.p2p import P2P, PeerID
    from hivemind.proto import averaging_pb2

    from swarm.group_averager import GroupAverager
    from swarm.rendezvous import pack

    p2p = await P2P.create(initial_peers=[address], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        stub = GroupAverager.get_stub(p2p, PeerID.from_base58(peer), namespace=prefix)
        for _ in range(count):
            request = averaging_pb2.DownloadData(metadata=pack({"seed": secrets.token_bytes(16)}))
            with contextlib.suppress(Exception):  # given up, as meant
                await stub.rpc_theta_sketch(request, timeout=after)
    finally:
        await p2p.shutdown()


def test_askers_that_give_up_leave_one_seed_in_the_peers_process_and_no_thread_behind():
    """Each request a caller abandoned used to hold a thread of the averager process's pool
    (where hivemind's all-reduce and the ring's checks run) while it waited for the peer's
    process, and still sent its seed there once the one before was answered: eight askers that
    gave up made the peer copy and sketch θ eight times, and the next honest request waited for
    all of them. Now the abandoned requests wait in the event loop for the one seed in flight,
    and send nothing."""
    import time

    from hivemind import DHT

    from optim.state import OuterState
    from swarm.group_averager import GroupAverager
    from swarm.sketch import state_sketches

    theta = [torch.randn(300, 40), torch.randn(40)]
    calls = []  # sketched in this process (the peer's), by its witness thread

    def slow_theta() -> OuterState:
        calls.append(time.monotonic())
        time.sleep(1.5)  # a round in flight (overlapped): θ is served when it lands
        return OuterState(outer_step=3, params=[t.clone() for t in theta], momentum=theta)

    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = None
    try:
        averager = GroupAverager(
            [torch.zeros(12040)], dht, prefix="witness", state_provider=lambda: None, theta_provider=slow_theta,
            target_group_size=2, ready_snapshots=False, start=True,
        )  # fmt: skip
        address, peer = str(dht.get_visible_maddrs()[0]), dht.peer_id.to_base58()
        started = time.monotonic()
        asyncio.run(_give_up(address, "witness", peer, count=8, after=0.3))
        span = time.monotonic() - started
        seed = secrets.token_bytes(16)
        started = time.monotonic()
        (answer,) = asyncio.run(_ask(address, "witness", peer, [seed]))
        waited = time.monotonic() - started
        assert isinstance(answer, dict) and answer["ok"] and answer["outer_step"] == 3, answer
        assert answer["sketches"] == [s.to_bytes() for s in state_sketches(theta, seed)]
        time.sleep(4.0)  # what the peer's process is still asked to sketch after that
        # One seed at a time: while the askers kept asking (and giving up), one per 1.5 s at most,
        # then the honest one's, and nothing after it. Before, the abandoned requests' seeds went
        # on reaching the peer's process, one per 1.5 s, after the honest answer.
        assert len(calls) <= 2 + span / 1.5 < 9, (len(calls), span, waited)
        assert waited < 8.0, waited
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()
