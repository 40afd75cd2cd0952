"""Averaging pseudo-gradients over a real swarm with hivemind's DecentralizedAverager.

One round, as :meth:`SwarmAverager.all_reduce` runs it:

1. **Barrier.** Announce "waiting" and wait (at most ``round_wait`` seconds) until every live
   peer at the same outer step has finished its inner steps. Without it the first peer to
   finish would average with whoever happens to be matchmaking and the swarm would split
   into groups holding different global params.
2. **Matchmaking + all-reduce.** ``step(scheduled_time=now + matchmaking_time)``: peers that
   passed the barrier within that window form one group; the weighted mean replaces the
   tensors. Each member's ``info`` (outer step, fingerprint of θ) is all-gathered.
3. **Fallback.** No group (a lone peer) or a failed round: keep this peer's own tensors and
   say so in the report; the outer step is then a local one.

Serving state to late joiners: hivemind calls :meth:`get_current_state` in a background
thread of this process; the ``state_provider`` must return a consistent copy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import functools
import json
import logging
import math
import multiprocessing as mp
import pathlib
import random
import secrets
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, AsyncIterator  # noqa: UP035 - hivemind reads typing's name to detect streams

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import StepControl
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import (
    Float16Compression,
    NoCompression,
    Uniform8BitQuantization,
    deserialize_torch_tensor,
)
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import aiter_with_timeout, enter_asynchronously
from hivemind.utils.streaming import combine_from_streaming

from optim.averager import RoundReport
from optim.diloco import OuterState
from swarm.averaging_config import CODEC_BYTES, AveragingConfig
from swarm.claims import STRIKES, Vouching, judge_state
from swarm.dataplane import (
    DIRECT_CODECS,
    MAX_RINGS,
    RING_ID_BYTES,
    DirectPlane,
    RingUnreachable,
    bindable,
    one_line,
)
from swarm.dht import quiet_children
from swarm.errors import SwarmError
from swarm.progress import ProgressBoard
from swarm.records import PeerHeartbeat, RunKeys, Stage
from swarm.rendezvous import MAX_VALUE_BYTES, BoardClient, RendezvousBoards, pack, unpack
from swarm.sketch import Sketch, state_sketches

logger = logging.getLogger(__name__)

# wire codec name -> hivemind codec
CODECS: dict[str, Callable[[], Any]] = {
    "none": NoCompression,
    "fp16": Float16Compression,
    "int8": Uniform8BitQuantization,
}
assert set(CODECS) == set(CODEC_BYTES), f"{set(CODECS)=} {set(CODEC_BYTES)=}"

SEED_BYTES = 16  # a joiner's seed for sketching the θ it downloaded
VERIFIERS = 4  # peers asked to confirm a downloaded state
DONORS_PER_TRY = 4  # donors tried (each checked) in one download_state call
MAX_SKETCH_ANSWER = 1 << 20  # 72 bytes a tensor: room for 14,000 tensors


def _quiet_step_control_del(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """hivemind's ``StepControl.__del__`` asserts that a trigger was attached; a step that a
    signal interrupted before hivemind attached one (SIGTERM to a peer's process group kills the
    averager first) then printed an AssertionError traceback at exit. Nothing is pending then."""

    def __del__(self) -> None:
        if getattr(self, "_trigger", None) is not None:
            original(self)

    return __del__


StepControl.__del__ = _quiet_step_control_del(StepControl.__del__)


def _quiet_cancelled_result(original: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    """A peer cancels a step whose group it no longer wants (the others finished the round);
    when the all-reduce had just begun in hivemind's averager process, hivemind then sets the
    cancelled step's result and logs "Task exception was never retrieved ... InvalidStateError"
    with a traceback. The peer has moved on (its round falls back; a stale θ is re-downloaded):
    the result has nobody to go to."""

    def set_result(self, result: Any) -> None:
        if self.cancelled():
            logger.debug("a cancelled averaging step finished anyway; its result is dropped")
            return
        original(self, result)

    return set_result


StepControl.set_result = _quiet_cancelled_result(StepControl.set_result)


class _Verdict(enum.Enum):
    """What the round barrier decided."""

    AVERAGE = "average"  # the others of this round are ready: matchmaking now
    ALONE = "no other peer in this round"  # step with this peer's own update
    BEHIND = "other peers are past this round"  # this peer fell behind: fetch the state


# Gathered data, around the caller's own: whether this member takes direct rings, its weight, a
# random nonce for the group's sketch seed (gathered over hivemind's encrypted channel).
_PLANE, _WEIGHT, _NONCE, _USER, _RINGS = "dataplane", "weight", "nonce", "user", "rings"


def _unwrap(data: Any) -> Any:
    return data[_USER] if isinstance(data, dict) and _USER in data else data


class _StateServingAverager(DecentralizedAverager):
    """DecentralizedAverager whose downloadable state is DiLoCo's global state."""

    def __init__(
        self,
        *args: Any,
        state_provider: Callable[[], OuterState] | None,
        fault_file: str | None = None,
        data_plane: str = "hivemind",
        aggregate: str = "mean",
        plane_host: str = "127.0.0.1",
        plane_advertise: str | None = None,
        codec: str = "none",
        **kwargs: Any,
    ) -> None:
        self._state_provider = state_provider
        self._fault_file = fault_file
        self._codec = codec
        self._aggregate = aggregate
        self._plane: DirectPlane | None = None
        self._plane_used = False
        self._unreachable = 0  # consecutive rings this peer could not set up
        self._boards = RendezvousBoards()  # the rendezvous of the groups this peer leads
        self._sketch_lock: asyncio.Lock | None = None  # made in the averager process's loop
        self._sketch_after = 0.0
        # A donor may send at most this much: 8 copies of the parameters and 64 MiB of slack
        # (θ, momentum, a queued update and AdamW's two moments are 5).
        self._state_limit = 8 * 4 * sum(t.numel() for t in args[0]) + (64 << 20)
        # Cleared in the averager process when a ring fails; read here before each step.
        self._plane_enabled = mp.Value("b", 0)
        # The ids of the rings the averager process keeps, for the gathered info (written there
        # after each direct round, read here before each step).
        self._ring_ids = mp.Array("c", MAX_RINGS * RING_ID_BYTES)
        self.direct_rounds = mp.Value("q", 0)  # rounds the direct plane carried, for reports
        direct = data_plane == "direct" and aggregate == "mean" and codec in DIRECT_CODECS
        if direct and not kwargs.get("client_mode"):
            bind = plane_host if plane_host != "0.0.0.0" else plane_advertise
            if bind and bindable(bind):
                self._plane = DirectPlane(bind)
                self._plane_enabled.value = 1
            elif plane_host == "0.0.0.0":
                logger.info(
                    "direct data plane off: %s; rounds use hivemind's all-reduce",
                    f"the announced address {bind} is not on this machine (behind NAT?)"
                    if bind
                    else "--host 0.0.0.0 without --announce names no address to bind",
                )
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        # hivemind's averager process (forked): the aggregation rule of its all-reduce lives here.
        if self._aggregate == "trimmed-mean":
            from swarm.trimmed import install

            install()
        super().run()

    def step(self, gather: Any = None, **kwargs: Any):
        """hivemind's step; this member's data-plane address travels with its gathered info."""
        weight = kwargs.get("weight")
        weight = 1.0 if weight is None else float(weight)  # hivemind's default for a full peer
        kept = self._ring_ids.raw
        data = {
            _PLANE: bool(self._plane_enabled.value),
            _WEIGHT: weight,
            _NONCE: secrets.token_bytes(16),
            _RINGS: [
                ring
                for ring in (kept[i : i + RING_ID_BYTES] for i in range(0, len(kept), RING_ID_BYTES))
                if any(ring)
            ],
        }
        return super().step(gather={**data, _USER: gather}, **kwargs)

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs: Any):
        # In hivemind's averager process, once the group is formed (and triggered).
        members = [self.serializer.loads(self.serializer.loads(g)[2]) for g in group_info.gathered]
        direct = [isinstance(m, dict) and _USER in m and m.get(_PLANE) is True for m in members]
        if self._plane is not None and all(direct):
            # Ranks by peer id, not hivemind's order (random per group): the same members next
            # round find their ring already connected. The board's holder is hivemind's leader.
            peer_ids = sorted(group_info.peer_ids, key=lambda p: p.to_bytes())
            leader = group_info.peer_ids[0]
            if leader == self.peer_id:
                self._boards.open(group_info.group_id, [p.to_bytes() for p in peer_ids])
            nonces = b"".join(m.get(_NONCE) or b"" for m in members if isinstance(m.get(_NONCE), bytes))
            ring = functools.partial(
                self._plane.all_reduce,
                board=BoardClient(
                    group_info.group_id,
                    self._board_caller(leader, asyncio.get_running_loop()),
                    pause=0.002 if leader == self.peer_id else 0.0,  # a missed wake-up costs 2 ms
                    wait=self._boards.wait_change if leader == self.peer_id else None,
                ),
                seed=group_info.group_id + nonces,
                members=[p.to_base58() for p in peer_ids],
                rank=peer_ids.index(self.peer_id),
                weight=kwargs["weight"],
                total=sum(_weight(m) for m in members),
                codec=self._codec,
                reusable=_held_by_all(members),
                # Below hivemind's own deadline for this step, so that a member gone mid-ring
                # ends in our error, not in hivemind cancelling the wait on a running thread.
                timeout=0.75 * (self._allreduce_timeout or 60.0),
            )
            try:
                async with enter_asynchronously(self.get_tensors()) as local_tensors:
                    await asyncio.get_running_loop().run_in_executor(None, ring, local_tensors)
            except RingUnreachable as error:
                self._unreachable += 1
                if self._unreachable >= 3:  # not one member that left: this peer's plane is blocked
                    self._plane_enabled.value = 0
                    logger.warning(
                        "direct data plane: no ring could be set up 3 times in a row (%s); this peer "
                        "uses hivemind's all-reduce from now on (a firewall in front of its gloo "
                        "ports? --data-plane hivemind avoids the try)",
                        error,
                    )
                raise AllreduceException(f"direct data plane: could not set up the ring: {error}") from None
            except Exception as error:  # a member left mid-ring, a tampered sum: a failed round
                raise AllreduceException(f"direct data plane: {one_line(error)}") from None
            finally:  # the rings kept now, for this peer's next gathered info
                self._publish_ring_ids()
            self._unreachable = 0
            with self.direct_rounds.get_lock():
                self.direct_rounds.value += 1
            if not self._plane_used:
                self._plane_used = True
                logger.info("averaging over the direct data plane (a gloo ring of %d)", len(members))
            running = self._running_groups.get(group_info.group_id)
            if running is not None and not running.done():
                running.set_result(None)  # no hivemind runner for this group: nothing to wait for
            return {peer: _unwrap(m) for peer, m in zip(group_info.peer_ids, members)}
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        return {peer: _unwrap(data) for peer, data in gathered.items()}

    def _publish_ring_ids(self) -> None:
        kept = b"".join(self._plane.ring_ids()) if self._plane is not None else b""
        self._ring_ids.raw = kept.ljust(MAX_RINGS * RING_ID_BYTES, b"\0")

    def _board_caller(self, leader, loop: asyncio.AbstractEventLoop) -> Callable[[dict], dict]:
        """Requests to the group's board: in this process if this peer leads the group, else
        an RPC to the leader over hivemind's authenticated channel (from the ring's thread)."""
        if leader == self.peer_id:
            return functools.partial(self._boards.handle, self.peer_id.to_bytes())

        async def ask(request: dict) -> dict:
            stub = self.get_stub(self._p2p, leader, namespace=self.prefix)
            answer = await stub.rpc_plane_board(
                averaging_pb2.DownloadData(metadata=pack(request)), timeout=10
            )
            return unpack(answer.metadata)

        return lambda request: asyncio.run_coroutine_threadsafe(ask(request), loop).result(timeout=15)

    async def rpc_plane_board(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> averaging_pb2.DownloadData:
        """The rendezvous board of a group this peer leads; the caller's peer id is proven by
        hivemind's channel, and only the group's members get anything but "unknown group"."""
        if len(request.metadata) > 2 * MAX_VALUE_BYTES:
            answer = {"ok": False, "why": "request too large"}
        else:
            answer = await self._boards.answer(context.remote_id.to_bytes(), unpack(request.metadata))
        return averaging_pb2.DownloadData(metadata=pack(answer))

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        # Runs in hivemind's averager process. Testing: a fault file's ``serve_delay_ms`` slows
        # the stream down part by part, so that a test can kill this donor mid-download.
        delay = _fault(self._fault_file, "serve_delay_ms") / 1000
        if delay:
            logger.warning("serving the state slowly (fault injection: %.0f ms per part)", delay * 1000)
        async for message in super().rpc_download_state(request, context):
            yield message
            if delay:
                await asyncio.sleep(delay)

    # --- downloads that the joiner checks (see SwarmAverager.download_state) ----------------------

    def load_state_from_peers(
        self,
        wait: bool = True,
        timeout: float | None = None,
        exclude: Sequence[str] = (),
        verifiers: Sequence[str] = (),
    ):
        """hivemind's download, skipping the donors in ``exclude`` (base58 peer ids). While the
        state streams, up to ``VERIFIERS`` of ``verifiers`` (never the donor) are asked for their
        θ's sketches under a seed drawn for this donor, which the donor never sees. A result is
        (metadata, tensors, the donor's peer id, the seed, {verifier: (outer step, sketches) or
        None})."""
        future = MPFuture()
        request = dict(timeout=timeout, future=future, exclude=tuple(exclude), verifiers=tuple(verifiers))
        self._outer_pipe.send(("_load_state_from_peers", [], request))
        return future.result(timeout=timeout) if wait else future

    async def _load_state_from_peers(
        self,
        future: MPFuture,
        timeout: float | None = None,
        exclude: Sequence[str] = (),
        verifiers: Sequence[str] = (),
    ) -> None:
        # In the averager process. Donors in order of the priority they declare (their outer
        # step; anyone can declare any, which is why the joiner checks what it gets).
        try:
            key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
            found = await self.dht.get(key, latest=True, return_future=True)
            declared = found.value if found is not None and isinstance(found.value, dict) else {}
            donors = []
            for subkey, entry in declared.items():
                priority = getattr(entry, "value", None)
                if not isinstance(priority, (int, float)) or not math.isfinite(priority):
                    continue
                try:
                    peer = PeerID(subkey)
                except Exception:  # noqa: BLE001 - a made-up subkey is just skipped
                    continue
                if peer != self.peer_id and peer.to_base58() not in exclude:
                    donors.append((float(priority), random.random(), peer))
            for _, _, peer in sorted(donors, key=lambda d: d[:2], reverse=True):
                donor = peer.to_base58()
                seed = secrets.token_bytes(SEED_BYTES)
                asked = [v for v in verifiers if v != donor][:VERIFIERS]
                # Asked while the state streams (not after): a round can end during a download,
                # and the witnesses' θ should be of the step the donor serves.
                witnesses = asyncio.ensure_future(self._sketches_from(asked, seed, timeout=10.0))
                got = await self._download_from(peer)
                if got is not None:
                    future.set_result((*got, donor, seed, await witnesses))
                    return
                witnesses.cancel()
        finally:
            if not future.done():
                future.set_result(None)

    async def _download_from(self, peer: PeerID) -> tuple[Any, list[torch.Tensor]] | None:
        """One donor's state stream, at most ``self._state_limit`` bytes; None if it failed."""
        logger.info("downloading the state from %s", peer)
        try:
            stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
            stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
            metadata, tensors, parts, received = None, [], [], 0
            async for message in aiter_with_timeout(
                stream, timeout=self.next_chunk_timeout or self.request_timeout
            ):
                received += len(message.tensor_part.buffer) + len(message.metadata)
                if received > self._state_limit:
                    raise SwarmError(
                        f"it sent over {self._state_limit >> 20} MiB, more than this model's state"
                    )
                if message.metadata:
                    metadata = self.serializer.loads(message.metadata)
                if message.tensor_part.dtype and parts:  # the first part of the next tensor
                    tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    parts = []
                parts.append(message.tensor_part)
            if parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        except Exception as error:  # noqa: BLE001 - a donor gone or misbehaving: try the next
            logger.warning("state download from %s failed: %s", peer, one_line(error))
            return None
        return (metadata, tensors) if metadata else None

    async def rpc_theta_sketch(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> averaging_pb2.DownloadData:
        """Sketches of this peer's θ under a joiner's seed, for checking a state it downloaded."""
        seed = unpack(request.metadata).get("seed") if len(request.metadata) <= 256 else None
        if not isinstance(seed, bytes) or len(seed) != SEED_BYTES or not self.allow_state_sharing:
            return averaging_pb2.DownloadData(metadata=pack({"ok": False}))
        if self._sketch_lock is None:
            self._sketch_lock = asyncio.Lock()
        async with self._sketch_lock:  # each answer costs a copy of the state: one at a time
            await asyncio.sleep(max(0.0, self._sketch_after - time.monotonic()))
            metadata, tensors, _ = await self._get_current_state_from_host_process()
            metadata = self.serializer.loads(metadata)
            params = tensors[: int(metadata["num_params"])]
            sketches = await asyncio.get_running_loop().run_in_executor(None, state_sketches, params, seed)
            self._sketch_after = time.monotonic() + 0.1
        answer = {
            "ok": True,
            "outer_step": int(metadata["outer_step"]),
            "sketches": [s.to_bytes() for s in sketches],
        }
        return averaging_pb2.DownloadData(metadata=pack(answer))

    async def _sketches_from(
        self, peers: list[str], seed: bytes, timeout: float
    ) -> dict[str, tuple[int, list[Sketch]] | None]:
        """Each peer's (outer step, θ sketches) under ``seed``, or None for it."""

        async def ask(peer: str) -> tuple[str, tuple[int, list[Sketch]] | None]:
            try:
                stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
                request = averaging_pb2.DownloadData(metadata=pack({"seed": seed}))
                answer = await stub.rpc_theta_sketch(request, timeout=timeout)
                message = unpack(answer.metadata) if len(answer.metadata) <= MAX_SKETCH_ANSWER else {}
                step, raw = message.get("outer_step"), message.get("sketches")
                if message.get("ok") is not True or not isinstance(step, int) or not isinstance(raw, list):
                    return peer, None
                return peer, (step, [Sketch.from_bytes(b) for b in raw])
            except Exception as error:  # noqa: BLE001 - no answer, a malformed one: not a witness
                logger.debug("no θ sketch from %s: %s", peer, one_line(error))
                return peer, None

        return dict(await asyncio.gather(*map(ask, peers)))

    def get_current_state(self):
        state = self._state_provider()
        noise = _fault(self._fault_file, "serve_noise")
        if noise:  # fault injection: a donor serving a made-up θ (this peer's own is untouched)
            logger.warning("fault injection: serving θ with %g relative noise", noise)
            state = dataclasses.replace(
                state,
                params=[p + noise * p.norm() / p.numel() ** 0.5 * torch.randn_like(p) for p in state.params],
            )
        metadata = dict(
            outer_step=state.outer_step,
            num_params=len(state.params),
            num_pending=len(state.pending),
            inner_keys=state.inner_keys,
        )
        queued = [t for update in state.pending for t in update]
        return metadata, [*state.params, *state.momentum, *queued, *state.inner], None


class Serving:
    """Whether this peer is answering a request for its state right now (a joiner's download or
    a witness's sketch): the state provider wrapped by :meth:`wrap` counts the requests in
    flight. One per peer, shared by all its averagers (streaming has one per fragment)."""

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()

    def wrap(self, provider: Callable[[], OuterState]) -> Callable[[], OuterState]:
        def provide() -> OuterState:
            with self._lock:
                self._count += 1
            try:
                return provider()
            finally:
                with self._lock:
                    self._count -= 1

        return provide

    @property
    def answering(self) -> bool:
        return self._count > 0


class SwarmAverager:
    """An :class:`optim.Averager` over hivemind; also downloads and serves the global state."""

    def __init__(
        self,
        dht,
        *,
        keys: RunKeys,
        tensors_like: Sequence[torch.Tensor],
        board: ProgressBoard,
        beat: Callable[[Stage], None],
        state_provider: Callable[[], OuterState],
        config: AveragingConfig,
        client_mode: bool = False,
        group: str = "diloco",
        serve_state: bool = True,
        fault_file: str | None = None,
        plane_host: str = "127.0.0.1",
        plane_advertise: str | None = None,
        overlapped: bool = False,
        serving: Serving | None = None,
    ) -> None:
        self.dht = dht
        self.board = board
        self.serving = serving if serving is not None else Serving()
        """Set while this peer answers a state request (see the overlapped barrier)."""
        state_provider = self.serving.wrap(state_provider)
        self.overlapped = overlapped
        """Rounds run in the background (DiLoCo's ``overlap``): a peer's heartbeat shows the
        round it trains, one past the round it averages, and this thread leaves its stage alone."""
        self.lag = int(overlapped)
        """How far a round mate's clock is past the round being averaged."""
        self.beat = (lambda stage: None) if overlapped else beat
        self.config = config
        self.peer_id = dht.peer_id.to_base58()
        self.vouching = Vouching()
        """Peers that averaged with this one in a verified round: their claims are believed."""
        self._refused_donors: set[str] = set()
        self._gap = 0.0  # seconds between this peer's last two rounds (its inner steps)
        self._last_return = time.monotonic()
        self.corrupt_next = False
        """Testing: send NaN instead of this peer's update in the next round (a faulty peer)."""
        self.scale_next = 0.0
        """Testing: multiply the next update sent by this factor (a peer lying about its update)."""
        codec, self.bytes_per_element = CODECS[config.compression], CODEC_BYTES[config.compression]
        buffers = [torch.zeros_like(t, dtype=torch.float32, device="cpu") for t in tensors_like]
        self.numel = sum(b.numel() for b in buffers)
        plane = config.data_plane
        if keys.secret and plane == "direct":
            # gloo's TCP pairs are not encrypted: a private run's updates stay on hivemind's
            # path, which its daemon encrypts (TLS 1.3). The cost is in docs/performance.md.
            logger.info("private run: averaging over hivemind's encrypted path, not the direct plane")
            plane = "hivemind"
        handler = signal.getsignal(signal.SIGINT)
        self.averager = _StateServingAverager(
            buffers,
            dht,
            prefix=keys.group(group),  # peers average only with the same group name and shapes
            state_provider=state_provider,
            fault_file=fault_file,
            data_plane=plane,
            aggregate=config.aggregate,
            plane_host=plane_host,
            plane_advertise=plane_advertise,
            codec=config.compression,
            min_matchmaking_time=config.matchmaking_time,
            request_timeout=max(3.0, config.matchmaking_time),
            allreduce_timeout=config.averaging_timeout,
            next_chunk_timeout=min(10.0, config.averaging_timeout),
            compression=codec(),
            state_compression=NoCompression(),
            client_mode=client_mode,
            allow_state_sharing=serve_state and not client_mode,
            declare_state_period=10,
            shutdown_timeout=3,
            start=False,
        )
        try:
            # hivemind makes the calling process ignore SIGINT here (averager.py: signal(SIGINT,
            # SIG_IGN)) and would leave Ctrl+C dead for the rest of the run: restore it.
            with quiet_children():
                self.averager.run_in_background(await_ready=True, timeout=30)
        finally:
            signal.signal(signal.SIGINT, handler)

    # --- one round --------------------------------------------------------------------------

    def all_reduce(
        self, tensors: Sequence[torch.Tensor], *, weight: float, info: dict[str, Any] | None = None
    ) -> RoundReport:
        info = dict(info or {}, peer=self.peer_id)
        self._gap = time.monotonic() - self._last_return
        try:
            return self._round(tensors, weight=weight, info=info)
        finally:
            self._last_return = time.monotonic()

    def _round(self, tensors: Sequence[torch.Tensor], *, weight: float, info: dict[str, Any]) -> RoundReport:
        verdict = self.wait_for_round_mates(int(info.get("outer_step", 0)))
        if verdict is not _Verdict.AVERAGE:
            report = self._alone(info, verdict.value)
            report.stale = verdict is _Verdict.BEHIND
            return report
        deadline = time.monotonic() + self.config.averaging_timeout
        attempt, direct_before = 0, self.averager.direct_rounds.value
        while True:
            attempt += 1
            gathered, error = self._attempt(tensors, weight, info, deadline)
            if gathered:
                break
            # We retry here rather than let hivemind do it: hivemind retries on the buffers as a
            # failed all-reduce left them (half averaged) and would report a wrong mean as a
            # success. Each attempt starts from this peer's own Δ; retry only while the others
            # of this round are still averaging, and while time is left.
            outer_step = int(info.get("outer_step", 0))
            mates = [
                p
                for p in self.board.fetch().values()
                if p.peer_id != self.peer_id
                and p.outer_step == outer_step + self.lag
                and (self.overlapped or p.stage in (Stage.WAITING, Stage.AVERAGING))
            ]
            if not mates or deadline - time.monotonic() < self.config.matchmaking_time + 1.0:
                return self._failed(info, error)
            logger.debug("round %d: attempt %d failed (%s); retrying", outer_step, attempt, error)
        # Success: the buffers now hold the group's weighted mean. Its members (hivemind's
        # authenticated peer ids, not what they wrote in their info) are vouched for.
        self.vouching.averaged_with([peer.to_base58() for peer in gathered if hasattr(peer, "to_base58")])
        with self.averager.get_tensors() as buffers:
            for buffer, tensor in zip(buffers, tensors):
                tensor.copy_(buffer)
        group = len(gathered)
        payload = self.numel * self.bytes_per_element
        # Butterfly all-reduce: each peer sends (n-1)/n of its vector and receives (n-1)/n of
        # each partner's part (reduce-scatter), then the same again for the results (all-gather).
        moved = int(2 * payload * (group - 1) / group)
        return RoundReport(
            group_size=group,
            bytes_sent=moved,
            bytes_received=moved,
            group_info=[data for data in gathered.values() if isinstance(data, dict)],
            robust_mean=self.config.aggregate == "trimmed-mean",
            plane="direct" if self.averager.direct_rounds.value > direct_before else "hivemind",
        )

    def _attempt(
        self, tensors: Sequence[torch.Tensor], weight: float, info: dict[str, Any], deadline: float
    ) -> tuple[dict[Any, Any] | None, str]:
        """One matchmaking + all-reduce from this peer's own tensors; (gathered, why it failed)."""
        from hivemind.utils import get_dht_time

        self.beat(Stage.AVERAGING)
        with self.averager.get_tensors() as buffers:
            for buffer, tensor in zip(buffers, tensors):
                buffer.copy_(tensor)
            if self.corrupt_next:  # fault injection: behave like a faulty peer, once
                self.corrupt_next = False
                for buffer in buffers:
                    buffer.fill_(float("nan"))
                logger.warning("fault injection: sending a corrupt (NaN) update this round")
            if self.scale_next:  # fault injection: a lying peer (1000x what it declared), once
                factor, self.scale_next = self.scale_next, 0.0
                for buffer in buffers:
                    buffer.mul_(factor)
                logger.warning("fault injection: sending %gx this round's update", factor)
        control = self.averager.step(
            allow_retries=False,  # see all_reduce
            gather=info,
            weight=weight,
            scheduled_time=get_dht_time() + self.config.matchmaking_time,
            timeout=max(self.config.matchmaking_time + 0.5, deadline - time.monotonic()),
            wait=False,
        )
        try:
            # Poll rather than block, so heartbeats continue and Ctrl+C lands here.
            hard_deadline = deadline + 10.0
            outer_step, next_check = int(info.get("outer_step", 0)), time.monotonic() + 1.0
            while not control.done():
                self.beat(Stage.AVERAGING)
                if time.monotonic() > hard_deadline:  # hivemind missed its own deadline
                    control.cancel()
                    return None, f"averaging did not finish in {self.config.averaging_timeout:.0f} s"
                if time.monotonic() > next_check:
                    # Came too late for this round's group (e.g. a joiner that downloaded the
                    # state while the others were averaging): they are past this round and wait
                    # at their next barrier for us, so stop now rather than at the timeout.
                    next_check = time.monotonic() + 1.0
                    # Never cancel a step whose all-reduce began: hivemind would then try to set
                    # the result of a cancelled future and log an InvalidStateError, and a step
                    # that just finished (stage FINISHED, result not yet seen here) would be
                    # thrown away although the others averaged with this peer. ``began_allreduce``
                    # stays set once the stage was RUNNING_ALLREDUCE; the stage does not.
                    if not control.began_allreduce and self._believed_ahead(
                        lambda p: p.outer_step > outer_step + self.lag
                    ):
                        control.cancel()
                        return None, "the others finished this round without this peer"
                time.sleep(0.05)
            gathered = control.result()
        except KeyboardInterrupt:
            control.cancel()
            raise
        except (Exception, asyncio.CancelledError) as error:  # hivemind may cancel a step it gave up on
            return None, f"averaging failed: {type(error).__name__}: {error}"
        return (gathered, "") if gathered else (None, "could not find a group")

    def _failed(self, info: dict[str, Any], reason: str) -> RoundReport:
        """The others of this round were ready but the round failed for this peer: they may
        have averaged without it, so after its local step its θ is presumed stale."""
        report = self._alone(info, reason)
        report.stale = True
        return report

    def _alone(self, info: dict[str, Any], reason: str) -> RoundReport:
        logger.info(
            "round %s: %s; continuing alone with this peer's own update", info.get("outer_step"), reason
        )
        return RoundReport(group_size=1, group_info=[info], error=reason)

    def wait_for_round_mates(self, outer_step: int) -> _Verdict:
        """The barrier: wait until every other live peer has finished this round's inner steps.

        Heartbeats lag by up to a second, so a peer whose heartbeat still shows it averaging the
        previous round counts as "about to train this one". A peer further behind is a
        straggler: not waited for, it will fetch the state. A peer already past this round
        means this one fell behind and must fetch the state instead of averaging.

        Overlapped (run in the background while this peer trains the next round), a peer's
        clock moves to ``outer_step + 1`` the moment it ends this round's inner steps: still at
        ``outer_step`` means busy, at ``+ 1`` ready, past ``+ 1`` it has applied this round's
        mean already. A peer downloading the state (a joiner, a straggler catching up) is waited
        for, or it would land a few rounds behind again and chase the swarm for ever; but not
        while this peer serves a state (to it or as its witness): the state served holds this
        round's mean, which this wait would hold back. The downloader then lands past this
        round, its mean queued, and the next round waits for it.
        """
        r = outer_step
        if self.overlapped:
            return self._barrier(
                r,
                behind=lambda p: p.outer_step > r + 1,
                busy=lambda p: (
                    (p.outer_step == r and p.stage is not Stage.DOWNLOADING)
                    or (p.stage is Stage.DOWNLOADING and not self.serving.answering)
                ),
                ready=lambda p: p.outer_step == r + 1 and p.stage is not Stage.DOWNLOADING,
                # Nobody at r + 1 (the others download or straggle): no group can form, and
                # failing to find one would flag this peer stale for nothing.
                need_ready=True,
            )
        return self._barrier(
            r,
            behind=lambda p: p.outer_step > r,
            busy=lambda p: (
                p.stage is Stage.DOWNLOADING  # a joiner: it will land on this round
                or (p.outer_step == r and p.stage in (Stage.JOINING, Stage.TRAINING))
                # a heartbeat from just before its last round ended: it is about to train this one
                or (p.outer_step == r - 1 and p.stage in (Stage.WAITING, Stage.AVERAGING))
            ),
            ready=lambda p: p.outer_step == r and p.stage in (Stage.WAITING, Stage.AVERAGING),
        )

    def _barrier(
        self,
        outer_step: int,
        *,
        behind: Callable[[PeerHeartbeat], bool],
        busy: Callable[[PeerHeartbeat], bool],
        ready: Callable[[PeerHeartbeat], bool],
        need_ready: bool = False,
    ) -> _Verdict:
        """Wait while some other live peer is ``busy`` (at most ``round_wait``); BEHIND as soon
        as one is past the round (``behind``); after the wait, average with the ``ready``.

        Heartbeats are claims (swarm.claims): "past the round" is believed from a peer that
        averaged with this one (or, before any did, from most of the others); "busy" keeps this
        peer waiting the full ``round_wait`` only for such a peer, an unvouched one for about one
        of this peer's own rounds. Claims not acted on are strikes; three rounds of them and the
        claimant is ignored for the rest of the run."""
        started = time.monotonic()
        deadline = started + self.config.round_wait
        # What an honest newcomer costs: about one round of inner steps (measured between this
        # peer's rounds), and at least a couple of matchmaking windows.
        grace = started + min(
            self.config.round_wait, max(5.0, 2 * self.config.matchmaking_time, 1.5 * self._gap)
        )
        waited_for: list[str] = []
        while True:
            self.beat(Stage.WAITING)
            # A paused peer (steering) trains nothing and averages nothing: not a round mate.
            others = [
                p
                for p in self.board.fetch().values()
                if p.peer_id != self.peer_id and p.stage is not Stage.PAUSED
            ]
            if not others:
                return _Verdict.ALONE
            vouched = self.vouching.vouched
            ahead = [p for p in others if behind(p)]
            if self._believed_ahead(behind, others):
                return _Verdict.BEHIND
            for p in ahead:  # not believed: not a round mate either
                self._strike(
                    p,
                    outer_step,
                    f"claimed outer step {p.outer_step} ahead of every peer that averaged with this one",
                )
            others = [p for p in others if p not in ahead]
            now = time.monotonic()
            # A joiner downloading the state is waited for like a vouched peer (a download of a
            # large state legitimately takes long); one that never shows up is struck all the same.
            trusted = [p for p in others if p.peer_id in vouched or p.stage is Stage.DOWNLOADING]
            busy_peers = [p for p in others if busy(p) and (now < grace or p in trusted)]
            if now >= grace:
                for p in others:
                    if busy(p) and p not in trusted:
                        self._strike(
                            p, outer_step, f"said it was still training round {outer_step} and never averaged"
                        )
            waiting = [p.name for p in busy_peers]
            if not waiting:
                return _Verdict.AVERAGE if not need_ready or any(map(ready, others)) else _Verdict.ALONE
            if now > deadline:
                logger.warning(
                    "round %d: not waiting longer than %.0f s for %s",
                    outer_step,
                    self.config.round_wait,
                    waiting,
                )
                for p in busy_peers:
                    if p.peer_id not in vouched:  # "downloading" for a whole round wait
                        self._strike(
                            p, outer_step, f"said it was downloading in round {outer_step} and never averaged"
                        )
                return _Verdict.AVERAGE if any(map(ready, others)) else _Verdict.ALONE
            if waiting != waited_for:
                logger.debug("round %d: waiting for %s", outer_step, ", ".join(waiting))
                waited_for = waiting
            time.sleep(0.1)

    def _believed_ahead(
        self, ahead: Callable[[PeerHeartbeat], bool], others: list[PeerHeartbeat] | None = None
    ) -> bool:
        """Whether the swarm is past this peer's round: a peer that averaged with this one says
        so, or (before any did) most of the others do. A stranger's word alone is not enough."""
        if others is None:
            others = [p for p in self.board.fetch().values() if p.peer_id != self.peer_id]
        claims = [p for p in others if ahead(p)]
        vouched = self.vouching.vouched
        if any(p.peer_id in vouched for p in claims):
            return True
        return (
            bool(claims) and not any(p.peer_id in vouched for p in others) and 2 * len(claims) > len(others)
        )

    def _strike(self, peer: PeerHeartbeat, outer_step: int, claim: str) -> None:
        if self.vouching.strike(peer.peer_id, outer_step):
            self.board.ignore(peer.peer_id, f"{peer.name} {claim}, {STRIKES} rounds running")

    # --- state for late joiners ---------------------------------------------------------------

    def set_state_priority(self, outer_step: int) -> None:
        """Joiners download from the peer with the highest outer step."""
        if self.averager.allow_state_sharing:
            claimed = _fault(self.averager._fault_file, "state_priority")  # testing: a lying donor
            self.averager.state_sharing_priority = claimed or float(outer_step)

    def download_state(self, *, timeout: float = 60.0) -> OuterState | None:
        """The global state of the most advanced peer whose θ the others confirm, or None if
        nobody served one in time.

        Any peer can declare itself the most advanced and serve a made-up θ. So each state is
        checked before it is used: while it streams, up to ``VERIFIERS`` other peers (those this
        one averaged with first) are asked for their θ's sketches under a seed the donor never
        sees, and the θ that arrived is sketched under it (:func:`swarm.claims.judge_state`
        decides). A refused donor is skipped for the rest of this call; one contradicted by
        peers this one averaged with, for the run.
        """
        deadline = time.monotonic() + timeout
        skipped = set(self._refused_donors)
        for _ in range(DONORS_PER_TRY):
            got = self._fetch_state(skipped, deadline)
            if got is None:
                return None
            state, donor, seed, answers = got
            skipped.add(donor)
            if state is None:
                continue
            vouched = set(self.vouching.vouched)
            verdict = judge_state(
                state.outer_step, state_sketches(state.params, seed), answers, donor=donor, vouched=vouched
            )
            if verdict.accept:
                logger.info(
                    "the state served by %s at outer step %d: %s", donor[-8:], state.outer_step, verdict.why
                )
                return state
            logger.warning(
                "refused the state served by %s: %s; trying another donor", donor[-8:], verdict.why
            )
            if verdict.blame:
                self._refused_donors.add(donor)
                self.board.ignore(
                    donor, f"served a θ at outer step {state.outer_step} that its round mates contradict"
                )
        return None

    def _verifiers(self, skipped: set[str]) -> list[str]:
        """Peers to ask about a downloaded θ, best witnesses first: round mates, then the most
        advanced (a donor is among the most advanced)."""
        vouched = self.vouching.vouched
        others = [
            p
            for p in self.board.fetch().values()
            if p.peer_id != self.peer_id
            and p.peer_id not in skipped
            and p.stage not in (Stage.DOWNLOADING, Stage.JOINING)
        ]
        others.sort(key=lambda p: (p.peer_id not in vouched, -p.outer_step, random.random()))
        return [p.peer_id for p in others[: VERIFIERS + 1]]  # one more: the donor is never asked

    def _fetch_state(self, skipped: set[str], deadline: float) -> tuple[Any, ...] | None:
        """(the state, or None if malformed; its donor; the seed; the witnesses' answers) from
        the best donor not skipped, or None.

        Polls rather than blocks so that this peer's heartbeat ("downloading") stays alive:
        the others' round barrier waits for a downloading peer only while it can see it.
        """
        remaining = max(1.0, deadline - time.monotonic())
        future = self.averager.load_state_from_peers(
            wait=False, timeout=remaining, exclude=sorted(skipped), verifiers=self._verifiers(skipped)
        )
        try:
            while not future.done():
                self.beat(Stage.DOWNLOADING)
                if time.monotonic() > deadline:
                    future.cancel()
                    logger.warning("no peer served the state in time")
                    return None
                time.sleep(0.05)
            result = future.result()
        except KeyboardInterrupt:
            future.cancel()
            raise
        except Exception as error:  # a timeout inside hivemind, ...
            logger.warning("state download failed: %s: %s", type(error).__name__, error)
            return None
        if result is None:
            return None
        metadata, tensors, donor, seed, answers = result
        try:
            return _parse_state(metadata, tensors), donor, seed, answers
        except (SwarmError, KeyError, TypeError, ValueError) as error:
            logger.warning(
                "%s served an incomplete or malformed state (%s); trying another donor", donor[-8:], error
            )
            return None, donor, seed, answers

    def shutdown(self) -> None:
        self.averager.shutdown()


def _held_by_all(members: list[Any]) -> frozenset[bytes]:
    """The ring ids every member says it keeps (a malformed list counts as none kept)."""
    held = None
    for member in members:
        rings = member.get(_RINGS) if isinstance(member, dict) else None
        if not isinstance(rings, list) or len(rings) > MAX_RINGS:
            return frozenset()
        ids = {r for r in rings if isinstance(r, bytes) and len(r) == RING_ID_BYTES}
        held = ids if held is None else held & ids
    return frozenset(held or ())


def _weight(member: Any) -> float:
    """A member's gathered weight; anything but a finite number >= 0 counts as 0."""
    try:
        weight = float(member.get(_WEIGHT, 0.0))
    except (TypeError, ValueError, AttributeError):
        return 0.0
    return weight if math.isfinite(weight) and weight >= 0 else 0.0


def _fault(fault_file: str | None, key: str) -> float:
    """A number from the fault file (testing), 0 if there is none.

    ``serve_delay_ms``: sleep this long per streamed state part (so that a test can kill a
    donor mid-download); ``serve_noise``: serve θ with this much relative noise added (a lying
    donor); ``state_priority``: declare this outer step to joiners (to be picked first)."""
    if not fault_file:
        return 0.0
    try:
        value = float(json.loads(pathlib.Path(fault_file).read_text()).get(key, 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0.0  # no fault file yet, or a half-written one: no fault
    return value if math.isfinite(value) and value > 0 else 0.0


def _parse_state(metadata: Any, tensors: list[torch.Tensor]) -> OuterState:
    """Rebuild an OuterState from what _StateServingAverager.get_current_state sent."""
    if not isinstance(metadata, dict):
        raise SwarmError("the state's metadata is not a dict")
    count = int(metadata.get("num_params", -1))
    inner_keys = metadata.get("inner_keys") or []
    pending = int(metadata.get("num_pending", 0))
    if count < 1 or len(tensors) != (2 + pending) * count + len(inner_keys):
        raise SwarmError(
            f"{len(tensors)} tensors for {count} params: the donor left mid-download (hivemind ends a "
            "broken stream as if it were complete) or runs another version of workbench"
        )
    rest = tensors[2 * count :]
    queued = [[t.float() for t in rest[i * count : (i + 1) * count]] for i in range(pending)]
    return OuterState(
        outer_step=int(metadata["outer_step"]),
        params=[t.float() for t in tensors[:count]],
        momentum=[t.float() for t in tensors[count : 2 * count]],
        pending=queued,
        inner=list(rest[pending * count :]),
        inner_keys=[list(k) for k in inner_keys],
    )


def diverged_from_group(
    mine: dict[str, Any], group: list[dict[str, Any]], *, rel_tol: float = 1e-5
) -> str | None:
    """Why this peer's global params before the round differ from the group's, or None.

    Members of one round must start it from the same θ. If this peer was behind (a lower
    outer step) or on another trajectory (e.g. it stepped alone while others averaged), its θ
    is now wrong and it must download the state. Among members at the same step, the
    trajectory held by most members wins; ties go to the lowest peer id.
    """
    # Other peers' info is untrusted input: skip members whose info does not parse.
    others = [g for g in map(_parse_info, group) if g is not None and g["peer"] != mine.get("peer")]
    mine = _parse_info(mine) or {"peer": str(mine.get("peer")), "outer_step": -1, "fingerprint": []}
    if not others:
        return None
    top = max(g["outer_step"] for g in [mine, *others])
    if mine["outer_step"] < top:
        return f"behind the group (outer step {mine['outer_step']} < {top})"
    same = [g for g in [mine, *others] if g["outer_step"] == top]

    def close(a: dict[str, Any], b: dict[str, Any]) -> bool:
        fa, fb = a["fingerprint"], b["fingerprint"]
        return len(fa) == len(fb) and all(
            abs(x - y) <= rel_tol * max(abs(x), abs(y), 1e-12) for x, y in zip(fa, fb)
        )

    def rank(member: dict[str, Any]) -> tuple[int, str]:
        agreeing = [g for g in same if close(member, g)]
        return -len(agreeing), min(g["peer"] for g in agreeing)  # most agreeing first, then lowest id

    best = min(same, key=rank)
    if close(mine, best):
        return None
    return f"its global params differ from the group's ({-rank(best)[0]} of {len(same)} peers agree on another state)"


def _parse_info(info: Any) -> dict[str, Any] | None:
    """A group member's info as {peer: str, outer_step: int, fingerprint: [float]}, or None."""
    if not isinstance(info, dict):
        return None
    step, fingerprint = info.get("outer_step"), info.get("fingerprint") or []
    if not isinstance(step, int) or isinstance(step, bool) or not isinstance(fingerprint, list):
        return None
    if not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in fingerprint
    ):
        return None
    return {"peer": str(info.get("peer")), "outer_step": step, "fingerprint": [float(x) for x in fingerprint]}
