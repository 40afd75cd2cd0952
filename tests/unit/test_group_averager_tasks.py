"""hivemind's averager process awaits futures that nothing else holds (an ``MPFuture`` the DHT
answers from its own process is held weakly there) in tasks it keeps no reference to, and asyncio
holds only weak references to tasks: the garbage collector destroyed such tasks mid-flight ("Task
was destroyed but it is pending!"). In matchmaking's clean-up that left hivemind's locks held and
the peer never looked for a group again. The averager process's loop now holds its tasks
(swarm.hivemind_fixes.keep_tasks_alive)."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import weakref
from types import SimpleNamespace

import pytest

from swarm.group_averager import GroupAverager
from swarm.hivemind_fixes import keep_tasks_alive


def _a_cleanup_awaiting_a_weakly_held_future(
    keep: bool, loop: asyncio.AbstractEventLoop
) -> tuple[bool, bool]:
    """A cancelled matchmaking's clean-up, as hivemind's is: a task that holds a lock and, in a
    ``finally``, awaits a future that its producer holds only weakly (an ``MPFuture``), then
    awaits more on its way out. After a collection, the producer answers if it still can;
    (answered, the lock was released). A destroyed task's coroutine is closed: the ``await`` in
    the outer ``finally`` ignores the close, so the lock's exit never runs."""
    produced: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    lock = asyncio.Lock()

    async def clean_up() -> None:
        async with lock:  # begin_search's lock_search
            try:
                try:
                    await asyncio.sleep(3600)  # matchmaking, until cancelled
                finally:  # _declare_averager_periodically's
                    answer = loop.create_future()
                    produced["store"] = answer
                    await answer  # the DHT's "no longer looking" store
            finally:  # begin_search's: cancel_and_wait(update_queue_task)
                await asyncio.sleep(0)

    async def main() -> tuple[bool, bool]:
        if keep:
            keep_tasks_alive(asyncio.get_running_loop())
        task = asyncio.create_task(clean_up())  # hivemind keeps no reference either
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0)
        del task
        gc.collect()
        answer = produced.get("store")
        if answer is not None:
            answer.set_result(None)
        for _ in range(3):
            await asyncio.sleep(0)
        return answer is not None, not lock.locked()

    return loop.run_until_complete(main())


# The unkept half shows the bug: the destroyed coroutine's "coroutine ignored GeneratorExit".
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_a_loop_that_keeps_its_tasks_lets_a_cancelled_cleanup_finish_and_release_its_lock(kind):
    make = asyncio.new_event_loop if kind == "asyncio" else pytest.importorskip("uvloop").new_event_loop
    for keep in (False, True):
        loop = make()
        try:
            answered, released = _a_cleanup_awaiting_a_weakly_held_future(keep, loop)
        finally:
            loop.close()
        if keep:
            assert answered and released, "the loop held the task: the clean-up ends, the lock is free"
        else:  # the hivemind bug, shown: the task was destroyed and the lock stays held for ever
            assert not answered and not released


@pytest.mark.parametrize("module", ["hivemind.averaging.averager", "hivemind.dht.dht"])
def test_hivemind_s_averager_and_dht_processes_make_their_loops_through_the_patched_switch(module):
    """GroupAverager's and QuietDHT's processes install the keeper before hivemind makes their
    event loop (in a child, as there: ``switch_to_uvloop`` replaces this process's event loop
    policy)."""
    code = (
        "import importlib\n"
        "from swarm.hivemind_fixes import install_task_keeper\n"
        f"install_task_keeper({module!r}); install_task_keeper({module!r})\n"
        f"loop = importlib.import_module({module!r}).switch_to_uvloop()\n"
        "print(type(loop).__module__, loop.get_task_factory() is not None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["uvloop", "True"], out.stdout + out.stderr


async def _loop_keeps_tasks(dht, node) -> bool:
    return asyncio.get_running_loop().get_task_factory() is not None


def test_a_peer_s_dht_process_runs_on_a_loop_that_keeps_its_tasks():
    from swarm.dht import _quiet_dht_class

    dht = _quiet_dht_class()(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        assert dht.run_coroutine(_loop_keeps_tasks) is True
    finally:
        dht.shutdown()


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


def test_a_shutdown_after_the_p2p_daemon_died_still_cancels_its_groups_without_a_traceback():
    """Ctrl+C reaches the whole terminal's process group: the p2p daemon may end before the
    averager removes its handlers (FileNotFoundError, its socket gone), a traceback from the
    averager's thread in 2 of 5 tries of a user's audit."""

    async def gone(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory")

    async def main() -> dict:
        loop = asyncio.get_running_loop()
        groups = {b"waiting": loop.create_future()}
        averager = SimpleNamespace(
            client_mode=False, _running_groups=groups, _p2p=None, prefix="p", remove_p2p_handlers=gone
        )
        await GroupAverager._shutdown(averager, 5.0)
        return groups

    assert asyncio.run(main())[b"waiting"].cancelled()


def _a_caller_gone_before_the_runner(handler) -> tuple[bool, list]:
    """A member's parts arrive while this member's runner is not made yet (it is still
    sketching its tensors), and the member then gives up: its stream closes and the handler is
    cancelled. (Whether the group's future was cancelled too, what a handler for a direct-plane
    group answers.)"""
    from hivemind.proto import averaging_pb2

    async def main() -> tuple[bool, list]:
        loop = asyncio.get_running_loop()
        registered = asyncio.Event()
        registered.set()
        groups = {b"waiting": loop.create_future(), b"direct": loop.create_future()}
        groups[b"direct"].set_result(None)
        averager = SimpleNamespace(_running_groups=groups, _pending_groups_registered=registered)

        async def parts(group_id: bytes):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=group_id)
            await asyncio.sleep(3600)

        async def read(group_id: bytes) -> list:
            return [m async for m in handler(averager, parts(group_id), None)]

        waiting = asyncio.create_task(read(b"waiting"))
        await asyncio.sleep(0.05)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        try:
            direct = await asyncio.wait_for(read(b"direct"), 5)
        except AttributeError:  # hivemind's: the runner it found is None
            direct = ["AttributeError"]
        return groups[b"waiting"].cancelled(), direct

    return asyncio.run(main())


def test_hivemind_s_handler_cancels_the_group_when_its_caller_goes():
    from hivemind.averaging import DecentralizedAverager

    cancelled, _ = _a_caller_gone_before_the_runner(DecentralizedAverager.rpc_aggregate_part)
    assert cancelled, "hivemind's handler no longer cancels the group: GroupAverager's may go"


def test_a_caller_that_goes_leaves_the_group_for_this_member_s_runner():
    """Seen as "Unable to run All-Reduce: invalid state" on a member whose groupmate gave up
    first (swarm.group_averager.GroupAverager.rpc_aggregate_part)."""
    from hivemind.proto import averaging_pb2

    cancelled, direct = _a_caller_gone_before_the_runner(GroupAverager.rpc_aggregate_part)
    assert not cancelled
    assert [m.code for m in direct] == [averaging_pb2.BAD_GROUP_ID]


def test_the_handler_is_served_as_hivemind_s_streamed_rpc():
    """hivemind reads an RPC's streams from its annotations (typing's ``AsyncIterator``): an
    averager whose override lacks them does not start."""
    from hivemind.averaging import DecentralizedAverager

    def handler(cls) -> tuple:
        cls._collect_rpc_handlers()
        found = next(h for h in cls._rpc_handlers if h.method_name == "rpc_aggregate_part")
        return found.request_type, found.response_type, found.stream_input, found.stream_output

    assert handler(GroupAverager) == handler(DecentralizedAverager)


def test_a_member_alone_in_matchmaking_searches_the_dht_for_leaders_at_a_bounded_pace():
    """hivemind's matchmaking, with nobody to join (a round mate killed after the barrier counted
    it in): its leader search asked the DHT again as soon as a search found nobody, as fast as
    the DHT answered, for the step's whole timeout (the survivor's averager and DHT processes at
    0.4 of a core each; with ``latest=True`` every search is a network lookup). Paced
    (swarm.hivemind_fixes: ``LEADER_SEARCH_PERIOD``): about one search per period. hivemind's
    own search, a DHT that answers at once."""
    import contextlib

    from hivemind.averaging.key_manager import GroupKeyManager
    from hivemind.averaging.matchmaking import PotentialLeaders
    from hivemind.p2p import PeerID

    from swarm.hivemind_fixes import LEADER_SEARCH_PERIOD

    class NobodyDeclared:  # the DHT as the survivor sees it
        peer_id = PeerID(b"survivor")
        searches = 0

        async def get(self, key, latest, return_future):
            self.searches += 1
            return None

    dht = NobodyDeclared()
    keys = GroupKeyManager(dht, "run", "", target_group_size=None)
    seconds = 1.0

    async def matchmaking() -> None:
        leaders = PotentialLeaders(dht.peer_id, min_matchmaking_time=1.0, target_group_size=None)
        async with leaders.begin_search(SimpleNamespace(deadline=None), keys, declare=False):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(leaders.pop_next_leader(), seconds)

    asyncio.run(matchmaking())
    assert 1 <= dht.searches <= seconds / LEADER_SEARCH_PERIOD + 2, dht.searches


def test_a_step_whose_leader_broke_the_pipe_leaves_no_unretrieved_task_error(monkeypatch):
    """A leader killed while this peer's join request read its answer raised BrokenPipeError,
    which hivemind does not retry: it set the step's exception, then raised it again into a task
    nobody awaits, and asyncio printed "Task exception was never retrieved" with a traceback into
    the peer's log (the churn soak, stop 58). The step carries the error; the task ends quietly."""
    import asyncio

    from hivemind.averaging import DecentralizedAverager

    async def broken(self, **kwargs):  # type: ignore[no-untyped-def]
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(DecentralizedAverager, "_step", broken)

    averager = _bare_for_step(plane=False, leader_assemble_group=None)
    averager._no_shows.value = b"an earlier step's"  # (unread: not blamed on this step's)
    averager._stalled.value = b"an earlier step's"
    assert asyncio.run(averager._step(step=None)) is None
    assert averager._no_shows.value == averager._stalled.value == b""


def test_a_group_formed_as_its_step_was_given_up_on_is_offered_to_be_declined(monkeypatch):
    """hivemind forms a group, then sends the leader's followers away before its look for a group
    returns; a step cancelled then never offered its group to the ring. A leader never opened its
    board (its followers waited 10 s and blamed it), a follower never declined (its leader blamed
    it): a review, 2026-12-06. The group is offered all the same, and the ring declines it."""
    import asyncio
    import contextlib
    import multiprocessing as mp
    from collections import OrderedDict
    from types import SimpleNamespace

    from hivemind.averaging import DecentralizedAverager

    group = SimpleNamespace(group_id=b"formed", peer_ids=())

    async def stepping(self, **kwargs):  # type: ignore[no-untyped-def]
        looking = asyncio.ensure_future(self._matchmaking.look_for_group("the step"))
        await asyncio.sleep(0.1)
        looking.cancel()  # the step, given up on
        with contextlib.suppress(asyncio.CancelledError):
            await looking

    monkeypatch.setattr(DecentralizedAverager, "_step", stepping)

    async def leader_assemble_group():  # type: ignore[no-untyped-def]
        return group

    async def look_for_group(step):  # type: ignore[no-untyped-def]
        await averager._matchmaking.leader_assemble_group()
        await asyncio.sleep(60)  # sending the followers away

    averager = _bare_for_step(
        plane=True, peer_id="me", leader_assemble_group=leader_assemble_group, look_for_group=look_for_group
    )
    averager._leaders, averager._posted, averager._formed = OrderedDict(), OrderedDict(), None
    averager._outcomes_in, _ = mp.Pipe(duplex=False)
    offered: list = []
    averager._offer = lambda group_info, step: offered.append((group_info, step))
    asyncio.run(averager._step(step=None))
    assert offered == [(group, "the step")]  # (old code: never offered)


def _bare_for_step(*, plane: bool, **matchmaking):  # type: ignore[no-untyped-def]
    """A GroupAverager with what its ``_step`` reads, no process or DHT (``matchmaking``: its
    hivemind matchmaking's attributes, beyond those every step reads)."""
    import multiprocessing as mp
    from types import SimpleNamespace

    from swarm.group_averager import GroupAverager

    class Bare(GroupAverager):
        peer_id = "me"

        def __del__(self) -> None:  # no process was started
            pass

    averager = object.__new__(Bare)
    averager._matchmaking = SimpleNamespace(
        target_group_size=None,
        group_key_manager=None,
        _check_reasons_to_reject=None,
        _servicer_type=None,
        follower_assemble_group=None,
        **matchmaking,
    )
    averager._donor_subkey, averager._ticket_loop = None, None
    averager._expected, averager._plane_enabled = mp.Array("c", 64), SimpleNamespace(value=int(plane))
    averager._allowed, averager._silent, averager._silent_ids = mp.Array("c", 64), mp.Array("c", 64), set()
    averager._no_shows, averager._decliners = mp.Array("c", 64), mp.Array("c", 64)
    averager._stalled = mp.Array("c", 64)
    return averager
