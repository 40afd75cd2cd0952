"""One peer's contribution to a round (:class:`Outgoing`, what went on the wire and why), a
round averaging in the background (:class:`InFlight`), and the small arithmetic both need."""

from __future__ import annotations

import concurrent.futures
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from optim.averager import RoundReport
from optim.codecs import all_finite
from optim.robust import check_round, claim, counted_weights, is_outlier, misreported, overclaimed

logger = logging.getLogger(__name__)

_TOLD_OVERCLAIMED: set[str] = set()
"""Peers whose claimed weight this process has warned of (optim.robust.overclaimed)."""


@dataclass
class Outgoing:
    """One round's contribution; ``deltas`` hold the group's mean once averaged."""

    deltas: list[torch.Tensor]
    info: dict[str, Any]
    weight: float
    local_norm: float
    payload_bytes: int
    diverged: bool
    outer_step: int
    sent: list[torch.Tensor] | None = None
    """With error feedback: a copy of what went out (the all-reduce overwrites ``deltas``), to
    take back into the residual if the group does not apply it (:func:`not_applied`)."""


@dataclass
class InFlight:
    outgoing: Outgoing
    future: concurrent.futures.Future


def own_share(report: RoundReport, weight: float) -> float:
    """This peer's share of a round's weighted mean: its counted weight over the group's (1 alone).
    In a round it missed (the simulator's dropout) the group's info holds only the others: its
    share is what it would have been among them."""
    if report.group_size <= 1 and not report.missed:
        return 1.0
    claims = [claim(i.get("weight")) for i in report.group_info if isinstance(i, dict)]
    if weight in claims and not report.missed:  # this peer's own entry: the others are the rest
        claims.remove(weight)
    counted = counted_weights([*claims, weight])  # what the group counted (optim.robust)
    total = sum(counted)
    return min(1.0, counted[-1] / total) if total > 0 else 1.0


def global_norm(tensors: list[torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors])))


def judge(outgoing: Outgoing, report: RoundReport, outlier_ratio: float) -> str | None:
    """Fill in the report once ``outgoing.deltas`` hold the mean; why the mean must not be
    applied (refused by the robust check, NaN/Inf), or None."""
    report.info = outgoing.info
    if outgoing.diverged:
        report.error = (
            "this peer's pseudo-gradient held NaN/Inf: not sent; it took the group's update "
            "(lower the inner learning rate)"
        )
    report.local_norm, report.mean_norm = outgoing.local_norm, global_norm(outgoing.deltas)
    report.payload_bytes = outgoing.payload_bytes
    for peer, line in overclaimed(report.group_info).items() if report.group_size > 1 else ():
        # Once per peer at warning level: a peer far faster than the others does it every round.
        told = peer in _TOLD_OVERCLAIMED or len(_TOLD_OVERCLAIMED) >= 1024
        _TOLD_OVERCLAIMED.add(peer)
        logger.log(logging.DEBUG if told else logging.WARNING, "round %d: %s", outgoing.outer_step, line)
    refused = report.refused or check_round(
        report.mean_norm,
        report.group_info,
        ratio=outlier_ratio,
        trimmed=report.robust_mean,
    )
    if refused and report.group_size > 1:
        why = f"round {outgoing.outer_step}: {refused}; the global params were left unchanged"
    elif not math.isfinite(report.mean_norm) and not all_finite(outgoing.deltas):  # finite norm: all finite
        why = (
            f"round {outgoing.outer_step}: the averaged update holds NaN/Inf; the global params "
            f"were left unchanged ({_nan_senders(report.group_info)})"
        )
    else:
        return None
    report.error, report.applied = why, False
    return why


def take_back_unapplied(feedback: Any, outgoing: Outgoing, report: RoundReport, outlier_ratio: float) -> None:
    """Error feedback (``feedback``, an :class:`optim.codecs.ErrorFeedback` or None) keeps what
    this peer sent when the group's θ will not hold it (:func:`not_applied`): "compression
    delays coordinates, it never loses them" held only for rounds that were applied."""
    if feedback is not None and outgoing.sent is not None and not_applied(outgoing, report, outlier_ratio):
        feedback.take_back(outgoing.sent)


def not_applied(outgoing: Outgoing, report: RoundReport, outlier_ratio: float) -> bool:
    """Whether this peer's update went out and the group's θ will not hold it: the round was
    refused for another member's update (an outlier, a misreport, NaN) or this peer was left
    out of the mean (``missed``). Not when this peer's own update was the outlier: sent again,
    it would be refused again. (An all-reduce that failed lands this peer's own update.)"""
    if outgoing.diverged:
        return False
    if report.missed:
        return True
    if report.applied or report.group_size <= 1:
        return False
    return not is_outlier(float(outgoing.info.get("norm", 0.0)), report.group_info, ratio=outlier_ratio)


def _nan_senders(group_info: list[Any]) -> str:
    """Who sent the NaN/Inf, as far as the members' declared norms tell (a declared norm is a
    claim: a faulty member may declare a finite one; this peer's own is always finite, zeros
    when it diverged)."""
    named = [
        str(info.get("name") or str(info.get("peer", "?"))[-12:])
        for info in group_info
        if isinstance(info, dict)
        and not (isinstance(info.get("norm"), (int, float)) and math.isfinite(info["norm"]))
    ]
    if named:
        return f"sent by {', '.join(named)}, whose declared norm is not finite: a peer that diverged or is faulty"
    return (
        "a member sent NaN/Inf under a finite declared norm: a faulty peer; this peer's own update was finite"
    )


def keepers(deltas: list[torch.Tensor]) -> list[torch.Tensor]:
    """1 where this peer's compressed Δ kept a coordinate (nonzero), else 0. Averaged alongside
    the Δ with the same weights, each becomes the share of the group's weight that kept it."""
    return [(d != 0).to(torch.float32) for d in deltas]


@torch.no_grad()
def spread_over_keepers(
    deltas: list[torch.Tensor], shares: list[torch.Tensor], report: RoundReport, *, check: bool = True
) -> None:
    """Turn the group's weighted mean (in ``deltas``) into, per coordinate, the weighted mean over
    the members that kept it (SparseLoCo's reference rule): divide by the share of the group's
    weight that kept it (``shares``: the averaged :func:`keepers`), and by no less than half the
    smallest member's share (a coordinate nobody kept is 0 either way; a continuous rule, so
    that members whose copies of the result differ by rounding divide alike).

    The misreport check bounds the group's mean, not this one (with members keeping different
    coordinates it is larger by design), so it runs here first, on the group's mean. The kept
    mean has its own bound: each coordinate lies between its keepers' values, so its norm is at
    most ``sqrt(Σ |Δ_i|²)`` over the declared norms; a member whose mask lies (a negative or
    fractional share, to scale up the others' values) by more than that allows fails it, and a
    smaller lie is bounded by it. Either failure leaves the group's mean and sets
    ``report.refused``: :func:`judge` refuses the round (``check=False``, with the robust checks
    turned off: neither runs)."""
    if report.group_size <= 1:
        floor = 0.5
    else:
        members = [i for i in report.group_info if isinstance(i, dict) and _positive(i.get("weight"))]
        weights = counted_weights([i["weight"] for i in members])
        floor = 0.5 * min(weights) / sum(weights) if weights else 0.5
        if check and not report.robust_mean:
            report.refused = misreported(global_norm(deltas), report.group_info)
            if report.refused:
                return
    spread = [d / share.clamp(min=floor) for d, share in zip(deltas, shares)]
    if check and report.group_size > 1:
        norms = [float(i["norm"]) for i in members if _positive(i.get("norm")) or i.get("norm") == 0]
        bound = math.sqrt(sum(n * n for n in norms)) * 1.05 + 1e-6
        if len(norms) < len(members) or global_norm(spread) > bound:
            report.refused = (
                f"the mean over the members that kept each coordinate has norm {global_norm(spread):.3g}, "
                f"more than their reported norms allow ({bound:.3g}): a member's kept-mask is not 0/1"
            )
            return
    for d, s in zip(deltas, spread):
        d.copy_(s)
    report.robust_mean = True  # checked above, on the group's mean


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
