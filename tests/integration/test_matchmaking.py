"""A peer that gives up on steps mid-matchmaking (it found the others past its round) still finds
its group in the rounds after: real GroupAverager processes, one per member, each with its own
DHT, their averager processes with an eager garbage collector. Before
the averager's event loop held its tasks (swarm.hivemind_fixes.keep_tasks_alive), the collector
destroyed hivemind's matchmaking clean-up ("Task was destroyed but it is pending!"); its locks
stayed held and that member never found a group again (seen as a late joiner left alone for the
rest of a run in test_late_joiner_downloads_state_and_matches). Without the fix this test
failed about 1 run in 3 when it was written, every round after the collection frozen; on
2026-12-07 it passed 5 of 5 without it: test_group_averager_tasks shows the mechanism
deterministically, and guards the fix."""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback

import pytest

from tests.processes import members_context

ROUNDS = 10
CANCELLED_PER_ROUND = 3
SETTLE = 3  # rounds after the cancellations stop


def _member(rank: int, barrier, addresses, ids, out) -> None:
    mp.set_start_method("fork", force=True)  # hivemind's averager forks
    import gc

    import torch
    from hivemind import DHT
    from hivemind.utils import get_dht_time

    from swarm.group_averager import GroupAverager

    # Both members: hivemind names its RPCs after the averager's class.
    class Collecting(GroupAverager):
        def run(self) -> None:  # the averager process: collect after every few allocations
            gc.set_threshold(5)
            super().run()

    torch.set_num_threads(1)
    try:
        if rank == 0:
            dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            addresses.put([str(a) for a in dht.get_visible_maddrs()])
        else:
            dht = DHT(
                start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=addresses.get(timeout=60)
            )
        averager = Collecting(
            [torch.randn(1000)],
            dht,
            prefix="cancelled",
            state_provider=None,
            min_matchmaking_time=0.5,
            request_timeout=3.0,
            allreduce_timeout=30.0,
            allow_state_sharing=False,
            data_plane="direct",
            start=True,
        )
        ids[rank] = averager.peer_id.to_base58()
        barrier.wait(timeout=60)
        other = [ids[1 - rank]]

        def step():  # as a peer's round asks for one (swarm.averaging: no retries, its mate expected)
            return averager.step(
                wait=False,
                allow_retries=False,
                expected=other,
                scheduled_time=get_dht_time() + 1.0,
                timeout=10,
            )

        sizes = []
        for round_ in range(ROUNDS + SETTLE):
            if rank == 0 and round_ < ROUNDS:  # steps given up on mid-matchmaking
                for _ in range(CANCELLED_PER_ROUND):
                    control = step()
                    time.sleep(0.3)
                    control.cancel()
                    time.sleep(0.05)
            barrier.wait(timeout=60)
            control = step()
            try:
                sizes.append(len(control.result(timeout=20)))
            except Exception as error:  # noqa: BLE001 - no group: counted as such
                print(f"member {rank}: no group: {error!r}", flush=True)
                sizes.append(0)
        out.put((rank, sizes))
        barrier.wait(timeout=60)
        averager.shutdown()
        dht.shutdown()
    except BaseException:  # the whole traceback, for the test's failure message
        out.put((rank, traceback.format_exc()))
        raise


def test_a_member_that_cancelled_steps_mid_matchmaking_still_finds_its_group():
    context = members_context()
    barrier, addresses, out = context.Barrier(2), context.Queue(), context.Queue()
    with context.Manager() as manager:
        ids = manager.dict()
        members = [context.Process(target=_member, args=(r, barrier, addresses, ids, out)) for r in range(2)]
        for member in members:
            member.start()
        try:
            # A frozen member spends ~21 s a round (its steps time out): 13 rounds, then say so.
            results = dict(out.get(timeout=420) for _ in members)
        finally:
            for member in members:
                member.join(timeout=30)
                if member.is_alive():
                    member.kill()
    for rank, sizes in results.items():
        if not isinstance(sizes, list):  # (pytest cuts a long assertion message)
            pytest.fail(f"member {rank} failed:\n{sizes}", pytrace=False)
        # A round with cancellations fails now and then (1 in 5 to 25 here, every other round
        # beside three busy loops): this member's hivemind formed the group for a step it had just
        # cancelled (the cancel reaches the averager process after the group formed), so its new
        # step finds nobody; it declines that group's ring and the other member fails at once
        # (MemberDeclined; it used to wait 6 s). Under load that race can be lost round after
        # round, which the old check (the last three rounds did not all fail) took for a frozen
        # matchmaking (2 of 3 runs beside three busy loops; the sizes alternated 2, 0, 2, 0 and
        # then failed five running). A frozen matchmaking fails every round after it, the rounds
        # with no step cancelled too: those do not all fail. (13 of 13 runs passed beside three
        # and four busy loops. Without keep_tasks_alive this test, old check or new, passed 5 of
        # 5 here: test_group_averager_tasks shows that mechanism deterministically.)
        assert any(size == 2 for size in sizes[ROUNDS:]), f"{results}"
