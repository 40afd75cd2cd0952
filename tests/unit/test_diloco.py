"""Unit tests for optim.diloco.DiLoCo over fake averagers: no hivemind, no peers, no clock.

Expected global params are computed by hand with the formulas of the paper's outer step
(Nesterov SGD on the mean pseudo-gradient Δ = θ − θ_local):

    buf = Δ                      (first round)
    buf = m * buf + Δ            (later rounds)
    update = Δ + m * buf         (Nesterov; plain momentum would use buf)
    θ ← θ − lr * update
"""

from __future__ import annotations

import copy
import dataclasses
import math
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

from optim.averager import LocalAverager, RoundReport
from optim.contribution import own_share
from optim.diloco import DiLoCo, DiLoCoConfig, OuterState

ATOL = 1e-6


# --- helpers ------------------------------------------------------------------------------------


def make_model(seed: int = 0, in_features: int = 3, out_features: int = 2) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features)


def batches(seed: int, count: int, batch: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of (x (B, 3), y (B, 2)) from their own generator."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, generator=g), torch.randn(batch, 2, generator=g)) for _ in range(count)]


def inner_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone().float() for p in model.parameters()]


def assert_all_close(
    actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], atol: float = ATOL
) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.detach().float(), e.detach().float(), atol=atol, rtol=0)


def train_round(
    outer: DiLoCo,
    opt: torch.optim.Optimizer,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    samples: int = 4,
) -> tuple[list[torch.Tensor], RoundReport]:
    """H inner steps through ``outer.step``; returns (local params before the sync, report)."""
    H = outer.config.inner_steps
    assert len(data) == H, f"{len(data)=} {H=}"
    for i, (x, y) in enumerate(data):
        inner_step(outer.model, opt, x, y)
        if i < H - 1:
            assert outer.step(samples=samples) is None, f"step {i + 1} of {H} must not sync"
    local = params_of(outer.model)  # θ_local after the H-th inner step, before the sync
    report = outer.step(samples=samples)
    assert isinstance(report, RoundReport)
    return local, report


def sgd_outer(model: nn.Module, config: DiLoCoConfig | None = None) -> DiLoCo:
    """DiLoCo over LocalAverager with a stateless inner SGD."""
    return DiLoCo(
        model, torch.optim.SGD(model.parameters(), lr=0.1), LocalAverager(), config or DiLoCoConfig()
    )


class FailingAverager:
    def __init__(self, error: Exception) -> None:
        self.error = error
        self.calls = 0

    def all_reduce(
        self, tensors: Sequence[torch.Tensor], *, weight: float, info: dict[str, Any] | None = None
    ) -> RoundReport:
        self.calls += 1
        raise self.error


class NaNAverager:
    """Pretends another peer diverged: the 'mean' holds a NaN."""

    def all_reduce(
        self, tensors: Sequence[torch.Tensor], *, weight: float, info: dict[str, Any] | None = None
    ) -> RoundReport:
        tensors[0].view(-1)[0] = float("nan")
        return RoundReport(group_size=2, group_info=[dict(info or {}), {"peer": "other"}])


class FakeGroup:
    """An in-process all-reduce for ``size`` peers, each calling from its own thread.

    Every peer deposits its tensors and weight, waits for the others, then gets the weighted
    mean written into its tensors in place, as hivemind's DecentralizedAverager would do."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=10)
        self.lock = threading.Lock()
        self.deposits: dict[int, tuple[list[torch.Tensor], float, dict[str, Any]]] = {}

    def member(self, index: int) -> _GroupMember:
        return _GroupMember(self, index)


class _GroupMember:
    def __init__(self, group: FakeGroup, index: int) -> None:
        self.group, self.index = group, index

    def all_reduce(
        self, tensors: Sequence[torch.Tensor], *, weight: float, info: dict[str, Any] | None = None
    ) -> RoundReport:
        with self.group.lock:
            self.group.deposits[self.index] = ([t.clone() for t in tensors], weight, dict(info or {}))
        self.group.barrier.wait()  # everyone has deposited
        deposits = [self.group.deposits[i] for i in range(self.group.size)]
        total = sum(w for _, w, _ in deposits)
        for j, tensor in enumerate(tensors):
            tensor.copy_(sum(w * ts[j] for ts, w, _ in deposits) / total)
        self.group.barrier.wait()  # nobody leaves (and may start a new round) before all have read
        return RoundReport(group_size=self.group.size, group_info=[i for _, _, i in deposits])


# --- LocalAverager: DiLoCo with k = 1 --------------------------------------------------------------


@pytest.mark.parametrize("H", [1, 3, 5])
def test_step_returns_none_until_the_h_th_step(H: int) -> None:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    outer = DiLoCo(model, opt, LocalAverager(), DiLoCoConfig(inner_steps=H))
    for round_index in range(2):
        _, report = train_round(outer, opt, batches(round_index, H))
        assert report.group_size == 1 and report.averaged_alone
        assert report.error is None
        assert outer.outer_step_count == round_index + 1
        assert outer.inner_step_count == 0 and outer.samples_this_round == 0


def test_fedavg_with_one_peer_adopts_the_local_params() -> None:
    """outer lr 1, no momentum: θ ← θ − (θ − θ_local) = θ_local."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    config = DiLoCoConfig(inner_steps=4, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    outer = DiLoCo(model, opt, LocalAverager(), config)
    theta0 = [g.clone() for g in outer.global_params]
    local, _ = train_round(outer, opt, batches(1, 4))
    assert any(not torch.allclose(a, b) for a, b in zip(local, theta0)), "training must move the params"
    assert_all_close(outer.global_params, local)
    assert_all_close(params_of(model), local)


def test_outer_nesterov_update_matches_hand_computation_over_two_rounds() -> None:
    lr, m = 0.7, 0.9
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    outer = DiLoCo(model, opt, LocalAverager(), DiLoCoConfig(inner_steps=3, outer_lr=lr, outer_momentum=m))

    theta = [g.clone() for g in outer.global_params]
    buf: list[torch.Tensor] | None = None
    for round_index in range(2):
        local, report = train_round(outer, opt, batches(10 + round_index, 3))
        assert report.error is None
        delta = [t - loc for t, loc in zip(theta, local)]
        buf = list(delta) if buf is None else [m * b + d for b, d in zip(buf, delta)]
        update = [d + m * b for d, b in zip(delta, buf)]
        theta = [t - lr * u for t, u in zip(theta, update)]

        assert outer.outer_step_count == round_index + 1
        assert_all_close(outer.global_params, theta)
        assert_all_close(outer.momentum_buffers(), buf)
        assert_all_close(params_of(model), theta)  # the next round starts from θ


def test_global_params_are_fp32_cpu_copies_apart_from_the_model() -> None:
    model = make_model()
    outer = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), LocalAverager(), DiLoCoConfig())
    for g, p in zip(outer.global_params, model.parameters()):
        assert g.dtype == torch.float32 and g.device.type == "cpu"
        assert g.data_ptr() != p.data_ptr()
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert not torch.equal(outer.global_params[0], next(model.parameters()))


def test_with_global_runs_on_theta_and_puts_the_trained_params_back_bit_for_bit() -> None:
    """An evaluation sees θ_global (cast to the model's dtype); the params this peer trains
    from (here θ plus an eager offset's stand-in) are back afterwards, even after an error."""
    model = make_model().to(torch.bfloat16)
    outer = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), LocalAverager(), DiLoCoConfig())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    trained = [p.detach().clone() for p in model.parameters()]
    seen = outer.with_global(lambda: [p.detach().clone() for p in model.parameters()])
    for s, g in zip(seen, outer.global_params):
        assert torch.equal(s, g.to(torch.bfloat16))
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), trained))

    def fails() -> None:
        raise RuntimeError("out of memory in the evaluation")

    with pytest.raises(RuntimeError, match="out of memory"):
        outer.with_global(fails)
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), trained))


def test_with_global_swaps_nothing_while_the_model_still_holds_theta() -> None:
    """Right after a round (or at the start) the model holds θ as the round left it: the
    evaluation runs on it as it is, with no copy in or out (torch's write counters show none).
    An inner step, a change of θ or an eager offset brings the swap back."""
    model = make_model().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = DiLoCo(model, opt, LocalAverager(), DiLoCoConfig(inner_steps=2))

    def writes() -> list[int]:
        return [p._version for p in model.parameters()]

    def seen() -> list[torch.Tensor]:
        return [p.detach().clone() for p in model.parameters()]

    for _ in range(2):  # at the start, then after a round
        before = writes()
        assert all(
            torch.equal(s, g.to(torch.bfloat16)) for s, g in zip(outer.with_global(seen), outer.global_params)
        )
        assert writes() == before
        train_round(outer, opt, [(x.to(torch.bfloat16), y.to(torch.bfloat16)) for x, y in batches(3, 2)])
    x, y = (t.to(torch.bfloat16) for t in batches(4, 1)[0])
    inner_step(model, opt, x, y)  # mid-round: the model is θ_local
    trained = seen()
    assert all(
        torch.equal(s, g.to(torch.bfloat16)) for s, g in zip(outer.with_global(seen), outer.global_params)
    )
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), trained))
    outer.restore_parameters()
    outer.apply_outer_step([torch.ones_like(g) for g in outer.global_params])  # θ moves, the model not
    assert all(
        torch.equal(s, g.to(torch.bfloat16)) for s, g in zip(outer.with_global(seen), outer.global_params)
    )

    eager = DiLoCo(make_model(), torch.optim.SGD(make_model().parameters(), lr=0.1), LocalAverager(),
                   DiLoCoConfig(delay=1, eager=True))  # fmt: skip
    assert eager._writes() is None


def test_with_global_swaps_after_a_fused_step_that_torch_does_not_count_as_a_write() -> None:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    outer = DiLoCo(model, opt, LocalAverager(), DiLoCoConfig(inner_steps=4))
    x, y = batches(5, 1)[0]
    inner_step(model, opt, x, y)
    outer.step(samples=4)
    assert any(not torch.equal(p, g) for p, g in zip(model.parameters(), outer.global_params))
    seen = outer.with_global(lambda: [p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(s, g) for s, g in zip(seen, outer.global_params))


def test_an_outer_step_cut_short_marks_theta_as_not_intact() -> None:
    """Ctrl+C inside the outer SGD's loop leaves θ half updated: the flag says so (a stopped peer
    then writes no global_params.pt); a completed step sets it back."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = DiLoCo(model, opt, LocalAverager(), DiLoCoConfig(inner_steps=1))
    assert outer.global_intact
    step = outer.outer_optimizer.step

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    outer.outer_optimizer.step = interrupted
    with pytest.raises(KeyboardInterrupt):
        outer.apply_outer_step([torch.ones_like(g) for g in outer.global_params])
    assert not outer.global_intact
    outer.outer_optimizer.step = step
    outer.apply_outer_step([torch.ones_like(g) for g in outer.global_params])
    assert outer.global_intact


@pytest.mark.parametrize(
    ("codec", "clip"),
    [("none", 0.0), ("none", 1e-3), ("fp16", 0.0), ("int8", 0.0)],
    ids=["none", "clipped", "fp16", "int8"],
)
def test_the_declared_norm_is_that_of_the_update_sent(codec: str, clip: float) -> None:
    """The norm every member's robust check reads is |what goes on the wire|: taken once for an
    update sent as computed, again after a lossy codec or a clip."""
    model = make_model()
    outer = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), LocalAverager(),
                   DiLoCoConfig(codec=codec, clip_norm=clip))  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    outgoing = outer._outgoing(None)
    sent = float(torch.linalg.vector_norm(torch.cat([d.reshape(-1) for d in outgoing.deltas])))
    assert outgoing.info["norm"] == pytest.approx(sent, rel=1e-6)
    if clip:
        assert outgoing.info["norm"] == pytest.approx(clip, rel=1e-5) and clip < outgoing.local_norm


def test_a_model_without_trainable_params_is_rejected() -> None:
    model = make_model()
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        DiLoCo(
            model,
            torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1),
            LocalAverager(),
            DiLoCoConfig(),
        )


# --- two peers through an in-process all-reduce --------------------------------------------------


@pytest.mark.parametrize("samples", [(4, 4), (3, 1), (1, 7)])
def test_two_peers_end_with_the_weighted_mean_update(samples: tuple[int, int]) -> None:
    H, lr, m = 3, 0.7, 0.9
    base = make_model(seed=5)
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    opts = [torch.optim.AdamW(model.parameters(), lr=0.05) for model in models]
    group = FakeGroup(2)
    config = DiLoCoConfig(inner_steps=H, outer_lr=lr, outer_momentum=m)
    peers = [DiLoCo(models[i], opts[i], group.member(i), config) for i in range(2)]
    theta0 = [g.clone() for g in peers[0].global_params]
    data = [batches(100, H), batches(200, H)]  # different data per peer

    # H−1 inner steps each, then the H-th inner step; the H-th outer.step runs the round.
    locals_: list[list[torch.Tensor]] = []
    for i in range(2):
        for x, y in data[i][: H - 1]:
            inner_step(models[i], opts[i], x, y)
            assert peers[i].step(samples=samples[i]) is None
        inner_step(models[i], opts[i], *data[i][H - 1])
        locals_.append(params_of(models[i]))
    reports: list[RoundReport | None] = [None, None]
    errors: list[BaseException] = []

    def sync(i: int) -> None:
        try:
            reports[i] = peers[i].step(samples=samples[i], info={"peer": f"p{i}"})
        except BaseException as error:  # surfaced below; a thread must not swallow it
            errors.append(error)

    threads = [threading.Thread(target=sync, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not errors, errors
    assert all(r is not None and r.group_size == 2 and r.error is None for r in reports), reports
    assert sorted(d["peer"] for d in reports[0].group_info) == ["p0", "p1"]

    # The weights DiLoCo passed are the samples of the round.
    assert [group.deposits[i][1] for i in range(2)] == [float(H * s) for s in samples]

    w = [H * s for s in samples]
    deltas = [[t - loc for t, loc in zip(theta0, local)] for local in locals_]
    mean = [(w[0] * a + w[1] * b) / (w[0] + w[1]) for a, b in zip(*deltas)]
    expected = [t - lr * (1 + m) * d for t, d in zip(theta0, mean)]  # first round: buf = Δ
    for i in range(2):
        assert_all_close(peers[i].global_params, expected)
        assert_all_close(params_of(models[i]), expected)
    assert peers[0].fingerprint() == peers[1].fingerprint()

    if samples[0] != samples[1]:  # the weights matter: the plain mean gives another θ
        plain = [(a + b) / 2 for a, b in zip(*deltas)]
        unweighted = [t - lr * (1 + m) * d for t, d in zip(theta0, plain)]
        assert any(not torch.allclose(g, u, atol=1e-4) for g, u in zip(peers[0].global_params, unweighted))


# --- failures are the normal path -----------------------------------------------------------------


@pytest.mark.parametrize(
    "error", [RuntimeError("peer vanished"), TimeoutError("no group"), OSError("socket")]
)
def test_a_failing_averager_falls_back_to_this_peers_own_update(error: Exception) -> None:
    lr, m = 0.7, 0.9
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    averager = FailingAverager(error)
    outer = DiLoCo(model, opt, averager, DiLoCoConfig(inner_steps=2, outer_lr=lr, outer_momentum=m))
    theta0 = [g.clone() for g in outer.global_params]

    local, report = train_round(outer, opt, batches(3, 2))
    assert averager.calls == 1
    assert report.group_size == 1 and report.averaged_alone
    assert report.error is not None and str(error) in report.error
    assert report.seconds >= 0
    expected = [t - lr * (1 + m) * (t - loc) for t, loc in zip(theta0, local)]
    assert_all_close(outer.global_params, expected)
    assert_all_close(params_of(model), expected)
    assert outer.outer_step_count == 1

    # Training continues: the next round runs (and falls back) the same way.
    _, report = train_round(outer, opt, batches(4, 2))
    assert report.group_size == 1 and outer.outer_step_count == 2
    assert all(torch.isfinite(g).all() for g in outer.global_params)


class PartialWriteThenFailAverager:
    """Overwrites part of the tensors with another peer's data, then fails mid-round."""

    def all_reduce(
        self, tensors: Sequence[torch.Tensor], *, weight: float, info: dict[str, Any] | None = None
    ) -> RoundReport:
        tensors[0].fill_(123.0)
        raise ConnectionError("peer dropped during all-reduce")


def test_a_failing_averager_that_wrote_into_the_tensors_still_gives_our_own_update() -> None:
    lr, m = 0.7, 0.9
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    outer = DiLoCo(
        model, opt, PartialWriteThenFailAverager(), DiLoCoConfig(inner_steps=2, outer_lr=lr, outer_momentum=m)
    )
    theta0 = [g.clone() for g in outer.global_params]
    local, report = train_round(outer, opt, batches(3, 2))
    assert report.error is not None
    expected = [t - lr * (1 + m) * (t - loc) for t, loc in zip(theta0, local)]
    assert_all_close(outer.global_params, expected)


class CleanFailAverager(FailingAverager):
    """Fails before writing anything, and says so: DiLoCo keeps no backup of Δ for it."""

    keeps_tensors_on_failure = True


def test_a_failing_averager_that_keeps_the_tensors_gives_our_own_update_without_a_backup(monkeypatch) -> None:
    lr, m = 0.7, 0.9
    clones: list[torch.Size] = []
    clone = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda t, *a, **k: clones.append(t.shape) or clone(t, *a, **k))
    counted = {}
    for averager in (
        FailingAverager(ConnectionError("no group")),
        CleanFailAverager(ConnectionError("no group")),
    ):
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        outer = DiLoCo(model, opt, averager, DiLoCoConfig(inner_steps=2, outer_lr=lr, outer_momentum=m))
        theta0 = [g.clone() for g in outer.global_params]
        clones.clear()
        local, report = train_round(outer, opt, batches(3, 2))
        counted[type(averager).__name__] = len(clones)
        assert report.error is not None and averager.calls == 1
        expected = [t - lr * (1 + m) * (t - loc) for t, loc in zip(theta0, local)]
        assert_all_close(outer.global_params, expected)
    assert counted["CleanFailAverager"] == counted["FailingAverager"] - len(theta0)  # no copy of Δ


def test_a_nan_from_the_averager_leaves_the_global_params_unchanged() -> None:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    outer = DiLoCo(model, opt, NaNAverager(), DiLoCoConfig(inner_steps=2))
    theta0 = [g.clone() for g in outer.global_params]
    momentum0 = [b.clone() for b in outer.momentum_buffers()]

    local, report = train_round(outer, opt, batches(7, 2))
    assert any(not torch.allclose(a, b) for a, b in zip(local, theta0))
    assert report.error is not None and "NaN" in report.error
    assert "\n" not in report.error
    assert all(torch.isfinite(g).all() for g in outer.global_params)
    assert_all_close(outer.global_params, theta0, atol=0)
    assert_all_close(outer.momentum_buffers(), momentum0, atol=0)
    # The round counts, as with --delay 1, --overlap and streaming (a review, stop 60: uncounted,
    # --rounds N ran N + the refused rounds and the next went out at the same outer step)
    assert outer.outer_step_count == 1
    assert_all_close(params_of(model), theta0, atol=0)  # the model restarts from the unchanged θ
    assert outer.inner_step_count == 0 and outer.samples_this_round == 0


def test_a_nan_in_this_peers_own_params_does_not_poison_theta() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = DiLoCo(model, opt, LocalAverager(), DiLoCoConfig(inner_steps=1))
    theta0 = [g.clone() for g in outer.global_params]
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    report = outer.step(samples=1)
    assert report is not None and report.error is not None and "NaN" in report.error
    assert_all_close(outer.global_params, theta0, atol=0)
    assert_all_close(params_of(model), theta0, atol=0)


def test_huge_but_finite_params_are_not_taken_for_a_divergence() -> None:
    """The norm of Δ overflows to Inf (|Δ| ~ 1e30): the finite check then looks at every
    element, and the update is sent (the robust check, not the NaN guard, judges its size)."""
    model = make_model()
    outer = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), LocalAverager(), DiLoCoConfig())
    with torch.no_grad():
        model.weight.fill_(1e30)
    outgoing = outer._outgoing(None)
    assert math.isinf(outgoing.local_norm) and not outgoing.diverged and outgoing.weight > 0
    with torch.no_grad():
        model.weight[0, 1] = float("nan")
    assert outer._outgoing(None).diverged


# --- state for late joiners and checkpoints -------------------------------------------------------


def test_outer_state_round_trips_into_a_fresh_diloco() -> None:
    H = 2
    config = DiLoCoConfig(inner_steps=H, outer_lr=0.7, outer_momentum=0.9)
    model_a = make_model(seed=0)
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.1)  # stateless inner optimizer: see below
    a = DiLoCo(model_a, opt_a, LocalAverager(), config)
    for r in range(2):
        train_round(a, opt_a, batches(20 + r, H))
    state = a.outer_state()
    assert isinstance(state, OuterState) and state.outer_step == 2
    assert_all_close(state.params, a.global_params, atol=0)
    assert_all_close(state.momentum, a.momentum_buffers(), atol=0)

    # The state is a copy: changing it does not touch the peer serving it.
    state_copy = OuterState(
        outer_step=state.outer_step,
        params=[t.clone() for t in state.params],
        momentum=[t.clone() for t in state.momentum],
    )
    state.params[0].add_(1.0)
    assert_all_close(a.global_params, state_copy.params, atol=0)

    model_b = make_model(seed=99)  # another init: everything must come from the state
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.1)
    b = DiLoCo(model_b, opt_b, LocalAverager(), config)
    b.note_inner_step(samples=3)  # a round in progress is restarted by the load
    b.load_outer_state(state_copy)
    assert b.outer_step_count == 2
    assert b.inner_step_count == 0 and b.samples_this_round == 0
    assert_all_close(b.global_params, state_copy.params, atol=0)
    assert_all_close(b.momentum_buffers(), state_copy.momentum, atol=0)
    assert_all_close(params_of(model_b), state_copy.params, atol=0)
    assert b.fingerprint() == a.fingerprint()

    # Both continue on the same data: the loaded momentum is really used by the next step.
    data = batches(30, H)
    train_round(a, opt_a, data)
    train_round(b, opt_b, data)
    assert a.outer_step_count == b.outer_step_count == 3
    assert_all_close(b.global_params, a.global_params)


def test_loading_a_state_from_step_zero_matches_a_fresh_start() -> None:
    """Zero momentum buffers loaded at step 0 must act like no momentum yet (buf = Δ)."""
    config = DiLoCoConfig(inner_steps=2)
    a = sgd_outer(make_model(), config)
    b = sgd_outer(make_model(seed=3), config)
    b.load_outer_state(a.outer_state())
    c = sgd_outer(make_model(), config)
    data = batches(40, 2)
    train_round(b, b.inner_optimizer, data)
    train_round(c, c.inner_optimizer, data)
    assert_all_close(b.global_params, c.global_params)


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda: nn.Linear(4, 2), id="other-shapes"),
        pytest.param(lambda: nn.Linear(3, 2, bias=False), id="fewer-tensors"),
        pytest.param(lambda: nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2)), id="more-tensors"),
    ],
)
def test_load_outer_state_rejects_a_state_of_another_model(other) -> None:
    source = sgd_outer(make_model())
    target = sgd_outer(other())
    before = [g.clone() for g in target.global_params]
    with pytest.raises(ValueError, match="same model") as info:
        target.load_outer_state(source.outer_state())
    assert "\n" not in str(info.value)
    assert_all_close(target.global_params, before, atol=0)  # nothing was half-loaded


def test_load_outer_state_rejects_momentum_of_the_wrong_shape() -> None:
    target = sgd_outer(make_model())
    state = target.outer_state()
    bad = OuterState(outer_step=1, params=state.params, momentum=[torch.zeros(5) for _ in state.momentum])
    with pytest.raises(ValueError, match="same model"):
        target.load_outer_state(bad)


def test_fingerprint_is_equal_for_equal_states_and_changes_after_a_step() -> None:
    model_a, model_b = make_model(seed=1), make_model(seed=1)
    opt_a = torch.optim.AdamW(model_a.parameters(), lr=0.05)
    a = DiLoCo(model_a, opt_a, LocalAverager(), DiLoCoConfig(inner_steps=2))
    b = DiLoCo(
        model_b,
        torch.optim.AdamW(model_b.parameters(), lr=0.05),
        LocalAverager(),
        DiLoCoConfig(inner_steps=2),
    )
    fa = a.fingerprint()
    assert fa == b.fingerprint()
    assert len(fa) == len(list(model_a.parameters()))
    assert all(isinstance(x, float) and math.isfinite(x) for x in fa)
    expected = [float(p.detach().double().norm()) for p in model_a.parameters()]
    assert fa == pytest.approx(expected, rel=1e-6)

    # Training alone does not change θ (only a sync does).
    for x, y in batches(50, 1):
        inner_step(model_a, opt_a, x, y)
    assert a.fingerprint() == fa
    train_round(a, opt_a, batches(51, 2))
    assert a.fingerprint() != fa
    assert b.fingerprint() == fa


# --- config validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        pytest.param(dict(inner_steps=0), ["inner_steps", "0", "try"], id="inner_steps=0"),
        pytest.param(dict(inner_steps=-5), ["inner_steps", "-5"], id="inner_steps<0"),
        pytest.param(dict(outer_lr=0.0), ["outer_lr", "0.0", "0.7"], id="outer_lr=0"),
        pytest.param(dict(outer_lr=-1.0), ["outer_lr", "-1.0", "0.7"], id="outer_lr<0"),
        pytest.param(dict(outer_lr=11.0), ["outer_lr", "11.0", "0.7"], id="outer_lr=11"),
        pytest.param(dict(outer_lr=float("nan")), ["outer_lr", "nan"], id="outer_lr=nan"),
        pytest.param(dict(outer_momentum=1.0), ["outer_momentum", "1.0", "0.9"], id="momentum=1"),
        pytest.param(dict(outer_momentum=-0.1), ["outer_momentum", "-0.1"], id="momentum<0"),
        pytest.param(
            dict(outer_momentum=0.0, nesterov=True), ["nesterov", "outer_momentum"], id="nesterov-no-momentum"
        ),
    ],
)
def test_diloco_config_rejects_bad_values_with_a_fix(kwargs: dict[str, Any], names: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        DiLoCoConfig(**kwargs)
    message = str(info.value)
    assert "\n" not in message
    for name in names:
        assert name in message, f"{name!r} not in {message!r}"


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(inner_steps=1, outer_lr=10.0),
        dict(outer_lr=1.0, outer_momentum=0.0, nesterov=False),
        dict(outer_momentum=0.99),
    ],
)
def test_diloco_config_accepts_sensible_values(kwargs: dict[str, Any]) -> None:
    DiLoCoConfig(**kwargs)


def test_diloco_config_defaults_follow_the_paper() -> None:
    config = DiLoCoConfig()
    assert (config.inner_steps, config.outer_lr, config.outer_momentum, config.nesterov) == (
        50,
        0.7,
        0.9,
        True,
    )


def test_delayed_updates_travel_with_the_state() -> None:
    """With delay=1 a joiner must receive the queued update, or it skips one the others apply."""
    from optim.averager import LocalAverager as _Local

    config = DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False, delay=1)
    model_a = make_model(seed=0)
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.1)
    a = DiLoCo(model_a, opt_a, _Local(), config)
    train_round(a, opt_a, batches(1, 1))
    state = a.outer_state()
    assert len(state.pending) == 1
    model_b = make_model(seed=5)
    b = DiLoCo(model_b, torch.optim.SGD(model_b.parameters(), lr=0.1), _Local(), config)
    b.load_outer_state(state)
    zero = [torch.zeros_like(g) for g in a.global_params]
    a.apply_delayed([z.clone() for z in zero])
    b.apply_delayed([z.clone() for z in zero])
    assert_all_close(a.global_params, b.global_params, atol=0)


class _SlowAverager:
    """A swarm of one whose all-reduce takes a while and says where it ran."""

    def __init__(self, seconds: float = 0.2) -> None:
        self.seconds = seconds
        self.threads: list[str] = []

    def all_reduce(self, tensors, *, weight, info=None) -> RoundReport:
        import time

        self.threads.append(threading.current_thread().name)
        time.sleep(self.seconds)
        return RoundReport(group_size=1, group_info=[dict(info or {})])


def overlapped(model: nn.Module, averager) -> tuple[DiLoCo, torch.optim.Optimizer]:
    config = DiLoCoConfig(
        inner_steps=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False, delay=1, overlap=True
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return DiLoCo(model, opt, averager, config), opt


def test_overlap_needs_the_one_step_delay() -> None:
    with pytest.raises(ValueError, match="overlap needs delay=1"):
        DiLoCoConfig(overlap=True)


def test_an_overlapped_round_averages_in_the_background_and_reports_a_round_later() -> None:
    averager = _SlowAverager()
    outer, opt = overlapped(make_model(), averager)
    _, first = train_round(outer, opt, batches(1, 1))
    assert first.pending and outer.outer_step_count == 1  # the clock moves on at once
    assert averager.threads == [] or averager.threads == ["outer-all-reduce"]
    _, second = train_round(outer, opt, batches(2, 1))
    assert not second.pending and second.info["outer_step"] == 0  # round 0's report
    assert averager.threads[0] == "outer-all-reduce"
    assert outer.finish().info["outer_step"] == 1
    assert outer.finish() is None  # nothing left in flight


def test_overlapped_finish_ends_on_the_theta_of_the_blocking_delay_plus_its_last_mean() -> None:
    model_a, model_b = make_model(), make_model()
    a, opt_a = overlapped(model_a, LocalAverager())
    config = dataclasses.replace(a.config, overlap=False)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.1)
    b = DiLoCo(model_b, opt_b, LocalAverager(), config)
    for r in range(3):
        train_round(a, opt_a, batches(r, 1))
        train_round(b, opt_b, batches(r, 1))
    a.finish()
    b.apply_outer_step(b._pending.pop(0))  # the blocking delay's last queued mean
    assert_all_close(a.global_params, b.global_params, atol=0)


class _RefusingAverager(LocalAverager):
    """A swarm of one whose round ``refuse`` (0-based) is refused by the group's robust check."""

    def __init__(self, refuse: int) -> None:
        self.refuse, self.calls = refuse, 0

    def all_reduce(self, tensors, *, weight, info=None) -> RoundReport:
        report = super().all_reduce(tensors, weight=weight, info=info)
        self.calls += 1
        if self.calls - 1 == self.refuse:
            report.group_size, report.refused = 2, "a member sent an outlier (test)"
        return report


@pytest.mark.parametrize("eager", [False, True], ids=["naive", "eager"])
def test_a_refused_round_moves_the_blocking_delay_on_as_the_overlapped_one(eager: bool) -> None:
    """Stop 57, a review: with --delay 1 and no background thread, a refused round kept the
    mean accepted a round before queued (applied a round late; with eager updates the next
    round started from a point holding none of it, 0.24 away from the overlapped run's)."""
    config = DiLoCoConfig(
        inner_steps=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False, delay=1, overlap=True, eager=eager
    )
    model_a, model_b = make_model(), make_model()
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model_a, model_b))
    a = DiLoCo(model_a, opt_a, _RefusingAverager(refuse=2), config)
    b = DiLoCo(model_b, opt_b, _RefusingAverager(refuse=2), dataclasses.replace(config, overlap=False))
    for r in range(5):
        train_round(a, opt_a, batches(r, 1))
        train_round(b, opt_b, batches(r, 1))
        if r != 2:  # (an overlapped round is judged a round later)
            assert_all_close(a.working_params(), b.working_params(), atol=1e-6)
    assert a.outer_step_count == b.outer_step_count == 5


def test_a_joiner_gets_the_mean_in_flight_with_the_state() -> None:
    """Served mid-flight, the state waits for the all-reduce and queues its mean: the joiner
    applies it at the end of its first round, as the donor does."""
    donor, opt_d = overlapped(make_model(seed=0), _SlowAverager(0.3))
    train_round(donor, opt_d, batches(1, 1))  # round 0 in flight now
    state = donor.outer_state()
    assert state.outer_step == 1 and len(state.pending) == 1
    joiner, opt_j = overlapped(make_model(seed=5), LocalAverager())
    joiner.load_outer_state(state)
    assert_all_close(joiner.global_params, donor.global_params, atol=0)
    # Both train a round that changes nothing; then both have applied round 0's mean.
    for outer in (donor, joiner):
        outer.inner_step_count = 1
        outer.sync()
    assert_all_close(joiner.global_params, donor.global_params, atol=0)
    assert joiner.outer_step_count == donor.outer_step_count == 2


# --- eager updates (Kale et al. 2025) -----------------------------------------------------------


def _lone(config: DiLoCoConfig, seed: int = 0) -> tuple[DiLoCo, torch.optim.Optimizer]:
    model = make_model(seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return DiLoCo(model, opt, LocalAverager(), config), opt


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking-delay", "overlap"])
def test_a_lone_eager_peer_trains_exactly_like_blocking_diloco(overlap: bool) -> None:
    """Alone, this peer's share of every mean is 1, so its fresh Δ stands in for the whole late
    mean: ĝ_t = mean_{t-1} + Δ_t - Δ_{t-1} = Δ_t, and θ + offset follows blocking DiLoCo step
    for step (outer momentum and Nesterov included: the outer SGD is linear in its gradients)."""
    base = DiLoCoConfig(inner_steps=2, outer_lr=0.7, outer_momentum=0.9)
    blocking, opt_b = _lone(base)
    eager, opt_e = _lone(dataclasses.replace(base, delay=1, overlap=overlap))
    assert eager.config.eager_updates
    for r in range(5):
        train_round(blocking, opt_b, batches(r, 2))
        train_round(eager, opt_e, batches(r, 2))
        # Where the next round starts: the model's params.
        assert_all_close(params_of(eager.model), params_of(blocking.model), atol=1e-6)
    # θ itself moves only with real means: one round behind until the run ends.
    assert max(float((a - b).abs().max()) for a, b in zip(eager.global_params, blocking.global_params)) > 1e-4
    eager.finish()
    assert_all_close(eager.global_params, blocking.global_params, atol=1e-6)
    assert_all_close(params_of(eager.model), eager.global_params, atol=0)  # no offset left


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking-delay", "overlap"])
def test_before_a_first_mean_lands_an_eager_peer_stands_in_for_its_expected_share(overlap: bool) -> None:
    """Kale et al.'s eager step uses Δ/M for this peer's part of the mean in flight. Before any
    mean had landed the share was 1, so the first round moved the start point M times as far.
    The averager's expected group size gives the first share; the next rounds use the share the
    last mean showed, as before."""

    class ExpectsThree(LocalAverager):
        def expected_group(self) -> int:
            return 3

    config = DiLoCoConfig(inner_steps=2, outer_lr=0.7, outer_momentum=0.9, delay=1, overlap=overlap)
    alone, opt_a = _lone(config)
    three, opt_t = _lone(config)
    three.averager = ExpectsThree()
    train_round(alone, opt_a, batches(0, 2))
    train_round(three, opt_t, batches(0, 2))
    # The outer SGD's first step is linear in its gradient: a third of the stand-in, a third of the offset.
    assert max(float(o.abs().max()) for o in alone.offset) > 1e-3
    assert_all_close(three.offset, [o / 3 for o in alone.offset], atol=1e-7)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking-delay", "overlap"])
def test_a_failed_averaging_does_not_make_the_next_stand_in_the_whole_delta(overlap: bool) -> None:
    """A round whose all-reduce failed lands this peer's own update (a group of 1): that says
    nothing of the group the next round finds, so the share learnt from the last real mean
    (1/3 here) stands; it became 1, and the next stand-in M times too large."""

    class ThreeThenFails(LocalAverager):
        calls = 0

        def all_reduce(self, tensors, *, weight, info=None):  # type: ignore[no-untyped-def]
            ThreeThenFails.calls += 1
            if ThreeThenFails.calls == 2:
                raise RuntimeError("the group fell apart")
            return RoundReport(group_size=3, group_info=[dict(info or {}, weight=weight)] * 3)

    config = DiLoCoConfig(inner_steps=2, outer_lr=0.7, outer_momentum=0.9, delay=1, overlap=overlap)
    eager, opt = _lone(config)
    eager.averager = ThreeThenFails()
    for r in range(3 if overlap else 2):  # the failed round has just landed (overlapped: a round late)
        train_round(eager, opt, batches(r, 2))
    assert ThreeThenFails.calls >= 2
    assert eager._stand_in_share() == pytest.approx(1 / 3)
    eager.finish()
    # Alone by the barrier's verdict (nobody else in the round, not a failure): its share is 1.
    eager._learn_share(RoundReport(group_size=1, error="no other peer in this round"), 4.0)
    assert eager._stand_in_share() == 1.0


def test_a_failed_first_averaging_leaves_the_expected_share_standing() -> None:
    """The same before any mean has landed: a failed first round taught a share of 1 (its own
    update, a group of 1), and the next offset went M times Kale et al.'s Δ/M (a review,
    stop 60). The expected group's share stands until a real mean lands."""

    class ExpectsTwo(LocalAverager):
        def expected_group(self) -> int:
            return 2

    outer, _ = _lone(DiLoCoConfig(inner_steps=2, delay=1))
    outer.averager = ExpectsTwo()
    outer._learn_share(RoundReport(group_size=1, error="the group fell apart", failed=True), 4.0)
    assert outer._stand_in_share() == pytest.approx(1 / 2)


@pytest.mark.parametrize(
    ("delay", "overlap", "eager"),
    [(1, False, False), (1, True, False), (1, True, True)],
    ids=["blocking-delay", "overlap", "overlap-eager"],
)
def test_the_settled_global_is_what_finish_leaves_and_changes_nothing(
    delay: int, overlap: bool, eager: bool
) -> None:
    """A peer stopped mid-run (Ctrl+C: how a run without --rounds ends) wrote θ alone as the
    swarm's model, without the mean its last round had averaged (queued with --delay, or in
    flight with --overlap): max |Δθ| 0.064 after 3 rounds against what finish() leaves."""
    config = DiLoCoConfig(
        inner_steps=2, outer_lr=0.7, outer_momentum=0.9, delay=delay, overlap=overlap, eager=eager
    )
    outer, opt = _lone(config)
    outer.outer_optimizer.param_groups[0]["lr"] = 0.5  # a steered outer lr counts too
    for r in range(3):
        train_round(outer, opt, batches(r, 2))
    if overlap:
        outer._inflight.future.result(timeout=10)  # landed: its mean is part of the settled θ
    before = outer.read_global(lambda params: [p.clone() for p in params])
    settled = outer.settled_global()
    assert_all_close(outer.read_global(lambda params: [p.clone() for p in params]), before, atol=0)
    assert max(float((s - b).abs().max()) for s, b in zip(settled, before)) > 1e-3
    outer.finish()
    assert_all_close(settled, outer.read_global(lambda params: [p.clone() for p in params]), atol=1e-6)


def test_a_missed_round_does_not_take_another_members_weight_for_this_peers() -> None:
    """In a round this peer missed (the simulator's dropout) the group's info holds only the
    others; one of them with this peer's weight was taken for its own entry and removed: 1/2
    instead of 1/3 among two others of equal weight."""
    others = [{"weight": 2.0}, {"weight": 2.0}]
    assert own_share(RoundReport(group_size=2, group_info=others, missed=True), 2.0) == pytest.approx(1 / 3)
    present = [*others, {"weight": 2.0}]
    assert own_share(RoundReport(group_size=3, group_info=present), 2.0) == pytest.approx(1 / 3)
    # Of three peers, this one missed and one more dropped: the other's group of one. 1/2, not 1.
    alone = RoundReport(group_size=1, group_info=others[:1], missed=True)
    assert own_share(alone, 2.0) == pytest.approx(1 / 2)


def test_a_round_this_peer_diverged_in_teaches_no_share() -> None:
    """A diverged peer sends zeros at weight 0: its share of that mean is 0, which the next eager
    stand-in took (a round of the naive delay). The share learnt before stands."""
    outer, _ = _lone(DiLoCoConfig(inner_steps=2, delay=1, overlap=True))
    three = RoundReport(group_size=3, group_info=[{"weight": 4.0}] * 3)
    outer._learn_share(three, 4.0)
    assert outer._stand_in_share() == pytest.approx(1 / 3)
    outer._learn_share(RoundReport(group_size=3, group_info=[{"weight": 4.0}] * 2 + [{"weight": 0.0}]), 0.0)
    assert outer._stand_in_share() == pytest.approx(1 / 3)


def test_the_naive_delay_lags_a_round_and_finish_applies_its_last_mean() -> None:
    base = DiLoCoConfig(inner_steps=2, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    blocking, opt_b = _lone(base)
    naive, opt_n = _lone(dataclasses.replace(base, delay=1, eager=False))
    assert not naive.config.eager_updates and not naive.offset
    train_round(naive, opt_n, batches(0, 2))
    assert_all_close(params_of(naive.model), params_of(make_model(seed=0)), atol=0)  # nothing applied yet
    train_round(blocking, opt_b, batches(0, 2))
    naive.finish()  # the pending mean of round 0
    assert_all_close(naive.global_params, blocking.global_params, atol=1e-6)
    assert not naive._pending


def test_eager_needs_the_one_step_delay() -> None:
    with pytest.raises(ValueError, match="eager updates need delay=1"):
        DiLoCoConfig(eager=True)
    assert not DiLoCoConfig().eager_updates and DiLoCoConfig(delay=1).eager_updates
    with pytest.raises(ValueError, match="delay must be 0 or 1"):  # a refused round broke its queue
        DiLoCoConfig(delay=2)


def test_eager_peers_hold_one_consensus_theta_and_a_download_resets_the_offset() -> None:
    """Four virtual peers with eager overlap: every peer's θ is the same at every round (only
    real means move it), their working params differ (each its own offset), and they all end
    on the same params."""
    from optim.sim import InProcessSwarm

    swarm = InProcessSwarm(4)
    config = DiLoCoConfig(inner_steps=2, delay=1, overlap=True)
    peers = []
    for rank in range(4):
        model = make_model(seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        peers.append((DiLoCo(model, opt, swarm.averager(rank), config), opt))
    thetas: list[list[list[torch.Tensor]]] = []

    def run(rank: int) -> None:
        outer, opt = peers[rank]
        for r in range(4):
            train_round(outer, opt, batches(10 * rank + r, 2))
        outer.finish()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    thetas = [outer.global_params for outer, _ in peers]
    for theta in thetas[1:]:
        assert_all_close(theta, thetas[0], atol=0)
    for outer, _ in peers:
        assert_all_close(params_of(outer.model), thetas[0], atol=0)
    # A download mid-run: the joiner's offset and its stand-in start from zero.
    donor = peers[0][0]
    joiner, _ = _lone(config, seed=3)
    joiner.offset[0].fill_(1.0)
    joiner._proxy = [torch.ones_like(g) for g in joiner.global_params]
    joiner.load_outer_state(donor.outer_state())
    assert all(float(o.abs().max()) == 0 for o in joiner.offset) and joiner._proxy is None
    assert_all_close(params_of(joiner.model), donor.global_params, atol=0)


def bf16_beside_its_fp32_theta(model: torch.nn.Module) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """``model`` in bf16, and its fp32 θ off bf16's grid (as an fp32 master copy is)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    theta = [p.detach().clone() for p in model.parameters()]
    return model.to(torch.bfloat16), theta


def test_bf16_parameters_keep_theta_s_progress_finer_than_bf16() -> None:
    """θ is fp32 and the model starts each round from θ in bf16. Δ was θ minus the model, so it
    held θ's own rounding: with no training at all a round moved θ, and updates smaller than
    a bf16 step were undone by the next round. Δ is now taken from θ as the model started."""
    model, theta = bf16_beside_its_fp32_theta(torch.nn.Linear(16, 4))
    inner = torch.optim.SGD(model.parameters(), lr=0.0)
    diloco = DiLoCo(
        model, inner, LocalAverager(), DiLoCoConfig(inner_steps=2, outer_lr=0.7, outer_momentum=0.9)
    )
    with torch.no_grad():
        for g, t in zip(diloco.global_params, theta):
            g.copy_(t)
    diloco.restore_parameters()
    for _ in range(3):  # rounds without training: Δ = 0, θ stays
        for _ in range(2):
            model(torch.randn(4, 16, dtype=torch.bfloat16)).float().pow(2).mean().backward()
            inner.step()
            inner.zero_grad()
            report = diloco.step(samples=4)
    assert report.local_norm == 0.0
    assert all(torch.equal(g, t) for g, t in zip(diloco.global_params, theta))


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking-delay", "overlap"])
def test_an_eager_peer_resumed_from_its_checkpoint_goes_on_as_if_never_stopped(overlap: bool) -> None:
    """A checkpoint kept θ, momentum and the queued mean, not the eager offset: a resumed peer
    ran one round of the naive delay and left the path it was on (6e-2 away for a lone peer).
    The offset, its momentum, last round's stand-in and share now go with the checkpoint."""
    import io

    from workbench.run.checkpoint import restore_training, training_state

    config = DiLoCoConfig(inner_steps=2, outer_lr=0.7, outer_momentum=0.9, delay=1, overlap=overlap)
    reference, opt_r = _lone(config)
    for r in range(6):
        train_round(reference, opt_r, batches(r, 2))
    peer, opt = _lone(config)
    for r in range(3):
        train_round(peer, opt, batches(r, 2))
    saved = io.BytesIO()
    torch.save(training_state(peer, peer.model, opt, None), saved)
    peer, opt = _lone(config, seed=7)  # another start: everything comes from the checkpoint
    saved.seek(0)
    restore_training(torch.load(saved, weights_only=False), peer, peer.model, opt, None)
    for r in range(3, 6):
        train_round(peer, opt, batches(r, 2))
    assert_all_close(peer.global_params, reference.global_params, atol=0)
    assert_all_close(params_of(peer.model), params_of(reference.model), atol=0)


def test_a_model_with_batchnorm_is_told_its_running_statistics_stay_each_peer_s(caplog) -> None:
    """Only parameters are averaged and downloaded: BatchNorm's running mean and variance drift
    apart between peers (1.73 apart after a few rounds, each peer's eval loss its own), and a
    joiner starts them afresh. Said once, when the outer optimizer is made."""
    from optim.streaming import StreamingConfig, StreamingDiLoCo

    class WithBatchNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear, self.norm = nn.Linear(3, 2), nn.BatchNorm1d(2)

    model = WithBatchNorm()
    with caplog.at_level("WARNING"):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), LocalAverager(), DiLoCoConfig())
        StreamingDiLoCo(
            model, torch.optim.SGD(model.parameters(), lr=0.1), LocalAverager(), StreamingConfig(fragments=2)
        )
    told = [r.getMessage() for r in caplog.records if "not averaged or sent to joiners" in r.getMessage()]
    assert len(told) == 1 and "norm.running_mean, norm.running_var" in told[0], told


class _GroupOfThree(LocalAverager):
    """This peer beside two members declaring ``others`` × its norm; the tensors stay (the mean
    is this peer's own update), ``missed``: this peer was left out of the mean."""

    def __init__(self, others: tuple[float, float], missed: bool = False) -> None:
        self.others, self.missed = others, missed

    def all_reduce(self, tensors, *, weight, info=None):  # type: ignore[no-untyped-def]
        mine = dict(info or {}, peer="me")
        group = [
            mine,
            *(dict(mine, peer=f"m{i}", norm=k * float(mine["norm"])) for i, k in enumerate(self.others)),
        ]
        return RoundReport(group_size=3, group_info=group, missed=self.missed)


@pytest.mark.parametrize(
    ("others", "missed", "kept"),
    [
        ((1.0, 1000.0), False, True),  # refused for another member's update: kept
        ((1.0, 1.0), True, True),  # left out of the mean (the simulator's dropout): kept
        ((1e-3, 1e-3), False, False),  # refused for this peer's own update: not sent again
        ((1.0, 1.0), False, False),  # applied: the residual is what the codec dropped
    ],
    ids=["refused-for-another", "missed", "refused-for-its-own", "applied"],
)
def test_error_feedback_keeps_what_the_group_did_not_apply(others, missed: bool, kept: bool) -> None:
    """What error feedback sent left its residual at once; a refused round (or one this peer
    missed) then lost it for good, against "compression delays coordinates, it never loses
    them": with SparseLoCo's top-k, the part sent was exactly the part lost (0.0089 of 0.0193)."""
    config = DiLoCoConfig(
        inner_steps=2, outer_lr=1.0, outer_momentum=0.0, nesterov=False, codec="topk", topk_density=0.25,
        error_feedback=True,
    )  # fmt: skip
    outer, opt = _lone(config)
    outer.averager = _GroupOfThree(others, missed)
    theta = [g.clone() for g in outer.global_params]
    local, report = train_round(outer, opt, batches(0, 2))
    delta = [t - p for t, p in zip(theta, local)]
    residual = outer.feedback.residuals
    sent = [d - r for d, r in zip(delta, residual)]  # what left the residual and was not taken back
    assert report.applied == (others == (1.0, 1.0))
    if kept:
        assert_all_close(residual, delta, atol=1e-6)  # nothing was lost: all of Δ is kept
    else:
        assert max(float(s.abs().max()) for s in sent) > 1e-4  # the top-k part went out


def test_a_downloaded_state_drops_what_error_feedback_held_back() -> None:
    """The residual is what compression held back of this peer's updates to its old θ; a state
    download replaces that θ (the peer was behind, or outvoted), so the memory goes with it, as
    ``ErrorFeedback.reset`` says. Kept, it was added to the first update on the new θ: a
    diverged peer's held-back coordinates came back into the group's mean a round later."""
    config = DiLoCoConfig(inner_steps=2, codec="topk", topk_density=0.25, error_feedback=True)
    outer, opt = _lone(config)
    train_round(outer, opt, batches(0, 2))
    assert outer.feedback.residuals is not None
    source, _ = _lone(config, seed=5)
    outer.load_outer_state(source.outer_state())
    assert outer.feedback.residuals is None


def test_a_state_read_while_a_round_is_still_averaging_is_refused_not_short_of_its_mean() -> None:
    """With --overlap the step count moves on when a round's all-reduce starts. Once the wait
    for it ran out (60 s; an all-reduce can take minutes), the state was read anyway: its outer
    step counted the round and its queued means lacked it, so a checkpoint resumed (or a joiner)
    ended 0.06 away from the uninterrupted run, with nothing said. Now it is refused."""
    from optim.background import RoundInFlight

    release = threading.Event()

    class Slow:
        def all_reduce(self, tensors, *, weight: float, info: dict[str, Any] | None = None) -> RoundReport:
            release.wait(timeout=30)
            return RoundReport(group_size=1)

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = DiLoCo(model, opt, Slow(), DiLoCoConfig(inner_steps=2, delay=1, overlap=True))
    train_round(outer, opt, batches(0, 2))  # its all-reduce now waits in the background
    with pytest.raises(RoundInFlight, match="has not finished after 0.2 s"):
        outer.outer_state(inflight_timeout=0.2)
    release.set()
    state = outer.outer_state(inflight_timeout=30)
    assert state.outer_step == 1 and len(state.pending) == 1  # its mean, queued for the joiner
    outer.finish()


def test_a_joiner_takes_adamw_s_state_from_a_donor_whose_model_has_a_frozen_layer() -> None:
    """DiLoCo averages the trained parameters (θ); AdamW(model.parameters()) also holds the frozen
    ones, and its state is indexed by its own list: the donor's indices were checked against θ
    ("has an entry for parameter 2 of 2") and the joiner started AdamW from zero."""
    from swarm.download import _parse_state

    def peer(seed: int) -> tuple[DiLoCo, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
        model[0].requires_grad_(False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return DiLoCo(model, opt, LocalAverager(), DiLoCoConfig(inner_steps=2)), opt

    donor, donor_opt = peer(0)
    train_round(donor, donor_opt, batches(0, 2))
    state = donor.outer_state()
    assert sorted({index for index, _ in state.inner_keys}) == [0, 1]  # positions in θ: the second layer's
    wire = [*state.params, *state.momentum, *state.inner]
    metadata = {"outer_step": 1, "num_params": 2, "num_pending": 0, "inner_keys": state.inner_keys}
    parsed = _parse_state(metadata, wire, [tuple(p.shape) for p in donor.params])  # what a joiner checks
    joiner, joiner_opt = peer(1)
    joiner.load_outer_state(parsed)
    mine, theirs = donor_opt.state_dict()["state"], joiner_opt.state_dict()["state"]
    assert sorted(theirs) == sorted(mine) == [2, 3]  # AdamW's own indices: the frozen layer holds none
    assert all(torch.equal(mine[i][k], theirs[i][k]) for i in mine for k in mine[i])
