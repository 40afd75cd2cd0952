"""A joiner's state download from several donors at once, over direct TCP connections.

hivemind's download streams the whole state from one donor, as protobuf messages through both
peers' p2p daemons: 76 MB/s for a 400 MB state on this machine, 0.02x a raw TCP copy
(docs/performance.md). Here hivemind keeps what it is good at, finding donors and proving who
they are, and the bytes take a plain socket:

1. **Offer.** The joiner asks each donor over hivemind's authenticated, encrypted channel
   (``rpc_state_offer``). A donor answers with its outer step, the state's :class:`Layout`, a
   SHA-256 of every slice of its bytes, the address of its listener (bound to ``--host`` only)
   and a random token for this joiner. The donor takes one :class:`Snapshot` per outer step and
   serves every joiner of that step from it: no copy of the state per joiner.
2. **Slices.** The joiner connects to each donor's listener and proves it holds a token before
   the donor reads anything else (a stranger who found the port gets nothing and can ask for
   nothing). Then it asks for slices by index; each one arrives straight into the joiner's
   buffer and is checked against the hash in that donor's offer.
3. **Who serves what.** The state has two regions. The *shared* one (θ, the outer momentum,
   queued updates) is the swarm's consensus: a slice of it is taken from any donor whose hash
   for it equals the first donor's, so the assembled θ is bit for bit the first donor's and the
   witnesses' check of it (:func:`swarm.claims.judge_state`) holds for the whole. The *local*
   region (the donor's own inner-optimizer moments, different on every peer) is taken slice by
   slice from any donor at the same step, each checked against its own donor's hash. Slices
   only one donor can serve are fetched first, so it is not left with a tail at the end.
4. **Failure.** A donor that cannot be reached, stalls, dies mid-slice or sends a slice that
   does not match its hash is dropped for this download; its slice goes back to the others.
   When nobody left can serve a slice, :class:`TransferFailed`: the caller falls back to
   hivemind's download.

The bytes are not encrypted: a private run (``--secret``) downloads over hivemind's encrypted
path, as its rounds do (the cost is in docs/performance.md). They are authenticated by the
hashes, which travel over hivemind's channel.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import hashlib
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import blake3
import torch

from swarm.addresses import origin
from swarm.bounds import whole

logger = logging.getLogger(__name__)

SLICE_BYTES = 4 << 20
"""The smallest slice: a round trip per slice costs ~0.1 ms on loopback, 4 MiB ~1-2 ms."""
MAX_SLICES = 2048  # a larger state gets larger slices: an offer's hashes stay within 64 KiB
MAX_TENSORS = 1 << 16
ALIGN = 64  # each tensor starts at a multiple of this in the flat buffer
TOKEN_BYTES = 32
HASH_BYTES = 32
HASHES: dict[str, Callable[[], Any]] = {"blake3": blake3.blake3, "sha256": hashlib.sha256}
"""The hashes a joiner checks slices with, by the name in an offer (an offer without one is
from a donor before 2026-12-02: SHA-256)."""
HASH = "blake3"
"""What this donor hashes its slices with: BLAKE3 hashes 4.8 GB/s on one core here, SHA-256
1.1 GB/s; a 400 MB state is hashed by every donor at every outer step and by every joiner."""
TOKEN_SECONDS = 120.0  # an offer can be used this long after it was made
MAX_TOKENS = 256  # offers remembered (oldest forgotten): joiners are few, fresh keys are free
MAX_CONNECTIONS = 16  # connections being served (each showed a token of a current offer)
MAX_PER_ADDRESS = 4
"""Connections one address may have served at once, on a listener that takes other machines'
connections: fresh keys are free (each gets an offer), addresses less so. 16 fresh keys on
one machine held every slot, and honest joiners fell back to hivemind's stream."""
MAX_PENDING = 64
"""Connections still to show their token. When one more comes, the oldest from the address with
the most of them is cut: a flood of silent connections (each held a slot for TOKEN_WAIT
before) cuts its own, and an honest joiner, which shows its token as soon as it connects from
an address of its own, gets through."""
TOKEN_WAIT = 5.0  # s for a connection to show its token, in all
SERVED_PER_OFFER = 2  # an offer serves at most this many times its snapshot's bytes
IDLE_SECONDS = 30.0  # a connection may last this long beyond its bytes at MIN_RATE, or is cut off
MIN_RATE = 256 << 10  # bytes/s: a donor slower than this over a whole slice is dropped
MAX_SNAPSHOTS = 2  # snapshots kept alive by offers (older offers expire; twice that with downloads under way)
SLOW_PART = 1 << 16
HASH_THREADS = 4
END = 0xFFFFFFFF  # a slice index that closes the connection
INDEX = struct.Struct("!I")
DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32, torch.float16, torch.bfloat16, torch.float64,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}  # fmt: skip


class TransferFailed(RuntimeError):
    """The state could not be assembled from the donors offered (the caller falls back)."""


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a state lies in one flat byte buffer, and how it is cut into slices.

    ``specs``: (dtype name, shape) per tensor; the first ``shared`` of them are the shared
    region. Slices never cross the regions' boundary."""

    specs: tuple[tuple[str, tuple[int, ...]], ...]
    shared: int
    slice_bytes: int

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], shared: int) -> Layout:
        specs = tuple((str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tensors)
        return cls(specs, shared, cls(specs, shared, SLICE_BYTES).honest_slice_bytes())  # (by its total)

    def offsets(self) -> list[int]:
        """The byte offset of each tensor, then the buffer's size."""
        return self._offsets

    @functools.cached_property
    def _offsets(self) -> list[int]:
        offsets, position = [], 0
        for dtype, shape in self.specs:
            offsets.append(position)
            position += _aligned(DTYPES[dtype].itemsize * _numel(shape))
        return [*offsets, position]

    @property
    def total(self) -> int:
        return self.offsets()[-1]

    def slices(self) -> list[tuple[int, int, bool]]:
        """``(lo, hi, shared)`` byte bounds of every slice."""
        return self._slices

    @functools.cached_property
    def _slices(self) -> list[tuple[int, int, bool]]:
        offsets = self.offsets()
        boundary = offsets[self.shared]
        cuts = []
        for lo, hi, shared in ((0, boundary, True), (boundary, offsets[-1], False)):
            cuts += [(a, min(a + self.slice_bytes, hi), shared) for a in range(lo, hi, self.slice_bytes)]
        return cuts

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The tensors, as views into ``flat`` (uint8, ``total`` bytes)."""
        offsets = self.offsets()
        return [
            flat[lo : lo + DTYPES[dtype].itemsize * _numel(shape)].view(DTYPES[dtype]).view(shape)
            for (dtype, shape), lo in zip(self.specs, offsets)
        ]

    def to_wire(self) -> dict:
        return {
            "specs": [[d, list(s)] for d, s in self.specs],
            "shared": self.shared,
            "slice": self.slice_bytes,
        }

    @classmethod
    def from_wire(cls, message: object, limit: int) -> Layout:
        """A layout from a donor: ValueError unless well formed and at most ``limit`` bytes."""
        if not isinstance(message, dict):
            raise ValueError("no layout")
        specs, shared, size = message.get("specs"), message.get("shared"), message.get("slice")
        if not isinstance(specs, list) or not 0 < len(specs) <= MAX_TENSORS:
            raise ValueError("a layout needs 1 to 65536 tensors")
        parsed = []
        for spec in specs:
            if not (
                isinstance(spec, list) and len(spec) == 2 and spec[0] in DTYPES and isinstance(spec[1], list)
            ):
                raise ValueError("a tensor's spec is [dtype, shape]")
            shape = spec[1]
            if len(shape) > 8 or not all(whole(n) and 0 <= n < 1 << 40 for n in shape):
                raise ValueError("a shape of up to 8 sizes")
            parsed.append((spec[0], tuple(shape)))
        if not whole(shared) or not 0 <= shared <= len(parsed):
            raise ValueError("a shared region of 0 to all tensors")
        layout = cls(tuple(parsed), shared, size if whole(size) else 0)
        if layout.total > limit:
            raise ValueError(f"a state of {layout.total >> 20} MiB, more than this model's")
        if not layout.slice_bytes >= SLICE_BYTES or len(layout.slices()) > MAX_SLICES:
            raise ValueError("slices too small")
        if layout.slice_bytes > layout.honest_slice_bytes():
            # One slice of a whole state: its timeout (from its size) ran to hours, and a donor
            # that sent all of it but a byte held the download's thread, socket and buffer past
            # the download's end (a review, 2026-12-06). Donors cut as :meth:`of` does.
            raise ValueError("slices larger than this state's")
        return layout

    def honest_slice_bytes(self) -> int:
        """The slice size a donor of this release cuts this layout's state into (:meth:`of`)."""
        return max(SLICE_BYTES, _aligned(-(-self.total // (MAX_SLICES - 2))))


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def hash_of(view: memoryview, name: str = HASH) -> bytes:
    digest = HASHES[name]()
    digest.update(view)  # releases the GIL: slices are hashed in parallel
    return digest.digest()


@dataclass
class Snapshot:
    """One donor's state at one outer step, with a hash per slice; served to every joiner of
    that step, from the tensors themselves (no flat copy)."""

    step: int
    metadata: bytes
    layout: Layout
    tensors: list[torch.Tensor]
    data: list[memoryview]  # each tensor's bytes
    hashes: list[bytes]
    hash_name: str = field(default=HASH)

    @classmethod
    def take(cls, step: int, metadata: bytes, tensors: Sequence[torch.Tensor], shared: int) -> Snapshot:
        """``tensors``: a copy of the state that nobody changes any more (held, not copied)."""
        layout = Layout.of(tensors, shared)
        tensors = [t.detach().contiguous() for t in tensors]
        data = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors]
        snapshot = cls(step, metadata, layout, tensors, data, [])
        with _pool(HASH_THREADS) as pool:
            snapshot.hashes = list(pool(snapshot.hash, range(len(layout.slices()))))
        return snapshot

    def pieces(self, index: int) -> list[memoryview | bytes]:
        """Slice ``index`` as the tensors' bytes it covers and the zeros that pad them."""
        lo, hi, _ = self.layout.slices()[index]
        offsets = self.layout.offsets()
        pieces: list[memoryview | bytes] = []
        for k in range(max(0, bisect.bisect_right(offsets, lo) - 1), len(self.data)):
            start, end, padded = offsets[k], offsets[k] + len(self.data[k]), offsets[k + 1]
            if start >= hi:
                break
            if lo < end and start < hi:
                pieces.append(self.data[k][max(lo, start) - start : min(hi, end) - start])
            if lo < padded and end < hi and end < padded:
                pieces.append(bytes(min(hi, padded) - max(lo, end)))
        return pieces

    def hash(self, index: int) -> bytes:
        digest = HASHES[self.hash_name]()
        for piece in self.pieces(index):
            digest.update(piece)  # releases the GIL: slices are hashed in parallel
        return digest.digest()


@contextlib.contextmanager
def _pool(workers: int):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers, thread_name_prefix="state-hash") as executor:
        yield executor.map


@dataclass
class _Offer:
    snapshot: Snapshot
    joiner: str
    expires: float
    served: int = 0  # bytes served under it (at most SERVED_PER_OFFER times the snapshot's)


class StateServer:
    """The donor's listener (bound to one address, ``--host``): serves the slices of the
    snapshots it offered, to whoever shows one of the offers' tokens first.

    What a token holder or an outsider can take (2026-12-05, a trust review: one token held all
    16 slots, the offer's expiry did not end its connections, and their snapshots stayed alive):
    a connection waits for its token without a slot (:data:`MAX_PENDING`, the oldest cut
    first); an offer serves one connection at a time, is looked up again at every slice asked
    for (an offer expired or replaced cuts its connection, and an idle connection holds no
    snapshot), and serves at most :data:`SERVED_PER_OFFER` times its snapshot's bytes. One
    address (:func:`swarm.addresses.origin`; not this listener's own) has at most
    ``per_address`` connections served at once; a connection lasts at most
    :data:`IDLE_SECONDS` beyond its bytes at :data:`MIN_RATE`, and each slice must leave within
    :data:`IDLE_SECONDS` plus its size at :data:`MIN_RATE` (the joiner's own rule for a donor):
    a token holder that read a slice now and then held a slot for the offer's two minutes."""

    def __init__(self, host: str, *, per_address: int | None = MAX_PER_ADDRESS) -> None:
        """``per_address``: None where every connection comes from this machine (a listener on
        loopback). Testing (the fault file): ``tamper()`` > 0 flips a byte of every slice
        served; ``delay()`` sleeps that many ms per 64 KiB sent, as hivemind's stream is slowed."""
        self._socket = socket.create_server((host, 0), backlog=MAX_CONNECTIONS)
        self.address = (host, self._socket.getsockname()[1])
        self._offers: dict[bytes, _Offer] = {}  # sha256(token) -> offer
        self._lock = threading.Lock()
        self.per_address = per_address
        self._open: set[socket.socket] = set()  # connections being served, cut by close()
        # Connections still to show a token, by the address they come from (oldest first).
        self._pending: dict[str, collections.deque[socket.socket]] = {}
        # Offer (by key) -> the connection it serves and its address: MAX_CONNECTIONS at most.
        self._serving: dict[bytes, tuple[socket.socket, str | None]] = {}  # (None: this machine's)
        self.tamper: Callable[[], float] = lambda: 0.0
        self.delay: Callable[[], float] = lambda: 0.0
        self.served = 0  # bytes served, for the logs and tests
        threading.Thread(target=self._accept, name="state-server", daemon=True).start()

    @property
    def connections(self) -> int:
        """Connections being served now."""
        with self._lock:
            return len(self._open)

    def offer(self, snapshot: Snapshot, joiner: str) -> bytes:
        """A token that lets ``joiner`` (sent over hivemind's channel only) fetch ``snapshot``."""
        token = secrets.token_bytes(TOKEN_BYTES)
        now = time.monotonic()
        with self._lock:
            # One offer per joiner (its last), the latest MAX_SNAPSHOTS snapshots: whoever asks,
            # and however often, the offers keep at most that many copies of the state alive.
            for key in [k for k, o in self._offers.items() if o.expires < now or o.joiner == joiner]:
                del self._offers[key]
            self._offers[hashlib.sha256(token).digest()] = _Offer(snapshot, joiner, now + TOKEN_SECONDS)
            kept: list[int] = []
            for offer in reversed(self._offers.values()):
                if id(offer.snapshot) not in kept:
                    kept.append(id(offer.snapshot))
            # The latest MAX_SNAPSHOTS, and those a download is under way from (a third joiner's
            # fresh snapshot cut the first one's download mid-way), 2 x MAX_SNAPSHOTS in all.
            served = {id(self._offers[k].snapshot) for k in self._serving if k in self._offers}
            kept = kept[:MAX_SNAPSHOTS] + [s for s in kept[MAX_SNAPSHOTS:] if s in served]
            kept = kept[: 2 * MAX_SNAPSHOTS]
            for key in [k for k, o in self._offers.items() if id(o.snapshot) not in kept]:
                del self._offers[key]
            while len(self._offers) > MAX_TOKENS:
                del self._offers[next(iter(self._offers))]
        return token

    def offered(self, token: bytes) -> Snapshot | None:
        """The snapshot offered under ``token``, while the offer lasts."""
        with self._lock:
            offer = self._current(hashlib.sha256(token).digest())
        return offer.snapshot if offer is not None else None

    def _current(self, key: bytes) -> _Offer | None:
        """The offer under ``key`` (sha256 of its token) while it lasts (call under the lock)."""
        offer = self._offers.get(key)
        return offer if offer is not None and offer.expires >= time.monotonic() else None

    def close(self) -> None:
        """Stop listening and cut every connection being served (as if this process died)."""
        with self._lock:
            sockets = [self._socket, *self._open]
        for each in sockets:
            with contextlib.suppress(OSError):
                each.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it; close alone does not
            with contextlib.suppress(OSError):
                each.close()

    def _accept(self) -> None:
        while True:
            try:
                connection, address = self._socket.accept()
            except OSError:  # closed
                return
            with self._lock:
                self._open.add(connection)
                self._pending.setdefault(address[0], collections.deque()).append(connection)
                cut = None
                if sum(len(q) for q in self._pending.values()) > MAX_PENDING:
                    crowded = max(self._pending, key=lambda a: len(self._pending[a]))
                    cut = self._pending[crowded].popleft()
            if cut is not None:  # its thread wakes from its wait for a token and ends
                with contextlib.suppress(OSError):
                    cut.shutdown(socket.SHUT_RDWR)
            threading.Thread(target=self._serve, args=(connection, address[0]), daemon=True).start()

    def _serve(self, connection: socket.socket, address: str) -> None:
        key = b""
        try:
            with connection:
                no_delay(connection)
                token = _receive(connection, TOKEN_BYTES, TOKEN_WAIT)
                key = hashlib.sha256(token).digest()
                with self._lock:
                    if not self._unpend(connection):
                        return  # cut while it waited: a newer connection took its place
                    offer = self._current(key)
                    if offer is None:
                        return  # not one of ours: nothing read beyond the token, nothing sent
                    # One connection per offer: a newer one takes the older one's place (a
                    # joiner reconnects for a second pass once its first connection ended),
                    # if there is room for it beside the others.
                    others = [a for k, (_, a) in self._serving.items() if k != key]
                    party = (
                        None if self.per_address is None or address == self.address[0] else origin(address)
                    )
                    if len(others) >= MAX_CONNECTIONS or (
                        party is not None and others.count(party) >= self.per_address
                    ):
                        return  # every slot taken, or every slot this address may hold
                    older = self._serving.get(key)
                    if older is not None:
                        with contextlib.suppress(OSError):
                            older[0].shutdown(socket.SHUT_RDWR)
                    self._serving[key] = (connection, party)
                    joiner = offer.joiner
                    del offer  # looked up again at every slice: an idle connection holds no snapshot
                delay = self.delay()
                if delay:
                    logger.warning(
                        "serving the state slowly to %s (fault injection: %.0f ms per part)", joiner, delay
                    )
                # The joiner's own rule for a donor, turned round: IDLE_SECONDS beyond what its
                # bytes take at MIN_RATE (waits for requests add up to about a round trip a
                # slice on a long path: a budget of waits alone cut a 3 GB download at 50 ms).
                started, served = time.monotonic(), 0
                while True:
                    left = started + IDLE_SECONDS + served / MIN_RATE - time.monotonic()
                    (index,) = INDEX.unpack(_receive(connection, INDEX.size, min(IDLE_SECONDS, left)))
                    sent = self._send_slice(connection, key, index)
                    if sent is None:
                        return
                    served += sent
        except (OSError, ConnectionError) as error:
            logger.debug("state connection ended: %s", error)
        finally:
            with self._lock:
                self._open.discard(connection)
                self._unpend(connection)
                if self._serving.get(key, (None, None))[0] is connection:
                    del self._serving[key]

    def _unpend(self, connection: socket.socket) -> bool:
        """Take ``connection`` off the pending ones (call under the lock); False if not there."""
        for address, queue in self._pending.items():
            if connection in queue:
                queue.remove(connection)
                if not queue:
                    del self._pending[address]
                return True
        return False

    def _send_slice(self, connection: socket.socket, key: bytes, index: int) -> int | None:
        """Send slice ``index`` of the offer under ``key``: its bytes, or None to end the
        connection (END or an index out of range, the offer expired or replaced, or its bytes
        served)."""
        with self._lock:
            offer = self._current(key)
            if offer is None or index >= len(offer.snapshot.hashes):
                return None
            pieces = offer.snapshot.pieces(index)
            size = sum(len(piece) for piece in pieces)
            if offer.served + size > SERVED_PER_OFFER * offer.snapshot.layout.total:
                logger.debug("an offer asked for more than %dx its state: cut", SERVED_PER_OFFER)
                return None
            offer.served += size
            del offer  # (nor does a connection sending a slice: the snapshot may go once it is sent)
        if self.tamper():
            pieces = [bytes([pieces[0][0] ^ 0xFF]), pieces[0][1:], *pieces[1:]]
        connection.settimeout(IDLE_SECONDS + size / MIN_RATE)  # a reader that stops reading is cut
        delay = self.delay() / 1000
        for piece in pieces:
            step = SLOW_PART if delay else len(piece)  # slowed like hivemind's stream
            for lo in range(0, len(piece), step):
                if delay:
                    time.sleep(delay)
                connection.sendall(piece[lo : lo + step])
            self.served += len(piece)
        return size


def no_delay(connection: socket.socket) -> None:
    """Send small writes (a slice's tail, a request) at once: with Nagle's algorithm each one
    waited for the delayed ACK of the last, 130 ms for a 14-slice state against 1 ms."""
    with contextlib.suppress(OSError):
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _receive(connection: socket.socket, count: int, seconds: float) -> bytes:
    data = bytearray(count)
    receive_into(connection, memoryview(data), seconds)
    return bytes(data)


def receive_into(connection: socket.socket, view: memoryview, seconds: float) -> None:
    """Fill ``view`` within ``seconds`` in all (a peer trickling a byte at a time does not hold
    a connection open for longer)."""
    deadline = time.monotonic() + seconds
    while view:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(view)} bytes still missing after {seconds:.0f} s")
        connection.settimeout(left)
        got = connection.recv_into(view)
        if not got:
            raise ConnectionError("the other side closed the connection")
        view = view[got:]
