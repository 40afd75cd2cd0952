"""A peer resumed from its checkpoint that joins a swarm (``join --resume``): what it keeps.

Stop 57, a review: every joiner downloaded the state after its resume and loaded it, which
dropped what only the checkpoint holds (error feedback's residuals, the eager stand-in,
streaming's fragments not synced yet, its own AdamW), even when the swarm was where the
checkpoint was (every peer of a run stopped and resumed)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from optim.averager import LocalAverager
from optim.config import DiLoCoConfig
from optim.diloco import DiLoCo
from optim.eager import AdamW
from workbench.run import joining
from workbench.run.checkpoint import restore_training, training_state


def _peer():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    inner = AdamW(model.parameters(), lr=1e-2)
    config = DiLoCoConfig(inner_steps=2, codec="int8", error_feedback=True)
    return model, inner, DiLoCo(model, inner, averager=LocalAverager(), config=config)


def _round(model, inner, rounds) -> None:
    for _ in range(2):
        model(torch.randn(4, 8)).pow(2).sum().backward()
        inner.step()
        inner.zero_grad()
        rounds.note_inner_step(samples=4)
    rounds.sync()


def _join(rounds, state, events) -> bool:
    averager = SimpleNamespace(
        download_state=lambda **kwargs: state, download_donors=lambda: 1, set_state_priority=lambda step: None
    )
    return joining.download_state(
        averager, rounds, emit=lambda event, **f: events.append(event), name="p", run_id="r",
        reason="joining", oldest_unconfirmed=rounds.outer_step_count, keep_own=True,
    )  # fmt: skip


def test_a_resumed_joiner_keeps_its_checkpoints_state_where_the_swarm_holds_its_theta():
    model, inner, rounds = _peer()
    _round(model, inner, rounds)
    saved = training_state(rounds, model, inner, None)
    swarm = rounds.outer_state()  # the others, resumed too: the same θ at the same step
    model2, inner2, resumed = _peer()
    restore_training(saved, resumed, model2, inner2, None)
    events: list[str] = []
    assert _join(resumed, swarm, events) and events == ["state_confirmed"]
    assert resumed.feedback.residuals is not None
    assert all(torch.equal(a, b) for a, b in zip(resumed.feedback.residuals, saved["feedback"]))


def test_a_resumed_joiner_takes_the_swarms_state_where_it_moved_on():
    model, inner, rounds = _peer()
    _round(model, inner, rounds)
    saved = training_state(rounds, model, inner, None)
    _round(model, inner, rounds)  # the swarm trained on without this peer
    ahead = rounds.outer_state()
    model2, inner2, resumed = _peer()
    restore_training(saved, resumed, model2, inner2, None)
    events: list[str] = []
    assert _join(resumed, ahead, events) and events == ["state_downloaded"]
    assert resumed.outer_step_count == ahead.outer_step
    assert all(torch.equal(a, b) for a, b in zip(resumed.global_params, ahead.params))


def test_a_resumed_peer_trains_with_the_inner_settings_of_its_flags_and_the_moments_of_its_checkpoint():
    """Stop 57, a review: torch's load_state_dict put the checkpoint's weight decay and betas
    back over the flags the peer was resumed with."""
    model, inner, rounds = _peer()
    _round(model, inner, rounds)
    saved = training_state(rounds, model, inner, None)
    model2, _, resumed = _peer()
    other = AdamW(model2.parameters(), lr=1e-2, weight_decay=0.0, betas=(0.8, 0.99))
    resumed.inner_optimizer = other
    restore_training(saved, resumed, model2, other, None)
    group = other.param_groups[0]
    assert group["weight_decay"] == 0.0 and group["betas"] == (0.8, 0.99)
    moments = [s["exp_avg"] for s in other.state.values()]
    assert moments and all(m.abs().sum() > 0 for m in moments)  # the checkpoint's


def test_streaming_peers_with_another_sync_delay_or_alpha_train_another_run():
    from workbench.config import RunConfig
    from workbench.run.joining import fingerprint
    from workbench.run.model import GPT, tiny

    model = GPT(tiny())
    base = RunConfig(method="streaming", fragments=2)
    prints = {
        fingerprint(base, model)[0],
        fingerprint(RunConfig(method="streaming", fragments=2, sync_delay=1), model)[0],
        fingerprint(RunConfig(method="streaming", fragments=2, alpha=0.5), model)[0],
    }
    assert len(prints) == 3


def test_a_resumed_peer_draws_the_dropout_masks_the_uninterrupted_one_would():
    """Stop 57, a review: torch's generator (dropout's, 0.1 in a Hugging Face GPT-2) was not in
    the checkpoint, so "bit for bit on one peer" held for the built-in presets only."""
    model, inner, rounds = _peer()
    _round(model, inner, rounds)
    saved = training_state(rounds, model, inner, None)
    uninterrupted = torch.nn.functional.dropout(torch.ones(64), p=0.5)
    torch.manual_seed(123)  # a new process's generator
    model2, inner2, resumed = _peer()
    restore_training(saved, resumed, model2, inner2, None)
    assert torch.equal(torch.nn.functional.dropout(torch.ones(64), p=0.5), uninterrupted)


def test_waiting_for_min_peers_says_so_every_15_seconds(monkeypatch, caplog) -> None:
    """--min-peers waits up to 120 s: nothing was printed until it gave up (a volunteer saw 43 s
    of silence after "created a new key", a review, stop 60)."""
    from types import SimpleNamespace

    from workbench.run import joining

    clock = [0.0]
    monkeypatch.setattr(joining.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(joining.time, "sleep", lambda seconds: clock.__setitem__(0, clock[0] + seconds))
    board = SimpleNamespace(fetch=lambda: {"me": SimpleNamespace(stage=None)})
    caplog.set_level("INFO", logger="workbench.run.joining")
    joining.wait_for_peers(board, lambda stage: None, wanted=2, timeout=40.0, name="a")
    waiting = [r.getMessage() for r in caplog.records if "waiting for --min-peers 2" in r.getMessage()]
    # at once (15 s of silence before the first, a hands-on review, stop 72), then every 15 s
    assert len(waiting) == 3 and "1 peer(s) here so far (40 s left" in waiting[0], waiting
    assert "(25 s left" in waiting[1], waiting
    assert "only 1 of 2 peers after 40 s; starting anyway" in caplog.records[-1].getMessage()


def test_a_checkpoint_s_round_mates_are_peer_ids_or_none():
    """What a resumed first peer waits for (``Peer.run``): the checkpoint's ``mates``, read as
    peer ids; an earlier release's checkpoint has none, and a malformed list is none of it."""
    mate = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    assert joining.checked_mates([mate, 5, "no spaces allowed", "x" * 200]) == [mate]
    assert joining.checked_mates(None) == [] and joining.checked_mates({"a": 1}) == []
    assert len(joining.checked_mates([mate] * 100)) == 16  # a heartbeat names at most 16

    seen = iter([{}, {"stranger": None}, {mate: None}])
    board = SimpleNamespace(fetch=lambda: next(seen))
    assert joining.wait_for_mates(board, lambda stage: None, [mate], timeout=10.0, name="a")
    assert not joining.wait_for_mates(board, lambda stage: None, [], timeout=10.0, name="a")  # at once
    quiet = SimpleNamespace(fetch=dict)
    assert not joining.wait_for_mates(quiet, lambda stage: None, [mate], timeout=0.6, name="a")
