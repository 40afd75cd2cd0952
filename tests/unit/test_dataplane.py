"""The direct data plane's ring (swarm.dataplane) between local processes, without hivemind."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from swarm.dataplane import DirectPlane, free_port


def _member(rank: int, addresses: list[str], weights: list[float], codec: str, rounds: int, out) -> None:
    host, port = addresses[rank].rsplit(":", 1)
    plane = DirectPlane(host, int(port), addresses[rank])
    plane.serve()
    results = []
    for r in range(rounds):
        tensors = [torch.full((3, 4), float(rank + 1) * (r + 1)), torch.arange(5.0) * (rank + 1)]
        plane.all_reduce(
            tensors,
            group_id=f"round{r}".encode(),
            addresses=addresses,
            rank=rank,
            weight=weights[rank],
            total=sum(weights),
            codec=codec,
            timeout=20,
        )
        results.append([t.clone() for t in tensors])
    out.put((rank, results, len(plane._rings)))


@pytest.mark.parametrize("codec", ["none", "fp16"])
def test_three_members_get_the_same_weighted_mean(codec):
    context = mp.get_context("spawn")
    out = context.Queue()
    addresses = [f"127.0.0.1:{free_port('127.0.0.1')}" for _ in range(3)]
    weights = [1.0, 2.0, 5.0]
    members = [context.Process(target=_member, args=(r, addresses, weights, codec, 2, out)) for r in range(3)]
    for m in members:
        m.start()
    results = sorted(out.get(timeout=60) for _ in members)
    for m in members:
        m.join(timeout=30)
    mean = sum(w * (r + 1) for r, w in enumerate(weights)) / sum(weights)
    for _, rounds, rings in results:
        assert rings == 1  # the second round reused the first round's ring
        for r, (block, line) in enumerate(rounds):
            assert torch.allclose(block, torch.full((3, 4), mean * (r + 1)), rtol=1e-3)
            assert torch.allclose(line, torch.arange(5.0) * mean, rtol=1e-3)
    # Identical on every member, bit for bit: the robust checks read the same numbers everywhere.
    for _, rounds, _ in results[1:]:
        assert all(torch.equal(a, b) for ra, rb in zip(results[0][1], rounds) for a, b in zip(ra, rb))


def test_an_unreachable_member_fails_within_the_timeout():
    port = free_port("127.0.0.1")
    plane = DirectPlane("127.0.0.1", port, f"127.0.0.1:{port}")
    dead = f"127.0.0.1:{free_port('127.0.0.1')}"  # nobody serves the rendezvous there
    started = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - torch raises its own DistStoreError/RuntimeError
        plane.all_reduce(
            [torch.ones(4)],
            group_id=b"g",
            addresses=[dead, plane.advertise],
            rank=1,
            weight=1.0,
            total=2.0,
            codec="none",
            timeout=2,
        )
    assert time.monotonic() - started < 15
    assert not plane._rings
