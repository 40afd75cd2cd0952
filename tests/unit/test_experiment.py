"""`Experiment` from a notebook: bad arguments refused where they are written, a simulation
that can be stopped, Ctrl+C in wait(), compare() of runs with nothing to draw, and the view of
a finished simulation."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from swarm.errors import SwarmError
from workbench import Experiment, Stopped, compare

ADDRESS = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


class _Bigram(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table(x)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _broken_factory() -> nn.Module:
    raise RuntimeError("out of ideas")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(peers=0), r"peers must be at least 1 \(got 0\)"),
        (dict(peers=True), r"peers must be a whole number \(got True\)"),
        (dict(peers="4"), r"peers must be a whole number \(got '4'\)"),
        (dict(peers=5000), "--peers must be"),
        (dict(steps=10, rounds=2), "give steps= or rounds=, not both"),
        (dict(steps=0), "steps must be at least 1"),
        (dict(rounds=0), "rounds must be at least 1"),
        (dict(steps=2.5), "steps must be a whole number"),
        (dict(backend="swarm", initial_peers=ADDRESS), "initial_peers is a list of multiaddrs"),
        (dict(backend="swarm", initial_peers=["203.0.113.7:31337"]), "is not a multiaddr"),
        (dict(initial_peers=[ADDRESS]), "use it with backend='swarm'"),
        (dict(speeds="1,1"), "speeds is a list of numbers"),
        (dict(peers=2, speeds=[1.0]), "speeds"),
        (dict(device="cuda"), "device= sets real peers"),
        (dict(aggregate="trimmed-mean", data_plane="hivemind"), "aggregate=, data_plane= set real peers"),
        (dict(model=_Bigram, loss_fn=3), "loss_fn must be a function"),
        (dict(model=lambda: 3), "model\\(\\) must return a torch.nn.Module \\(got int\\)"),
        (dict(model=_broken_factory), "out of ideas"),
        (dict(backend="cloud"), "unknown backend 'cloud'"),
    ],
)
def test_bad_arguments_are_refused_where_they_are_written(kwargs, message):
    with pytest.raises((ValueError, SwarmError, RuntimeError), match=message):
        Experiment(**kwargs)


def _bigram(**kwargs) -> Experiment:
    return Experiment(model=_Bigram, loss_fn=_loss, peers=2, inner_steps=2, batch_size=4, **kwargs)


def test_a_simulation_stops_at_the_end_of_a_round_and_keeps_the_rounds_done():
    run = _bigram(steps=100_000).run()
    deadline = time.monotonic() + 60
    while run.source().poll().outer_round < 2:
        assert time.monotonic() < deadline and run.running
        time.sleep(0.05)
    run.stop()
    with pytest.raises(Stopped, match="was stopped at round"):
        run.wait(timeout=60)
    assert not run.running and "stopped" in repr(run)
    history = run.history()
    assert len(history) >= 2 and history["loss"].notna().all()
    assert history["round"].tolist() == sorted(history["round"])
    # The view keeps the peers that ran, done with their rounds.
    snapshot = run.source().poll()
    assert len(snapshot.peers) == 2 and {p.stage.value for p in snapshot.peers.values()} == {"finishing"}


def test_ctrl_c_in_wait_leaves_the_run_going_and_says_how_to_end_it(monkeypatch):
    run = _bigram(steps=100_000).run()

    def interrupted(timeout=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(run._done, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt, match="goes on in the background: .stop\\(\\) ends it"):
        run.wait()
    monkeypatch.undo()
    assert run.running and "running" in repr(run)
    run.stop()
    with pytest.raises(SwarmError, match="was stopped"):
        run.wait(timeout=60)


def test_a_simulation_takes_eval_every_and_threads_and_writes_no_folder():
    def threads_of_a_new_thread() -> int:  # torch's count is read lazily by each new thread
        seen: list[int] = []
        thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        return seen[0]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _bigram(steps=4).run().wait(timeout=120)
        assert threads_of_a_new_thread() == 2  # not given: left as it was
        run = _bigram(steps=16, eval_every="2", threads=1).run().wait(timeout=120)
        assert threads_of_a_new_thread() == 1
    finally:
        torch.set_num_threads(threads)
    evaluated = run.history().dropna(subset=["eval_loss"])
    assert evaluated["round"].tolist() == [0, 2, 4, 6, 8]  # every 2 of its 8 rounds, and the start
    assert run._run_dir is None  # no temporary folder for a run that writes nothing


def test_compare_names_the_runs_with_nothing_to_draw():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    done = _bigram(steps=4).run().wait(timeout=120)
    with pytest.raises(ValueError, match="has not run \\(call .run\\(\\) first\\)"):
        compare([done, _bigram(steps=4, name="later")])
    failed = _bigram(steps=100_000, name="cut").run()
    failed.stop()
    with pytest.raises(SwarmError):
        failed.wait(timeout=60)
    with pytest.raises(ValueError, match="cut ended with no evaluation \\(cut was stopped"):
        compare([done, failed])  # a simulation evaluates at its end: stopped early, none
    assert compare([done]).get_legend().get_texts()[0].get_text() == done.name
