"""`Experiment` from a notebook: bad arguments refused where they are written, a simulation
that can be stopped, Ctrl+C in wait(), compare() of runs with nothing to draw, and the view of
a finished simulation."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

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
        (dict(peers="four"), r"peers must be a whole number \(got 'four'\)"),
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
    run = _bigram(steps=100_000, eval_every=1).run()
    deadline = time.monotonic() + 60
    while run.source().poll().outer_round < 2:
        assert time.monotonic() < deadline and run.running
        time.sleep(0.05)
    run.stop()
    with pytest.raises(Stopped, match="was stopped at round"):
        run.wait(timeout=60)
    assert not run.running and "stopped" in repr(run)
    history = run.history()
    assert len(history) >= 3 and history["round"].tolist() == list(range(len(history)))
    done = history[history["round"] > 0]  # the rounds every peer finished, with what they measured
    # (the last may have been stopped before rank 0 evaluated it)
    assert done["loss"].notna().all() and done["eval_loss"].iloc[:-1].notna().all(), history
    # (Not strictly: rounds of this tiny model can fall within one tick of a coarse clock.)
    assert done["seconds"].is_monotonic_increasing, history
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


def test_a_simulation_takes_eval_every_and_threads_and_writes_no_folder(monkeypatch):
    """The run's threads (default 1, as documented) for the run only: the default was never
    applied (the run used all of torch's threads), and a value given once stayed for every later
    cell, so the same cell's numbers depended on the cells before it and on the machine."""

    def threads_of_a_new_thread() -> int:  # torch's count is read lazily by each new thread
        seen: list[int] = []
        thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        return seen[0]

    used: list[int] = []
    simulate = Experiment._simulate

    def recording(self, *args, **kwargs):
        used.append(threads_of_a_new_thread())  # what the virtual peers' threads get
        return simulate(self, *args, **kwargs)

    monkeypatch.setattr(Experiment, "_simulate", recording)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _bigram(steps=4).run().wait(timeout=120)
        run = _bigram(steps=16, eval_every="2", threads=3).run().wait(timeout=120)
        assert used == [1, 3] and threads_of_a_new_thread() == 2  # each run's own; then as it was
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
    assert done.wait(float("inf")) is done  # (Event.wait raised OverflowError on inf)
    with pytest.raises(ValueError, match="has not run \\(call .run\\(\\) first\\)"):
        compare([done, _bigram(steps=4, name="later")])
    failed = _bigram(steps=4, name="cut", data="/nonexistent/corpus").run()
    with pytest.raises(ValueError, match="/nonexistent/corpus"):
        failed.wait(timeout=60)
    with pytest.raises(ValueError, match="cut ended with no evaluation \\("):
        compare([done, failed])  # it failed before its first evaluation
    with pytest.raises(ValueError, match="sent no bytes"):
        compare(
            [
                Experiment(model=_Bigram, loss_fn=_loss, peers=1, steps=4, inner_steps=2, name="solo")
                .run()
                .wait(timeout=120)
            ],
            x="bytes",
        )
    # Done, every evaluation NaN: "has no evaluation yet (.wait() for it)" sent the user to wait
    # for a run that had ended (a review, 2026-12-06).
    nan = Experiment(
        model=_Bigram, loss_fn=lambda model, batch: _loss(model, batch) * float("nan"), peers=2,
        inner_steps=2, batch_size=4, steps=4, name="hot",
    )  # fmt: skip
    with pytest.raises(ValueError, match="hot diverged: every evaluation is NaN"):
        compare([nan.run().wait(timeout=120)])
    with pytest.raises(ValueError, match="compare takes a list of experiments"):
        compare([])
    assert compare([done]).get_legend().get_texts()[0].get_text() == done.name
    assert compare(done).get_legend().get_texts()[0].get_text() == done.name  # one alone


@pytest.mark.parametrize(
    ("kwargs", "rounds", "steps", "evaluated"),
    [
        # The last round is short (30 = 20 + 10): one row for it, at the step the peers reached.
        (dict(inner_steps=20, steps=30), [0, 1, 2], [0, 20, 30], [0, 1, 2]),
        # --eval-every 3: a row for every round, an eval loss where evaluated (and at the end).
        (dict(inner_steps=2, rounds=5, eval_every=3), [0, 1, 2, 3, 4, 5], [0, 2, 4, 6, 8, 10], [0, 3, 5]),
        # Streaming syncs a fragment every H/F steps: still a row per outer round of H steps.
        (
            dict(method="streaming", inner_steps=4, fragments=2, rounds=3),
            [0, 1, 2, 3],
            [0, 4, 8, 12],
            [0, 1, 2, 3],
        ),
        # H not divisible by F: the simulator runs it, as `workbench simulate` does (real peers refuse it).
        (dict(method="streaming", inner_steps=5, fragments=2, rounds=2), [0, 1, 2], [0, 5, 10], [0, 1, 2]),
    ],
    ids=["short-last-round", "eval-every", "streaming", "streaming-uneven"],
)
def test_a_simulations_history_has_one_row_per_outer_round(kwargs, rounds, steps, evaluated):
    run = Experiment(model="tiny", peers=2, batch_size=4, **kwargs).run().wait(timeout=120)
    history = run.history()
    assert history["round"].tolist() == rounds and history["step"].tolist() == steps, history
    assert history["tokens"].tolist() == [s * 2 * 4 * run.config.model.block_size for s in steps]
    assert history.dropna(subset=["eval_loss"])["round"].tolist() == evaluated, history
    assert history["eval_loss"].iloc[-1] == run.result.final_eval_loss
    assert history["bytes_per_peer"].iloc[-1] == run.result.bytes_per_peer
    assert history["bytes_per_peer"].is_monotonic_increasing and history["seconds"].notna().all()


def test_text_numbers_and_a_stop_before_run_are_taken_as_the_cli_takes_them():
    streaming = dict(method="streaming", inner_steps=4, fragments=2, peers=2, steps=8, model="tiny")
    run = Experiment(alpha="0.5", sync_delay="1", **streaming)
    run.stop()  # nothing to stop yet: the run goes on to its end
    run.run().wait(timeout=120)
    assert len(run.history()) == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(model=_Bigram), "_Bigram.forward takes only x: give loss_fn="),
        (dict(speeds=["1", "1"]), "speeds is a list of numbers"),
        (dict(speeds=5), "speeds is a list of numbers"),
        (dict(method="streaming", round_seconds=2), "round_seconds= boxes a round's inner steps"),
        (dict(backend="local", peers=65), "backend='local' starts at most 64 peers"),
        (dict(backend="local", headless=True, json=True), "headless=, json=: `workbench demo`'s display"),
        (dict(timeout=60), "timeout=: `workbench demo`'s display settings"),
        (dict(backend="swarm", peers=3), "backend='swarm' runs one peer"),
        (dict(backend="swarm", resume="/ckpt", checkpoint_every=2), "checkpoint_every=, resume=: not passed"),
        (
            dict(backend="local", method="streaming", inner_steps=5, fragments=2),
            "streaming on real peers needs",
        ),
        (dict(backend="swarm", client_mode=True), "the first peer of a run must accept connections"),
    ],
)
def test_more_bad_arguments_are_refused_where_they_are_written(kwargs, message):
    with pytest.raises((ValueError, SwarmError), match=message):
        Experiment(**kwargs)


def test_wait_takes_no_negative_timeout():
    run = _bigram(steps=4).run()
    with pytest.raises(ValueError, match="timeout is seconds to wait"):
        run.wait(-1)
    run.wait(timeout=120)


class _Events:
    """A real peer's event log as `_follow` reads it (workbench.local.launch.LocalPeer)."""

    def __init__(self, events: list[dict]) -> None:
        self.pending = [dict(e, time=100.0 + i) for i, e in enumerate(events)]  # a peer's events carry a time
        self.events: list[dict] = []

    def poll_events(self) -> list[dict]:
        events, self.pending = self.pending, []
        self.events.extend(events)
        return events

    def last(self, event: str, **fields) -> dict | None:
        return next(
            (
                e
                for e in reversed(self.events + self.pending)
                if e["event"] == event and fields.items() <= e.items()
            ),
            None,
        )


def test_real_peers_rounds_count_the_steps_they_ran_and_only_the_evaluations_made():
    """The first peer's round events: its H was steered from 5 to 10 after round 2, and it
    evaluates every 2 rounds (a round event carries the last evaluation otherwise)."""
    run = Experiment(backend="local", peers=2, inner_steps=5, rounds=4, eval_every=2, model="tiny")
    rounds = [(1, 5, 4.0, False), (2, 5, 3.5, True), (3, 10, 3.5, False), (4, 10, 3.0, True)]
    events = [{"event": "initial_eval", "outer_step": 0, "eval_loss": 5.0}] + [
        {
            "event": "round",
            "outer_step": r,
            "inner_steps": h,
            "loss": 4.5,
            "eval_loss": e,
            "evaluated": done,
            "bytes_sent": 100,
        }  # fmt: skip
        for r, h, e, done in rounds
    ]
    run._follow(_Events(events), lambda: True)
    history = run.history()
    assert history["step"].tolist() == [0, 5, 10, 20, 30]
    assert history["eval_loss"].tolist()[::2] == [5.0, 3.5, 3.0] and history["eval_loss"][1::2].isna().all()
    assert history["bytes_per_peer"].tolist() == [0, 100, 200, 300, 400]


def test_a_real_run_s_view_is_read_while_it_runs_and_at_its_end():
    """A widget made after a short local run showed round 0 and no peer (its one read came as
    the peers left, never seen alive), and one open during it stopped a round before the end.
    The view is now read every second while the peers run (a widget open or not) and again at
    the first peer's "done"; not after they are gone."""
    run = Experiment(backend="local", peers=2, inner_steps=5, rounds=1, model="tiny")
    reads = []

    class Source:
        def read_once(self, *, again: bool = False) -> None:
            reads.append((again, [e["event"] for e in log.events]))

    run._source = Source()
    log = _Events([{"event": "round", "outer_step": 1, "loss": 4.0, "eval_loss": 4.0, "bytes_sent": 1}])
    start = time.monotonic()

    def finished() -> bool:
        if time.monotonic() - start > 1.2 and not log.last("done"):
            log.pending.append({"event": "done", "time": 200.0})
        return time.monotonic() - start > 1.6

    run._follow(log, finished)
    assert len(reads) >= 2 and all(again for again, _ in reads), reads  # (3 unless this thread stalled)
    assert reads[0][1] == []  # read as it started, before any event
    assert reads[-1][1][-1] == "done"  # and at the end, while the peers were still there


def test_a_real_run_s_view_is_read_after_its_last_round_until_it_shows_the_end():
    """A local run's final view was a round short (4 runs of 2 peers, 3 rounds: 2 ended on round
    2 or 1): read once at the first peer's "done", the DHT still held the heartbeats of a round
    before, or the peers as they left. After the followed peer's last round the view is now read
    until every peer shows it, and then no more (later reads find the peers leaving)."""
    run = Experiment(backend="local", peers=2, inner_steps=5, rounds=2, model="tiny")
    reads = []
    # What the DHT holds, read by read, once the followed peer has finished its last round:
    # first the round before, then its own heartbeat, then the other's.
    lagging = [{"a": 1, "b": 1}, {"a": 2, "b": 1}, {"a": 2, "b": 2}]

    class Source:
        def read_once(self, *, again: bool = False):
            last_round = log.last("round", outer_step=2) in log.events
            held = (
                lagging.pop(0)
                if last_round and len(lagging) > 1
                else lagging[0]
                if last_round
                else {"a": 1, "b": 1}
            )
            reads.append((time.monotonic() - start, held))
            return SimpleNamespace(peers={k: SimpleNamespace(outer_step=v) for k, v in held.items()})

    run._source = Source()
    log = _Events([{"event": "round", "outer_step": 1, "loss": 4.0, "eval_loss": 4.0, "bytes_sent": 1}])
    start = time.monotonic()

    def finished() -> bool:
        elapsed = time.monotonic() - start
        if elapsed > 0.5 and not log.last("round", outer_step=2):
            log.pending.append(
                {
                    "event": "round",
                    "outer_step": 2,
                    "loss": 3.0,
                    "eval_loss": 3.0,
                    "bytes_sent": 1,
                    "time": 101.0,
                }
            )
        if elapsed > 3.0 and not log.last("done"):
            log.pending.append({"event": "done", "time": 200.0, "syncs": 2})
        return elapsed > 4.0

    run._follow(log, finished)
    shown = [at for at, held in reads if held == {"a": 2, "b": 2}]
    assert reads[-1][1] == {"a": 2, "b": 2}, reads  # the end, as every peer published it
    assert len(shown) == 1, reads  # then not read again: not at "done", not as the peers leave
    assert shown[0] < 3.0, reads  # read again at once after the last round, not only at "done"


def test_time_boxed_rounds_count_the_steps_that_were_run():
    """With time boxes the `step` column read the schedule's (5, 15, 25, 35) while the peers ran
    20 and 8 steps; it is now the most any peer ran (tokens count every peer's)."""
    run = Experiment(
        model=_Bigram,
        loss_fn=_loss,
        peers=2,
        inner_steps=4,
        batch_size=4,
        steps=16,
        round_seconds=2,
        speeds=[1.0, 0.5],
    )
    run.run().wait(timeout=120)
    history = run.history()
    assert history["step"].iloc[-1] == max(run.result.steps_per_peer) < 16
    assert history["tokens"].iloc[-1] == sum(run.result.steps_per_peer) * 4 * run.config.model.block_size


def test_dp_s_default_budget_is_the_others_in_steps_and_counts_may_be_text():
    """dp's round is one step: its default 8 rounds were 8 steps against DiLoCo's 160, so every
    default comparison was 20x unfair. And peers="4" was refused though numbers may be text."""
    dp, diloco = Experiment(method="dp", model="tiny", peers="2"), Experiment(model="tiny", peers=2)
    assert dp.steps == diloco.steps == 160 and dp.peers == 2
    assert Experiment(method="dp", model="tiny", rounds=3).steps == 3  # given: as given


def test_compare_says_what_it_takes():
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="compare takes Experiments, got str 'foo'"):
        compare([_bigram(steps=4), "foo"])
    # A generator was read to its end by that check: an empty plot, no error (a review, stop 69).
    with pytest.raises(ValueError, match="has not run"):
        compare(e for e in [_bigram(steps=4)])


def test_a_custom_models_seed_is_checked_as_the_keyword_is():
    """A review (stop 69): ``int(seed)`` ran before the settings' check: ``seed=None`` (taken
    with a preset) was a TypeError, ``seed="abc"`` int()'s own error naming no keyword."""
    assert Experiment(model=_Bigram, loss_fn=_loss, peers=2, seed=None).config.peer.seed == 0
    with pytest.raises(ValueError, match="seed must be an integer"):
        Experiment(model=_Bigram, loss_fn=_loss, peers=2, seed="abc")


def test_keywords_of_other_types_are_taken_or_named():
    """A review (stop 69): NumPy speeds were refused; ``codec=None`` on the simulator was refused
    where None is "not given" everywhere else; ``run_dir=123``, ``initial_peers=[123]`` and
    ``wait("5")`` were errors from deep inside (pathlib, str.strip, a comparison)."""
    import numpy as np

    assert Experiment(backend="sim", peers=2, speeds=np.array([1.0, 0.5])).speeds == [1.0, 0.5]
    assert Experiment(backend="sim", peers=2, speeds=[1, np.float32(0.5)]).speeds == [1.0, 0.5]
    Experiment(backend="sim", codec=None)
    with pytest.raises(ValueError, match="run_dir is a folder's path, got int 123"):
        Experiment(run_dir=123)
    with pytest.raises(ValueError, match=r"initial_peers is a list of multiaddrs \(strings\)"):
        Experiment(backend="swarm", initial_peers=[123])
    done = _bigram(steps=4).run()
    with pytest.raises(ValueError, match="timeout is seconds to wait"):
        done.wait("5")
    done.wait(timeout=120)


def test_a_script_ending_while_a_simulation_runs_stops_it_instead_of_aborting(tmp_path):
    """A review (stop 69): the interpreter's exit cut the run's daemon thread inside torch:
    "terminate called without an active exception", SIGABRT (exit 134), for a script or a
    notebook run by papermill that ends with a run still going."""
    import subprocess
    import sys

    script = (
        "import time\n"
        "from workbench.notebook.experiment import Experiment\n"
        "e = Experiment(backend='sim', peers=2, rounds=200, inner_steps=2, model='tiny')\n"
        "e.run(); time.sleep(1)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr


class _Logits(nn.Module):  # forward(x, y) that forgets the loss
    def __init__(self, vocab: int = 256) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab, 256)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.table(x)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(model=_Logits),
            r"model\(x, y\) on token ids x, y of shape \(2, 128\).* must return \(output, loss\), got Tensor",
        ),
        (dict(model=lambda: _Logits(vocab=100)), r"failed: IndexError: index out of range in self"),
        (
            dict(
                model=_Bigram,
                loss_fn=lambda out, y: nn.functional.cross_entropy(
                    out.flatten(0, 1), y.flatten(), reduction="none"
                ),
            ),
            r"must return a loss of one number \(a 0-d float tensor\), got \(256,\)",
        ),
        (dict(model=_Bigram, loss_fn=lambda out, y: 1.0), "got float"),
        (dict(model=_Bigram, loss_fn=lambda out, y: torch.tensor(1.0)), "a loss with no gradient"),
        (
            dict(model=_Bigram, loss_fn=nn.functional.cross_entropy),
            r"failed: (RuntimeError|ValueError): Expected target size",
        ),
    ],
)
def test_a_custom_model_that_cannot_train_is_said_when_the_experiment_is_made(kwargs, message):
    """Each of these passed construction and failed after run() with torch's own error."""
    with pytest.raises(ValueError, match=message):
        Experiment(peers=2, batch_size=2, **kwargs)


def test_simulations_running_at_once_put_torch_s_threads_back_after_the_last():
    """Each run put back the count it found: A found 16 and set 1, B found 1; A ended and set 16
    under B, B ended and left the notebook at 1."""
    from workbench.notebook.experiment import _threads_in, _threads_out

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _threads_in(1)
        _threads_in(3)
        _threads_out()
        assert torch.get_num_threads() == 3  # B still runs on its own
        _threads_out()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_a_simulated_history_row_counts_what_each_peer_had_run_by_its_round() -> None:
    """Streaming and overlapped virtual peers do not wait for each other every simulator round:
    a fast peer's later rounds came in before a slow peer's report of this one, and its running
    step count went into this round's row (step 17 for 16, tokens 16512 for 16384)."""
    import threading
    from types import SimpleNamespace

    from workbench.notebook.experiment import _SimRows

    config = SimpleNamespace(data=SimpleNamespace(batch_size=2), model=SimpleNamespace(block_size=8))
    experiment = SimpleNamespace(peers=2, steps=12, config=config, _lock=threading.Lock(), _rows=[])
    rows = _SimRows(experiment, loop_steps=4, per_row=1, started=0.0)

    def report(rank: int, sim_round: int) -> None:
        rows.reported(dict(round=sim_round, rank=rank, step=4 * sim_round, bytes=10, loss=1.0))

    report(1, 1)
    report(1, 2)  # the fast peer is a round ahead
    report(0, 1)
    report(0, 2)
    assert [(r["round"], r["step"], r["tokens"]) for r in experiment._rows] == [
        (1, 4, 8 * 16),
        (2, 8, 16 * 16),
    ]


def test_real_peers_take_a_step_budget_of_whole_rounds_only() -> None:
    """Real peers run whole rounds: steps=30 with inner_steps=20 ran 40 steps a peer while the
    Experiment said 30 (the simulator ran 30: a comparison of unequal budgets)."""
    with pytest.raises(ValueError, match=r"steps=30 is not a multiple of it; give steps=40 \(or rounds=2\)"):
        Experiment(backend="local", steps=30, inner_steps=20, peers=2, model="tiny")
    assert Experiment(backend="local", steps=40, inner_steps=20, peers=2, model="tiny").rounds == 2
    assert Experiment(backend="sim", steps=30, inner_steps=20, peers=2, model="tiny").steps == 30


def test_a_real_streaming_peer_gives_one_history_row_per_outer_round_and_its_end() -> None:
    """A streaming peer sends an event per fragment sync: rounds=2 with 4 fragments made 8 rows
    numbered 1..8; and the run's end (the last mean a delayed run had in flight, the final θ's
    eval loss) never reached the history, which the simulator's rows hold."""
    experiment = Experiment(backend="local", method="streaming", inner_steps=4, fragments=2, rounds=2, peers=2,
                            model="tiny", sync_delay=1)  # fmt: skip

    def sync(outer_step: int, loss: float) -> dict:
        return dict(event="round", outer_step=outer_step, bytes_sent=10, inner_steps=2, loss=loss,
                    eval_loss=3.0 - outer_step / 10, evaluated=outer_step % 2 == 0, time=100.0 + outer_step)  # fmt: skip

    class Peer:
        events = [
            dict(event="started", time=100.0),
            dict(event="initial_eval", outer_step=0, eval_loss=3.5),
            *(sync(s, loss) for s, loss in zip(range(1, 5), (4.0, 3.0, 2.0, 1.0))),
            dict(event="final_sync", outer_step=4, bytes_sent=7),
            dict(event="done", final_eval_loss=2.5),
        ]

        def last(self, kind: str) -> dict | None:
            return next((e for e in self.events if e["event"] == kind), None)

        def poll_events(self) -> None:
            pass

    experiment._follow(Peer(), finished=lambda: True)
    rows = [(r["round"], r["step"], r["bytes_per_peer"], r["loss"], r["eval_loss"]) for r in experiment._rows]
    assert rows == [(0, 0, 0, None, 3.5), (1, 4, 20, 3.5, 2.8), (2, 8, 47, 1.5, 2.5)]


def test_numpy_numbers_are_numbers() -> None:
    """A sweep over np.arange or a pandas column gives NumPy scalars: `peers=np.int64(4)` was
    refused as "must be a whole number (got np.int64(4))", `outer_lr=np.float32(0.5)` as not a
    number."""
    np = pytest.importorskip("numpy")

    run = Experiment(backend="sim", peers=np.int64(3), steps=np.int64(40), inner_steps=np.int64(20))
    assert (run.peers, run.config.diloco.inner_steps) == (3, 20) and type(run.peers) is int
    assert (
        Experiment(backend="sim", peers=2, steps=40, outer_lr=np.float32(0.5)).config.diloco.outer_lr == 0.5
    )
    with pytest.raises(ValueError, match="inner_steps must be an integer"):
        Experiment(backend="sim", peers=2, steps=40, inner_steps=np.float64(20.5))


def test_a_missing_notebook_extra_says_how_to_install_it(monkeypatch) -> None:
    """A plain `pip install .` has no pandas, matplotlib or anywidget: `widget()` raised a bare
    "No module named 'anywidget'", with nothing naming the notebook extra (a review, stop 60)."""
    import builtins

    real_import = builtins.__import__

    def without(name, *args, **kwargs):
        if name.split(".")[0] in ("pandas", "matplotlib", "anywidget"):
            raise ModuleNotFoundError(f"No module named '{name}'")
        return real_import(name, *args, **kwargs)

    run = Experiment(backend="sim", peers=2, steps=40, model="tiny")
    monkeypatch.setattr(builtins, "__import__", without)
    import importlib

    monkeypatch.setattr(importlib, "import_module", lambda name, package=None: without(name))
    for call, package in (
        (run.history, "pandas"),
        (run.widget, "anywidget"),
        (lambda: compare([run]), "matplotlib"),
    ):
        with pytest.raises(
            ImportError, match=rf"needs the '{package}' package: pip install 'swarm-workbench\[notebook\]'"
        ):
            call()
