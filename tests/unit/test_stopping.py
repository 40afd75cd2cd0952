"""workbench.run.stopping: SIGTERM and SIGHUP stop like Ctrl+C; a shutdown under way is not cut short."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from workbench.run.stopping import not_interrupted, stopped_by_signals


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_raises_keyboard_interrupt_and_the_handler_is_restored(signum):
    before = signal.getsignal(signum)
    with pytest.raises(KeyboardInterrupt), stopped_by_signals():
        os.kill(os.getpid(), signum)
        time.sleep(1.0)  # the handler runs at the next bytecode
    assert signal.getsignal(signum) is before


def test_a_signal_during_a_shutdown_waits_until_it_is_done():
    finished = False
    with pytest.raises(KeyboardInterrupt), stopped_by_signals():
        with not_interrupted():
            os.kill(os.getpid(), signal.SIGHUP)  # the terminal closes while the peers are stopped
            time.sleep(0.2)
            finished = True
        time.sleep(1.0)
    assert finished


def test_an_interrupt_that_leaves_a_hivemind_lock_held_does_not_hang_the_shutdown():
    """A stop signal that lands inside ``multiprocessing``'s ``Lock.__enter__`` right after the
    acquire leaves the lock held (the ``with`` never began). For hivemind's ``SharedBytes``
    lock that hung the next MPFuture for ever: a peer's leaving announcement, its shutdown.
    Played for real (a timer's KeyboardInterrupt, while making MPFutures' shared bytes), then
    released the way a closing peer or session does."""
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    from swarm.dht import release_interrupted_locks

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
