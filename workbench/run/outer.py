"""The outer loop a peer drives, over its swarm: DiLoCo (blocking, delayed or overlapped),
data-parallel (gradients through the swarm every step) or streaming (one hivemind averaging
group per fragment), each with the :class:`swarm.averaging.SwarmAverager` it averages with."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from optim.averager import LocalAverager
from optim.data_parallel import DataParallel
from optim.diloco import DiLoCo
from optim.streaming import StreamingConfig, StreamingDiLoCo, StreamingRounds, split_fragments
from swarm.records import RunKeys, Stage
from workbench.config import RunConfig


@dataclasses.dataclass
class OuterLoop:
    """What the peer's round loop drives: ``rounds`` syncs, serves and loads the state (DiLoCo,
    or streaming's fragment rounds, which it drives the same way); ``averager`` downloads the
    state and serves it (streaming: fragment 0's); ``averagers`` are all of them (closed at the
    end); ``dp`` steps gradients through the swarm (data-parallel only)."""

    rounds: Any  # DiLoCo | StreamingRounds (None until build_outer)
    averager: Any  # SwarmAverager
    averagers: list[Any]
    dp: DataParallel | None = None

    def start_serving(self) -> None:
        """Offer the state to joiners (and answer witnesses) from now on, at this peer's step."""
        for averager in self.averagers:
            averager.start_serving()
        self.averager.set_state_priority(self.rounds.outer_step_count)


def plane_location(config: RunConfig) -> dict[str, Any]:
    """Where a peer's direct data plane listens, and the host others dial for it (the first
    --announce's IP, else --host; none for 0.0.0.0 without --announce)."""
    network = config.network
    advertise = None
    for address in network.announce:
        parts = address.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            advertise = parts[2]
            break
    return dict(plane_host=network.host, plane_advertise=advertise)


def averaged_like(tensors: list, config: RunConfig) -> list:
    """The tensors a round all-reduces: the Δ, and with ``topk_mean="kept"`` a kept-mask of each
    (optim.contribution.keepers)."""
    return [*tensors, *tensors] if config.diloco.topk_mean == "kept" else list(tensors)


def start_averagers(
    config: RunConfig,
    shapes: list,
    *,
    dht,
    keys: RunKeys,
    board,
    beat: Callable[[Stage | None], None],
) -> OuterLoop:
    """The averagers of ``config.method``, for trained parameters of these ``shapes`` (meta
    tensors will do), before the model exists; :func:`build_outer` then puts the outer optimizer
    on the model. Each averager forks a process, and a process forked after the model (or
    after DiLoCo's copy of θ) keeps those pages, as they were when training rewrote them, for
    the rest of the run: a copy of the model (docs/performance.md, "A peer's memory")."""
    from swarm.averaging import SwarmAverager

    outer = OuterLoop(rounds=None, averager=None, averagers=[])
    common = dict(
        keys=keys,
        board=board,
        beat=beat,
        config=config.averaging,
        client_mode=config.network.client_mode,
        fault_file=config.peer.fault_file,
        overlapped=config.overlapped,
        state_shapes=[tuple(s.shape) for s in shapes],
        state_provider=lambda: outer.rounds.outer_state(),  # served once build_outer made it
        theta_provider=lambda: outer.rounds.outer_state(inner=False),  # a witness's: θ is enough
        **plane_location(config),
    )
    if config.outer_method.fragmented:
        # One hivemind averaging group per fragment (own shapes); fragment 0's serves the state.
        from swarm.barrier import Serving
        from swarm.claims import Vouching

        serving = Serving()  # one peer: a state request stops every fragment's barrier waiting
        vouching = Vouching()  # one peer: who averaged with it, and whose claims failed, for all
        fragments = split_fragments([s.numel() for s in shapes], config.fragments)
        outer.averagers = [
            SwarmAverager(
                dht,
                tensors_like=[shapes[i] for i in indices],
                group=f"fragment{f}",
                serve_state=f == 0,
                serving=serving,
                vouching=vouching,
                syncs_apart=len(fragments),
                **common,
            )
            for f, indices in enumerate(fragments)
        ]
    else:
        tensors = averaged_like(shapes, config)
        outer.averagers = [
            SwarmAverager(dht, tensors_like=tensors, masks=len(tensors) - len(shapes), **common)
        ]
    outer.averager = outer.averagers[0]
    return outer


def build_outer(
    config: RunConfig, model, inner_optimizer, outer: OuterLoop, *, serve: bool = True
) -> OuterLoop:
    """The outer optimizer of ``config.method`` on ``model``, averaging with the averagers
    :func:`start_averagers` started; they serve the state from now on if ``serve`` (else from
    :meth:`OuterLoop.start_serving`: a joiner, once its download is done)."""
    if config.outer_method.fragmented:
        streaming_config = StreamingConfig(
            outer=config.diloco, fragments=config.fragments, sync_delay=config.sync_delay, alpha=config.alpha
        )
        outer.rounds = StreamingRounds(
            StreamingDiLoCo(model, inner_optimizer, outer.averagers, streaming_config)
        )
    elif config.outer_method.every_step:
        # Gradients go through the swarm every step (clipped there: --clip-norm is this peer's
        # gradient); DiLoCo(H=1, lr 1, no momentum) over a swarm of one then just keeps θ, the
        # step clock and the state served to joiners, and clips nothing (it clipped each step's
        # change of the parameters, while the simulator's dp ignored the flag).
        outer.rounds = DiLoCo(
            model,
            inner_optimizer,
            averager=LocalAverager(),
            config=dataclasses.replace(config.diloco, clip_norm=0.0),
        )
        outer.dp = DataParallel(
            model,
            inner_optimizer,
            outer.averager,
            clip_norm=config.diloco.clip_norm,
            outlier_ratio=config.diloco.outlier_ratio,
        )
    else:
        outer.rounds = DiLoCo(model, inner_optimizer, averager=outer.averager, config=config.diloco)
    if serve:
        outer.start_serving()
    return outer
