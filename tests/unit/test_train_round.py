"""A peer's round of inner steps (``Peer.train_round``) with its network parts faked: pauses are
not round time, and the inner lr's schedule keeps its place when H is steered."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from workbench.config import RunConfig
from workbench.run import peer as peer_module
from workbench.run.peer import Peer
from workbench.run.telemetry import RoundStats


def _a_peer(
    config: RunConfig, *, wait_while_paused=lambda *_: 0.0, inner_step=lambda x, y, info: (2.5, None)
) -> Peer:
    """A peer whose round loop runs on its own: no board, no averager, batches of zeros."""

    def note_inner_step(samples: int) -> None:
        peer.diloco.inner_step_count += 1

    peer = Peer.__new__(Peer)
    model = torch.nn.Linear(2, 1)
    peer.__dict__.update(
        config=config,
        schedule_steps=config.round_steps,
        node=None,
        board=SimpleNamespace(fetch=lambda: {}),
        peer_id="me",
        averager=None,
        in_step=True,
        diloco=SimpleNamespace(outer_step_count=0, inner_step_count=0, note_inner_step=note_inner_step),
        steering=SimpleNamespace(round_seconds=None, wait_while_paused=wait_while_paused),
        faults=SimpleNamespace(apply=lambda averager: None),
        beat=lambda stage: None,
        stage=None,
        inner_optimizer=torch.optim.SGD(model.parameters(), lr=config.train.inner_lr),
        batches=iter([(torch.zeros(4, 2), torch.zeros(4, 1))] * 100_000),
        inner_step=inner_step,
        stats=RoundStats(),
    )
    return peer


def test_a_pause_is_left_out_of_the_round_s_rate_and_its_time_box(monkeypatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(peer_module.time, "monotonic", lambda: clock[0])
    pauses = [3600.0]  # paused for an hour before the first step, then never again

    def wait_while_paused(*_: object) -> float:
        paused = pauses.pop() if pauses else 0.0
        clock[0] += paused
        return paused

    def inner_step(x, y, info):
        clock[0] += 1.0  # each inner step takes a second
        return 2.5, None

    config = RunConfig()
    config.peer.round_seconds = 10.0  # a time box of 10 s: 10 steps, whatever the pause
    peer = _a_peer(config, wait_while_paused=wait_while_paused, inner_step=inner_step)
    peer.diloco.outer_step_count = 3
    round_start = clock[0]
    steps, _, _, paused = peer.train_round({}, round_start)
    assert paused == 3600.0
    assert steps == 10  # the box counts training time: 1 step (the box ran out in the pause) before
    assert peer.stats.samples_per_second == 4.0  # 4 samples a second, not 40 / 3610 = 0.011


@pytest.mark.parametrize(("before", "after"), [(50, 5), (5, 50)])
def test_steering_h_keeps_the_inner_lr_schedule_s_place(before: int, after: int) -> None:
    """The schedule's clock counted syncs times the H of the moment, so a steered H moved it: H
    50 -> 5 after the warmup sent the lr factor from 0.94 back into the warmup (0.55), and H 5 ->
    50 half way through the warmup skipped the rest of it (a review, stop 72). Its unit is now a
    sync: the factor goes on from where it was, and the run still ends on the cosine's floor."""
    config = RunConfig()
    config.train.warmup_steps = 20
    config.peer.rounds = 10
    config.diloco.inner_steps = before
    factors: list[float] = []

    def inner_step(x, y, info):
        factors.append(peer.inner_optimizer.param_groups[0]["lr"] / config.train.inner_lr)
        return 2.5, None

    peer = _a_peer(config, inner_step=inner_step)
    for outer_step in range(10):
        if outer_step == 2:
            config.diloco.inner_steps = after  # what DiLoCo.retune(inner_steps=...) does
        peer.diloco.outer_step_count, peer.diloco.inner_step_count = outer_step, 0
        peer.train_round({}, 0.0)
        if outer_step == 2:
            first = factors[-after]  # the first step after the steer
    # Where the run was at the end of sync 2, at the run's first H:
    expected = config.train.lr_factor(2 * before, 10 * before)
    assert first == pytest.approx(expected)
    assert factors[-1] == pytest.approx(config.train.lr_factor(10 * before - before / after, 10 * before))
    assert factors[-1] < 0.11  # the cosine's floor (0.1) at the run's end
