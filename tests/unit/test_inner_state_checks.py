"""A joiner's check of the inner optimizer state a donor serves (optim.state.load_inner_state).

The witnesses vouch for θ only: AdamW's moments are each donor's own. Shapes were all that was
checked, so a donor's NaN moments, a negative step count, an entry without ``exp_avg`` or moments
out of proportion reached the joiner's first step (NaN weights, a crash, or every weight moved by
1e30 lr). Each attack here is refused, the joiner starts AdamW afresh and steps on; every state
an honest AdamW can make, including the one that comes closest to the bound, is taken."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from optim.eager import AdamW
from optim.state import OuterState, inner_state_problem, load_inner_state


def _trained(steps: int = 5, *, amsgrad: bool = False, scale=lambda step: 1.0) -> tuple[nn.Module, AdamW]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = AdamW(model.parameters(), lr=1e-2, amsgrad=amsgrad)
    for step in range(steps):
        for p in model.parameters():
            p.grad = torch.randn_like(p) * scale(step)
        optimizer.step()
    return model, optimizer


def _served(optimizer: torch.optim.Optimizer) -> OuterState:
    keys, tensors = [], []
    for index, entry in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(entry.items()):
            keys.append([index, key])
            tensors.append(value.clone())
    return OuterState(outer_step=3, params=[], momentum=[], inner=tensors, inner_keys=keys)


def _changed(state: OuterState, key: str, value) -> OuterState:
    inner = [value(t) if k == key and i == 0 else t for (i, k), t in zip(state.inner_keys, state.inner)]
    return OuterState(outer_step=3, params=[], momentum=[], inner=inner, inner_keys=state.inner_keys)


def _without(state: OuterState, key: str) -> OuterState:
    kept = [(k, t) for k, t in zip(state.inner_keys, state.inner) if not (k[0] == 0 and k[1] == key)]
    return OuterState(
        outer_step=3, params=[], momentum=[], inner=[t for _, t in kept], inner_keys=[k for k, _ in kept]
    )


def _joiner() -> tuple[nn.Module, AdamW]:
    torch.manual_seed(1)
    model = nn.Linear(3, 2)
    return model, AdamW(model.parameters(), lr=1e-2)


ATTACKS = {
    "NaN exp_avg": lambda s: _changed(s, "exp_avg", lambda t: torch.full_like(t, float("nan"))),
    "Inf exp_avg_sq": lambda s: _changed(s, "exp_avg_sq", lambda t: torch.full_like(t, float("inf"))),
    "negative step": lambda s: _changed(s, "step", lambda t: torch.tensor(-3.0)),
    "fractional step": lambda s: _changed(s, "step", lambda t: torch.tensor(2.5)),
    "huge step": lambda s: _changed(s, "step", lambda t: torch.tensor(1e30)),
    "step 0 (a stored state has stepped)": lambda s: _changed(s, "step", lambda t: torch.tensor(0.0)),
    # torch keeps a loaded step in its dtype: each made the first step raise (or divide by 0).
    "bool step": lambda s: _changed(s, "step", lambda t: torch.tensor(True)),
    "uint8 step 255": lambda s: _changed(s, "step", lambda t: torch.tensor(255, dtype=torch.uint8)),
    "int8 step 127": lambda s: _changed(s, "step", lambda t: torch.tensor(127, dtype=torch.int8)),
    "fp16 step": lambda s: _changed(s, "step", lambda t: torch.tensor(3.0, dtype=torch.float16)),
    # The donor's dtypes are its own: loading casts the moments to the parameter's.
    "complex exp_avg for a real weight": lambda s: _changed(
        s, "exp_avg", lambda t: t.to(torch.complex64) * 1e30
    ),
    "fp16 squares to widen the slack": lambda s: _changed(
        _changed(s, "exp_avg_sq", lambda t: torch.zeros_like(t, dtype=torch.float16)),
        "exp_avg",
        lambda t: torch.full_like(t, 0.05),
    ),
    "integer exp_avg_sq": lambda s: _changed(
        s, "exp_avg_sq", lambda t: torch.zeros_like(t, dtype=torch.int64)
    ),
    "fp64 moments beyond fp32": lambda s: _changed(
        s, "exp_avg_sq", lambda t: torch.full_like(t, 1e300, dtype=torch.float64)
    ),
    "no exp_avg": lambda s: _without(s, "exp_avg"),
    "negative exp_avg_sq": lambda s: _changed(s, "exp_avg_sq", lambda t: -t - 1),
    "exp_avg 1e30 over exp_avg_sq 0": lambda s: _changed(
        _changed(s, "exp_avg", lambda t: torch.full_like(t, 1e30)), "exp_avg_sq", torch.zeros_like
    ),
    "exp_avg 100x its bound": lambda s: _changed(s, "exp_avg", lambda t: t.sign() * 100 * s.inner[2].sqrt()),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_donors_impossible_adamw_state_is_refused_and_the_joiner_starts_it_afresh(attack, caplog) -> None:
    _, donor = _trained()
    state = ATTACKS[attack](_served(donor))
    model, optimizer = _joiner()
    with caplog.at_level(logging.WARNING, logger="optim.state"):
        load_inner_state(optimizer, list(model.parameters()), state)
    assert "starting it fresh" in caplog.text, caplog.text
    assert len(optimizer.state) == 0  # nothing of it taken
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()  # steps, as a fresh AdamW: each weight moves by about lr
    moved = max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before))
    assert 0 < moved < 0.02


@pytest.mark.parametrize("amsgrad", [False, True])
def test_an_honest_adamw_state_is_taken(amsgrad) -> None:
    _, donor = _trained(20, amsgrad=amsgrad, scale=lambda step: 10.0 ** (step % 7 - 3))  # spikes
    model, optimizer = _joiner()
    optimizer.param_groups[0]["amsgrad"] = amsgrad
    load_inner_state(optimizer, list(model.parameters()), _served(donor))
    assert len(optimizer.state) == 2
    assert torch.equal(optimizer.state[model.weight]["exp_avg"], donor.state_dict()["state"][0]["exp_avg"])


def test_the_closest_an_honest_adamw_comes_to_the_bound_passes() -> None:
    """Gradients growing by β2/β1 a step make exp_avg / sqrt(exp_avg_sq) tend to the bound
    (Cauchy-Schwarz is tight for them); an honest state must never be refused for that."""
    beta1, beta2 = 0.9, 0.999
    param = nn.Parameter(torch.zeros(4))
    optimizer = AdamW([param], lr=1e-3, betas=(beta1, beta2))
    for step in range(300):
        param.grad = torch.full_like(param, (beta2 / beta1) ** step)
        optimizer.step()
    entry = optimizer.state[param]
    ratio = float((entry["exp_avg"] / entry["exp_avg_sq"].sqrt()).max())
    bound = (1 - beta1) / ((1 - beta2) * (1 - beta1**2 / beta2)) ** 0.5
    assert 0.99 * bound < ratio <= bound * 1.0001  # as close as an honest state gets
    assert inner_state_problem(optimizer, [param], {0: dict(entry)}) == ""


def test_entries_with_different_keys_are_refused_for_any_optimizer() -> None:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mixed = {0: {"momentum_buffer": torch.zeros(2, 3)}, 1: {"other": torch.zeros(2)}}
    assert "different keys" in inner_state_problem(optimizer, list(model.parameters()), mixed)
    fine = {0: {"momentum_buffer": torch.ones(2, 3)}, 1: {"momentum_buffer": torch.ones(2)}}
    assert inner_state_problem(optimizer, list(model.parameters()), fine) == ""


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_honest_low_precision_moments_are_taken(dtype) -> None:
    """bf16's rounding took an honest state 1.2 % past the bound; fp16's squares of gradients
    under 2e-4 underflow to 0 while exp_avg does not: both were refused."""
    beta1, beta2 = 0.9, 0.95
    param = nn.Parameter(torch.zeros(64, dtype=dtype))
    optimizer = torch.optim.AdamW([param], lr=1e-3, betas=(beta1, beta2))
    for step in range(40):
        scale = 1e-5 if dtype is torch.float16 else (beta2 / beta1) ** step  # underflow / the bound
        param.grad = (torch.rand(64) * scale).to(dtype)
        optimizer.step()
    assert inner_state_problem(optimizer, [param], {0: dict(optimizer.state[param])}) == ""


def test_groups_with_their_own_amsgrad_and_complex_parameters_are_taken() -> None:
    real, other = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))
    plain = nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    optimizer = torch.optim.AdamW([{"params": [real, plain]}, {"params": [other], "amsgrad": True}])
    for _ in range(3):
        for p in (real, other, plain):
            p.grad = torch.randn_like(p)
        optimizer.step()
    entries = {i: dict(optimizer.state[p]) for i, p in enumerate((real, plain, other))}
    assert inner_state_problem(optimizer, [real, plain, other], entries) == ""
