"""workbench.run.stopping: SIGTERM and SIGHUP stop like Ctrl+C; a shutdown under way is not cut short."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from workbench.run.stopping import LAUNCHER_PID, not_interrupted, stop_with_launcher, stopped_by_signals


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_raises_keyboard_interrupt_and_the_handler_is_restored(signum):
    before = signal.getsignal(signum)
    with pytest.raises(KeyboardInterrupt), stopped_by_signals():
        os.kill(os.getpid(), signum)
        time.sleep(1.0)  # the handler runs at the next bytecode
    assert signal.getsignal(signum) is before


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_stop_signal_lost_in_a_destructor_is_raised_at_the_next_check():
    """A Ctrl+C that landed in a ``__del__`` (a garbage collection) was printed as "Exception
    ignored" and lost: the peer trained on alone for good (a `make test` run, stop 62). The
    peer's loop checks for one (:func:`raise_if_stopped`): raised once, and not again once the
    stop is under way."""
    from workbench.run import stopping

    class Collected:
        def __del__(self) -> None:
            time.sleep(1.0)  # the signal lands here

    stopping._pending.clear()
    stopping._under_way.clear()
    try:
        with stopped_by_signals():
            thing = Collected()
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
            del thing  # KeyboardInterrupt inside __del__: printed, ignored (pytest: a warning)
            with pytest.raises(KeyboardInterrupt):
                stopping.raise_if_stopped()
            stopping.raise_if_stopped()  # once
            stopping.stopping_now()
            stopping._pending.set()  # a second Ctrl+C while the stop is under way: not raised here
            stopping.raise_if_stopped()
    finally:
        stopping._pending.clear()
        stopping._under_way.clear()


def test_a_signal_during_a_shutdown_waits_until_it_is_done():
    finished = False
    with pytest.raises(KeyboardInterrupt), stopped_by_signals():
        with not_interrupted():
            os.kill(os.getpid(), signal.SIGHUP)  # the terminal closes while the peers are stopped
            time.sleep(0.2)
            finished = True
        time.sleep(1.0)
    assert finished


def test_an_interrupt_that_leaves_a_hivemind_lock_held_does_not_hang_the_shutdown(monkeypatch):
    """A stop signal that lands inside ``multiprocessing``'s ``Lock.__enter__`` right after the
    acquire leaves the lock held (the ``with`` never began). For hivemind's ``SharedBytes``
    lock that hung the next MPFuture for ever: a peer's leaving announcement, its shutdown.
    Played for real (a timer's KeyboardInterrupt, while making MPFutures' shared bytes), then
    released the way a closing peer or session does."""
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    from swarm import hivemind_fixes
    from swarm.dht import release_interrupted_locks

    # An earlier test of this process may have called the peer's "stopping": its bounded wait
    # would let the thread below through before the release does.
    monkeypatch.setattr(hivemind_fixes, "LOCK_WAIT", 60.0)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    # A CPU-time timer (SIGVTALRM): pytest-timeout has SIGALRM.
    previous = signal.signal(signal.SIGVTALRM, interrupt)
    try:
        for attempt in range(5000):
            signal.setitimer(signal.ITIMER_VIRTUAL, 0.0005 + 0.00001 * (attempt % 200))
            until = time.monotonic() + 0.2  # an interrupt raised in a gc callback is lost
            try:
                while time.monotonic() < until:
                    SharedBytes.next()
                signal.setitimer(signal.ITIMER_VIRTUAL, 0)  # (inside: it may fire until here)
            except KeyboardInterrupt:
                pass
            if SharedBytes._lock._semlock._is_mine():
                break
        else:
            pytest.skip("this Python's Lock.__enter__ no longer leaks the lock on an interrupt")
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, previous)
    made = threading.Thread(target=MPFuture, daemon=True)  # what the leaving announcement does
    made.start()
    made.join(1.0)
    assert made.is_alive()  # held: it waits (for ever, without the release)
    assert release_interrupted_locks() == ["SharedBytes._lock"]
    made.join(5.0)
    assert not made.is_alive()
    assert release_interrupted_locks() == []  # nothing held: nothing released


_A_PROCESS_DIES_HOLDING_A_LOCK = """
import multiprocessing as mp, os, sys, threading, time
import swarm.hivemind_fixes
from hivemind.utils.mpfuture import MPFuture, SharedBytes

which, how, wait = sys.argv[1], sys.argv[2], float(sys.argv[3])
owner, name = {"update": (MPFuture, "_update_lock"), "shared": (SharedBytes, "_lock")}[which]
if how == "unpatched":
    setattr(owner, name, getattr(owner, name)._lock)
if how != "running":
    swarm.hivemind_fixes.stopping()  # a peer stopping: SIGHUP to the group
future = MPFuture()  # this process's
fork = mp.get_context("fork")
held = getattr(getattr(owner, name), "_lock", getattr(owner, name))  # the lock itself
dies = fork.Process(target=lambda: (held.acquire(), os._exit(0)))
dies.start()  # as the DHT or averager process ending mid-update (SIGHUP to the group)
dies.join()
started = time.monotonic()
if which == "update":  # as the peer cancelling its step while it stops
    sets = fork.Process(target=future.set_result, args=(7,))
    sets.start()
    try:
        print(future.result(timeout=wait), round(time.monotonic() - started), flush=True)
    finally:
        sets.kill()
else:  # as the peer announcing that it leaves (a DHT store: a new future)
    made = []
    maker = threading.Thread(target=lambda: made.append(MPFuture()), daemon=True)
    maker.start()
    maker.join(wait)
    assert made, "TimeoutError: no MPFuture made"
    print(7, round(time.monotonic() - started), flush=True)
"""


@pytest.mark.parametrize("which", ["update", "shared"])
@pytest.mark.parametrize("lock", ["patched", "unpatched", "running"])
def test_a_process_that_ends_holding_a_hivemind_lock_does_not_hang_the_others(which, lock):
    """hivemind's MPFutures share locks across the peer's processes; SIGHUP to the peer's
    process group ended its averager while it held the update lock, and the peer, cancelling
    its averaging step as it stopped, waited for it for ever (``make faults``: still running
    30 s after the signal); the lock for a future's shared state is shared the same way (the
    peer's leaving announcement makes a future). A stopping process's waits are bounded now;
    hivemind's own locks wait for ever (unpatched, so that this test can tell), and so does a
    process still running (going on without the lock there could interleave two processes'
    messages in one pipe), saying so."""
    import subprocess
    import sys

    from swarm.hivemind_fixes import LOCK_WAIT

    # Long enough for a running process to say that it waits (at LOCK_WAIT), and no longer: a
    # wait for ever is told by the TimeoutError.
    wait = {"patched": 30, "unpatched": 1, "running": LOCK_WAIT + 1}[lock]
    done = subprocess.run(
        [sys.executable, "-c", _A_PROCESS_DIES_HOLDING_A_LOCK, which, lock, str(wait)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if lock != "patched":
        assert done.returncode != 0 and "TimeoutError" in done.stderr, (done.stdout, done.stderr)
        assert ("held by another process" in done.stderr) == (lock == "running"), done.stderr
        return
    assert done.returncode == 0, done.stderr
    result, seconds = done.stdout.split()
    assert result == "7" and int(seconds) <= LOCK_WAIT + 5, done.stdout
    assert "stayed held for" in done.stderr


_SIGNALS_WHILE_THE_SHM_MANAGER_STARTS = """
import os, signal, subprocess, sys, time
import hivemind  # noqa: F401  (tensors are shared by file name from here on)

handled = []
signal.signal(signal.SIGINT, lambda *a: handled.append(1))  # a handler in Python, as a peer's
storm = subprocess.Popen(["bash", "-c", f"while kill -INT {os.getpid()} 2>/dev/null; do sleep 0.002; done"])
deadline = time.monotonic() + 30
while not handled and time.monotonic() < deadline:  # the storm is on (bash takes its time under load)
    time.sleep(0.01)
from swarm.dht import start_shm_manager

start_shm_manager()
storm.kill()
print("manager up;", len(handled) > 0, flush=True)
"""


def test_signals_while_torch_starts_its_shared_memory_manager_do_not_hang_the_peer():
    """torch waits for its shm manager's handle in a read() that a signal turns into an endless
    loop at 100% CPU (a Ctrl+C 2 s into a peer's start hung it). Ctrl+C arrives every 2 ms here,
    as torch starts the manager: it comes up, and the signals reach the handler afterwards.
    (The same with ``torch.empty(1).share_memory_()`` in place of ``start_shm_manager()`` never
    returns.)"""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _SIGNALS_WHILE_THE_SHM_MANAGER_STARTS],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "manager up; True", done.stdout


def test_only_a_peer_whose_parent_is_the_lab_watches_it(monkeypatch):
    """WORKBENCH_LAUNCHER_PID is inherited by whatever a peer starts: a process watches the lab
    only if the lab is its parent, and a live lab that is not its parent is left alone."""
    for value in ("", "x", str(os.getpid())):
        monkeypatch.setenv(LAUNCHER_PID, value)
        stop_with_launcher()
        assert not any(t.name == "launcher-watch" for t in threading.enumerate()), value


def test_a_peer_whose_lab_died_before_it_watched_stops_at_once() -> None:
    """A demo killed with SIGKILL half a second into its peers' start: a peer orphaned before
    its watch began found its parent was not the lab and did nothing, then trained on its own
    for good (a review, 2026-12-06). A lab that is gone stops it at once, saying why."""
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    peer = subprocess.run(
        [
            sys.executable,
            "-c",
            "import time; from workbench.run.stopping import stop_with_launcher; "
            "stop_with_launcher(); time.sleep(30)",
        ],
        env={**os.environ, LAUNCHER_PID: str(gone.pid)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert peer.returncode == -signal.SIGTERM, (peer.returncode, peer.stderr)
    assert f"the lab that started this peer (pid {gone.pid}) is gone: stopping" in peer.stderr


_A_SHM_MANAGER_THAT_NEVER_ANSWERS = """
import time
import hivemind  # noqa: F401  (tensors are shared by file name from here on)
import torch
import swarm.dht

torch.Tensor.share_memory_ = lambda self: time.sleep(600)  # as torch waiting on a manager that never answers
swarm.dht.SHM_MANAGER_DEADLINE = 1.0
swarm.dht.start_shm_manager()
print("returned", flush=True)
"""


def test_a_shared_memory_manager_that_never_answers_ends_the_process_saying_where() -> None:
    """torch's manager once had not answered a ``workbench status`` 60 s after it was started,
    and with Ctrl+C, SIGTERM and SIGHUP held during that wait the process could only be killed.
    Past the deadline the process ends with status 1, every thread's stack on stderr naming
    ``start_shm_manager``; it neither returns as if the manager were up nor hangs."""
    import subprocess
    import sys

    done = subprocess.run(  # a hang fails here
        [sys.executable, "-c", _A_SHM_MANAGER_THAT_NEVER_ANSWERS],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "returned" not in done.stdout
    assert "Timeout" in done.stderr and "in start_shm_manager" in done.stderr, done.stderr


def test_a_lock_taken_as_lost_while_stopping_is_waited_for_as_any_once_running_again(monkeypatch, caplog):
    """A lock taken as lost as the process stopped stayed lost when it ran again (a notebook's
    next session): every wait on it then tried every 0.1 s, with a warning each time claiming
    2 s more (a review, stop 72)."""
    import multiprocessing as mp
    import threading

    from swarm import hivemind_fixes

    monkeypatch.setattr(hivemind_fixes, "LOCK_WAIT", 0.2)
    monkeypatch.setattr(hivemind_fixes, "LOST_LOCK_WAIT", 0.02)
    dead = mp.Lock()
    dead.acquire()  # its holder ended holding it
    lock = hivemind_fixes._BoundedLock(dead, "x")
    try:
        hivemind_fixes.stopping()
        with lock:
            pass
        assert lock.lost
    finally:
        hivemind_fixes.stopping(False)
    live = mp.Lock()
    lock._lock = live
    live.acquire()
    threading.Timer(0.3, live.release).start()  # a live holder, 0.3 s
    caplog.set_level("WARNING", logger="swarm.hivemind_fixes")
    caplog.clear()
    with lock:
        pass
    assert not lock.lost and len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
