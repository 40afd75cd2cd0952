"""A closed terminal (SIGHUP) ends the monitor whatever its polling thread is doing.

The signal ends the UI's event loop wherever it is. A polling thread that was handing a
snapshot to the UI and waiting for it (Textual's ``call_from_thread``) then waited forever,
and the process never exited: the interpreter joins that thread at exit. Beside a busy test
suite this held the monitor of a live run in 2 of 6 runs; with a source that is read every
millisecond (the thread nearly always waiting on the UI) it held 11 of 16 hang-ups.
"""

from __future__ import annotations

import contextlib
import os
import pty
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import faulthandler, signal, sys
faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it hangs, if it does
from tests.ui.fake import FakeSource
from tui.app import run_app
from workbench.run.stopping import stopped_by_signals

class Busy(FakeSource):
    interval = 0.001  # the polling thread hands over a snapshot nearly all the time

    def poll(self):
        if self.position == 3:
            open(sys.argv[1], "w").write("drawing")
        return super().poll()

with stopped_by_signals():
    try:
        run_app(Busy())
    except KeyboardInterrupt:
        pass
"""


INSIDE_ASYNCIO = (
    """
# The hang-up's handler runs where a real one was caught landing in a monitor that never exited
# (1 hang-up in about 950 under load): inside asyncio, as a future schedules a task's wake-up.
import asyncio, asyncio.base_events, signal, sys
armed = []
scheduled = asyncio.base_events.BaseEventLoop._call_soon
def _call_soon(self, callback, args, context):
    if armed and isinstance(getattr(callback, "__self__", None), asyncio.Task) and sys._getframe(1).f_code.co_name == "call_soon":
        armed.pop()(signal.SIGHUP, None)
    return scheduled(self, callback, args, context)
asyncio.base_events.BaseEventLoop._call_soon = _call_soon
install = signal.signal
def deferred(signum, handler):  # SIGHUP's handler, whoever installs it, waits for that moment
    if signum == signal.SIGHUP and callable(handler):
        return install(signum, lambda s, f: armed.append(handler))
    return install(signum, handler)
signal.signal = deferred
"""
    + CHILD
)


class Monitor:
    def __init__(self, marker: Path, child: str = CHILD) -> None:
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "TEXTUAL"))
        }  # as a user runs it
        env.update(TERM="xterm-256color", COLUMNS="100", LINES="30")
        self.marker = marker
        self.leader, follower = pty.openpty()
        self.process = subprocess.Popen(
            [sys.executable, "-c", child, str(marker)],
            stdin=follower, stdout=follower, stderr=follower, start_new_session=True,
            cwd=Path(__file__).parents[2], env=env,
        )  # fmt: skip
        os.close(follower)
        self.output = bytearray()

    def drain(self) -> None:
        """A terminal reads what the app draws, or the app blocks on a full pty."""
        with contextlib.suppress(OSError):  # the child closed its end
            while select.select([self.leader], [], [], 0)[0]:
                self.output.extend(os.read(self.leader, 65536))

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        os.close(self.leader)


def test_a_hang_up_ends_a_busy_monitor(tmp_path: Path) -> None:
    """Four monitors drawing snapshots as fast as they come, each sent SIGHUP at a random moment
    0.2-1.5 s into its drawing: each exits, cleanly, within 10 s."""
    _hang_up([Monitor(tmp_path / f"drawing-{i}") for i in range(4)])


def test_a_hang_up_landing_inside_asyncio_s_scheduling_ends_the_monitor(tmp_path: Path) -> None:
    """The hang-up's handler raised KeyboardInterrupt wherever the event loop was: inside
    asyncio scheduling a task's wake-up, the wake-up was lost and the app's shutdown waited for
    that task for ever (placed there, 8 of 8 monitors hung). The handler now asks the app to
    exit at the loop's next turn."""
    _hang_up([Monitor(tmp_path / f"drawing-{i}", INSIDE_ASYNCIO) for i in range(2)])


def _hang_up(monitors: list[Monitor]) -> None:
    try:
        deadline = time.monotonic() + 90
        hang_up_at: dict[int, float] = {}
        hung_up: dict[int, float] = {}
        while len(hung_up) < len(monitors) or any(m.process.poll() is None for m in monitors):
            now = time.monotonic()
            for i, m in enumerate(monitors):
                m.drain()
                if i not in hang_up_at and m.marker.exists():
                    hang_up_at[i] = now + random.uniform(0.2, 1.5)
                if i not in hung_up and now >= hang_up_at.get(i, float("inf")):
                    m.process.send_signal(signal.SIGHUP)
                    hung_up[i] = now
                if i not in hang_up_at:
                    assert m.process.poll() is None and now < deadline, m.output.decode(errors="replace")[
                        -3000:
                    ]
                elif i in hung_up and m.process.poll() is None and now - hung_up[i] >= 10:
                    m.process.send_signal(signal.SIGUSR1)  # every thread's stack, into its terminal
                    time.sleep(2.0)
                    m.drain()
                    raise AssertionError(
                        f"monitor {i} still running 10 s after SIGHUP; its threads:\n"
                        + m.output.decode(errors="replace")[-6000:]
                    )
            time.sleep(0.02)
        for m in monitors:
            assert m.process.returncode == 0, m.output.decode(errors="replace")[-3000:]
    finally:
        for m in monitors:
            m.close()
