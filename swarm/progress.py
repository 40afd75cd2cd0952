"""The progress board: every peer's heartbeat under one DHT key of the run.

Each peer stores a :class:`~swarm.records.PeerHeartbeat` under ``<run>_peers`` with its peer
id as subkey and a short expiration, so a crashed peer vanishes from the board after ``ttl``
seconds. Readers validate every entry and drop what does not parse.
"""

from __future__ import annotations

import logging
import time

from pydantic import ValidationError

from swarm.dht import wait_for
from swarm.errors import SwarmError
from swarm.records import PeerHeartbeat, Stage

logger = logging.getLogger(__name__)


class ProgressBoard:
    """Publish this peer's heartbeat and read everybody's (call from one thread)."""

    def __init__(self, dht, run_id: str, *, ttl: float = 10.0, period: float = 1.0) -> None:
        self.dht = dht
        self.key = f"{run_id}_peers"
        self.ttl = ttl
        self.period = period
        self._last_publish = 0.0
        self._last_fetch: dict[str, PeerHeartbeat] = {}
        self.timeout = 5.0

    def publish(self, heartbeat: PeerHeartbeat, *, force: bool = False) -> None:
        """Store the heartbeat; at most once per ``period`` unless ``force`` (a stage change)."""
        now = time.monotonic()
        if not force and now - self._last_publish < self.period:
            return
        self._last_publish = now
        from hivemind.utils import get_dht_time

        # Same TTL for "leaving": hivemind keeps a subkey's value with the later expiration, so a
        # shorter one would be ignored and the peer would look alive until its last beat expired.
        ttl = self.ttl
        self.dht.store(
            self.key,
            subkey=heartbeat.peer_id,
            value=heartbeat.model_dump(mode="json"),
            expiration_time=get_dht_time() + ttl,
            return_future=True,  # fire and forget: never block a training step on the DHT
        )

    def publish_now(self, heartbeat: PeerHeartbeat, timeout: float = 3.0) -> None:
        """Store and wait until stored (used for the last word: leaving)."""
        from hivemind.utils import get_dht_time

        future = self.dht.store(
            self.key,
            subkey=heartbeat.peer_id,
            value=heartbeat.model_dump(mode="json"),
            expiration_time=get_dht_time() + self.ttl,
            return_future=True,
        )
        if not wait_for(future, timeout, "the leaving heartbeat"):
            logger.debug("the DHT kept an older heartbeat over this one")

    def fetch(self, *, include_leaving: bool = False) -> dict[str, PeerHeartbeat]:
        """Live peers by peer id (this one included once it has published)."""
        try:
            found = wait_for(
                self.dht.get(self.key, latest=True, return_future=True), self.timeout, "a heartbeat query"
            )
        except SwarmError as error:
            logger.warning("%s; using the last known peers", error)
            return dict(self._last_fetch)
        peers = self._read(found, include_leaving)
        self._last_fetch = peers
        return peers

    def _read(self, found, include_leaving: bool) -> dict[str, PeerHeartbeat]:
        if found is None or not isinstance(found.value, dict):
            return {}
        peers = {}
        for subkey, entry in found.value.items():
            try:
                heartbeat = PeerHeartbeat.model_validate(entry.value)
            except (ValidationError, AttributeError, TypeError) as error:
                logger.debug("dropping a malformed heartbeat under %r: %s", subkey, error)
                continue
            if heartbeat.peer_id != subkey:
                logger.debug(
                    "dropping a heartbeat whose peer id %r differs from its subkey", heartbeat.peer_id
                )
                continue
            if heartbeat.stage is Stage.LEAVING and not include_leaving:
                continue
            peers[subkey] = heartbeat
        return peers
