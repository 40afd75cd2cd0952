"""Matchmaking declarations that only their writer can make or withdraw (imports hivemind).

hivemind's matchmaking declares each averager looking for a group under its bare peer id (a
subkey of ``<prefix>.0b<bits>``): anybody's to write. An outsider with a stock hivemind node
stored "not looking" under every live peer's id, expiring in a year, and left: DHT nodes keep
the value that expires last, so every peer's own declaration was refused and no peer ever
found another (every round alone, for good). A run's peers declare under their ``[owner:...]``
key instead (hivemind's signature validator then checks the writer), and a run's validators
refuse any other subkey there (:class:`swarm.validators.RecordBoundsValidator`), as for the
donors' declarations.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.p2p import PeerID

from swarm.hivemind_fixes import _paced_leader_search
from swarm.identity import peer_id_of
from swarm.store import subkey_public_key


@functools.lru_cache(maxsize=4096)
def _peer_of_key(public_key: str) -> PeerID:
    return PeerID.from_base58(peer_id_of(public_key))


def peer_of(subkey: Any) -> PeerID | None:
    """The peer an ``[owner:...]`` subkey names (the peer id of its key; the signature proves
    that peer wrote the record), None for anything else."""
    public_key = subkey_public_key(subkey)
    if public_key is None:
        return None
    try:
        return _peer_of_key(public_key)
    except Exception:  # noqa: BLE001 - a made-up key is just skipped
        return None


class SignedGroupKeys(GroupKeyManager):
    """hivemind's group key manager, declaring under this peer's ``[owner:...]`` key
    (``subkey``) and reading back only such declarations. Made from hivemind's own instance in
    the averager process (:meth:`install`)."""

    subkey: bytes
    allowed: set[PeerID] | None
    """The peers this one may follow this step (None: any): the peers of the run whose
    heartbeats it read (:meth:`swarm.averaging.SwarmAverager.round_peers`). A fresh key that
    declared itself a leader every 0.1 s, just ahead of everyone, accepted every follower and
    never began an all-reduce: every round of a pair ended alone (a red-team review)."""

    @classmethod
    def install(cls, manager: GroupKeyManager, subkey: bytes) -> None:
        manager.__class__ = cls
        manager.subkey = subkey
        manager.allowed = None

    async def declare_averager(
        self, group_key: str, peer_id: PeerID, expiration_time: float, looking_for_group: bool = True
    ) -> bool:
        if not looking_for_group:  # a withdrawal outlives the declaration (as hivemind's does)
            expiration_time = math.nextafter(expiration_time, math.inf)
        return await self.dht.store(
            key=group_key,
            subkey=self.subkey,
            value=looking_for_group,
            expiration_time=expiration_time,
            return_future=True,
        )

    async def _signed_averagers(self, group_key: str, only_active: bool) -> list[tuple[PeerID, float]]:
        found = await self.dht.get(group_key, latest=True, return_future=True)
        if found is None or not isinstance(found.value, dict):
            return []
        averagers = []
        for subkey, entry in found.value.items():
            peer = peer_of(subkey)
            looking = getattr(entry, "value", None)
            if peer is None or not isinstance(looking, bool) or (only_active and not looking):
                continue
            if self.allowed is not None and peer not in self.allowed:
                continue
            averagers.append((peer, entry.expiration_time))
        return averagers

    get_averagers = _paced_leader_search(_signed_averagers)
