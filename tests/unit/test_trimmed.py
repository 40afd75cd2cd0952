"""The trimmed mean inside hivemind's reducer (swarm.trimmed), driven as hivemind drives it."""

from __future__ import annotations

import asyncio

import torch

from swarm.trimmed import TrimmedPartReducer, trimmed_mean


def test_one_bad_value_per_coordinate_moves_nothing():
    honest = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.2, 2.2, 2.8]), torch.tensor([0.8, 1.8, 3.2])]
    bad = torch.tensor([float("nan"), 1e6, -1e6])
    mean = trimmed_mean([*honest, bad], trim=1)
    assert torch.isfinite(mean).all()
    # per coordinate: drop the smallest and the largest of four, average the middle two
    assert torch.allclose(mean, torch.tensor([1.1, 2.1, 2.9]))


def test_too_few_members_keep_at_least_one_value():
    assert torch.equal(trimmed_mean([torch.tensor([1.0]), torch.tensor([3.0])], trim=1), torch.tensor([2.0]))
    assert torch.equal(trimmed_mean([torch.tensor([5.0])], trim=1), torch.tensor([5.0]))


def test_the_reducer_returns_the_trimmed_mean_to_every_sender():
    async def run() -> list[torch.Tensor]:
        reducer = TrimmedPartReducer([torch.Size([2]), torch.Size([1])], num_senders=3)
        parts = {0: [torch.tensor([1.0, 1.0]), torch.tensor([4.0])],
                 1: [torch.tensor([2.0, 2.0]), torch.tensor([5.0])],
                 2: [torch.tensor([100.0, -100.0]), torch.tensor([6.0])]}  # fmt: skip

        async def sender(index: int) -> list[torch.Tensor]:
            return [
                await reducer.accumulate_part(index, p, part, weight=1.0)
                for p, part in enumerate(parts[index])
            ]

        return await asyncio.gather(*(sender(i) for i in range(3)))

    results = asyncio.run(run())
    for first, second in results:
        assert torch.equal(first, torch.tensor([2.0, 1.0]))  # the median of three, per coordinate
        assert torch.equal(second, torch.tensor([5.0]))


def _reduce(parts: list[torch.Tensor], weights: list[float]) -> list[torch.Tensor]:
    """One part per sender through the trimmed reducer, as hivemind drives it."""

    async def run() -> list[torch.Tensor]:
        reducer = TrimmedPartReducer([parts[0].shape], num_senders=len(parts))
        return await asyncio.gather(
            *(
                reducer.accumulate_part(i, 0, part, weight=w)
                for i, (part, w) in enumerate(zip(parts, weights))
            )
        )

    return asyncio.run(run())


def test_a_member_sending_with_weight_zero_casts_no_vote():
    """A diverged peer sends zeros with weight 0 so that the all-reduce still finds it: counted
    as a vote, its zeros pulled every coordinate toward 0 (0.72x the honest mean, measured)."""
    honest = [torch.tensor([1.0, 2.0]), torch.tensor([1.1, 2.1]), torch.tensor([1.2, 2.2])]
    for result in _reduce([*honest, torch.zeros(2)], [1.0, 1.0, 1.0, 0.0]):
        assert torch.allclose(result, torch.tensor([1.1, 2.1]))  # the median of the three honest
    for result in _reduce([torch.zeros(2), torch.zeros(2)], [0.0, 0.0]):
        assert torch.equal(result, torch.zeros(2))  # nobody sent anything: nothing moves


def test_a_trimmed_mean_of_sparse_updates_is_refused_before_anything_starts():
    """Per coordinate most members send 0 under top-k: trimming would erase the kept values."""
    import pytest

    from optim.config import DiLoCoConfig
    from swarm.averaging_config import AveragingConfig
    from workbench.config import RunConfig

    with pytest.raises(ValueError, match="use --aggregate mean with topk"):
        RunConfig(diloco=DiLoCoConfig(codec="topk"), averaging=AveragingConfig(aggregate="trimmed-mean"))
    RunConfig(diloco=DiLoCoConfig(codec="int8"), averaging=AveragingConfig(aggregate="trimmed-mean"))


def test_a_trimmed_mean_of_a_pair_still_refuses_a_mate_sending_far_more_than_it_declared():
    """Stop 57, a review: a trimmed mean trims nothing in a pair (k = 0), and the misreport
    check was off for it, so a mate that declared an ordinary norm and sent 1e30 had it applied;
    +inf came out of the reducer as float32's max (nan_to_num's default), past the NaN check."""
    from optim.averager import RoundReport
    from optim.contribution import Outgoing, judge

    honest = torch.tensor([0.3, -0.4])
    assert torch.isinf(trimmed_mean([honest, torch.tensor([float("inf"), 0.0])], trim=1)[0])
    info = [{"name": "me", "norm": 0.5, "weight": 8}, {"name": "mate", "norm": 0.5, "weight": 8}]
    for sent in (torch.tensor([1e30, 0.0]), torch.tensor([float("inf"), 0.0])):
        mean = [trimmed_mean([honest, sent], trim=1)]
        outgoing = Outgoing(mean, info[0], 8.0, 0.5, 8, False, 5)
        report = RoundReport(group_size=2, group_info=info, robust_mean=True)
        why = judge(outgoing, report, outlier_ratio=10.0)
        assert why is not None and not report.applied, sent
    # An honest pair's trimmed mean (its plain mean) passes: within the root of the squared norms.
    mean = [trimmed_mean([honest, torch.tensor([0.4, 0.3])], trim=1)]
    report = RoundReport(group_size=2, group_info=info, robust_mean=True)
    assert judge(Outgoing(mean, info[0], 8.0, 0.5, 8, False, 5), report, outlier_ratio=10.0) is None
