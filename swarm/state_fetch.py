"""The joiner's side of the direct state transport (:mod:`swarm.state_transfer` has the
protocol, the layout and the donor's listener): which offer to assemble the state from, and the
slices fetched from every donor at once, each checked against its donor's hash."""

from __future__ import annotations

import collections
import hmac
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from swarm.state_transfer import (
    END,
    HASH,
    INDEX,
    MIN_RATE,
    Layout,
    TransferFailed,
    hash_of,
    no_delay,
    receive_into,
)

logger = logging.getLogger(__name__)


@dataclass
class DonorOffer:
    """One donor's offer, as the joiner holds it."""

    peer: str
    address: tuple[str, int]
    token: bytes
    hashes: list[bytes]
    hash_name: str = HASH  # what the hashes are (state_transfer.HASHES)
    delivered: int = 0  # bytes it sent that checked out
    why: str = ""  # why it was dropped ("" while it serves)


def freshest(offers: list[tuple[DonorOffer, int, bytes, Layout]]) -> tuple[DonorOffer, int, bytes, Layout]:
    """The offer to assemble the state from: of the latest outer step offered (the donors'
    declared priorities are up to ``declare_state_period`` old), the one most other offers
    share it with (they serve its slices too), the first (by declared priority) on a tie."""

    def same(offer) -> int:
        return sum((o[1], o[2], o[3]) == (offer[1], offer[2], offer[3]) for o in offers)

    return max(offers, key=lambda offer: (offer[1], same(offer), -offers.index(offer)))


@dataclass
class _Work:
    layout: Layout
    flat: torch.Tensor
    donors: list[DonorOffer]
    timeout: float
    progress: Callable[[int], None]
    slices: list[tuple[int, int, bool]] = field(init=False)
    pending: set[int] = field(init=False)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.slices = self.layout.slices()
        self.pending = set(range(len(self.slices)))
        first = self.donors[0].hashes
        shared = [i for i, (_, _, s) in enumerate(self.slices) if s]
        self.agree = {id(d): all(d.hashes[i] == first[i] for i in shared) for d in self.donors}

    def servable(self, donor: DonorOffer, index: int) -> bool:
        """A shared slice only from donors that hold the first donor's bytes; a local one (the
        donor's own moments) only from donors that hold the first donor's whole θ and momentum."""
        if not self.slices[index][2]:
            return self.agree[id(donor)]
        return donor.hashes[index] == self.donors[0].hashes[index]

    def order(self, donor: DonorOffer) -> list[int]:
        """The pending slices ``donor`` can serve, those fewest live donors can serve first."""
        live = [d for d in self.donors if not d.why]
        with self.lock:
            mine = [i for i in self.pending if self.servable(donor, i)]
        return sorted(mine, key=lambda i: (sum(self.servable(d, i) for d in live), i))

    def claim(self, index: int) -> bool:
        with self.lock:
            if index in self.pending:
                self.pending.discard(index)
                return True
            return False

    def give_back(self, index: int) -> None:
        with self.lock:
            self.pending.add(index)


def fetch(
    layout: Layout,
    flat: torch.Tensor,
    donors: Sequence[DonorOffer],
    *,
    timeout: float = 10.0,
    progress: Callable[[int], None] = lambda received: None,
    cancel: threading.Event | None = None,
) -> list[DonorOffer]:
    """Fill ``flat`` (uint8, ``layout.total`` bytes) with the first donor's shared region and a
    local region from any of them (see the module's docstring); the donors, each with what it
    delivered and why it was dropped. :class:`TransferFailed` if a slice is left that no live
    donor can serve. ``progress`` is told the bytes received so far. ``cancel``: set, the
    download stops at the next slice (:class:`TransferFailed`)."""
    cancel = cancel or threading.Event()
    work = _Work(layout, flat, list(donors), timeout, progress)
    if any(len(d.hashes) != len(work.slices) for d in work.donors):
        raise TransferFailed("an offer's hashes do not cover the layout's slices")
    received = [0]

    def serve(donor: DonorOffer) -> None:
        data = memoryview(flat.numpy())
        asked: collections.deque[int] = collections.deque()  # requested, not yet received
        try:
            with socket.create_connection(donor.address, timeout=timeout) as connection:
                connection.settimeout(timeout)
                no_delay(connection)
                connection.sendall(donor.token)
                order = iter(work.order(donor))

                def ask() -> None:
                    for index in order:
                        if work.claim(index):
                            asked.append(index)
                            connection.sendall(INDEX.pack(index))
                            return

                ask()
                ask()  # one ahead: the donor sends the next slice while this one is hashed
                while asked and not cancel.is_set():
                    index = asked[0]
                    lo, hi, _ = work.slices[index]
                    receive_into(connection, data[lo:hi], timeout + (hi - lo) / MIN_RATE)
                    ask()
                    if not hmac.compare_digest(hash_of(data[lo:hi], donor.hash_name), donor.hashes[index]):
                        raise ValueError(f"slice {index} does not match the hash it offered")
                    asked.popleft()
                    donor.delivered += hi - lo
                    with work.lock:
                        received[0] += hi - lo
                        work.progress(received[0])
                connection.sendall(INDEX.pack(END))
        except Exception as error:  # noqa: BLE001 - any failure drops this donor, never the download
            donor.why = str(error) or type(error).__name__
            logger.warning("state download: dropped donor %s: %s", donor.peer[-8:], donor.why)
        finally:
            for index in asked:  # what it was asked for and did not deliver goes to the others
                work.give_back(index)

    # Rounds: a donor dropped mid-way leaves its slice to those still serving; they may all
    # have finished their own lists by then, so anything left starts another round.
    while work.pending:
        if cancel.is_set():
            raise TransferFailed("cancelled")
        live = [d for d in work.donors if not d.why and any(work.servable(d, i) for i in work.pending)]
        if not live:
            why = "; ".join(f"{d.peer[-8:]}: {d.why}" for d in work.donors if d.why) or "no donor holds them"
            raise TransferFailed(f"{len(work.pending)} slice(s) left that no donor can serve ({why})")
        threads = [threading.Thread(target=serve, args=(d,), name="state-fetch", daemon=True) for d in live]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return work.donors
