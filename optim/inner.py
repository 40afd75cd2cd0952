"""One inner step, the same everywhere: a swarm peer, a node's other ranks, the simulator and
the benchmarks all train through :func:`inner_step`, so what they measure is what runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch


def inner_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    device: torch.device | None = None,
    grad_clip: float = 0.0,
    before_step: Callable[[], Any] | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> torch.Tensor:
    """Forward (``model(x, y)`` returns ``(logits, loss)``), backward, ``before_step`` (where a
    node or data-parallel swarm averages the gradients), clip, optimizer step, zero the
    gradients. Returns the loss, still on the device: reading it is the caller's choice (a
    ``float()`` per step would synchronize a GPU)."""
    if device is not None:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    model.train()
    with autocast():
        _, loss = model(x, y)
    loss.backward()
    if before_step is not None:
        before_step()
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss
