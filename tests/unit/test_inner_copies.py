"""AdamW's state for joiners (optim.state.InnerStateCopies): copied when someone asks, never
every round, and always a state no inner step was writing while it was copied."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

import optim.state
from optim.averager import LocalAverager
from optim.diloco import DiLoCo, DiLoCoConfig
from optim.state import InnerStateCopies
from optim.streaming import StreamingConfig, StreamingDiLoCo, StreamingRounds

H = 3


def adamw_peer(config: DiLoCoConfig | None = None, averager=None) -> tuple[DiLoCo, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return DiLoCo(model, inner, averager or LocalAverager(), config or DiLoCoConfig(inner_steps=H)), inner


def past_the_first_round(outer, inner) -> None:
    """One round (before it, a joiner gets no moments), then rounds too long to end in a test."""
    for step in range(outer.config.inner_steps):
        one_step(outer, inner, 100 + step)
    assert outer.outer_step_count == 1
    outer.retune(inner_steps=1000)


def one_step(outer, inner: torch.optim.Optimizer, seed: int):
    """One inner step on its own batch, then the round's hook (the sync after the H-th)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    nn.functional.mse_loss(outer.model(x), y).backward()
    inner.step()
    inner.zero_grad(set_to_none=True)
    return outer.after_inner_step(samples=8)


def moments(inner: torch.optim.Optimizer) -> dict[tuple[int, str], torch.Tensor]:
    return {
        (index, key): value.clone()
        for index, state in inner.state_dict()["state"].items()
        for key, value in state.items()
    }


def served(state) -> dict[tuple[int, str], torch.Tensor]:
    return {(int(i), str(k)): t for (i, k), t in zip(state.inner_keys, state.inner)}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def counting_copies(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = optim.state.inner_state_tensors

    def counted(optimizer, params=None):
        calls.append(1)
        return real(optimizer, params)

    monkeypatch.setattr(optim.state, "inner_state_tensors", counted)
    return calls


def test_rounds_copy_nothing_until_someone_asks(monkeypatch) -> None:
    """A copy of AdamW's state (twice the model) was taken every round and kept for good."""
    calls = counting_copies(monkeypatch)
    outer, inner = adamw_peer()
    one_step(outer, inner, 99)
    # Before the first round every peer's AdamW starts from zero, and so does a joiner's (the
    # simulator's peers do too: tests/integration/test_sim_matches_swarm.py).
    assert outer.outer_state().inner == [] and calls == []
    for step in range(3 * H - 1):
        one_step(outer, inner, step)
    assert outer.outer_step_count == 3 and calls == []
    state = outer.outer_state()  # asked by the trainer's own thread (a test, a checkpoint): at once
    assert len(calls) == 1 and same(served(state), moments(inner))
    assert outer.outer_state(inner=False).inner == []  # a checkpoint saves the optimizer itself
    assert len(calls) == 1


def test_a_state_asked_for_mid_round_is_copied_at_the_trainers_next_step_boundary() -> None:
    """The asker waits for the trainer to finish the step it is in: the copy holds the moments
    after one step, never those of a step half done."""
    outer, inner = adamw_peer()
    after: dict[int, dict] = {}
    stepped, in_step = threading.Event(), threading.Event()
    real_step = inner.step

    def slow_step(*args, **kwargs):  # a step the asker arrives in the middle of
        if stepped.is_set():
            in_step.set()
            time.sleep(0.2)
        return real_step(*args, **kwargs)

    inner.step = slow_step

    def train() -> None:
        past_the_first_round(outer, inner)
        for step in range(6):
            one_step(outer, inner, step)
            after[step + 1] = moments(inner)
            stepped.set()

    trainer = threading.Thread(target=train)
    trainer.start()
    assert in_step.wait(10)
    state = outer.outer_state()
    trainer.join()
    got = served(state)
    step = int(got[(0, "step")]) - H  # AdamW counts the first round's steps too
    assert step >= 2 and same(got, after[step])


def test_a_state_asked_for_during_a_sync_is_the_rounds_final_state_at_once() -> None:
    """The trainer is in its all-reduce (minutes over the internet): the asker copies the
    round's final moments itself, without waiting for the next inner step."""
    entered, release = threading.Event(), threading.Event()

    class SlowAverager(LocalAverager):
        def all_reduce(self, tensors, **kwargs):
            entered.set()
            release.wait(10)
            return super().all_reduce(tensors, **kwargs)

    outer, inner = adamw_peer(averager=SlowAverager())
    outer.inner_copies.wait = 30.0
    release.set()
    for step in range(2 * H - 1):  # the first round, then all but the last step of the second
        one_step(outer, inner, step)
    assert outer.outer_step_count == 1
    entered.clear()
    release.clear()
    trainer = threading.Thread(target=one_step, args=(outer, inner, 2 * H))
    trainer.start()
    assert entered.wait(10)
    final = moments(inner)
    start = time.monotonic()
    state = outer.outer_state(inflight_timeout=0.0)
    waited = time.monotonic() - start
    release.set()
    trainer.join()
    assert waited < 5.0 and same(served(state), final)


def test_a_trainer_that_stopped_stepping_holds_an_asker_at_most_its_wait() -> None:
    outer, inner = adamw_peer()
    past_the_first_round(outer, inner)
    one_step(outer, inner, 0)  # this thread is the trainer, in the middle of a round
    outer.inner_copies.wait = 0.2
    result = []
    asker = threading.Thread(target=lambda: result.append(outer.outer_state()))
    start = time.monotonic()
    asker.start()
    asker.join(10)
    assert 0.2 <= time.monotonic() - start < 5.0
    assert same(served(result[0]), moments(inner))


def test_a_copy_racing_a_growing_state_dict_is_taken_again() -> None:
    class Racing(torch.optim.SGD):
        races = 2

        def state_dict(self):
            if Racing.races:
                Racing.races -= 1
                raise RuntimeError("dictionary changed size during iteration")
            return super().state_dict()

    model = nn.Linear(2, 1)
    optimizer = Racing(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    keys, tensors = InnerStateCopies(optimizer).take()
    assert Racing.races == 0 and [k for _, k in keys] == ["momentum_buffer", "momentum_buffer"]


def test_a_failed_copy_fails_its_askers_not_the_trainer() -> None:
    """An error copying (the host out of memory) reaches the askers; nobody waits for an
    answer, and the donor's training goes on (it used to raise in the trainer: a joiner's
    request stopped the donor)."""
    outer, inner = adamw_peer()
    past_the_first_round(outer, inner)
    copies = outer.inner_copies
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            copies.take()
        except MemoryError as error:
            errors.append(error)

    asker = threading.Thread(target=ask)
    asker.start()
    while not copies._asked:
        time.sleep(0.001)
    copies._copy = lambda: (_ for _ in ()).throw(MemoryError("no room for AdamW's state"))
    copies.boundary()
    asker.join(10)
    assert len(errors) == 1
    one_step(outer, inner, 1)  # and trains on


def test_a_copy_cut_by_ctrl_c_stops_the_trainer_and_fails_its_askers_with_an_error_of_their_own() -> None:
    """Ctrl+C in the trainer's copy: the trainer stops (KeyboardInterrupt), the asker gets a
    RuntimeError. Handed the KeyboardInterrupt itself, hivemind's state thread sent it to the
    averager process, whose event loop's thread died with a traceback in the peer's log."""
    outer, inner = adamw_peer()
    past_the_first_round(outer, inner)
    one_step(outer, inner, 0)
    copies = outer.inner_copies
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            copies.take()
        except BaseException as error:  # noqa: BLE001 - what the asker got
            errors.append(error)

    asker = threading.Thread(target=ask)
    asker.start()
    while not copies._asked:
        time.sleep(0.001)
    copies._copy = lambda: (_ for _ in ()).throw(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        copies.boundary()
    asker.join(10)
    assert len(errors) == 1 and type(errors[0]) is RuntimeError and "KeyboardInterrupt" in str(errors[0])


def test_an_asker_whose_wait_runs_out_while_the_trainer_copies_takes_that_copy(monkeypatch) -> None:
    """A big state: the trainer takes the request at its boundary and copies for longer than the
    asker's wait. The asker used to copy too, meanwhile: two copies of AdamW's state at once,
    the second racing the trainer's next steps."""
    outer, inner = adamw_peer()
    past_the_first_round(outer, inner)
    one_step(outer, inner, 0)  # this thread is the trainer, in the middle of a round
    copies = outer.inner_copies
    copies.wait = 0.3
    real, live, peak = optim.state.inner_state_tensors, [0], [0]

    def slow(optimizer, params=None):
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        time.sleep(0.5)
        try:
            return real(optimizer, params)
        finally:
            live[0] -= 1

    monkeypatch.setattr(optim.state, "inner_state_tensors", slow)
    result = []
    asker = threading.Thread(target=lambda: result.append(copies.take()))
    asker.start()
    while not copies._asked:
        time.sleep(0.001)
    time.sleep(0.1)
    copies.boundary()  # answers: 0.5 s of copying, past the asker's 0.3 s
    asker.join(10)
    assert peak[0] == 1 and len(result) == 1
    keys, tensors = result[0]
    assert same({(int(i), str(k)): t for (i, k), t in zip(keys, tensors)}, moments(inner))


def test_a_diverged_peer_serves_no_moments() -> None:
    """A peer whose inner steps went NaN used to answer a joiner with its NaN moments (copied at
    the sync's start, before the sync found the NaN and cleared them): the joiner's first step
    then made its weights NaN."""
    outer, inner = adamw_peer()
    past_the_first_round(outer, inner)
    one_step(outer, inner, 7)
    for p in outer.model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    inner.step()
    inner.zero_grad(set_to_none=True)
    state = outer.outer_state()
    assert state.inner == [] and state.inner_keys == []
    assert all(torch.isfinite(p).all() for p in state.params)


def test_askers_after_the_last_round_copy_at_once() -> None:
    """finish(): no inner step comes any more, so an asker does not wait for one."""
    outer, inner = adamw_peer()
    past_the_first_round(outer, inner)
    one_step(outer, inner, 0)
    outer.finish()
    outer.inner_copies.wait = 30.0
    result = []
    asker = threading.Thread(target=lambda: result.append(outer.outer_state()))
    start = time.monotonic()
    asker.start()
    asker.join(20)
    assert time.monotonic() - start < 5.0 and result
    assert same(served(result[0]), moments(inner))


def test_streaming_rounds_copy_nothing_until_someone_asks(monkeypatch) -> None:
    calls = counting_copies(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = StreamingConfig(outer=DiLoCoConfig(inner_steps=4), fragments=2)
    rounds = StreamingRounds(StreamingDiLoCo(model, inner, LocalAverager(), config))
    g = torch.Generator().manual_seed(1)
    for _ in range(8):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        inner.zero_grad(set_to_none=True)
        rounds.note_inner_step(samples=8)
        if rounds.inner_step_count >= rounds.steps_per_round:
            rounds.sync()
    assert rounds.outer_step_count == 4 and calls == []
    state = rounds.outer_state()
    assert len(calls) == 1 and same(served(state), moments(inner))
