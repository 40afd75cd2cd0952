"""The direct data plane: a hivemind group's all-reduce over its own gloo ring.

hivemind's butterfly all-reduce moves every byte through Python protobuf messages and the p2p
daemon (with its stream multiplexing and encryption) on both ends; on this machine that caps it
near a tenth of what torch.distributed's gloo reaches between the same processes (numbers in
docs/performance.md). The direct plane keeps hivemind for discovery, matchmaking, the gather of
member info and every fallback, and moves only the tensor bytes over TCP with gloo:

1. each member that accepts inbound connections says so in its gathered data (a peer in client
   mode, behind NAT or in a private run says nothing and the group takes hivemind's path);
2. the ring's rendezvous is a board held by the group's leader and reached over
   hivemind's authenticated channel (:mod:`swarm.rendezvous`): only the group's members can
   read or write it, and no rendezvous port exists for anyone else to find;
3. every member's weight travels with the gathered info, so each sends ``x * w / Σw`` (fp16 on
   the wire with the fp16 codec) and the ring's sum is the weighted mean, identical on every
   member. The ring is kept for the next round when the group is the same;
4. the ring runs once every member has shown up (at the board for a new ring, in a gloo
   exchange with a short timeout on a kept one): a member hivemind's matchmaking counted in but
   that gave up on the group fails the round in seconds, not at gloo's timeout, and one whose
   step was cancelled after its group formed says so there (:meth:`DirectPlane.decline`). A new
   ring's pairs then connect each on its own and exchange a hello, within the same time: a
   member that never posts its ring address, or posts one that refuses connections, is named
   (:meth:`DirectPlane._connect`), and the group's leader leaves it out of the round's retries;
5. the sum is checked before it is used: every member sends every other, over their own pair
   of the ring (gloo's all-to-all: nobody relays it), a sketch of what it sent, sealed with a
   key it posted at the board when the ring was set up (an HMAC: someone in its place in the
   ring, who never saw the board, cannot seal anything, not even a sketch of zeros), and the
   result's sketch must match their sum (:mod:`swarm.sketch`). Only members know the sketch's
   seed, so a ring an outsider got into (or a member that sent something else than it claims)
   fails the round, which falls back like any failed round; the ring is never reused.

A kept ring's gloo listener stays open between rounds, and gloo keeps every connection that
sends it a sequence number no member waits for, for the ring's life: 500 strangers' connections
were 500 open files in the peer, and at the open-files limit gloo aborted the whole process. So
:class:`DirectPlane` watches the process's open files while it keeps rings, and closes them all
(their listeners and whatever strangers left there) once :data:`FLOOD` more are open than when
the last ring was kept; the next round sets up a new ring. And the soft limit on open files is
raised to the hard one (:func:`raise_open_files_limit`).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import logging
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from swarm.rendezvous import DECLINED, Rendezvous, RingStore
from swarm.sketch import CHUNK, ROWS, Sketch, Sketcher, mismatch

logger = logging.getLogger(__name__)

PLANES = ("hivemind", "direct")
PROTOCOL = 5
"""The direct plane's version, in every member's gathered info (members of different versions
take hivemind's path): 5 meets at the board of the group's matchmaking leader (earlier: the first
member's in hivemind's order that accepts connections); 4 cuts the vector into segments by the ring's size (:func:`segments`;
members cutting differently would reduce mismatched pieces); 3 lets a member decline a round
(:meth:`DirectPlane.decline`); 2 exchanges the arrival check and the sketches over the ring (1,
unnumbered, over the board)."""
MAX_RINGS = 8
"""Rings kept for reuse per plane (the same members next round skip the rendezvous)."""
RING_ID_BYTES = 16
KEY_BYTES = 32  # each member's key for sealing its sketches on a ring
POST_BYTES = 8 * (ROWS + 1) + 8 + 32  # a sketch, the round's tag, its seal
FLOOD = 128
"""Open files the process may gain while it keeps rings before it closes them: a ring of 8
members has 7 connections and a listener, and a flood of strangers' connections to a kept
ring's listener is what it guards against (see the module's docstring)."""
WATCH_SECONDS = 0.2
CONNECT_FACTOR = 5
"""gloo gives up connecting a pair after 5 times its group's timeout (measured with torch 2.13:
1 s -> 5.0 s, 2 s -> 10 s, 8 s -> 40 s): a new ring's group timeout is its arrival time / 5, and
every operation on it passes its own timeout."""
HELLO_TAG = 7  # the hello's point-to-point messages on a new ring
PARKED = 5
"""A new ring that failed keeps its listener open for this many times the arrival time
(:meth:`DirectPlane._connect`): the others read the addresses within 2x it and dial within 2x
it of their hello's start (:meth:`DirectPlane._hello`)."""
OPEN_FILES_CAP = 65536  # the soft limit is raised to the hard one, up to this


def open_files() -> int | None:
    """How many files this process has open, or None where that cannot be read cheaply."""
    for path in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(path))
        except OSError:
            continue
    return None


def raise_open_files_limit() -> None:
    """Raise the soft limit on open files to the hard one (at most :data:`OPEN_FILES_CAP`): 1024
    on most Linux systems and 256 on macOS, where a flood of connections reaches it in a second."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES_CAP if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_CAP)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


class RingUnreachable(RuntimeError):
    """The group's ring could not be set up (rendezvous or connections), as opposed to a member
    leaving once the ring was up. ``absent``: the ranks that never posted their ring address at
    the board; ``unreachable``: those whose posted address refused this member's own dial on
    the new ring (:meth:`DirectPlane._hello`); both empty when nobody can be named."""

    def __init__(self, message: str, *, absent: Sequence[int] = (), unreachable: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.absent, self.unreachable = tuple(absent), tuple(unreachable)


class MemberMissing(RuntimeError):
    """A member hivemind put in the group never came to its ring: it gave up on the group during
    matchmaking (a follower whose wait for the leader's go timed out, under load), or left."""


class MemberDeclined(MemberMissing):
    """A member of the group said it will not take part: its step was cancelled after hivemind
    had formed the group (:meth:`DirectPlane.decline`). The round fails at once, not after the
    arrival timeout, and a kept ring stays kept."""


class _Declined(Exception):
    pass


class RingTampered(RuntimeError):
    """The ring's sum does not match the members' sketches: something else than the members'
    contributions went into it."""


SEGMENT = 1 << 19
"""Elements per segment of the ring (2 MB in float32) for a pair, and per two members for larger
groups: the ring reduces one segment while the member sketches the next, and each segment's ring
pays 2 (n - 1) hops' latency (4 peers, 10 MB: 2 segments 31 ms, 4 segments 34 ms). A vector of
less than two segments goes round in one piece."""
MAX_SEGMENTS = 8


def segments(count: int, members: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` bounds cutting ``count`` elements into pieces of whole sketch chunks, for a
    ring of ``members``."""
    pieces = min(MAX_SEGMENTS, count // (SEGMENT * max(1, members // 2)))
    if pieces <= 1:
        return [(0, count)]
    size = -(-count // pieces // CHUNK) * CHUNK  # rounded up to whole chunks
    return [(lo, min(lo + size, count)) for lo in range(0, count, size)]


DIRECT_CODECS = ("none", "fp16")  # int8 needs hivemind's quantizer: it takes hivemind's path


def _options(seconds: float) -> torch.distributed.AllToAllOptions:
    """A gloo all-to-all's options with its own timeout (gloo closes the ring's connections
    when it expires: the ring is then never used again)."""
    options = torch.distributed.AllToAllOptions()
    options.timeout = datetime.timedelta(seconds=seconds)
    return options


def _usable(ring: Any, ring_id: bytes, reusable: frozenset[bytes] | None) -> bool:
    """Whether a kept ring is used this round: every member still holds it (``reusable``: the
    ids all of them say they hold; None trusts this side's cache)."""
    return ring is not None and (reusable is None or ring_id in reusable)


def _lazy_device(host: str) -> Any:
    """A gloo device bound to ``host`` whose rings connect each pair on its first use instead
    of all of them as the ring is made: a pair that cannot be connected then fails on its own,
    where the eager full mesh failed as a whole ("Connect timeout [none]") and named nobody."""
    return torch.distributed.ProcessGroupGloo.create_device(hostname=host, lazy_init=True)


def _round_tag(seed: bytes) -> torch.Tensor:
    """The round's tag (56 bits of the group's seed): what a kept ring's arrival check sends."""
    return torch.tensor([int.from_bytes(hashlib.sha256(b"round" + seed).digest()[:7], "little")])


def _seal(key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, hashlib.sha256).digest()


def _opened(posts: bytes, keys: Sequence[bytes], seed: bytes, tag: int) -> list[Sketch]:
    """The members' sketches from their posts, each checked against the key that member posted
    at the board (RingTampered if one is not its own) and this round's tag."""
    if len(keys) * POST_BYTES != len(posts) or not all(len(k) == KEY_BYTES for k in keys):
        raise RingTampered("the ring's keys do not match its members (a malformed key at the board)")
    sketches = []
    for rank, key in enumerate(keys):
        post = posts[rank * POST_BYTES : (rank + 1) * POST_BYTES]
        body, seal = post[:-32], post[-32:]
        if not hmac.compare_digest(seal, _seal(key, seed + body)):
            raise RingTampered(
                f"member {rank}'s sketch is not sealed with the key it posted at the board: "
                "someone else is in its place in the ring"
            )
        if int.from_bytes(body[-8:], "little") != tag:
            raise RingTampered(f"member {rank} is in another round on this ring")
        sketches.append(Sketch.from_bytes(body[:-8]))
    return sketches


def bindable(host: str) -> bool:
    """Whether ``host`` is an address of this machine (a listener can bind it)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
        return True
    except OSError:
        return False


def or_error(call: Callable[[], Any]) -> Any:
    """``call()``, or its error as one line (for a board request run in an executor)."""
    try:
        return call()
    except Exception as error:  # noqa: BLE001 - reported by the caller as a failed round
        return one_line(error)


def one_line(error: BaseException) -> str:
    """An error as one line: torch's C++ errors carry a backtrace after their first line."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


class DirectPlane:
    """Lives in hivemind's averager process: one gloo ring per group, bound to ``host`` only."""

    def __init__(self, host: str) -> None:
        assert host not in ("", "0.0.0.0"), f"{host=}: the ring binds one address"
        self.host = host
        # Rings by members in rank order, with the id they were made under and the keys each
        # member posted at the board for it: the same group reuses its connections next round
        # if every member still holds that ring.
        self._rings: dict[tuple[str, ...], tuple[bytes, torch.distributed.ProcessGroup, list[bytes]]] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ring-arrival")
        self._reduce = torch.distributed.AllreduceOptions()  # its timeout: the round's (all_reduce)
        self._send = lambda ring, wire: ring.allreduce([wire], self._reduce)  # tests put an impostor here
        self._seal = _seal  # and here
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._drawn: tuple[bytes, int, Sketcher] | None = None  # the next round's R (draw())
        self.timeline: list[tuple[str, float]] | None = None
        """A list to append each round's phases to as they end, ``(phase, time.perf_counter())``
        (``benchmarks.allreduce --phases``); None in a peer."""
        self._files: int | None = None  # the baseline of open files while rings are kept (_keep)
        self._rings_lock = threading.Lock()  # the flood watch closes the kept rings from its thread
        self._parked: list[tuple[float, Any]] = []  # (until when, a new ring that failed): see _connect
        self._watching = False
        self.floods = 0
        """How many times strangers' connections made this plane close its kept rings."""
        raise_open_files_limit()

    def _keep(self, key: tuple[str, ...], ring_id: bytes, ring: Any, keys: list[bytes]) -> None:
        """Keep ``ring`` for the group's next round, and watch the open files while rings are kept.
        The baseline is the fewest open files seen at a keep since the rings were last all
        closed: strangers' connections made during a round (its ring is taken out of the kept
        ones while it runs) must not become part of it."""
        with self._rings_lock:
            self._rings[key] = (ring_id, ring, keys)
            while len(self._rings) > MAX_RINGS:
                self._rings.pop(next(iter(self._rings)))
            now = open_files()
            self._files = now if self._files is None or now is None else min(self._files, now)
        if not self._watching and self._files is not None:
            self._watching = True
            threading.Thread(target=self._watch, name="ring-flood-watch", daemon=True).start()

    def _watch(self) -> None:
        """Close the kept rings when the process has :data:`FLOOD` more open files than its
        baseline (:meth:`_keep`). (A round under way holds its ring and keeps it afterwards if it
        went well: the next check closes it then.)"""
        while True:
            time.sleep(WATCH_SECONDS)
            now = open_files()
            with self._rings_lock:
                baseline = self._files
                if not self._rings or baseline is None or now is None or now - baseline <= FLOOD:
                    continue
                self.floods += 1  # counted before the rings go: whoever sees them gone sees it
                self._rings.clear()  # their process groups close their listeners and connections
                self._files = None
            logger.warning(
                "the direct plane's ring listener on %s got about %d connections that no round mate made "
                "(a port scan or a flood): its kept rings were closed, and the next round sets up a new one",
                self.host,
                now - baseline,
            )

    def mark(self, phase: str) -> None:
        if self.timeline is not None:
            self.timeline.append((phase, time.perf_counter()))

    def draw(self, seed: bytes, count: int) -> None:
        """Draw the sketch's R for a round of ``count`` elements under ``seed`` ahead of it (the
        ring's thread, while it waits for the step's trigger): 0.1-0.3 ms less in the round."""
        self._drawn = (seed, count, Sketcher(seed, count, fast=True))

    def _sketcher(self, seed: bytes, count: int) -> Sketcher:
        drawn, self._drawn = self._drawn, None
        if drawn is not None and drawn[:2] == (seed, count):
            return drawn[2]
        return Sketcher(seed, count, fast=True)

    def _scratch(self, dtype: torch.dtype, count: int, role: str = "flat") -> torch.Tensor:
        """A flat buffer of ``count`` elements kept for the next rounds."""
        buffer = self._buffers.get((role, dtype))
        if buffer is None or buffer.numel() != count:
            buffer = self._buffers[(role, dtype)] = torch.empty(count, dtype=dtype)
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
        ``arrival``: seconds every member has to show up before the ring runs
        (:class:`MemberMissing` otherwise). hivemind's matchmaking can hand the leader a group
        whose follower has already given up on it; the others would then wait in gloo for the
        ring's whole ``timeout``. On a kept ring the check is a gloo exchange with that timeout
        (no board round trip: a member that misses the round costs the group its ring, set up
        again next round); a new ring's members meet at the board first.
        On any error the tensors hold garbage: the caller keeps its own copy."""
        self.mark("start")
        if not total > 0:
            raise RuntimeError(f"the group's weights sum to {total}")
        count = sum(t.numel() for t in tensors)
        abort = threading.Event()
        arrival = min(arrival, timeout)
        self._reduce.timeout = datetime.timedelta(seconds=timeout)
        key = tuple(members)
        ring_id, ring, keys = self._rings.pop(key, (b"", None, []))  # kept below if the sum checks out
        if not _usable(ring, ring_id, reusable):
            ring = None  # another member no longer holds it: all set up a new one
        tag = _round_tag(seed)
        mine = secrets.token_bytes(KEY_BYTES)  # a new ring's key for this member's sketches
        if ring is None:  # everyone here (with their keys)? answered while this member scales
            present: Future | torch.distributed.Work = self._pool.submit(
                board.exchange,
                f"here/{rank}",
                mine,
                [f"here/{r}" for r in range(len(members)) if r != rank],
                arrival,
                abort,
            )
        else:  # each member's round tag, straight from each other member (no relay)
            tags = torch.empty(len(members), dtype=torch.int64)
            present = ring.alltoall_base(tags, tag.repeat(len(members)), [], [], _options(arrival))
        single = len(tensors) == 1 and tensors[0].dtype == torch.float32 and tensors[0].is_contiguous()
        # One buffer on the wire; a lone float32 tensor is reduced in place, without copies. The
        # buffers are kept from round to round: a fresh 100 MB tensor costs more in page faults
        # than the pass that fills it.
        if single:
            flat = tensors[0].view(-1)
        else:
            pieces = [t.detach().reshape(-1).float() for t in tensors]
            flat = torch.cat(pieces, out=self._scratch(torch.float32, count))
        scale = weight / total
        bounds = segments(count, len(members))
        # What goes round: fp16 on the wire with that codec; a copy when the vector goes in one
        # piece (this member sketches its update while the ring reduces the copy); else the
        # vector itself, each segment sketched while the ring reduces the one before.
        if codec == "fp16":
            wire = self._scratch(torch.float16, count)
        elif len(bounds) == 1:
            wire = self._scratch(torch.float32, count, "wire")
        else:
            wire = flat
        sketcher = self._sketcher(seed, count)  # R, for both sketches
        rows = torch.zeros(len(bounds), ROWS, dtype=torch.float64)  # own, per segment
        squares = [0.0] * len(bounds)

        def prepare(index: int) -> None:
            lo, hi = bounds[index]
            flat[lo:hi].mul_(scale)
            if wire is not flat:
                wire[lo:hi].copy_(flat[lo:hi])

        def sketch_own(index: int) -> None:
            lo, hi = bounds[index]
            rows[index] = sketcher.rows(flat[lo:hi], lo)
            squares[index] = float(torch.dot(flat[lo:hi], flat[lo:hi]))  # |x|^2: 0.8x vector_norm's time

        works: list[torch.distributed.Work] = []
        exchange: torch.distributed.Work | None = None
        try:
            prepare(0)  # while the others come
            if wire is flat:
                sketch_own(0)
            self.mark("scale")
            try:
                if isinstance(present, Future):
                    keys = present.result()
                    if DECLINED in keys:
                        raise _Declined
                    keys.insert(rank, mine)
                else:
                    present.wait()
                    if bool((tags == -tag).any()):
                        self._keep(key, ring_id, ring, keys)  # nothing timed out: still whole
                        raise _Declined
                    if not bool((tags == tag).all()):
                        raise RuntimeError("a member is in another round on this ring")
            except _Declined:
                raise MemberDeclined(
                    "a member of the group declined this round (it gave up on its step after the "
                    "group formed)"
                ) from None
            except Exception as error:
                raise MemberMissing(
                    f"not every member of the group came to its ring within {arrival:.0f} s "
                    f"({one_line(error)}); one gave up on the group during matchmaking or left"
                ) from None
            self.mark("arrival")
            if ring is None:
                ring_id = hashlib.sha256(b"ring" + seed).digest()[:RING_ID_BYTES]
                ring = self._connect(board, rank, len(members), arrival, tag)
            for index, (lo, hi) in enumerate(bounds):
                if index:
                    prepare(index)
                    if wire is flat:
                        sketch_own(index)
                works.append(self._send(ring, wire[lo:hi]))
                if wire is not flat:
                    sketch_own(index)
            self.mark("connect, send, own sketch")
            # Each member's sketch of what it sent, straight from that member (gloo's all-to-all
            # uses the pair between the two; nobody relays another's sketch). R is known only to
            # the members (the group's seed), so nobody else can change a contribution and its
            # sketch to match.
            own = Sketch(tuple(rows.sum(0).tolist()), math.sqrt(sum(squares))).to_bytes()
            own += int(tag).to_bytes(8, "little")
            own += self._seal(keys[rank], seed + own)
            sent = torch.frombuffer(bytearray(own * len(members)), dtype=torch.uint8)
            posts = torch.empty(len(members) * POST_BYTES, dtype=torch.uint8)
            exchange = ring.alltoall_base(posts, sent, [], [], _options(timeout))
            self.mark("seal")
            result = torch.zeros(ROWS, dtype=torch.float64)
            for work, (lo, hi) in zip(works, bounds):
                work.wait()
                if wire is not flat:
                    flat[lo:hi].copy_(wire[lo:hi])
                result += sketcher.rows(flat[lo:hi], lo)
            self.mark("ring, result sketch")
            exchange.wait()
            self.mark("sketch exchange")
            parts = _opened(bytes(posts.numpy()), keys, seed, int(tag))
            result = Sketch(tuple(result.tolist()), 0.0)
        finally:
            abort.set()  # a failed round leaves no request polling on for the next one to queue behind
            for work in works:  # nothing writes ``flat`` (maybe the caller's tensor) once this returns
                with contextlib.suppress(Exception):  # the first failure is already raised
                    work.wait()
            if isinstance(present, Future):
                wait([present])
        why = mismatch(result, parts, codec, count=sketcher.count)
        if why is None and not all(map(math.isfinite, result.rows)) and bool(torch.isfinite(flat).all()):
            # mismatch() lets a non-finite sum through for the outer step's NaN check; a finite
            # sum whose sketch overflows float32 (values near 3e38) is not one it would catch.
            why = "the sum holds values beyond float32's range: its check overflows"
        if why is not None:
            raise RingTampered(why)
        self.mark("check")
        self._keep(key, ring_id, ring, keys)
        if single:
            return
        offset = 0
        for tensor in tensors:
            count = tensor.numel()
            tensor.copy_(flat[offset : offset + count].view_as(tensor))
            offset += count

    def decline(
        self,
        *,
        board: Rendezvous,
        seed: bytes,
        members: Sequence[str],
        rank: int,
        reusable: frozenset[bytes] | None = None,
        arrival: float = 5.0,
    ) -> None:
        """Tell the group's other members that this one will not take part in this round (its
        step was cancelled after hivemind formed the group), where they wait for it: in a kept
        ring's arrival exchange (the round's tag negated; the ring stays kept on every side) or
        at a new ring's board (:data:`DECLINED` instead of a key). They fail the round at once
        (:class:`MemberDeclined`) instead of after ``arrival`` s. Never raises."""
        key = tuple(members)
        ring_id, ring, keys = self._rings.get(key, (b"", None, []))
        try:
            if _usable(ring, ring_id, reusable):
                tags = torch.empty(len(members), dtype=torch.int64)
                sent = (-_round_tag(seed)).repeat(len(members))
                ring.alltoall_base(tags, sent, [], [], _options(arrival)).wait()
            else:
                board.set(f"here/{rank}", DECLINED)
        except Exception as error:  # noqa: BLE001 - the others fail at their arrival timeout
            self._rings.pop(key, None)  # a gloo timeout closed the ring
            logger.debug("could not decline the round: %s", one_line(error))

    def ring_ids(self) -> list[bytes]:
        """The ids of the rings kept for reuse (sent with this member's gathered info); safe to
        call from another thread than the ring's."""
        return [ring_id for ring_id, _, _ in self._rings.copy().values()]  # copy(): atomic (GIL)

    def _connect(
        self, board: Rendezvous, rank: int, size: int, arrival: float, tag: torch.Tensor
    ) -> torch.distributed.ProcessGroup:
        """A new ring among the group's members, every pair connected and heard from within
        ``arrival`` s (the addresses: twice that); else :class:`RingUnreachable`, naming the
        members that never posted their address at the board (``absent``) or whose address
        refused this member's connection (``unreachable``). (Before, one member that posted a
        dead address failed gloo's whole connection, naming nobody, after up to 5x the round's
        timeout on the side that waited for it: it joined every retry too, and three such rings
        switched the plane off.) Nobody else is named: a pair that connected and then stayed
        silent may be a silent member, or someone else in its place at a listener (gloo pairs
        a connection by the rank it says it is; a review of this defence: an outsider, or
        another member, connecting first as one member to the other got honest members named)."""
        now = time.monotonic()
        self._parked = [(until, parked) for until, parked in self._parked if until > now][-MAX_RINGS:]
        options = torch.distributed.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=arrival / CONNECT_FACTOR)
        store = RingStore(board, 2 * arrival)
        ring = None
        try:
            options._devices = [_lazy_device(self.host)]
            ring = torch.distributed.ProcessGroupGloo(store, rank, size, options)  # posts its address
            absent = store.fetch_others(rank, size, 2 * arrival)
            if absent:
                raise RingUnreachable(
                    f"{_members(absent)} never posted a ring address within {2 * arrival:.0f} s",
                    absent=absent,
                )
            unreachable, silent = self._hello(ring, rank, size, tag, arrival)
            if unreachable or silent:
                said = [f"{_members(unreachable)} refused this member's connection"] if unreachable else []
                said += [f"no hello from {_members(silent)} within {arrival:.0f} s"] if silent else []
                raise RingUnreachable("; ".join(said), unreachable=unreachable)
        except Exception as error:
            # The failed ring's listener stays open a while: a member still connecting to it
            # then meets silence, not a refusal it would name this member for (a slow member
            # dialling late, or one kept waiting on purpose by another that gave up early).
            if ring is not None:  # (the others dial within 2x + 2x the arrival time of their start)
                self._parked.append((time.monotonic() + PARKED * arrival, ring))
            if isinstance(error, RingUnreachable):
                raise
            raise RingUnreachable(one_line(error)) from None  # a device, a thread, a board request
        return ring

    def _hello(
        self, ring: Any, rank: int, size: int, tag: torch.Tensor, budget: float
    ) -> tuple[list[int], list[int]]:
        """Connect every pair of a new ring and exchange the round's tag over each within
        ``budget`` s: (the ranks whose address refused this member's connection, the ranks it
        did not hear the tag from otherwise). Only the first are the member's own doing: this
        member dialled the address it posted (gloo has the higher of two addresses connect to
        the lower), and a member's listener stays open past the others' dials even when its
        ring failed (:data:`PARKED`), so nobody but it could have refused (or this member's own
        network: its own view only); a pair that connected and then stayed silent may be
        someone else's doing (:meth:`_connect`). The pairs are connected one at a
        time, as gloo makes a lazy ring's pairs without a lock; the tags are then awaited
        together."""
        started = time.monotonic()
        unreachable, silent = [], []
        pending: list[tuple[int, list[Any], torch.Tensor, torch.Tensor]] = []
        for other in range(size):
            if other == rank:
                continue
            if time.monotonic() - started > budget:  # members that keep this one waiting hold no
                silent.append(other)  # dial back past the budget (one waited on costs at most
                continue  # gloo's connect, the arrival time: a dial within 2x the budget)
            heard, sent = torch.zeros(1, dtype=torch.int64), tag.clone()
            try:
                works = [ring.recv([heard], other, HELLO_TAG), ring.send([sent], other, HELLO_TAG)]
            except Exception as error:  # noqa: BLE001 - this pair failed: named if it dialled
                (unreachable if _dialled(error) else silent).append(other)
                logger.debug("ring member %d could not be connected: %s", other, one_line(error))
                continue
            pending.append((other, works, heard, sent))
        for other, works, heard, _ in pending:
            try:
                for work in works:
                    work.wait(datetime.timedelta(seconds=max(0.001, budget - (time.monotonic() - started))))
            except Exception as error:  # noqa: BLE001 - silent: named by nobody
                silent.append(other)
                logger.debug("no hello from ring member %d: %s", other, one_line(error))
                continue
            if heard.item() != tag.item():
                silent.append(other)
        return unreachable, sorted(silent)


def _members(ranks: Sequence[int]) -> str:
    return f"member{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


def _dialled(error: BaseException) -> bool:
    """Whether gloo's error is this side's connection to the other's address failing (refused,
    or unanswered: "timed out connecting ... remote=[host]:port"), not a wait for the other to
    connect ("Connect timeout [none]") or a read on a pair that connected."""
    text = str(error)
    return "connecting" in text and "remote=" in text
