"""optim.api: the registry of methods and the outer-loop protocols every caller relies on."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from optim.api import KNOBS, METHODS, OuterOptimizer, Rounds, Sync, method, names
from optim.averager import LocalAverager
from optim.diloco import DiLoCo
from optim.streaming import StreamingRounds


def test_the_registry_imports_without_torch():
    """The command line's --help reads it; torch loads only when a method is built."""
    code = "import sys, optim.api as a; a.method('diloco').steps_per_sync(50); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_an_unknown_method_names_the_choices():
    with pytest.raises(ValueError, match="unknown method 'adam'; choose one of: dp, local_sgd, diloco"):
        method("adam")


def test_each_method_says_what_it_does():
    assert names() == ("dp", "local_sgd", "diloco", "sparseloco", "streaming")
    assert names(real_peers=True) == ("dp", "diloco", "streaming")
    for m in METHODS.values():
        assert set(m.knobs) <= set(KNOBS), m.name
        assert m.real_peers in names(real_peers=True)
        config = m.config(48)
        if m.every_step:
            assert config.inner_steps == 1 and m.steps_per_sync(48, 4) == 1
        else:
            assert config.inner_steps == 48
    assert method("diloco").steps_per_sync(48, 4) == 48 and method("diloco").syncs_per_round(4) == 1
    assert method("streaming").steps_per_sync(48, 4) == 12 and method("streaming").syncs_per_round(4) == 4
    # The presets are DiLoCo with their paper's outer step.
    assert (method("local_sgd").config(10).outer_lr, method("local_sgd").config(10).outer_momentum) == (
        1.0,
        0.0,
    )
    assert method("sparseloco").config(10).codec == "topk" and method("sparseloco").config(10).error_feedback
    assert [m.name for m in METHODS.values() if m.sync is Sync.ROUNDS] == [
        "local_sgd",
        "diloco",
        "sparseloco",
    ]


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_builds_an_outer_optimizer_that_trains(name):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    chosen = method(name)
    outer = chosen.build(model, inner, LocalAverager(), chosen.config(4), fragments=2)
    assert isinstance(outer, OuterOptimizer)
    before = [p.detach().clone() for p in model.parameters()]
    reports = []
    for _ in range(8):
        reports.append(outer.before_inner_step(samples=4))
        model(torch.randn(4, 8)).pow(2).mean().backward()
        inner.step()
        inner.zero_grad()
        reports.append(outer.after_inner_step(samples=4))
    assert any(r is not None for r in reports), "8 steps hold at least one sync"
    assert outer.outer_step_count >= 1
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_the_round_loops_a_peer_drives_follow_the_protocol():
    model = torch.nn.Linear(4, 4)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(model, inner, LocalAverager(), method("diloco").config(2))
    assert isinstance(diloco, Rounds)
    streaming = method("streaming").build(
        model, inner, LocalAverager(), method("streaming").config(2), fragments=2
    )
    assert isinstance(StreamingRounds(streaming), Rounds)
