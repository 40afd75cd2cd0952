"""The direct plane's ring, run in the peer's own process.

hivemind's averager lives in a process of its own: a step's trigger goes to it through a pipe,
and its result comes back through another, about a millisecond each way on this machine; with a
1 MB all-reduce taking 1-2 ms in gloo, those two crossings alone halved its speed. So the ring
runs where the peer's tensors are:

1. the averager process finds the group (hivemind's matchmaking) and, before it waits for the
   step's trigger, sends this process a :class:`Ticket`: the members in rank order, the sketch
   seed, the weights, the rings every member keeps, and the gathered data;
2. :class:`RingDriver`'s thread takes the ticket, waits for the trigger (set here, in
   :meth:`DirectStep.allow_allreduce`, with no pipe in between), runs the ring on the
   averager's shared buffers and settles the step: the caller's ``result()`` returns at once;
3. it then tells the averager process how the round went (:class:`Outcome`), so that hivemind's
   own step ends the same way (its result is not waited for here);
4. a new ring's rendezvous still uses the group's board, which the averager process holds or
   reaches over hivemind's channel: the ring's requests go to it through a third pipe
   (:class:`ForwardedBoard`, served by :func:`serve_board`). A kept ring needs none.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from swarm.dataplane import DirectPlane, RingUnreachable, one_line
from swarm.rendezvous import DECLINED, RendezvousError

logger = logging.getLogger(__name__)

STEPS_KEPT = 16  # steps waiting for a ticket (a step that never gets one is dropped later)


@dataclass(frozen=True)
class Ticket:
    """A group the averager process found, for this process's ring to average with."""

    nonce: bytes  # this member's gathered nonce: which of this process's steps it is for
    group_id: bytes
    members: tuple[str, ...]  # base58 ids in rank order
    rank: int
    seed: bytes
    weight: float  # this member's weight as the group counts it (optim.robust.counted_weights)
    total: float  # the group's counted weights
    reusable: frozenset[bytes]
    codec: str
    timeout: float
    arrival: float
    mask_scale: float
    gathered: dict[Any, Any]  # peer id -> its gathered user data: the step's result
    holder: str = ""  # who holds its board, as this member knows for itself (base58; "" unknown)


@dataclass(frozen=True)
class Outcome:
    """How a ticket's round went, for the averager process's side of the step."""

    group_id: bytes
    ok: bool
    why: str = ""


class AllreduceFailed(RuntimeError):
    """The direct plane's round failed (hivemind's AllreduceException is raised in its process)."""


class DirectStep:
    """hivemind's StepControl, as the caller of a step on a direct-capable averager holds it:
    attributes pass through, except the trigger, cancel, ``done`` and ``result``, which also
    follow this process's ring when the averager process sent it a ticket for this step."""

    def __init__(self) -> None:
        self._control: Any = None
        self._changed = threading.Condition()
        self._triggered = self._cancelled = self._running = self._forwarded = False
        self._ticket: Ticket | None = None
        self._outcome: tuple[Any, BaseException | None] | None = None

    def attach(self, control: Any) -> None:
        with self._changed:
            self._control = control
            self._changed.notify_all()
        control.add_done_callback(lambda _: self._notify())

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._control, name)

    def allow_allreduce(self) -> None:
        with self._changed:
            self._triggered = True
            self._changed.notify_all()
            if self._ticket is not None:
                return  # told to the averager process once the ring is done: see _forward
        self._forward()

    def _forward(self) -> None:
        """The trigger, to the averager process (hivemind's side of the step). With a ticket in
        hand it goes after the ring: sent at once, it would wake that process (and its p2p
        daemon) while the ring runs, on the same cores."""
        with self._changed:
            if self._forwarded:
                return
            self._forwarded = True
        if not self._control.triggered:
            self._control.allow_allreduce()

    def cancel(self) -> bool:
        with self._changed:
            self._cancelled = True
            self._changed.notify_all()
        return self._control.cancel()

    @property
    def triggered(self) -> bool:
        return self._triggered or self._control.triggered

    @property
    def began_allreduce(self) -> bool:
        return self._running or self._control.began_allreduce

    def done(self) -> bool:
        with self._changed:
            return self._outcome is not None if self._ticket is not None else self._control.done()

    def wait(self, timeout: float) -> bool:
        """Block until the step is done or ``timeout`` s passed; whether it is done (the
        caller's poll wakes as soon as the ring settles, not at its next tick)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not self.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    def result(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while True:
                if self._ticket is not None and self._outcome is not None:
                    value, error = self._outcome
                    if error is not None:
                        raise error
                    return value
                if self._ticket is None and self._control.done():
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"the averaging step did not finish within {timeout} s")
                self._changed.wait(left if left is not None else 1.0)
        return self._control.result(0)

    # --- the driver's side ------------------------------------------------------------------

    def claim(self, ticket: Ticket, wait: float) -> bool:
        """Take ``ticket``; True once the step is triggered (False: cancelled, ended, or not
        triggered within ``wait`` s: the round is then not run)."""
        deadline = time.monotonic() + wait
        with self._changed:
            self._ticket = ticket
            while not self._cancelled:
                if self._control is not None and (self._triggered or self._control.triggered):
                    self._running = True
                    return True
                if self._control is not None and self._control.done():
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(min(left, 1.0))
            self._outcome = (None, AllreduceFailed("the step ended before its trigger"))
            self._changed.notify_all()
            return False

    def gave_up(self) -> bool:
        """Cancelled by its caller, or ended on hivemind's side (not merely never triggered)."""
        with self._changed:
            return self._cancelled or (self._control is not None and self._control.done())

    def end_retries(self) -> None:
        """After a failed ring, end hivemind's side of a step that allows retries: hivemind would
        look for another group for it and average the buffers the failed ring left garbage,
        under a ticket this process no longer waits for (the others then wait out the arrival
        timeout). The step ends with the ring's error, as a step without retries does."""
        control = self._control
        if control is not None and getattr(control, "allow_retries", False) and not control.done():
            control.cancel()  # seen by the averager process before the ring's outcome is sent

    def settle(self, value: Any, error: BaseException | None) -> None:
        with self._changed:
            self._outcome = (value, error)
            self._running = False
            self._changed.notify_all()
        if self._triggered:
            self._forward()


class ForwardedBoard:
    """A group's board (:class:`swarm.rendezvous.Rendezvous`) reached through the averager
    process, which holds it or talks to its holder over hivemind's channel.

    Each request carries a number and its answer the same: a request this side gave up on is
    still answered later, and that late answer must not be read as the next request's (it was,
    for good: every ring after a board request that took too long got the answer before its
    own, stale keys or addresses, and failed, until the plane turned itself off)."""

    def __init__(self, connection: Connection, lock: threading.Lock, group_id: bytes) -> None:
        self._connection, self._lock, self._group_id = connection, lock, group_id

    def _call(self, op: str, wait: float, *args: Any) -> Any:
        limit = wait + BOARD_SLACK
        with self._lock:
            number = next(_REQUESTS)
            self._connection.send((number, self._group_id, op, args))
            deadline = time.monotonic() + limit
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not self._connection.poll(left):
                    raise RendezvousError(
                        f"the averager process did not answer a board {op} in {limit:.0f} s"
                    )
                answered, ok, value = self._connection.recv()
                if answered == number:
                    break  # an older number: the answer to a request given up on, dropped
        if not ok:
            raise RendezvousError(value)
        return value

    def set(self, key: str, value: bytes) -> None:
        self._call("set", 0.0, key, bytes(value))

    def get(self, key: str, timeout: float) -> bytes:
        return self._call("get", timeout, key, timeout)

    def exchange(
        self, key: str, value: bytes, want: list[str], timeout: float, abort: threading.Event | None = None
    ) -> list[bytes]:
        # ``abort`` stays here: the request ends by itself within ``timeout``.
        return self._call("exchange", timeout, key, bytes(value), list(want), timeout)


_REQUESTS = itertools.count(1)
BOARD_SLACK = 10.0
"""Seconds a board request may take beyond its own wait (a set to a board its holder has not
opened yet is retried for 10 s, then refused: given up on here, and answered late)."""


def messages(connection: Connection) -> Iterator[Any]:
    """What comes through ``connection`` until its other end is closed."""
    while True:
        try:
            yield connection.recv()
        except (EOFError, OSError):
            return


def serve_board(
    connection: Connection,
    boards: Callable[[bytes], Any],
    failed: Callable[[bytes, str, str], None] = lambda group_id, op, key: None,
) -> None:
    """In the averager process: answer the ring's board requests until the pipe closes
    (``boards``: a group's board by its id, or None). Each in its own thread, so that one
    request held up by a slow board's holder does not hold up the next rounds' behind it.
    ``failed(group id, op, key)``: told when the members' meeting at a board ("exchange",
    ``key`` this member's post) failed or a member declined there ("declined"), before the
    ring hears of it."""
    sending = threading.Lock()

    def answer(number: int, group_id: bytes, op: str, args: tuple) -> None:
        board, told = boards(group_id), ""
        try:
            if board is None or op not in ("set", "get", "exchange"):
                raise RendezvousError("no such group's board here (the round already ended?)")
            reply = (number, True, getattr(board, op)(*args))
            if op == "exchange" and DECLINED in reply[2]:
                told = "declined"
        except Exception as error:  # noqa: BLE001 - the ring's error, told to the ring
            reply = (number, False, one_line(error))
            told = "exchange" if op == "exchange" else ""
        if told and args and isinstance(args[0], str):
            try:
                failed(group_id, told, args[0])
            except Exception as note:  # noqa: BLE001 - only a note: the ring's error goes on
                logger.debug("could not note who missed the ring: %s", one_line(note))
        with sending, contextlib.suppress(EOFError, OSError):
            connection.send(reply)

    for number, group_id, op, args in messages(connection):
        threading.Thread(target=answer, args=(number, group_id, op, args), daemon=True).start()


PLANE_RETRY = 300.0
"""Seconds on hivemind's path after the direct plane could not set up three rings in a row,
before it tries again (twice as long each time)."""
PLANE_RETRY_MAX = 3600.0


class RingDriver:
    """In the peer's process: the direct plane and the thread that runs its rounds."""

    def __init__(
        self,
        plane: DirectPlane,
        *,
        tickets: Connection,
        outcomes: Connection,
        board: Connection,
        tensors: Callable[[], Any],
        count: int,
        masks: int,
        enabled: Any,
        rounds: Any,
    ) -> None:
        """``tensors``: the averager's ``get_tensors`` (a lock over its shared buffers), of
        ``count`` elements in all;
        ``enabled`` and ``rounds``: shared values (the plane still on; rounds it carried)."""
        self.plane = plane
        self._tickets, self._outcomes, self._board = tickets, outcomes, board
        self._board_lock = threading.Lock()
        self._tensors, self._count, self._masks = tensors, count, masks
        self._enabled, self._rounds = enabled, rounds
        self._steps: OrderedDict[bytes, DirectStep] = OrderedDict()
        self._steps_lock = threading.Lock()
        self._unreachable = 0  # consecutive rings this peer could not set up
        self._spoilers: dict[str, set[str]] = {"absent": set(), "unreachable": set()}
        self._spoilers_lock = threading.Lock()
        self._switched_off = 0  # times the plane was switched off (each retry waits twice as long)
        self._retry_at: float | None = None  # (time.monotonic()) when it is tried again
        self.clock = time.monotonic
        self._used = False
        self._thread: threading.Thread | None = None

    def _switch_off(self, error: Exception) -> None:
        """Rings on hivemind's path for a while: :data:`PLANE_RETRY` s, twice as long each time
        (at most :data:`PLANE_RETRY_MAX`). For good, as it was, one ring mate that posted no
        address three times running (its own to post) sent this peer to the 10x slower path
        for the rest of its run, and its log blamed this peer's firewall."""
        wait = min(PLANE_RETRY * 2**self._switched_off, PLANE_RETRY_MAX)
        self._switched_off += 1
        self._unreachable = 0
        self._retry_at = self.clock() + wait
        self._enabled.value = 0
        logger.warning(
            "direct data plane: no ring could be set up 3 times in a row (%s); this peer uses "
            "hivemind's all-reduce for the next %.0f min, then tries rings again (a firewall in front "
            "of its gloo ports? --data-plane hivemind avoids the try)",
            error,
            wait / 60,
        )

    def retry(self) -> None:
        """(Before each step.) Switched off a while ago: turn the plane on again."""
        if self._retry_at is not None and self.clock() >= self._retry_at:
            self._retry_at = None
            self._enabled.value = 1
            logger.info("direct data plane: trying rings again")

    def expect(self, nonce: bytes) -> DirectStep:
        """A step about to be sent to the averager process under ``nonce``."""
        step = DirectStep()
        with self._steps_lock:
            self._steps[nonce] = step
            while len(self._steps) > STEPS_KEPT:
                self._steps.popitem(last=False)
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="direct-ring", daemon=True)
            self._thread.start()
        return step

    def _serve(self) -> None:
        ticket: Ticket
        for ticket in messages(self._tickets):
            with self._steps_lock:
                step = self._steps.pop(ticket.nonce, None)
            if step is None:
                self._decline(ticket)
                outcome = Outcome(ticket.group_id, False, "no step of this peer's is waiting for this group")
            else:
                outcome = self._round(step, ticket)
            try:
                self._outcomes.send(outcome)
            except (EOFError, OSError):
                return

    def _round(self, step: DirectStep, ticket: Ticket) -> Outcome:
        try:  # while the step's inner steps still run; only a head start: the round draws it else
            self.plane.draw(ticket.seed, self._count)
        except Exception as error:  # noqa: BLE001 - out of memory, say: not this thread's end
            logger.debug("could not draw the round's sketch ahead: %s", one_line(error))
        if not step.claim(ticket, wait=ticket.timeout):
            if step.gave_up():  # at once: the others are at the ring's arrival check by now
                self._decline(ticket)
            return Outcome(ticket.group_id, False, "the step ended before its trigger")
        self.plane.mark("wake")
        try:
            with self._tensors() as tensors:
                self._ring(tensors, ticket)
        except Exception as error:  # noqa: BLE001 - a failed round, told to both sides
            step.settle(None, AllreduceFailed(f"direct data plane: {error}"))
            step.end_retries()
            return Outcome(ticket.group_id, False, str(error))
        with self._rounds.get_lock():  # before the caller wakes: its report reads this
            self._rounds.value += 1
        self.plane.mark("copy out, unlock")
        step.settle(ticket.gathered, None)
        if not self._used:
            self._used = True
            logger.info(
                "averaging over the direct data plane from now on (a gloo ring among each round's "
                "members; this first one: %d)",
                len(ticket.members),
            )
        return Outcome(ticket.group_id, True)

    def _name_spoilers(self, ticket: Ticket, error: RingUnreachable) -> None:
        """A new ring failed to set up: the members it named (never posted an address at the
        board, or posted one that refused this member's own dial:
        :meth:`swarm.dataplane.DirectPlane._connect`), for :meth:`spoilers`, before the step
        hears of the failure (its retry leaves them out). The group's leader (the board's
        holder is this member) names any member: the addresses are on its own board. A follower
        names only its leader (what the leader posted at its own board is its own): the others'
        addresses it read there, the leader could have made up. A member that does not know
        who holds the board names nobody (the rule of
        :meth:`swarm.group_averager.GroupAverager._meeting_failed`)."""
        leads = ticket.holder == ticket.members[ticket.rank]
        with self._spoilers_lock:
            for kind, ranks in (("absent", error.absent), ("unreachable", error.unreachable)):
                named = {ticket.members[r] for r in ranks if 0 <= r < len(ticket.members)}
                self._spoilers[kind].update(named if leads else named & {ticket.holder})

    def spoilers(self, kind: str) -> list[str]:
        """The members of this peer's groups named ``kind`` ("absent", "unreachable") since
        last asked (base58), each told once."""
        with self._spoilers_lock:
            named, self._spoilers[kind] = self._spoilers[kind], set()
        return sorted(named)

    def _decline(self, ticket: Ticket) -> None:
        """hivemind formed a group for a step this peer gave up on (cancelled before the
        averager process heard of it): tell the others, who would wait out the arrival timeout."""
        logger.debug("declining group %s: this peer's step for it is over", ticket.group_id.hex()[:8])
        self.plane.decline(
            board=ForwardedBoard(self._board, self._board_lock, ticket.group_id),
            seed=ticket.seed,
            members=ticket.members,
            rank=ticket.rank,
            reusable=ticket.reusable,
            arrival=ticket.arrival,
        )

    def _ring(self, tensors: Sequence[torch.Tensor], ticket: Ticket) -> None:
        masks = list(tensors[len(tensors) - self._masks :]) if self._masks else []
        # Kept-masks go round scaled like the updates beside them (gathered.mask_scale says why).
        for mask in masks:
            mask.mul_(ticket.mask_scale)
        try:
            self.plane.all_reduce(
                tensors,
                board=ForwardedBoard(self._board, self._board_lock, ticket.group_id),
                seed=ticket.seed,
                members=ticket.members,
                rank=ticket.rank,
                weight=ticket.weight,
                total=ticket.total,
                codec=ticket.codec,
                reusable=ticket.reusable,
                timeout=ticket.timeout,
                arrival=ticket.arrival,
            )
        except RingUnreachable as error:
            self._name_spoilers(ticket, error)
            self._unreachable += 1
            if self._unreachable >= 3:  # not one member that left: this peer's plane is blocked
                self._switch_off(error)
            raise RuntimeError(f"could not set up the ring: {error}") from None
        except Exception as error:  # a member left mid-ring, a tampered sum: a failed round
            raise RuntimeError(one_line(error)) from None
        finally:
            for mask in masks:  # a failure leaves garbage anyway (the caller keeps its own copy)
                mask.mul_(1.0 / ticket.mask_scale)
        self._unreachable = 0
