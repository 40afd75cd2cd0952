"""DiLoCo: Distributed Low-Communication training of language models.

Douillard et al., 2023, https://arxiv.org/abs/2311.08105

Every peer starts a round from the same global parameters θ, runs H steps of its own inner
optimizer (AdamW; its state never leaves the peer), then the peers average their
pseudo-gradients Δ = θ − θ_local and an outer SGD with Nesterov momentum updates θ with the
mean Δ. With outer lr 1 and no momentum this is FedAvg / local SGD.

Phases of one round, each a method below:
``save_global_params`` (once, at wrap time) → H × inner step (the user's loop) →
``compute_pseudo_gradients`` → ``average`` (the :class:`~optim.averager.Averager`) →
``apply_outer_step`` → ``restore_parameters`` (global θ copied into the model).

The user's loop stays plain PyTorch::

    outer = DiLoCo(model, inner_opt, averager, DiLoCoConfig(inner_steps=50))
    for x, y in batches:
        loss = model(x, y)[1]; loss.backward(); inner_opt.step(); inner_opt.zero_grad()
        report = outer.step(samples=len(x))   # a RoundReport after every H-th step, else None
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from optim.averager import Averager, RoundReport
from optim.background import in_background, landed, read_settled
from optim.codecs import all_finite, encoded_nbytes
from optim.config import DiLoCoConfig
from optim.contribution import (
    InFlight,
    Outgoing,
    global_norm,
    judge,
    keepers,
    not_applied,
    own_share,
    spread_over_keepers,
    take_back_unapplied,
)
from optim.eager import SGD
from optim.state import (
    InnerStateCopies,
    InnerTensors,
    OuterState,
    holding,
    inner_state_tensors,
    load_inner_state,
    shape_mismatch,
    warn_unsynced_buffers,
)

__all__ = [  # the config and state live in their own modules; importing them from here still works
    "DiLoCo",
    "DiLoCoConfig",
    "OuterState",
    "in_background",
    "inner_state_tensors",
    "landed",
    "load_inner_state",
    "read_settled",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")


def pseudo_gradient(theta: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Δ = θ − θ_local in fp32 on the host, with θ (fp32) first rounded to the local params'
    dtype, as the model started from it (see :meth:`DiLoCo.compute_pseudo_gradients`)."""
    started = theta if local.dtype == theta.dtype else theta.to(local.dtype).float()
    return started - local.detach().to("cpu", torch.float32)


class DiLoCo:
    """Wraps ``model`` and its inner optimizer; averages pseudo-gradients every H steps."""

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        averager: Averager,
        config: DiLoCoConfig,
    ) -> None:
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.averager = averager
        self.config = config
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters: nothing for DiLoCo to average")
        warn_unsynced_buffers(model)
        self.outer_step_count = 0
        """Completed outer rounds (the run's clock: peers at the same step hold the same θ)."""
        self.inner_step_count = 0
        """Inner steps done in the current round."""
        self.samples_this_round = 0
        # Held while θ or the momentum change, so a state download served from another thread
        # (hivemind calls get_current_state in a background thread) never sees half a step.
        self.lock = threading.RLock()
        self.inner_copies = InnerStateCopies(
            inner_optimizer, params=self.params
        )  # AdamW's state, copied when asked
        self.codec = config.make_codec()
        self._pending: list[list[torch.Tensor]] = []  # averaged Δ waiting to be applied (delay > 0)
        self._inflight: InFlight | None = None  # with overlap: the round being averaged
        self._take_back_later: list[torch.Tensor] | None = None  # see take_back_later
        self._last_future: concurrent.futures.Future | None = None  # the next round starts after it
        # What compression dropped, per peer, added back next round (never lost; see codecs).
        self.feedback = config.make_feedback(self.codec)
        self.save_global_params()

    def retune(
        self, *, outer_lr: float | None = None, inner_steps: int | None = None, codec: str | None = None
    ) -> dict[str, Any]:
        """Change settings between rounds (steering); returns what changed. Validated first, so
        a bad value raises ValueError and changes nothing. A new codec starts its error
        feedback afresh (the old residual was in the old codec's terms and is dropped)."""
        changes = {
            k: v
            for k, v in dict(outer_lr=outer_lr, inner_steps=inner_steps, codec=codec).items()
            if v is not None and getattr(self.config, k) != v
        }
        if not changes:
            return {}
        checked = dataclasses.replace(self.config, **changes)  # runs __post_init__'s checks
        for key, value in changes.items():
            setattr(self.config, key, value)
        if "outer_lr" in changes:
            with self.lock:
                for optimizer in (self.outer_optimizer, self.offset_optimizer):
                    for group in optimizer.param_groups if optimizer else []:
                        group["lr"] = checked.outer_lr
        if "codec" in changes:
            self.codec = self.config.make_codec()
            self.feedback = self.config.make_feedback(self.codec)
        return changes

    # --- phases -------------------------------------------------------------------------

    def save_global_params(self) -> None:
        """Keep θ in fp32 on the CPU, apart from the model, with its own outer SGD."""
        self.global_params = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
        self.outer_optimizer = self._outer_sgd(self.global_params)
        # Eager updates: this peer trains from θ + offset. θ moves only with real means (the
        # same on every peer); the offset with this peer's own corrections (apply_eager).
        self.offset = [torch.zeros_like(g) for g in self.global_params] if self.config.eager_updates else []
        self.offset_optimizer = self._outer_sgd(self.offset) if self.offset else None
        self._proxy: list[torch.Tensor] | None = None  # last round's share · Δ, applied eagerly
        self._restored = self._writes()  # the model holds θ as it is (θ is its fp32 copy)
        self.global_intact = True
        """False from the moment a change of θ (an outer step, an adopted state) was cut short by an
        exception, Ctrl+C included: θ may then be half updated (a peer stopped so writes no θ)."""
        self._share: float | None = (
            None  # this peer's share of the last mean that landed (its weight / the group's)
        )

    def _outer_sgd(self, params: list[torch.Tensor]) -> SGD:
        return SGD(
            params,
            lr=self.config.outer_lr,
            momentum=self.config.outer_momentum,
            nesterov=self.config.nesterov,
        )

    def working_params(self) -> list[torch.Tensor]:
        """Where this peer's inner steps start: θ, plus the eager offset if any."""
        if not self.offset:
            return self.global_params
        return [g + o for g, o in zip(self.global_params, self.offset)]

    @torch.no_grad()
    def compute_pseudo_gradients(self) -> list[torch.Tensor]:
        """Δ = θ − θ_local, one fp32 CPU tensor per parameter (same shapes as the params); θ
        is where this round started (with eager updates: θ + this peer's offset), in the
        parameters' dtype as the model started from it: with bf16 parameters, an fp32 θ minus
        the model's bf16 put θ's own rounding into every Δ, and the outer step then undid θ's
        progress finer than bf16 (two peers adding half a bf16 ulp a round moved θ by 0.5 ulp in
        10 rounds, not 5; with no training at all, a round still moved θ)."""
        return [pseudo_gradient(g, local) for g, local in zip(self.working_params(), self._host_params())]

    def _host_params(self) -> list[torch.Tensor]:
        """θ_local on the host. From a GPU, through pinned buffers kept across rounds: the copies
        are asynchronous DMA, one synchronize for all of them (no pageable staging per tensor)."""
        if not self.params or self.params[0].device.type != "cuda":
            return [p.detach().to("cpu") for p in self.params]
        if getattr(self, "_pinned", None) is None:
            self._pinned = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in self.params]
        for buffer, p in zip(self._pinned, self.params):
            buffer.copy_(p.detach(), non_blocking=True)
        torch.cuda.current_stream(self.params[0].device).synchronize()
        return self._pinned

    def compress(self, deltas: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
        """Encode Δ as the group will receive it; returns the decoded Δ and the payload bytes."""
        if self.feedback is not None:
            encoded, decoded = self.feedback.compress(deltas)
            return decoded, encoded_nbytes(encoded)
        return self.codec.round_trip(deltas)

    def average(
        self, deltas: list[torch.Tensor], info: dict[str, Any] | None, *, weight: float | None = None
    ) -> RoundReport:
        """Replace ``deltas`` by the group's weighted mean; fall back to ours on any failure."""
        start = time.monotonic()
        if weight is None:
            weight = float(max(self.samples_this_round, 1))
        kept = keepers(deltas) if self.config.topk_mean == "kept" else []
        # A transport may fail after writing half a mean into ``deltas``: keep our own to fall
        # back on, unless it says it writes them only on success (a copy of Δ a round saved).
        intact = getattr(self.averager, "keeps_tensors_on_failure", False) and not kept
        backup = None if intact else [d.clone() for d in deltas]
        try:
            report = self.averager.all_reduce([*deltas, *kept], weight=weight, info=info)
            if kept:
                spread_over_keepers(deltas, kept, report, check=self.config.outlier_ratio > 0)
        except threading.BrokenBarrierError:
            raise  # the in-process swarm lost a peer: stop, do not train on alone
        except Exception as error:  # the transport failed: this round is a local step
            logger.warning("averaging failed (%s); applying this peer's own update", error)
            for d, b in zip(deltas, backup or []):
                d.copy_(b)
            report = RoundReport(group_size=1, error=str(error), group_info=[dict(info or {})], failed=True)
        report.seconds = time.monotonic() - start
        return report

    @torch.no_grad()
    def apply_outer_step(self, mean_deltas: list[torch.Tensor], *, checked: bool = False) -> None:
        """θ ← OuterSGD(θ, mean Δ). Refuses a non-finite update rather than poison θ (``checked``:
        the caller has just found it finite)."""
        if not checked and not all_finite(mean_deltas):
            raise FloatingPointError(
                f"round {self.outer_step_count}: the averaged update holds NaN/Inf; the global params "
                "were left unchanged (a peer diverged: lower the inner learning rate)"
            )
        with self.lock:
            self._apply(mean_deltas)
            self.outer_step_count += 1

    def apply_delayed(self, mean_deltas: list[torch.Tensor]) -> None:
        """One-step-delayed outer step (DiLoCoX, https://arxiv.org/abs/2506.21263; eager
        updates, https://arxiv.org/abs/2502.12996): round r applies the mean Δ of round r − delay,
        so on a real network that all-reduce has the whole next round of inner steps to finish.
        The first ``delay`` rounds apply nothing; the outer step still counts rounds."""
        if not all_finite(mean_deltas):
            raise FloatingPointError(
                f"round {self.outer_step_count}: the averaged update holds NaN/Inf; it was dropped"
            )
        self._pending.append([d.clone() for d in mean_deltas])
        if len(self._pending) > self.config.delay:
            self.apply_outer_step(self._pending.pop(0))
        else:
            with self.lock:
                self.outer_step_count += 1

    def _skip_delayed(self) -> None:
        """A refused round: nothing joins the queue, and the mean queued a round ago (``delay``)
        is applied as it would have been (as the overlapped path does, whose refused round
        applies nothing a round later); the clock counts the round either way. Before stop 57
        the queued mean stayed queued: applied a round late, and with eager updates the next
        round started from a point holding none of it. (``delay`` is at most 1: a longer queue
        would need a place held for the refused round, :data:`optim.config.MAX_DELAY`.)"""
        if self._pending:
            self.apply_outer_step(self._pending.pop(0), checked=True)  # finite when queued
        else:
            with self.lock:
                self.outer_step_count += 1

    @torch.no_grad()
    def restore_parameters(self) -> None:
        """Copy θ (plus the eager offset, if any) into the model: where the next round starts."""
        start = self.working_params()
        if self.params and self.params[0].device.type == "cuda" and getattr(self, "_pinned", None):
            for p, g, buffer in zip(self.params, start, self._pinned):
                buffer.copy_(g)  # host to pinned (dtype cast here), then an async DMA to the GPU
                p.copy_(buffer, non_blocking=True)
            torch.cuda.current_stream(self.params[0].device).synchronize()  # buffers reused next round
        else:
            for p, g in zip(self.params, start):
                p.copy_(g.to(p.device, p.dtype))
        self._restored = self._writes()

    def _holds_global(self) -> bool:
        """Whether the model still holds θ as :meth:`restore_parameters` wrote it: no inner step
        counted since, and torch's write counters of the params and of θ unchanged (a fused
        optimizer step does not move them, hence the step count; writes through ``.data`` are
        not seen at all: use the params themselves)."""
        return (
            self._restored is not None
            and self.inner_step_count == 0
            and self.samples_this_round == 0
            and self._restored == self._writes()
        )

    def _writes(self) -> tuple[int, ...] | None:
        """The in-place writes so far to the model's params and to θ (torch counts them per tensor):
        while they stay as :meth:`restore_parameters` left them, the model holds θ, cast. None with
        an eager offset (the model holds θ + offset)."""
        if self.offset:
            return None
        return tuple(t._version for t in (*self.params, *self.global_params))

    # --- the user's hook ------------------------------------------------------------------

    def before_inner_step(self, *, samples: int, info: dict[str, Any] | None = None) -> RoundReport | None:
        """Nothing to do before an inner step (data-parallel averages gradients here)."""
        return None

    def after_inner_step(self, *, samples: int, info: dict[str, Any] | None = None) -> RoundReport | None:
        """The common hook name; same as :meth:`step`."""
        return self.step(samples=samples, info=info)

    def step(self, *, samples: int, info: dict[str, Any] | None = None) -> RoundReport | None:
        """Call after every inner optimizer step; runs a round after the H-th. ``samples``
        is how many sequences this step trained on (the round's averaging weight)."""
        self.note_inner_step(samples=samples)
        if self.inner_step_count < self.config.inner_steps:
            return None
        return self.sync(info=info)

    def note_inner_step(self, *, samples: int) -> None:
        """Count an inner step without syncing (for loops that decide when to sync)."""
        self.inner_step_count += 1
        self.samples_this_round += samples
        self.inner_copies.boundary()

    def sync(self, *, info: dict[str, Any] | None = None) -> RoundReport:
        """Run one outer round now, whatever the inner step count. With ``overlap`` the round's
        all-reduce starts in the background and the report is that of the previous round."""
        self.inner_copies.leave()
        outgoing = self._outgoing(info)
        later, self._take_back_later = self._take_back_later, None
        if later is not None and self.feedback is not None:
            # A resumed checkpoint's round in flight that the group refused: taken back where
            # the run that went on collected it, after this round's encode (checkpoint_state).
            self.feedback.take_back(later)
        if self.config.overlap:
            return self._sync_overlapped(outgoing)
        sent = [d.clone() for d in outgoing.deltas] if self.offset else []
        report = self.average(outgoing.deltas, outgoing.info, weight=outgoing.weight)
        refused = judge(outgoing, report, self.config.outlier_ratio)
        take_back_unapplied(self.feedback, outgoing, report, self.config.outlier_ratio)
        if refused:
            logger.error("%s", refused)
            # The round counts as the other paths count it (the queue moves on: with --delay 1
            # the mean accepted a round ago is due now): θ unchanged, the clock one round on.
            # Without the count, --rounds N ran N + the refused rounds, the next round went out
            # at the same outer step and the inner lr's schedule ran its H steps again.
            self._skip_delayed()
        elif self.config.delay:
            self.apply_delayed(outgoing.deltas)
        else:
            self.apply_outer_step(outgoing.deltas, checked=True)  # judge() found the mean finite
        if self.offset:  # as overlapped: this round's share is learnt once its mean lands
            self.apply_eager(sent, self._stand_in_share())
            self._learn_share(report, outgoing.weight)
        self._next_round()
        return report

    def _outgoing(self, info: dict[str, Any] | None) -> Outgoing:
        """This peer's Δ for the round, as it goes on the wire (clipped, compressed)."""
        deltas = self.compute_pseudo_gradients()
        local_norm = global_norm(deltas)
        diverged = not math.isfinite(local_norm) and not all_finite(deltas)  # a finite norm: all finite
        sent_norm: float | None = None
        if diverged:
            # This peer diverged: sending its update would poison everyone's θ. It contributes
            # nothing (weight 0) and adopts the group's mean, so it stays on the swarm's θ and
            # every other peer's all-reduce still finds it (no barrier left waiting).
            logger.error(
                "round %d: this peer's pseudo-gradient holds NaN/Inf; not sent", self.outer_step_count
            )
            deltas = [torch.zeros_like(g) for g in self.global_params]
            payload_bytes = 0
            self.inner_optimizer.state.clear()  # its moments are likely NaN too: start them afresh
        else:
            clipped = bool(self.config.clip_norm) and local_norm > self.config.clip_norm
            if clipped:
                deltas = [d * (self.config.clip_norm / local_norm) for d in deltas]
            before = [d.data_ptr() for d in deltas]
            deltas, payload_bytes = self.compress(deltas)
            if not clipped and before == [d.data_ptr() for d in deltas]:
                sent_norm = local_norm  # sent as computed ('none' hands Δ itself on): the norm just taken
        weight = 0.0 if diverged else float(max(self.samples_this_round, 1))
        if sent_norm is None:
            sent_norm = global_norm(deltas)
        # What the robust check of every member reads: this peer's declared norm and weight.
        info = dict(info or {}, norm=sent_norm, weight=weight)
        if self.config.topk_mean == "kept":  # how the group scales the kept-masks (swarm.gathered)
            info["kept"] = int(sum(int(torch.count_nonzero(d)) for d in deltas))
        info.setdefault("outer_step", self.outer_step_count)
        sent = [d.clone() for d in deltas] if self.feedback is not None and not diverged else None
        return Outgoing(
            deltas, info, weight, local_norm, payload_bytes, diverged, self.outer_step_count, sent
        )

    def _next_round(self) -> None:
        self.restore_parameters()
        self.inner_step_count = 0
        self.samples_this_round = 0
        self.inner_copies.enter()

    # --- overlapped rounds --------------------------------------------------------------

    def _sync_overlapped(self, outgoing: Outgoing) -> RoundReport:
        """Apply the previous round's mean, start this round's all-reduce in the background,
        and move the clock on at once: the all-reduce has the next round's inner steps to run."""
        report, mean = RoundReport(group_size=1, pending=True, info=outgoing.info), None  # first round
        if self._inflight is not None:
            report, mean = self._collect(self._inflight)
            self._learn_share(report, self._inflight.outgoing.weight)
        sent = [d.clone() for d in outgoing.deltas] if self.offset else []  # the all-reduce overwrites them
        share = self._stand_in_share() if self.offset else 1.0  # (not under the lock: may ask the DHT)
        with self.lock:  # θ, the clock and the in-flight round change together (see outer_state)
            if self._pending:  # queued in a downloaded state: the donor's, not our stale round's
                mean = self._pending.pop(0)
            if mean is not None:
                self._apply(mean)
            if self.offset:
                self.apply_eager(sent, share)
            self._inflight = InFlight(
                outgoing,
                in_background(
                    self.average,
                    outgoing.deltas,
                    outgoing.info,
                    weight=outgoing.weight,
                    after=self._last_future,
                ),
            )
            self._last_future = self._inflight.future
            self.outer_step_count += 1
        self._next_round()
        return report

    def finish(self) -> RoundReport | None:
        """End the run on the swarm's θ: wait for the round in flight (``overlap``) and apply
        every mean still queued (``delay``), then drop the eager offset (what it stood in for
        is in those means now). The report of the round that was in flight, else None."""
        self.inner_copies.leave()  # no inner step comes any more: askers copy at once
        report, mean = None, None
        if self._inflight is not None:
            report, mean = self._collect(self._inflight)
        with self.lock:
            if self._pending and self._inflight is not None:  # a donor's queued mean replaces ours
                mean = self._pending.pop(0)
            self._inflight = None
            for update in [*self._pending, *([mean] if mean is not None else [])]:
                self._apply(update)
            self._pending = []
            self._reset_offset()
        self.restore_parameters()
        return report

    def _reset_offset(self) -> None:
        for o in self.offset:
            o.zero_()
        if self.offset_optimizer is not None:
            self.offset_optimizer.state.clear()
        self._proxy = None

    def local_state(self) -> dict[str, Any]:
        """What a checkpoint keeps beside the outer state: with eager updates, this peer's offset,
        its SGD's momentum, last round's stand-in and share ({} without). A resume without them
        ran one round of the naive delay (a lone eager peer then left blocking DiLoCo's path)."""
        if not self.offset:
            return {}
        with self.lock:
            state = self.offset_optimizer.state
            return {
                "offset": [o.clone() for o in self.offset],
                "offset_momentum": [
                    m.clone() if (m := state.get(o, {}).get("momentum_buffer")) is not None else None
                    for o in self.offset
                ],
                "proxy": [p.clone() for p in self._proxy] if self._proxy is not None else None,
                "share": self._share,
            }

    @torch.no_grad()
    def load_local_state(self, state: dict[str, Any]) -> None:
        """The inverse of :meth:`local_state`, after :meth:`load_outer_state`; the model then starts
        from θ + offset. A state of another shape (another config) is skipped with a warning."""
        offset = state.get("offset")
        if not self.offset or not offset:
            self.restore_parameters()  # (the model as saved at a round's end: θ; its write marks kept)
            return
        shapes = [tuple(o.shape) for o in self.offset]
        momentum, proxy = state.get("offset_momentum") or [None] * len(offset), state.get("proxy")
        if (
            [tuple(o.shape) for o in offset] != shapes
            or len(momentum) != len(offset)
            or (proxy is not None and [tuple(p.shape) for p in proxy] != shapes)
        ):
            logger.warning("the checkpoint's eager offset does not fit this model; starting it at zero")
            return
        with self.lock:
            for o, saved, m in zip(self.offset, offset, momentum):
                o.copy_(saved)
                if m is not None:
                    self.offset_optimizer.state[o]["momentum_buffer"] = m.clone().float()
            self._proxy = [p.clone().float() for p in proxy] if proxy is not None else None
            share = state.get("share")
            self._share = float(share) if isinstance(share, (int, float)) and 0 < share <= 1 else None
        self.restore_parameters()

    def _learn_share(self, report: RoundReport, weight: float) -> None:
        """Remember this peer's share of the mean that just landed, for the next stand-in. A
        round whose all-reduce failed (this peer fell back on its own update) says nothing of the
        group the next round will find: the share learnt before stands (else the next stand-in
        would be the whole Δ, M times its share, as before the first mean). A peer alone by
        the barrier's verdict (nobody else in the round) takes 1. Before any mean has landed a
        failed round leaves none learnt: 1 / the expected group stands in (a review, stop 60:
        a failed first round taught 1.0, and the next offset went M times the paper's Δ/M)."""
        if report.failed:
            return
        if weight <= 0:  # this peer diverged and sent nothing: its share (0) says nothing of the next
            return
        self._share = own_share(report, weight)

    def _stand_in_share(self) -> float:
        """The share of the mean in flight this peer's Δ stands in for: its share of the last
        mean that landed, or before one has, 1 / the group its averager expects (Kale et al.'s
        Δ/M; the whole Δ stood in before, M times the paper's first step)."""
        if self._share is not None:
            return self._share
        expected = getattr(self.averager, "expected_group", None)
        try:
            size = int(expected()) if callable(expected) else 1
        except Exception as error:  # noqa: BLE001 - an estimate: the whole Δ, as alone
            logger.debug("could not tell the expected group size: %s", error)
            size = 1
        return 1.0 / max(1, size)

    @torch.no_grad()
    def apply_eager(self, sent: list[torch.Tensor], share: float) -> None:
        """The eager half of a delayed round (Kale et al. 2025). The outer gradient a peer
        should use is ĝ_t = mean_{t−1} + s·Δ_t − s'·Δ_{t−1}: the last mean that landed, with
        this peer's fresh Δ standing in for its share ``s`` of the mean still in flight, and
        last round's stand-in taken back out (the mean that just landed holds the real one).

        ``mean_{t−1}`` goes to θ (``apply_delayed`` / the overlapped round), identically on every
        peer; ``s·Δ_t − s'·Δ_{t−1}`` goes to this peer's offset through an SGD with the same lr
        and momentum. The outer SGD is linear in its gradients, so θ + offset is exactly where
        one outer SGD fed ĝ would be, while θ itself stays the swarm's consensus."""
        proxy = [share * d for d in sent]
        correction = proxy if self._proxy is None else [p - q for p, q in zip(proxy, self._proxy)]
        with self.lock:
            for o, c in zip(self.offset, correction):
                o.grad = c
            self.offset_optimizer.step()
            self.offset_optimizer.zero_grad(set_to_none=True)
        self._proxy = proxy

    def _collect(self, inflight: InFlight) -> tuple[RoundReport, list[torch.Tensor] | None]:
        """Wait for a round in flight: its report, and its mean unless refused."""
        report = inflight.future.result()  # re-raises only what stops the run
        refused = judge(inflight.outgoing, report, self.config.outlier_ratio)
        take_back_unapplied(self.feedback, inflight.outgoing, report, self.config.outlier_ratio)
        if refused:
            logger.error("%s", refused)
            return report, None
        return report, inflight.outgoing.deltas

    @torch.no_grad()
    def _apply(self, mean_deltas: list[torch.Tensor]) -> None:
        with self.lock:
            self.global_intact = False  # stays so if an exception (Ctrl+C) cuts the step short
            for g, d in zip(self.global_params, mean_deltas):
                g.grad = d
            self.outer_optimizer.step()
            self.outer_optimizer.zero_grad(set_to_none=True)
            self.global_intact = True

    # --- state for late joiners and checkpoints -------------------------------------------

    def momentum_buffers(self) -> list[torch.Tensor]:
        """The outer SGD's momentum, zeros where it has none yet (before the first round)."""
        buffers = []
        for g in self.global_params:
            buf = self.outer_optimizer.state.get(g, {}).get("momentum_buffer")
            buffers.append(torch.zeros_like(g) if buf is None else buf)
        return buffers

    def outer_state(self, *, inflight_timeout: float = 60.0, inner: bool = True) -> OuterState:
        """A consistent copy of the global state (safe to call from another thread).

        With ``overlap`` the round in flight is part of the state: this waits (at most
        ``inflight_timeout`` s) for its all-reduce and serves its mean as a queued update, so a
        joiner applies it at the end of its first round, as this peer will. ``inner``: with a
        copy of the inner optimizer's state (:class:`~optim.state.InnerStateCopies`; a
        checkpoint saves the optimizer itself)."""
        # Before the first round every peer starts AdamW from zero: so does a joiner.
        copies = self.inner_copies.take() if inner and self.outer_step_count else ([], [])
        return read_settled(self, inflight_timeout, lambda inflight: self._state_with(inflight, copies))

    def checkpoint_state(
        self, *, inflight_timeout: float = 60.0
    ) -> tuple[OuterState, dict[str, Any], Any, list[torch.Tensor] | None]:
        """What a checkpoint keeps, read at once and as it will be when the round in flight
        (``overlap``) is collected: the outer state with its mean queued (:meth:`outer_state`,
        without the inner optimizer's), :meth:`local_state` with the share that round teaches,
        the error-feedback residuals (None without error feedback), and what that round sent if
        the group did not apply it: error feedback takes it back after the next round's encode,
        as the running peer does when it collects the round (:meth:`take_back_later`). Read
        apart, a checkpoint taken while a round was averaging resumed on the share of the round
        before (0.6 for 0.5) and lost a refused round's update (0.09 of the residuals, 0.22 of θ
        after three rounds)."""

        def read(
            inflight: InFlight | None,
        ) -> tuple[OuterState, dict[str, Any], Any, list[torch.Tensor] | None]:
            report = self._landed_report(inflight)
            state = self._state_with(inflight, ([], []), report=report)
            local = self.local_state()
            feedback = self.feedback
            residuals = None if feedback is None or feedback.residuals is None else feedback.residuals
            later = None
            if report is not None:
                outgoing = inflight.outgoing
                if local and not report.failed and outgoing.weight > 0:
                    local["share"] = own_share(report, outgoing.weight)  # as _learn_share will
                sent = outgoing.sent
                if (
                    residuals is not None
                    and sent is not None
                    and not_applied(outgoing, report, self.config.outlier_ratio)
                ):
                    later = [s.clone() for s in sent]
            return state, local, residuals, later

        return read_settled(self, inflight_timeout, read)

    def take_back_later(self, sent: list[torch.Tensor] | None) -> None:
        """(A resumed checkpoint's.) Error feedback takes ``sent`` back at the next round, after
        its encode (whether this peer's update was finite or not);
        one that does not fit the residuals (another model) is dropped with a warning."""
        residuals = self.feedback.residuals if self.feedback is not None else None
        if sent and (
            residuals is None
            or len(sent) != len(residuals)
            or any(not isinstance(s, torch.Tensor) or s.shape != r.shape for s, r in zip(sent, residuals))
        ):
            logger.warning(
                "the checkpoint's update to take back does not fit this model's residuals; dropped"
            )
            sent = None
        self._take_back_later = [s.float() for s in sent] if sent else None

    def _landed_report(self, inflight: InFlight | None) -> RoundReport | None:
        """A judged copy of a landed round's report (the round itself is judged when collected)."""
        if not landed(inflight):
            return None
        report = dataclasses.replace(inflight.future.result())
        judge(inflight.outgoing, report, self.config.outlier_ratio)
        return report

    def _state_with(
        self, inflight: InFlight | None, copies: InnerTensors, *, report: RoundReport | None = None
    ) -> OuterState:
        """The state, its queued means and ``inflight``'s mean if it arrived (under the lock),
        with the inner optimizer's ``copies``; ``report``: its judged report, if already made."""
        keys, tensors = copies
        pending = [[d.clone() for d in update] for update in self._pending]
        report = report if report is not None else self._landed_report(inflight)
        if report is not None and report.applied:  # judge() left it so: not refused
            pending.append([d.clone() for d in inflight.outgoing.deltas])
        return OuterState(
            outer_step=self.outer_step_count,
            params=[g.clone() for g in self.global_params],
            momentum=[m.clone() for m in self.momentum_buffers()],
            inner=list(tensors),
            inner_keys=[list(k) for k in keys],
            pending=pending,
        )

    @torch.no_grad()
    def load_outer_state(self, state: OuterState) -> None:
        """Adopt a downloaded global state and restart the current round from it."""
        shapes = [tuple(g.shape) for g in self.global_params]
        why = shape_mismatch([t.shape for t in state.params], shapes) or shape_mismatch(
            [t.shape for t in state.momentum], shapes
        )
        if why:
            raise ValueError(
                f"the downloaded state does not fit this model ({why}); every peer of a run must use the same model"
            )
        with self.lock:
            self.global_intact = False
            for g, p in zip(self.global_params, state.params):
                g.copy_(p)
            self.global_intact = True
            for g, m in zip(self.global_params, state.momentum):
                self.outer_optimizer.state[g]["momentum_buffer"] = m.clone().to(torch.float32)
            self.outer_step_count = state.outer_step
            # The group's queued updates replace ours (ours was computed from a stale θ); so
            # does an in-flight round's mean (the thread finishes; the next one waits for it).
            self._pending = [[d.clone().float() for d in update] for update in state.pending]
            self._inflight = None
            self._reset_offset()  # a fresh start from the swarm's θ: no stand-ins in flight
            if self.feedback is not None:  # what compression held back was this peer's old θ's
                self.feedback.reset()  # (a checkpoint's residuals are loaded after this)
                self._take_back_later = None
        self.restore_parameters()
        self._load_inner_state(state)
        self.inner_step_count = 0
        self.samples_this_round = 0

    def _load_inner_state(self, state: OuterState) -> None:
        load_inner_state(self.inner_optimizer, self.params, state)

    def fingerprint(self) -> list[float]:
        """Per-tensor L2 norms of θ: peers on the same trajectory agree to ~1e-6 relative."""
        with self.lock:
            return [float(g.double().norm()) for g in self.global_params]

    @torch.no_grad()
    def settled_global(self) -> list[torch.Tensor]:
        """A copy of θ_global as :meth:`finish` would leave it, without waiting or changing
        anything: the means still queued (``delay``), and the round in flight's if it has landed
        and passes the checks, applied to copies of θ and the outer momentum. What a peer stopped
        mid-run (Ctrl+C, how a run without ``--rounds`` ends) writes as the swarm's model: θ alone
        lacked the last mean the group had averaged."""
        with self.lock:
            state = self._state_with(self._inflight, ([], []))
            settings = [
                {k: v for k, v in g.items() if k != "params"} for g in self.outer_optimizer.param_groups
            ]
        if not state.pending:
            return state.params
        shadow = [torch.nn.Parameter(p, requires_grad=False) for p in state.params]
        sgd = self._outer_sgd(shadow)
        for group, setting in zip(sgd.param_groups, settings):  # steered values included
            group.update(setting)
        for p, m in zip(shadow, state.momentum):
            sgd.state[p]["momentum_buffer"] = m
        for update in state.pending:
            for p, d in zip(shadow, update):
                p.grad = d
            sgd.step()
        return [p.detach() for p in shadow]

    def read_global(self, read: Callable[[list[torch.Tensor]], Any]) -> Any:
        """``read(θ_global)`` under the lock, without a copy (``read`` must not keep or change it)."""
        with self.lock:
            return read(self.global_params)

    def with_global(self, run: Callable[[], T]) -> T:
        """``run()`` with the model holding θ_global (what the swarm agrees on, and what eval
        losses report) in place of the params this peer trains (θ plus what a delayed,
        overlapped or eager round has not settled yet), under the lock; those put back after."""
        with self.lock:
            if self._holds_global():
                return run()  # the model holds θ since the last round: nothing to swap (nor copy)
            with holding(self.params, self.global_params):
                return run()
