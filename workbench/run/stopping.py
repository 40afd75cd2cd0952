"""How a workbench process is told to stop: Ctrl+C (SIGINT), a service manager or `timeout`
(SIGTERM), a closed terminal or SSH session (SIGHUP). All three raise KeyboardInterrupt in
the main thread, so one ``except KeyboardInterrupt`` path stops cleanly: a peer announces
leaving and shuts its child processes down, the demo stops every peer it started."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

STOP_SIGNALS = tuple(s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


_pending = threading.Event()
"""Set when a stop signal arrived, until the stop is under way (:func:`stopping_now`)."""
_under_way = threading.Event()
"""Set once the stop is under way: a later signal (a second Ctrl+C) is not raised again here."""


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    _pending.set()
    raise KeyboardInterrupt


def raise_if_stopped() -> None:
    """Raise the KeyboardInterrupt of a stop signal that arrived and was lost: raised inside a
    destructor (``__del__``, a garbage collection), Python prints "Exception ignored" and goes
    on. A peer interrupted so trained on alone for good (500 rounds, past `make test`'s 60 s
    wait for it to stop). Called where the peer's main loop passes often (a heartbeat, an inner
    step); once raised, not again."""
    if (
        _pending.is_set()
        and not _under_way.is_set()
        and threading.current_thread() is threading.main_thread()
    ):
        _pending.clear()
        raise KeyboardInterrupt


def stopping_now() -> None:
    """The stop signal was caught and the stop is under way: nothing left to raise again."""
    _under_way.set()
    _pending.clear()


@contextlib.contextmanager
def stopped_by_signals() -> Iterator[None]:
    """Within: SIGINT, SIGTERM and SIGHUP raise KeyboardInterrupt (restored on exit), and one
    lost in a destructor is raised again (:func:`raise_if_stopped`). A process started in the
    background of a non-interactive shell ignores SIGINT: take it back."""
    previous = {s: signal.signal(s, _raise_keyboard_interrupt) for s in (signal.SIGINT, *STOP_SIGNALS)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def not_interrupted(*, deliver: bool = True) -> Iterator[None]:
    """Within: Ctrl+C, SIGTERM and SIGHUP are held back and delivered on exit (``deliver``;
    else dropped: a stop already under way for another reason), so that a shutdown already
    under way (stopping the demo's peers) is not cut short by a second signal, such as the
    terminal closing a few seconds after `q`. (Python runs signal handlers in the main thread
    whichever thread the kernel picked, so the handlers are swapped rather than the signal
    mask.) Only the main thread may change handlers: elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    held = (signal.SIGINT, *STOP_SIGNALS)
    previous = {s: signal.signal(s, lambda signum, frame: arrived.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if arrived and deliver:
            signal.raise_signal(arrived[0])  # now handled as it would have been


LAUNCHER_PID = "WORKBENCH_LAUNCHER_PID"
"""Set by the local lab (:mod:`workbench.local.launch`) in each peer it starts: its own pid."""


def stop_with_launcher(poll: float = 0.5) -> None:
    """In a peer the local lab started (the demo, a notebook's ``Experiment``): stop as on
    SIGTERM once the lab is gone, however it ended. The lab starts each peer in a session of
    its own, so that Ctrl+C in its terminal reaches the lab only, which then stops the peers in
    order; a lab killed with SIGKILL, by the OOM killer or with its notebook kernel restarted
    left them training on their own for good. Watched from a daemon thread (the parent pid
    changes when a process is orphaned); a no-op unless the lab that set :data:`LAUNCHER_PID`
    is this process's parent."""
    value = os.environ.get(LAUNCHER_PID, "")
    if not value.isdigit():
        return
    if os.getppid() != int(value):
        if _alive(int(value)):  # a variable inherited further down: not this process's lab
            return
        # The lab died while this peer was still starting (SIGKILL half a second into a demo):
        # orphaned before its watch began, it waited for --min-peers and then trained for good.
        logging.getLogger(__name__).warning(
            "the lab that started this peer (pid %s) is gone: stopping (unset %s if you started it yourself)",
            value,
            LAUNCHER_PID,
        )
        os.kill(os.getpid(), signal.SIGTERM)
        return

    def watch(launcher: int) -> None:
        while os.getppid() == launcher:
            threading.Event().wait(poll)
        logging.getLogger(__name__).warning(
            "the lab that started this peer (pid %d) is gone: stopping", launcher
        )
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, args=(int(value),), name="launcher-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def end_process(code: int) -> None:
    """End this process now with ``code``, after its work is shut down: flush the logs, stop
    any child process left, and skip interpreter finalization. Finalization destroys whatever
    torch, gloo and hivemind still hold in a half-torn-down interpreter, where a stray C++
    thread ends the process in ``std::terminate`` (SIGABRT, "terminate called without an active
    exception") after it already said "stopped." or finished its run: exit status -6 for a run
    that succeeded (and torchrun then takes the whole node down). Only for a process's own
    entry point: a peer's or a node rank's, never a library call."""
    logging.shutdown()
    for child in multiprocessing.active_children():  # normally none: the peer shut them down
        child.terminate()
        child.join(1.0)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing to say
            stream.flush()
    os._exit(code)


CLOSE_DEADLINE = 20.0
"""Seconds a peer may take to leave (announce it, stop its averager and DHT processes)."""


def close_within(close: Callable[[str], None], reason: str, deadline: float = CLOSE_DEADLINE) -> None:
    """``close(reason)``, and a process told to stop is gone within ``deadline`` seconds whatever
    its child processes do: past it, every thread's stack goes to stderr (where the shutdown
    hung) and the process exits with status 1."""
    faulthandler.dump_traceback_later(deadline, exit=True)
    try:
        close(reason)
    finally:
        faulthandler.cancel_dump_traceback_later()
