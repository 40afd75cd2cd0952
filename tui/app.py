"""The swarm monitor: a Textual app over a :class:`~workbench.sources.SnapshotSource`.

It renders snapshots and sends commands through the source (steering, fault injection); it
holds no networking or training logic. Polling runs in a thread worker and hands each
snapshot to the UI thread, so the screen never waits on the DHT.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult, ScreenStackError, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Input, Label, RichLog, Sparkline, Static
from textual_plotext import PlotextPlot

from swarm.errors import SwarmError
from swarm.faults import FaultRequest
from swarm.monitor import SwarmSnapshot
from tui.format import (
    STAGE_STYLE,
    bytes_saved,
    eta_seconds,
    human_bytes,
    human_duration,
    human_rate,
    matches,
    peer_row,
    sort_key,
)
from tui.screens import FaultScreen, HelpScreen, PeerScreen, SteerScreen

COLUMNS = [
    ("name", "name"),
    ("stage", "stage"),
    ("inner", "inner"),
    ("outer", "outer"),
    ("lag", "lag"),
    ("loss", "loss"),
    ("speed", "smp/s"),
    ("sent", "sent"),
    ("received", "recv"),
    ("round", "round"),
    ("group", "grp"),
    ("control", "ctl"),
]
# Fixed widths, wide enough for the values these columns take in practice: a column that widens makes the
# table re-measure all its rows (a 200 ms refresh with 256 peers), so none ever does. The name
# column sizes itself when a row is added.
WIDTHS = {
    "stage": 11,
    "inner": 7,
    "outer": 5,
    "lag": 3,
    "loss": 5,
    "speed": 6,
    "sent": 8,
    "received": 8,
    "round": 6,
    "group": 3,
    "control": 4,
}
WINDOWS = [30.0, 60.0, 120.0, 300.0, 900.0, 3600.0, float("inf")]
EVENT_STYLE = {
    "joined": "green",
    "left": "red",
    "round": "blue",
    "control": "magenta",
    "lagging": "yellow",
    "error": "bold red",
}


class SwarmApp(App[None]):
    """Live swarm view and steering console."""

    CSS_PATH = "app.tcss"
    TITLE = "swarm workbench"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
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
        Binding("escape", "clear_filter", show=False),
    ]

    def __init__(self, source, *, poll: bool = True, clock: bool = True) -> None:
        super().__init__()
        self.clock = clock
        self.source = source
        self.snapshot: SwarmSnapshot | None = None
        self.updates_paused = False
        self.sort_column: str | None = None
        self.sort_reverse = False
        self.filter_text = ""
        self.window = 2  # index into WINDOWS: 120 s
        self.published: Any = None  # the last ControlState this app published
        self._poll = poll
        self._stop = threading.Event()
        self._rows: dict[str, dict[str, str]] = {}
        self._throughput: deque[float] = deque(maxlen=120)
        self._bandwidth: deque[float] = deque(maxlen=120)
        self._last_sent: tuple[float, int] | None = None
        self.last_refresh_seconds = 0.0
        self.title = source.title

    # --- layout -----------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header(show_clock=self.clock)
        yield Static("waiting for the first reading...", id="summary")
        with Horizontal(id="main"):
            with Vertical(id="left"):
                table = DataTable(id="peers", cursor_type="row", zebra_stripes=True)
                for key, label in COLUMNS:
                    table.add_column(label, key=key, width=WIDTHS.get(key))
                yield table
                yield Input(placeholder="filter: name, stage, device or peer id (esc clears)", id="filter")
            with Vertical(id="right"):
                yield PlotextPlot(id="loss")
                yield Label("tokens/s", classes="spark-label", id="throughput-label")
                yield Sparkline([], id="throughput")
                yield Label(
                    "bandwidth (bytes sent/s, all peers)", classes="spark-label", id="bandwidth-label"
                )
                yield Sparkline([], id="bandwidth")
        yield RichLog(id="events", markup=True, wrap=False, max_lines=500)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#filter", Input).display = False
        self.query_one("#peers", DataTable).focus()
        if self._poll:
            self.poll_source()

    def on_unmount(self) -> None:
        self._stop.set()

    def on_resize(self) -> None:
        self.set_class(self.size.width < 110, "narrow")

    # --- polling (worker thread) ---------------------------------------------------------------

    @work(thread=True, exclusive=True, group="poll")
    def poll_source(self) -> None:
        while not self._stop.is_set():
            try:
                snapshot = self.source.poll()
            except Exception as error:  # the DHT hiccupped: say so, keep the last view, retry
                self.call_from_thread(self.notify, f"poll failed: {error}", severity="warning", timeout=4)
            else:
                self.call_from_thread(self.show, snapshot)
            self._stop.wait(self.source.interval)

    # --- rendering (UI thread) -------------------------------------------------------------------

    def show(self, snapshot: SwarmSnapshot) -> None:
        """Take a new snapshot: record what accumulates, then render unless updates are paused."""
        try:
            log = self.query_one("#events", RichLog)
        except (NoMatches, ScreenStackError):  # the app is closing, its screen gone: a last poll, dropped
            return
        self.snapshot = snapshot
        self._throughput.append(sum(p.tokens_per_second for p in snapshot.peers.values()))
        sent = sum(p.bytes_sent for p in snapshot.peers.values())
        if self._last_sent is not None and snapshot.time > self._last_sent[0]:
            rate = max(0, sent - self._last_sent[1]) / (snapshot.time - self._last_sent[0])
            self._bandwidth.append(rate)
        self._last_sent = (snapshot.time, sent)
        for event in snapshot.new_events:
            stamp = time.strftime("%H:%M:%S", time.localtime(event.time))
            style = EVENT_STYLE.get(event.kind, "")
            log.write(Text.assemble((f"{stamp} ", "dim"), (f"{event.kind:>7} ", style), event.message))
        if not self.updates_paused:
            self.render_snapshot()

    def render_snapshot(self) -> None:
        if self.snapshot is None:
            return
        started = time.perf_counter()
        self.render_summary()
        self.render_table()
        self.render_chart()
        self.query_one("#throughput", Sparkline).data = list(self._throughput) or [0.0]
        self.query_one("#bandwidth", Sparkline).data = list(self._bandwidth) or [0.0]
        rate = self._throughput[-1] if self._throughput else 0
        self.query_one("#throughput-label", Label).update(f"tokens/s  [b]{human_rate(rate)}[/b]")
        bandwidth = self._bandwidth[-1] if self._bandwidth else 0
        self.query_one("#bandwidth-label", Label).update(
            f"bandwidth, all peers  [b]{human_bytes(bandwidth)}/s[/b]"
        )
        self.last_refresh_seconds = time.perf_counter() - started

    def summary_text(self) -> str:
        """The run summary line, as Textual markup."""
        s = self.snapshot
        assert s is not None
        clients = sum(1 for p in s.peers.values() if not p.addresses)
        sent, dp = bytes_saved(s)
        parts = [
            f"[dim]round[/] [b]{s.outer_round}[/]",
            f"[dim]peers[/] [b]{len(s.peers)}[/]" + (f" [dim]({clients} clients)[/]" if clients else ""),
            f"[dim]tokens/s[/] [b]{human_rate(sum(p.tokens_per_second for p in s.peers.values()))}[/]",
            f"[dim]sent[/] [b]{human_bytes(sent)}[/]"
            + (f" [dim](data-parallel {human_bytes(dp)}: {dp / sent:.0f}x more)[/]" if sent and dp else ""),
            f"[dim]ETA[/] [b]{human_duration(eta_seconds(s))}[/]",
        ]
        control = s.control
        version = max(control.version if control else 0, self.published.version if self.published else 0)
        if version:
            applied, total = s.applied(version)
            color = "green" if applied == total else "yellow"
            parts.append(f"[dim]control[/] [{color}]{applied}/{total} peers applied v{version}[/]")
        if s.lagging:
            parts.append(f"[yellow]{len(s.lagging)} lagging[/]")
        if s.ignored:  # peers caught lying (swarm.claims): their events say who and why
            parts.append(f"[red]{len(s.ignored)} ignored for lying[/]")
        if self.updates_paused:
            parts.append("[b reverse yellow] UPDATES PAUSED (p) [/]")
        return "  ".join(parts)

    def render_summary(self) -> None:
        self.query_one("#summary", Static).update(self.summary_text())

    def visible_peers(self) -> list:
        s = self.snapshot
        assert s is not None
        peers = [p for p in s.peers.values() if matches(p, self.filter_text)]
        column = self.sort_column or "name"
        return sorted(peers, key=lambda p: sort_key(p, column, s.outer_round), reverse=self.sort_reverse)

    def render_table(self) -> None:
        """Update rows in place (keyed by peer id); add and remove only what changed."""
        table = self.query_one("#peers", DataTable)
        s = self.snapshot
        assert s is not None
        peers = self.visible_peers()
        wanted = [p.peer_id for p in peers]
        for gone in set(self._rows) - set(wanted):
            table.remove_row(gone)
            del self._rows[gone]
        for p in peers:
            cells = peer_row(p, s.outer_round)
            styled = {
                **cells,
                "name": _NameCell(cells["name"], p.peer_id),
                "stage": Text(cells["stage"], style=STAGE_STYLE.get(p.stage, ""), justify="left", end=""),
            }
            if p.peer_id in s.lagging:
                styled["lag"] = Text(cells["lag"], style="bold yellow", justify="left", end="")
            old = self._rows.get(p.peer_id)
            if old is None:
                table.add_row(*(styled[key] for key, _ in COLUMNS), key=p.peer_id)
            else:
                for key, _ in COLUMNS:
                    if old[key] != cells[key]:
                        table.update_cell(p.peer_id, key, styled[key])
            self._rows[p.peer_id] = cells
        order = [str(key.value) for key in table.rows]
        if order != wanted:
            # DataTable sorts by cell values; the name cell carries its peer id (see _NameCell),
            # so the order computed above (numbers as numbers, missing last, ties by name) applies.
            selected = self.selected_peer()
            position = {peer_id: index for index, peer_id in enumerate(wanted)}
            table.sort("name", key=lambda cell: position.get(getattr(cell, "peer_id", ""), 0))
            if selected is not None and selected[0] in position:
                table.move_cursor(row=table.get_row_index(selected[0]))

    def render_chart(self) -> None:
        s = self.snapshot
        assert s is not None
        plot = self.query_one("#loss", PlotextPlot)
        plt = plot.plt
        plt.clear_data()
        plt.clear_figure()
        window = WINDOWS[self.window]
        since = s.time - window
        label = "all" if window == float("inf") else human_duration(window)
        plt.title(f"loss (window {label}, +/-)")
        series = []
        for peer_id, peer in sorted(s.peers.items(), key=lambda kv: kv[1].name):
            points = [(t, v) for t, v in s.history.get(peer_id, {}).get("loss", []) if t >= since]
            if points:
                series.append((peer.name, points))
        for name, points in series[:8]:
            plt.plot([t - s.time for t, _ in points], [v for _, v in points], marker="braille", label=name)
        if len(series) > 1:
            mean = _mean_series([points for _, points in series])
            if mean:
                plt.plot(
                    [t - s.time for t, _ in mean],
                    [v for _, v in mean],
                    marker="braille",
                    label="mean",
                    color="white",
                )
        plt.xlabel("seconds ago")
        plot.refresh()

    # --- actions ------------------------------------------------------------------------------------

    def selected_peer(self) -> tuple[str, str] | None:
        table = self.query_one("#peers", DataTable)
        if not table.row_count or self.snapshot is None:
            return None
        row_key, _ = table.coordinate_to_cell_key(table.cursor_coordinate)
        peer_id = str(row_key.value)
        peer = self.snapshot.peers.get(peer_id)
        return (peer_id, peer.name if peer else peer_id)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        box.focus()

    @on(Input.Changed, "#filter")
    def filter_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value
        if self.snapshot is not None:
            self.render_table()

    @on(Input.Submitted, "#filter")
    def filter_done(self) -> None:
        self.query_one("#peers", DataTable).focus()

    def action_clear_filter(self) -> None:
        if self.screen.maximized is not None:
            self.screen.minimize()
            return
        box = self.query_one("#filter", Input)
        box.value = ""
        box.display = False
        self.query_one("#peers", DataTable).focus()

    def action_sort_next(self) -> None:
        keys = [key for key, _ in COLUMNS]
        current = keys.index(self.sort_column) if self.sort_column in keys else -1
        self.sort_by(keys[(current + 1) % len(keys)])

    @on(DataTable.HeaderSelected)
    def header_clicked(self, event: DataTable.HeaderSelected) -> None:
        self.sort_by(str(event.column_key.value))

    def sort_by(self, column: str) -> None:
        self.sort_reverse = not self.sort_reverse if column == self.sort_column else False
        self.sort_column = column
        label = dict(COLUMNS)[column]
        self.notify(f"sorted by {label}{' (descending)' if self.sort_reverse else ''}", timeout=2)
        if self.snapshot is not None:
            self.render_table()

    @on(DataTable.RowSelected)
    def row_selected(self) -> None:
        self.action_details()

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
        self.window = min(max(self.window + step, 0), len(WINDOWS) - 1)
        if self.snapshot is not None:
            self.render_chart()

    def action_maximize(self) -> None:
        focused = self.focused
        target = focused if focused is not None and focused.id != "filter" else self.query_one("#peers")
        self.screen.maximize(target)

    def action_export(self, path: str | None = None) -> Path | None:
        if self.snapshot is None:
            self.notify("nothing to export yet", severity="warning")
            return None
        target = Path(path or f"swarm-snapshot-{time.strftime('%Y%m%d-%H%M%S')}.json")
        target.write_text(json.dumps(self.snapshot.to_json(), indent=2))
        self.notify(f"snapshot written to {target}")
        return target

    def action_ansi_theme(self) -> None:
        self.theme = "ansi-dark"

    # --- steering and faults --------------------------------------------------------------------

    def action_steer(self) -> None:
        control = self.snapshot.control if self.snapshot else None
        current = control.model_dump() if control else {}
        paused = list(control.paused) if control else []
        screen = SteerScreen(
            reason=self.source.steering_reason(), current=current, peer=self.selected_peer(), paused=paused
        )
        self.push_screen(screen, self._steer_chosen)

    def _steer_chosen(self, changes: dict[str, Any] | None) -> None:
        if changes:
            self.publish(changes)

    @work(thread=True, exclusive=True, group="steer")
    def publish(self, changes: dict[str, Any]) -> None:
        try:
            control = self.source.steer(**changes)
        except (SwarmError, ValueError) as error:
            self.call_from_thread(self.notify, str(error), severity="error", timeout=8)
            return
        self.published = control
        message = f"published control v{control.version}, applied from outer step {control.from_step}"
        self.call_from_thread(self.notify, message)
        if self.snapshot is not None:
            self.call_from_thread(self.render_summary)

    def action_faults(self) -> None:
        peer = self.selected_peer()
        if peer is None:
            self.notify("no peer selected", severity="warning")
            return
        faults = self.source.faults
        reason = (
            faults.reason(peer[0])
            if faults is not None
            else ("fault injection works on peers this machine launched (`workbench demo`)")
        )
        self.push_screen(
            FaultScreen(name=peer[1], reason=reason), lambda choice: self._fault_chosen(peer, choice)
        )

    def _fault_chosen(self, peer: tuple[str, str], request: FaultRequest | None) -> None:
        if request is None or self.source.faults is None:
            return
        try:
            message = self.source.faults.inject(peer[0], request)
        except (SwarmError, OSError, ValueError) as error:
            self.notify(str(error), severity="error")
            return
        self.notify(message, timeout=6)
        self.query_one("#events", RichLog).write(Text.assemble(("   fault ", "bold red"), message))

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


class _NameCell(Text):
    """The name cell, which also knows its row's peer id (for sorting by our own order)."""

    def __init__(self, name: str, peer_id: str) -> None:
        super().__init__(name, justify="left", end="")
        self.peer_id = peer_id


def _mean_series(series: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """The mean loss over peers at each time one of them reported (last value carried forward)."""
    times = sorted({t for points in series for t, _ in points})
    mean, latest = [], [None] * len(series)
    cursors = [0] * len(series)
    for t in times:
        for i, points in enumerate(series):
            while cursors[i] < len(points) and points[cursors[i]][0] <= t:
                latest[i] = points[cursors[i]][1]
                cursors[i] += 1
        known = [v for v in latest if v is not None]
        if len(known) == len(series):
            mean.append((t, sum(known) / len(known)))
    return mean


def run_app(source) -> None:
    """Run the monitor over ``source`` until the user quits; always closes the source."""
    try:
        SwarmApp(source).run()
    finally:
        source.close()
