"""A pause by the run's owner is not round time (a review, stop 60): an hour's pause in a round
of 14 s made the monitor's ETA 29 h and the peer's rate 0.2 samples/s after the resume, and a
time-boxed round ran out of its box during the pause (one inner step, then the sync)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from workbench.config import RunConfig
from workbench.run import peer as peer_module
from workbench.run.peer import Peer
from workbench.run.telemetry import RoundStats


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
    peer = Peer.__new__(Peer)
    model = torch.nn.Linear(2, 1)
    peer.__dict__.update(
        config=config,
        node=None,
        board=SimpleNamespace(fetch=lambda: {}),
        peer_id="me",
        averager=None,
        in_step=True,
        diloco=SimpleNamespace(outer_step_count=3, inner_step_count=0, note_inner_step=lambda samples: None),
        steering=SimpleNamespace(round_seconds=None, wait_while_paused=wait_while_paused),
        faults=SimpleNamespace(apply=lambda averager: None),
        beat=lambda stage: None,
        stage=None,
        inner_optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        batches=iter([(torch.zeros(4, 2), torch.zeros(4, 1))] * 1000),
        inner_step=inner_step,
        stats=RoundStats(),
    )
    round_start = clock[0]
    steps, _, _, paused = peer.train_round({}, round_start)
    assert paused == 3600.0
    assert steps == 10  # the box counts training time: 1 step (the box ran out in the pause) before
    assert peer.stats.samples_per_second == 4.0  # 4 samples a second, not 40 / 3610 = 0.011
