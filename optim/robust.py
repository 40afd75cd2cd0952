"""Robust aggregation checks: refuse a round's mean when one member's update is an outlier.

An all-reduce hands every member the same weighted mean, and the members' reported
(norm, weight) travel with it (the averager's gathered info). So every member can run the same
deterministic check on the same numbers and reach the same verdict: the whole group keeps θ
unchanged for that round, and nobody's θ drifts or becomes NaN.

Two rules:

- **outlier**: a member whose update norm is more than ``ratio`` times the median of the other
  members' norms (a diverging or malicious peer), times how many more samples than theirs it
  declares, if more: with time-boxed rounds a fast peer trains several times the steps of a
  slow one and its pseudo-gradient grows with them (21x for 20x the steps, measured);
- **misreport**: the mean's norm is larger than the reported norms allow (by the triangle
  inequality ``|Σ wᵢΔᵢ / Σ wᵢ| ≤ Σ wᵢ|Δᵢ| / Σ wᵢ``): a member sent more than it declared.

Both read the weights the group counts (:func:`counted_weights`), not the weights claimed: a
weight is a number of samples trained, which nobody else can check, and one member claiming 1e9
would otherwise take the whole mean and a norm allowance to match.

The mean cannot be repaired after the fact (nobody holds the other members' updates), so an
offending round is excluded as a whole; a peer can also clip its own update before sending
(``DiLoCoConfig.clip_norm``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

WEIGHT_RATIO = 16.0
"""A member counts for at most this many times the median of the other members' weights. Part
of the averaging protocol: every member of a group must count alike (the direct plane scales
each contribution by its counted share, and the checks read the same numbers), so it is not a
setting. 16 leaves honest speed differences alone up to 16x (a time-boxed round weighs a peer's
update by the samples it trained); a faster peer still leads the mean, by 16 to 1."""


def claim(weight: Any) -> float:
    """A weight as a member declared it: anything but a finite number >= 0 counts as 0."""
    if not isinstance(weight, (int, float)) or isinstance(weight, bool):
        return 0.0
    return float(weight) if math.isfinite(weight) and weight >= 0 else 0.0


def counted_weight(weight: float, others: Sequence[float]) -> float:
    """What a member claiming ``weight`` counts for among ``others`` (the other members' claims):
    at most :data:`WEIGHT_RATIO` times the median of their positive claims (none: as claimed)."""
    positive = [w for w in others if w > 0]
    return min(weight, WEIGHT_RATIO * statistics.median(positive)) if positive else weight


def counted_weights(claims: Sequence[Any]) -> list[float]:
    """The weight each member counts for, from every member's claim (:func:`claim`,
    :func:`counted_weight`). The same numbers in any order give the same weights, so every
    member of a group counts alike."""
    weights = [claim(w) for w in claims]
    return [counted_weight(w, weights[:i] + weights[i + 1 :]) for i, w in enumerate(weights)]


def overclaimed(group_info: list[Any]) -> dict[str, str]:
    """Each member whose claimed weight counted for less, by peer: what it claimed and what it
    counted for. For the peer's log, so that a liar, or a peer far faster than the others, is
    seen."""
    infos = [i for i in group_info if isinstance(i, dict)]
    claims = [claim(i.get("weight")) for i in infos]
    return {
        str(info.get("peer", "?")): f"peer {str(info.get('peer', '?'))[-12:]} claimed {w:.4g} samples, "
        f"counted as {c:.4g} ({WEIGHT_RATIO:g}x the others' median)"
        for info, w, c in zip(infos, claims, counted_weights(claims))
        if c < w
    }


def _members(group_info: list[Any]) -> list[tuple[str, float, float]]:
    """(peer, norm, counted weight) of every member whose declared norm and weight parse."""
    members = []
    for info in group_info:
        if not isinstance(info, dict):
            continue
        norm, weight = info.get("norm"), info.get("weight")
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (norm, weight)):
            continue
        if not (math.isfinite(norm) and math.isfinite(weight)) or norm < 0 or weight < 0:
            continue
        members.append((str(info.get("peer", "?")), float(norm), float(weight)))
    counted = counted_weights([w for _, _, w in members])
    return [(peer, norm, w) for (peer, norm, _), w in zip(members, counted)]


def check_round(
    mean_norm: float, group_info: list[Any], *, ratio: float, misreport: bool = True
) -> str | None:
    """Why the group's mean must be refused this round, or None to apply it (``misreport``:
    also check the mean against the declared norms; off for a trimmed mean, which they do not
    bound)."""
    members = [m for m in _members(group_info) if m[2] > 0]
    if ratio <= 0 or len(members) < 2:
        return None
    for peer, norm, weight in members:
        median = statistics.median(n for p, n, _ in members if p != peer)
        more = max(1.0, weight / statistics.median(w for p, _, w in members if p != peer))
        if norm > ratio * more * max(median, 1e-12):
            allowed = f"{ratio:g}x" if more == 1 else f"{ratio * more:.3g}x for {more:.3g}x their samples"
            return (
                f"peer {peer[-12:]} sent an update of norm {norm:.3g}, {norm / max(median, 1e-12):.0f}x the "
                f"median of the others ({median:.3g}; limit {allowed}): the round's mean was refused"
            )
    return misreported(mean_norm, group_info) if misreport else None


def misreported(mean_norm: float, group_info: list[Any]) -> str | None:
    """Why the weighted mean's norm is more than the members' declared (norm, weight) allow, or
    None (fewer than two members with a weight: nothing to check)."""
    members = [m for m in _members(group_info) if m[2] > 0]
    if len(members) < 2:
        return None
    total = sum(w for _, _, w in members)
    bound = sum(w * n for _, n, w in members) / total
    # 5% slack: a lossy wire codec (hivemind's int8) may grow the mean's norm a little.
    if mean_norm > bound * 1.05 + 1e-6:
        return (
            f"the group's mean has norm {mean_norm:.3g}, more than the members' reported norms allow "
            f"({bound:.3g}): a member sent more than it declared; the round's mean was refused"
        )
    return None
