"""The global state a joiner downloads (:class:`OuterState`) and the inner optimizer's
statistics that travel with it."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
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


def shape_mismatch(got: Sequence[tuple[int, ...]], wanted: Sequence[tuple[int, ...]]) -> str | None:
    """How a state's tensor shapes differ from this model's, or None: ``N tensors vs this
    model's M; first mismatch tensor i: (a) vs (b)``."""
    got, wanted = [tuple(s) for s in got], [tuple(s) for s in wanted]
    if got == wanted:
        return None
    first = next((f"tensor {i}: {a} vs {b}" for i, (a, b) in enumerate(zip(got, wanted)) if a != b), "")
    return f"{len(got)} tensors vs this model's {len(wanted)}" + (
        f"; first mismatch {first}" if first else ""
    )


def positions(optimizer: torch.optim.Optimizer, params: list[torch.Tensor] | None) -> dict[int, int]:
    """Each of the optimizer's own parameter indices (its state dict's) -> that parameter's
    position in ``params`` (θ: the trained parameters), for those in it. They differ when the
    optimizer also holds frozen parameters (``AdamW(model.parameters())`` with a frozen layer):
    the donor's indices were then checked against θ, and its whole state was refused."""
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if params is None:
        return {index: index for index in range(len(held))}
    where = {id(p): position for position, p in enumerate(params)}
    return {index: where[id(p)] for index, p in enumerate(held) if id(p) in where}


def inner_state_tensors(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor] | None = None
) -> tuple[list[list[Any]], list[torch.Tensor]]:
    """The optimizer's per-parameter tensors as ([param index, key] list, CPU copies), each
    index the parameter's position in ``params`` (None: the optimizer's own index). Pageable
    copies, on purpose: pinned ones came to the host faster (small model on an H200: 7.2 -> 4.2
    ms a round), but page-locked memory cannot be swapped, torch caches it without giving it
    back, and a snapshot is still served while the next one is taken: several times AdamW's
    state locked in RAM, for a big model more than a volunteer's machine has."""
    position = positions(optimizer, params)
    keys, tensors = [], []
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        if int(index) not in position:
            continue  # not trained: no part of the state
        for key, value in sorted(state.items()):
            if isinstance(value, torch.Tensor):
                keys.append([position[int(index)], str(key)])
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

    def __init__(
        self, optimizer: torch.optim.Optimizer, *, wait: float = 5.0, params: list[torch.Tensor] | None = None
    ) -> None:
        """``params``: θ, whose positions the copies' indices are (:func:`inner_state_tensors`)."""
        self.optimizer = optimizer
        self.params = params
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
        """A copy of the optimizer's state (safe from any thread); none (``([], [])``) if it
        holds NaN or Inf: a peer whose inner steps diverged serves no moments, and a joiner
        starts its own afresh, as the diverged peer itself does at its sync."""
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
                taken = asked not in self._asked  # the trainer is copying it now: not a second copy
                if not taken:
                    self._asked.remove(asked)
            if taken:
                return asked.result()
            logger.debug(
                "the trainer reached no step boundary in %.0f s: copying AdamW's state now", self.wait
            )
            return self._copy()

    def _answer(self) -> None:
        """The trainer copies for whoever asked. A copy that fails (the host out of memory) fails
        those askers, not the trainer: a joiner's request must not stop the donor's training."""
        with self._lock:
            asked, self._asked = self._asked, []
        if not asked:
            return
        try:
            copy = self._copy()
        except Exception as error:  # noqa: BLE001 - the askers see it
            logger.warning("could not copy AdamW's state for a joiner: %s", error)
            for future in asked:
                future.set_exception(error)
            return
        except BaseException as error:  # Ctrl+C: the askers fail too, and the trainer stops
            # With an error of their own: the KeyboardInterrupt itself, handed to an asker (hivemind's
            # state thread), crossed to the averager process and ended its event loop's thread.
            stopped = RuntimeError(
                f"the trainer stopped while it copied AdamW's state ({type(error).__name__})"
            )
            for future in asked:
                future.set_exception(stopped)
            raise
        for future in asked:
            future.set_result(copy)

    def _copy(self) -> InnerTensors:
        for _ in range(COPY_TRIES - 1):
            try:
                return _finite_or_none(*inner_state_tensors(self.optimizer, self.params))
            except RuntimeError as error:  # "dictionary changed size during iteration"
                logger.debug("copying AdamW's state again: %s", error)
        return _finite_or_none(*inner_state_tensors(self.optimizer, self.params))


def _finite_or_none(keys: list[list[Any]], tensors: list[torch.Tensor]) -> InnerTensors:
    if all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point()):
        return keys, tensors
    logger.warning("the inner optimizer's state holds NaN/Inf (its steps diverged): a joiner gets none")
    return [], []


MAX_STEP = 2.0**53  # an optimizer's step count, as a float: beyond it, not an integer any more


def load_inner_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], state: OuterState) -> None:
    """Adopt a donor's inner optimizer statistics when they are ones this optimizer could hold
    for ``params`` (:func:`inner_state_problem`); else keep ours, with a warning that says why.

    The witnesses check θ, not these: each donor's moments are its own. Shapes alone let a
    donor's NaN moments (a peer whose steps diverged), a negative step count (AdamW's bias
    correction turns complex and its step raises) or an entry without ``exp_avg`` (a KeyError
    at the joiner's first step) through, and moments out of proportion (``exp_avg`` 1e30 over
    ``exp_avg_sq`` 0) would move every weight by 1e30 lr on the joiner's first step."""
    if not state.inner:
        return
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for (index, key), tensor in zip(state.inner_keys, state.inner):
        per_param.setdefault(int(index), {})[str(key)] = tensor.clone()
    problem = inner_state_problem(optimizer, params, per_param)
    if problem:
        logger.warning("the donor's inner optimizer state %s; starting it fresh", problem)
        return
    index_of = {position: index for index, position in positions(optimizer, params).items()}
    if not all(position in index_of for position in per_param):
        logger.warning(
            "the donor's inner optimizer state is for parameters this optimizer does not hold; starting it fresh"
        )
        return
    groups = optimizer.state_dict()["param_groups"]
    per_index = {index_of[position]: entry for position, entry in per_param.items()}
    optimizer.load_state_dict({"state": per_index, "param_groups": groups})


def inner_state_problem(
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    per_param: dict[int, dict[str, torch.Tensor]],
) -> str:
    """Why ``per_param`` (param index -> key -> tensor) is not a state ``optimizer`` could hold
    for ``params``, or "".

    Any optimizer: an entry for a parameter that exists, of its shape (a ``step`` a scalar), all
    values finite, and (but for Adam's, checked per group below) every entry with the same keys.
    Adam and AdamW (torch's, and :class:`optim.eager.AdamW`), for real parameters: the keys its
    group keeps (``max_exp_avg_sq`` too with ``amsgrad``), a step count that is a whole number in
    [1, 2^53] (a stored state has taken a step), ``exp_avg_sq`` >= 0, and
    ``|exp_avg| <= c sqrt(exp_avg_sq)`` with ``c = (1 - β1) / sqrt((1 - β2)(1 - β1²/β2))``
    (7.3 for the default betas): by Cauchy-Schwarz no sequence of gradients gives more, as both
    moments start at zero and take every gradient (the stored moments are not bias-corrected).
    So the joiner's first step moves each weight by at most ``c · max(1, sqrt(1 - β2²) /
    (1 - β1²))`` learning rates (7.3 for the default betas), as an honest donor's could."""
    adam = isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
    keys: set[str] | None = None
    for index, entry in per_param.items():
        if not 0 <= index < len(params):
            return f"has an entry for parameter {index} of {len(params)}"
        for key, tensor in entry.items():
            if not ((key == "step" and tensor.dim() == 0) or tensor.shape == params[index].shape):
                return f"does not fit this model (parameter {index}'s {key!r}: {tuple(tensor.shape)})"
            if (tensor.is_floating_point() or tensor.is_complex()) and not bool(torch.isfinite(tensor).all()):
                return f"holds NaN/Inf (parameter {index}'s {key!r})"
        if keys is None:
            keys = set(entry)
        elif set(entry) != keys and not adam:
            return f"has entries with different keys ({sorted(keys)} and {sorted(entry)})"
    if not adam:
        return ""
    position = positions(optimizer, params)  # per_param is by position in params
    groups = {
        position[i]: g for g in optimizer.state_dict()["param_groups"] for i in g["params"] if i in position
    }
    for index, entry in per_param.items():
        group = groups.get(index, optimizer.param_groups[0])
        wanted = {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if group.get("amsgrad") else set())
        if set(entry) != wanted:
            return f"has the keys {sorted(entry)}, where {type(optimizer).__name__} keeps {sorted(wanted)}"
        if entry["step"].dtype not in (torch.float32, torch.float64):
            # torch keeps a loaded step in its dtype: a bool, uint8 255 or int8 127 made the
            # joiner's first AdamW step raise (or wrap to 0), and the peer exit.
            return f"has a step count of dtype {entry['step'].dtype} (parameter {index})"
        step = float(entry["step"])
        if not (1 <= step <= MAX_STEP and step == int(step)):
            return f"has a step count of {step} (parameter {index})"
        dtype = params[index].dtype
        moments = {k: t for k, t in entry.items() if k != "step"}
        if any(
            not (t.is_floating_point() or t.is_complex()) or t.is_complex() != dtype.is_complex
            for t in moments.values()
        ):
            return f"has moments of another kind than parameter {index} ({dtype})"
        if dtype.is_complex:
            continue  # Adam steps a complex parameter as its real view: finite is all checked here
        # As loading will hold them: in the parameter's dtype (the donor's dtype is its to choose).
        moments = {k: t.to(dtype) for k, t in moments.items()}
        if not all(bool(torch.isfinite(t).all()) for t in moments.values()):
            return f"holds values out of {dtype}'s range (parameter {index})"
        squares = moments["exp_avg_sq"]
        if bool((squares < 0).any()) or (
            "max_exp_avg_sq" in moments and bool((moments["max_exp_avg_sq"] < 0).any())
        ):
            return f"has a negative exp_avg_sq (parameter {index})"
        beta1, beta2 = (float(b) for b in group["betas"])
        if not beta1**2 < beta2 < 1:
            continue
        bound = (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1**2 / beta2))
        # Slack for the moments' own rounding (a few units of their dtype's precision: bf16's
        # rounding took an honest state 1.2 % past the bound) and for squares that underflowed
        # (eps, which AdamW adds to sqrt(exp_avg_sq) in its step, and the smallest square the
        # dtype holds: fp16's squares of gradients under 2e-4 are 0).
        info = torch.finfo(dtype)
        slack = 1 + max(1e-3, 8 * info.eps)
        floor = float(group.get("eps", 1e-8)) + math.sqrt(info.smallest_normal)
        limit = squares.float().sqrt().mul_(slack * bound).add_(bound * floor)
        if bool((moments["exp_avg"].float().abs() > limit).any()):
            return (
                f"has an exp_avg larger than AdamW can make from its exp_avg_sq ({bound:.1f} sqrt(exp_avg_sq); "
                f"parameter {index})"
            )
    return ""


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


_TOLD_BUFFERS: set[str] = set()


def warn_unsynced_buffers(model: torch.nn.Module) -> list[str]:
    """Say once per model class that its floating-point buffers (BatchNorm's running mean and
    variance, say) stay each peer's own: only parameters are averaged and downloaded, so the
    peers' running statistics drift apart and a joiner starts them afresh. The names, or [].
    Only buffers the model keeps in its state_dict: a non-persistent one is a constant the model
    computes itself (rotary embeddings' inv_freq in every Llama-style model was said to drift)."""
    kept = model.state_dict(keep_vars=True).keys()
    names = [name for name, buffer in model.named_buffers() if buffer.is_floating_point() and name in kept]
    kind = type(model).__name__
    if names and kind not in _TOLD_BUFFERS:
        _TOLD_BUFFERS.add(kind)
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        logger.warning(
            "%s has %d floating-point buffers (%s): they are not averaged or sent to joiners, so each "
            "peer keeps its own (BatchNorm's running statistics drift apart between peers). Prefer "
            "LayerNorm or GroupNorm, or recompute the statistics before evaluating "
            "(torch.optim.swa_utils.update_bn)",
            kind,
            len(names),
            shown,
        )
    return names
