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

The mean cannot be repaired after the fact (nobody holds the other members' updates), so an
offending round is excluded as a whole; a peer can also clip its own update before sending
(``DiLoCoConfig.clip_norm``).
"""

from __future__ import annotations

import math
import statistics
from typing import Any


def _members(group_info: list[Any]) -> list[tuple[str, float, float]]:
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
    return members


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
