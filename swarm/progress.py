"""The progress board: every peer's heartbeat under one DHT key of the run.

Each peer stores a :class:`~swarm.records.PeerHeartbeat` under ``<ns>_peers``, signed, with
its public key as subkey and a short expiration, so a crashed peer vanishes from the board
after ``ttl`` seconds. Readers drop every entry that does not parse or whose peer id is not
the one its signing key belongs to: nobody can publish a heartbeat for another peer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Collection

from swarm.claims import Ignored, implausible
from swarm.dht import REDIAL_PEERS, redial
from swarm.errors import SwarmError
from swarm.records import CLOCK_SLACK, HEARTBEAT_TTL, PeerHeartbeat, RunKeys, Stage
from swarm.store import SignedStore

logger = logging.getLogger(__name__)

MAX_KEYS = 4096  # signing keys whose peer id is cached
REDIAL_SECONDS = 10.0  # between two redials of the peers seen, while none is in sight


class ProgressBoard:
    """Publish this peer's heartbeat and read everybody's (call from one thread)."""

    def __init__(
        self, store: SignedStore, keys: RunKeys, *, ttl: float = HEARTBEAT_TTL, period: float = 1.0
    ) -> None:
        self.store = store
        self.key = keys.peers
        self.ttl = ttl
        self.period = period
        self._last_publish = 0.0
        self._last_fetch: dict[str, PeerHeartbeat] = {}
        self.failure: str | None = None
        """Why the last :meth:`fetch` could not read the DHT (None: it could). The peer's own
        barrier goes on with the last known peers; a monitor must say it lost the DHT instead
        (it showed frozen values, then every peer "left", a review)."""
        self._seen: OrderedDict[str, list[str]] = OrderedDict()  # peer id -> its addresses, last seen last
        self.vouched: Collection[str] = frozenset()
        """The peers this one averaged with (the averager's ``Vouching.vouched``, which it sets
        here): the last forgotten of the peers to dial again (:meth:`_keep_in_touch`)."""
        self._redialed = -REDIAL_SECONDS  # when the DHT was last asked to dial them again
        self._lock = threading.Lock()
        dht = getattr(store, "dht", None)
        self._dht = dht if hasattr(dht, "run_coroutine") else None  # (unit tests' stores have none)
        self.peer_id_here = dht.peer_id.to_base58() if self._dht is not None else None
        self._peer_ids: OrderedDict[str, str | None] = OrderedDict()  # public key -> peer id (cached, LRU)
        self.ignored = Ignored()
        self._forgers = Ignored()  # keys caught signing another peer's heartbeat (bounded)
        self.writers: dict[str, str] = {}
        """The last fetch's peers by id -> the hash of the key that signed their heartbeat (the
        run owner's own peers: :class:`swarm.steering.Steering`)."""
        """Peers caught lying (absurd heartbeats here, behaviour in swarm.averaging): dropped
        from every fetch for the rest of the run."""

    def ignore(self, peer_id: str, reason: str) -> None:
        if self.ignored.add(peer_id, reason):
            logger.warning("ignoring peer %s for the rest of the run: %s", peer_id[-8:], reason)

    def publish(self, heartbeat: PeerHeartbeat, *, force: bool = False) -> None:
        """Store the heartbeat; at most once per ``period`` unless ``force`` (a stage change)."""
        now = time.monotonic()
        if not force and now - self._last_publish < self.period:
            return
        self._last_publish = now
        # Same TTL for "leaving": hivemind keeps a subkey's value with the later expiration, so a
        # shorter one would be ignored and the peer would look alive until its last beat expired.
        # Fire and forget: never block a training step on the DHT.
        self.store.store(self.key, heartbeat, ttl=self.ttl)

    def publish_now(self, heartbeat: PeerHeartbeat, timeout: float = 3.0) -> None:
        """Store and wait until stored (used for the last word: leaving)."""
        try:
            if not self.store.store(self.key, heartbeat, ttl=self.ttl, wait=True, timeout=timeout):
                logger.debug("the DHT kept an older heartbeat over this one")
        except SwarmError as error:
            logger.debug("%s", error)

    @property
    def last_seen(self) -> dict[str, PeerHeartbeat]:
        """The live peers the last :meth:`fetch` read (no lookup)."""
        return dict(self._last_fetch)

    def fetch(self, *, include_leaving: bool = False) -> dict[str, PeerHeartbeat]:
        """Live peers by peer id (this one included once it has published)."""
        try:
            records = self.store.read(self.key, PeerHeartbeat)
        except SwarmError as error:
            self.failure = str(error)
            logger.warning("%s; using the last known peers", error)
            from swarm.dht import dht_time

            # Not for ever: a peer whose last heartbeat has expired by now is gone as far as this
            # peer can tell (a monitor whose DHT stopped answering showed them live for good).
            now = dht_time()
            return {i: p for i, p in self._last_fetch.items() if now - p.time <= self.ttl + CLOCK_SLACK}
        from swarm.dht import dht_time
        from swarm.identity import key_hash

        self.failure = None
        peers, writers, now = {}, {}, dht_time()
        for public_key, heartbeat in records.items():
            if self.peer_id_of(public_key) != heartbeat.peer_id:
                if self._forgers.add(public_key, "forged"):  # said once per forging key, not per read
                    logger.warning(
                        "dropping heartbeats that claim peer id %s but are signed by another key (forged)",
                        heartbeat.peer_id,
                    )
                continue
            if heartbeat.peer_id in self.ignored:
                continue
            absurd = implausible(heartbeat, now)
            if absurd is not None:
                self.ignore(heartbeat.peer_id, f"{heartbeat.name} published {absurd}")
                continue
            if heartbeat.stage is Stage.LEAVING and not include_leaving:
                continue
            if now - heartbeat.time > self.ttl + CLOCK_SLACK:
                # A heartbeat outlives its writer only by the expiration it chose: one stored
                # with a year's (by a node without the bounds validator) would be a ghost peer
                # counted for --min-peers, listed in every UI and picked as a witness.
                continue
            peers[heartbeat.peer_id] = heartbeat
            writers[heartbeat.peer_id] = key_hash(public_key)
        self.writers = writers
        self._last_fetch = {k: v for k, v in peers.items() if v.stage is not Stage.LEAVING}
        self._keep_in_touch(peers)
        return peers

    def _keep_in_touch(self, peers: dict[str, PeerHeartbeat]) -> None:
        """Remember where the other peers are; with none left in sight, have the DHT dial them
        again (:func:`swarm.dht.redial`: after a freeze two peers' DHTs forgot each other for
        good). An address is dialed only under its own peer's id, which the connection's
        handshake proves: a heartbeat can make this peer talk to nobody but its writer (at most
        open a TCP connection elsewhere, every ``REDIAL_SECONDS`` while this peer is alone)."""
        others = [p for p in peers.values() if p.peer_id != self.peer_id_here]
        with self._lock:  # fetch() runs in the trainer and in an overlapped round's thread
            for peer in others:
                own = [a for a in peer.addresses if a.endswith(f"/p2p/{peer.peer_id}")]
                if own and peer.stage is not Stage.LEAVING:
                    self._seen[peer.peer_id] = own
                    self._seen.move_to_end(peer.peer_id)
                elif peer.stage is Stage.LEAVING:
                    self._seen.pop(peer.peer_id, None)
            while len(self._seen) > REDIAL_PEERS:
                # Strangers first: keys are free, and 8 fresh ones with addresses (each seen after
                # the honest peers, whose records come first) left a peer alone after a freeze
                # dialing none but them (a review, stop 59). A round mate proved it is a peer.
                oldest = next((p for p in self._seen if p not in self.vouched), next(iter(self._seen)))
                del self._seen[oldest]
            now = time.monotonic()
            if others or not self._seen or self._dht is None or now - self._redialed < REDIAL_SECONDS:
                return
            self._redialed = now
            addresses = [a for peer in reversed(self._seen.values()) for a in peer[:2]]
            logger.debug("no other peer in sight: dialing %d known peers again", len(self._seen))
        redial(self._dht, addresses)

    def peer_id_of(self, public_key: str) -> str | None:
        """The peer id of a heartbeat's signing key (RSA work: the last ``MAX_KEYS`` are cached;
        keys are free, so the cache must not keep every key ever seen)."""
        with self._lock:  # fetch() runs in two threads (an overlapped round's, the trainer's)
            if public_key in self._peer_ids:
                self._peer_ids.move_to_end(public_key)
                return self._peer_ids[public_key]
        from swarm.identity import peer_id_of

        try:
            found = peer_id_of(public_key)
        except (ValueError, TypeError):
            found = None
        with self._lock:
            self._peer_ids[public_key] = found
            while len(self._peer_ids) > MAX_KEYS:
                self._peer_ids.popitem(last=False)
        return found
