"""hivemind's DecentralizedAverager, as a peer of this swarm runs it (in its own process):
rounds over the direct data plane (:mod:`swarm.dataplane`, a gloo ring set up through
hivemind's authenticated group) with hivemind's own all-reduce as the fallback, and the global
state served to joiners, with sketches of θ for the witnesses who check a download
(:mod:`swarm.sketch`). :class:`swarm.averaging.SwarmAverager` drives it, one round at a time.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from typing import Any

from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.partition import AllreduceException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import enter_asynchronously

from optim.diloco import OuterState
from swarm import gathered
from swarm.consensus import CHECKED_CODECS, FAILED, Post, TensorSketcher, disagreement, scaled
from swarm.dataplane import (
    DIRECT_CODECS,
    MAX_RINGS,
    RING_ID_BYTES,
    DirectPlane,
    RingUnreachable,
    bindable,
    one_line,
    or_error,
)
from swarm.faults import fault_value
from swarm.hivemind_fixes import ExpectedMembers  # importing it also patches StepControl
from swarm.rendezvous import MAX_VALUE_BYTES, BoardClient, RendezvousBoards, pack, unpack
from swarm.state_sharing import VERIFIERS, StateSharing

logger = logging.getLogger(__name__)

__all__ = ["VERIFIERS", "GroupAverager", "fault_value"]

EXPECTED_BYTES = 1 << 16  # the expected members' ids (~47 bytes each): about 1,300 peers


class GroupAverager(StateSharing, DecentralizedAverager):
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
        masks: int = 0,
        ready_snapshots: bool = True,
        **kwargs: Any,
    ) -> None:
        self._state_provider = state_provider
        self._codec = codec
        self._masks = masks  # the last tensors averaged are kept-masks (--topk-mean kept)
        self._aggregate = aggregate
        self._plane: DirectPlane | None = None
        self._plane_used = False
        self._unreachable = 0  # consecutive rings this peer could not set up
        self._boards = RendezvousBoards()  # the rendezvous of the groups this peer leads
        self._running: set[asyncio.Task] = set()  # see _keep_running
        # Cleared in the averager process when a ring fails; read here before each step.
        self._plane_enabled = mp.Value("b", 0)
        # The ids of the rings the averager process keeps, for the gathered info (written there
        # after each direct round, read here before each step).
        self._ring_ids = mp.Array("c", MAX_RINGS * RING_ID_BYTES)
        self.direct_rounds = mp.Value("q", 0)  # rounds the direct plane carried, for reports
        self._expected = mp.Array("c", EXPECTED_BYTES)  # the next step's round mates (ids)
        self.assembled = mp.Value("d", 0.0)  # when a group last formed (time.time())
        self.generation = mp.Value("q", 0)  # bumped (under the buffers' lock) as the peer fills them
        bind = plane_host if plane_host != "0.0.0.0" else plane_advertise
        bindable_ = bool(bind) and bindable(bind)
        # A donor may send at most this much: 8 copies of the parameters and 64 MiB of slack
        # (θ, momentum, a queued update and AdamW's two moments are 5).
        params = args[0][: len(args[0]) - masks]  # a state holds no masks
        self._init_state_sharing(
            fault_file=fault_file,
            direct=data_plane == "direct",
            state_host=bind if data_plane == "direct" and bindable_ else None,
            limit=8 * 4 * sum(t.numel() for t in params) + (64 << 20),
            ready=ready_snapshots,
        )
        direct = data_plane == "direct" and aggregate == "mean" and codec in DIRECT_CODECS
        if direct and not kwargs.get("client_mode"):
            if bindable_:
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

    async def _shutdown(self, timeout: float | None) -> None:
        """hivemind's shutdown of the averager process, without its crash: hivemind calls
        ``finalize(cancel=True)`` on each value of ``_running_groups`` and gathers what that
        returns, but the values are futures (of the all-reduce runner, or of nothing on the
        direct plane) and ``finalize`` returns nothing. A peer stopped while a group was
        registered (three peers stopped together mid-round) printed an AttributeError traceback
        from the averager's thread. Here each running all-reduce is cancelled for its peers, and
        a group still waiting for its runner is cancelled."""
        if not self.client_mode:
            await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
        for future in list(self._running_groups.values()):
            if not future.done():
                future.cancel()
            elif not future.cancelled() and future.exception() is None and future.result() is not None:
                future.result().finalize(cancel=True)

    def _keep_running(self) -> None:
        """Keep the current task referenced until it is done. hivemind's averager process starts
        each request from the peer (a step, a state download) as a task it keeps no reference to
        (``_run_internal``: ``task = asyncio.create_task(...)``, overwritten by the next one), and
        asyncio holds only weak references to tasks: once the task waits on something only it
        references, the garbage collector may destroy it mid-flight ("Task was destroyed but it
        is pending!"). The peer then waits on a step that never begins (its round mates' ring
        waits for it until the timeout) or a download that never ends."""
        task = asyncio.current_task()
        if task is not None:
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _step(self, **kwargs: Any):
        self._keep_running()
        # A leader forms the group as soon as the expected members joined, rather than at the end
        # of the matchmaking window (hivemind's target group size, which it reads per join).
        self._matchmaking.target_group_size = ExpectedMembers.parse(self._matchmaking, self._expected.value)
        return await super()._step(**kwargs)

    def step(self, gather: Any = None, expected: Sequence[str] = (), **kwargs: Any):
        """hivemind's step; this member's data-plane address travels with its gathered info.
        ``expected``: the other members of this round's group (base58 ids; none: the window)."""
        wanted = ",".join(expected).encode()
        self._expected.value = wanted if len(wanted) < EXPECTED_BYTES else b""
        weight = kwargs.get("weight")
        weight = 1.0 if weight is None else float(weight)  # hivemind's default for a full peer
        mine = gathered.own(bool(self._plane_enabled.value), weight, self._ring_ids.raw, gather)
        return super().step(gather=mine, **kwargs)

    def _group_board(self, group_info, members: list[Any]) -> tuple[BoardClient, list[PeerID], bytes]:
        """The group's board, its members in rank order (by peer id, not hivemind's random
        order: the same members next round find their ring connected), and its secret seed (the
        group id and every member's gathered nonce). The board is held by the first member in
        hivemind's order that accepts connections (a peer in client mode cannot hold it)."""
        peer_ids = sorted(group_info.peer_ids, key=lambda p: p.to_bytes())
        modes = [self.serializer.loads(g)[1] for g in group_info.gathered]
        hosts = [p for p, mode in zip(group_info.peer_ids, modes) if mode != AveragingMode.CLIENT.value]
        leader = hosts[0] if hosts else group_info.peer_ids[0]
        if leader == self.peer_id:
            self._boards.open(group_info.group_id, [p.to_bytes() for p in peer_ids])
        board = BoardClient(
            group_info.group_id,
            self._board_caller(leader, asyncio.get_running_loop()),
            pause=0.002 if leader == self.peer_id else 0.0,  # a missed wake-up costs 2 ms
            wait=self._boards.wait_change if leader == self.peer_id else None,
        )
        return board, peer_ids, group_info.group_id + gathered.nonces(members)

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs: Any):
        # In hivemind's averager process, once the group is formed (and triggered).
        self.assembled.value = time.time()
        members = [self.serializer.loads(self.serializer.loads(g)[2]) for g in group_info.gathered]
        if not self._masks:
            return await self._reduce(group_info, members, min_vector_size, **kwargs)
        # Kept-masks go round scaled like the updates beside them (gathered.mask_scale says why);
        # a failure leaves garbage anyway (the caller keeps its own copy).
        limit = sum(t.numel() for t in self._averaged_tensors[len(self._averaged_tensors) - self._masks :])
        scale = gathered.mask_scale(members, self._codec, limit=limit)
        loop = asyncio.get_running_loop()
        generation = await loop.run_in_executor(None, self._scale_masks, scale, None)
        results = await self._reduce(group_info, members, min_vector_size, **kwargs)
        await loop.run_in_executor(None, self._scale_masks, 1.0 / scale, generation)
        return results

    def _scale_masks(self, factor: float, generation: int | None) -> int:
        """Masks times ``factor``, unless refilled since ``generation`` (an abandoned step that
        finished late); the generation they hold."""
        with self.get_tensors() as tensors:
            if generation is None or generation == self.generation.value:
                for mask in tensors[len(tensors) - self._masks :]:
                    mask.mul_(factor)
            return self.generation.value

    async def _reduce(self, group_info, members: list[Any], min_vector_size: int, **kwargs: Any):
        """The group's all-reduce on the direct plane if every member takes direct rings, else
        hivemind's, checked (:mod:`swarm.consensus`); the members' gathered data."""
        if self._plane is not None and all(map(gathered.takes_direct_rings, members)):
            board, peer_ids, seed = self._group_board(group_info, members)
            ring = functools.partial(
                self._plane.all_reduce,
                board=board,
                seed=seed,
                members=[p.to_base58() for p in peer_ids],
                rank=peer_ids.index(self.peer_id),
                weight=kwargs["weight"],
                total=sum(gathered.weight_of(m) for m in members),
                codec=self._codec,
                reusable=gathered.held_by_all(members),
                # Below hivemind's own deadline for this step, so that a member gone mid-ring
                # ends in our error, not in hivemind cancelling the wait on a running thread.
                timeout=0.75 * (self._allreduce_timeout or 60.0),
                # A follower gives up on its leader request_timeout s after the group's scheduled
                # time; the leader may already have begun: twice that, and the round fails fast.
                arrival=max(5.0, 2 * float(self.request_timeout or 3.0)),
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
            return {peer: gathered.unwrap(m) for peer, m in zip(group_info.peer_ids, members)}
        if self._codec in CHECKED_CODECS:
            results = await self._checked_butterfly(group_info, members, min_vector_size, **kwargs)
        else:  # int8: unchecked (swarm.consensus says why)
            results = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        return {peer: gathered.unwrap(data) for peer, data in results.items()}

    async def _checked_butterfly(self, group_info, members: list[Any], min_vector_size: int, **kwargs: Any):
        """hivemind's all-reduce, then the check that every member got the group's mean (a
        trimmed mean: the same result; :mod:`swarm.consensus`); a member that did not fails the
        round for all."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + 0.75 * (self._allreduce_timeout or 60.0)
        board, peer_ids, seed = self._group_board(group_info, members)
        rank = peer_ids.index(self.peer_id)
        share = kwargs["weight"] / (sum(gathered.weight_of(m) for m in members) or 1.0)
        async with enter_asynchronously(self.get_tensors()) as local_tensors:
            sketcher = TensorSketcher(seed, [t.numel() for t in local_tensors])
            sent = await loop.run_in_executor(None, sketcher.sketch, local_tensors)
        try:
            results = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
            async with enter_asynchronously(self.get_tensors()) as local_tensors:
                got = await loop.run_in_executor(None, sketcher.sketch, local_tensors)
        except Exception:  # the others learn it at once instead of waiting for this member
            await loop.run_in_executor(None, or_error, functools.partial(board.set, f"mean/{rank}", FAILED))
            raise
        if board.held_here:  # a fresh lease, however long the all-reduce took
            self._boards.open(group_info.group_id, [p.to_bytes() for p in peer_ids], renew=True)
        post = Post(scaled(sent, share), sent.norm, got.rows).to_bytes()
        others = [f"mean/{r}" for r in range(len(peer_ids)) if r != rank]
        exchange = functools.partial(
            board.exchange, f"mean/{rank}", post, others, max(1.0, deadline - time.monotonic())
        )
        answers = await loop.run_in_executor(None, or_error, exchange)
        if isinstance(answers, str):
            raise AllreduceException(
                f"hivemind's all-reduce: the members' check did not complete ({answers})"
            )
        posts = [*answers[:rank], post, *answers[rank:]]
        why = disagreement(posts, self._codec, linear=self._aggregate == "mean")
        if why is not None:
            raise AllreduceException(f"hivemind's all-reduce gave the members different results: {why}")
        return results

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
