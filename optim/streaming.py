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

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from optim.averager import Averager, RoundReport
from optim.codecs import encoded_nbytes
from optim.diloco import DiLoCoConfig, OuterState, inner_state_tensors, load_inner_state

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class StreamingConfig:
    """Streaming DiLoCo's settings: DiLoCo's outer step (``outer``) plus the fragment schedule."""

    outer: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    """H, outer SGD, codec and error feedback, exactly as DiLoCo takes them (``delay`` unused)."""
    fragments: int = 4
    """F: how many fragments the parameters are split into (contiguous, about equal bytes)."""
    sync_delay: int = 0
    """τ: inner steps between the start of a fragment's reduction and its merge (< H/F)."""
    alpha: float = 0.0
    """Merge mixing: weight of the local fragment (0 = take the global fragment)."""

    @property
    def inner_steps(self) -> int:
        """H: inner steps between two syncs of the same fragment."""
        return self.outer.inner_steps

    def __post_init__(self) -> None:
        if self.fragments < 1:
            raise ValueError(f"fragments must be >= 1 (got {self.fragments})")
        if self.outer.delay:
            raise ValueError(
                "streaming delays merges with sync_delay (in steps), not the outer delay (in rounds)"
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
        self.fragments = split_fragments([p.numel() for p in self.params], config.fragments)
        # One transport for every fragment (the simulator), or one per fragment (a real swarm,
        # where each fragment is its own hivemind averaging group with its own tensor shapes).
        self.averagers = (
            list(averager) if isinstance(averager, Sequence) else [averager] * len(self.fragments)
        )
        assert len(self.averagers) == len(self.fragments), f"{len(self.averagers)=} {len(self.fragments)=}"
        self.global_params = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
        self.outer_optimizer = torch.optim.SGD(
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
        self._pending: dict[int, tuple[int, list[torch.Tensor]]] = {}  # merge step -> (fragment, mean Δ)

    @property
    def outer_step_count(self) -> int:
        """Whole-model rounds completed: every fragment merged once per round."""
        return self.syncs // len(self.fragments)

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
        """Pseudo-gradient of fragment ``f`` → codec → averager; merged ``sync_delay`` steps later."""
        start = time.monotonic()
        indices = self.fragments[f]
        deltas = [self.global_params[i] - self.params[i].detach().to("cpu", torch.float32) for i in indices]
        if self.feedback[f] is not None:
            encoded, deltas = self.feedback[f].compress(deltas)
        else:
            encoded = [self.codec.encode(d) for d in deltas]
            deltas = [self.codec.decode(e) for e in encoded]
        report = self.averagers[f].all_reduce(deltas, weight=float(max(self.samples_since[f], 1)), info=info)
        self.samples_since[f] = 0
        report.payload_bytes = encoded_nbytes(encoded)
        report.seconds = time.monotonic() - start
        self._pending[self.step_count + self.config.sync_delay] = (f, deltas)
        return report

    @torch.no_grad()
    def merge(self, f: int, mean_deltas: list[torch.Tensor]) -> None:
        """Outer SGD on the fragment's θ, then mix it into the model's fragment."""
        indices = self.fragments[f]
        if not all(torch.isfinite(d).all() for d in mean_deltas):
            logger.error("fragment %d: the averaged update holds NaN/Inf; left unchanged", f)
            return
        for i, d in zip(indices, mean_deltas):
            self.global_params[i].grad = d
        self.outer_optimizer.step()  # params without .grad are skipped
        self.outer_optimizer.zero_grad(set_to_none=True)
        alpha = self.config.alpha
        for i in indices:
            p, g = self.params[i], self.global_params[i].to(self.params[i].device, self.params[i].dtype)
            p.copy_(alpha * p + (1 - alpha) * g)
        self.syncs += 1


class StreamingRounds:
    """Streaming DiLoCo for round-driven loops (a real peer): one "round" = the inner steps up to
    the next fragment sync (H/F), then that fragment's sync. Presents the surface a peer uses on
    :class:`~optim.diloco.DiLoCo` (clock, ``note_inner_step``, ``sync``, state for joiners);
    the clock ``outer_step_count`` counts fragment syncs.
    """

    def __init__(self, streaming: StreamingDiLoCo) -> None:
        config = streaming.config
        if config.inner_steps % config.fragments or config.sync_delay:
            raise ValueError(
                f"on real peers streaming needs H ({config.inner_steps}) divisible by the fragments "
                f"({config.fragments}) and sync_delay 0 (got {config.sync_delay}): e.g. H=48 with 4 fragments"
            )
        self.streaming = streaming
        self.steps_per_round = config.inner_steps // config.fragments
        self.inner_step_count = 0
        self.lock = threading.Lock()
        self.global_params = streaming.global_params
        self._inner_snapshot: tuple[list[list[Any]], list[torch.Tensor]] = ([], [])

    @property
    def outer_step_count(self) -> int:
        return self.streaming.syncs

    def retune(
        self, *, outer_lr: float | None = None, inner_steps: int | None = None, codec: str | None = None
    ) -> dict[str, Any]:
        """Change settings between syncs (steering), as :meth:`optim.diloco.DiLoCo.retune`;
        a new H must stay divisible by the number of fragments."""
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

    def sync(self, *, info: dict[str, Any] | None = None) -> RoundReport:
        """Sync the fragment whose turn it is, and merge it at once."""
        s = self.streaming
        fragment = s.syncs % len(s.fragments)
        report = s.begin_sync(fragment, info)
        with self.lock:
            s.merge(*s._pending.pop(s.step_count))
        self.inner_step_count = 0
        self.snapshot_inner_state()
        return report

    def snapshot_inner_state(self) -> None:
        snapshot = inner_state_tensors(self.streaming.inner_optimizer)
        with self.lock:
            self._inner_snapshot = snapshot

    def fingerprint(self) -> list[float]:
        with self.lock:
            return [float(g.double().norm()) for g in self.global_params]

    def _momentum(self) -> list[torch.Tensor]:
        state = self.streaming.outer_optimizer.state
        return [state.get(g, {}).get("momentum_buffer", torch.zeros_like(g)) for g in self.global_params]

    def outer_state(self) -> OuterState:
        with self.lock:
            keys, tensors = self._inner_snapshot
            return OuterState(
                outer_step=self.streaming.syncs,
                params=[g.clone() for g in self.global_params],
                momentum=[m.clone() for m in self._momentum()],
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
            for g, p, m in zip(self.global_params, state.params, state.momentum):
                g.copy_(p)
                s.outer_optimizer.state[g]["momentum_buffer"] = m.clone().float()
            s.syncs = state.outer_step
            s.step_count = state.outer_step * self.steps_per_round
            s.samples_since = [0] * len(s.fragments)
            for p, g in zip(s.params, self.global_params):
                p.copy_(g.to(p.device, p.dtype))
        load_inner_state(s.inner_optimizer, s.params, state)
        self.inner_step_count = 0
