"""The global state a joiner downloads (:class:`OuterState`) and the inner optimizer's
statistics that travel with it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class OuterState:
    """Everything a new peer needs to continue the run: global θ, outer momentum, step."""

    outer_step: int
    params: list[torch.Tensor]
    momentum: list[torch.Tensor]
    inner: list[torch.Tensor] = field(default_factory=list)
    """The inner optimizer's per-parameter tensors at the end of the last round (see
    :meth:`DiLoCo.inner_state_tensors`). A joiner that starts AdamW from zero takes steps of
    ±lr on every coordinate and its first pseudo-gradients derail the round (measured here:
    eval loss 3.2 -> 5.7 on the round after a join), so the state travels with θ."""
    inner_keys: list[list[Any]] = field(default_factory=list)
    """(param index, state key) for each tensor in ``inner``."""
    pending: list[list[torch.Tensor]] = field(default_factory=list)
    """With ``delay``: averaged updates not applied yet, oldest first (one list per round)."""


def inner_state_tensors(optimizer: torch.optim.Optimizer) -> tuple[list[list[Any]], list[torch.Tensor]]:
    """The optimizer's per-parameter tensors as ([param index, key] list, CPU copies). Pageable
    copies, on purpose: pinned ones came to the host faster (small model on an H200: 7.2 -> 4.2
    ms a round), but page-locked memory cannot be swapped, torch caches it without giving it
    back, and a snapshot is still served while the next one is taken: several times AdamW's
    state locked in RAM, for a big model more than a volunteer's machine has."""
    keys, tensors = [], []
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            if isinstance(value, torch.Tensor):
                keys.append([int(index), str(key)])
                tensors.append(value.detach().to("cpu", copy=True))
    return keys, tensors


def load_inner_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], state: OuterState) -> None:
    """Adopt a donor's inner optimizer statistics when they fit ``params``; else keep ours."""
    if not state.inner:
        return
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for (index, key), tensor in zip(state.inner_keys, state.inner):
        per_param.setdefault(int(index), {})[str(key)] = tensor.clone()
    fits = all(
        0 <= index < len(params)
        and all(
            (key == "step" and t.dim() == 0) or t.shape == params[index].shape for key, t in entry.items()
        )
        for index, entry in per_param.items()
    )
    if not fits:
        logger.warning("the donor's inner optimizer state does not fit this model; starting it fresh")
        return
    groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": per_param, "param_groups": groups})


@contextlib.contextmanager
def holding(params: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> Iterator[None]:
    """``params`` (a model's trained tensors) hold ``values`` (θ_global: fp32 on the CPU), cast to
    their device and dtype, for the block; their own values wait on the CPU meanwhile (no second
    copy on an accelerator) and are put back after, bit for bit, even if the block raises."""
    kept = [p.detach().to("cpu", copy=True) for p in params]
    try:
        with torch.no_grad():
            for p, v in zip(params, values, strict=True):
                p.copy_(v)
        yield
    finally:
        with torch.no_grad():
            for p, k in zip(params, kept):
                p.copy_(k)
