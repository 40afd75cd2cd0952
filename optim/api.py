"""The optimizer family's one interface: what every outer loop offers the loop that trains
with it, and the registry of the methods a run can name (``--method``).

Callers ask a :class:`Method` what it does (does it sync every step? in fragments? which
knobs does it take?) instead of comparing its name; a new method is one entry in
:data:`METHODS`. Torch-free at import (the command line's ``--help`` reads this registry);
the optimizers load when :meth:`Method.build` or :meth:`Method.preset` runs.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    import torch

    from optim.averager import Averager, RoundReport
    from optim.diloco import DiLoCoConfig
    from optim.state import OuterState

T = TypeVar("T")


@runtime_checkable
class OuterOptimizer(Protocol):
    """What a training loop drives (DiLoCo, StreamingDiLoCo, DataParallel): the two hooks
    around each inner optimizer step; a hook that ran a round returns its report. ``with_global``
    runs a call (an evaluation) on the swarm's model, θ_global, where the method keeps one
    apart from the model it trains."""

    @property
    def outer_step_count(self) -> int: ...

    def before_inner_step(
        self, *, samples: int, info: dict[str, Any] | None = None
    ) -> RoundReport | None: ...

    def after_inner_step(self, *, samples: int, info: dict[str, Any] | None = None) -> RoundReport | None: ...

    def with_global(self, run: Callable[[], T]) -> T: ...


@runtime_checkable
class Rounds(Protocol):
    """What a peer's round loop drives (DiLoCo, streaming's
    :class:`~optim.streaming.StreamingRounds`): rounds on the caller's clock (``sync`` after the
    inner steps it counted), the global state served to and loaded from other peers, and the
    owner's live changes (``retune``)."""

    @property
    def outer_step_count(self) -> int: ...

    def note_inner_step(self, *, samples: int) -> None: ...

    def sync(self, *, info: dict[str, Any] | None = None) -> RoundReport: ...

    def finish(self) -> RoundReport | None: ...

    def outer_state(self, *, inflight_timeout: float = 60.0, inner: bool = True) -> OuterState: ...

    def load_outer_state(self, state: OuterState) -> None: ...

    def fingerprint(self) -> list[float]: ...

    def read_global(self, read: Callable[[list[torch.Tensor]], Any]) -> Any: ...

    def with_global(self, run: Callable[[], T]) -> T: ...

    @property
    def global_intact(self) -> bool:
        """False once a change of θ was cut short by an exception (Ctrl+C): θ may be half updated."""
        ...

    def retune(
        self, *, outer_lr: float | None = None, inner_steps: int | None = None, codec: str | None = None
    ) -> dict[str, Any]: ...


class Sync(enum.Enum):
    """When a method talks to the swarm."""

    EVERY_STEP = "every step"  # data-parallel: gradients averaged before each inner step
    ROUNDS = "rounds"  # the DiLoCo family: a pseudo-gradient every H inner steps
    FRAGMENTS = "fragments"  # streaming: one fragment of the parameters every H/F steps


# The knobs a method may take beyond the inner steps and inner lr, by their settings name (the
# command line's flag without its dashes, the TOML key, the Experiment keyword).
OUTER = ("outer_lr", "outer_momentum")
ROUND_KNOBS = ("delay", "overlap", "eager", "outlier_ratio", "clip_norm")
CODEC_KNOBS = (
    "update_codec",
    "topk_density",
    "topk_chunk",
    "topk_bits",
    "topk_mean",
    "error_feedback",
    "ef_decay",
)
STREAMING_KNOBS = ("fragments", "sync_delay", "alpha")
KNOBS = (*OUTER, *ROUND_KNOBS, *CODEC_KNOBS, *STREAMING_KNOBS)

DELAYED_OUTER = {"eager": (0.8, 0.3), "naive": (1.0, 0.0)}
"""(outer lr, outer momentum) DiLoCo defaults to with ``overlap`` / ``delay 1``: the update a
delayed round applies is a round stale, and the paper's momentum 0.9 compounds the staleness
(naive: eval loss 3.45 at H=50 against 2.17 without momentum; eager: 2.61 against 1.94,
re-swept in stop 66 among 7 outer steps). Measured in docs/optimizers.md."""


@dataclass(frozen=True)
class Method:
    """One method of the family, as a run names it."""

    name: str
    summary: str
    sync: Sync
    knobs: tuple[str, ...]
    """The knobs it takes (see ``OUTER`` ...); any other given is an error."""
    why_not: str
    """Why the knobs it does not take do not apply (said with that error)."""
    config: Callable[[int], DiLoCoConfig]
    """Its outer settings for H inner steps per round, before the user's overrides."""
    real_peers: str
    """What a real peer runs for it: ``diloco`` (DiLoCo with :attr:`config`), ``dp`` or
    ``streaming`` (``RunConfig.method``)."""

    @property
    def every_step(self) -> bool:
        return self.sync is Sync.EVERY_STEP

    @property
    def fragmented(self) -> bool:
        return self.sync is Sync.FRAGMENTS

    def steps_per_sync(self, inner_steps: int, fragments: int = 1) -> int:
        """Inner steps between two syncs: 1 (every step), H, or H/F (one fragment per sync)."""
        if self.every_step:
            return 1
        return inner_steps // fragments if self.fragmented else inner_steps

    def syncs_per_round(self, fragments: int = 1) -> int:
        """Syncs in one outer round (streaming syncs each fragment once)."""
        return fragments if self.fragmented else 1

    def build(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        averager: Averager,
        config: DiLoCoConfig,
        *,
        fragments: int = 4,
        sync_delay: int = 0,
        alpha: float | None = None,
    ) -> OuterOptimizer:
        """The outer optimizer over ``averager`` with these settings."""
        if self.every_step:
            from optim.data_parallel import DataParallel

            return DataParallel(
                model,
                inner_optimizer,
                averager,
                clip_norm=config.clip_norm,
                outlier_ratio=config.outlier_ratio,
            )
        if self.fragmented:
            from optim.streaming import StreamingConfig, StreamingDiLoCo

            streaming = StreamingConfig(outer=config, fragments=fragments, sync_delay=sync_delay, alpha=alpha)
            return StreamingDiLoCo(model, inner_optimizer, averager, streaming)
        from optim.diloco import DiLoCo

        return DiLoCo(model, inner_optimizer, averager, config)


def _diloco(inner_steps: int) -> DiLoCoConfig:
    from optim.diloco import DiLoCoConfig

    return DiLoCoConfig(inner_steps=inner_steps)


def _local_sgd(inner_steps: int) -> DiLoCoConfig:
    from optim.local_sgd import local_sgd

    return local_sgd(inner_steps=inner_steps)


def _sparseloco(inner_steps: int) -> DiLoCoConfig:
    from optim.sparseloco import sparseloco

    return sparseloco(inner_steps=inner_steps)


def _data_parallel(inner_steps: int) -> DiLoCoConfig:
    from optim.data_parallel import data_parallel_state

    return data_parallel_state()


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            name="dp",
            summary="data-parallel: gradients averaged every step (the quality baseline)",
            sync=Sync.EVERY_STEP,
            knobs=("outlier_ratio", "clip_norm"),
            why_not="it averages gradients every step (no outer optimizer)",
            config=_data_parallel,
            real_peers="dp",
        ),
        Method(
            name="local_sgd",
            summary="FedAvg: parameters averaged every H steps (outer SGD, lr 1, no momentum)",
            sync=Sync.ROUNDS,
            knobs=(*ROUND_KNOBS, *CODEC_KNOBS),
            why_not="it is DiLoCo with outer lr 1 and no momentum (use --method diloco to choose them)",
            config=_local_sgd,
            real_peers="diloco",
        ),
        Method(
            name="diloco",
            summary="DiLoCo: pseudo-gradients every H steps, outer Nesterov (Douillard et al. 2023)",
            sync=Sync.ROUNDS,
            knobs=(*OUTER, *ROUND_KNOBS, *CODEC_KNOBS),
            why_not="they belong to --method streaming",
            config=_diloco,
            real_peers="diloco",
        ),
        Method(
            name="sparseloco",
            summary="SparseLoCo: chunked top-k, 2-bit values, error feedback (Sarfi et al. 2025)",
            sync=Sync.ROUNDS,
            knobs=("outer_lr", *ROUND_KNOBS, *CODEC_KNOBS),
            why_not="its error feedback stands in for outer momentum",
            config=_sparseloco,
            real_peers="diloco",
        ),
        Method(
            name="streaming",
            summary="Streaming DiLoCo: one fragment synced every H/F steps (Douillard et al. 2025)",
            sync=Sync.FRAGMENTS,
            knobs=(*OUTER, *CODEC_KNOBS, *STREAMING_KNOBS, "outlier_ratio", "clip_norm"),
            why_not="it syncs fragments on their own schedule (--sync-delay, --alpha)",
            config=_diloco,  # DiLoCo's outer step, one fragment at a time
            real_peers="streaming",
        ),
    )
}


def method(name: str) -> Method:
    """The method called ``name``; ValueError naming the choices otherwise."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method '{name}'; choose one of: {', '.join(METHODS)}") from None


def names(*, real_peers: bool = False) -> Sequence[str]:
    """The methods' names; ``real_peers``: only those a real peer's config names."""
    return tuple({m.real_peers: None for m in METHODS.values()}) if real_peers else tuple(METHODS)
