"""What each member of a hivemind group gathers with the others, around the caller's own data:
whether it takes direct rings, its weight, a random nonce for the group's sketch seed (all
gathered over hivemind's encrypted channel) and the ring ids it keeps. All of it comes from
other machines: every reader here treats a malformed value as absent."""

from __future__ import annotations

import math
import secrets
from typing import Any

from swarm.dataplane import MAX_RINGS, RING_ID_BYTES

PLANE, WEIGHT, NONCE, USER, RINGS = "dataplane", "weight", "nonce", "user", "rings"


def own(plane: bool, weight: float, kept: bytes, user: Any) -> dict[str, Any]:
    """What this member gathers: ``plane`` (it takes direct rings), its ``weight``, a fresh
    nonce, the ring ids in ``kept`` (a zero-padded array of them) and the caller's ``user`` data."""
    rings = (kept[i : i + RING_ID_BYTES] for i in range(0, len(kept), RING_ID_BYTES))
    return {
        PLANE: plane,
        WEIGHT: weight,
        NONCE: secrets.token_bytes(16),
        RINGS: [ring for ring in rings if any(ring)],
        USER: user,
    }


def unwrap(data: Any) -> Any:
    """The caller's own gathered data, as it passed it to the step."""
    return data[USER] if isinstance(data, dict) and USER in data else data


def takes_direct_rings(member: Any) -> bool:
    return isinstance(member, dict) and USER in member and member.get(PLANE) is True


def held_by_all(members: list[Any]) -> frozenset[bytes]:
    """The ring ids every member says it keeps (a malformed list counts as none kept)."""
    held = None
    for member in members:
        rings = member.get(RINGS) if isinstance(member, dict) else None
        if not isinstance(rings, list) or len(rings) > MAX_RINGS:
            return frozenset()
        ids = {r for r in rings if isinstance(r, bytes) and len(r) == RING_ID_BYTES}
        held = ids if held is None else held & ids
    return frozenset(held or ())


def weight_of(member: Any) -> float:
    """A member's gathered weight; anything but a finite number >= 0 counts as 0."""
    try:
        weight = float(member.get(WEIGHT, 0.0))
    except (TypeError, ValueError, AttributeError):
        return 0.0
    return weight if math.isfinite(weight) and weight >= 0 else 0.0


def nonces(members: list[Any]) -> bytes:
    """Every member's nonce, in the group's order (the group's sketch seed after its id)."""
    return b"".join(m[NONCE] for m in members if isinstance(m, dict) and isinstance(m.get(NONCE), bytes))
