"""Fixes to hivemind's step control, to its futures' process-shared locks (:class:`_BoundedLock`)
and to the pace of its matchmaking's leader search (:func:`_paced_leader_search`), applied once
on import (by :mod:`swarm.group_averager`), :func:`keep_tasks_alive` for the
averager process's event loop, and :class:`ExpectedMembers`, a group target made of peer ids."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

from hivemind.averaging.control import StepControl
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.p2p import P2P, PeerID
from hivemind.utils.mpfuture import MPFuture, SharedBytes

logger = logging.getLogger(__name__)


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

LEADER_SEARCH_PERIOD = 0.1
"""Seconds at least between two of an averager's searches for a group's leaders (a DHT lookup
each, with ``latest=True``: a round trip to the nodes that hold the key, not a local read)."""


def _paced_leader_search(original: Callable[..., Any]) -> Callable[..., Any]:
    """hivemind's matchmaking searches the DHT for leaders again as soon as a search finds none
    it can join (``PotentialLeaders.pop_next_leader`` asks for an update, the update answers at
    once): a member left alone in matchmaking searched as fast as the DHT answered, for the
    step's whole timeout. Seen when a round mate was killed after the barrier counted it in: for
    the 30 s until the step gave up, the survivor's averager and DHT processes used about 0.4 of
    a core each, and each search was a network lookup (at scale, every member of every group
    whose mate died, at tens of lookups a second). Paced, a search waits for the one before it
    plus :data:`LEADER_SEARCH_PERIOD`; a leader that declares meanwhile is found that much later
    at most."""

    async def get_averagers(self: Any, group_key: Any, only_active: bool) -> Any:
        wait = getattr(self, "_next_leader_search", 0.0) - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        try:
            return await original(self, group_key, only_active)
        finally:
            self._next_leader_search = time.monotonic() + LEADER_SEARCH_PERIOD

    get_averagers.paced = True  # type: ignore[attr-defined]
    return get_averagers


if not getattr(GroupKeyManager.get_averagers, "paced", False):
    GroupKeyManager.get_averagers = _paced_leader_search(GroupKeyManager.get_averagers)


def _no_port_map_in_identity_check(original: Callable[..., Any]) -> Callable[..., Any]:
    """hivemind checks that a kept key is nobody else's with a second, temporary p2p daemon
    made with its defaults, which ask the router to forward a public port (UPnP / NAT-PMP);
    every DHT node of ours asks none (:func:`swarm.dht.start_dht`), nor does this one now."""

    async def is_identity_taken(cls: type, *args: Any, **kwargs: Any) -> bool:
        class NoPortMap(cls):  # what the check creates its daemon with
            @classmethod
            async def create(inner: type, *a: Any, **k: Any) -> Any:
                return await cls.create(*a, **{**k, "nat_port_map": False})

        return await original(NoPortMap, *args, **kwargs)

    return classmethod(is_identity_taken)


if not getattr(P2P.is_identity_taken, "_no_port_map", False):
    P2P.is_identity_taken = _no_port_map_in_identity_check(P2P.is_identity_taken.__func__)
    P2P.is_identity_taken.__func__._no_port_map = True


LOCK_WAIT = 2.0
"""Seconds a stopping process waits for one of hivemind's process-shared locks before taking
it as lost (a live process holds them for a pipe write of a small message, or to share 16
bytes). A running one waits as long as hivemind does, saying so every ``LOCK_WAIT`` s."""
LOST_LOCK_WAIT = 0.1
"""The wait for a lock once taken as lost: used if it comes back, not waited for again."""

_stopping = False


def stopping(now: bool = True) -> None:
    """This process is stopping: from now on hivemind's process-shared locks are waited for at
    most ``LOCK_WAIT`` s (:class:`_BoundedLock`). ``now=False``: it runs again (a notebook's
    next session, after one closed)."""
    global _stopping
    _stopping = now


class _BoundedLock:
    """One of hivemind's locks that every process of a peer shares from the fork (the peer, its
    DHT and averager processes): ``MPFuture._update_lock`` (held to write a future's update),
    ``MPFuture._initialization_lock`` and ``SharedBytes._lock`` (held to make a future's shared
    state). A process that ends while it holds one leaves it held for good: SIGHUP or SIGTERM
    to a peer's process group ends its DHT and averager processes at once, one may be writing
    an update then, and the peer, cancelling its averaging step as it stopped, waited for the
    update lock for ever (``make faults``, once: still running 30 s after the SIGHUP).

    Once the process is stopping (:func:`stopping`), a wait lasts at most ``LOCK_WAIT`` s; past
    it the lock is taken as lost and the process goes on without it (an update to a process
    that ended fails at once, and hivemind drops it), waiting only ``LOST_LOCK_WAIT`` from
    then on. Not before: two processes writing to one pipe at once interleave their messages
    and hivemind's reader never recovers, and a live holder always releases (a process frozen
    by SIGSTOP, or a laptop asleep, times out as it wakes, whoever holds the lock)."""

    def __init__(self, lock: Any, name: str) -> None:
        self._lock, self.name = lock, name
        self._mine = threading.local()
        self.lost = False

    def __enter__(self) -> _BoundedLock:
        waited = 0.0
        if not _stopping:  # running again (a notebook's next session): waited for as any lock
            self.lost = False  # (it stayed lost: ten warnings a second, a review, stop 72)
        while True:
            wait = LOST_LOCK_WAIT if self.lost else LOCK_WAIT
            got = self._lock.acquire(timeout=wait)
            if got or _stopping:
                break
            waited += wait
            logger.warning("waited %.0f s for hivemind's %s, held by another process", waited, self.name)
        if not got and not self.lost:
            self.lost = True
            logger.warning(
                "hivemind's %s stayed held for %.0f s while this process stops (a process of this "
                "peer ended holding it); going on without it",
                self.name,
                LOCK_WAIT,
            )
        self._held().append(got)
        return self

    def __exit__(self, *exc: object) -> None:
        held = self._held()
        if held and held.pop():
            self._lock.release()

    def _held(self) -> list[bool]:
        """This thread's acquires, innermost last (a ``with`` nested in another on one thread)."""
        if not hasattr(self._mine, "held"):
            self._mine.held = []
        return self._mine.held

    # What swarm.dht.release_interrupted_locks reads and calls on the lock it wraps.
    @property
    def _semlock(self) -> Any:
        return self._lock._semlock

    def release(self) -> None:
        self._lock.release()


def _bound(owner: type, attribute: str) -> None:
    lock = getattr(owner, attribute)
    if not isinstance(lock, _BoundedLock):
        setattr(owner, attribute, _BoundedLock(lock, f"{owner.__name__}.{attribute}"))


_bound(MPFuture, "_update_lock")
_bound(MPFuture, "_initialization_lock")
_bound(SharedBytes, "_lock")


def keep_tasks_alive(loop: asyncio.AbstractEventLoop) -> set[asyncio.Task]:
    """Make ``loop`` hold every task it runs until the task is done; the set it holds them in.

    asyncio (and uvloop) keep only weak references to tasks. A task that waits on an ``MPFuture``
    (which another process, the DHT's, will answer; ``MPFuture._active_futures``, which routes
    the answer to it, holds it only weakly) is then reachable from nothing but a reference
    cycle, and the garbage collector destroys it mid-flight ("Task was destroyed but it is
    pending!"). In hivemind's matchmaking
    that happens to the clean-up of a cancelled step: ``PotentialLeaders._declare_averager_
    periodically`` awaits the DHT's "no longer looking" store in a ``finally`` inside ``async with``
    blocks of ``begin_search`` and ``looking_for_group``. A coroutine closed there never runs
    their exits, so those locks stay held and the averager never looks for a group again: the
    peer is left out of every round for the rest of the run (a late joiner that once gave up on
    a round, seen in ``test_late_joiner_downloads_state_and_matches``)."""
    tasks: set[asyncio.Task] = set()

    def factory(loop: asyncio.AbstractEventLoop, coro: Coroutine, **kwargs: Any) -> asyncio.Task:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    loop.set_task_factory(factory)
    return tasks


def _keeping_tasks_alive(
    original: Callable[[], asyncio.AbstractEventLoop],
) -> Callable[[], asyncio.AbstractEventLoop]:
    """hivemind's ``switch_to_uvloop`` (which makes each of its processes' event loops), with
    :func:`keep_tasks_alive` on the loop it makes."""

    def switch_to_uvloop() -> asyncio.AbstractEventLoop:
        loop = original()
        keep_tasks_alive(loop)
        return loop

    return switch_to_uvloop


def install_task_keeper(module: str = "hivemind.averaging.averager") -> None:
    """In one of hivemind's processes (its averager's by default, or ``"hivemind.dht.dht"``),
    before its event loop exists: that loop will hold its tasks (:func:`keep_tasks_alive`).
    Patches the process's own copy of ``module`` only (call it in the child process)."""
    import importlib

    target = importlib.import_module(module)
    if not getattr(target.switch_to_uvloop, "keeps_tasks", False):
        target.switch_to_uvloop = _keeping_tasks_alive(target.switch_to_uvloop)
        target.switch_to_uvloop.keeps_tasks = True  # type: ignore[attr-defined]


class ExpectedMembers:
    """A target group size that counts identities. hivemind's leader checks
    ``len(current_followers) + 1 >= target_group_size`` on every join (and refuses joiners once
    it holds): with this as the target, that holds once every expected peer has joined, so an
    unexpected joiner (a stranger in a public run, a peer this one's view missed) can neither
    complete the group early nor take an expected mate's place."""

    def __init__(self, matchmaking: Any, expected: set[PeerID]) -> None:
        self._matchmaking = matchmaking
        self._expected = expected

    def __le__(self, count: object) -> bool:  # ``count >= target``, reflected
        joined = set(self._matchmaking.current_followers) | {self._matchmaking.peer_id}
        return self._expected <= joined

    @classmethod
    def parse(cls, matchmaking: Any, raw: bytes) -> ExpectedMembers | None:
        """From the comma-separated base58 ids the peer's process wrote; None (the window
        decides) for none or anything that does not parse."""
        ids = parse_ids(raw)
        return cls(matchmaking, ids | {matchmaking.peer_id}) if ids else None


def parse_ids(raw: bytes) -> set[PeerID] | None:
    """Comma-separated base58 peer ids (what a peer's process writes for its averager's); None
    for none, or for anything that does not parse."""
    try:
        ids = {PeerID.from_base58(text) for text in raw.decode().split(",") if text}
    except Exception:  # noqa: BLE001 - not ids: nothing
        return None
    return ids or None


SILENT_GRACE = 1.0
"""Seconds past a join request's expiration that an accepting leader may yet begin or disband
its group (an honest one does by its own declared expiration, which a request's may not precede:
hivemind refuses such a request) before it counts as silent (:func:`watch_leaders`)."""


def watch_leaders(
    matchmaking: Any,
    silent: Callable[[PeerID, Any], None],
    led: Callable[[Any, PeerID], None] = lambda group_info, leader: None,
) -> None:
    """Call ``led(group info, leader)`` for each group this peer is in, as it knows for itself who
    leads it (the leader it joined, which sent it the group; or itself), and ``silent(leader,
    allowed)`` for each leader that accepted this peer into its group
    and then did not begin it by this peer's request's expiration (plus :data:`SILENT_GRACE`):
    it said nothing until hivemind gave up on it, or "disbanded" only then. ``allowed``: the
    step's set of peers it may group with (``matchmaking.allowed`` when the request was made: a
    note that comes after the step is over names that step's). A fresh key that declared itself a
    leader just ahead of everyone and did that held its followers for their whole matchmaking
    window, every attempt (a red-team review, 2026-12-06); an honest leader begins or disbands
    its group by its own declared expiration, which a request's may not precede (hivemind refuses
    such a request). A leader's redirect to a peer outside ``allowed`` is dropped (the peer
    treats it as "disbanded"): hivemind follows a redirect without asking who it names. Wraps
    the stubs ``matchmaking`` (hivemind's, in the averager process) asks leaders with; once."""
    if getattr(matchmaking, "watching_leaders", False):
        return
    from hivemind.proto import averaging_pb2

    matchmaking.watching_leaders = True
    servicer = matchmaking._servicer_type

    class Answers:  # one join request's answers, as the follower reads them
        def __init__(self, stream: Any, leader: PeerID, expiration: float, allowed: Any) -> None:
            self.stream, self.leader, self.expiration, self.allowed = stream, leader, expiration, allowed
            self.codes: list[int] = []

        def __aiter__(self) -> Answers:
            return self

        def late(self) -> bool:
            from hivemind.utils import get_dht_time

            return self.codes == [averaging_pb2.ACCEPTED] and get_dht_time() > self.expiration + SILENT_GRACE

        async def __anext__(self) -> Any:
            try:
                message = await self.stream.__anext__()
            except asyncio.CancelledError:  # hivemind's wait for the next answer ended
                if self.late():
                    silent(self.leader, self.allowed)
                raise
            if message.code != averaging_pb2.BEGIN_ALLREDUCE and self.late():
                silent(self.leader, self.allowed)  # "disbanded" just before hivemind gave up
            if message.suggested_leader and self.allowed is not None:
                try:
                    suggested = PeerID(message.suggested_leader)
                except Exception:  # noqa: BLE001 - not an id: no redirect
                    suggested = None
                if suggested not in self.allowed:
                    message.ClearField("suggested_leader")
            self.codes.append(message.code)
            return message

        async def aclose(self) -> None:
            await self.stream.aclose()

    class Stub:
        def __init__(self, stub: Any, leader: PeerID) -> None:
            self.stub, self.leader = stub, leader

        async def rpc_join_group(self, request: Any) -> Answers:
            allowed = getattr(matchmaking, "allowed", None)
            return Answers(await self.stub.rpc_join_group(request), self.leader, request.expiration, allowed)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.stub, name)

    class Servicer:
        @staticmethod
        def get_stub(p2p: Any, peer: PeerID, *, namespace: str | None = None) -> Stub:
            return Stub(servicer.get_stub(p2p, peer, namespace=namespace), peer)

    matchmaking._servicer_type = Servicer
    lead, follow = matchmaking.leader_assemble_group, matchmaking.follower_assemble_group

    async def leading() -> Any:
        group_info = await lead()
        led(group_info, matchmaking.peer_id)  # (before its members hear of it)
        return group_info

    async def following(leader: PeerID, message: Any) -> Any:
        group_info = await follow(leader, message)
        led(group_info, leader)
        return group_info

    matchmaking.leader_assemble_group = leading
    matchmaking.follower_assemble_group = following


NOT_A_ROUND_MATE = "not a round mate"


def refuse_strangers(matchmaking: Any) -> None:
    """Make ``matchmaking`` (hivemind's, in the averager process) refuse a join request from any
    peer outside its ``allowed`` set (an attribute set here, None: anybody), as a leader that is
    not looking for a group does. hivemind's leader accepted every well-formed request: a fresh
    key that polled the matchmaking key joined each honest peer's group and then never came to
    its ring, and 4 of 5 rounds ended alone (a red-team review, 2026-12-06)."""
    if getattr(matchmaking, "allowed", ...) is not ...:
        return
    from hivemind.proto import averaging_pb2

    check = matchmaking._check_reasons_to_reject
    matchmaking.allowed = None

    def refusing(request: Any, context: Any) -> Any:
        allowed = matchmaking.allowed
        if allowed is not None and context.remote_id not in allowed:
            logger.debug("refused a join request from %s: %s", context.remote_id, NOT_A_ROUND_MATE)
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
        return check(request, context)

    matchmaking._check_reasons_to_reject = refusing
