"""The swarm monitor: a Textual app over a :class:`~workbench.sources.SnapshotSource`.

It renders snapshots and sends commands through the source (steering, fault injection); it
holds no networking or training logic. Polling: :mod:`tui.polling`; the owner's steering and
fault injection: :mod:`tui.console`; the widgets: :mod:`tui.widgets`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from textual import on
from textual.app import App, ComposeResult, ScreenStackError, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Input

from swarm.monitor import SwarmSnapshot, strict_json
from tui.console import OwnerConsole
from tui.screens import HelpScreen, PeerScreen
from tui.widgets import EventLog, LossChart, PeersTable, Rates, RunSummary


class SwarmApp(OwnerConsole):
    """Live swarm view and steering console: the layout, the rendering and the viewer's
    actions (steering and faults: :class:`~tui.console.OwnerConsole`)."""

    CSS_PATH = "app.tcss"
    TITLE = "swarm workbench"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        # Textual 8 only hints at ctrl+q; a terminal user presses ctrl+c, in a dialog too (the
        # inputs and buttons took it for themselves there, and it did nothing).
        Binding("ctrl+c", "quit", show=False, priority=True),
        Binding("question_mark,f1", "help", "Help"),
        Binding("slash", "filter", "Filter"),
        Binding("s", "sort_next", "Sort"),
        Binding("enter", "details", "Details", show=False),
        Binding("e", "steer", "Steer"),
        Binding("f", "faults", "Faults"),
        Binding("p", "toggle_updates", "Pause"),
        Binding("m", "maximize", "Max"),
        Binding("plus,equals_sign", "window(1)", "Window+", show=False),
        Binding("minus", "window(-1)", "Window-", show=False),
        Binding("x", "export", "Export", show=False),
        Binding("c", "clear_departed", "Clear left"),
        Binding("escape", "clear_filter", show=False),
    ]

    def __init__(
        self, source, *, poll: bool = True, clock: bool = True, freeze_startup: bool = False
    ) -> None:
        """``freeze_startup``: once the first reading is on the screen, move every object alive
        then (the imports, the widgets, the first reading) out of the garbage collector's way
        (:func:`gc.freeze`): a full collection walked them all, 25-35 ms, in the worst refreshes
        with 256 peers (:mod:`benchmarks.tui_refresh`). For the monitor's own process
        (:func:`run_app`), not an app among others (a test's): they stay for the process's life."""
        super().__init__()
        self.clock = clock
        self._freeze_startup = freeze_startup
        self.source = source
        self.snapshot: SwarmSnapshot | None = None
        self.updates_paused = False
        self.published: Any = None  # the last ControlState this app published
        self._poll = poll
        self.last_refresh_seconds = 0.0
        self.title = source.title

    # --- layout -----------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header(show_clock=self.clock)
        yield RunSummary("waiting for the first reading...", id="summary")
        with Horizontal(id="main"):
            with Vertical(id="left"):  # the table as tall as its peers, the event log under it
                yield PeersTable(id="peers")
                yield Input(placeholder="filter: name, stage, device or peer id (esc clears)", id="filter")
                yield EventLog(id="events")
            with Vertical(id="right"):
                yield LossChart(id="loss")
                yield Rates(id="rates")
        yield Footer()

    @property
    def table(self) -> PeersTable:
        return self.query_one("#peers", PeersTable)

    @property
    def chart(self) -> LossChart:
        return self.query_one("#loss", LossChart)

    # What the user chose (the widgets hold it as reactive attributes).
    sort_column = property(lambda self: self.table.sort_column)
    sort_reverse = property(lambda self: self.table.sort_reverse)
    window = property(lambda self: self.chart.window)

    def on_mount(self) -> None:
        self.query_one("#filter", Input).display = False
        self.table.focus()
        if self._poll:
            self.poll_source()

    def on_resize(self) -> None:
        self.set_class(self.size.width < 110, "narrow")

    # --- rendering (UI thread) -------------------------------------------------------------------

    def show(self, snapshot: SwarmSnapshot) -> None:
        """Take a new snapshot: record what accumulates, then render unless updates are paused."""
        try:  # every widget a render touches (the screen's children go one by one as it closes)
            log, rates = self.query_one("#events", EventLog), self.query_one("#rates", Rates)
            self.query_one("#summary", RunSummary)
        except (NoMatches, ScreenStackError):  # the app is closing, its screen gone: a last poll, dropped
            return
        self.snapshot = snapshot
        rates.record(snapshot)
        log.add(snapshot.new_events)
        if not self.updates_paused:
            self.render_snapshot()
        if self._freeze_startup:
            self._freeze_startup = False
            self.call_after_refresh(gc.freeze)

    def render_snapshot(self) -> None:
        if self.snapshot is None:
            return
        started = time.perf_counter()
        self.render_summary()
        self.table.show(self.snapshot)
        self.show_chart()
        self.query_one("#rates", Rates).show()
        self.last_refresh_seconds = time.perf_counter() - started

    def show_chart(self, snapshot: SwarmSnapshot | None = None) -> None:
        """The loss chart of the peers the table shows, in its order, the highlighted one first."""
        table = self.table
        if table.snapshot is None:
            return
        order = [p.peer_id for p in table.visible_peers()]
        selected = table.selected_peer()
        self.chart.show(snapshot or self.snapshot, order=order, first=selected[0] if selected else None)

    def render_summary(self) -> None:
        self.query_one("#summary", RunSummary).show(
            self.snapshot, published=self.published, updates_paused=self.updates_paused
        )

    # --- actions ------------------------------------------------------------------------------------

    def selected_peer(self) -> tuple[str, str] | None:
        return self.table.selected_peer()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_filter(self) -> None:
        if self.screen.maximized is not None:  # the box is outside the maximized widget: unseen
            self.screen.minimize()
        box = self.query_one("#filter", Input)
        box.display = True
        box.focus()

    @on(Input.Changed, "#filter")
    def filter_changed(self, event: Input.Changed) -> None:
        self.table.filter_text = event.value
        if not self.updates_paused:
            self.show_chart()

    @on(DataTable.RowHighlighted, "#peers")
    def row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        """A peer beyond the chart's lines, highlighted, gets one (redrawn only then: a chart of
        256 peers takes a while)."""
        if self.updates_paused or event.row_key.value is None:
            return
        try:  # (the message may come as the app closes, its widgets gone)
            if str(event.row_key.value) not in self.chart.shown:
                self.show_chart()
        except (NoMatches, ScreenStackError):
            pass

    @on(Input.Submitted, "#filter")
    def filter_done(self) -> None:
        self.table.focus()

    def action_clear_filter(self) -> None:
        if self.screen.maximized is not None:
            self.screen.minimize()
            return
        box = self.query_one("#filter", Input)
        box.value = ""
        box.display = False
        self.table.focus()

    def action_sort_next(self) -> None:
        self.table.sort_next()

    @on(DataTable.HeaderSelected)
    def header_clicked(self, event: DataTable.HeaderSelected) -> None:
        self.sort_by(str(event.column_key.value))

    def sort_by(self, column: str) -> None:
        self.table.sort_by(column)

    @on(DataTable.RowSelected)
    def row_selected(self) -> None:
        self.action_details()

    def action_clear_departed(self) -> None:
        hidden = self.table.clear_departed()
        self.notify(
            f"cleared {hidden} peer{'s' if hidden != 1 else ''} that left" if hidden else "no peer left"
        )

    def action_details(self) -> None:
        peer = self.selected_peer()
        if peer is not None and self.snapshot is not None:
            self.push_screen(PeerScreen(self.snapshot, peer[0]))

    def action_toggle_updates(self) -> None:
        self.updates_paused = not self.updates_paused
        if self.snapshot is not None:
            self.render_snapshot()
        self.notify("updates paused (p resumes)" if self.updates_paused else "updates resumed", timeout=2)

    def action_window(self, step: int) -> None:
        self.chart.window += step

    def action_maximize(self) -> None:
        focused = self.focused
        target = focused if focused is not None and focused.id != "filter" else self.query_one("#peers")
        self.screen.maximize(target)

    def action_export(self, path: str | None = None) -> Path | None:
        if self.snapshot is None:
            self.notify("nothing to export yet", severity="warning")
            return None
        target = Path(path or f"swarm-snapshot-{time.strftime('%Y%m%d-%H%M%S')}.json")
        try:
            target.write_text(json.dumps(strict_json(self.snapshot.to_json()), indent=2, allow_nan=False))
        except OSError as error:  # a folder that cannot be written: say so, keep watching
            self.notify(
                f"could not write {target.resolve()}: {error.strerror or error}; start the monitor "
                "from a folder you can write to",
                severity="error",
                timeout=10,
            )
            return None
        self.notify(f"snapshot written to {target}")
        return target

    def action_ansi_theme(self) -> None:
        self.theme = "ansi-dark"

    # --- command palette --------------------------------------------------------------------------

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand(
            "Steer the run", "Change outer lr, H, codec; pause or resume a peer", self.action_steer
        )
        yield SystemCommand(
            "Pause updates" if not self.updates_paused else "Resume updates",
            "Freeze the screen (polling continues)",
            self.action_toggle_updates,
        )
        yield SystemCommand(
            "Export snapshot as JSON", "Write the current snapshot to a file", self.action_export
        )
        yield SystemCommand("ANSI theme", "Use the terminal's own 16 colors", self.action_ansi_theme)
        yield SystemCommand(
            "Inject a fault", "Kill, freeze, throttle or corrupt a local peer", self.action_faults
        )


STOP_SIGNALS = tuple(s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


def run_app(source) -> None:
    """Run the monitor over ``source`` until the user quits; always closes the source."""
    app = SwarmApp(source, freeze_startup=True)
    try:
        run_until_stopped(app)
    finally:
        app.stop_polling()  # a signal can end the UI before it unmounts (and its workers are cancelled)
        source.close()


def run_until_stopped(app: App) -> None:
    """``app.run()``, which SIGTERM and SIGHUP (a closed terminal) end as `q` does; then
    KeyboardInterrupt, as a caller's handler that raises it promises
    (``workbench.run.stopping.stopped_by_signals``). Raised by the handler itself it landed
    wherever the event loop was, once inside asyncio scheduling a task's wake-up: the wake-up
    was lost, the app's shutdown waited for that task for ever, and the monitor outlived its
    terminal (1 hang-up in about 950 under load; every time with the signal placed there). A
    second signal raises at once: the app's own exit is stuck, and the caller stops anyway."""
    stopped: list[int] = []
    exiting: list[asyncio.Task] = []  # held here: the loop keeps only a weak reference to a task

    async def exit_once_mounted() -> None:
        await app._mounted_event.wait()  # exited before its screen is up, Textual shows errors
        app.exit()

    def stop(signum: int, frame: object) -> None:
        stopped.append(signum)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (yet or any more): nothing to break, stop now
            raise KeyboardInterrupt from None
        if len(stopped) > 1:  # asked again: the app's own exit is stuck, leave it as Ctrl+C would
            raise KeyboardInterrupt
        # At the loop's next turn, as asyncio.Runner does Ctrl+C.
        loop.call_soon_threadsafe(lambda: exiting.append(loop.create_task(exit_once_mounted())))

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        app.run()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopped:
        raise KeyboardInterrupt
