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

    rounds: Any  # DiLoCo | StreamingRounds
    averager: Any  # SwarmAverager
    averagers: list[Any]
    dp: DataParallel | None = None


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


def build_outer(
    config: RunConfig,
    model,
    inner_optimizer,
    *,
    dht,
    keys: RunKeys,
    board,
    beat: Callable[[Stage | None], None],
) -> OuterLoop:
    """The outer optimizer of ``config.method`` on ``model``, averaging over ``dht``."""
    from swarm.averaging import SwarmAverager

    common = dict(
        keys=keys,
        board=board,
        beat=beat,
        config=config.averaging,
        client_mode=config.network.client_mode,
        fault_file=config.peer.fault_file,
        overlapped=config.overlapped,
        **plane_location(config),
    )
    if config.outer_method.fragmented:
        return _streaming(config, model, inner_optimizer, dht, SwarmAverager, common)
    # The averager's process is forked before DiLoCo keeps its copy of θ: forked after, it would
    # keep the pages of that copy as they were when the first outer step rewrote them (for a
    # 57M-parameter model, 228 MB more in the averager's process for the rest of the run).
    trained = [p.detach() for p in model.parameters() if p.requires_grad]  # DiLoCo's θ, in shape
    tensors = averaged_like(trained, config)
    rounds: list[DiLoCo] = []  # filled below; the state provider reads it when asked
    averager = SwarmAverager(
        dht,
        tensors_like=tensors,
        state_provider=lambda: rounds[0].outer_state(),
        masks=len(tensors) - len(trained),
        **common,
    )
    diloco = DiLoCo(model, inner_optimizer, averager=None, config=config.diloco)  # type: ignore[arg-type]
    rounds.append(diloco)
    if config.outer_method.every_step:
        # Gradients go through the swarm every step; DiLoCo(H=1, lr 1, no momentum) over a
        # swarm of one then just keeps θ, the step clock and the state served to joiners.
        diloco.averager = LocalAverager()
        return OuterLoop(diloco, averager, [averager], DataParallel(model, inner_optimizer, averager))
    diloco.averager = averager
    return OuterLoop(diloco, averager, [averager])


def _streaming(config: RunConfig, model, inner_optimizer, dht, SwarmAverager, common) -> OuterLoop:  # noqa: N803
    """One hivemind averaging group per fragment (own shapes); fragment 0's serves the state."""
    from swarm.barrier import Serving

    streaming_config = StreamingConfig(
        outer=config.diloco, fragments=config.fragments, sync_delay=config.sync_delay, alpha=config.alpha
    )
    fragments = split_fragments([p.numel() for p in model.parameters() if p.requires_grad], config.fragments)
    shapes = [p.detach().float().cpu() for p in model.parameters() if p.requires_grad]
    rounds: list[StreamingRounds] = []  # filled below; the state provider reads it lazily
    serving = Serving()  # one peer: a state request stops every fragment's barrier waiting
    averagers = [
        SwarmAverager(
            dht,
            tensors_like=[shapes[i] for i in indices],
            state_provider=lambda: rounds[0].outer_state(),
            group=f"fragment{f}",
            serve_state=f == 0,
            serving=serving,
            **common,
        )
        for f, indices in enumerate(fragments)
    ]
    rounds.append(StreamingRounds(StreamingDiLoCo(model, inner_optimizer, averagers, streaming_config)))
    return OuterLoop(rounds[0], averagers[0], averagers)
