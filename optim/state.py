"""The global state a joiner downloads (:class:`OuterState`) and the inner optimizer's
statistics that travel with it."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
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
    """The inner optimizer's per-parameter tensors at the donor's latest step boundary (see
    :class:`InnerStateCopies`; none before its first round). A joiner that starts AdamW from zero takes steps of
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


InnerTensors = tuple[list[list[Any]], list[torch.Tensor]]
"""([param index, key] per tensor, CPU copies): what :func:`inner_state_tensors` returns."""

COPY_TRIES = 5  # a copy racing the trainer's first step (its state dict grows) is taken again


class InnerStateCopies:
    """The inner optimizer's state, copied for a joiner (or a checkpoint) only when one asks.

    Rounds used to end with a copy of AdamW's state to host memory, kept in case a joiner
    asked: twice the parameters held for good (8 GB for a 1B-parameter model), and copied every
    round. Now whoever serves the state asks (:meth:`take`) and the trainer copies at its next
    step boundary (:meth:`boundary`, after every inner step; :meth:`leave` at the start of a
    sync copies the round's final state), so the copy is of a state no step is writing. The
    asker copies at once, itself, when the trainer is outside its inner steps (in a sync, whose
    all-reduce can take minutes; :meth:`leave` .. :meth:`enter`), has not stepped yet, is the
    asker (a checkpoint), or does not reach a boundary within ``wait`` s (a long evaluation): a
    value that an inner step writes meanwhile is then read old or new, either a fine warm start
    for a joiner's AdamW. The trainer's only mutations outside ``step()`` (a diverged peer's
    ``state.clear()``, a downloaded state's ``load_state_dict``) swap or shrink the state dict,
    which the copy survives by taking it again."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, wait: float = 5.0) -> None:
        self.optimizer = optimizer
        self.wait = wait
        self._lock = threading.Lock()
        self._asked: list[concurrent.futures.Future] = []
        self._trainer: int | None = None  # the thread that steps, once it has
        self._stepping = True  # between a round's start and its sync: inside inner steps

    def boundary(self) -> None:
        """The trainer, between two inner steps: answer whoever asked since the last one."""
        self._trainer = threading.get_ident()
        if self._asked:  # read without the lock: this runs every inner step
            self._answer()

    def leave(self) -> None:
        """The trainer's inner steps are over for this round (a sync begins): answer who asked
        with the round's final state; until :meth:`enter`, askers copy it themselves."""
        with self._lock:
            self._stepping = False
        self._answer()

    def enter(self) -> None:
        """The trainer starts a round's inner steps."""
        with self._lock:
            self._stepping = True

    def take(self) -> InnerTensors:
        """A copy of the optimizer's state (safe from any thread)."""
        with self._lock:
            mine = self._trainer in (None, threading.get_ident()) or not self._stepping
            if not mine:
                asked: concurrent.futures.Future = concurrent.futures.Future()
                self._asked.append(asked)
        if mine:
            return self._copy()
        try:
            return asked.result(timeout=self.wait)
        except concurrent.futures.TimeoutError:
            with self._lock:
                if asked in self._asked:
                    self._asked.remove(asked)
            if asked.done():  # answered just now
                return asked.result()
            logger.debug(
                "the trainer reached no step boundary in %.0f s: copying AdamW's state now", self.wait
            )
            return self._copy()

    def _answer(self) -> None:
        with self._lock:
            asked, self._asked = self._asked, []
        if not asked:
            return
        try:
            copy = self._copy()
        except BaseException as error:  # the askers fail too, and the trainer sees it
            for future in asked:
                future.set_exception(error)
            raise
        for future in asked:
            future.set_result(copy)

    def _copy(self) -> InnerTensors:
        for _ in range(COPY_TRIES - 1):
            try:
                return inner_state_tensors(self.optimizer)
            except RuntimeError as error:  # "dictionary changed size during iteration"
                logger.debug("copying AdamW's state again: %s", error)
        return inner_state_tensors(self.optimizer)


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
