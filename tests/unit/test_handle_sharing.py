"""A peer stopped with its process group must not print a child's death as a traceback.

hivemind hands shared-memory tensors between a peer and its children every round; torch sends
their file descriptors through multiprocessing's resource sharer, a thread in the sending
process. CI once caught that thread printing ``ConnectionResetError`` when SIGTERM reached a
receiving child mid-handshake (tests/integration/test_trust.py). Here the same reset is made on
purpose, in a fresh interpreter, with and without the peer's process setup."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest

_RECEIVER_DIES = textwrap.dedent(
    """
    import os, socket, sys, time
    from multiprocessing import resource_sharer

    if sys.argv[1] == "peer":
        from swarm.dht import quiet_children

        with quiet_children():  # what a peer does before hivemind forks its DHT and averager
            pass
    read_end, _ = os.pipe()
    resource_sharer.DupFd(read_end)  # a descriptor offered to another process, as torch does
    receiver = socket.socket(socket.AF_UNIX)
    receiver.connect(resource_sharer._resource_sharer._address)
    receiver.recv(1, socket.MSG_PEEK)  # the sharer has sent its challenge
    receiver.close()  # ... and the receiver dies without answering
    time.sleep(0.5)
    sys.excepthook(ValueError, ValueError("any other error still shows"), None)
    """
)


@pytest.mark.parametrize("setup", ["bare", "peer"])
def test_a_receiver_dying_mid_handshake_prints_no_traceback_in_a_peer(setup):
    run = subprocess.run(
        [sys.executable, "-c", _RECEIVER_DIES, setup], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert "any other error still shows" in run.stderr
    if setup == "bare":  # the stdlib's own behaviour, which the peer's setup quiets
        assert "ConnectionResetError" in run.stderr and "resource_sharer" in run.stderr
    else:
        assert "Traceback" not in run.stderr and "ConnectionResetError" not in run.stderr, run.stderr


def test_hivemind_clean_up_noise_stays_out_of_the_log_but_a_destroyed_task_shows(caplog):
    """What a peer resumed after a long suspend printed as errors (seen in the overlapped
    straggler scenario): an async generator closed twice in hivemind's clean-up (noise: to the
    debug log), and matchmaking tasks destroyed pending. Those are shown: they froze the peer's
    matchmaking until the averager process's loop kept its tasks (test_group_averager_tasks).
    And a cancelled all-reduce's future, holding the cancellation nobody read (``make faults``,
    hivemind's path): noise; a future's own exception is shown."""
    import logging

    from swarm.dht import quiet_children

    with quiet_children():
        pass
    log = logging.getLogger("asyncio")
    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        log.error(
            "Task was destroyed but it is pending!\ntask: <Task cancelling name='Task-8443' coro=<DecentralizedAverager"
            "._step.<locals>.find_peers_or_notify_cancel() done, defined at .../hivemind/averaging/averager.py:427>>"
        )
        log.error(
            "Task exception was never retrieved\nfuture: <Task finished name='Task-8519' coro=<<async_generator_athrow"
            " without __name__>()> exception=RuntimeError('aclose(): asynchronous generator is already running')>"
        )
        log.error(  # hivemind's all-reduce, cancelled: its future holds the cancellation
            "Future exception was never retrieved\nfuture: <Future finished exception=CancelledError()>",
            exc_info=(asyncio.CancelledError, asyncio.CancelledError(), None),
        )
        log.error(
            "Future exception was never retrieved\nfuture: <Future finished exception=ValueError('mine')>"
        )
        log.error("Task was destroyed but it is pending!\ntask: <Task pending coro=<my_own_code()>>")
    shown = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert len(shown) == 3 and sum(text.startswith("Task was destroyed") for text in shown) == 2, shown
    assert "ValueError('mine')" in shown[1]  # a future's own exception is still shown
