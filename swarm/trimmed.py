"""A coordinate-wise trimmed mean inside hivemind's all-reduce (``--aggregate trimmed-mean``).

In hivemind's butterfly all-reduce each member reduces one slice of the vector and receives
every member's part of that slice, so the reducer can drop, per coordinate, the ``k`` largest
and ``k`` smallest values before averaging (k = 1, or fewer so that one value is left). A single
peer that sends NaN or a huge update then moves no coordinate of the mean. The mean is
unweighted (every member counts the same), as trimmed means usually are; a member that sends
with weight 0 (a peer whose update diverged sends zeros so that the all-reduce still finds it)
casts no vote: its zeros would otherwise pull every coordinate toward 0.

Only hivemind's plane can do this: the direct plane's gloo ring only sums. It is installed in
hivemind's averager process (see ``GroupAverager.run`` in swarm.group_averager).
"""

from __future__ import annotations

import torch
from hivemind.averaging.partition import TensorPartReducer


class _TrimmedParts:
    """Stands in for the reducer's accumulator: collects the parts, then trims and averages."""

    def __init__(self, trim: int) -> None:
        self.trim = trim
        self.parts: list[torch.Tensor] = []
        self.shape: torch.Size | None = None

    def add_(self, tensor: torch.Tensor, alpha: float = 1.0) -> _TrimmedParts:
        self.shape = tensor.shape
        if alpha > 0:  # weight 0: the member sent nothing to count (see the module's docstring)
            self.parts.append(tensor.detach().float().clone())
        return self

    def div_(self, denominator: float) -> torch.Tensor:
        if not self.parts:  # every member sent with weight 0: nothing to average
            return torch.zeros(self.shape if self.shape is not None else (0,))
        return trimmed_mean(self.parts, self.trim)


def trimmed_mean(parts: list[torch.Tensor], trim: int = 1) -> torch.Tensor:
    """Per coordinate: sort the members' values (NaN last), drop ``trim`` from each end (fewer if
    that would leave nothing), average the rest."""
    stacked = torch.stack(parts)
    count = len(parts)
    k = max(0, min(trim, (count - 1) // 2))
    # NaN sorts last, so it is among the values dropped at the top whenever k >= 1 (and stays
    # NaN or inf when k = 0, for the NaN check; nan_to_num's default made +inf float32's max).
    inf = float("inf")
    ordered = torch.sort(torch.nan_to_num(stacked, nan=inf, posinf=inf, neginf=-inf), dim=0).values
    kept = ordered[k : count - k]
    return kept.mean(dim=0)


class TrimmedPartReducer(TensorPartReducer):
    trim = 1

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = _TrimmedParts(self.trim)


def install() -> None:
    """Make hivemind's all-reduce in this process use the trimmed mean."""
    import hivemind.averaging.allreduce as allreduce

    allreduce.TensorPartReducer = TrimmedPartReducer
