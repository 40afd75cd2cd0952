"""A simulated swarm: N virtual peers in one process running the exact optimizer code.

Each virtual peer is a thread with its own model copy, inner optimizer, data shard and outer
optimizer (:class:`~optim.diloco.DiLoCo`, :class:`~optim.data_parallel.DataParallel`, ...);
their averagers meet in an :class:`InProcessSwarm`, an exact all-reduce: every peer waits at
a barrier, then every peer sums the contributions in rank order (the same float operations on
every peer, so they agree bit for bit and the run is deterministic for a seed).

Faults, decided by a seeded generator so a run replays exactly:
- **stragglers**: a peer runs only a fraction of the inner steps of each round (its weight,
  the samples it saw, shrinks with it);
- **dropouts**: with probability ``dropout`` a peer misses a round's all-reduce: it sends
  nothing and afterwards adopts the group's result, as a real peer downloads the state.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from optim.api import OuterOptimizer, Rounds
from optim.averager import RoundReport
from optim.inner import inner_step
from optim.robust import counted_weights

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class SimConfig:
    """The simulated swarm's shape and faults."""

    peers: int = 4
    """Virtual peers."""
    steps: int = 200
    """Inner steps per peer (a straggler runs fewer)."""
    stragglers: dict[int, float] = field(default_factory=dict)
    """Rank -> fraction of each round's inner steps it runs, e.g. {3: 0.5}."""
    dropout: float = 0.0
    """Probability that a peer misses a round's all-reduce (never all peers at once)."""
    speeds: list[float] = field(default_factory=list)
    """Each peer's speed on the virtual clock (inner steps per ``step_seconds``), e.g.
    [1, 1, 0.5, 0.5]; empty: all 1. A round lasts as long as its slowest peer's steps."""
    round_seconds: float = 0.0
    """Time-boxed rounds on the virtual clock: each peer runs the steps that fit in this many
    virtual seconds at its speed (at least 1, at most H); 0: H steps each."""
    step_seconds: float = 1.0
    """Virtual seconds of one inner step at speed 1."""
    seed: int = 0
    """Seeds model init (shared), each peer's data order and the fault schedule."""
    eval_every: int = 0
    """Evaluate every this many rounds for the history (0: only at the start and the end)."""
    on_round: Callable[[dict[str, float]], None] | None = None
    """Called from each virtual peer's thread after each of its rounds with {"rank", "round",
    "step", "loss" (last inner loss), "bytes" (its payload bytes so far), "steps" and "samples"
    (this round's inner steps and the samples they took)}: live progress."""
    on_eval: Callable[[dict[str, float]], None] | None = None
    """Called with each entry of the history as it is evaluated ({"round", "step",
    "eval_loss", "bytes_per_peer"}), the initial evaluation first (round 0)."""

    def __post_init__(self) -> None:
        if not 1 <= self.peers <= 1024:
            raise ValueError(f"peers must be within 1..1024 (got {self.peers})")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1 (got {self.steps})")
        for rank, fraction in self.stragglers.items():
            if not 0 <= rank < self.peers or not 0 < fraction <= 1:
                raise ValueError(
                    f"straggler {rank}: {fraction} must name a rank < {self.peers} and a fraction in (0, 1]"
                )
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1) (got {self.dropout})")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0 (got {self.eval_every})")
        if self.speeds and (len(self.speeds) != self.peers or not all(0 < s <= 1e6 for s in self.speeds)):
            raise ValueError(
                f"speeds must give one positive speed per peer ({self.peers}), e.g. 1,1,0.5,0.5 (got {self.speeds})"
            )
        if not 0 <= self.round_seconds <= 1e9 or not 0 < self.step_seconds <= 1e9:
            raise ValueError(
                f"round_seconds must be >= 0 and step_seconds > 0 (got {self.round_seconds}, {self.step_seconds})"
            )

    def speed(self, rank: int) -> float:
        return self.speeds[rank] if self.speeds else 1.0

    def steps_in_round(self, rank: int, todo: int) -> int:
        """Of ``todo`` inner steps (H, or what is left of the run), those this peer runs in a
        round: a straggler's fraction, or what fits in the time box at its speed."""
        todo = max(1, round(todo * self.stragglers.get(rank, 1.0)))
        if self.round_seconds:
            fits = self.round_seconds * self.speed(rank) / self.step_seconds  # inf for a tiny step
            if fits < todo:  # compared as floats: int(inf) raised OverflowError (a review)
                todo = max(1, int(fits + 1e-9))
        return todo


class InProcessSwarm:
    """The all-reduce of N virtual peers (threads) in one process."""

    def __init__(self, peers: int, *, dropout: float = 0.0, seed: int = 0, timeout: float = 600.0) -> None:
        self.peers = peers
        self.dropout = dropout
        self.seed = seed
        self._barrier = threading.Barrier(peers, timeout=timeout)
        self._slots: list[tuple[list[torch.Tensor], float, dict[str, Any]] | None] = [None] * peers
        self._rounds = [0] * peers
        self._result: tuple[list[torch.Tensor], list[dict[str, Any]]] = ([], [])  # a round's means and infos

    def averager(self, rank: int) -> _PeerAverager:
        assert 0 <= rank < self.peers, f"{rank=}"
        return _PeerAverager(self, rank)

    def dropped(self, round_index: int) -> set[int]:
        """Ranks that miss this round (deterministic; at least one peer always stays)."""
        if not self.dropout or self.peers == 1:
            return set()
        rng = random.Random(self.seed * 1_000_003 + round_index)
        out = {rank for rank in range(self.peers) if rng.random() < self.dropout}
        return out if len(out) < self.peers else out - {min(out)}

    def abort(self) -> None:
        """Release every waiting peer (one peer failed: the others must not hang)."""
        self._barrier.abort()

    def _all_reduce(
        self, rank: int, tensors: Sequence[torch.Tensor], weight: float, info: dict[str, Any] | None = None
    ) -> RoundReport:
        round_index = self._rounds[rank]
        self._rounds[rank] += 1
        dropped = self.dropped(round_index)
        self._slots[rank] = (
            [t.detach().clone() for t in tensors],
            0.0 if rank in dropped else weight,
            dict(info or {}, peer=f"sim-{rank}"),
        )
        if self._barrier.wait() == 0:  # every peer has written its slot; one sums them for all
            # (each peer summing every slot itself cost N^2: 5 s a round for 128 peers)
            slots = list(self._slots)
            weights = counted_weights([w for _, w, _ in slots])  # type: ignore[misc]  # as a real group counts
            total = sum(weights)
            means = []
            for index in range(len(tensors)):
                mean = torch.zeros_like(tensors[index], dtype=torch.float32)
                for (contribution, _, _), w in zip(slots, weights):  # type: ignore[misc]
                    if w:
                        mean.add_(contribution[index].float(), alpha=w / total)
                means.append(mean)
            # Each member's info with the weight it gathered, as a real group reports it
            # (swarm.gathered.reported; the robust checks cap it): dp's info says none, and the
            # checks counted every dp member as weight 0 and checked nobody (a review, stop 72).
            self._result = (means, [dict(slot_info, weight=w) for _, w, slot_info in slots if w])  # type: ignore[misc]
        self._barrier.wait()  # the sum is there
        means, group_info = self._result
        for tensor, mean in zip(tensors, means):
            tensor.copy_(mean)
        self._barrier.wait()  # every peer has read it: the next round may overwrite the slots and it
        group = self.peers - len(dropped)
        return RoundReport(
            group_size=group,
            # Like hivemind's gather: what every member of the group declared this round.
            group_info=list(group_info),
            error="dropped out of this round" if rank in dropped else None,
            missed=rank in dropped,
        )


class _PeerAverager:
    """One virtual peer's handle on the swarm; an :class:`optim.Averager`."""

    def __init__(self, swarm: InProcessSwarm, rank: int) -> None:
        self.swarm = swarm
        self.rank = rank

    def expected_group(self) -> int:
        return self.swarm.peers

    def all_reduce(
        self, tensors: Sequence[torch.Tensor], *, weight: float, info: dict[str, Any] | None = None
    ) -> RoundReport:
        return self.swarm._all_reduce(self.rank, tensors, weight, info)


@dataclass(kw_only=True)
class VirtualPeer:
    """Everything one virtual peer trains with; built by the caller's factory."""

    model: torch.nn.Module
    inner_optimizer: torch.optim.Optimizer
    outer: OuterOptimizer
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    inner_steps: int
    """Steps per round of the method (1 for data-parallel): stragglers run a fraction of it."""
    set_lr: Callable[[int], None] = lambda step: None
    """Called with the run's step before each inner step (the schedule)."""
    grad_clip: float = 0.0
    """Clip the (averaged, for data-parallel) gradient norm to this before the step (0: off)."""


@dataclass(kw_only=True)
class SimResult:
    peers: int
    steps: int
    initial_eval_loss: float
    final_eval_loss: float
    bytes_per_peer: int
    """Payload bytes peer 0 sent over the run (see RoundReport.payload_bytes)."""
    peak_bytes_per_sync: int
    """Largest single contribution peer 0 sent."""
    rounds: int
    seconds: float
    params_max_abs_diff: float
    """Largest difference between any peer's parameters and peer 0's at the end."""
    history: list[dict[str, float]] = field(default_factory=list)
    virtual_seconds: float = 0.0
    """The run's length on the virtual clock (``SimConfig.speeds``): per round, the slowest
    peer's steps; the all-reduce itself takes no virtual time."""
    utilization: list[float] = field(default_factory=list)
    """Per peer: the share of the virtual time it spent in inner steps (the rest it waited)."""
    steps_per_peer: list[int] = field(default_factory=list)
    """Inner steps each peer ran (time boxes and stragglers run fewer or more than H per round)."""
    final_params: list[torch.Tensor] = field(default_factory=list)
    """Peer 0's model parameters at the end (for DiLoCo: the global params after the last round)."""


def _evaluate_global(peer: VirtualPeer, evaluate: Callable[[torch.nn.Module], float]) -> float:
    """The loss of the swarm's model, θ_global, as real peers report it (streaming's model is
    not θ_global between merges, nor the same on every peer)."""
    return peer.outer.with_global(lambda: evaluate(peer.model))


def simulate(
    make_peer: Callable[[int, InProcessSwarm], VirtualPeer],
    evaluate: Callable[[torch.nn.Module], float],
    config: SimConfig,
) -> SimResult:
    """Run ``config.peers`` virtual peers in threads for ``config.steps`` inner steps each."""
    swarm = InProcessSwarm(config.peers, dropout=config.dropout, seed=config.seed)
    peers = [make_peer(rank, swarm) for rank in range(config.peers)]
    initial = _evaluate_global(peers[0], evaluate)
    if config.on_eval is not None:
        config.on_eval({"round": 0, "step": 0, "eval_loss": initial, "bytes_per_peer": 0})
    bytes_sent = [0] * config.peers
    peak = [0] * config.peers
    history: list[dict[str, float]] = []
    errors: list[BaseException] = []
    interrupted = threading.Event()  # Ctrl+C in the caller's thread: every peer stops at its next step
    start = time.monotonic()
    # Steps each peer ran in each round, for the virtual clock.
    ran: list[dict[int, int]] = [{} for _ in range(config.peers)]

    def run(rank: int) -> None:
        peer = peers[rank]
        rounds = -(-config.steps // peer.inner_steps)  # ceil
        try:
            for round_index in range(rounds):
                todo = min(peer.inner_steps, config.steps - round_index * peer.inner_steps)
                if peer.inner_steps > 1:
                    todo = config.steps_in_round(rank, todo)
                ran[rank][round_index] = todo
                for i in range(todo):
                    if interrupted.is_set():
                        return
                    peer.set_lr(round_index * peer.inner_steps + i)
                    x, y = next(peer.batches)
                    n = len(x)
                    loss = inner_step(
                        peer.model,
                        peer.inner_optimizer,
                        x,
                        y,
                        grad_clip=peer.grad_clip,
                        before_step=lambda n=n: _account(rank, peer.outer.before_inner_step(samples=n)),
                    )
                    if i < todo - 1 or peer.inner_steps == 1:
                        report = peer.outer.after_inner_step(samples=len(x))
                    else:  # the last step of a (possibly short) round: sync now (DiLoCo's rounds)
                        diloco = cast(Rounds, peer.outer)
                        diloco.note_inner_step(samples=len(x))
                        report = diloco.sync()
                    _account(rank, report)
                if config.on_round is not None:
                    config.on_round(
                        {
                            "rank": rank,
                            "round": round_index + 1,
                            "step": round_index * peer.inner_steps + todo,
                            "loss": float(loss.detach()),
                            "bytes": bytes_sent[rank],
                            "steps": todo,  # this round's inner steps, and the samples they took
                            "samples": todo * n,
                        }
                    )
                if round_index == rounds - 1 and hasattr(peer.outer, "finish"):
                    # The last means still queued or in flight (delay, overlap): every peer ends
                    # on the swarm's θ, as a real peer does when its run ends.
                    _account(rank, peer.outer.finish())
                if rank == 0 and config.eval_every and (round_index + 1) % config.eval_every == 0:
                    history.append(
                        {
                            "round": round_index + 1,
                            # The most steps any peer ran (time boxes run fewer than H a round:
                            # the schedule's count stretched the curves 2.5x, a review, stop 72),
                            # as the notebook's rows count them.
                            "step": max(
                                sum(steps.get(r, 0) for r in range(round_index + 1)) for steps in ran
                            ),
                            "eval_loss": _evaluate_global(peer, evaluate),
                            "bytes_per_peer": bytes_sent[0],
                        }
                    )
                    if config.on_eval is not None:
                        config.on_eval(dict(history[-1]))
        except threading.BrokenBarrierError:
            pass  # another peer failed; its error is reported
        except BaseException as error:
            errors.append(error)
            swarm.abort()

    def _account(rank: int, report: RoundReport | None) -> None:
        # What a peer uploads: nothing in a round it missed, or had nobody to average with.
        if report is not None and not report.missed and report.group_size > 1:
            bytes_sent[rank] += report.payload_bytes
            peak[rank] = max(peak[rank], report.payload_bytes)

    # Daemons: a second Ctrl+C leaves at once, even in the middle of a long inner step.
    threads = [
        threading.Thread(target=run, args=(rank,), name=f"virtual-peer-{rank}", daemon=True)
        for rank in range(config.peers)
    ]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():  # a timed wait: a signal taken by another thread is seen too
                thread.join(0.2)
    except KeyboardInterrupt:
        interrupted.set()
        swarm.abort()
        logger.warning(
            "stopping: each virtual peer ends its inner step in progress (Ctrl+C again to quit now)"
        )
        for thread in threads:
            thread.join()
        raise
    if errors:
        raise errors[0]
    busy = [sum(steps.values()) * config.step_seconds / config.speed(rank) for rank, steps in enumerate(ran)]
    virtual = sum(
        max(ran[rank].get(r, 0) * config.step_seconds / config.speed(rank) for rank in range(config.peers))
        for r in range(max((len(steps) for steps in ran), default=0))
    )
    reference = list(peers[0].model.parameters())
    diff = max(
        (
            float((a.detach() - b.detach()).abs().max())
            for p in peers[1:]
            for a, b in zip(reference, p.model.parameters())
        ),
        default=0.0,
    )
    return SimResult(
        peers=config.peers,
        steps=config.steps,
        initial_eval_loss=initial,
        final_eval_loss=_evaluate_global(peers[0], evaluate),
        bytes_per_peer=bytes_sent[0],
        peak_bytes_per_sync=peak[0],
        rounds=peers[0].outer.outer_step_count,
        seconds=time.monotonic() - start,
        params_max_abs_diff=diff,
        history=history,
        virtual_seconds=virtual,
        utilization=[b / virtual if virtual else 0.0 for b in busy],
        steps_per_peer=[sum(steps.values()) for steps in ran],
        final_params=[p.detach().to("cpu", torch.float32, copy=True) for p in peers[0].model.parameters()],
    )
