"""hivemind's DecentralizedAverager, as a peer of this swarm runs it (in its own process):
rounds over the direct data plane (:mod:`swarm.dataplane`, a gloo ring set up through
hivemind's authenticated group, run in the peer's process: :mod:`swarm.ring_driver`) with
hivemind's own all-reduce as the fallback, and the global state served to joiners, with
sketches of θ for the witnesses who check a download (:mod:`swarm.sketch`).
:class:`swarm.averaging.SwarmAverager` drives it, one round at a time.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import multiprocessing as mp
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, AsyncIterator  # noqa: UP035 - hivemind finds streamed RPCs by typing's name

from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import achain, as_aiter, azip, enter_asynchronously

from optim.diloco import OuterState
from swarm import gathered
from swarm.butterfly import CountedWeights, MeanReplies, Stalls
from swarm.consensus import CHECKED_CODECS, FAILED, Post, TensorSketcher, disagreement, scaled
from swarm.dataplane import DIRECT_CODECS, DirectPlane, bindable, one_line, or_error
from swarm.faults import fault_value
from swarm.hivemind_fixes import (  # importing it patches StepControl
    ExpectedMembers,
    install_task_keeper,
    parse_ids,
    refuse_strangers,
    watch_leaders,
)
from swarm.rendezvous import MAX_VALUE_BYTES, BoardClient, RendezvousBoards, pack, unpack
from swarm.ring_driver import Outcome, RingDriver, Ticket, messages, serve_board
from swarm.signed_groups import SignedGroupKeys
from swarm.state_sharing import VERIFIERS, StateSharing

logger = logging.getLogger(__name__)

__all__ = ["VERIFIERS", "GroupAverager", "fault_value"]

EXPECTED_BYTES = 1 << 16  # the expected members' ids (~47 bytes each): about 1,300 peers


def _put_ids(array: Any, ids: Sequence[str]) -> None:
    """Peer ids (base58) into a shared array, comma-separated, for the other process; none when
    they do not fit (:data:`EXPECTED_BYTES`: about 1,300 peers; an expected set or a filter
    then falls back to hivemind's own behaviour)."""
    wanted = ",".join(ids).encode()
    with array.get_lock():
        array.value = wanted if len(wanted) < EXPECTED_BYTES else b""


def _take_ids(array: Any) -> list[str]:
    """The peer ids (base58) in a shared array, which is cleared: each is told once."""
    with array.get_lock():
        raw, array.value = array.value, b""
    return _ids_in(raw)


def _add_ids(array: Any, ids: set[str]) -> None:
    """``ids`` added to those a shared array holds, not yet taken (:func:`_take_ids`)."""
    if ids:
        with array.get_lock():  # (a lock the reader takes too, and re-entrant)
            _put_ids(array, sorted(set(_ids_in(array.value)) | ids))


def _ids_in(raw: bytes) -> list[str]:
    return [text for text in raw.decode(errors="replace").split(",") if text]


TICKETS_KEPT = 16  # groups sent to the peer's ring and not yet ended (a cancelled step's linger)


class GroupAverager(StateSharing, DecentralizedAverager):
    """DecentralizedAverager whose downloadable state is DiLoCo's global state."""

    def __init__(
        self,
        *args: Any,
        state_provider: Callable[[], OuterState] | None,
        theta_provider: Callable[[], OuterState] | None = None,
        fault_file: str | None = None,
        data_plane: str = "hivemind",
        aggregate: str = "mean",
        plane_host: str = "127.0.0.1",
        plane_advertise: str | None = None,
        codec: str = "none",
        masks: int = 0,
        ready_snapshots: bool = True,
        donor_subkey: bytes | None = None,
        state_numel: int | None = None,
        members_key: str | None = None,
        **kwargs: Any,
    ) -> None:
        self._state_provider = state_provider
        self._codec = codec
        self._masks = masks  # the last tensors averaged are kept-masks (--topk-mean kept)
        self._aggregate = aggregate
        self._driver: RingDriver | None = None  # the peer process's ring (swarm.ring_driver)
        self._boards = RendezvousBoards()  # the rendezvous of the groups this peer leads
        # Cleared by the ring when no ring can be set up; read by both processes.
        self._plane_enabled = mp.Value("b", 0)
        self.direct_rounds = mp.Value("q", 0)  # rounds the direct plane carried, for reports
        # Between the averager process and the peer's ring: groups found (there -> here), how
        # their rounds went (here -> there), a new ring's board requests (both ways).
        self._tickets_in, self._tickets_out = mp.Pipe(duplex=False)
        self._outcomes_in, self._outcomes_out = mp.Pipe(duplex=False)
        self._board_here, self._board_there = mp.Pipe()
        # Groups sent to the peer's ring: how its round went, the group's board, the step's result.
        self._posted: OrderedDict[bytes, tuple[asyncio.Future, BoardClient, dict]] = OrderedDict()
        self._ticket_loop: asyncio.AbstractEventLoop | None = None
        self._expected = mp.Array("c", EXPECTED_BYTES)  # the next step's round mates (ids)
        self._allowed = mp.Array("c", EXPECTED_BYTES)  # the peers the next step may group with (ids)
        self._silent = mp.Array("c", EXPECTED_BYTES)  # leaders silent after accepting, this step (ids)
        self._silent_ids: set[str] = set()  # (the averager process's)
        self._no_shows = mp.Array("c", EXPECTED_BYTES)  # members that never came to a ring (ids)
        self._decliners = mp.Array("c", EXPECTED_BYTES)  # members that declined one (ids)
        self._stalled = mp.Array("c", EXPECTED_BYTES)  # members that sent nothing on hivemind's path (ids)
        self._leaders: OrderedDict[bytes, Any] = OrderedDict()  # group id -> who led it (this process's)
        self._formed: Any = None  # the group hivemind formed in the current look for one
        self.assembled = mp.Value("d", 0.0)  # when a group last formed (time.time())
        self.generation = mp.Value("q", 0)  # bumped (under the buffers' lock) as the peer fills them
        bind = plane_host if plane_host != "0.0.0.0" else plane_advertise
        bindable_ = bool(bind) and bindable(bind)
        # A donor may send at most this much: 8 copies of the parameters and 64 MiB of slack
        # (θ, momentum, a queued update and AdamW's two moments are 5). ``state_numel``: the
        # model's parameters, where the state served is more than this group's tensors (streaming's
        # fragment 0 serves the whole model's: with 4 fragments, every download of a model past
        # 8.4 M parameters was refused as too large).
        params = args[0][: len(args[0]) - masks]  # a state holds no masks
        numel = state_numel if state_numel is not None else sum(t.numel() for t in params)
        self._init_state_sharing(
            fault_file=fault_file,
            direct=data_plane == "direct",
            state_host=bind if data_plane == "direct" and bindable_ else None,
            limit=8 * 4 * numel + (64 << 20),
            ready=ready_snapshots,
            theta_provider=theta_provider,
            subkey=donor_subkey,
            members=members_key,
        )
        direct = data_plane == "direct" and aggregate == "mean" and codec in DIRECT_CODECS
        if direct and not kwargs.get("client_mode"):
            if bindable_:
                self._driver = RingDriver(
                    DirectPlane(bind),
                    tickets=self._tickets_in,
                    outcomes=self._outcomes_out,
                    board=self._board_here,
                    tensors=self.get_tensors,
                    count=sum(t.numel() for t in args[0]),
                    masks=masks,
                    enabled=self._plane_enabled,
                    rounds=self.direct_rounds,
                )
                self._plane_enabled.value = 1
            elif plane_host == "0.0.0.0":
                logger.info(
                    "direct data plane off: %s; rounds use hivemind's all-reduce",
                    f"the announced address {bind} is not on this machine (behind NAT?)"
                    if bind
                    else "--host 0.0.0.0 without --announce names no address to bind",
                )
            else:  # an IPv6 --host (the direct plane binds IPv4 addresses), said rather than silent
                logger.info(
                    "direct data plane off: it binds IPv4 addresses, and --host is %s; rounds use "
                    "hivemind's all-reduce",
                    plane_host,
                )
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        # hivemind's averager process (forked): the aggregation rule of its all-reduce lives here.
        # What it inherited from the peer's process is never collected here: that may hold the
        # gloo rings of earlier averagers (a benchmark, a notebook), whose threads were not
        # forked; destroying one here aborts this process (std::system_error from its thread
        # join, seen in benchmarks.allreduce's second averager).
        gc.freeze()
        install_task_keeper()  # a pending task destroyed by the collector froze matchmaking
        if self._aggregate == "trimmed-mean":
            from swarm.trimmed import install

            install()
        self._inherited, self._driver = self._driver, None  # the ring runs in the peer's process
        for end in (
            self._tickets_in,
            self._outcomes_out,
            self._board_here,
            self._witness_here,
        ):  # the peer's ends
            if end is not None:
                end.close()
        if self._plane_enabled.value:
            threading.Thread(
                target=serve_board,
                args=(self._board_there, self._posted_board, self._meeting_failed),
                daemon=True,
            ).start()
        super().run()

    def start(self) -> None:
        super().start()  # the averager process, with its own copies of the pipes' ends
        # Its ends close here: once it exits, the ring's thread reads the end of its pipe.
        for end in (self._tickets_out, self._outcomes_in, self._board_there, self._witness_there):
            if end is not None:
                end.close()
        if self._witness_here is not None:
            threading.Thread(target=self._answer_witnesses, name="witness-sketches", daemon=True).start()

    def _posted_board(self, group_id: bytes) -> BoardClient | None:
        posted = self._posted.get(group_id)
        return posted[1] if posted is not None else None

    def _read_outcomes(self) -> None:
        """The peer's ring telling how each group's round went (a thread of this process)."""
        for outcome in messages(self._outcomes_in):
            self._ticket_loop.call_soon_threadsafe(self._settle, outcome)

    def _settle(self, outcome: Outcome) -> None:
        posted = self._posted.get(outcome.group_id)
        if posted is not None and not posted[0].done():
            posted[0].set_result(outcome)

    async def _shutdown(self, timeout: float | None) -> None:
        """hivemind's shutdown of the averager process, without its crash: hivemind calls
        ``finalize(cancel=True)`` on each value of ``_running_groups`` and gathers what that
        returns, but the values are futures (of the all-reduce runner, or of nothing on the
        direct plane) and ``finalize`` returns nothing. A peer stopped while a group was
        registered (three peers stopped together mid-round) printed an AttributeError traceback
        from the averager's thread. Here each running all-reduce is cancelled for its peers, and
        a group still waiting for its runner is cancelled."""
        if not self.client_mode:
            try:
                await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
            except Exception as error:  # noqa: BLE001 - Ctrl+C to the whole terminal's group
                # ended the p2p daemon first (its socket is gone: FileNotFoundError): a
                # traceback from the averager's thread in 2 of 5 Ctrl+C mid-round (a user's audit)
                logger.debug("could not remove the averager's handlers: %s", one_line(error))
        for future in list(self._running_groups.values()):
            if not future.done():
                future.cancel()
            elif not future.cancelled() and future.exception() is None and future.result() is not None:
                future.result().finalize(cancel=True)
        # hivemind never closes this process's replica of the DHT's p2p client, whose unix socket
        # file then stays in the temp folder: one per averager a peer, test or benchmark ever ran.
        p2p = getattr(self, "_p2p", None)
        if p2p is not None:
            try:
                await p2p.shutdown()
            except Exception as error:  # noqa: BLE001 - the process ends right after this
                logger.debug("could not close the averager's p2p client: %s", one_line(error))

    async def _step(self, **kwargs: Any):
        if self._donor_subkey is not None and not isinstance(
            self._matchmaking.group_key_manager, SignedGroupKeys
        ):
            # A run's peer: declared under its signed key, which no one else can withdraw.
            SignedGroupKeys.install(self._matchmaking.group_key_manager, self._donor_subkey)
        # A leader forms the group as soon as the expected members joined, rather than at the end
        # of the matchmaking window (hivemind's target group size, which it reads per join).
        self._matchmaking.target_group_size = ExpectedMembers.parse(self._matchmaking, self._expected.value)
        # Only the run's peers this one read heartbeats from lead or join its group (none
        # given: anybody, as in hivemind).
        allowed = parse_ids(self._allowed.value)
        allowed = None if allowed is None else allowed | {self._matchmaking.peer_id}
        refuse_strangers(self._matchmaking)
        self._matchmaking.allowed = allowed
        self._silent_ids.clear()
        _put_ids(self._silent, ())
        _put_ids(self._no_shows, ())  # (any left unread: an earlier step's)
        _put_ids(self._decliners, ())
        _put_ids(self._stalled, ())
        watch_leaders(self._matchmaking, self._note_silent, self._note_leader)
        keys = self._matchmaking.group_key_manager
        if isinstance(keys, SignedGroupKeys):
            keys.allowed = allowed
        if self._ticket_loop is None and self._plane_enabled.value:
            # Once: every group found is offered to the peer's ring before hivemind waits for
            # the step's trigger (swarm.ring_driver), and the ring's outcomes are read.
            self._ticket_loop = asyncio.get_running_loop()
            threading.Thread(target=self._read_outcomes, daemon=True).start()
            look_for_group = self._matchmaking.look_for_group

            async def look_and_offer(step):
                self._formed = None
                try:
                    group_info = await look_for_group(step)
                except asyncio.CancelledError:
                    # Given up on as its group formed (hivemind still sending the followers
                    # away): offered all the same, the ring declines it where the others wait
                    # for it. Not offered, a leader never opened its board, and its followers
                    # waited 10 s and blamed it (a review, 2026-12-06).
                    formed = self._formed
                    if formed is not None and formed.group_id not in self._posted:
                        try:
                            self._offer(formed, step)
                        except Exception as error:  # noqa: BLE001 - the step ends anyway
                            logger.debug(
                                "could not decline a group formed as its step ended: %s", one_line(error)
                            )
                    raise
                if group_info is not None:
                    self.assembled.value = time.time()
                    self._offer(group_info, step)
                return group_info

            self._matchmaking.look_for_group = look_and_offer
        try:
            return await super()._step(**kwargs)
        except OSError as error:
            # A leader killed while this peer's join request read its answer (BrokenPipeError):
            # not among the errors hivemind retries, so it set the step's exception (the peer's
            # round fails as for any other) and raised it again into a task nobody awaits, and
            # asyncio printed "Task exception was never retrieved" with a traceback (churn soak).
            logger.debug("averaging step failed: %s", one_line(error))

    def _note_silent(self, leader: Any, allowed: Any) -> None:
        """A leader accepted this peer and did not begin its group (in the averager process):
        the peer's process reads it (:meth:`silent_leaders`). ``allowed``: the set of the step
        that asked it; a note that comes after that step is over is dropped (it would be blamed
        on the next round, or taken from the next step's peers)."""
        if allowed is not self._matchmaking.allowed:
            return
        self._silent_ids.add(leader.to_base58())
        _put_ids(self._silent, sorted(self._silent_ids))
        if allowed is not None:  # (the key manager's too: one set)
            # Not followed again this step: its declaration, renewed every 0.1 s, was a new
            # leader each time to hivemind, and the follower went back to it until its deadline.
            allowed.discard(leader)

    def _note_leader(self, group_info: Any, leader: Any) -> None:
        """Who led a group this peer is in, as it knows for itself (in the averager process):
        the group's board is that leader's (:meth:`_group_board`)."""
        self._formed = group_info
        self._leaders[bytes(group_info.group_id)] = leader
        while len(self._leaders) > TICKETS_KEPT:
            self._leaders.popitem(last=False)

    def _meeting_failed(self, group_id: bytes, op: str, key: str) -> None:
        """A ring's members' meeting at its board (``key``: this member's post there) failed
        ("exchange"), or a member declined the round there ("declined"), in this process before
        the ring hears of it: the members that spoiled it, as this peer knows for itself, for
        the peer's process (:meth:`no_shows`). The group's leader, which holds its board and
        took every member's join request itself: the members that posted nothing there, or
        declined. A follower: its leader, if it answered that it never opened its board. Nobody
        else's word is taken: a leader that named a peer which never joined its group, on a
        board held by another, could have had that peer blamed (a review, 2026-12-06); and
        only the meeting counts, whose clocks start for every member as the board opens (gloo's
        later waits do not: a member that gave up at the meeting and posted there was blamed
        for the address it then never posted, a review of this defence). A fresh key with a
        heartbeat joined each group and never came to its ring, or declined it: every attempt
        of the round failed into the next until the averaging deadline."""
        posted = self._posted.get(group_id)
        if posted is None or posted[1].holder is None:
            return
        board, prefix = posted[1], key.rpartition("/")[0] + "/"
        if not board.held_here:
            never_opened = op == "exchange" and board.refused and not board.opened
            absent = [board.holder] if never_opened else []
        else:
            absent = [PeerID(m) for m in self._boards.missing(group_id, prefix, declined=op == "declined")]
        ids = {peer.to_base58() for peer in absent if peer != self.peer_id}
        array = self._decliners if op == "declined" else self._no_shows
        _add_ids(array, ids)

    def no_shows(self) -> list[str]:
        """The members of this peer's failed rings that never came to them, as it saw for itself
        (base58; :meth:`_meeting_failed`), or came to the meeting and then never posted their
        ring address (:meth:`swarm.ring_driver.RingDriver.spoilers`), each told once."""
        absent = self._driver.spoilers("absent") if self._driver is not None else []
        return sorted({*_take_ids(self._no_shows), *absent})

    def unreachable(self) -> list[str]:
        """The members of new rings of groups this peer led whose address refused its own dial
        (or its leader's, for a follower; base58: :meth:`swarm.ring_driver.RingDriver.spoilers`),
        each told once."""
        return self._driver.spoilers("unreachable") if self._driver is not None else []

    def stalled(self) -> list[str]:
        """The members of this peer's groups on hivemind's path that sent it nothing within the
        senders' timeout, or then stalled (base58; :meth:`_name_stalls`), each told once."""
        return _take_ids(self._stalled)

    def decliners(self) -> list[str]:
        """The members of this peer's groups that declined their rings at its board (base58;
        :meth:`_meeting_failed`), each told once."""
        return _take_ids(self._decliners)

    def silent_leaders(self) -> list[str]:
        """The leaders that accepted this peer in its last step and did not begin their group
        (base58), each told once: read, they are cleared (an attempt that sent no step, or the
        next round's, re-read them and struck the same peer again, a review)."""
        return _take_ids(self._silent)

    def step(
        self, gather: Any = None, expected: Sequence[str] = (), allowed: Sequence[str] = (), **kwargs: Any
    ):
        """hivemind's step; this member's data-plane address travels with its gathered info.
        ``expected``: the other members of this round's group (base58 ids; none: the window).
        ``allowed``: the only peers whose group this one joins and who may join its group
        (base58 ids; none: anybody; a run's peers only: the leaders it finds are its signed
        declarations', :class:`~swarm.signed_groups.SignedGroupKeys`).
        With the direct plane, the control returned also follows the ring that this process
        runs (:class:`swarm.ring_driver.DirectStep`)."""
        _put_ids(self._expected, expected)
        _put_ids(self._allowed, allowed)
        weight = kwargs.get("weight")
        weight = 1.0 if weight is None else float(weight)  # hivemind's default for a full peer
        if self._driver is not None:
            self._driver.retry()
        direct = self._driver is not None and bool(self._plane_enabled.value)
        kept = b"".join(self._driver.plane.ring_ids()) if direct else b""
        mine = gathered.own(direct, weight, kept, gather)
        if not direct:
            return super().step(gather=mine, **kwargs)
        wait, triggered = kwargs.pop("wait", True), not kwargs.pop("require_trigger", False)
        proxy = self._driver.expect(mine[gathered.NONCE])
        proxy.attach(super().step(gather=mine, wait=False, require_trigger=True, **kwargs))
        if triggered:
            proxy.allow_allreduce()
        return proxy.result() if wait else proxy

    def _offer(self, group_info, step) -> None:
        """Send a group whose members all take direct rings to the peer's ring (in this process,
        once the group is found, before hivemind waits for the step's trigger)."""
        members = self._gathered(group_info)
        if not (members and self._plane_enabled.value and all(map(gathered.takes_direct_rings, members))):
            return
        board, peer_ids, seed = self._group_board(group_info, members)
        own = members[list(group_info.peer_ids).index(self.peer_id)]
        weights = gathered.counted_weights(group_info.peer_ids, members)
        masks = self._averaged_tensors[len(self._averaged_tensors) - self._masks :] if self._masks else []
        ticket = Ticket(
            nonce=own[gathered.NONCE],
            group_id=group_info.group_id,
            members=tuple(p.to_base58() for p in peer_ids),
            rank=peer_ids.index(self.peer_id),
            seed=seed,
            weight=weights[self.peer_id],
            total=sum(weights.values()),
            reusable=gathered.held_by_all(members),
            codec=self._codec,
            # Below hivemind's own deadline for this step, so that a member gone mid-ring ends
            # in our error, not in hivemind cancelling the step.
            timeout=0.75 * (self._allreduce_timeout or 60.0),
            # A follower gives up on its leader request_timeout s after the group's scheduled
            # time; the leader may already have begun: twice that, and the round fails fast.
            arrival=max(5.0, 2 * float(self.request_timeout or 3.0)),
            mask_scale=gathered.mask_scale(members, self._codec, limit=sum(m.numel() for m in masks))
            if masks
            else 1.0,
            gathered={peer: gathered.reported(m) for peer, m in zip(group_info.peer_ids, members)},
            holder=board.holder.to_base58() if board.holder is not None else "",
        )
        self._posted[group_info.group_id] = (
            asyncio.get_running_loop().create_future(),
            board,
            ticket.gathered,
        )
        while len(self._posted) > TICKETS_KEPT:
            self._posted.popitem(last=False)
        self._tickets_out.send(ticket)

    def _gathered(self, group_info) -> list[Any] | None:
        """Each member's gathered info (``gathered.own``), or None when any member's bytes are
        malformed: the group is then left to hivemind's own path, which refuses them as a
        failed matchmaking (a member's b"\xc1" raised here, past every handler, and failed the
        step of every member without a retry)."""
        members = []
        for data in group_info.gathered:
            try:
                outer = self.serializer.loads(data)
                members.append(self.serializer.loads(outer[2]))
                outer[1]  # noqa: B018 - the mode, read by _group_board
            except Exception as error:  # noqa: BLE001 - anything a member can send
                logger.debug("a member's gathered info is malformed (%s): not a direct ring", one_line(error))
                return None
        return members

    def _group_board(self, group_info, members: list[Any]) -> tuple[BoardClient, list[PeerID], bytes]:
        """The group's board, its members in rank order (by peer id, not hivemind's random
        order: the same members next round find their ring connected), and its secret seed (the
        group id and every member's gathered nonce). The board is held by the group's leader in
        hivemind's matchmaking, as each member knows for itself (the peer whose group it joined,
        or itself): the only member that knows who really joined (it took their join requests),
        so the only one whose view of who never came is blamed on anyone (:meth:`_meeting_failed`).
        Whatever the members say of themselves: a key that let the group meet elsewhere (at the
        first member's in hivemind's order that accepts connections, as earlier releases do:
        saying it was one) would never be blamed (a review, 2026-12-06). A group whose leader
        this process did not see form it (never, in this release) meets there, blaming nobody.
        So peers of earlier releases meet at other boards and never average with this one's
        (:data:`swarm.records.PROTOCOL`)."""
        peer_ids = sorted(group_info.peer_ids, key=lambda p: p.to_bytes())
        leader = self._leaders.get(group_info.group_id)
        holder = leader if leader in group_info.peer_ids else None  # (a leader that left itself out)
        if holder is None:
            modes = [self.serializer.loads(g)[1] for g in group_info.gathered]
            hosts = [p for p, mode in zip(group_info.peer_ids, modes) if mode != AveragingMode.CLIENT.value]
            leader = hosts[0] if hosts else group_info.peer_ids[0]
            logger.debug("a group formed without its leader seen: its board is %s's", leader)
        if leader == self.peer_id:
            self._boards.open(group_info.group_id, [p.to_bytes() for p in peer_ids])
        board = BoardClient(
            group_info.group_id,
            self._board_caller(leader, asyncio.get_running_loop()),
            pause=0.002 if leader == self.peer_id else 0.0,  # a missed wake-up costs 2 ms
            wait=self._boards.wait_change if leader == self.peer_id else None,
        )
        board.holder = holder
        return board, peer_ids, group_info.group_id + gathered.nonces(members)

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs: Any):
        # In hivemind's averager process, once the group is formed (and triggered).
        posted = self._posted.get(group_info.group_id)
        if posted is not None:  # the peer's ring runs this round: wait for how it went
            try:
                outcome: Outcome = await posted[0]
            finally:
                self._posted.pop(group_info.group_id, None)
            if not outcome.ok:
                raise AllreduceException(f"direct data plane: {outcome.why}")
            running = self._running_groups.get(group_info.group_id)
            if running is not None and not running.done():
                running.set_result(None)  # no hivemind runner for this group: nothing to wait for
            return posted[2]
        self.assembled.value = time.time()
        members = self._gathered(group_info)
        if members is None:  # a failed matchmaking, which hivemind retries (not a step failed for good)
            raise MatchmakingException("a member of the group sent malformed gathered info")
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
        """The group's all-reduce on hivemind's path, checked (:mod:`swarm.consensus`); the
        members' gathered data."""
        if self._codec in CHECKED_CODECS:
            results = await self._checked_butterfly(group_info, members, min_vector_size, **kwargs)
        else:  # int8: unchecked (swarm.consensus says why)
            results = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        return {peer: gathered.reported(data) for peer, data in results.items()}

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs: Any) -> None:
        """hivemind's all-reduce into ``tensors``; if every member takes the mean, with replies
        that leave every member on the same bits (:mod:`swarm.butterfly`)."""
        members = [self.serializer.loads(self.serializer.loads(g)[2]) for g in group_info.gathered]
        if group_id is not None:
            await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)
            return
        # Every member weighs the others' parts by what the group counts, not by what their
        # messages claim, and its own by the same rule (optim.robust.counted_weights).
        weights = gathered.counted_weights(group_info.peer_ids, members)
        kwargs["weight"] = weights[self.peer_id]
        if not gathered.all_take_the_mean(members):
            await self._run_differences(tensors, group_info, weights, **kwargs)
            return
        runner = self._runner(
            MeanReplies,
            tensors,
            group_info,
            codec=kwargs["compression"].compression_type,
            weights=weights,
            **kwargs,
        )

        async def copy_means() -> None:
            async for tensor, mean in azip(as_aiter(*tensors), runner):
                tensor.copy_(mean)
                self.last_updated = get_dht_time()
                self._state_updated.set()

        # A member that dropped out fails the round (``doomed``), once every member has had the
        # senders' timeout of this runner's start to begin (10 s by default), unless the runner
        # ends before. Cut short at the first drop, this member's streams to the others ended
        # before they began, and a group's leader saw an honest member that another had failed
        # send it nothing (a test of :meth:`_name_stalls`: a key that refused one member's
        # stream had the leader name that member). Not the runner's whole course: a reducer
        # that stalls holds it up to the reducers' timeout, twice as long.
        copying, doomed = asyncio.create_task(copy_means()), asyncio.create_task(runner.doomed.wait())
        failed = None
        try:
            await asyncio.wait({copying, doomed}, return_when=asyncio.FIRST_COMPLETED)
            timeout = runner.sender_timeout or 0.0
            left = runner.started_at + timeout - time.monotonic()
            if not copying.done() and left > 0:
                await asyncio.wait({copying}, timeout=left)
            # And for a part asked before then, up to the timeout more: a key that sent one
            # part and then went silent was seen idle only after the round had failed (a review).
            limit = runner.started_at + 2 * timeout
            while (
                not copying.done()
                and runner.reading_since_before(runner.started_at + timeout)
                and time.monotonic() < limit
            ):
                await asyncio.wait({copying}, timeout=0.1)
        finally:
            for task in (copying, doomed):
                task.cancel()
            await asyncio.gather(copying, doomed, return_exceptions=True)
        if copying.done() and not copying.cancelled():
            failed = copying.exception()
        self._name_stalls(group_info, runner)
        if runner.doomed.is_set():  # no member can hold the group's mean: the round fails
            gone = ", ".join(str(p)[-8:] for p in runner.dropped)
            raise AllreduceException(f"members dropped out of hivemind's all-reduce ({gone})")
        if failed is not None:
            raise failed

    def _runner(self, kind: type, tensors, group_info, **kwargs: Any) -> Any:
        """An all-reduce runner of ``kind`` for this group, registered for its members' calls."""
        runner = kind(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_info.group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        self._running_groups[group_info.group_id].set_result(runner)
        return runner

    async def _run_differences(self, tensors, group_info, weights: dict[Any, float], **kwargs: Any) -> None:
        """hivemind's own exchange (each member adds the differences its reducers reply), as
        hivemind runs it, with the senders' weights the group counts (:class:`CountedWeights`)."""
        runner = self._runner(CountedWeights, tensors, group_info, weights=weights, **kwargs)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")
            return
        failed = None
        try:
            async for tensor, update in azip(as_aiter(*tensors), runner):
                tensor.add_(update, alpha=self._averaging_alpha)
                self.last_updated = get_dht_time()
                self._state_updated.set()
        except Exception as error:  # (told after who stalled it)
            failed = error
        self._name_stalls(group_info, runner)
        if failed is not None:
            raise failed

    def _name_stalls(self, group_info, runner: Stalls) -> None:
        """The members that stalled this peer's part of a group's all-reduce on hivemind's path
        (:class:`swarm.butterfly.Stalls`), for the peer's process (:meth:`stalled`), by the
        ring's rule: the group's leader names any, a follower only its leader. A leader forwards
        the group's membership to each follower: one that told a follower another group would
        have the others see that follower send nothing."""
        leader = self._leaders.get(bytes(group_info.group_id))
        if leader is None:
            return
        mine = set(runner.sender_peer_ids) if leader == self.peer_id else {leader}
        named = runner.stalled() & mine
        _add_ids(self._stalled, {peer.to_base58() for peer in named if peer != self.peer_id})

    async def _checked_butterfly(self, group_info, members: list[Any], min_vector_size: int, **kwargs: Any):
        """hivemind's all-reduce, then the check that every member got the group's mean (a
        trimmed mean: the same result; :mod:`swarm.consensus`); a member that did not fails the
        round for all."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + 0.75 * (self._allreduce_timeout or 60.0)
        board, peer_ids, seed = self._group_board(group_info, members)
        rank = peer_ids.index(self.peer_id)
        weights = gathered.counted_weights(group_info.peer_ids, members)  # kwargs["weight"]: the claim
        share = weights[self.peer_id] / (sum(weights.values()) or 1.0)
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
        why = disagreement(posts, self._codec, count=sketcher.count, linear=self._aggregate == "mean")
        if why is not None:
            raise AllreduceException(f"hivemind's all-reduce gave the members different results: {why}")
        return results

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

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's handler of a member's parts, which waits for this member's runner without
        cancelling it when the caller goes away. hivemind awaits the group's future itself, so a
        member that gave up on the round (its stream closed, this handler cancelled) cancelled
        the future too, and this member then failed at once with "Unable to run All-Reduce:
        invalid state" instead of saying who dropped out. A direct-plane group has no runner."""
        request = await anext(stream)
        if request.group_id not in self._running_groups:  # the leader's answer may come late
            await self._pending_groups_registered.wait()
        future = self._running_groups.get(request.group_id)
        runner = None if future is None else await asyncio.shield(future)
        if runner is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        async for message in runner.rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

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
