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


def _norm(value: Any) -> float | None:
    """A declared update norm: a finite number >= 0, else None."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def _members(group_info: list[Any]) -> list[tuple[str, float | None, float]]:
    """(peer, declared norm or None, counted weight) of every member, in the group's order."""
    infos = [i for i in group_info if isinstance(i, dict)]
    counted = counted_weights([i.get("weight") for i in infos])
    return [(str(i.get("peer", "?")), _norm(i.get("norm")), w) for i, w in zip(infos, counted)]


def _unchecked(members: list[tuple[str, float | None, float]]) -> str | None:
    """Why the round cannot be checked: a member that counts in the mean declared no norm to
    check its update against (a diverged peer declares a weight of 0 and sends nothing)."""
    for peer, norm, weight in members:
        if weight > 0 and norm is None:
            return (
                f"peer {peer[-12:]} counts for {weight:.4g} samples but declared no valid update norm, "
                "so its update cannot be checked: the round's mean was refused"
            )
    return None


def check_round(
    mean_norm: float, group_info: list[Any], *, ratio: float, misreport: bool = True, trimmed: bool = False
) -> str | None:
    """Why the group's mean must be refused this round, or None to apply it (``misreport``:
    also check the mean against the declared norms; ``trimmed``: the mean is a trimmed mean,
    or another rule whose every coordinate lies between the members' values, bounded by the
    root of their squared norms instead of their weighted mean)."""
    members = _members(group_info)
    if ratio <= 0 or len(members) < 2:
        return None
    why = _unchecked(members)
    if why:
        return why
    counted = [(peer, norm, weight) for peer, norm, weight in members if weight > 0]
    for index, (peer, norm, weight) in enumerate(counted):
        others = counted[:index] + counted[index + 1 :]  # by place: two members may claim one id
        if not others:
            break
        why = _too_large(norm, weight, [(n, w) for _, n, w in others], ratio)
        if why:
            return f"peer {peer[-12:]} sent an update of norm {norm:.3g}, {why}: the round's mean was refused"
    return misreported(mean_norm, group_info, trimmed=trimmed) if misreport else None


def _too_large(norm: float, weight: float, others: list[tuple[float, float]], ratio: float) -> str | None:
    """How far ``norm`` (of a member counting for ``weight``) is beyond the outlier rule's limit
    among ``others`` (their declared norms and counted weights), or None within it."""
    median = statistics.median(n for n, _ in others)
    more = max(1.0, weight / statistics.median(w for _, w in others))
    if norm <= ratio * more * max(median, 1e-12):
        return None
    allowed = f"{ratio:g}x" if more == 1 else f"{ratio * more:.3g}x for {more:.3g}x their samples"
    return f"{norm / max(median, 1e-12):.0f}x the median of the others ({median:.3g}; limit {allowed})"


def is_outlier(norm: float, group_info: list[Any], *, ratio: float) -> bool:
    """Whether the member that declared ``norm`` (this peer: its entry is the first with that
    norm) is beyond the outlier rule's limit among the others: a refused round was then refused
    for its own update, which must not go out again (error feedback keeps what was not applied)."""
    if ratio <= 0:
        return False
    counted = [(n, w) for _, n, w in _members(group_info) if w > 0 and n is not None]
    mine = next((i for i, (n, _) in enumerate(counted) if n == norm), None)
    if mine is None or len(counted) < 2:
        return False
    return _too_large(norm, counted[mine][1], counted[:mine] + counted[mine + 1 :], ratio) is not None


def misreported(mean_norm: float, group_info: list[Any], *, trimmed: bool = False) -> str | None:
    """Why the weighted mean's norm is more than the members' declared (norm, weight) allow, or
    None (a peer alone, or no member with a weight: nothing to check). Run with one counted
    member too: the others, declaring a weight of 0, must have sent nothing, and a member that
    declared 0 (or a weight that does not parse) but sent an update is caught here.

    ``trimmed``: a coordinate-wise trimmed mean lies, per coordinate, between the values it
    kept, so its norm is at most ``sqrt(Σ |Δ_i|²)`` over the counted members. A trimmed mean
    trims nothing in a pair (it needs 3 votes to drop one value from each end): without this
    bound a pair mate that declared an ordinary norm and sent 1e30 had it averaged in."""
    members = _members(group_info)
    if len(members) < 2:
        return None
    why = _unchecked(members)
    if why:
        return why
    counted = [(norm, weight) for _, norm, weight in members if weight > 0]
    total = sum(w for _, w in counted)
    if not total > 0:
        return None  # every member declared 0: nothing was to be averaged (NaN is caught apart)
    if trimmed:
        bound = math.sqrt(sum(n * n for n, _ in counted))
    else:
        bound = sum(w * n for n, w in counted) / total
    # 5% slack: a lossy wire codec (hivemind's int8) may grow the mean's norm a little.
    if mean_norm > bound * 1.05 + 1e-6:
        return (
            f"the group's mean has norm {mean_norm:.3g}, more than the members' reported norms allow "
            f"({bound:.3g}): a member sent more than it declared; the round's mean was refused"
        )
    return None
