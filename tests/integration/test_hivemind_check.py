"""hivemind's all-reduce, checked (swarm.consensus): two real GroupAverager processes on
hivemind's data plane. hivemind lets a member whose stream back from a reducer fails keep its
own values for that part and still report success; with the check, that round fails for both.

Under CPU load hivemind itself now and then fails an honest round: a follower's join stream
breaks after the leader counted it in (the leader waits ``sender_timeout`` for it, then averages
without it), or a reducer's stream closes before its result is sent. The check fails such a
round too, which is right (the peer retries it), so the members here retry a round, in lockstep,
until it ends as that round must: the honest one averaged by both, the faulty one failed by both.
A faulty round that a member averaged ends the test at once: that is the check missing it."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from hivemind.averaging.partition import AllreduceException

from tests.processes import members_context

SHAPES = [(300, 400), (17,), (90_000,)]  # several of hivemind's 512 KB parts, both peers reduce some
WEIGHTS = [1.0, 3.0]
ATTEMPTS = 4  # per round, both members together (see above)


def _member(rank: int, codec: str, addresses, faulty_round: int, out, barrier, ended) -> None:
    mp.set_start_method("fork", force=True)  # the averager process inherits the patch below
    try:
        _rounds(rank, codec, addresses, faulty_round, out, barrier, ended)
    except BaseException:
        import traceback

        out.put((rank, traceback.format_exc()))
        raise


def _rounds(rank: int, codec: str, addresses, faulty_round: int, out, barrier, ended) -> None:
    from hivemind import DHT
    from hivemind.averaging.allreduce import AllReduceRunner

    from swarm.averaging import CODECS
    from swarm.group_averager import GroupAverager

    torch.set_num_threads(1)
    fault = mp.get_context("fork").Value("b", 0)  # inherited by the averager process (forked)
    original = AllReduceRunner._communicate_with_peer

    async def keeps_own_values(self, peer_id):
        """As when the stream back from that reducer fails: this member keeps its own values
        for that reducer's parts (hivemind's register_failed_reducer: a zero difference, or its
        own part where the reducers answer with the mean, swarm.butterfly)."""
        if fault.value and peer_id != self.peer_id:
            container, index = self.tensor_part_container, self.ordered_peer_ids.index(peer_id)
            real = container.register_processed_part

            def own_values(p, i, part):
                if p != index:
                    return real(p, i, part)
                own = container._input_parts_by_peer[p][i][0]
                return real(p, i, torch.zeros_like(part) if container.return_deltas else own.clone())

            container.register_processed_part = own_values
        return await original(self, peer_id)

    AllReduceRunner._communicate_with_peer = keeps_own_values
    if rank == 0:
        dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        addresses.put([str(a) for a in dht.get_visible_maddrs()])
    else:
        dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=addresses.get())
    tensors = [torch.zeros(s) for s in SHAPES]
    averager = GroupAverager(
        tensors, dht, prefix="check", state_provider=None, compression=CODECS[codec](), codec=codec,
        data_plane="hivemind", min_matchmaking_time=2.0, request_timeout=3.0, allreduce_timeout=30.0,
        next_chunk_timeout=10.0, target_group_size=2, allow_state_sharing=False, start=True,
    )  # fmt: skip
    results = []
    for round_ in range(2):
        for attempt in range(1, ATTEMPTS + 1):
            result = _attempt(averager, rank, round_, fault, faulty=rank == 1 and round_ == faulty_round)
            if round_ == faulty_round and not isinstance(result, str):
                ended[rank] = -1  # averaged a round it must fail: the check missed it, no retry
            elif round_ == faulty_round:
                ended[rank] = int("did not get the group's mean" in result)
            else:
                ended[rank] = int(not isinstance(result, str))
            barrier.wait(timeout=150)  # both have written
            if all(e == 1 for e in ended[:]) or -1 in ended[:] or attempt == ATTEMPTS:
                break
            barrier.wait(timeout=150)  # both have read, before either writes again
        results.append((result, attempt))
        barrier.wait(timeout=150)
    out.put((rank, results))
    averager.shutdown()
    dht.shutdown()


def _attempt(averager, rank: int, round_: int, fault, faulty: bool):
    """One averaging step from this round's values, with member 1 keeping its own values for the
    others' parts if ``faulty``; (group size, the first values) or the error."""
    fault.value = int(faulty)
    with averager.get_tensors() as local:
        for i, t in enumerate(local):
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(10 * round_ + rank)) + i)
    try:
        group = averager.step(weight=WEIGHTS[rank], timeout=60, allow_retries=False)
        with averager.get_tensors() as local:
            return len(group), [t.clone().reshape(-1)[:2000].tolist() for t in local]
    except Exception as error:  # noqa: BLE001 - reported to the test
        return str(error)


def _expected(round_: int) -> list[torch.Tensor]:
    means = []
    for i, shape in enumerate(SHAPES):
        parts = [
            torch.randn(shape, generator=torch.Generator().manual_seed(10 * round_ + r)) + i for r in range(2)
        ]
        means.append((sum(w * p for w, p in zip(WEIGHTS, parts)) / sum(WEIGHTS)).reshape(-1)[:2000])
    return means


@pytest.mark.timeout(ATTEMPTS * 2 * 100 + 60)  # every attempt of both rounds at its step's limit
@pytest.mark.parametrize("codec", ["none", "fp16"])
def test_a_member_left_with_its_own_values_fails_the_round_for_both(codec):
    context = members_context()
    out, addresses = context.Queue(), context.Queue()
    barrier, ended = context.Barrier(2), context.Array("b", 2)
    members = [
        context.Process(target=_member, args=(r, codec, addresses, 1, out, barrier, ended)) for r in range(2)
    ]
    for m in members:
        m.start()
    try:
        results = dict(out.get(timeout=ATTEMPTS * 2 * 100) for _ in members)
    finally:
        for m in members:
            m.join(timeout=30)
            if m.is_alive():
                m.kill()
    assert not any(isinstance(r, str) for r in results.values()), results  # a member's traceback
    tolerance = 1e-5 if codec == "none" else 3e-3
    # Round 0, honest: both hold the weighted mean, and the same bits (swarm.butterfly: with
    # hivemind's own replies each ended on the mean plus its own rounding, 1e-3 apart with fp16).
    for rank in range(2):
        (outcome, attempts) = results[rank][0]
        assert not isinstance(outcome, str), (rank, attempts, outcome)
        size, got = outcome
        assert size == 2
        for tensor, mean in zip(got, _expected(0)):
            assert torch.allclose(torch.tensor(tensor), mean, atol=tolerance), rank
    assert results[0][0][0][1] == results[1][0][0][1]
    # Round 1: process 1 silently kept its own values for member 0's parts; both rounds fail.
    for rank in range(2):
        (outcome, attempts) = results[rank][1]
        assert isinstance(outcome, str), (rank, attempts, outcome)
        assert "did not get the group's mean" in outcome, (attempts, outcome)


def _dropping_member(rank: int, addresses, out, names, barrier, stop) -> None:
    mp.set_start_method("fork", force=True)  # the averager process inherits the patch below
    try:
        _drop_rounds(rank, addresses, out, names, barrier, stop)
    except BaseException:
        import traceback

        out.put((rank, traceback.format_exc()))
        raise


def _drop_rounds(rank: int, addresses, out, names, barrier, stop) -> None:
    from hivemind import DHT

    from swarm.averaging import CODECS
    from swarm.group_averager import GroupAverager

    torch.set_num_threads(1)
    if rank == 2:

        async def gives_up(self, group_info, min_vector_size, **kwargs):
            """As a member whose matchmaking gave up after its leader had counted it in."""
            raise AllreduceException("gave up on its group")

        GroupAverager._aggregate_with_group = gives_up
    if rank == 0:
        dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        for _ in range(2):
            addresses.put([str(a) for a in dht.get_visible_maddrs()])
    else:
        dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=addresses.get())
    averager = GroupAverager(
        [torch.ones(s) for s in SHAPES], dht, prefix="drop", state_provider=None, compression=CODECS["fp16"](),
        codec="fp16", data_plane="hivemind", min_matchmaking_time=2.0, request_timeout=3.0,
        allreduce_timeout=60.0, next_chunk_timeout=10.0, target_group_size=3, allow_state_sharing=False,
        start=True,
    )  # fmt: skip
    while not stop.value:
        barrier.wait(timeout=150)  # together into the round
        try:
            outcome: int | str = len(averager.step(weight=1.0, timeout=90, allow_retries=False))
        except Exception as error:  # noqa: BLE001 - reported to the test
            outcome = str(error)
        out.put((rank, outcome))
        names.put((rank, (averager.peer_id.to_base58(), averager.stalled())))
        barrier.wait(timeout=150)  # the test read the outcomes and said whether to go on
    averager.shutdown()
    dht.shutdown()


@pytest.mark.timeout(ATTEMPTS * 150 + 60)
def test_a_member_that_drops_out_of_the_all_reduce_fails_the_round_and_is_named():
    """swarm.butterfly: a member that gives up after the group formed (it never sends nor
    reduces) fails the round for the others within the senders' timeout, with why, and is named
    by the group's leader (or by the followers, if it led). Before, they waited on hivemind's
    reducer timeout and then on the missing member's post to the check, and failed only with
    "the members' check did not complete" (a 25 s stall in a private run)."""
    context = members_context()
    out, names, addresses = context.Queue(), context.Queue(), context.Queue()
    barrier, stop = context.Barrier(4), context.Value("b", 0)
    members = [
        context.Process(target=_dropping_member, args=(r, addresses, out, names, barrier, stop))
        for r in range(3)
    ]
    for m in members:
        m.start()
    rounds = []
    try:
        for _ in range(ATTEMPTS):  # until a group held all three: a group without member 2 averages
            barrier.wait(timeout=150)
            outcomes = dict(out.get(timeout=150) for _ in members)
            named = dict(names.get(timeout=150) for _ in members)  # (its id, whom it named)
            rounds.append(outcomes)
            tracebacks = [o for o in outcomes.values() if isinstance(o, str) and "Traceback" in o]
            stop.value = int(bool(tracebacks) or all(isinstance(outcomes[r], str) for r in range(2)))
            barrier.wait(timeout=150)
            if stop.value:
                break
    finally:
        stop.value = 1
        for m in members:
            m.join(timeout=30)
            if m.is_alive():
                m.kill()
    last = rounds[-1]
    assert all(isinstance(last[r], str) for r in range(2)), rounds  # a round with all three, failed
    for rank in range(2):
        assert "dropped out of hivemind's all-reduce" in last[rank], rounds
    assert "gave up" in last[2] or "group" in last[2], rounds
    # It sent nothing: the group's leader names it (swarm.butterfly.Stalls), or a follower that
    # it led; nobody names a member that took part.
    dropped, honest = named[2][0], {named[0][0], named[1][0]}
    assert any(dropped in named[r][1] for r in range(2)), (named, rounds)
    assert not honest & {*named[0][1], *named[1][1]}, (named, rounds)
