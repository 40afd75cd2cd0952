"""Streaming DiLoCo: sync one fragment of the model at a time, on staggered schedules.

Douillard et al., 2025, "Streaming DiLoCo with overlapping communication",
https://arxiv.org/abs/2501.18512 (see also torchft's ``torchft/local_sgd.py``).

The parameters are split into F contiguous fragments of about equal size. Fragment f is
synced every H inner steps like DiLoCo, but at its own offset ``(f + 1)·H/F``, so at any time
at most one fragment is on the wire: peak bytes per sync drop F-fold. Its reduction starts at
step t and is *merged* τ steps later (``sync_delay``), so on a real network the all-reduce
overlaps τ inner steps; the merge mixes ``alpha·θ_local + (1 − alpha)·θ_global`` for the
fragment (alpha = 0 replaces the local fragment by the global one, as plain DiLoCo does).

Phases for one fragment: ``begin_sync`` (pseudo-gradient of the fragment, codec, average)
→ τ inner steps → ``merge`` (outer SGD on the fragment's θ, then mix into the model).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from optim.averager import Averager, RoundReport
from optim.codecs import all_finite, encoded_nbytes
from optim.contribution import Outgoing, global_norm, judge, not_applied, take_back_unapplied
from optim.diloco import (
    DiLoCoConfig,
    OuterState,
    in_background,
    landed,
    load_inner_state,
    pseudo_gradient,
    read_settled,
)
from optim.eager import SGD
from optim.state import InnerStateCopies, InnerTensors, holding, warn_unsynced_buffers

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(kw_only=True)
class StreamingConfig:
    """Streaming DiLoCo's settings: DiLoCo's outer step (``outer``) plus the fragment schedule."""

    outer: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    """H, outer SGD, codec and error feedback, exactly as DiLoCo takes them (``delay`` unused)."""
    fragments: int = 4
    """F: how many fragments the parameters are split into (contiguous, about equal bytes)."""
    sync_delay: int = 0
    """τ: inner steps between the start of a fragment's reduction and its merge (< H/F)."""
    alpha: float | None = None
    """Merge mixing: weight of the local fragment (0 = take the global fragment). None: 0.5 with
    τ > 0 (the paper's choice when the merge overlaps inner steps), else 0."""

    @property
    def inner_steps(self) -> int:
        """H: inner steps between two syncs of the same fragment."""
        return self.outer.inner_steps

    def __post_init__(self) -> None:
        if self.alpha is None:
            self.alpha = 0.5 if self.sync_delay else 0.0
        if self.fragments < 1:
            raise ValueError(f"fragments must be >= 1 (got {self.fragments})")
        if self.outer.delay:
            raise ValueError(
                "streaming delays merges with sync_delay (in steps), not the outer delay (in rounds)"
            )
        if self.outer.topk_mean != "group":
            raise ValueError(
                "streaming averages each fragment over the whole group: topk_mean 'kept' is for "
                "diloco, local_sgd and sparseloco (use topk_mean 'group')"
            )
        if self.fragments > self.inner_steps:
            raise ValueError(
                f"fragments ({self.fragments}) must not exceed inner_steps ({self.inner_steps}): each fragment "
                "needs its own step in the round"
            )
        if not 0 <= self.sync_delay < self.inner_steps // self.fragments:
            raise ValueError(
                f"sync_delay must be in [0, H/F) = [0, {self.inner_steps // self.fragments}) "
                f"(got {self.sync_delay}): a fragment must merge before the next one starts"
            )
        if not 0 <= self.alpha < 1:
            raise ValueError(f"alpha must be in [0, 1) (got {self.alpha}); the paper uses 0.5 or less")


DEFAULT_FRAGMENTS = 4


def default_fragments(inner_steps: int) -> int:
    """The fragment count when none is given: 4, or (real peers sync a fragment every H/F
    steps, so F must divide H) the count in 2..8 nearest 4 that divides H (the smaller on a
    tie); 4 if none does (the run's own check then says what to change)."""
    if inner_steps % DEFAULT_FRAGMENTS == 0:
        return DEFAULT_FRAGMENTS
    fits = [n for n in range(2, 9) if inner_steps % n == 0]
    return min(fits, key=lambda n: (abs(n - DEFAULT_FRAGMENTS), n)) if fits else DEFAULT_FRAGMENTS


def split_fragments(sizes: list[int], fragments: int) -> list[list[int]]:
    """Split parameter indices into ``fragments`` contiguous groups whose largest total size is
    as small as it can be (binary search on that size, then greedy packing), so the peak
    bytes per sync is as close to 1/F of the model as whole tensors allow."""
    if fragments > len(sizes):
        raise ValueError(f"{fragments} fragments but the model has only {len(sizes)} parameter tensors")

    def pack(capacity: int) -> list[list[int]]:
        groups: list[list[int]] = [[]]
        filled = 0
        for index, size in enumerate(sizes):
            if groups[-1] and filled + size > capacity:
                groups.append([])
                filled = 0
            groups[-1].append(index)
            filled += size
        return groups

    low, high = max(sizes), sum(sizes)
    while low < high:
        middle = (low + high) // 2
        if len(pack(middle)) <= fragments:
            high = middle
        else:
            low = middle + 1
    groups = pack(low)
    while len(groups) < fragments:  # fewer groups than asked: split the largest splittable one
        total = lambda group: sum(sizes[i] for i in group)  # noqa: E731
        at = max((i for i, g in enumerate(groups) if len(g) > 1), key=lambda i: total(groups[i]))
        groups[at : at + 1] = [groups[at][:-1], groups[at][-1:]]
    assert len(groups) == fragments and all(groups), f"{groups=}"
    return groups


class StreamingDiLoCo:
    """Wraps ``model`` and its inner optimizer; syncs one fragment at a time."""

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        averager: Averager | Sequence[Averager],
        config: StreamingConfig,
    ) -> None:
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.config = config
        self.params = [p for p in model.parameters() if p.requires_grad]
        warn_unsynced_buffers(model)
        self.fragments = split_fragments([p.numel() for p in self.params], config.fragments)
        # One transport for every fragment (the simulator), or one per fragment (a real swarm,
        # where each fragment is its own hivemind averaging group with its own tensor shapes).
        self.averagers = (
            list(averager) if isinstance(averager, Sequence) else [averager] * len(self.fragments)
        )
        assert len(self.averagers) == len(self.fragments), f"{len(self.averagers)=} {len(self.fragments)=}"
        self.global_params = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
        self.global_intact = True
        """False once a change of θ was cut short by an exception (see DiLoCo.global_intact)."""
        self.outer_optimizer = SGD(
            self.global_params,
            lr=config.outer.outer_lr,
            momentum=config.outer.outer_momentum,
            nesterov=config.outer.nesterov,
        )
        self.codec = config.outer.make_codec()
        self.feedback = [config.outer.make_feedback(self.codec) for _ in self.fragments]
        self.step_count = 0
        """Inner steps taken."""
        self.syncs = 0
        """Fragment syncs merged."""
        self.samples_since = [0] * len(self.fragments)
        self._pending: dict[
            int, tuple[int, list[torch.Tensor], bool]
        ] = {}  # merge step -> (fragment, mean Δ, refused)

    @property
    def outer_step_count(self) -> int:
        """Whole-model rounds completed: every fragment merged once per round."""
        return self.syncs // len(self.fragments)

    def with_global(self, run: Callable[[], T]) -> T:
        """``run()`` with the model holding θ_global, the swarm's model, in place of this peer's
        (its fragments are out of step with each other, and α-mixed at each merge); put back after."""
        with holding(self.params, self.global_params):
            return run()

    def before_inner_step(self, *, samples: int, info: dict[str, Any] | None = None) -> RoundReport | None:
        return None

    def after_inner_step(self, *, samples: int, info: dict[str, Any] | None = None) -> RoundReport | None:
        """Call after every inner step; returns the report of a fragment sync started now."""
        self.step_count += 1
        self.samples_since = [s + samples for s in self.samples_since]
        report = None
        due = self._pending.pop(self.step_count, None)
        if due is not None:
            self.merge(*due)
        H, F = self.config.inner_steps, len(self.fragments)
        offset = self.step_count % H
        for f in range(F):
            if offset == ((f + 1) * H // F) % H:
                report = self.begin_sync(f, info)
                if self.config.sync_delay == 0:
                    self.merge(*self._pending.pop(self.step_count))
        return report

    step = after_inner_step

    def finish(self) -> None:
        """End the run: merge every fragment whose all-reduce is done but whose merge was still
        τ steps away, oldest first (otherwise the last τ steps' syncs would be lost)."""
        for step in sorted(self._pending):
            self.merge(*self._pending.pop(step))

    @torch.no_grad()
    def begin_sync(self, f: int, info: dict[str, Any] | None) -> RoundReport:
        """Pseudo-gradient of fragment ``f`` → codec → averager → the robust checks; merged
        ``sync_delay`` steps later."""
        start = time.monotonic()
        outgoing = self.outgoing(f, info)
        report = self.averagers[f].all_reduce(outgoing.deltas, weight=outgoing.weight, info=outgoing.info)
        refused = self.judge(f, outgoing, report)
        report.seconds = time.monotonic() - start
        self._pending[self.step_count + self.config.sync_delay] = (f, outgoing.deltas, bool(refused))
        return report

    def judge(self, f: int, outgoing: Outgoing, report: RoundReport) -> str | None:
        """As DiLoCo judges a round (optim.contribution.judge): fill in the report; why fragment
        ``f``'s mean must not be merged (an outlier, a misreported norm, NaN/Inf), or None."""
        refused = judge(outgoing, report, self.config.outer.outlier_ratio)
        take_back_unapplied(self.feedback[f], outgoing, report, self.config.outer.outlier_ratio)
        if refused:
            logger.error("fragment %d: %s", f, refused)
        return refused

    @torch.no_grad()
    def outgoing(self, f: int, info: dict[str, Any] | None = None) -> Outgoing:
        """Fragment ``f``'s pseudo-gradient as it goes on the wire (clipped to
        ``outer.clip_norm``, codec, error feedback), its averaging weight (samples since its
        last sync), its payload in bytes, and ``info`` with the norm and weight every member's
        robust check reads (as DiLoCo's)."""
        indices = self.fragments[f]
        # θ as the model started from it (in bf16 parameters' dtype, as DiLoCo takes it): an fp32
        # θ put its own rounding into every Δ, and a round without training moved θ.
        deltas = [pseudo_gradient(self.global_params[i], self.params[i]) for i in indices]
        if not all_finite(deltas):
            # As DiLoCo: a diverged peer sends nothing (weight 0), starts again from the swarm's θ
            # (every fragment: NaN spreads through the whole model in one step, and α mixing
            # would keep it) and its AdamW moments afresh. Sent on, the NaN stopped the codec
            # and, in the simulator, every peer.
            logger.error(
                "fragment %d: this peer's pseudo-gradient holds NaN/Inf; not sent, restarting from θ", f
            )
            with torch.no_grad():
                for p, g in zip(self.params, self.global_params):
                    p.copy_(g.to(p.device, p.dtype))
            self.inner_optimizer.state.clear()
            # Every fragment's count too: another's next Δ holds only the steps from here (it
            # went out with all of them: twice its weight, a review, stop 72).
            self.samples_since = [0] * len(self.samples_since)
            zeros = [torch.zeros_like(d) for d in deltas]
            return Outgoing(zeros, dict(info or {}, norm=0.0, weight=0.0), 0.0, 0.0, 0, True, self.syncs)
        local_norm = global_norm(deltas)
        clip = self.config.outer.clip_norm
        if clip and local_norm > clip:
            deltas = [d * (clip / local_norm) for d in deltas]
        if self.feedback[f] is not None:
            encoded, deltas = self.feedback[f].compress(deltas)
            payload = encoded_nbytes(encoded)
        else:
            deltas, payload = self.codec.round_trip(deltas)
        weight = float(max(self.samples_since[f], 1))
        self.samples_since[f] = 0
        info = dict(info or {}, norm=global_norm(deltas), weight=weight)
        sent = [d.clone() for d in deltas] if self.feedback[f] is not None else None
        return Outgoing(deltas, info, weight, local_norm, payload, False, self.syncs, sent)

    @torch.no_grad()
    def merge(self, f: int, mean_deltas: list[torch.Tensor], refused: bool = False) -> None:
        """Outer SGD on the fragment's θ, then mix it into the model's fragment. ``refused`` (by
        the robust checks, :meth:`judge`, which refuses a NaN/Inf mean too): θ stays, and the
        model's fragment is still mixed with it, as DiLoCo puts every peer back on θ after a
        refused round (an outlier's fragment would otherwise go out again the next time)."""
        indices = self.fragments[f]
        if refused or not all_finite(mean_deltas):  # (not finite: judged refused before)
            self.mix(f)
            self.syncs += 1
            return
        self.global_intact = False  # stays so if an exception (Ctrl+C) cuts the step short
        for i, d in zip(indices, mean_deltas):
            self.global_params[i].grad = d
        self.outer_optimizer.step()  # params without .grad are skipped
        self.outer_optimizer.zero_grad(set_to_none=True)
        self.global_intact = True
        self.mix(f)
        self.syncs += 1

    @torch.no_grad()
    def mix(self, f: int) -> None:
        """Mix fragment ``f``'s θ into the model's fragment: ``alpha·local + (1 − alpha)·θ``."""
        alpha = self.config.alpha
        for i in self.fragments[f]:
            p, g = self.params[i], self.global_params[i].to(self.params[i].device, self.params[i].dtype)
            p.copy_(alpha * p + (1 - alpha) * g)


class StreamingRounds:
    """Streaming DiLoCo for round-driven loops (a real peer): one "round" = the inner steps up to
    the next fragment sync (H/F), then that fragment's sync. Presents the surface a peer uses on
    :class:`~optim.diloco.DiLoCo` (clock, ``note_inner_step``, ``sync``, state for joiners);
    the clock ``outer_step_count`` counts fragment syncs started.

    With ``sync_delay`` τ > 0 the fragment's all-reduce runs in the background while the next
    round's first τ inner steps train, and is merged after the τ-th (as in the simulator, and as
    Douillard et al. 2025 overlap it). The clock moves on when the all-reduce starts, like
    DiLoCo's ``overlap``: a peer's heartbeat shows the round it trains, one past the fragment it
    averages. The state served to joiners is the one every peer of the round holds once that
    merge lands (so it is the same whenever in the round it is asked for); the round's θ
    fingerprint is taken at the sync, after the merge, where every peer's θ is that state.
    """

    def __init__(self, streaming: StreamingDiLoCo) -> None:
        config = streaming.config
        if config.inner_steps % config.fragments:
            raise ValueError(
                f"on real peers streaming needs H ({config.inner_steps}) divisible by the fragments "
                f"({config.fragments}): e.g. H=48 with 4 fragments"
            )
        self.streaming = streaming
        self.steps_per_round = config.inner_steps // config.fragments
        self.inner_step_count = 0
        self.lock = threading.Lock()
        self.global_params = streaming.global_params
        self.inner_copies = InnerStateCopies(
            streaming.inner_optimizer, params=streaming.params
        )  # copied when asked
        self._clock = streaming.syncs
        self._inflight: _FragmentInFlight | None = None
        self._landed: RoundReport | None = None  # the merged fragment's report, for the next sync
        self._unmixed: int | None = None  # a fragment θ holds merged, the model not yet (a resume)

    @property
    def outer_step_count(self) -> int:
        return self._clock

    @property
    def global_intact(self) -> bool:
        """See :attr:`StreamingDiLoCo.global_intact`."""
        return self.streaming.global_intact

    @property
    def sync_delay(self) -> int:
        return self.streaming.config.sync_delay

    @property
    def feedback(self) -> list[Any]:
        """Each fragment's error-feedback memory (None without one): what a checkpoint keeps."""
        return self.streaming.feedback

    def local_state(self) -> dict[str, Any]:
        """What a checkpoint keeps beside the outer state (taken after :meth:`outer_state`): the
        samples each fragment trained since its last sync (its weight at the next one), and the
        fragment in flight (τ > 0), whose merge the outer state holds but the model does not yet."""
        inflight = self._inflight
        return {
            "samples_since": list(self.streaming.samples_since),
            "in_flight": inflight.fragment if inflight is not None and landed(inflight) else None,
        }

    def checkpoint_state(
        self, *, inflight_timeout: float = 60.0
    ) -> tuple[OuterState, dict[str, Any], list[Any], dict[str, Any] | None]:
        """What a checkpoint keeps, read at once once the fragment in flight (τ > 0) has landed,
        as :meth:`optim.diloco.DiLoCo.checkpoint_state`: the outer state with its merge, the
        :meth:`local_state`, each fragment's error-feedback residuals, and that fragment's sent
        values if the group will not apply them (``{"fragment": f, "sent": [...]}``): error
        feedback takes them back as the running peer does when the fragment lands
        (:meth:`take_back_later`). Without it a checkpoint taken while a refused fragment was
        in flight lost that fragment's update: neither in θ nor in the residual (a review, stop 60:
        0.9 of θ away from the uninterrupted run four syncs later)."""
        ratio = self.streaming.config.outer.outlier_ratio

        def read(inflight: _FragmentInFlight | None):
            state = self._state_with(inflight, ([], []))
            residuals = [memory.residuals if memory is not None else None for memory in self.feedback]
            later = None
            if landed(inflight):
                memory = self.feedback[inflight.fragment]
                report = dataclasses.replace(inflight.future.result())  # judged as _land() will
                judge(inflight.outgoing, report, ratio)
                sent = inflight.outgoing.sent
                if (
                    memory is not None
                    and memory.residuals is not None
                    and sent is not None
                    and not_applied(inflight.outgoing, report, ratio)
                ):
                    later = {"fragment": inflight.fragment, "sent": [s.clone() for s in sent]}
            return state, self.local_state(), residuals, later

        return read_settled(self, inflight_timeout, read)

    def take_back_later(self, later: Any) -> None:
        """(A resumed checkpoint's, after its residuals.) The fragment that was in flight and
        refused: its memory takes back what it sent, as landing would have (before that
        fragment's next encode, which alone reads its memory). One that does not fit (another
        model) is dropped with a warning."""
        if not later:
            return
        fragment, sent = (
            (later.get("fragment"), later.get("sent")) if isinstance(later, dict) else (None, None)
        )
        memory = (
            self.feedback[fragment]
            if isinstance(fragment, int)
            and not isinstance(fragment, bool)
            and 0 <= fragment < len(self.feedback)
            else None
        )
        residuals = memory.residuals if memory is not None else None
        if (
            residuals is None
            or not isinstance(sent, list)
            or len(sent) != len(residuals)
            or any(not isinstance(s, torch.Tensor) or s.shape != r.shape for s, r in zip(sent, residuals))
        ):
            logger.warning("the checkpoint's refused fragment does not fit this model's fragments: dropped")
            return
        memory.take_back(sent)

    def load_local_state(self, state: dict[str, Any]) -> None:
        """The inverse of :meth:`local_state`, after :meth:`load_outer_state` and with the model
        as it was saved. θ holds the merge of the fragment that was in flight; the model takes it
        τ inner steps into this round, as it would have."""
        s = self.streaming
        since = state.get("samples_since")
        if isinstance(since, list) and len(since) == len(s.fragments):
            s.samples_since = [int(n) for n in since]
        fragment = state.get("in_flight")
        if isinstance(fragment, int) and not isinstance(fragment, bool) and 0 <= fragment < len(s.fragments):
            self._unmixed = fragment

    def _mix_resumed(self) -> None:
        """Mix the fragment merged into θ before a resume into the model (see load_local_state)."""
        if self._unmixed is not None:
            with self.lock:
                self.streaming.mix(self._unmixed)
                self._unmixed = None

    def retune(
        self, *, outer_lr: float | None = None, inner_steps: int | None = None, codec: str | None = None
    ) -> dict[str, Any]:
        """Change settings between syncs (steering), as :meth:`optim.diloco.DiLoCo.retune`;
        a new H must stay divisible by the number of fragments, and leave room for τ."""
        s, outer = self.streaming, self.streaming.config.outer
        changes = {
            k: v
            for k, v in dict(outer_lr=outer_lr, inner_steps=inner_steps, codec=codec).items()
            if v is not None and getattr(outer, k) != v
        }
        if not changes:
            return {}
        checked = dataclasses.replace(outer, **changes)
        if checked.inner_steps % len(s.fragments):
            raise ValueError(
                f"H={checked.inner_steps} is not divisible by the {len(s.fragments)} fragments of this run"
            )
        if checked.inner_steps // len(s.fragments) <= self.sync_delay:
            raise ValueError(
                f"H={checked.inner_steps} leaves {checked.inner_steps // len(s.fragments)} steps per fragment, "
                f"not more than this run's --sync-delay {self.sync_delay}"
            )
        for key, value in changes.items():
            setattr(outer, key, value)
        with self.lock:
            for group in s.outer_optimizer.param_groups:
                group["lr"] = outer.outer_lr
        self.steps_per_round = outer.inner_steps // len(s.fragments)
        if "codec" in changes:
            s.codec = outer.make_codec()
            s.feedback = [outer.make_feedback(s.codec) for _ in s.fragments]
        return changes

    def note_inner_step(self, *, samples: int) -> None:
        self.inner_step_count += 1
        self.streaming.step_count += 1
        self.streaming.samples_since = [s + samples for s in self.streaming.samples_since]
        self.inner_copies.boundary()  # before a merge that waits for its all-reduce
        if self._inflight is not None and self.inner_step_count >= self.sync_delay:
            self._landed = self._land()
        if self.inner_step_count >= self.sync_delay:
            self._mix_resumed()

    def sync(self, *, info: dict[str, Any] | None = None) -> RoundReport:
        """Sync the fragment whose turn it is: at once (τ = 0), or start its all-reduce in the
        background (τ > 0; the report is then that of the fragment merged this round)."""
        s = self.streaming
        self.inner_copies.leave()
        fragment = self._clock % len(s.fragments)
        if not self.sync_delay:
            report = s.begin_sync(fragment, info)
            with self.lock:
                s.merge(*s._pending.pop(s.step_count))
                self._clock += 1
        else:
            # Normally merged τ steps into this round already; a round shorter than τ (H
            # steered down, a joiner's or a resynced peer's first round cut to meet the
            # others at the barrier) merges here, before the next fragment goes out.
            report = self._land() if self._inflight is not None else self._landed
            self._landed = None
            self._mix_resumed()
            if info and "fingerprint" in info:  # taken after that merge: every peer's θ is the same here
                info = dict(info, fingerprint=self.fingerprint())
            start = time.monotonic()
            outgoing = s.outgoing(fragment, info)
            averager = s.averagers[fragment]
            with self.lock:
                self._inflight = _FragmentInFlight(
                    fragment,
                    outgoing,
                    start,
                    in_background(
                        averager.all_reduce, outgoing.deltas, weight=outgoing.weight, info=outgoing.info
                    ),
                )
                self._clock += 1
            if report is None:  # the first sync: nothing merged yet
                report = RoundReport(group_size=1, pending=True, info=outgoing.info)
        self.inner_step_count = 0
        self.inner_copies.enter()
        return report

    def _land(self) -> RoundReport:
        """Wait for the fragment in flight and merge it; its report."""
        inflight = self._inflight
        assert inflight is not None
        report = inflight.future.result()  # re-raises only what stops the run
        refused = self.streaming.judge(inflight.fragment, inflight.outgoing, report)
        report.seconds = time.monotonic() - inflight.start
        with self.lock:
            self.streaming.merge(inflight.fragment, inflight.outgoing.deltas, bool(refused))
            self._inflight = None
        return report

    def finish(self) -> RoundReport | None:
        """End the run on the swarm's θ: merge the fragment still in flight (τ > 0)."""
        self.inner_copies.leave()  # no inner step comes any more: askers copy at once
        self._mix_resumed()
        return self._land() if self._inflight is not None else None

    def fingerprint(self) -> list[float]:
        with self.lock:
            return [float(g.double().norm()) for g in self.global_params]

    def read_global(self, read: Callable[[list[torch.Tensor]], Any]) -> Any:
        """``read(θ_global)`` under the lock, without a copy (``read`` must not keep or change it)."""
        with self.lock:
            return read(self.global_params)

    def settled_global(self) -> list[torch.Tensor]:
        """A copy of θ_global with the merge of the fragment in flight (τ > 0) if its mean has
        landed and passes the checks, changing nothing: what a peer stopped mid-run writes (as
        :meth:`optim.diloco.DiLoCo.settled_global`)."""
        with self.lock:
            return self._state_with(self._inflight, ([], [])).params

    def with_global(self, run: Callable[[], T]) -> T:
        """As :meth:`StreamingDiLoCo.with_global`, under the lock (no merge meanwhile)."""
        with self.lock:
            return self.streaming.with_global(run)

    def _momentum(self) -> list[torch.Tensor]:
        state = self.streaming.outer_optimizer.state
        return [state.get(g, {}).get("momentum_buffer", torch.zeros_like(g)) for g in self.global_params]

    def outer_state(self, *, inflight_timeout: float = 60.0, inner: bool = True) -> OuterState:
        """A consistent copy of the global state (safe from another thread). With a fragment in
        flight this waits (at most ``inflight_timeout`` s) for its all-reduce and serves θ and
        momentum with its merge applied, as this peer will hold them once it lands. ``inner``:
        as :meth:`optim.diloco.DiLoCo.outer_state`."""
        # Before the first round every peer starts AdamW from zero: so does a joiner.
        copies = self.inner_copies.take() if inner and self._clock else ([], [])
        return read_settled(self, inflight_timeout, lambda inflight: self._state_with(inflight, copies))

    def _state_with(self, inflight: _FragmentInFlight | None, copies: InnerTensors) -> OuterState:
        """θ and momentum with ``inflight``'s merge applied if its mean arrived (under the lock),
        with the inner optimizer's ``copies``."""
        s = self.streaming
        keys, tensors = copies
        params = [g.clone() for g in self.global_params]
        momentum = [m.clone() for m in self._momentum()]
        if landed(inflight) and not judge(  # as _land() will judge it (on a copy of the report)
            inflight.outgoing, dataclasses.replace(inflight.future.result()), s.config.outer.outlier_ratio
        ):
            indices = s.fragments[inflight.fragment]
            _outer_step_on_copies(
                [params[i] for i in indices],
                [momentum[i] for i in indices],
                inflight.outgoing.deltas,
                s.outer_optimizer.param_groups[0],
                fresh=[self.global_params[i] not in s.outer_optimizer.state for i in indices],
            )
        return OuterState(
            outer_step=self._clock,
            params=params,
            momentum=momentum,
            inner=list(tensors),
            inner_keys=[list(k) for k in keys],
        )

    @torch.no_grad()
    def load_outer_state(self, state: OuterState) -> None:
        s = self.streaming
        if [tuple(t.shape) for t in state.params] != [tuple(g.shape) for g in self.global_params]:
            raise ValueError(
                "the downloaded state does not fit this model; every peer of a run must use the same model"
            )
        with self.lock:
            s.global_intact = False
            for g, p, m in zip(self.global_params, state.params, state.momentum):
                g.copy_(p)
                s.outer_optimizer.state[g]["momentum_buffer"] = m.clone().float()
            s.global_intact = True
            s.syncs = self._clock = state.outer_step
            s.step_count = state.outer_step * self.steps_per_round
            s.samples_since = [0] * len(s.fragments)
            # A fragment in flight was computed from a stale θ; its merge is in the state (the
            # thread finishes on its own; its result is dropped).
            self._inflight, self._landed, self._unmixed = None, None, None
            for memory in s.feedback:  # held back from this peer's old θ's fragments
                if memory is not None:
                    memory.reset()
            for p, g in zip(s.params, self.global_params):
                p.copy_(g.to(p.device, p.dtype))
        load_inner_state(s.inner_optimizer, s.params, state)
        self.inner_step_count = 0


@dataclass
class _FragmentInFlight:
    fragment: int
    outgoing: Outgoing  # its deltas hold the fragment's mean once the future is done
    start: float
    future: concurrent.futures.Future


@torch.no_grad()
def _outer_step_on_copies(
    params: list[torch.Tensor],
    momentum: list[torch.Tensor],
    grads: list[torch.Tensor],
    group: dict[str, Any],
    fresh: list[bool],
) -> None:
    """torch's SGD step (lr, momentum, Nesterov; no weight decay or dampening) on copies of θ
    and momentum, in place: what ``outer_optimizer.step()`` will do to the originals.
    ``fresh``: tensors without a momentum buffer yet (SGD's first step copies the gradient)."""
    assert not group.get("weight_decay") and not group.get("dampening"), "outer SGD has neither"
    lr, beta, nesterov = group["lr"], group["momentum"], group["nesterov"]
    for p, m, g, new in zip(params, momentum, grads, fresh):
        step = g
        if beta:
            if new:
                m.copy_(g)
            else:
                m.mul_(beta).add_(g)
            step = g.add(m, alpha=beta) if nesterov else m
        p.add_(step, alpha=-lr)
