"""hivemind's averager process starts each request as a task it keeps no reference to; ours
keep themselves referenced (GroupAverager._keep_running), or the garbage collector may destroy
a step mid-flight and its round mates wait for it until their timeout."""

from __future__ import annotations

import asyncio
import gc
import weakref
from types import SimpleNamespace

from swarm.group_averager import GroupAverager


def test_a_request_that_keeps_itself_running_survives_the_garbage_collector():
    holder = SimpleNamespace(_running=set())

    async def request(keep: bool) -> None:
        if keep:
            GroupAverager._keep_running(holder)
        await asyncio.get_running_loop().create_future()  # waits on what only it references

    async def main() -> tuple[bool, bool]:
        # As hivemind's _run_internal does: create_task, keep no reference.
        refs = {keep: weakref.ref(asyncio.create_task(request(keep))) for keep in (False, True)}
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()
        destroyed, alive = refs[False]() is None, refs[True]() is not None
        for task in list(holder._running):
            task.cancel()
        await asyncio.sleep(0)
        return destroyed, alive

    destroyed, alive = asyncio.run(main())
    assert destroyed, "without a reference the pending task was collected (the hivemind bug)"
    assert alive, "a task that keeps itself running is not"


class Runner:
    """An all-reduce runner as hivemind registers it: finalize cancels it for its peers."""

    def __init__(self) -> None:
        self.cancelled = False

    def finalize(self, *, cancel: bool = False) -> None:
        self.cancelled = cancel


def _averager_stopped_mid_round(shutdown) -> tuple[dict, Runner]:
    """``shutdown(averager, timeout)`` with three groups registered: one waiting for its runner,
    one running, one that the direct plane finished (its future holds None)."""
    runner = Runner()

    async def main() -> dict:
        loop = asyncio.get_running_loop()
        groups = {
            b"waiting": loop.create_future(),
            b"running": loop.create_future(),
            b"direct": loop.create_future(),
        }
        groups[b"running"].set_result(runner)
        groups[b"direct"].set_result(None)
        await shutdown(SimpleNamespace(client_mode=True, _running_groups=groups), 5.0)
        return groups

    return asyncio.run(main()), runner


def test_hivemind_s_own_shutdown_crashes_on_a_registered_group():
    from hivemind.averaging import DecentralizedAverager

    try:
        _averager_stopped_mid_round(DecentralizedAverager._shutdown)
    except AttributeError as error:  # the traceback a peer stopped mid-round printed
        assert "finalize" in str(error)
    else:
        raise AssertionError("hivemind's _shutdown no longer crashes: GroupAverager._shutdown may go")


def test_a_shutdown_mid_round_cancels_the_running_all_reduce_and_the_waiting_group():
    groups, runner = _averager_stopped_mid_round(GroupAverager._shutdown)
    assert groups[b"waiting"].cancelled()
    assert runner.cancelled
    assert groups[b"direct"].result() is None
