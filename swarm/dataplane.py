"""The direct data plane: a hivemind group's all-reduce over its own gloo ring.

hivemind's butterfly all-reduce moves every byte through Python protobuf messages and the p2p
daemon (with its stream multiplexing and encryption) on both ends; on this machine that caps it
near a tenth of what torch.distributed's gloo reaches between the same processes (numbers in
docs/performance.md). The direct plane keeps hivemind for discovery, matchmaking, the gather of
member info and every fallback, and moves only the tensor bytes over TCP with gloo:

1. each member that accepts inbound connections advertises ``host:port`` in its gathered data
   (a peer in client mode, behind NAT, advertises nothing);
2. when *every* member of a formed group advertised one, the group's first member's
   ``TCPStore`` (a server each advertising peer runs on its port) is the rendezvous: a
   ``ProcessGroupGloo`` for this group only, keyed by hivemind's group id;
3. every member's weight travels with the gathered info, so each sends ``x * w / Σw`` (fp16 on
   the wire with the fp16 codec) and the ring's sum is the weighted mean, identical on every
   member. The ring is kept for the next round when the group is the same.

If the ring fails (a member unreachable or gone), the round fails like a failed hivemind round,
and this peer stops advertising, so its later groups use hivemind's path.
"""

from __future__ import annotations

import datetime
import logging
import socket
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

PLANES = ("hivemind", "direct")


class RingUnreachable(RuntimeError):
    """The group's ring could not be set up (rendezvous or connections), as opposed to a member
    leaving once the ring was up."""


DIRECT_CODECS = ("none", "fp16")  # int8 needs hivemind's quantizer: it takes hivemind's path


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (the store binds it moments later, in the averager)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host if host != "0.0.0.0" else "", 0))
        return probe.getsockname()[1]


class DirectPlane:
    """Lives in hivemind's averager process: the rendezvous store, and one ring per group."""

    def __init__(self, host: str, port: int, advertise: str) -> None:
        self.host, self.port, self.advertise = host, port, advertise
        self._server: torch.distributed.TCPStore | None = None
        self._clients: dict[str, torch.distributed.TCPStore] = {}
        # Rings by (members in rank order): the same group next round reuses its connections.
        self._rings: dict[tuple[str, ...], torch.distributed.ProcessGroup] = {}

    def serve(self) -> None:
        """Start this peer's rendezvous server (other members connect when it leads a group)."""
        if self._server is None:
            self._server = torch.distributed.TCPStore(
                self.host if self.host != "0.0.0.0" else "",
                self.port,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=30),
            )

    def _store(self, address: str, timeout: float) -> torch.distributed.Store:
        if address == self.advertise:
            self.serve()
            return self._server
        if address not in self._clients:
            host, port = address.rsplit(":", 1)
            self._clients[address] = torch.distributed.TCPStore(
                host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout)
            )
        return self._clients[address]

    def all_reduce(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        group_id: bytes,
        addresses: Sequence[str],
        rank: int,
        weight: float,
        total: float,
        codec: str,
        timeout: float,
    ) -> None:
        """Replace ``tensors`` in place by the group's weighted mean (``total``: the sum of
        every member's weight, from the gathered info)."""
        if not total > 0:
            raise RuntimeError(f"the group's weights sum to {total}")
        key = tuple(addresses)
        ring = self._rings.get(key)
        if ring is None:
            try:
                ring = self._connect(group_id, addresses, rank, timeout)
            except Exception as error:
                raise RingUnreachable(f"{type(error).__name__}: {error}") from None
        try:
            self._reduce(ring, tensors, scale=weight / total, codec=codec)
        except Exception:
            self._rings.pop(key, None)  # a member left: never reuse these connections
            raise
        self._rings[key] = ring
        while len(self._rings) > 8:
            self._rings.pop(next(iter(self._rings)))

    def _connect(
        self, group_id: bytes, addresses: Sequence[str], rank: int, timeout: float
    ) -> torch.distributed.ProcessGroup:
        store = torch.distributed.PrefixStore(group_id.hex(), self._store(addresses[0], timeout))
        options = torch.distributed.ProcessGroupGloo._Options()
        device = (
            torch.distributed.ProcessGroupGloo.create_default_device()
            if self.host == "0.0.0.0"
            else torch.distributed.ProcessGroupGloo.create_device(hostname=self.host)
        )
        options._devices = [device]
        options._timeout = datetime.timedelta(seconds=timeout)
        return torch.distributed.ProcessGroupGloo(store, rank, len(addresses), options)

    @staticmethod
    def _reduce(ring, tensors: Sequence[torch.Tensor], *, scale: float, codec: str) -> None:
        single = len(tensors) == 1 and tensors[0].dtype == torch.float32 and tensors[0].is_contiguous()
        # One buffer on the wire; a lone float32 tensor is reduced in place, without copies.
        flat = tensors[0].view(-1) if single else torch.cat([t.detach().reshape(-1).float() for t in tensors])
        flat.mul_(scale)
        wire = flat.half() if codec == "fp16" else flat
        ring.allreduce([wire]).wait()
        if wire is not flat:
            flat.copy_(wire)
        if single:
            return
        offset = 0
        for tensor in tensors:
            count = tensor.numel()
            tensor.copy_(flat[offset : offset + count].view_as(tensor))
            offset += count
