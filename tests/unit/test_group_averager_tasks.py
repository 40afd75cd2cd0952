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
