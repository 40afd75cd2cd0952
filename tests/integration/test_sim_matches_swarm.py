"""The simulator and the real hivemind swarm run the same optimizer code: for the same seed,
data shards, model and schedule they must end with the same global params."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from optim.diloco import DiLoCoConfig
from optim.sim import SimConfig
from tests.integration.conftest import max_abs_diff
from workbench.config import TrainConfig
from workbench.run.data import DataConfig
from workbench.run.model import preset
from workbench.simulate import MethodSpec, run_simulation

pytestmark = pytest.mark.integration

ROUNDS, H, BATCH = 3, 4, 8


def test_two_real_peers_match_the_simulator(spawn, tmp_path: Path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = "".join(f"def f{i}(a, b):\n    return a * {i} - b // {i % 5 + 1}\n\n" for i in range(4000))
    (corpus / "code.py").write_text(text)
    common = [
        "--model",
        "tiny",
        "--data",
        str(corpus),
        "--inner-steps",
        str(H),
        "--batch-size",
        str(BATCH),
        "--rounds",
        str(ROUNDS),
        "--threads",
        "1",
        "--min-peers",
        "2",
        "--run-id",
        "sim-vs-swarm",
        "--matchmaking-time",
        "1.0",
        "--seed",
        "3",
    ]
    first = spawn("a", "start", *common, "--shard", "0/2")
    second = spawn("b", "join", first.address(), *common, "--shard", "1/2")
    assert first.wait() == 0, first.stderr()
    assert second.wait() == 0, second.stderr()
    assert all(r["group_size"] == 2 for r in first.events("round"))

    torch.set_num_threads(1)
    result = run_simulation(
        MethodSpec(method="diloco", diloco=DiLoCoConfig(inner_steps=H)),
        model=preset("tiny"),
        data=DataConfig(path=str(corpus), batch_size=BATCH),
        train=TrainConfig(),
        sim=SimConfig(peers=2, steps=ROUNDS * H, seed=3),
    )
    swarm = first.global_params()
    assert max_abs_diff(swarm, second.global_params()) <= 1e-5
    # hivemind averages in its own order and applies the mean as a delta: ~1e-7 per round.
    assert max_abs_diff(swarm, result.final_params) <= 1e-4
    assert result.final_eval_loss == pytest.approx(first.events("done")[0]["final_eval_loss"], abs=1e-3)
