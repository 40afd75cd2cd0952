"""The direct data plane: a hivemind group's all-reduce over its own gloo ring.

hivemind's butterfly all-reduce moves every byte through Python protobuf messages and the p2p
daemon (with its stream multiplexing and encryption) on both ends; on this machine that caps it
near a tenth of what torch.distributed's gloo reaches between the same processes (numbers in
docs/performance.md). The direct plane keeps hivemind for discovery, matchmaking, the gather of
member info and every fallback, and moves only the tensor bytes over TCP with gloo:

1. each member that accepts inbound connections says so in its gathered data (a peer in client
   mode, behind NAT or in a private run says nothing and the group takes hivemind's path);
2. the ring's rendezvous is a board held by the group's first member and reached over
   hivemind's authenticated channel (:mod:`swarm.rendezvous`): only the group's members can
   read or write it, and no rendezvous port exists for anyone else to find;
3. every member's weight travels with the gathered info, so each sends ``x * w / Σw`` (fp16 on
   the wire with the fp16 codec) and the ring's sum is the weighted mean, identical on every
   member. The ring is kept for the next round when the group is the same;
4. the ring runs once every member has shown up at the board (a member hivemind's matchmaking
   counted in but that gave up on the group fails the round in seconds, not at gloo's timeout);
5. the sum is checked before it is used: every member posts a sketch of what it sent to the
   board, and the result's sketch must match their sum (:mod:`swarm.sketch`). A ring an
   outsider got into (or a member that sent something else than it claims) fails the round,
   which falls back like any failed round; the ring is never reused.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import socket
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from swarm.rendezvous import Rendezvous, RingStore
from swarm.sketch import Sketch, Sketcher, mismatch

logger = logging.getLogger(__name__)

PLANES = ("hivemind", "direct")
MAX_RINGS = 8
"""Rings kept for reuse per plane (the same members next round skip the rendezvous)."""
RING_ID_BYTES = 16


class RingUnreachable(RuntimeError):
    """The group's ring could not be set up (rendezvous or connections), as opposed to a member
    leaving once the ring was up."""


class MemberMissing(RuntimeError):
    """A member hivemind put in the group never came to its ring: it gave up on the group during
    matchmaking (a follower whose wait for the leader's go timed out, under load), or left."""


class RingTampered(RuntimeError):
    """The ring's sum does not match the members' sketches: something else than the members'
    contributions went into it."""


DIRECT_CODECS = ("none", "fp16")  # int8 needs hivemind's quantizer: it takes hivemind's path


def bindable(host: str) -> bool:
    """Whether ``host`` is an address of this machine (a listener can bind it)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
        return True
    except OSError:
        return False


def one_line(error: BaseException) -> str:
    """An error as one line: torch's C++ errors carry a backtrace after their first line."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


class DirectPlane:
    """Lives in hivemind's averager process: one gloo ring per group, bound to ``host`` only."""

    def __init__(self, host: str) -> None:
        assert host not in ("", "0.0.0.0"), f"{host=}: the ring binds one address"
        self.host = host
        # Rings by members in rank order, with the id they were made under: the same group
        # reuses its connections next round if every member still holds that ring.
        self._rings: dict[tuple[str, ...], tuple[bytes, torch.distributed.ProcessGroup]] = {}
        self._pool = ThreadPoolExecutor(3, thread_name_prefix="sketch-exchange")
        self._send = lambda ring, wire: ring.allreduce([wire])  # tests put an impostor here
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def _scratch(self, dtype: torch.dtype, count: int) -> torch.Tensor:
        """A flat buffer of ``count`` elements kept for the next rounds."""
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.numel() != count:
            buffer = self._buffers[dtype] = torch.empty(count, dtype=dtype)
        return buffer

    def all_reduce(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        board: Rendezvous,
        seed: bytes,
        members: Sequence[str],
        rank: int,
        weight: float,
        total: float,
        codec: str,
        timeout: float,
        reusable: frozenset[bytes] | None = None,
        arrival: float = 5.0,
    ) -> None:
        """Replace ``tensors`` in place by the group's weighted mean (``total``: the sum of
        every member's weight, from the gathered info), checked against the members' sketches.
        ``reusable``: the ring ids every member says it still holds (:meth:`ring_ids`); a kept
        ring is used again only if its id is among them (None: trust this side's cache), since
        a member that lost its side of the ring (a failed round, a process suspended past the
        ring's timeout) would set up a new one while this one waited on the old.
        ``arrival``: seconds every member has to show up at the board before the ring runs
        (:class:`MemberMissing` otherwise). hivemind's matchmaking can hand the leader a group
        whose follower has already given up on it; on a kept ring the others would then wait in
        gloo for the ring's whole ``timeout``.
        On any error the tensors hold garbage: the caller keeps its own copy."""
        if not total > 0:
            raise RuntimeError(f"the group's weights sum to {total}")
        count = sum(t.numel() for t in tensors)
        single = len(tensors) == 1 and tensors[0].dtype == torch.float32 and tensors[0].is_contiguous()
        # One buffer on the wire; a lone float32 tensor is reduced in place, without copies. The
        # buffers are kept from round to round: a fresh 100 MB tensor costs more in page faults
        # than the pass that fills it.
        if single:
            flat = tensors[0].view(-1)
        else:
            pieces = [t.detach().reshape(-1).float() for t in tensors]
            flat = torch.cat(pieces, out=self._scratch(torch.float32, count))
        flat.mul_(weight / total)
        sketcher = Sketcher(seed, flat.numel())  # R, drawn once for both sketches
        wire = self._scratch(torch.float16, count).copy_(flat) if codec == "fp16" else flat
        # What this member sends (before the codec's rounding) is sketched, posted, and the
        # others' collected while the ring runs (one request that the board answers when the last
        # member's sketch lands): off the critical path. A ring that reduces ``flat`` itself
        # changes it, so its sketch is taken first.
        others = [f"sketch/{r}" for r in range(len(members)) if r != rank]
        abort = threading.Event()
        arrival = min(arrival, timeout)
        # Everyone here? Posted first, answered while this member sketches its update.
        present = self._pool.submit(
            board.exchange,
            f"here/{rank}",
            b"",
            [f"here/{r}" for r in range(len(members)) if r != rank],
            arrival,
            abort,
        )

        def own_sketch() -> Sketch:
            return Sketch(tuple(sketcher.rows(flat).tolist()), float(torch.linalg.vector_norm(flat)))

        def post(mine: Sketch) -> list[bytes]:
            return board.exchange(f"sketch/{rank}", mine.to_bytes(), others, timeout, abort)

        if wire is flat:
            sketched = Future()
            sketched.set_result(own_sketch())
        else:
            sketched = self._pool.submit(own_sketch)
        exchange = self._pool.submit(lambda: post(sketched.result()))
        try:
            try:
                present.result()
            except Exception as error:
                raise MemberMissing(
                    f"not every member of the group came to its ring within {arrival:.0f} s "
                    f"({one_line(error)}); one gave up on the group during matchmaking or left"
                ) from None
            key = tuple(members)
            ring_id, ring = self._rings.pop(key, (b"", None))  # kept below only if the sum checks out
            if ring is not None and reusable is not None and ring_id not in reusable:
                ring = None  # another member no longer holds it: all set up a new one
            if ring is None:
                ring_id = hashlib.sha256(b"ring" + seed).digest()[:RING_ID_BYTES]
                try:
                    ring = self._connect(board, rank, len(members), timeout)
                except Exception as error:
                    raise RingUnreachable(one_line(error)) from None
            self._send(ring, wire).wait()
            mine = sketched.result(timeout=timeout)  # read ``flat`` before it takes the sum
            if wire is not flat:
                flat.copy_(wire)
            result = Sketch(tuple(sketcher.rows(flat).tolist()), 0.0)
            parts = [mine, *map(Sketch.from_bytes, exchange.result(timeout=timeout))]
        finally:
            abort.set()  # a failed round leaves no request polling on for the next one to queue behind
            wait([sketched, present])  # nothing reads ``flat`` (maybe a kept buffer) once this returns
        why = mismatch(result, parts, codec)
        if why is not None:
            raise RingTampered(why)
        self._rings[key] = (ring_id, ring)
        while len(self._rings) > MAX_RINGS:
            self._rings.pop(next(iter(self._rings)))
        if single:
            return
        offset = 0
        for tensor in tensors:
            count = tensor.numel()
            tensor.copy_(flat[offset : offset + count].view_as(tensor))
            offset += count

    def ring_ids(self) -> list[bytes]:
        """The ids of the rings kept for reuse (sent with this member's gathered info)."""
        return [ring_id for ring_id, _ in self._rings.values()]

    def _connect(
        self, board: Rendezvous, rank: int, size: int, timeout: float
    ) -> torch.distributed.ProcessGroup:
        options = torch.distributed.ProcessGroupGloo._Options()
        options._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname=self.host)]
        options._timeout = datetime.timedelta(seconds=timeout)
        return torch.distributed.ProcessGroupGloo(RingStore(board, timeout), rank, size, options)
