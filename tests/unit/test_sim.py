"""The simulated swarm and the data-parallel baseline, against values worked out by hand."""

from __future__ import annotations

import _thread
import itertools
import threading
import time

import pytest
import torch
from torch import nn

from optim.data_parallel import DataParallel
from optim.diloco import DiLoCo, DiLoCoConfig
from optim.sim import InProcessSwarm, SimConfig, VirtualPeer, simulate


class Regression(nn.Module):
    """A model with the workbench's forward contract: (inputs, targets) -> (output, loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.linear(x)
        return out, ((out - y) ** 2).mean()


def init_model(seed: int = 0) -> Regression:
    torch.manual_seed(seed)
    return Regression()


def stream(rank: int, batch: int = 8):
    """Peer ``rank``'s endless, deterministic batches: y = x·w + noise."""
    generator = torch.Generator().manual_seed(100 + rank)
    w = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    while True:
        x = torch.randn(batch, 4, generator=generator)
        yield x, x @ w + 0.01 * torch.randn(batch, 1, generator=generator)


def mse(model: nn.Module) -> float:
    x, y = next(stream(99, batch=256))
    with torch.no_grad():
        return float(model(x, y)[1])


def factory(
    method: str,
    *,
    H: int = 5,
    lr: float = 0.05,
    outer_lr: float = 0.7,
    momentum: float = 0.9,
    sgd: bool = False,
    delay: int = 0,
    overlap: bool = False,
):
    def make_peer(rank: int, swarm: InProcessSwarm) -> VirtualPeer:
        model = init_model()
        inner = (
            torch.optim.SGD(model.parameters(), lr=lr)
            if sgd
            else torch.optim.AdamW(model.parameters(), lr=lr)
        )
        if method == "dp":
            outer = DataParallel(model, inner, swarm.averager(rank))
            steps = 1
        else:
            config = DiLoCoConfig(
                inner_steps=H,
                outer_lr=outer_lr,
                outer_momentum=momentum,
                nesterov=momentum > 0,
                delay=delay,
                overlap=overlap,
            )
            outer = DiLoCo(model, inner, swarm.averager(rank), config)
            steps = H
        return VirtualPeer(
            model=model, inner_optimizer=inner, outer=outer, batches=stream(rank), inner_steps=steps
        )

    return make_peer


def test_data_parallel_equals_one_model_on_the_union_of_batches():
    """Mean of per-peer mean-loss gradients = gradient of the mean loss over all batches."""
    result_peers = 3
    steps = 6
    swarm_result = simulate(factory("dp", sgd=True), mse, SimConfig(peers=result_peers, steps=steps))

    model = init_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    streams = [stream(rank) for rank in range(result_peers)]
    for _ in range(steps):
        batches = [next(s) for s in streams]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        model(x, y)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    assert swarm_result.final_eval_loss == pytest.approx(mse(model), rel=1e-5)
    assert swarm_result.params_max_abs_diff == 0.0
    assert swarm_result.bytes_per_peer == steps * 5 * 4  # 5 fp32 parameters per step


def test_diloco_with_h1_lr1_no_momentum_equals_data_parallel_with_sgd():
    """With inner SGD, mean(θ − (θ − lr·g_i)) = lr·mean(g_i): one DiLoCo round is one DP step."""
    dp = simulate(factory("dp", sgd=True), mse, SimConfig(peers=4, steps=5))
    diloco = simulate(
        factory("diloco", H=1, outer_lr=1.0, momentum=0.0, sgd=True), mse, SimConfig(peers=4, steps=5)
    )
    assert diloco.final_eval_loss == pytest.approx(dp.final_eval_loss, rel=1e-5)


def test_fedavg_with_one_peer_equals_local_training():
    result = simulate(factory("diloco", H=4, outer_lr=1.0, momentum=0.0), mse, SimConfig(peers=1, steps=12))
    model = init_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for x, y in itertools.islice(stream(0), 12):
        model(x, y)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    assert result.final_eval_loss == pytest.approx(mse(model), rel=1e-5)
    assert result.rounds == 3


def test_simulation_is_deterministic_and_peers_agree():
    config = SimConfig(peers=4, steps=20, stragglers={2: 0.4}, dropout=0.3, seed=7)
    first = simulate(factory("diloco"), mse, config)
    second = simulate(factory("diloco"), mse, config)
    assert first.final_eval_loss == second.final_eval_loss
    assert first.params_max_abs_diff == 0.0  # dropped peers adopt the group's result
    assert first.final_eval_loss < first.initial_eval_loss
    assert first.rounds == 4


def test_dropout_schedule_keeps_one_peer_and_replays():
    swarm = InProcessSwarm(3, dropout=0.9, seed=1)
    schedules = [swarm.dropped(r) for r in range(50)]
    assert all(len(d) < 3 for d in schedules)
    assert any(schedules)
    assert schedules == [InProcessSwarm(3, dropout=0.9, seed=1).dropped(r) for r in range(50)]


def test_a_peer_sends_nothing_in_a_round_it_missed_or_spent_alone():
    """bytes_per_peer counted every round, missed or not: dropout did not lower it."""
    full = simulate(factory("diloco"), mse, SimConfig(peers=3, steps=40))
    per_round = full.bytes_per_peer // full.rounds
    assert per_round > 0 and full.bytes_per_peer == per_round * 8
    swarm = InProcessSwarm(3, dropout=0.5, seed=0)
    sent = [r for r in range(8) if 0 not in swarm.dropped(r) and len(swarm.dropped(r)) < 2]
    assert 0 < len(sent) < 8  # the schedule drops rank 0 from some rounds, not all
    dropping = simulate(factory("diloco"), mse, SimConfig(peers=3, steps=40, dropout=0.5))
    assert dropping.bytes_per_peer == per_round * len(sent)
    assert simulate(factory("diloco"), mse, SimConfig(peers=1, steps=40)).bytes_per_peer == 0


def test_a_failing_peer_stops_the_run_without_hanging():
    def make_peer(rank: int, swarm: InProcessSwarm) -> VirtualPeer:
        peer = factory("diloco", H=2)(rank, swarm)
        if rank == 1:

            def broken():
                yield next(stream(1))
                raise RuntimeError("disk on fire")

            peer.batches = broken()
        return peer

    with pytest.raises(RuntimeError, match="disk on fire"):
        simulate(make_peer, mse, SimConfig(peers=3, steps=6))


def test_ctrl_c_stops_every_virtual_peer_at_its_next_step():
    """Ctrl+C (KeyboardInterrupt in the caller's thread, wherever the signal landed) ends the
    simulation within a step: no virtual peer trains on in the background, which kept the
    process alive after Ctrl+C until the whole run was done."""
    taken = [0, 0, 0]
    workers: set[threading.Thread] = set()

    def make_peer(rank: int, swarm: InProcessSwarm) -> VirtualPeer:
        peer = factory("diloco")(rank, swarm)
        batches = peer.batches

        def counted():
            for batch in batches:
                workers.add(threading.current_thread())
                taken[rank] += 1
                # What Ctrl+C does, from a virtual peer's thread; again much later only if
                # the first was lost (raised in a gc callback of the main thread, say).
                if rank == 0 and taken[0] % 3000 == 12:
                    _thread.interrupt_main()
                yield batch

        peer.batches = counted()
        return peer

    with pytest.raises(KeyboardInterrupt):
        simulate(make_peer, mse, SimConfig(peers=3, steps=1_000_000))
    assert len(workers) == 3 and not [t for t in workers if t.is_alive()], (workers, taken)
    settled = list(taken)
    time.sleep(0.2)
    assert taken == settled and max(taken) < 10_000, taken


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(peers=0), "peers"),
        (dict(steps=0), "steps"),
        (dict(stragglers={5: 0.5}), "straggler"),
        (dict(stragglers={0: 0.0}), "straggler"),
        (dict(dropout=1.0), "dropout"),
        (dict(peers=2, speeds=[1.0]), "speeds"),
        (dict(peers=2, speeds=[1.0, 0.0]), "speeds"),
        (dict(round_seconds=-1.0), "round_seconds"),
        (dict(step_seconds=0.0), "step_seconds"),
    ],
)
def test_sim_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SimConfig(**kwargs)


def test_one_step_delay_applies_the_previous_rounds_mean():
    """delay=1: round r applies round r-1's mean Δ; with lr 1 and no momentum θ after round 2 is
    θ0 − Δ_0, where Δ_0 is the first round's pseudo-gradient (computed from θ0)."""
    model = init_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    config = DiLoCoConfig(inner_steps=2, outer_lr=1.0, outer_momentum=0.0, nesterov=False, delay=1)
    from optim.averager import LocalAverager

    outer = DiLoCo(model, inner, LocalAverager(), config)
    theta0 = [g.clone() for g in outer.global_params]
    data = stream(0)

    def run_round() -> list[torch.Tensor]:
        for _ in range(2):
            x, y = next(data)
            model(x, y)[1].backward()
            inner.step()
            inner.zero_grad()
            outer.note_inner_step(samples=len(x))
        delta = outer.compute_pseudo_gradients()
        outer.sync()
        return delta

    delta0 = run_round()
    assert outer.outer_step_count == 1
    assert all(torch.equal(g, t) for g, t in zip(outer.global_params, theta0))  # nothing applied yet
    run_round()
    assert outer.outer_step_count == 2
    for g, t, d in zip(outer.global_params, theta0, delta0):
        torch.testing.assert_close(g, t - d)


def test_delayed_diloco_trains_in_the_simulator():
    result = simulate(
        factory("diloco", H=3, outer_lr=0.7, momentum=0.9, delay=1), mse, SimConfig(peers=2, steps=30)
    )
    assert result.final_eval_loss < result.initial_eval_loss
    assert result.rounds == 10 and result.params_max_abs_diff == 0.0


def test_a_diverged_virtual_peer_sends_nothing_and_keeps_the_swarm_in_step():
    """A peer whose update is NaN contributes weight 0 and takes the group's mean: no barrier
    waits for it, and its θ stays the swarm's."""

    def make_peer(rank: int, swarm: InProcessSwarm) -> VirtualPeer:
        peer = factory("diloco", H=2)(rank, swarm)
        if rank == 1:
            clean = stream(1)

            def poisoned():
                for index, (x, y) in enumerate(clean):
                    yield (x * float("nan"), y) if index == 2 else (x, y)

            peer.batches = poisoned()
        return peer

    result = simulate(make_peer, mse, SimConfig(peers=3, steps=8))
    assert result.rounds == 4
    assert result.params_max_abs_diff == 0.0
    assert result.final_eval_loss < result.initial_eval_loss


def test_overlapped_rounds_give_exactly_the_blocking_one_step_delay():
    """Averaging in the background changes when the mean arrives, never what is applied."""
    blocking = simulate(factory("diloco", H=3, delay=1), mse, SimConfig(peers=3, steps=15))
    overlapped = simulate(factory("diloco", H=3, delay=1, overlap=True), mse, SimConfig(peers=3, steps=15))
    assert overlapped.rounds == blocking.rounds == 5
    assert overlapped.params_max_abs_diff == 0.0  # the peers agree
    for a, b in zip(overlapped.final_params, blocking.final_params):
        assert torch.equal(a, b)
    assert overlapped.final_eval_loss < overlapped.initial_eval_loss


class _Bigram(nn.Module):
    """Your own module: next-token logits from the current token only."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table(x)  # (B, T, 256)


def _next_token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


@pytest.mark.parametrize("given", ["module", "factory"])
def test_an_experiment_trains_your_own_module_with_your_loss(given: str):
    from workbench import Experiment

    model = _Bigram() if given == "module" else _Bigram
    run = Experiment(
        backend="sim",
        model=model,
        loss_fn=_next_token_loss,
        peers=2,
        steps=40,
        inner_steps=10,
        batch_size=8,
        inner_lr=0.05,
    )
    run.run().wait(timeout=120)
    history = run.history()
    assert run.result.params_max_abs_diff == 0.0  # both virtual peers hold the same θ
    assert history["eval_loss"].iloc[-1] < history["eval_loss"].iloc[0] - 0.2
    if given == "module":  # the module handed in is a template: it stays untrained
        assert all(p.grad is None for p in model.parameters())


def test_your_own_module_is_for_the_simulator_only():
    from workbench import Experiment

    with pytest.raises(ValueError, match="backend='sim'"):
        Experiment(backend="local", model=_Bigram(), loss_fn=_next_token_loss)
    with pytest.raises(ValueError, match="loss_fn goes with model"):
        Experiment(backend="sim", model="tiny", loss_fn=_next_token_loss)


def test_the_wire_codec_is_for_real_peers_only():
    """The simulator has no wire: ``codec=`` (real peers' all-reduce) would change nothing."""
    from workbench import Experiment

    with pytest.raises(ValueError, match="use update_codec='int8'"):
        Experiment(backend="sim", codec="int8")
    assert Experiment(backend="sim", update_codec="int8").config.diloco.codec == "int8"
    assert Experiment(backend="local", codec="int8").config.averaging.compression == "int8"


def test_time_boxed_rounds_on_the_virtual_clock():
    """Two peers at half speed: with fixed H every round lasts as long as their steps and the
    fast peers idle half the time; with a time box each runs what fits (the fast ones H, the
    slow ones H/2), rounds take half as long and nobody idles. Deterministic: no wall clock."""
    speeds = [1.0, 1.0, 0.5, 0.5]
    fixed = simulate(factory("diloco", H=4), mse, SimConfig(peers=4, steps=16, speeds=speeds))
    assert fixed.steps_per_peer == [16] * 4 and fixed.virtual_seconds == 32.0
    assert fixed.utilization == [0.5, 0.5, 1.0, 1.0]
    config = SimConfig(peers=4, steps=16, speeds=speeds, round_seconds=4.0)
    boxed = simulate(factory("diloco", H=4), mse, config)
    assert boxed.steps_per_peer == [16, 16, 8, 8] and boxed.virtual_seconds == 16.0
    assert boxed.utilization == [1.0] * 4 and boxed.rounds == 4
    assert boxed.params_max_abs_diff == 0.0  # unequal H, one θ
    assert boxed.final_eval_loss < boxed.initial_eval_loss
    again = simulate(factory("diloco", H=4), mse, config)
    assert again.final_eval_loss == boxed.final_eval_loss
    # At least one step per round, at most H, whatever the box.
    assert SimConfig(peers=2, speeds=[1.0, 0.01], round_seconds=4.0).steps_in_round(1, 4) == 1
    assert SimConfig(peers=2, speeds=[100.0, 1.0], round_seconds=4.0).steps_in_round(0, 4) == 4
    # A day's box of 1e-305 s steps fits infinitely many: H (it raised OverflowError, a review).
    assert SimConfig(peers=2, round_seconds=86400.0, step_seconds=1e-305).steps_in_round(0, 4) == 4


def test_an_experiment_runs_time_boxed_rounds_on_the_virtual_clock():
    from workbench import Experiment

    common = dict(backend="sim", model=_Bigram, loss_fn=_next_token_loss, peers=2, steps=40, inner_steps=10)
    run = Experiment(**common, batch_size=8, inner_lr=0.05, speeds=[1.0, 0.5], round_seconds=10)
    run.run().wait(timeout=120)
    assert run.result.steps_per_peer == [40, 20] and run.result.utilization == [1.0, 1.0]
    with pytest.raises(ValueError, match="backend='sim'"):
        Experiment(backend="local", speeds=[1.0, 0.5])


def test_data_parallel_leaves_a_parameter_no_member_used_without_a_gradient() -> None:
    """A parameter unused this step (by every member) got a zero gradient, so AdamW's weight
    decay and momentum moved it, where torch alone leaves a parameter whose .grad is None."""
    from optim.averager import LocalAverager

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = torch.nn.Linear(2, 1)
            self.unused = torch.nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    data_parallel = DataParallel(model, optimizer, LocalAverager())
    for _ in range(3):
        model(torch.randn(4, 2)).pow(2).mean().backward()
        data_parallel.before_inner_step(samples=4)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert torch.equal(model.unused.detach(), torch.ones(3))
    assert model.used.weight.grad is None and model.used.weight.abs().sum() > 0


def test_clip_norm_clips_a_data_parallel_peer_s_gradient_alike_in_the_simulator_and_on_real_peers() -> None:
    """``--clip-norm`` for dp: the simulator's dp ignored it, and real peers' dp clipped each
    step's change of the parameters (their DiLoCo(H=1) wrapper's Δ). Both now scale this peer's
    gradient to at most the norm before it is averaged."""
    from optim.api import METHODS
    from optim.averager import LocalAverager

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    built = METHODS["dp"].build(
        model, optimizer, LocalAverager(), DiLoCoConfig(**_dp_state(), clip_norm=0.01)
    )
    assert isinstance(built, DataParallel) and built.clip_norm == 0.01
    before = [p.detach().clone() for p in model.parameters()]
    (model(torch.ones(4, 3)) * 100).sum().backward()
    built.before_inner_step(samples=4)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert float(grads.norm()) == pytest.approx(0.01, rel=1e-5)
    optimizer.step()
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    assert float(moved.norm()) == pytest.approx(0.01, rel=1e-5)  # SGD lr 1: the clipped gradient
    with pytest.raises(ValueError, match="clip_norm must be"):
        DataParallel(model, optimizer, LocalAverager(), clip_norm=float("nan"))


def _dp_state() -> dict:
    from dataclasses import asdict

    from optim.data_parallel import data_parallel_state

    state = data_parallel_state()
    return {
        k: v
        for k, v in asdict(state).items()
        if k in ("inner_steps", "outer_lr", "outer_momentum", "nesterov")
    }


def test_data_parallel_skips_a_step_a_faulty_member_made_nan_and_stops_on_its_own() -> None:
    """The lab's corrupt fault on one data-parallel peer stopped every peer of the demo, each
    blaming its learning rate ("the averaged gradient holds NaN/Inf"; a review, 2026-12-06):
    every member holds the same mean, so every one skips that step alike and goes on. A peer
    whose own gradient is NaN still stops (it diverged)."""
    from optim.averager import RoundReport

    class Faulty:  # the group's mean, with another member's NaN in it
        def all_reduce(self, tensors, *, weight, info=None):  # type: ignore[no-untyped-def]
            for t in tensors:
                t.fill_(float("nan"))
            return RoundReport(group_size=2)

    model = init_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    dp = DataParallel(model, inner, Faulty())
    model(torch.randn(8, 4), torch.randn(8, 1))[1].backward()
    before = [p.detach().clone() for p in model.parameters()]
    report = dp.before_inner_step(samples=8)
    inner.step()
    assert "skipped this step" in report.error and dp.outer_step_count == 1
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # nothing moved
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))  # its own gradient diverged
    with pytest.raises(FloatingPointError, match="lower the learning rate"):
        dp.before_inner_step(samples=8)


def test_data_parallel_refuses_a_step_with_a_members_outsized_gradient() -> None:
    """The lab's oversize fault (a member's gradient 1000x) was averaged into every data-parallel
    peer's step: the menu says the group refuses it, as DiLoCo's rounds are (a review,
    2026-12-06). The same robust check, on each step's declared gradient norms."""
    from optim.averager import RoundReport

    class Group:  # this peer and a member declaring (and sending) 1000x its norm
        def __init__(self, factor: float) -> None:
            self.factor = factor

        def all_reduce(self, tensors, *, weight, info=None):  # type: ignore[no-untyped-def]
            mine = dict(info or {}, peer="QmMe", weight=weight)
            theirs = dict(peer="QmBig", norm=mine["norm"] * self.factor, weight=weight)
            for t in tensors:
                t.mul_((1 + self.factor) / 2)
            return RoundReport(group_size=2, group_info=[mine, theirs])

    for factor, skipped in ((1000.0, True), (1.5, False)):
        model = init_model()
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        dp = DataParallel(model, inner, Group(factor), outlier_ratio=10.0)
        model(torch.randn(8, 4), torch.randn(8, 1))[1].backward()
        before = [p.detach().clone() for p in model.parameters()]
        report = dp.before_inner_step(samples=8)
        inner.step()
        moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert moved is not skipped and ("QmBig" in (report.error or "")) is skipped, report.error


def test_simulated_data_parallel_peers_refuse_an_outsized_member_and_count_what_they_sent() -> None:
    """The simulator's groups reported no weights (a real group reports each member's counted
    weight, swarm.gathered.reported, and dp's own info has none), so its dp checked nobody: a
    member sending 10^4x gradients took the eval loss from 5.8 to 1e16 where real dp peers
    refuse every such step. And a skipped step counted no bytes, though it sent its gradient
    (a review, stop 72)."""
    from optim.sim import SimConfig, simulate

    errors: list[str | None] = []

    def make_peer(rank: int, swarm: InProcessSwarm) -> VirtualPeer:
        model = init_model()
        inner = torch.optim.SGD(model.parameters(), lr=0.01)
        dp = DataParallel(model, inner, swarm.averager(rank), outlier_ratio=10.0)
        if rank == 2:  # the lab's oversize fault: its gradients 10^4 times the others'
            step = dp.before_inner_step

            def oversized(**kwargs):  # type: ignore[no-untyped-def]
                for p in model.parameters():
                    p.grad.mul_(1e4)
                return step(**kwargs)

            dp.before_inner_step = oversized
        checked = dp.before_inner_step

        def recorded(**kwargs):  # type: ignore[no-untyped-def]
            report = checked(**kwargs)
            errors.append(report.error)
            return report

        dp.before_inner_step = recorded
        return VirtualPeer(model=model, inner_optimizer=inner, outer=dp, batches=stream(rank), inner_steps=1)

    result = simulate(make_peer, mse, SimConfig(peers=3, steps=4))
    assert len(errors) == 12 and all("sim-2" in (e or "") for e in errors), errors
    assert result.final_eval_loss == pytest.approx(result.initial_eval_loss)
    assert result.bytes_per_peer == 4 * 5 * 4  # 4 steps of the model's 5 fp32 values, each sent


def test_the_simulator_s_history_counts_the_steps_run_under_time_boxes() -> None:
    """``SimResult.history``'s step was the schedule's (round x H: 5, 10, 15, 20) where time boxes
    ran 2 steps a round (a review, stop 72): the most steps any peer ran, as the notebook's."""
    from optim.sim import SimConfig, simulate

    result = simulate(
        factory("diloco", H=5), mse, SimConfig(peers=2, steps=20, round_seconds=2, eval_every=1)
    )
    assert result.steps_per_peer == [8, 8]
    assert [row["step"] for row in result.history] == [2, 4, 6, 8]


def test_data_parallel_takes_a_trimmed_mean_of_honest_gradients() -> None:
    """Under ``--aggregate trimmed-mean`` the mean is bounded by the members' norms, not their
    weighted mean (DiLoCo's check knows; dp's did not): three honest gradients (1,0), (0,1) and
    (1,1), whose median (1,1) is longer than their mean, made every member skip the step as
    "a member sent more than it declared" (a review, stop 72)."""
    from optim.averager import RoundReport

    members = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0])]

    class Trimmed:
        def all_reduce(self, tensors, *, weight, info=None):  # type: ignore[no-untyped-def]
            tensors[0].copy_(torch.stack(members).median(dim=0).values)
            infos = [dict(peer=f"Qm{i}", norm=float(g.norm()), weight=weight) for i, g in enumerate(members)]
            return RoundReport(group_size=3, group_info=infos, robust_mean=True)

    model = torch.nn.Linear(2, 1, bias=False)
    model.weight.grad = members[0].clone().view(1, 2)
    dp = DataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1), Trimmed(), outlier_ratio=10.0)
    report = dp.before_inner_step(samples=8)
    assert report.error is None and model.weight.grad.tolist() == [[1.0, 1.0]], report.error
