"""The peer-to-peer layer on hivemind: addresses, DHT, records, progress and averaging.

Heavy modules (``swarm.averaging`` imports hivemind) are imported where they are used, so
`workbench --help` stays fast.
"""

from __future__ import annotations

from swarm.addresses import AddressError, parse_peer_address, parse_peer_addresses
from swarm.errors import SwarmError
from swarm.records import PeerHeartbeat, Stage

__all__ = [
    "AddressError",
    "PeerHeartbeat",
    "SwarmError",
    "Stage",
    "parse_peer_address",
    "parse_peer_addresses",
]
