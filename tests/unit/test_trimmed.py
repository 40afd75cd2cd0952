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
