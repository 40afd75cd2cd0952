"""Polling in a thread worker: each snapshot is posted to the UI thread, so the screen never
waits on the DHT. The worker never waits on the UI either: a signal (SIGHUP, SIGTERM) ends the
UI's event loop wherever it is, and a thread still waiting on that loop would hold the
process's exit forever."""

from __future__ import annotations

import contextlib
import threading

from textual import on, work
from textual.app import App
from textual.message import Message
from textual.worker import get_current_worker

from swarm.monitor import SwarmSnapshot


class PolledApp(App[None]):
    """An app that reads ``self.source`` every ``source.interval`` s and :meth:`show` s it."""

    def __init__(self) -> None:
        super().__init__()
        self._stop = threading.Event()

    def show(self, snapshot: SwarmSnapshot) -> None:
        raise NotImplementedError

    def on_unmount(self) -> None:
        self.stop_polling()

    def stop_polling(self) -> None:
        """End the polling thread after its current read."""
        self._stop.set()

    class SnapshotRead(Message):
        """A snapshot the polling thread read, for the UI thread."""

        def __init__(self, snapshot: SwarmSnapshot) -> None:
            super().__init__()
            self.snapshot = snapshot

    @work(thread=True, exclusive=True, group="poll")
    def poll_source(self) -> None:
        # post_message and notify queue and return (call_from_thread would wait on the UI). The
        # loop ends on unmount, when Textual cancels its workers (its message loop ended, even
        # by a signal), or when the app no longer takes messages: Python 3.11's asyncio.run
        # waits for this thread before run_app's finally can stop it.
        worker = get_current_worker()
        while not (self._stop.is_set() or worker.is_cancelled):
            try:
                snapshot = self.source.poll()
            except Exception as error:  # the DHT hiccupped: say so, keep the last view, retry
                with contextlib.suppress(RuntimeError):  # the app's loop is closed
                    self.notify(f"poll failed: {error}", severity="warning", timeout=4)
            else:
                try:
                    if not self.post_message(self.SnapshotRead(snapshot)):
                        return  # the app is closing
                except RuntimeError:  # its event loop is closed
                    return
            self._stop.wait(self.source.interval)

    @on(SnapshotRead)
    def _snapshot_read(self, message: SnapshotRead) -> None:
        self.show(message.snapshot)
