"""An averager's shutdown leaves nothing behind: hivemind never closed the averager process's
replica of the DHT's p2p client, and its unix socket file (``hivemind-p2pclient-*.sock``) stayed
in the temp folder, one per averager any peer, test or benchmark ever started."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def _listening_unix_sockets(pid: int) -> set[str]:
    """The paths of the unix sockets process ``pid`` holds open (by inode, from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    paths = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes:
            paths.add(fields[7])
    return paths


def test_an_averager_s_shutdown_removes_its_p2p_client_socket_file():
    from hivemind import DHT

    from swarm.group_averager import GroupAverager

    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        averager = GroupAverager(
            [torch.zeros(10)], dht, prefix="cleanup", state_provider=None, target_group_size=2,
            allow_state_sharing=False, start=True,
        )  # fmt: skip
        sockets = {p for p in _listening_unix_sockets(averager.pid) if "hivemind-p2pclient" in p}
        assert sockets, "the averager process holds no p2p client socket: this test no longer finds it"
        assert all(Path(p).exists() for p in sockets)
        averager.shutdown()
        assert not averager.is_alive()
        assert [p for p in sockets if Path(p).exists()] == []
    finally:
        dht.shutdown()
