"""Sparse updates averaged over the members that kept each coordinate (SparseLoCo's reference rule)."""

from __future__ import annotations

import threading

import pytest
import torch

from optim.averager import RoundReport
from optim.contribution import keepers, spread_over_keepers
from optim.diloco import DiLoCo, DiLoCoConfig
from optim.sim import InProcessSwarm
from optim.streaming import StreamingConfig


def _group(deltas: list[torch.Tensor], weights: list[float], masks: list[torch.Tensor] | None = None):
    """What an all-reduce hands every member: the weighted means of the Δ and of the masks."""
    masks = masks if masks is not None else [keepers([d])[0] for d in deltas]
    total = sum(weights)
    mean = sum(w * d for w, d in zip(weights, deltas)) / total
    share = sum(w * m for w, m in zip(weights, masks)) / total
    info = [
        {"peer": f"p{i}", "norm": float(d.norm()), "weight": w}
        for i, (d, w) in enumerate(zip(deltas, weights))
    ]
    return [mean.clone()], [share], RoundReport(group_size=len(deltas), group_info=info)


def test_each_coordinate_is_the_weighted_mean_of_the_members_that_kept_it() -> None:
    a = torch.tensor([1.0, 0.0, 2.0, 0.0])
    b = torch.tensor([3.0, 4.0, 0.0, 0.0])
    c = torch.tensor([0.0, 0.0, 5.0, 0.0])
    mean, share, report = _group([a, b, c], [1.0, 3.0, 2.0])
    spread_over_keepers(mean, share, report)
    expected = torch.tensor([(1 * 1 + 3 * 3) / 4, 4.0, (1 * 2 + 2 * 5) / 3, 0.0])
    assert torch.allclose(mean[0], expected)
    assert report.refused is None and report.robust_mean  # checked on the group's mean first


def test_alone_a_member_applies_its_own_update() -> None:
    own = torch.tensor([0.5, 0.0, -2.0])
    deltas, shares = [own.clone()], keepers([own])
    spread_over_keepers(deltas, shares, RoundReport(group_size=1))
    assert torch.equal(deltas[0], own)


def test_a_lying_mask_that_scales_up_the_others_values_is_refused() -> None:
    honest = [torch.tensor([4.0, 0.0, 0.0, 1.0]), torch.tensor([0.0, 4.0, 0.0, 1.0])]
    liar = torch.tensor([0.0, 0.0, 0.0, 1.0])
    # The liar says it kept coordinates 0 and 1 "negatively": their shares fall near the floor and
    # the honest values would be multiplied by 5.5 instead of 3.
    masks = [*keepers(honest), torch.tensor([-0.45, -0.45, 0.0, 1.0])]
    mean, share, report = _group([*honest, liar], [1.0, 1.0, 1.0], masks)
    before = mean[0].clone()
    spread_over_keepers(mean, share, report)
    assert report.refused and "kept-mask" in report.refused
    assert torch.equal(mean[0], before)  # left as the group's mean, for judge to refuse


def test_a_mean_larger_than_declared_is_refused_before_it_is_spread() -> None:
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    mean, share, report = _group([a, b], [1.0, 1.0])
    mean[0].mul_(10)  # a member sent ten times what it declared
    spread_over_keepers(mean, share, report)
    assert report.refused and "more than it declared" in report.refused


def _two_peers(mean: str) -> list[torch.Tensor]:
    """Two simulated peers, each moving a different half of a 4-element θ far (kept) and the
    other half a little (dropped by top-k 50 %); θ after one outer round (outer lr 1)."""
    swarm = InProcessSwarm(2)
    models = [torch.nn.Linear(4, 1, bias=False) for _ in range(2)]
    for m in models:
        torch.nn.init.zeros_(m.weight)
    params = [m.weight for m in models]
    config = DiLoCoConfig(
        inner_steps=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False,
        codec="topk", topk_density=0.5, topk_mean=mean,
    )  # fmt: skip
    outers = [
        DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), swarm.averager(rank), config)
        for rank, m in enumerate(models)
    ]
    moves = [torch.tensor([1.0, 2.0, 0.01, 0.01]), torch.tensor([0.01, 0.01, 3.0, 4.0])]

    def run(rank: int) -> None:
        with torch.no_grad():
            params[rank].add_(moves[rank].view(1, 4))
        outers[rank].note_inner_step(samples=8)
        outers[rank].sync()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.equal(outers[0].global_params[0], outers[1].global_params[0])  # one θ
    return outers[0].global_params[0].view(4)


def test_two_peers_keeping_different_coordinates_each_apply_them_whole() -> None:
    kept = _two_peers("kept")
    assert torch.allclose(kept, torch.tensor([1.0, 2.0, 3.0, 4.0]), atol=1e-2)  # fp16 values
    group = _two_peers("group")
    assert torch.allclose(group, torch.tensor([0.5, 1.0, 1.5, 2.0]), atol=1e-2)  # diluted by 2


def test_the_kept_mean_needs_a_topk_codec_and_not_streaming() -> None:
    with pytest.raises(ValueError, match="keeps them all"):
        DiLoCoConfig(codec="int8", topk_mean="kept")
    with pytest.raises(ValueError, match="one of group, kept"):
        DiLoCoConfig(codec="topk", topk_mean="some")
    with pytest.raises(ValueError, match="local_sgd and sparseloco"):
        StreamingConfig(outer=DiLoCoConfig(codec="topk", topk_mean="kept"), fragments=2)


def test_masks_scaled_to_the_updates_leave_the_sum_check_its_power():
    """On real peers the masks go round beside the updates, and the rings' and hivemind's sum
    checks allow rounding in proportion to the norm of the whole vector (swarm.sketch). Masks of
    1 beside kept values of ~0.01 hid a member left out of half its update; scaled by
    gathered.mask_scale (the members' root-mean-square kept value), the check catches it."""
    from swarm.gathered import mask_scale
    from swarm.sketch import mismatch, sketch

    torch.manual_seed(0)
    count, kept = 1 << 17, (1 << 17) * 3 // 100
    updates = []
    for _ in range(2):
        delta = torch.zeros(count)
        delta[torch.randperm(count)[:kept]] = torch.randn(kept) * 0.01
        updates.append(delta)
    infos = [{"norm": float(d.norm()), "kept": int(torch.count_nonzero(d))} for d in updates]
    scale = mask_scale(infos, "fp16", limit=count)
    assert scale == 2.0**-7  # 0.01 is about 2^-6.6
    liar = {"norm": infos[0]["norm"] * 100, "kept": 1}  # would make the masks weigh 1000x the updates
    assert mask_scale([*infos, liar], "fp16", limit=count) == scale  # the lower median
    assert mask_scale([{"norm": 1e9, "kept": 1}], "fp16", limit=count) == 2.0**15  # within fp16
    for factor, caught in ((1.0, False), (scale, True)):
        sent = [0.5 * torch.cat([d, factor * keepers([d])[0]]) for d in updates]
        seed = b"group-seed"
        left_out = sent[0] + sent[1]
        left_out[: count // 2] = sent[1][: count // 2]  # member 0 missing from half of the Δ
        why = mismatch(
            sketch(left_out, seed, norm=False),
            [sketch(s, seed) for s in sent],
            "fp16",
            count=left_out.numel(),
        )
        assert (why is not None) == caught, (factor, why)


def test_real_peers_refuse_the_kept_mean_where_it_cannot_hold():
    """A trimmed mean has no weights to divide by, and int8's rounding blurs the masks."""
    from swarm.averaging_config import AveragingConfig
    from workbench.config import RunConfig

    kept = DiLoCoConfig(codec="topk", topk_mean="kept")
    RunConfig(diloco=kept)
    for averaging in (AveragingConfig(aggregate="trimmed-mean"), AveragingConfig(compression="int8")):
        with pytest.raises(ValueError, match="needs an exact wire"):
            RunConfig(diloco=kept, averaging=averaging)
