"""One peer's contribution to a round (:class:`Outgoing`, what went on the wire and why), a
round averaging in the background (:class:`InFlight`), and the small arithmetic both need."""

from __future__ import annotations

import concurrent.futures
import math
from dataclasses import dataclass
from typing import Any

import torch

from optim.averager import RoundReport
from optim.robust import check_round


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


@dataclass
class InFlight:
    outgoing: Outgoing
    future: concurrent.futures.Future


def own_share(report: RoundReport, weight: float) -> float:
    """This peer's share of a round's weighted mean: its weight over the group's (1 alone)."""
    if report.group_size <= 1:
        return 1.0
    weights = [i.get("weight") for i in report.group_info if isinstance(i, dict)]
    total = sum(float(w) for w in weights if isinstance(w, (int, float)) and math.isfinite(w) and w > 0)
    return min(1.0, weight / total) if total > 0 else 1.0


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
    refused = check_round(
        report.mean_norm,
        report.group_info,
        ratio=outlier_ratio,
        misreport=not report.robust_mean,
    )
    if refused and report.group_size > 1:
        why = f"round {outgoing.outer_step}: {refused}; the global params were left unchanged"
    elif not all(torch.isfinite(d).all() for d in outgoing.deltas):
        why = (
            f"round {outgoing.outer_step}: the averaged update holds NaN/Inf; the global params "
            "were left unchanged (a peer diverged: lower the inner learning rate)"
        )
    else:
        return None
    report.error = why
    return why
