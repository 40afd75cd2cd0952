"""What each member of a hivemind group gathers with the others, around the caller's own data:
whether it takes direct rings, its weight, a random nonce for the group's sketch seed (all
gathered over hivemind's encrypted channel) and the ring ids it keeps; and the check of the
user data every member sent (:func:`diverged_from_group`). All of it comes from other machines:
every reader here treats a malformed value as absent."""

from __future__ import annotations

import math
import secrets
from collections.abc import Collection, Sequence
from typing import Any

from optim import robust
from swarm.bounds import whole
from swarm.butterfly import MEAN
from swarm.dataplane import MAX_RINGS, PROTOCOL, RING_ID_BYTES

PLANE, WEIGHT, NONCE, USER, RINGS, BUTTERFLY = "dataplane", "weight", "nonce", "user", "rings", "butterfly"


def own(plane: bool, weight: float, kept: bytes, user: Any) -> dict[str, Any]:
    """What this member gathers: ``plane`` (it takes direct rings), its ``weight``, a fresh
    nonce, the ring ids in ``kept`` (a zero-padded array of them) and the caller's ``user`` data.
    A member that takes direct rings says which version of the plane it speaks: a group takes
    them only if every member speaks this one (older peers said ``True``). It also says that on
    hivemind's path it answers with the mean (:mod:`swarm.butterfly`)."""
    rings = (kept[i : i + RING_ID_BYTES] for i in range(0, len(kept), RING_ID_BYTES))
    return {
        PLANE: PROTOCOL if plane else False,
        WEIGHT: weight,
        NONCE: secrets.token_bytes(16),
        RINGS: [ring for ring in rings if any(ring)],
        BUTTERFLY: MEAN,
        USER: user,
    }


def unwrap(data: Any) -> Any:
    """The caller's own gathered data, as it passed it to the step."""
    return data[USER] if isinstance(data, dict) and USER in data else data


def reported(member: Any) -> dict[str, Any]:
    """A member's gathered data as its round reports it: its caller's info (``{}`` if that is
    not a dict: dropped, such a member once left a pair round with one member to check, and its
    update went through unchecked), with ``weight`` the weight the group's mean counted it by
    (:func:`weight_of`), not the one its info claims: the robust checks then bound the mean the
    group actually took."""
    info = unwrap(member)
    return {**(info if isinstance(info, dict) else {}), "weight": weight_of(member)}


def takes_direct_rings(member: Any) -> bool:
    plane = member.get(PLANE) if isinstance(member, dict) and USER in member else None
    return whole(plane) and plane == PROTOCOL


def all_take_the_mean(members: list[Any]) -> bool:
    """Every member answers with the mean on hivemind's path (:mod:`swarm.butterfly`)."""
    return all(
        isinstance(m, dict) and USER in m and type(m.get(BUTTERFLY)) is int and m[BUTTERFLY] == MEAN
        for m in members
    )


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
    return robust.claim(member.get(WEIGHT)) if isinstance(member, dict) else 0.0


def counted_weights(peer_ids: Sequence[Any], members: list[Any]) -> dict[Any, float]:
    """The weight each member counts for in the group's mean, by peer id (``peer_ids`` and
    ``members`` in the group's order), from the weights they gathered
    (:func:`optim.robust.counted_weights`: a claim above 16x the others' median counts as that);
    every member computes the same."""
    return dict(zip(peer_ids, robust.counted_weights([weight_of(m) for m in members])))


def nonces(members: list[Any]) -> bytes:
    """Every member's nonce, in the group's order (the group's sketch seed after its id)."""
    return b"".join(m[NONCE] for m in members if isinstance(m, dict) and isinstance(m.get(NONCE), bytes))


def mask_scale(members: list[Any], codec: str, *, limit: int) -> float:
    """The factor every member multiplies its kept-masks by before a kept-mean all-reduce
    (``--topk-mean kept``; :func:`optim.contribution.keepers`), the same on every member: the
    power of two nearest the members' lower-median root-mean-square kept value (``norm /
    sqrt(kept)`` from their gathered info; a ``kept`` above ``limit``, the masks' size, is not
    believed). Masks of 1 would be far larger than the updates beside them, and the sum checks'
    tolerance grows with the norm of the whole vector (swarm.sketch): scaled, the masks weigh
    about what the updates do. A power of two is exact on an fp16 wire, between 2^-12 and 2^15
    there (fp16 keeps full precision from 2^-14 and ends at 65504); the lower median of two is
    the smaller, so one member cannot blow the masks up by declaring a tiny ``kept``."""
    rms = []
    for member in members:
        info = unwrap(member)
        if not isinstance(info, dict):
            continue
        norm, kept = info.get("norm"), info.get("kept")
        numbers = isinstance(norm, (int, float)) and whole(kept)
        if numbers and math.isfinite(norm) and norm > 0 and 0 < kept <= limit:
            rms.append(norm / math.sqrt(kept))
    if not rms:
        return 1.0
    rms.sort()
    mantissa, exponent = math.frexp(rms[(len(rms) - 1) // 2])  # exact: x = mantissa * 2^exponent
    nearest = exponent if mantissa >= math.sqrt(0.5) else exponent - 1
    low, high = (-12, 15) if codec == "fp16" else (-60, 60)
    return 2.0 ** min(max(nearest, low), high)


def diverged_from_group(
    mine: dict[str, Any], group: list[dict[str, Any]], *, rel_tol: float = 1e-5, ignored: Collection[str] = ()
) -> str | None:
    """Why this peer's global params before the round differ from the group's, or None.

    Members of one round must start it from the same θ. If this peer was behind (a lower
    outer step) or on another trajectory (e.g. it stepped alone while others averaged), its θ
    is now wrong and it must download the state. Among members at the same step, the
    trajectory held by most members wins; ties go to the lowest peer id.

    A member's outer step is its claim: "behind" takes more than half of the other members
    past this peer's step (one member claiming 1e9 sent every honest member of its groups to
    download the state every round), and ``ignored`` peers (caught lying) count for nothing.
    With one other member its claim is followed, and the download must bear it out
    (:func:`claimed_ahead`, ``SwarmAverager.settle_claims``).
    """
    # Other peers' info is untrusted input: skip members whose info does not parse.
    others = [
        g
        for g in map(_parse_info, group)
        if g is not None and g["peer"] != mine.get("peer") and g["peer"] not in ignored
    ]
    mine = _parse_info(mine) or {"peer": str(mine.get("peer")), "outer_step": -1, "fingerprint": []}
    if not others:
        return None
    past = sorted(g["outer_step"] for g in others if g["outer_step"] > mine["outer_step"])
    if 2 * len(past) > len(others):
        return f"behind the group (outer step {mine['outer_step']} < {past[0]})"
    top = mine["outer_step"]  # a minority past it: they left the group's step, not this peer
    same = [g for g in [mine, *others] if g["outer_step"] == top]

    def rank(member: dict[str, Any]) -> tuple[int, str]:
        agreeing = [g for g in same if _same_fingerprint(member, g, rel_tol)]
        return -len(agreeing), min(g["peer"] for g in agreeing)  # most agreeing first, then lowest id

    best = min(same, key=rank)
    if _same_fingerprint(mine, best, rel_tol):
        return None
    return f"its global params differ from the group's ({-rank(best)[0]} of {len(same)} peers agree on another state)"


def claimed_ahead(mine: dict[str, Any], group: list[dict[str, Any]]) -> dict[str, int]:
    """The other members that said they were past this peer's outer step (peer id -> step):
    what a "behind the group" download must bear out."""
    me = _parse_info(mine)
    if me is None:
        return {}
    return {
        g["peer"]: g["outer_step"]
        for g in map(_parse_info, group)
        if g is not None and g["peer"] != me["peer"] and g["outer_step"] > me["outer_step"]
    }


def holding_the_same_state(
    mine: dict[str, Any], group: list[dict[str, Any]], *, rel_tol: float = 1e-5
) -> set[str]:
    """The other members at this peer's outer step whose θ fingerprint matches this peer's.

    When :func:`diverged_from_group` sends this peer to download the state because most of the
    group holds another θ, these peers hold the losing θ too and must not serve it back: two of
    them downloading from each other swapped the same wrong θ every round, for 20 rounds, to the
    end of a run (the churn soak, 2026-12-03)."""
    me = _parse_info(mine)
    if me is None:
        return set()
    return {g["peer"] for g in _at_my_step(me, group) if _same_fingerprint(me, g, rel_tol)}


def disowned_by_its_donor(
    mine: dict[str, Any],
    group: list[dict[str, Any]],
    last_download: tuple[str, int] | None,
    *,
    rel_tol: float = 1e-5,
) -> set[str]:
    """``{donor}`` if this peer's θ came from ``last_download`` (donor, outer step) at this
    outer step (no round since: θ is what the donor served) and the donor's own fingerprint in
    this round says it holds another θ; else an empty set. This peer then downloads again
    (unless most of the members at its step hold its θ, :func:`held_by_most`: a tie of two
    goes to the lower peer id there, not here), neither taking that donor's state nor counting
    its sketches.

    A donor that served a made-up θ to a joiner nobody could check averages honestly, so its
    fingerprint joins the majority that outvotes the joiner; asked about the joiner's next
    download, it sketches the made-up θ again and contradicts the honest donor, a round mate
    too: a tie, refused, and the joiner took the liar's state again (``make faults``, stop 52).
    The donor's two answers contradict each other. In a pair whose tie of fingerprints went to
    the joiner (the lower peer id), it kept the made-up θ. An honest donor that took another θ
    itself between serving and the round looks the same (the churn soak: the donor on the
    losing side of a split, the joiner on the winning one, where its θ stands); the donor is
    left out of one download (others may serve; if none does, the next round's vote decides)."""
    me = _parse_info(mine)
    if me is None or last_download is None or last_download[1] != me["outer_step"]:
        return set()
    donor = last_download[0]
    theirs = [g for g in _at_my_step(me, group) if g["peer"] == donor]
    disowned = len(theirs) == 1 and not _same_fingerprint(me, theirs[0], rel_tol)
    return {donor} if disowned else set()


def held_by_most(
    mine: dict[str, Any], group: list[dict[str, Any]], *, rel_tol: float = 1e-5, ignored: Collection[str] = ()
) -> bool:
    """More than half of the members at this peer's outer step (itself included; ``ignored``
    peers not counted) hold its θ: the round's vote stands, whatever one member says (a donor
    that disowns the θ it served, :func:`disowned_by_its_donor`, is outvoted there)."""
    me = _parse_info(mine)
    if me is None:
        return False
    same = [g for g in _at_my_step(me, group) if g["peer"] not in ignored]
    return 2 * (1 + sum(_same_fingerprint(me, g, rel_tol) for g in same)) > 1 + len(same)


def _at_my_step(me: dict[str, Any], group: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The other members (parsed; those that do not parse left out) at ``me``'s outer step."""
    return [
        g
        for g in map(_parse_info, group)
        if g is not None and g["peer"] != me["peer"] and g["outer_step"] == me["outer_step"]
    ]


def _same_fingerprint(a: dict[str, Any], b: dict[str, Any], rel_tol: float) -> bool:
    fa, fb = a["fingerprint"], b["fingerprint"]
    return len(fa) == len(fb) and all(
        abs(x - y) <= rel_tol * max(abs(x), abs(y), 1e-12) for x, y in zip(fa, fb)
    )


def _parse_info(info: Any) -> dict[str, Any] | None:
    """A group member's info as {peer: str, outer_step: int, fingerprint: [float]}, or None."""
    if not isinstance(info, dict):
        return None
    step, fingerprint = info.get("outer_step"), info.get("fingerprint") or []
    if not whole(step) or not isinstance(fingerprint, list):
        return None
    if not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in fingerprint
    ):
        return None
    return {"peer": str(info.get("peer")), "outer_step": step, "fingerprint": [float(x) for x in fingerprint]}
