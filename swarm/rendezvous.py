"""The direct data plane's rendezvous: a key-value board only a group's members can reach.

A gloo ring needs a rendezvous: every rank posts its listening address and reads the others'.
torch's ``TCPStore`` does that over a plain TCP port that anyone can reach, list, read, write
and fill (an outsider took members' places in rings that way; see docs/security.md). gloo
does not need a ``TCPStore``: any ``torch.distributed.Store`` will do. Ours is a board held by
the group's leader in hivemind's matchmaking, reached through hivemind's p2p channel, which is encrypted and
authenticated by peer keys (TLS 1.3 in hivemind's daemon). So:

- only the peers hivemind put in the group can read or write its board (the caller's peer id
  is checked against the group's members on every request), nothing listens on a new port;
- a member may write only its own keys (``<tag>/<its rank>``), once; values and key counts are
  bounded; a board lives a bounded time and at most ``MAX_GROUPS`` exist at once, so nobody
  can grow a peer's memory without bound;
- keys cannot be listed: there is no such operation.

The same board carries each member's sketch of its contribution (see :mod:`swarm.sketch`).
"""

from __future__ import annotations

import asyncio
import datetime
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack
import torch

DECLINED = b"declined"  # posted at a new ring's board instead of a key: this member will not come

MAX_GROUPS = 16  # boards a leader keeps at once (one per recent group it led)
MAX_VALUE_BYTES = 64 * 1024  # a gloo address blob is ~60 B per member; a sketch ~200 B
MAX_KEY_CHARS = 64
KEYS_PER_MEMBER = 8
BOARD_SECONDS = 120.0  # a board outlives its round by far; then it is dropped


class RendezvousError(RuntimeError):
    """The board refused a request or did not answer in time."""


class Rendezvous(Protocol):
    """One group's board, as a member sees it."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str, timeout: float) -> bytes: ...

    def exchange(
        self, key: str, value: bytes, want: list[str], timeout: float, abort: threading.Event | None = None
    ) -> list[bytes]:
        """Post ``key`` and return the values of ``want`` once all are there (or raise
        RendezvousError when ``abort`` is set)."""
        ...


@dataclass
class _Board:
    members: tuple[bytes, ...]  # peer ids in rank order
    values: dict[str, bytes] = field(default_factory=dict)
    created: float = field(default_factory=time.monotonic)


class RendezvousBoards:
    """The boards of the groups this peer leads. Thread-safe: requests come from hivemind's
    event loop (other members) and from the ring's thread (this peer itself)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._boards: OrderedDict[bytes, _Board] = OrderedDict()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a value was posted: local waiters wake
        self._clock = clock

    def wait_change(self, timeout: float) -> None:
        """Block until some board gets a value (or ``timeout``): the leader's own member waits
        here instead of polling, leaving the CPU to the ring."""
        with self._changed:
            self._changed.wait(timeout)

    def open(self, group_id: bytes, members: Sequence[bytes], renew: bool = False) -> None:
        """Open a group's board (no-op if open); ``renew``: also give an open one a fresh lease,
        its values kept (after a long all-reduce)."""
        with self._lock:
            self._expire()
            if group_id not in self._boards:
                self._boards[group_id] = _Board(tuple(members), created=self._clock())
            elif renew:
                self._boards[group_id].created = self._clock()
            while len(self._boards) > MAX_GROUPS:
                self._boards.popitem(last=False)

    def missing(self, group_id: bytes, prefix: str, *, declined: bool = False) -> list[bytes]:
        """The members of a group's board here (peer ids) that never posted their
        ``<prefix><rank>`` (``here/``: the members' meeting), or with ``declined`` those that
        posted :data:`DECLINED` there. None for a board not here."""
        with self._lock:
            board = self._boards.get(group_id)
            if board is None:
                return []
            posts = [board.values.get(f"{prefix}{rank}") for rank in range(len(board.members))]
        return [
            member for member, post in zip(board.members, posts) if post == (DECLINED if declined else None)
        ]

    def _expire(self) -> None:
        now = self._clock()
        for group_id in [g for g, b in self._boards.items() if now - b.created > BOARD_SECONDS]:
            del self._boards[group_id]

    def handle(self, caller: bytes, request: dict) -> dict:
        """One request from ``caller`` (an authenticated peer id): ``{"g": group id, "op":
        "set" | "get", "k": key, "v": value}`` -> ``{"ok": bool, "v": value, "why": str}``; a
        set may also name keys to read back at once (``"want": [keys]`` -> ``"vals"``)."""
        group_id, op, key = request.get("g"), request.get("op"), request.get("k")
        if not isinstance(group_id, bytes) or not isinstance(key, str) or len(key) > MAX_KEY_CHARS:
            return {"ok": False, "why": "malformed request"}
        want = request.get("want", [])
        if not isinstance(want, list) or len(want) > 1024 or not all(isinstance(k, str) for k in want):
            return {"ok": False, "why": "malformed request"}
        with self._lock:
            board = self._boards.get(group_id)
            # Same answer for an unknown group and a non-member: an outsider learns nothing.
            if board is None or caller not in board.members:
                return {"ok": False, "why": "unknown group"}
            if op == "get" and want:
                values = [board.values.get(k) for k in want]
                return {"ok": True, "vals": values} if None not in values else {"ok": False, "why": "not yet"}
            if op == "get":
                value = board.values.get(key)
                return {"ok": value is not None, "v": value, "why": "" if value is not None else "not yet"}
            if op != "set":
                return {"ok": False, "why": f"unsupported operation {op!r}"}
            value = request.get("v")
            rank = board.members.index(caller)
            if not key.endswith(f"/{rank}"):
                return {"ok": False, "why": f"a member writes only its own keys (*/{rank})"}
            if not isinstance(value, bytes) or len(value) > MAX_VALUE_BYTES:
                return {"ok": False, "why": "value too large"}
            if key in board.values:
                if board.values[key] != value:
                    return {"ok": False, "why": "already set"}
            elif sum(k.endswith(f"/{rank}") for k in board.values) >= KEYS_PER_MEMBER:
                return {"ok": False, "why": "too many keys"}
            board.values[key] = value
            self._changed.notify_all()
            values = [board.values.get(k) for k in want]
            return {"ok": True, "vals": values} if None not in values else {"ok": True}

    async def answer(self, caller: bytes, request: dict, wait: float = 1.0) -> dict:
        """:meth:`handle` for a remote member; a request for keys not all posted yet waits up to
        ``wait`` seconds for them (a long poll: the answer comes the moment the last one lands)."""
        deadline = time.monotonic() + wait
        while True:
            answer = self.handle(caller, request)
            if not request.get("want") or "vals" in answer or answer.get("why") not in ("not yet", None):
                return answer
            if time.monotonic() > deadline:
                return answer
            await asyncio.sleep(0.001)


def _values(answer: dict, count: int) -> bool:
    values = answer.get("vals")
    return isinstance(values, list) and len(values) == count and all(isinstance(v, bytes) for v in values)


def pack(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes, *, max_bin: int = 2 * MAX_VALUE_BYTES) -> dict:
    """A request or answer from the network: a dict, or an empty dict if it is not one (or holds
    bytes over ``max_bin``)."""
    try:
        message = msgpack.unpackb(data, raw=False, max_bin_len=max_bin, max_str_len=1024)
    except Exception:  # noqa: BLE001 - any malformed bytes are just a bad message
        return {}
    return message if isinstance(message, dict) else {}


class BoardClient:
    """A member's view of one group's board, through ``call`` (request -> answer, blocking).
    ``pause``: seconds between polls (small for a board in this process; a remote board holds
    a request until the keys are there, so polling it needs no pause)."""

    def __init__(
        self,
        group_id: bytes,
        call: Callable[[dict], dict],
        pause: float = 0.0005,
        wait: Callable[[float], None] | None = None,
    ) -> None:
        self.group_id, self._pause = group_id, pause
        self.held_here = wait is not None  # the board's holder waits on it instead of polling
        self.opened = False  # whether its holder ever answered as the board's (it opened it)
        self.refused = False  # whether the last request ended in its holder's "unknown group"
        self.holder: Any = None  # who holds it, where this member knows for itself (set by its maker)

        def asked(request: dict) -> dict:
            self.refused = False  # (a p2p error is no answer)
            answer = call(request)
            self.refused = answer.get("why") == "unknown group"
            self.opened = self.opened or not self.refused
            return answer

        self._call = asked
        self._wait = wait or time.sleep  # between polls: a board in this process wakes us itself

    def set(self, key: str, value: bytes) -> None:
        deadline = time.monotonic() + 10.0
        while True:
            answer = self._call({"g": self.group_id, "op": "set", "k": key, "v": bytes(value)})
            if answer.get("ok"):
                return
            # The leader may not have opened the board yet (it learns of the group as we do).
            if answer.get("why") != "unknown group" or time.monotonic() > deadline:
                raise RendezvousError(f"the group's board refused {key!r}: {answer.get('why')}")
            time.sleep(0.01)

    def exchange(
        self, key: str, value: bytes, want: list[str], timeout: float, abort: threading.Event | None = None
    ) -> list[bytes]:
        # One round trip when the others posted first (the usual case after a ring).
        deadline = time.monotonic() + timeout
        answer = self._call({"g": self.group_id, "op": "set", "k": key, "v": bytes(value), "want": want})
        if not answer.get("ok"):
            self.set(key, value)  # retried while the leader has not opened the board yet
            answer = {"ok": False, "why": "not yet"}
            # Everyone's ``timeout`` from the board's opening, as the leader's own: a member
            # that asked before then gave up first, and once the leader's own meeting was
            # complete (a late member came in between), only that member's failed.
            deadline = time.monotonic() + timeout
        while not _values(answer, len(want)):
            if answer.get("why") not in (None, "not yet") or time.monotonic() > deadline:
                raise RendezvousError(
                    f"the others' {want} did not come within {timeout:.0f} s: {answer.get('why')}"
                )
            if abort is not None and abort.is_set():
                raise RendezvousError("the round ended before the others' sketches came")
            self._wait(self._pause)
            answer = self._call({"g": self.group_id, "op": "get", "k": "", "want": want})
        return answer["vals"]

    def get(self, key: str, timeout: float) -> bytes:
        deadline, pause = time.monotonic() + timeout, 0.001
        while True:
            answer = self._call({"g": self.group_id, "op": "get", "k": key})
            if answer.get("ok") and isinstance(answer.get("v"), bytes):
                return answer["v"]
            if answer.get("why") not in ("not yet", "unknown group"):
                raise RendezvousError(f"the group's board refused {key!r}: {answer.get('why')}")
            if time.monotonic() > deadline:
                raise RendezvousError(f"no member posted {key!r} within {timeout:.0f} s")
            self._wait(pause)
            pause = min(2 * pause, 0.05)


class RingStore(torch.distributed.Store):
    """gloo's rendezvous on a group's board (gloo calls ``set``, ``wait`` and ``get`` only)."""

    def __init__(self, board: Rendezvous, timeout: float) -> None:
        super().__init__()
        self._board, self._timeout = board, timeout
        self._seen: dict[str, bytes] = {}
        self._posted: list[str] = []  # the keys gloo set (a member's address: "<prefix>/<rank>")

    def set(self, key: str, value: bytes) -> None:
        self._board.set(f"ring{key}", bytes(value))
        self._posted.append(key)

    def fetch_others(self, rank: int, size: int, timeout: float) -> list[int]:
        """Read every other member's address ahead of gloo (its lazy connections then find them
        here), all within ``timeout`` s: the ranks whose address never came. Read here, one
        missing address costs ``timeout`` once, not once per pair behind it. Nothing is read
        when gloo did not post exactly one key of this member's, named as the board names a
        member's keys (another torch: gloo then reads them itself)."""
        if len(self._posted) != 1 or not self._posted[0].endswith(f"/{rank}"):
            return []
        prefix = self._posted[0][: -len(str(rank))]
        deadline, absent = time.monotonic() + timeout, []
        for other in range(size):
            if other != rank:
                try:
                    self.get(f"{prefix}{other}", max(0.0, deadline - time.monotonic()))
                except RendezvousError:
                    absent.append(other)
        return absent

    def get(self, key: str, timeout: float | None = None) -> bytes:
        if key not in self._seen:
            self._seen[key] = self._board.get(f"ring{key}", self._timeout if timeout is None else timeout)
        return self._seen[key]

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        for key in keys:
            self.get(key)

    def check(self, keys: list[str]) -> bool:
        return all(key in self._seen for key in keys)

    def clone(self) -> RingStore:
        return RingStore(self._board, self._timeout)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout.total_seconds()

    def num_keys(self) -> int:
        return len(self._seen)

    def _unsupported(self, *args, **kwargs):
        raise RendezvousError("the ring's rendezvous supports set, get and wait only")

    add = compare_set = delete_key = append = multi_get = multi_set = list_keys = _unsupported

    def has_extended_api(self) -> bool:
        return False
