"""The state a peer serves to joiners, and the requests a joiner makes: the half of
:class:`swarm.group_averager.GroupAverager` that runs in hivemind's averager process for late
joiners (the joiner's own half is :mod:`swarm.download`).

A donor answers ``rpc_state_offer`` with an offer for the direct transport
(:mod:`swarm.state_transfer`): a snapshot of its state (one per outer step, taken when the
step is declared and shared by all its joiners; for a state over ``READY_BYTES`` or an
overlapped run, taken when a joiner asks and shared by those that ask within
``SNAPSHOT_SECONDS``), a hash per slice, its listener's address and a token. For a joiner, :meth:`StateSharing.state_offers` collects up to ``MAX_DONORS`` offers (asking the next donor
when one makes none) and
asks witnesses for their θ's sketches meanwhile; :meth:`StateSharing.load_state_from_peers` is
hivemind's stream from one donor at a time, the fallback (a private run, a donor in client mode,
slices that could not all be had).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import math
import multiprocessing as mp
import random
import secrets
import time
from collections.abc import Callable, Sequence
from concurrent.futures import InvalidStateError
from typing import Any, AsyncIterator  # noqa: UP035 - hivemind reads typing's name to detect streams

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming

from optim.diloco import OuterState
from swarm.addresses import direct_ips, far_ip, reached_at
from swarm.bounds import whole
from swarm.claims import at_the_donors_step
from swarm.dataplane import one_line
from swarm.errors import SwarmError
from swarm.faults import fault_value
from swarm.rendezvous import pack, unpack
from swarm.ring_driver import messages
from swarm.signed_groups import peer_of
from swarm.sketch import Sketch, state_sketches
from swarm.state_fetch import DonorOffer, freshest
from swarm.state_transfer import (
    HASH_BYTES,
    HASHES,
    MAX_PER_ADDRESS,
    MAX_TENSORS,
    MIN_RATE,
    TOKEN_BYTES,
    Layout,
    Snapshot,
    StateServer,
)

logger = logging.getLogger(__name__)

SEED_BYTES = 16  # a joiner's seed for sketching the θ it downloaded
VERIFIERS = 4  # peers asked to confirm a downloaded state
MAX_SKETCH_ANSWER = 1 << 20  # 72 bytes a tensor: room for 14,000 tensors
MAX_DONORS = 4  # donors asked for an offer at once in one direct download (and offers taken)
MAX_DIMS = 64
"""The most dimensions a tensor of a streamed state may have (torch's own limit is 25)."""
MAX_ASKED = 64  # donors asked in all, in turn as those before make no offer
OFFER_SECONDS = 15.0  # s for the offers in all (see _first_offers)
MAX_OFFER = 4 << 20
"""An offer's bytes: 64 KiB of hashes, a layout, the metadata (its optimizer's keys, about 35
bytes a trained tensor: rendezvous' 128 KiB bound on bytes dropped every offer of a model past
3,700 tensors, unsaid, and each join took the stream, a review of 2026-12-06)."""
OFFER_GRACE = 0.25  # s to wait for more offers once the first came in (see _first_offers)
TOP_WAIT = 2.0  # s the first-ranked donor's offer is waited for, from the request (see _first_offers)
SNAPSHOT_SECONDS = 10.0  # joiners asking within this long (and at the same declared step) share a snapshot
WITNESS_SECONDS = 120.0  # for the peer's process to sketch θ (it may wait for an overlapped round)
MAX_STREAMS = 3
"""hivemind's state streams served at once (one per peer, and one per address another machine
connects from: fresh keys are free): each holds a copy of the state while it runs (6 stalled
streams held 3.1 GB of a 200 MB state, measured). A joiner refused gets an empty stream and
asks the next donor."""
MEMBERS_WAIT = 5.0  # s a private run's peer looks for an asker's heartbeat (see _a_member)
MEMBERS_PAUSE = 0.5  # s between two reads of the run's heartbeats for it
MEMBERS_WAITING = 8  # askers waiting for such a read at most; another not found is refused at once
STREAM_GRACE = 30.0  # s for a stream's first bytes (the state is copied out of the peer first)
STREAM_WINDOW = 10.0  # s over which a stream must move MIN_RATE bytes a second, or is cut
READY_BYTES = 2 << 30
"""A state up to this size is snapshotted as soon as its step is declared and kept for that
step, so that the first joiner does not wait for the copy and the hashes (about 1 s per 400 MB
here; measured in benchmarks.overheads' join). A larger one is snapshotted when a joiner asks
and freed ``SNAPSHOT_SECONDS`` later, to keep its copy out of memory between joins."""


def half_connected(donors: list[PeerID], connected: set[PeerID]) -> list[PeerID]:
    """``donors`` (highest declared priority first) in the order they are asked for offers: in
    turn the best not asked yet, and the best this peer is connected to. A declaration costs a
    fresh key nothing, while a peer met through the DHT runs a process: fresh keys claiming the
    freshest step take half the places at most, and a fresher donor not connected to is still
    asked first (its offer, if it makes one, wins: :func:`swarm.state_fetch.freshest`)."""
    ordered, near = [], iter([d for d in donors if d in connected])
    taken: set[PeerID] = set()
    for donor in donors:
        for pick in (donor, next(near, None)):
            if pick is not None and pick not in taken:
                taken.add(pick)
                ordered.append(pick)
    return ordered


def _declared(task: asyncio.Task) -> None:
    """A declaration's store ended: its failure (most often, unanswered before it expired) is
    logged, not left for asyncio to print; the next period declares again."""
    if not task.cancelled() and task.exception() is not None:
        logger.debug("declaring the state for download failed: %s", one_line(task.exception()))


class StateSharing:
    """Mixin for hivemind's DecentralizedAverager: the state served and downloaded.
    :meth:`_init_state_sharing` before hivemind's ``__init__``."""

    def _init_state_sharing(
        self,
        *,
        fault_file: str | None,
        direct: bool,
        state_host: str | None,
        limit: int,
        ready: bool = True,
        theta_provider: Callable[[], OuterState] | None = None,
        subkey: bytes | None = None,
        members: str | None = None,
    ) -> None:
        """``direct``: download over the direct transport when donors offer it (else hivemind's
        path only: a private run, ``--data-plane hivemind``). ``state_host``: the address its
        listener binds to serve joiners (``--host``; None: serve over hivemind's path only).
        ``limit``: the most bytes a donor may send. ``ready``: snapshot each step when it is
        declared (see READY_BYTES); off for overlapped rounds, whose state waits for the round
        in flight: a snapshot taken at every step would keep this peer answering a state request
        (which the overlapped barrier reads) and make a joiner queue behind it.
        ``theta_provider``: the state without the inner optimizer's (``inner=False``), for a
        witness's sketches, which are then taken in the peer's process (see
        :meth:`_answer_witnesses`); None: a witness fetches the whole state from it.
        ``subkey``: this peer's ``[owner:...]`` key, under which it declares its state (a run's
        validators refuse any other subkey: :class:`swarm.validators.RecordBoundsValidator`);
        None: hivemind's bare peer id (averagers outside a run, in tests).
        ``members``: a private run's DHT key of its heartbeats: only a peer with one there (its
        record is sealed with the run secret, so its writer holds the secret) is served the
        state or θ's sketches (:meth:`_a_member`); None: anybody (a public run's state is its
        joiners')."""
        self._donor_subkey = subkey
        self._members_key = members
        self._members: dict[PeerID, float] = {}  # (averager process) those found there, until when
        self._members_read_task: asyncio.Future | None = None  # the read of them in flight
        self._members_read = 0.0  # when they were last read
        self._members_waiting = 0  # askers not found yet, waiting for a read
        self._streamed = mp.Array("c", 1024)  # "tag|donor,..." (see streamed_from), by id
        self._stream_tag = 0  # (averager process) the latest stream download asked for
        self._fault_file = fault_file
        self._state_direct = direct
        self._state_host = state_host
        self._state_limit = limit
        self._server: StateServer | None = None  # made in the averager process at the first offer
        self._snapshot: tuple[float, float, Snapshot] | None = None  # (priority, taken at, snapshot)
        self._snapshot_lock: asyncio.Lock | None = None
        self._state_bytes = 0  # the last snapshot's size (0: none taken yet)
        self._ready_snapshots = ready
        self._preparing: asyncio.Task | None = None  # the snapshot taken ahead of joiners (referenced)
        self._clock = time.monotonic  # when snapshots were taken (tests move it)
        self._sketch_lock: asyncio.Lock | None = None  # made in the averager process's loop
        self._sketch_after = 0.0
        self._witnesses: dict[bytes, asyncio.Future] = {}  # seed -> answers of the early witnesses
        self._theta_provider = theta_provider
        # A witness's seed (the averager process -> the peer's) and its answer (back): see
        # _answer_witnesses. Each process closes the other's end once the averager is forked.
        self._witness_here, self._witness_there = mp.Pipe() if theta_provider is not None else (None, None)
        self._witness_asked: tuple[bytes, asyncio.Future, float] | None = None  # (seed, answer, deadline)
        # The download in progress: bytes received, bytes announced, donors serving it.
        self.download = mp.Array("d", 3)
        self._streams: dict[str, str | None] = {}  # peers served hivemind's state stream: their IP
        self._own_ips: set[str] | None = None  # this peer's addresses, as its daemon shows them

    # --- the direct transport: donor side ------------------------------------------------------

    async def rpc_state_offer(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> averaging_pb2.DownloadData:
        """An offer of this peer's state for the direct transport (:mod:`swarm.state_transfer`):
        its layout, a hash per slice, this peer's listener and a token for the caller only (this
        channel is hivemind's: authenticated and encrypted)."""
        if self._state_host is None or not self.allow_state_sharing or len(request.metadata) > 256:
            return averaging_pb2.DownloadData(metadata=pack({"ok": False}))
        try:
            snapshot = await self._current_snapshot()
            if self._server is None:
                # On loopback every joiner is on this machine: no address to hold to its share.
                local = ipaddress.ip_address(self._state_host).is_loopback
                self._server = StateServer(self._state_host, per_address=None if local else MAX_PER_ADDRESS)
                self._server.delay = lambda: fault_value(self._fault_file, "serve_delay_ms")
                self._server.tamper = lambda: fault_value(self._fault_file, "serve_bad_slices")
                host, port = self._server.address
                logger.info(
                    "serving the state to joiners on %s:%d (TCP; only a joiner this peer made an "
                    "offer to, over hivemind's authenticated channel, is answered)",
                    host,
                    port,
                )
            token = self._server.offer(snapshot, context.remote_id.to_base58())
        except Exception as error:  # noqa: BLE001 - the joiner falls back to hivemind's stream
            logger.warning("could not offer the state for a direct download: %s", one_line(error))
            return averaging_pb2.DownloadData(metadata=pack({"ok": False}))
        answer = {
            "ok": True,
            "step": snapshot.step,
            "metadata": snapshot.metadata,
            "layout": snapshot.layout.to_wire(),
            "hashes": b"".join(snapshot.hashes),
            "hash": snapshot.hash_name,
            "address": list(self._server.address),
            "token": token,
        }
        lie = int(fault_value(self._fault_file, "offer_loopback_port"))  # testing: a lying donor
        if lie:
            answer["address"] = ["127.0.0.1", lie]
        return averaging_pb2.DownloadData(metadata=pack(answer))

    def _fresh_snapshot(self) -> Snapshot | None:
        """The snapshot of this peer's declared step: kept for the step if the state is at most
        ``READY_BYTES``, else taken in the last ``SNAPSHOT_SECONDS``."""
        if self._snapshot is None:
            return None
        at, taken, snapshot = self._snapshot
        if at == self.state_sharing_priority and (
            self._keeps_snapshots() or self._clock() - taken < SNAPSHOT_SECONDS
        ):
            return snapshot
        self._snapshot = None  # freed once the offers of it expire (swarm.state_transfer)
        return None

    def _keeps_snapshots(self) -> bool:
        return self._ready_snapshots and self._state_bytes <= READY_BYTES

    async def _declare_for_download_periodically(self) -> None:
        """Tell the DHT that this peer serves its state, every ``declare_state_period`` s and at
        once when that changes (withdrawn once after sharing stops), as hivemind does, except
        that a declaration the DHT has not stored by the time it expires is dropped quietly:
        hivemind left each such store's TimeoutError unretrieved, and asyncio printed "Task
        exception was never retrieved" with a traceback into the log, once per period for as long
        as the DHT was slow (a busy machine, a stalled DHT process)."""
        key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        was_shared = self.allow_state_sharing
        while True:
            expires = get_dht_time() + self.declare_state_period
            if self.allow_state_sharing or was_shared:
                store = self.dht.store(
                    key,
                    subkey=self._donor_subkey or self.peer_id.to_bytes(),
                    value=self.state_sharing_priority if self.allow_state_sharing else None,
                    expiration_time=expires,
                    return_future=True,
                )
                declared = asyncio.create_task(asyncio.wait_for(store, timeout=expires - get_dht_time()))
                declared.add_done_callback(_declared)
                was_shared = self.allow_state_sharing
            self._state_updated.clear()  # set when the priority or the sharing changes
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._state_updated.wait(), timeout=max(0.0, expires - get_dht_time()))

    async def _trigger_declare_load_state(self) -> None:
        """A new step declared: also snapshot it now, before any joiner asks (see READY_BYTES);
        one such snapshot at a time (a step declared meanwhile is taken right after it)."""
        await super()._trigger_declare_load_state()  # type: ignore[misc]
        busy = self._preparing is not None and not self._preparing.done()
        if self._state_host is not None and self.allow_state_sharing and self._keeps_snapshots() and not busy:
            self._preparing = asyncio.create_task(self._prepare_snapshot())

    async def _prepare_snapshot(self) -> None:
        """Snapshot the declared step; once more if a newer step was declared meanwhile (its
        trigger found this one busy), never more: a joiner's request takes any later one."""
        try:
            for _ in range(2):
                await self._current_snapshot()
                if self._fresh_snapshot() is not None:
                    return
        except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - a joiner's request will try again
            # (a KeyboardInterrupt here is the peer's process's, sent as the state's answer: raised
            # out of this task it would end the averager's event loop)
            logger.debug("could not snapshot the state ahead of joiners: %s", one_line(error))

    async def _current_snapshot(self) -> Snapshot:
        """The snapshot of this peer's state at its declared step (one for all joiners of it)."""
        if self._snapshot_lock is None:
            self._snapshot_lock = asyncio.Lock()
        async with self._snapshot_lock:
            priority = self.state_sharing_priority
            fresh = self._fresh_snapshot()
            if fresh is not None:
                return fresh
            asked = time.perf_counter()
            metadata, tensors, _ = await self._get_current_state_from_host_process()
            parsed = self.serializer.loads(metadata)
            shared = (2 + int(parsed["num_pending"])) * int(parsed["num_params"])
            got = time.perf_counter()
            snapshot = await asyncio.get_running_loop().run_in_executor(
                None, Snapshot.take, int(parsed["outer_step"]), metadata, tensors, shared
            )
            self._snapshot = (priority, self._clock(), snapshot)
            self._state_bytes = snapshot.layout.total
            logger.debug(
                "snapshot of step %d (%.0f MB) for joiners: %.2f s for the state from the peer, %.2f s to hash it",
                snapshot.step,
                snapshot.layout.total / 1e6,
                got - asked,
                time.perf_counter() - got,
            )
            return snapshot

    # --- the direct transport: joiner side -----------------------------------------------------

    async def _offer_from(self, peer: PeerID) -> tuple[DonorOffer, int, bytes, Layout] | None:
        """(the offer, its step, its metadata, its layout) from ``peer``, None if it made none."""
        try:
            stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
            answer = await stub.rpc_state_offer(averaging_pb2.DownloadData(metadata=pack({})), timeout=10)
            message = unpack(answer.metadata, max_bin=MAX_OFFER) if len(answer.metadata) <= MAX_OFFER else {}
            if message.get("ok") is not True:
                if answer.metadata and not message:  # (not one that offers nothing: one we cannot read)
                    logger.info("the state offer of %s could not be read: its stream instead", peer)
                return None
            layout = Layout.from_wire(message.get("layout"), self._state_limit)
            step, metadata, hashes = message.get("step"), message.get("metadata"), message.get("hashes")
            host, port = message.get("address") or (None, None)
            token = message.get("token")
            hash_name = message.get("hash", "sha256")  # a donor from before it was named
            count = len(layout.slices())
            if not (
                whole(step)
                and isinstance(metadata, bytes)
                and isinstance(hashes, bytes)
                and len(hashes) == count * HASH_BYTES
                and isinstance(host, str)
                and whole(port)
                and 0 < port < 65536
                and isinstance(token, bytes)
                and len(token) == TOKEN_BYTES
                and isinstance(hash_name, str)
                and hash_name in HASHES
            ):
                raise ValueError("a malformed offer")
            parsed = self.serializer.loads(metadata)
            if not isinstance(parsed, dict) or parsed.get("outer_step") != step:
                raise ValueError("an offer whose step is not its state's")
            # The joiner will connect where the offer says and send the token there: a donor
            # must not be able to point that connection at another host (a service behind the
            # joiner's firewall, say). Its listener must be where this peer reaches it.
            connections = [a for p in await self._p2p.list_peers() if p.peer_id == peer for a in p.addrs]
            if not reached_at(host, connections):
                logger.info(
                    "ignoring %s's direct state offer: its listener (%s) is not an address this peer "
                    "reaches it at (the other offers, or hivemind's stream, serve this joiner)",
                    peer.to_base58()[-8:],
                    host,
                )
                return None
            split = [hashes[i * HASH_BYTES : (i + 1) * HASH_BYTES] for i in range(count)]
            offer = DonorOffer(peer.to_base58(), (host, port), token, split, hash_name)
            return offer, step, metadata, layout
        except Exception as error:  # noqa: BLE001 - no offer: hivemind's stream is the fallback
            logger.debug("no state offer from %s: %s", peer, one_line(error))
            return None

    def state_offers(self, exclude: Sequence[str] = (), verifiers: dict[str, int] | None = None) -> MPFuture:
        """(From the peer's process.) The offers of the donors not in ``exclude`` (base58 ids)
        for the direct transport: a future of ``([(DonorOffer, outer step, metadata bytes,
        Layout), ...], seed)`` (no offers: nobody makes one). Once they are in, and not before
        (every donor asked is bound to its state by its hashes then, so no donor can learn the
        seed in time to aim a θ at it, even from a witness it colludes with), the ``verifiers``
        but the donor whose θ will be taken (:func:`swarm.state_transfer.freshest`) are asked
        for their θ's sketches under ``seed``, while the slices arrive; a donor among them
        sketches the state it offered. :meth:`theta_sketches` collects the answers.
        ``verifiers``: best first, each with the outer step it claims; those at the chosen
        donor's step are asked first (:func:`swarm.claims.at_the_donors_step`)."""
        future = MPFuture()
        request = dict(future=future, exclude=tuple(exclude), verifiers=dict(verifiers or {}))
        self._outer_pipe.send(("_state_offers", [], request))
        return future

    async def _state_offers(
        self, future: MPFuture, exclude: Sequence[str], verifiers: dict[str, int]
    ) -> None:
        try:
            donors = await self._donors(exclude) if self._state_direct else []
            connected = {info.peer_id for info in await self._p2p.list_peers()} if donors else set()
            offers = await self._first_offers(half_connected(donors, connected)[:MAX_ASKED])
            if future.done():  # the joiner gave up meanwhile: no witness to ask
                return
            seed = secrets.token_bytes(SEED_BYTES)
            if offers:
                chosen, step = freshest(offers)[:2]
                first = chosen.peer
                tokens = {o.peer: o.token for o, *_ in offers}
                witnesses = [v for v in at_the_donors_step(list(verifiers), verifiers, step) if v != first][
                    :VERIFIERS
                ]
                self._witnesses[seed] = [
                    asyncio.ensure_future(self._sketches_from([v], seed, timeout=10.0, token=tokens.get(v)))
                    for v in witnesses
                ]
                while len(self._witnesses) > MAX_DONORS:
                    for task in self._witnesses.pop(next(iter(self._witnesses))):
                        task.cancel()
            future.set_result((offers, seed))
        except BaseException as error:  # noqa: BLE001 - never leave the peer's future pending
            if not future.done():
                future.set_exception(error)

    async def _first_offers(self, donors: list[PeerID]) -> list[tuple[DonorOffer, int, bytes, Layout]]:
        """Up to ``MAX_DONORS`` offers from ``donors`` (best first), asked ``MAX_DONORS`` at a time:
        a donor that makes none (it cannot be dialed, refuses, or its offer is malformed) gives
        its place to the next. Those that come in by the time the first one did plus half as
        long again (at least ``OFFER_GRACE`` s): a donor still preparing its snapshot (with
        ``--overlap``, after its round in flight) does not hold the joiner up.

        (Fresh keys are free: six of them declaring the freshest step, with no process behind
        them, took all four places, and every joiner fell back to hivemind's stream, ten times
        slower; stop 59.) Nothing is asked, and nothing waited for, past ``OFFER_SECONDS``:
        donors whose dials hang, four at a time, would otherwise hold the joiner 10 s a wave."""
        started = time.monotonic()
        hard = started + OFFER_SECONDS
        queue = iter(donors)
        pending: set[asyncio.Future] = set()

        def ask_next() -> asyncio.Future | None:
            donor = next(queue, None) if time.monotonic() < hard else None
            if donor is None:
                return None
            task = asyncio.ensure_future(self._offer_from(donor))
            pending.add(task)
            return task

        top = ask_next()
        for _ in range(MAX_DONORS - 1):
            ask_next()
        offers, deadline = [], None
        while pending:
            # The first-ranked donor (the freshest step declared) is waited for up to TOP_WAIT s:
            # on a busy machine its offer came in past the others' grace, the joiner took an
            # older state and the order of its donors (and witnesses) was the machine's load's.
            until = deadline if top not in pending or deadline is None else max(deadline, started + TOP_WAIT)
            timeout = max(0.0, min(hard if until is None else until, hard) - time.monotonic())
            done, _ = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break
            pending -= done
            for task in done:
                if task.result() is not None:
                    offers.append(task.result())
                elif deadline is None or time.monotonic() < deadline:
                    ask_next()
            if offers and deadline is None:
                deadline = time.monotonic() + max(OFFER_GRACE, 0.5 * (time.monotonic() - started))
        for task in pending:
            task.cancel()
        order = {d.to_base58(): i for i, d in enumerate(donors)}
        return sorted(offers, key=lambda o: order[o[0].peer])  # by rank

    def theta_sketches(self, seed: bytes) -> MPFuture:
        """(From the peer's process.) A future of ``{peer: (outer step, θ sketches under seed)
        or None}`` (see :meth:`rpc_theta_sketch`) from the witnesses :meth:`state_offers` asked
        under ``seed``."""
        future = MPFuture()
        self._outer_pipe.send(("_theta_sketches", [], dict(future=future, seed=seed)))
        return future

    async def _theta_sketches(self, future: MPFuture, seed: bytes) -> None:
        try:
            answers: dict = {}
            for answered in await asyncio.gather(*self._witnesses.pop(seed, [])):
                answers.update(answered)
            future.set_result(answers)
        except BaseException as error:  # noqa: BLE001 - never leave the peer's future pending
            if not future.done():
                future.set_exception(error)

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        # Runs in hivemind's averager process. Each stream holds a copy of the state while it
        # runs, so: at most MAX_STREAMS at once, one per peer and one per address another machine
        # connects from (a joiner refused gets an empty stream and asks the next donor), and a
        # stream that moves less than MIN_RATE bytes a
        # second over STREAM_WINDOW (after STREAM_GRACE for its first bytes) is cut.
        # Testing: a fault file's ``serve_delay_ms`` slows the stream down part by part (64 KiB),
        # so that a test can kill this donor mid-download; the direct transport is slowed alike
        # (StateServer.delay).
        peer = context.remote_id.to_base58()
        if not await self._a_member(context.remote_id):
            logger.info("not serving the state to %s: not a peer of this private run", peer[-8:])
            return
        address = await self._far_ip(context.remote_id)
        busy = peer in self._streams or (address is not None and address in self._streams.values())
        if len(self._streams) >= MAX_STREAMS or busy:
            logger.info(
                "not serving the state to %s: %d streams already run%s",
                peer[-8:],
                len(self._streams),
                " (one to its address)" if busy else "",
            )
            return
        self._streams[peer] = address
        sent = [0]
        watch = asyncio.ensure_future(_cut_if_stalled(asyncio.current_task(), sent, peer))
        try:
            delay = fault_value(self._fault_file, "serve_delay_ms") / 1000
            if delay:
                logger.warning(
                    "serving the state slowly to %s (fault injection: %.0f ms per part)", peer, delay * 1000
                )
            async for message in super().rpc_download_state(request, context):
                yield message
                sent[0] += len(message.tensor_part.buffer) + len(message.metadata)
                if delay:
                    await asyncio.sleep(delay)
        finally:
            watch.cancel()
            self._streams.pop(peer, None)

    async def _a_member(self, peer: PeerID) -> bool:
        """Whether ``peer`` may read this peer's state: always in a public run; in a private one,
        if it has a live heartbeat under the run's key (which only holders of the secret can
        write). A joiner asks right after publishing its first heartbeat: one not found yet is
        looked for again, in one read of the run's heartbeats :data:`MEMBERS_PAUSE` s apart
        that every asker waits on, for :data:`MEMBERS_WAIT` s at most; past
        :data:`MEMBERS_WAITING` askers waiting, another not found is refused at once (a flood of
        outsiders' requests, queued behind one another, held each for up to 56 s and a late
        joiner behind them: a review). Before, anybody who connected to a peer of a private run
        (the run's namespace is in its handlers' names, which libp2p lists to any caller)
        downloaded its θ and optimizer state."""
        if self._members_key is None or self._is_member(peer):
            return True
        if self._members_waiting >= MEMBERS_WAITING:
            return False
        self._members_waiting += 1
        try:
            deadline = time.monotonic() + MEMBERS_WAIT
            while (left := deadline - time.monotonic()) > 0:
                if self._members_read_task is None or self._members_read_task.done():
                    self._members_read_task = asyncio.ensure_future(self._read_members())
                try:
                    await asyncio.wait_for(asyncio.shield(self._members_read_task), left)
                except asyncio.TimeoutError:
                    return False
                if self._is_member(peer):
                    return True
            return False
        finally:
            self._members_waiting -= 1

    def _is_member(self, peer: PeerID) -> bool:
        return self._members.get(peer, 0.0) > get_dht_time()

    async def _read_members(self) -> None:
        """The run's heartbeats now: their writers, each until its heartbeat expires."""
        await asyncio.sleep(max(0.0, self._members_read + MEMBERS_PAUSE - time.monotonic()))
        self._members_read = time.monotonic()
        try:
            found = await self.dht.get(self._members_key, latest=True, return_future=True)
        except Exception as error:  # noqa: BLE001 - the DHT did not answer: not found yet
            logger.debug("could not read the run's peers: %s", one_line(error))
            return
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        members: dict[PeerID, float] = {}
        for subkey, entry in entries.items():
            writer = peer_of(subkey)
            expiration = getattr(entry, "expiration_time", None)
            if writer is not None and isinstance(expiration, (int, float)):
                members[writer] = max(members.get(writer, 0.0), float(expiration))
        self._members = members

    async def _far_ip(self, peer: PeerID) -> str | None:
        """Where ``peer`` is connected from (:func:`swarm.addresses.far_ip`; None: this machine,
        a relay, unknown)."""
        try:
            if self._own_ips is None:
                self._own_ips = {str(ip) for ip in direct_ips(await self._p2p.get_visible_maddrs())}
            connections = [a for p in await self._p2p.list_peers() if p.peer_id == peer for a in p.addrs]
            return far_ip(connections, self._own_ips)
        except Exception as error:  # noqa: BLE001 - the daemon did not answer: one per peer still holds
            logger.debug("could not list the connections to %s: %s", peer, one_line(error))
            return None

    # --- downloads that the joiner checks (see SwarmAverager.download_state) ------------------

    def load_state_from_peers(
        self,
        wait: bool = True,
        timeout: float | None = None,
        exclude: Sequence[str] = (),
        verifiers: Sequence[str] = (),
        tag: int = 0,
    ):
        """hivemind's download, skipping the donors in ``exclude`` (base58 peer ids). While the
        state streams, up to ``VERIFIERS`` of ``verifiers`` (never the donor) are asked for their
        θ's sketches, each under a seed of its own drawn for this donor (which the donor never
        sees, unless a witness colludes: it then knows that witness's). A result is (metadata,
        tensors, the donor's peer id, {verifier: its seed}, {verifier: (outer step, sketches) or
        None}). ``tag``: names this download for :meth:`streamed_from`."""
        future = MPFuture()
        request = dict(
            timeout=timeout, future=future, exclude=tuple(exclude), verifiers=tuple(verifiers), tag=tag
        )
        self._outer_pipe.send(("_load_state_from_peers", [], request))
        return future.result(timeout=timeout) if wait else future

    async def _load_state_from_peers(
        self,
        future: MPFuture,
        timeout: float | None = None,
        exclude: Sequence[str] = (),
        verifiers: Sequence[str] = (),
        tag: int = 0,
    ) -> None:
        # In the averager process. Donors in order of the priority they declare (their outer
        # step; anyone can declare any, which is why the joiner checks what it gets). A fresh
        # key's declaration with no process behind it fails its dial at once. Within ``timeout``,
        # and not past the joiner's giving up (``future`` cancelled): a stream went on through
        # every donor after the joiner's deadline, kept its place at the donor (the joiner's next
        # try got an empty stream there), showed its bytes as the next download's, and ended in
        # an InvalidStateError traceback (a review, 2026-12-06).
        self._stream_tag = tag
        stalled: list[str] = []
        self._note_streamed(tag, stalled)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for peer in await self._donors(exclude):
                left = None if deadline is None else deadline - time.monotonic()
                if future.done() or (left is not None and left <= 0):
                    return
                donor = peer.to_base58()
                self._note_streamed(tag, [*stalled, donor])  # being streamed from
                asked = [v for v in verifiers if v != donor][:VERIFIERS]
                # Asked while the state streams (not after): a round can end during a download,
                # and the witnesses' θ should be of the step the donor serves. Nothing binds the
                # stream before it ends, so each witness gets a seed of its own: with one seed
                # for all, a witness colluding with the donor passed it on, the donor aimed a θ
                # at it (about -θ, with the same 8 projections and norm) and every honest witness
                # confirmed that θ (a review, stop 72). Now a colluder's seed fools its own vote.
                seeds = {v: secrets.token_bytes(SEED_BYTES) for v in asked}
                witnesses = asyncio.ensure_future(self._sketches_each(seeds, timeout=10.0))
                try:
                    got, stalled_here = await asyncio.wait_for(self._download_from(peer), left)
                except asyncio.TimeoutError:
                    logger.warning("state download from %s: not done by the joiner's deadline", peer)
                    got, stalled_here = None, True
                if got is not None:
                    self._note_streamed(tag, [])
                    answers = await witnesses
                    with contextlib.suppress(InvalidStateError):  # (given up on meanwhile)
                        future.set_result((*got, donor, seeds, answers))
                    return
                witnesses.cancel()
                if stalled_here:  # not one that refused at once or could not be dialed
                    stalled.append(donor)
                self._note_streamed(tag, stalled)
        finally:
            with contextlib.suppress(InvalidStateError):
                if not future.done():
                    future.set_result(None)

    async def _donors(self, exclude: Sequence[str]) -> list[PeerID]:
        """The peers that declare a state, highest declared priority first (ties at random)."""
        key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        found = await self.dht.get(key, latest=True, return_future=True)
        declared = found.value if found is not None and isinstance(found.value, dict) else {}
        donors = []
        for subkey, entry in declared.items():
            priority = getattr(entry, "value", None)
            if not isinstance(priority, (int, float)) or not math.isfinite(priority):
                continue
            peer = self._donor_of(subkey)
            if peer is None:
                continue
            if peer != self.peer_id and peer.to_base58() not in exclude:
                donors.append((float(priority), random.random(), peer))
        return [peer for _, _, peer in sorted(donors, key=lambda d: d[:2], reverse=True)]

    def _note_streamed(self, tag: int, donors: list[str]) -> None:
        """(Averager process.) Record the download ``tag``'s stalled donors and the one it streams
        from, unless a later download was asked for meanwhile (an abandoned one runs on)."""
        note = f"{tag}|{','.join(donors)}".encode()
        if tag == self._stream_tag and len(note) < len(self._streamed):
            self._streamed.value = note

    def streamed_from(self, tag: int) -> list[str]:
        """(Either process.) The donors the stream download ``tag`` (:meth:`load_state_from_peers`)
        gave up on because they stalled (a chunk or the start of their stream did not come in
        time), and the one it was streaming from when it was cut off; [] for another download."""
        found, _, donors = self._streamed.value.decode(errors="replace").partition("|")
        return [peer for peer in donors.split(",") if peer] if found == str(tag) else []

    def _donor_of(self, subkey: Any) -> PeerID | None:
        """The peer a declaration's subkey names: the peer id of its ``[owner:...]`` key (the
        signature proves that peer wrote it), or, for averagers outside a run that declare under
        bare peer ids, that id; None if malformed."""
        try:
            return PeerID(subkey) if self._donor_subkey is None else peer_of(subkey)
        except Exception:  # noqa: BLE001 - a made-up subkey is just skipped
            return None

    async def _download_from(self, peer: PeerID) -> tuple[tuple[Any, list[torch.Tensor]] | None, bool]:
        """One donor's state stream, at most ``self._state_limit`` bytes, or None if it failed; and
        whether it failed by stalling (the start of its stream, or a chunk, did not come in time)."""
        logger.info("downloading the state from %s", peer)
        try:
            stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
            # Bounded: dialing a frozen donor (SIGSTOP, a laptop asleep) stalls in libp2p's
            # protocol negotiation for about 30 s before the stream resets; the next donor waits.
            stream = await asyncio.wait_for(
                stub.rpc_download_state(averaging_pb2.DownloadRequest()),
                timeout=self.next_chunk_timeout or self.request_timeout,
            )
            metadata, tensors, parts, received = None, [], [], 0
            self.download[:] = [0.0, 0.0, 1.0]
            async for message in aiter_with_timeout(
                stream, timeout=self.next_chunk_timeout or self.request_timeout
            ):
                # The whole message: a part with an empty buffer and a shape of 4 M dimensions
                # counted 0 bytes here, and was kept at 8x its size (5 GB for 600 MiB sent).
                received += message.ByteSize()
                part = message.tensor_part
                if len(part.size) > MAX_DIMS or (part.size and not part.dtype):
                    # Only a tensor's first part says its shape (hivemind's split_for_streaming).
                    raise SwarmError(f"it sent a tensor part with a shape of {len(part.size)} dimensions")
                if received > self._state_limit:
                    raise SwarmError(
                        f"it sent over {self._state_limit >> 20} MiB, more than this model's state"
                    )
                if message.tensor_part.dtype and len(tensors) >= MAX_TENSORS:
                    # Each an empty tensor of 14 bytes on the wire, 1.5 KB here: 400,000 of them
                    # grew the process by 600 MB within a 6 MB byte count (a review, 2026-12-06).
                    raise SwarmError(f"it sent over {MAX_TENSORS} tensors, more than any state holds")
                if message.metadata:
                    metadata = self.serializer.loads(message.metadata)
                    announced = metadata.get("bytes") if isinstance(metadata, dict) else None
                    if isinstance(announced, int) and 0 < announced <= self._state_limit:  # for display only
                        self.download[1] = float(announced)
                self.download[0] = float(received)
                if message.tensor_part.compression != runtime_pb2.CompressionType.NONE:
                    # Donors send their state as it is (state_compression): hivemind decodes a
                    # compressed part whole before it checks its size, 8 bytes for every byte sent
                    # (8-bit codes as int64), which the byte limit above did not bound.
                    raise SwarmError("it sent its state compressed, which no donor does")
                if message.tensor_part.dtype and parts:  # the first part of the next tensor
                    tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    parts = []
                parts.append(message.tensor_part)
            if parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        except Exception as error:  # noqa: BLE001 - a donor gone or misbehaving: try the next
            logger.warning("state download from %s failed: %s", peer, one_line(error))
            return None, isinstance(error, (asyncio.TimeoutError, TimeoutError))  # one class since 3.11
        return ((metadata, tensors) if metadata else None), False

    async def rpc_theta_sketch(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> averaging_pb2.DownloadData:
        """Sketches of this peer's θ under a joiner's seed, for checking a state it downloaded:
        of the snapshot it offered that joiner if the request names the offer's token, else of
        its θ now."""
        message = unpack(request.metadata) if len(request.metadata) <= 256 else {}
        seed, token = message.get("seed"), message.get("token")
        if not isinstance(seed, bytes) or len(seed) != SEED_BYTES or not self.allow_state_sharing:
            return averaging_pb2.DownloadData(metadata=pack({"ok": False}))
        if not await self._a_member(context.remote_id):
            return averaging_pb2.DownloadData(metadata=pack({"ok": False}))
        if self._sketch_lock is None:
            self._sketch_lock = asyncio.Lock()
        offered = self._server.offered(token) if isinstance(token, bytes) and self._server else None
        snapshot = offered or self._fresh_snapshot()
        loop = asyncio.get_running_loop()
        async with self._sketch_lock:  # each answer costs a copy of θ: one at a time
            if snapshot is None and self._witness_there is not None:  # θ alone, sketched where it lives
                await asyncio.sleep(max(0.0, self._sketch_after - time.monotonic()))
                try:
                    step, sketches = await self._sketches_from_peer(seed)
                finally:
                    self._sketch_after = time.monotonic() + 0.1
            else:
                if snapshot is not None:  # offered to a joiner (who now asks it to witness)
                    metadata, tensors = snapshot.metadata, snapshot.tensors
                else:
                    await asyncio.sleep(max(0.0, self._sketch_after - time.monotonic()))
                    metadata, tensors, _ = await self._get_current_state_from_host_process()
                    self._sketch_after = time.monotonic() + 0.1
                metadata = self.serializer.loads(metadata)
                params = tensors[: int(metadata["num_params"])]
                step = int(metadata["outer_step"])
                sketches = await loop.run_in_executor(None, state_sketches, params, seed)
        answer = {"ok": True, "outer_step": step, "sketches": [s.to_bytes() for s in sketches]}
        return averaging_pb2.DownloadData(metadata=pack(answer))

    async def _sketches_from_peer(self, seed: bytes) -> tuple[int, list[Sketch]]:
        """In the averager process (under ``_sketch_lock``): the peer's outer step and its θ's
        sketches under ``seed`` (:meth:`_answer_witnesses`).

        One seed at a time is in the peer's process, and its answer is awaited in the event loop,
        holding no thread. A caller that gives up (hivemind cancels the handler when the asker's
        stream closes) leaves its seed there; the next request waits for that answer first, up to
        its deadline, and sends its own seed only then. Awaited in the loop's thread pool, as it
        once was, each abandoned request held a pool thread for up to ``WITNESS_SECONDS`` and
        had its seed sent and θ copied all the same: a few askers that give up (any node can
        ask) took every thread that hivemind's all-reduce and the ring's checks run in."""
        loop = asyncio.get_running_loop()
        if self._witness_asked is None:
            loop.add_reader(self._witness_there.fileno(), self._witness_answered)
        else:
            _, earlier, deadline = self._witness_asked
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(earlier), max(0.0, deadline - time.monotonic()))
        answer = loop.create_future()
        try:
            self._witness_there.send(seed)
        except (OSError, EOFError) as error:  # the peer's process is gone: no answer will come
            raise RuntimeError(f"the peer's process cannot be asked ({error})") from None
        self._witness_asked = (seed, answer, time.monotonic() + WITNESS_SECONDS)
        try:
            ok, value = await asyncio.wait_for(asyncio.shield(answer), WITNESS_SECONDS)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"the peer's process did not sketch its θ within {WITNESS_SECONDS:.0f} s"
            ) from None
        if not ok:
            raise RuntimeError(value)
        step, raw = value
        return step, [Sketch.from_bytes(b) for b in raw]

    def _witness_answered(self) -> None:
        """The event loop's reader of the peer's answers: the one for the seed in flight is
        taken; an answer to a request that timed out is dropped."""
        asked = self._witness_asked
        try:
            while self._witness_there.poll():
                answered, ok, value = self._witness_there.recv()
                if asked is not None and answered == asked[0] and not asked[1].done():
                    asked[1].set_result((ok, value))
        except (EOFError, OSError):  # the peer's process is gone
            asyncio.get_running_loop().remove_reader(self._witness_there.fileno())
            if asked is not None and not asked[1].done():
                asked[1].set_result((False, "the peer's process closed its pipe"))

    def _answer_witnesses(self) -> None:
        """In the peer's process (a thread): sketch θ for each seed the averager process sends.
        A witness needs θ alone; fetched as the whole state (what hivemind's hook gives), the
        AdamW moments and the momentum were copied too and sent through shared memory: 4x θ's
        bytes for every witness of every join."""
        for seed in messages(self._witness_here):
            try:
                state = self._served(self._theta_provider())
                answer = (
                    True,
                    (int(state.outer_step), [s.to_bytes() for s in state_sketches(state.params, seed)]),
                )
            except Exception as error:  # noqa: BLE001 - this witness does not answer
                answer = (False, one_line(error))
            try:
                self._witness_here.send((seed, *answer))
            except (EOFError, OSError):
                return

    async def _sketches_from(
        self, peers: list[str], seed: bytes, timeout: float, token: bytes | None = None
    ) -> dict[str, tuple[int, list[Sketch]] | None]:
        """Each peer's (outer step, θ sketches) under ``seed``, or None for it. ``token``: of
        the offer the (one) peer made this joiner: it sketches the θ it offered."""

        async def ask(peer: str) -> tuple[str, tuple[int, list[Sketch]] | None]:
            try:
                stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
                asked = {"seed": seed} if token is None else {"seed": seed, "token": token}
                request = averaging_pb2.DownloadData(metadata=pack(asked))
                answer = await stub.rpc_theta_sketch(request, timeout=timeout)
                message = unpack(answer.metadata) if len(answer.metadata) <= MAX_SKETCH_ANSWER else {}
                step, raw = message.get("outer_step"), message.get("sketches")
                if message.get("ok") is not True or not whole(step) or not isinstance(raw, list):
                    return peer, None
                return peer, (step, [Sketch.from_bytes(b) for b in raw])
            except Exception as error:  # noqa: BLE001 - no answer, a malformed one: not a witness
                logger.debug("no θ sketch from %s: %s", peer, one_line(error))
                return peer, None

        return dict(await asyncio.gather(*map(ask, peers)))

    async def _sketches_each(
        self, seeds: dict[str, bytes], timeout: float
    ) -> dict[str, tuple[int, list[Sketch]] | None]:
        """:meth:`_sketches_from` with a seed of its own for each peer (``seeds``)."""
        answers = await asyncio.gather(
            *(self._sketches_from([p], seed, timeout) for p, seed in seeds.items())
        )
        return {peer: got for answer in answers for peer, got in answer.items()}

    def _served(self, state: OuterState) -> OuterState:
        """``state`` as this peer serves it (the lab's faults: θ with made-up noise, labelled
        some outer steps older than it is)."""
        noise = fault_value(self._fault_file, "serve_noise")
        back = int(fault_value(self._fault_file, "serve_steps_back"))
        if noise:
            logger.warning("fault injection: serving θ with %g relative noise", noise)  # its own is untouched
            state = dataclasses.replace(
                state,
                params=[p + noise * p.norm() / p.numel() ** 0.5 * torch.randn_like(p) for p in state.params],
            )
        if back:
            logger.warning("fault injection: serving the state as %d outer step(s) older", back)
            state = dataclasses.replace(state, outer_step=max(0, state.outer_step - back))
        return state

    def get_current_state(self):
        state = self._served(self._state_provider())
        metadata = dict(
            outer_step=state.outer_step,
            num_params=len(state.params),
            num_pending=len(state.pending),
            inner_keys=state.inner_keys,
        )
        tensors = [
            *state.params,
            *state.momentum,
            *(t for update in state.pending for t in update),
            *state.inner,
        ]
        metadata["bytes"] = sum(t.numel() * t.element_size() for t in tensors)  # a joiner's progress
        return metadata, tensors, None


async def _cut_if_stalled(task: asyncio.Task | None, sent: list[int], peer: str) -> None:
    """Cancel ``task`` (a state stream being served) when ``sent[0]`` (its bytes) is still 0
    after STREAM_GRACE, or then grows by less than MIN_RATE bytes a second over STREAM_WINDOW:
    a reader that stops reading held the stream, and its copy of the state, for as long as it
    stayed connected."""
    if task is None:
        return
    await asyncio.sleep(STREAM_GRACE)
    last = 0
    while sent[0] > last:
        last = sent[0]
        await asyncio.sleep(STREAM_WINDOW)
        if sent[0] - last < MIN_RATE * STREAM_WINDOW:
            break
    logger.warning("cut the state stream to %s: it moved under %d KiB/s", peer[-8:], MIN_RATE >> 10)
    task.cancel()
