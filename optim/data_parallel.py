"""Synchronous data-parallel training: the reference every low-communication method is
measured against. Gradients are averaged across peers before every inner step, so all peers
take the same optimizer step and hold the same parameters.

Hook it between ``backward()`` and ``inner_optimizer.step()``::

    loss.backward()
    dp.before_inner_step(samples=len(x))   # all-reduce of gradients (weighted by samples)
    inner_optimizer.step(); inner_optimizer.zero_grad()
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from optim.averager import Averager, RoundReport
from optim.codecs import all_finite
from optim.contribution import global_norm
from optim.robust import check_round

if TYPE_CHECKING:
    from optim.diloco import DiLoCoConfig


T = TypeVar("T")


class DataParallel:
    """All-reduce gradients every step through an :class:`~optim.averager.Averager`.
    ``clip_norm`` (``--clip-norm``): this peer's gradient is scaled down to at most that norm
    before it is averaged, as DiLoCo clips a peer's own Δ (``--grad-clip`` clips the averaged
    gradient, as torch's ``clip_grad_norm_`` does after the all-reduce)."""

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        averager: Averager,
        *,
        clip_norm: float = 0.0,
        outlier_ratio: float = 0.0,
    ) -> None:
        if not (clip_norm >= 0 and math.isfinite(clip_norm)):
            raise ValueError(f"clip_norm must be a finite number >= 0 (0: off), got {clip_norm}")
        self.outlier_ratio = outlier_ratio
        """The robust check of DiLoCo's rounds on each step's gradients (0: off): a member's
        gradient far beyond the others' (1000x, the lab's oversize fault) was averaged in."""
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.averager = averager
        self.clip_norm = clip_norm
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.outer_step_count = 0
        """Completed all-reduces (one per inner step)."""

    def before_inner_step(self, *, samples: int, info: dict[str, Any] | None = None) -> RoundReport:
        start = time.monotonic()
        grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().to("cpu", torch.float32)
            for p in self.params
        ]
        if self.clip_norm:
            norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
            if norm > self.clip_norm:  # (a NaN norm is not: the NaN check below catches it)
                grads = [g * (self.clip_norm / norm) for g in grads]
        own_finite = all_finite(grads)
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        info = dict(info or {}, norm=norm if math.isfinite(norm) else None)  # checked by the others
        report = self.averager.all_reduce(grads, weight=float(samples), info=info)
        # Sent whatever the group makes of it (a skipped step's bytes went over the wire too,
        # as DiLoCo's refused rounds count theirs; a review, stop 72).
        report.payload_bytes = sum(g.numel() * 4 for g in grads)
        if not all_finite(grads):
            if not own_finite or report.group_size <= 1:  # this peer's own gradient: it diverged
                raise FloatingPointError("the averaged gradient holds NaN/Inf: lower the learning rate")
            # Another member's (a faulty peer): every member holds the same mean, so every one
            # skips this step alike, and none stops (each did, blaming its learning rate).
            for p in self.params:
                p.grad = None
            report.error = "a member's gradient held NaN/Inf: every member skipped this step"
            report.seconds = time.monotonic() - start
            self.outer_step_count += 1
            return report
        refused = (
            # (A trimmed mean is bounded by the members' norms, not their weighted mean: without
            # ``trimmed`` honest steps were refused, a review, stop 72.)
            check_round(
                global_norm(grads), report.group_info, ratio=self.outlier_ratio, trimmed=report.robust_mean
            )
            if report.group_size > 1
            else None
        )
        if refused:  # every member holds the same mean and the same infos: all skip it alike
            for p in self.params:
                p.grad = None
            report.error = f"{refused}; every member skipped this step"
            report.seconds = time.monotonic() - start
            self.outer_step_count += 1
            return report
        for p, g in zip(self.params, grads):
            if not bool(g.any()):
                # Unused by every member (or a gradient of exactly 0 everywhere): no gradient, as
                # torch alone leaves an unused parameter, decided from the mean every member holds
                # (by this member's own .grad, one that used it with a zero gradient would step).
                p.grad = None
                continue
            p.grad = g.to(p.device, p.dtype)
        report.seconds = time.monotonic() - start
        self.outer_step_count += 1
        return report

    def after_inner_step(self, *, samples: int, info: dict[str, Any] | None = None) -> RoundReport | None:
        return None

    def with_global(self, run: Callable[[], T]) -> T:
        """``run()``: every peer's model is θ after each averaged step, there is no other."""
        return run()


def data_parallel_state() -> DiLoCoConfig:
    """The DiLoCo settings under which DiLoCo's state keeping equals plain data-parallel:
    one step per round, θ_global ← θ_local (outer SGD with lr 1, no momentum, own Δ)."""
    from optim.diloco import DiLoCoConfig

    return DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
