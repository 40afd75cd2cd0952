"""swarm.consensus: the check that hivemind's all-reduce gave every member the group's mean."""

from __future__ import annotations

import contextlib

import pytest
import torch

from swarm.consensus import FAILED, Post, TensorSketcher, disagreement
from swarm.sketch import ROWS, Sketcher

SHAPES = [(64, 33), (7,), (5000,), (3, 3)]
WEIGHTS = [1.0, 2.0, 5.0]
COUNT = sum(torch.Size(s).numel() for s in SHAPES)


def _wire(x: torch.Tensor, codec: str) -> torch.Tensor:
    return x.half().float() if codec == "fp16" else x


def _round(codec: str, left_out: bool = False, median: bool = False, scale: float = 1.0) -> list[bytes]:
    """Three members' posts after a round with hivemind's arithmetic: member j gets
    ``x_j + Q(mean - Q(x_j))``; ``left_out``: member 1 kept its own values in one tensor, as
    after a reducer that failed towards it; ``median``: the trimmed mean of three (per
    coordinate, the middle value) instead of the weighted mean; ``scale``: the updates' size."""
    torch.manual_seed(0)
    updates = [[torch.randn(s) * (j + 1) * scale for s in SHAPES] for j in range(len(WEIGHTS))]
    total = sum(WEIGHTS)
    means = [
        torch.stack([_wire(u[t], codec) for u in updates]).median(0).values
        if median
        else sum(w * _wire(u[t], codec) for w, u in zip(WEIGHTS, updates)) / total
        for t in range(len(SHAPES))
    ]
    sketcher = TensorSketcher(b"group-seed", [torch.Size(s).numel() for s in SHAPES])
    posts = []
    for j, (weight, mine) in enumerate(zip(WEIGHTS, updates)):
        got = [x + _wire(m - _wire(x, codec), codec) for x, m in zip(mine, means)]
        if left_out and j == 1:
            got[2] = mine[2].clone()
        norm = sketcher.sketch(mine).norm
        posts.append(Post(sketcher.sketch(mine, weight / total), norm, sketcher.sketch(got).rows).to_bytes())
    return posts


@pytest.mark.parametrize("codec", ["none", "fp16"])
def test_members_that_got_the_mean_up_to_rounding_agree(codec):
    assert disagreement(_round(codec), codec, count=COUNT) is None


@pytest.mark.parametrize("median", [False, True])
def test_tiny_updates_pass_fp16s_rounding_and_a_left_out_part_still_fails(median):
    """fp16 rounds values below 2^-14 by up to 2^-25, whatever their size: updates around 1e-6
    (a cosine schedule's end) round by a few % of themselves, which the relative bound alone
    refused in every honest round (swarm.sketch.floor)."""
    linear = not median
    assert disagreement(_round("fp16", median=median, scale=1e-6), "fp16", count=COUNT, linear=linear) is None
    why = disagreement(_round("fp16", True, median, scale=1e-6), "fp16", count=COUNT, linear=linear)
    assert why is not None and why.startswith("member 1"), why


@pytest.mark.parametrize("codec", ["none", "fp16"])
def test_a_member_that_kept_its_own_values_for_a_part_fails_the_round(codec):
    why = disagreement(_round(codec, left_out=True), codec, count=COUNT)
    assert why is not None and why.startswith("member 1 did not get the group's mean")


def test_a_failed_or_malformed_post_fails_the_round():
    posts = _round("none")
    assert disagreement([posts[0], FAILED, posts[2]], "none", count=COUNT) == "member 1's all-reduce failed"
    assert "malformed" in disagreement([posts[0], posts[1], posts[2][:-8]], "none", count=COUNT)


@pytest.mark.parametrize("seed", [0, 6, 80])  # 6 and 80 failed a tolerance of 1e-6 absolute
def test_the_sketch_of_a_tensor_list_is_the_sum_of_its_tensors_sketches(seed):
    generator = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(s, generator=generator) for s in SHAPES]
    sketcher = TensorSketcher(b"seed", [t.numel() for t in tensors])
    whole = torch.tensor(sketcher.sketch(tensors).rows)
    parts = sum(torch.tensor(sketcher.sketch([t if i == k else torch.zeros_like(t) for i, t in enumerate(tensors)]).rows)
                for k in range(len(tensors)))  # fmt: skip
    # A row's rounding error scales with the whole vector (|x| ~ 84 here), not with the row's own
    # value: 300 seeds differed by at most 1.9e-7 |x| (one or two float32 steps of the largest
    # rows), while a wrong sum differs by about |x| per row.
    slack = 1e-6 * float(torch.cat([t.reshape(-1) for t in tensors]).norm())
    assert torch.allclose(whole, parts, rtol=0, atol=slack)
    # Each tensor starts on a chunk boundary of one R: the same as a padded flat vector.
    padded = torch.cat([torch.nn.functional.pad(t.reshape(-1), (0, -t.numel() % 4096)) for t in tensors])
    direct = Sketcher(b"seed", padded.numel()).rows(padded).float()
    assert torch.allclose(whole, direct, rtol=0, atol=slack) and len(whole) == ROWS


@pytest.mark.parametrize("codec", ["none", "fp16"])
def test_a_trimmed_mean_is_checked_for_agreement(codec):
    """A trimmed mean is not the sum of the contributions: the members must agree on it."""
    assert disagreement(_round(codec, median=True), codec, count=COUNT, linear=False) is None
    assert disagreement(_round(codec, median=True), codec, count=COUNT) is not None  # not the linear mean
    why = disagreement(_round(codec, left_out=True, median=True), codec, count=COUNT, linear=False)
    assert why is not None and why.startswith("member 1's result differs from member 0's")
    # A NaN posted by one member does not switch the check off: it fails the round for all.
    posts = _round(codec, median=True)
    nan = Post.from_bytes(posts[1])
    nan_norm = Post(nan.sent, float("nan"), nan.got).to_bytes()
    nan_got = Post(nan.sent, nan.own_norm, (float("nan"),) * ROWS).to_bytes()
    assert "not finite" in disagreement([posts[0], nan_norm, posts[2]], codec, count=COUNT, linear=False)
    assert "non-finite result" in disagreement(
        [posts[0], nan_got, posts[2]], codec, count=COUNT, linear=False
    )


def test_a_reducer_whose_stream_back_fails_dooms_the_round_and_leaves_no_error_unread(monkeypatch):
    """swarm.butterfly: a reducer's stream back to a member ends early (it "sent 11 parts, but we
    expected 12", seen under load in a private run across machines): the member drops it, so the
    round fails (``doomed``), and the task ends without an error. Raised, it was read only by
    hivemind's clean-up, which an abandoned all-reduce never runs: it reached the user's log as
    "Task exception was never retrieved" with a traceback, in a round the peer then averaged."""
    import asyncio

    from hivemind.averaging.allreduce import AllReduceRunner
    from hivemind.averaging.partition import AllreduceException

    from swarm.butterfly import MeanReplies

    async def truncated(self, peer_id):
        raise AllreduceException(f"peer {peer_id} sent 11 parts, but we expected 12")

    monkeypatch.setattr(AllReduceRunner, "_communicate_with_peer", truncated)

    async def member():
        runner = object.__new__(MeanReplies)  # only what the failure path touches
        runner.peer_id, runner.dropped, runner.doomed = "member", set(), asyncio.Event()
        task = asyncio.create_task(runner._communicate_with_peer("reducer"))
        await asyncio.wait({task})
        return runner, task

    runner, task = asyncio.run(member())
    assert task.exception() is None
    assert runner.dropped == {"reducer"} and runner.doomed.is_set()


def test_hiveminds_own_exchange_weighs_a_sender_by_its_counted_weight_not_its_messages():
    """A group with a member that does not take the mean (an older release, or a liar that left
    the flag out of what it gathered) runs hivemind's own exchange, whose reducers weighed each
    sender's parts by the weight its messages carry: 1e9 there, under a gathered weight of 1,
    took every honest reducer's part. swarm.butterfly.CountedWeights weighs it by the counted 1."""
    import asyncio
    from types import SimpleNamespace

    import torch
    from hivemind.compression import serialize_torch_tensor
    from hivemind.proto import averaging_pb2, runtime_pb2

    from swarm.butterfly import CountedWeights

    weighed: list[float] = []

    class Reducer:
        num_parts = 2

        async def accumulate_part(self, sender_index, part_index, part, weight):  # type: ignore[no-untyped-def]
            weighed.append(weight)
            return part

    async def liar():  # its parts, each message claiming 1e9
        for _ in range(2):
            part = serialize_torch_tensor(torch.full((4,), -2.0), runtime_pb2.CompressionType.NONE)
            yield averaging_pb2.AveragingData(tensor_part=part, weight=1e9)

    async def exchange() -> list:
        runner = object.__new__(CountedWeights)  # what the reducing path touches
        runner.weights, runner.sender_peer_ids = {"liar": 1.0}, ["liar"]
        runner.reading, runner.idle, runner.cut = {}, set(), {}
        runner.tensor_part_reducer = Reducer()
        runner.tensor_part_container = SimpleNamespace(prefetch=1)
        return [reply async for reply in runner._accumulate_parts_streaming(liar(), 0)]

    replies = asyncio.run(exchange())
    assert len(replies) == 2 and weighed == [1.0, 1.0]


def test_a_group_with_a_member_not_taking_the_mean_runs_hiveminds_exchange_on_counted_weights():
    """The test above checks CountedWeights itself; this one that the averager runs it: with
    plain hivemind's runner in its place (one line), a member claiming 1e9 in its messages took
    every honest reducer's part again and no test failed (a review, 2026-12-06)."""
    import asyncio
    from types import SimpleNamespace

    from hivemind.utils import MSGPackSerializer

    from swarm import gathered
    from swarm.butterfly import CountedWeights, MeanReplies
    from swarm.group_averager import GroupAverager

    class Ran(Exception):
        pass

    def reduce_with(members: list[dict]) -> tuple[type, dict]:
        ran: list = []

        def runner(kind, tensors, group_info, **kwargs):
            ran.append((kind, kwargs["weights"]))
            raise Ran

        class Probe(GroupAverager):  # the averager's reducing path, without its processes
            peer_id, serializer, _runner = "a", MSGPackSerializer, staticmethod(runner)

            def __del__(self) -> None:
                pass

        averager = object.__new__(Probe)
        dumps = MSGPackSerializer.dumps
        group = SimpleNamespace(peer_ids=["a", "liar"], gathered=[dumps([0.0, 0, dumps(m)]) for m in members])
        compression = SimpleNamespace(compression_type=0)
        with pytest.raises(Ran):
            asyncio.run(averager._run_allreduce_inplace_([], group, compression=compression))
        return ran[0]

    honest = gathered.own(False, 1.0, b"", {})
    mean_taker = {**gathered.own(False, 1e9, b"", {})}
    assert reduce_with([honest, mean_taker])[0] is MeanReplies
    differences = {k: v for k, v in mean_taker.items() if k != gathered.BUTTERFLY}
    kind, weights = reduce_with([honest, differences])
    assert kind is CountedWeights and weights["liar"] <= 16 * weights["a"], weights


def _stalls_runner(kind: type, own_fraction: float = 1.0, timeout: float = 0.3):
    """A real runner of ``kind`` for three members, this one first, with no network: (the
    runner, the members' ids)."""
    from types import SimpleNamespace

    from hivemind.averaging.allreduce import AveragingMode
    from hivemind.p2p import PeerID, ServicerBase

    peers = [PeerID(bytes([i + 1]) * 34) for i in range(3)]
    extra = {"codec": 0} if kind.__name__ == "MeanReplies" else {}
    runner = kind(
        p2p=SimpleNamespace(peer_id=peers[0]), servicer_type=ServicerBase, prefix="stalls", group_id=b"g",
        tensors=[torch.zeros(3 << 18)], ordered_peer_ids=peers, peer_fractions=(own_fraction, 1.0, 1.0),
        modes=[AveragingMode.CLIENT if own_fraction == 0 else AveragingMode.NODE, *[AveragingMode.NODE] * 2],
        sender_timeout=timeout, reducer_timeout=2 * timeout, weights={p: 1.0 for p in peers}, **extra,
    )  # fmt: skip
    return runner, peers


@pytest.mark.parametrize("kind", ["MeanReplies", "CountedWeights"])
def test_a_reducer_tells_the_senders_that_sent_it_nothing_or_stalled_and_only_those(kind):
    """swarm.butterfly.Stalls: a sender that sent this reducer nothing within the senders'
    timeout of its runner's start is told; one that began is not; before the timeout nobody is; a member that reduces nothing (client
    mode) sees no senders and tells none. A sender whose stream then stood idle for the
    timeout is told too, and one whose stream ended within half the timeout of the start (later,
    another's failure may have ended it so: not told)."""
    import asyncio
    import time

    from hivemind.utils.asyncio import aiter_with_timeout

    from swarm import butterfly

    cls = getattr(butterfly, kind)

    async def told() -> None:
        runner, (me, began, silent) = _stalls_runner(cls)
        runner.active_senders.add(began)
        assert runner.stalled() == set()  # not yet due: nobody
        await asyncio.sleep(0.35)
        assert runner.stalled() == {silent}  # due: the one that sent nothing, only
        client, _ = _stalls_runner(cls, own_fraction=0.0, timeout=0.01)
        await asyncio.sleep(0.05)
        assert client.stalled() == set()

        async def idle():
            await asyncio.sleep(10)
            yield None

        async def ended():
            return
            yield None

        # idle; hung up at once (a key's one part and gone: a review); hung up once half the
        # timeout had passed (an honest member ends its streams early only after the timeout
        # of its own start, or when its step is given up)
        for stream, sender, after, named in (
            (idle(), 1, 0.0, True),
            (ended(), 2, 0.0, True),
            (ended(), 2, 0.3, False),
        ):
            runner, peers = _stalls_runner(cls, timeout=0.4)
            runner.active_senders.update(peers)
            await asyncio.sleep(after)
            with contextlib.suppress(Exception):
                async for _ in runner._accumulate_parts_streaming(aiter_with_timeout(stream, 0.4), sender):
                    pass
            assert runner.stalled() == ({peers[sender]} if named else set()), (sender, after)
            assert not runner.reading_since_before(time.monotonic() + 1)  # nothing left waiting

    asyncio.run(told())
