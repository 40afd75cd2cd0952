"""The transport an outer optimizer averages through.

An :class:`Averager` takes this peer's tensors and a weight, and replaces the tensors in place
by the weighted mean over the group of peers it found. Implementations: :class:`LocalAverager`
(a swarm of one, for tests and single-machine runs) and ``swarm.averaging.SwarmAverager``
(hivemind's decentralized all-reduce).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass(kw_only=True)
class RoundReport:
    """What one averaging round did, as seen by this peer."""

    group_size: int
    """Peers whose tensors went into the mean, this one included (1 = averaged alone)."""
    bytes_sent: int = 0
    """Bytes this peer sent during the round (payload, after compression)."""
    bytes_received: int = 0
    """Bytes this peer received during the round (payload, after compression)."""
    payload_bytes: int = 0
    """Bytes of this peer's own contribution as encoded (the per-peer upload of one round,
    independent of the transport; what the optimizer benchmarks compare)."""
    seconds: float = 0.0
    """Wall time of the round, matchmaking included."""
    matchmaking_seconds: float = 0.0
    """Of which: from this peer's request until its group formed (0 when no group formed)."""
    group_info: list[dict[str, Any]] = field(default_factory=list)
    """The ``info`` every group member sent (this peer's included), for consistency checks."""
    error: str | None = None
    """Why the round fell back to a local step, when it did."""
    failed: bool = False
    """The all-reduce was tried with others and failed (not: this peer was alone by choice, no
    other peer in the round): it says nothing of the group the next round finds."""
    local_norm: float = 0.0
    """L2 norm of this peer's own pseudo-gradient before averaging."""
    mean_norm: float = 0.0
    """L2 norm of the averaged pseudo-gradient the outer step applied."""
    stale: bool = False
    """This peer's global state is known to be behind the group's: fetch it before going on."""
    ahead: dict[str, int] = field(default_factory=dict)
    """With :attr:`stale`: the peers whose claim to be past this round made it so (peer id ->
    the outer step claimed). A download that then reaches no such step disproves them."""
    robust_mean: bool = False
    """No bound from the members' declared norms applies to the mean (a trimmed mean; a sparse
    mean over the members that kept each coordinate, checked before it was spread), so the
    misreport check is skipped (NaN and outlier checks stay)."""
    refused: str | None = None
    """Why a check made while the mean was formed refuses it (the round is then refused like
    one the robust check refuses; :func:`optim.contribution.judge`)."""

    applied: bool = True
    """False when this peer left its global params unchanged after a group round (the robust
    check refused the mean, or it held NaN/Inf): :attr:`error` says why, and the optimizer
    logged it as an error (:func:`optim.contribution.judge`)."""

    plane: str = ""
    """The transport that carried the all-reduce (a swarm's "direct" ring or "hivemind"'s path);
    empty when nothing was averaged or the averager has no such choice."""

    missed: bool = False
    """The simulator's dropout: this peer missed the round (it sent nothing, and took the others'
    mean)."""

    pending: bool = False
    """Overlapped rounds: this round's all-reduce still runs in the background (the first
    round's report; each later sync reports the round before it)."""
    info: dict[str, Any] = field(default_factory=dict)
    """What this peer sent with the round: its outer step, θ fingerprint, norm and weight."""

    @property
    def averaged_alone(self) -> bool:
        return self.group_size <= 1


class Averager(Protocol):
    """Replace ``tensors`` in place by their weighted mean over a group of peers. An averager
    whose ``keeps_tensors_on_failure`` is true writes them only once the mean is complete (on
    an error they still hold the caller's values), which spares its caller a backup copy. One
    may also say how many peers it expects in a group (``expected_group() -> int``): eager
    updates stand in for 1/that of a mean before the first one lands (else the whole Δ)."""

    def all_reduce(
        self, tensors: Sequence[torch.Tensor], *, weight: float, info: dict[str, Any] | None = None
    ) -> RoundReport: ...


class LocalAverager:
    """A swarm of one: leaves the tensors as they are. DiLoCo over it is DiLoCo with k=1."""

    keeps_tensors_on_failure = True

    def expected_group(self) -> int:
        return 1

    def all_reduce(
        self, tensors: Sequence[torch.Tensor], *, weight: float, info: dict[str, Any] | None = None
    ) -> RoundReport:
        assert weight >= 0, f"{weight=}"  # 0: a diverged peer's zeros, its own "mean"
        return RoundReport(group_size=1, group_info=[dict(info or {})])
