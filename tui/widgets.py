"""The monitor's widgets: the run summary, the peers table, the loss chart, the rates (tokens/s
and bandwidth sparklines) and the event log. Each takes a :class:`~swarm.monitor.SwarmSnapshot`
through ``show``; what the user changes (sort, filter, chart window) is a reactive attribute
that re-renders its widget. :class:`tui.app.SwarmApp` composes them."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from rich.markup import escape
from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.cache import LRUCache
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import DataTable, Label, RichLog, Sparkline, Static
from textual.widgets.data_table import ColumnKey, RowKey

from swarm.monitor import SwarmSnapshot
from swarm.records import refused
from tui import chart
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

COLUMNS = [
    ("name", "name"),
    ("stage", "stage"),
    ("inner", "inner"),
    ("h", "H"),
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
    "stage": 13,
    "inner": 9,  # 9999/9999; longer in thousands (99k/100k)
    "h": 4,
    "outer": 5,
    "lag": 4,  # counts take at least 4 (999k, 12M: tui.format.count)
    "loss": 5,
    "speed": 6,
    "sent": 8,
    "received": 8,
    "round": 6,
    "group": 3,
    "control": 5,
}
WINDOWS = [30.0, 60.0, 120.0, 300.0, 900.0, 3600.0, float("inf")]
EVENT_STYLE = {
    "joined": "green",
    "present": "green",
    "left": "red",
    "round": "blue",
    "control": "magenta",
    "lagging": "yellow",
    "error": "bold red",
    "ignored": "bold red",
}
LEFT_AS = {
    "clean exit": "exit",
    "heartbeat expired": "expired",
    "killed from the monitor": "killed",
}
"""A departed peer's stage cell: how it left (a lie: "lying"), then when."""


def summary_text(s: SwarmSnapshot, *, published: Any = None, updates_paused: bool = False) -> str:
    """The run summary line, as Textual markup (``published``: the last ControlState this
    monitor published, which the snapshot may not show yet)."""
    clients = sum(1 for p in s.peers.values() if not p.addresses)
    sent, dp = bytes_saved(s)
    parts = [
        f"[dim]round[/] [b]{s.outer_round}[/]",
        f"[dim]peers[/] [b]{len(s.peers)}[/]" + (f" [dim]({clients} clients)[/]" if clients else ""),
        f"[dim]tokens/s[/] [b]{human_rate(s.tokens_per_second)}[/]",
        f"[dim]sent[/] [b]{human_bytes(sent)}[/]"
        + (f" [dim](data-parallel {human_bytes(dp)}: {dp / sent:.0f}x more)[/]" if sent and dp else ""),
        f"[dim]ETA[/] [b]{human_duration(eta_seconds(s))}[/]",
    ]
    control = s.control
    version = max(control.version if control else 0, published.version if published else 0)
    if version:
        applied, total = s.applied(version)
        color = "green" if applied == total else "yellow"
        paused = len(s.peers) - total  # they apply it when resumed
        said_no = refused(s.peers.values(), version)
        color = "red" if said_no else color
        parts.append(
            f"[dim]control[/] [{color}]{applied}/{total} peers applied v{version}[/]"
            + (f" [dim]({paused} paused)[/]" if paused else "")
            + (
                f" [red]({len(said_no)} refused: {escape(next(iter(said_no.values()))[:80])})[/]"
                if said_no
                else ""
            )
        )
    waits = sorted(p.round_wait_seconds for p in s.peers.values() if p.round_wait_seconds)
    if waits:  # the deadlines the peers learned from the last rounds (swarm.deadlines)
        parts.append(f"[dim]waits[/] [b]{waits[len(waits) // 2]:.0f} s[/]")
    if s.lagging:
        parts.append(f"[yellow]{len(s.lagging)} lagging[/]")
    if s.ignored:  # peers caught lying (swarm.claims): their events say who and why
        parts.append(f"[red]{len(s.ignored)} ignored for lying[/]")
    if updates_paused:
        parts.append("[b reverse yellow] UPDATES PAUSED (p) [/]")
    return "  ".join(parts)


class RunSummary(Static):
    """One line about the whole run: round, peers, tokens/s, bytes, ETA, steering, warnings."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lines = 0

    def show(self, snapshot: SwarmSnapshot, *, published: Any = None, updates_paused: bool = False) -> None:
        text = summary_text(snapshot, published=published, updates_paused=updates_paused)
        # A layout (which re-renders every widget on the screen) only when the line wraps
        # differently: the summary's box is as tall as its lines (app.tcss), not as wide.
        lines = len(Text.from_markup(text).wrap(self.app.console, max(1, self.content_size.width)))
        self.update(text, layout=lines != self._lines)
        self._lines = lines

    def on_resize(self) -> None:
        self._lines = 0  # the next show measures again (the resize itself lays the screen out)


class PeersTable(DataTable):
    """One row per peer, updated in place (keyed by peer id); sorted and filtered by the user."""

    sort_column: reactive[str | None] = reactive(None, init=False)
    sort_reverse: reactive[bool] = reactive(False, init=False)
    filter_text: reactive[str] = reactive("", init=False)

    def __init__(self, **kwargs: Any) -> None:
        self._rendered: LRUCache[tuple, tuple[Any, Any]] = LRUCache(4096)  # see _render_cell
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self.snapshot: SwarmSnapshot | None = None
        self._rows: dict[str, dict[str, str]] = {}
        self._dimmed: set[str] = set()  # rows shown as departed
        self.cleared_before = float("-inf")  # peers that left before this (reading) time are hidden
        for key, label in COLUMNS:
            self.add_column(label, key=key, width=WIDTHS.get(key))

    def watch_sort_column(self) -> None:
        self.show()

    def watch_sort_reverse(self) -> None:
        self.show()

    def watch_filter_text(self) -> None:
        self.show()

    def sort_by(self, column: str) -> None:
        """Sort by ``column``; the same column again reverses the order."""
        reverse = not self.sort_reverse if column == self.sort_column else False
        self.set_reactive(PeersTable.sort_reverse, reverse)  # both, then one render
        self.set_reactive(PeersTable.sort_column, column)
        self.show()
        self.notify(f"sorted by {dict(COLUMNS)[column]}{' (descending)' if reverse else ''}", timeout=2)

    def sort_next(self) -> None:
        keys = [key for key, _ in COLUMNS]
        current = keys.index(self.sort_column) if self.sort_column in keys else -1
        self.sort_by(keys[(current + 1) % len(keys)])

    def visible_peers(self) -> list:
        """Live peers in the user's order, then the peers that left (dimmed, newest first)."""
        s = self.snapshot
        assert s is not None
        peers = [p for p in s.peers.values() if matches(p, self.filter_text)]
        column = self.sort_column or "name"
        live = sorted(peers, key=lambda p: sort_key(p, column, s.outer_round), reverse=self.sort_reverse)
        return live + [d.heartbeat for d in self.departed()]

    def departed(self) -> list:
        """The peers that left since the user last cleared them, newest first."""
        s = self.snapshot
        assert s is not None
        gone = [d for pid, d in s.departed.items() if d.time > self.cleared_before and pid not in s.peers]
        # As shown: how it left, not the stage its last heartbeat said ("exit", not "training").
        shown = [d for d in gone if matches(d.heartbeat, self.filter_text, stage=LEFT_AS.get(d.how, "lying"))]
        return sorted(shown, key=lambda d: d.time, reverse=True)

    def clear_departed(self) -> int:
        """Hide the peers that left so far (key ``c``); how many were hidden."""
        if self.snapshot is None:
            return 0
        hidden = len(self.departed())
        self.cleared_before = self.snapshot.time
        self.show()
        return hidden

    def selected_peer(self) -> tuple[str, str] | None:
        """(peer id, name) of the row under the cursor, or None."""
        if not self.row_count or self.snapshot is None:
            return None
        row_key, _ = self.coordinate_to_cell_key(self.cursor_coordinate)
        peer_id = str(row_key.value)
        gone = self.snapshot.departed.get(peer_id)
        peer = self.snapshot.peers.get(peer_id) or (gone.heartbeat if gone else None)
        return (peer_id, peer.name if peer else peer_id)

    def show(self, snapshot: SwarmSnapshot | None = None) -> None:
        """Render ``snapshot`` (or the last one again): add and remove only what changed."""
        self.snapshot = snapshot or self.snapshot
        s = self.snapshot
        if s is None:
            return
        version = self._update_count
        try:
            self._show(s)
        finally:
            if self._update_count != version:
                self._drop_stale_renders()

    def _show(self, s: SwarmSnapshot) -> None:
        peers = self.visible_peers()
        wanted = [p.peer_id for p in peers]
        departed = {d.heartbeat.peer_id: d for d in self.departed()}
        restyled = (self._dimmed ^ set(departed)) & set(self._rows)  # left or came back
        for gone in (set(self._rows) - set(wanted)) | restyled:
            self.remove_row(gone)  # re-added below in its new style if still shown
            del self._rows[gone]
        self._dimmed = set(departed)
        changed: list[tuple[str, str, Any]] = []  # (row, column, new value)
        for p in peers:
            cells = peer_row(p, s.outer_round, WIDTHS)
            left = departed.get(p.peer_id)
            if left is not None:
                how = LEFT_AS.get(left.how, "lying")
                cells |= {"stage": f"{how} {time.strftime('%H:%M', time.localtime(left.time))}", "lag": "-"}
            lagging = p.peer_id in s.lagging and left is None
            old = self._rows.get(p.peer_id)
            if old is None:
                self.add_row(
                    *(_cell(p, key, cells[key], left is not None, lagging) for key, _ in COLUMNS),
                    key=p.peer_id,
                )
            else:
                for key, _ in COLUMNS:
                    # The lag cell's style too: a peer that began (or stopped) lagging with the
                    # same lag kept its old look.
                    if old[key] != cells[key] or (key == "lag" and old.get(LAGGING) != lagging):
                        changed.append((p.peer_id, key, _cell(p, key, cells[key], left is not None, lagging)))
            self._rows[p.peer_id] = {**cells, LAGGING: lagging}
        self._update_cells(changed)
        # As shown: DataTable.sort reorders what is shown, not ``rows`` (the order rows were
        # added in), so a sort back to that order was taken as done and skipped.
        order = [str(row.key.value) for row in self.ordered_rows]
        if order != wanted:
            # DataTable sorts by cell values; the name cell carries its peer id (see _NameCell),
            # so the order computed above (numbers as numbers, missing last, ties by name) applies.
            selected = self.selected_peer()
            position = {peer_id: index for index, peer_id in enumerate(wanted)}
            self.sort("name", key=lambda cell: position.get(getattr(cell, "peer_id", ""), 0))
            if selected is not None and selected[0] in position:
                self.move_cursor(row=self.get_row_index(selected[0]))

    def _render_cell(
        self,
        row_index: int,
        column_index: int,
        base_style: Style,
        width: int,
        cursor: bool = False,
        hover: bool = False,
    ) -> Any:
        """DataTable's cell, rendered again only when its value (or look) changed: DataTable's own
        cache is dropped whenever any cell changes, and with 256 peers every reading re-rendered
        every visible cell (about 0.17 ms each), most of them unchanged. Keyed as DataTable keys
        its own, the cell's value object in place of the table's update count (a changed cell
        gets a new value object, :meth:`show`)."""
        if row_index < 0 or column_index < 0:  # the header, row labels (none here)
            return super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
        row_key = self._row_locations.get_key(row_index)
        column_key = self._column_locations.get_key(column_index)
        value = self._data[row_key][column_key]
        key = (
            row_key, column_key, row_index, base_style, width, cursor, hover,
            self._show_hover_cursor, self._pseudo_class_state, self.rows[row_key].height,
        )  # fmt: skip
        cached = self._rendered.get(key)
        if cached is not None and cached[0] is value:
            return cached[1]
        lines = super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
        self._rendered[key] = (value, lines)
        return lines

    def _drop_stale_renders(self) -> None:
        """Empty DataTable's caches of rendered cells, rows and lines once the table changed:
        their keys hold its update count, so no entry made before can be read again, and they
        kept up to 10,000 cells and 1,000 lines of each (with 256 peers, about half of the
        monitor's 300,000 objects, which every full garbage collection walks: 160 ms pauses,
        every 4-5 readings)."""
        for cache in (
            self._cell_render_cache,
            self._row_render_cache,
            self._line_cache,
            self._row_renderable_cache,
        ):
            cache.clear()

    def _clear_caches(self) -> None:
        super()._clear_caches()
        self._rendered.clear()

    def notify_style_update(self) -> None:  # a theme or CSS change: every cell looks different
        super().notify_style_update()
        self._rendered.clear()

    def _update_cells(self, changed: list[tuple[str, str, Any]]) -> None:
        """``DataTable.update_cell`` for each (row, column, value), with one refresh for all.
        Each call invalidates the table's render caches and schedules a refresh: with 256 peers
        a reading changed about 1,100 cells, and their calls took 20-30 ms of each refresh. (Its
        private ``_data`` and ``_update_count``, as ``update_cell`` sets them; Textual is pinned
        below 9, and ``tests/ui`` compare what the table shows.)"""
        for row, column, value in changed:
            self._data[RowKey(row)][ColumnKey(column)] = value
        if changed:
            self._update_count += 1
            self.refresh()


def _cell(peer: Any, key: str, value: str, departed: bool, lagging: bool) -> Text:
    """A peer's cell as the table draws it: Text, never a str, which DataTable parses as markup
    at every render."""
    if key == "name":
        return _NameCell(value, peer.peer_id, style="dim" if departed else "")
    if departed:
        return Text(str(value), style="dim", end="")
    if key == "stage":
        return Text(value, style=STAGE_STYLE.get(peer.stage, ""), justify="left", end="")
    if key == "lag" and lagging:
        return Text(value, style="bold yellow", justify="left", end="")
    return Text(value, end="", no_wrap=True)


LAGGING = "lagging?"  # (not a column) whether a row's lag cell was drawn as lagging


CHART_PEERS = 8
"""The most peers the loss chart draws a line for (the mean line covers all it could show)."""


class LossChart(Widget):
    """Each peer's loss over the last ``WINDOWS[window]`` seconds, and their mean: the peers the
    table shows, in its order (its filter narrows the chart too), ``CHART_PEERS`` at most, the
    row under the cursor always among them. Drawn in braille by :mod:`tui.chart`."""

    window: reactive[int] = reactive(2, init=False)  # index into WINDOWS: 120 s

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.snapshot: SwarmSnapshot | None = None
        self.order: list[str] | None = None  # peer ids as the table shows them (None: by name)
        self.shown: list[str] = []  # the peers drawn, by id
        self.heading = ""
        self.lines: list[chart.Line] = []

    def validate_window(self, window: int) -> int:
        return min(max(window, 0), len(WINDOWS) - 1)

    def watch_window(self) -> None:
        self.show()

    def show(
        self, snapshot: SwarmSnapshot | None = None, order: list[str] | None = None, first: str | None = None
    ) -> None:
        """Draw ``snapshot`` (or the last one again); ``order``: the peer ids the table shows, in
        its order; ``first``: the peer under its cursor, drawn whatever its place."""
        self.snapshot = snapshot or self.snapshot
        self.order = order if order is not None else self.order
        s = self.snapshot
        if s is None:
            return
        window = WINDOWS[self.window]
        since = s.time - window
        label = "all" if window == float("inf") else human_duration(window)
        ids = self.order if self.order is not None else sorted(s.peers, key=lambda pid: s.peers[pid].name)
        if first in ids:
            ids = [first, *(pid for pid in ids if pid != first)]
        series = []
        for peer_id in ids:
            points = [(t, v) for t, v in s.history.get(peer_id, {}).get("loss", []) if t >= since]
            if peer_id in s.peers and points:
                series.append((peer_id, points))
        drawn = series[:CHART_PEERS]
        # Past CHART_PEERS lines the chart is unreadable: which ones it shows, said in its title.
        of = f" of {len(drawn)} of {len(series)} peers" if len(series) > len(drawn) else ""
        self.heading = f"loss{of} (window {label}, +/-)"
        self.shown = [peer_id for peer_id, _ in drawn]
        lines = [
            chart.Line(
                s.peers[peer_id].name, [(t - s.time, v) for t, v in points], LINE_STYLES[k % len(LINE_STYLES)]
            )
            for k, (peer_id, points) in enumerate(sorted(drawn, key=lambda item: s.peers[item[0]].name))
        ]
        if len(series) > 1:
            mean = _mean_series([points for _, points in series])
            if mean:
                lines.append(chart.Line("mean", [(t - s.time, v) for t, v in mean], "bold"))
        self.lines = lines
        self.refresh()

    def render(self) -> Text:
        try:
            return chart.render(
                self.lines,
                self.size.width,
                self.size.height,
                title=self.heading,
                xlabel="seconds ago",
                absolute_x=True,
                x_until=0.0,  # the right edge is now
            )
        except Exception as error:  # a chart the data broke: said there, the monitor goes on
            return Text(f"loss chart unavailable: {type(error).__name__}: {error}", style="red")


LINE_STYLES = ("#729fcf", "#8ae234", "#ef2929", "#34e2e2", "#ad7fa8", "#fce94f", "#fcaf3e", "#c17d11")
"""A colour per peer's line, eight that differ on any terminal theme (Tango's; the ANSI names
showed two pairs alike), the mean in the text's own colour, bold."""


BANDWIDTH_WINDOW = 30.0
"""Seconds the bandwidth is averaged over: a peer reports the bytes it sent once per round, so a
rate from one reading to the next read 0 B/s, then a round's bytes in one spike."""


class Rates(Vertical):
    """The swarm's tokens/s and bytes sent/s over the last 120 readings, as sparklines."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._throughput: deque[float] = deque(maxlen=120)
        self._bandwidth: deque[float] = deque(maxlen=120)
        self._sent: dict[str, int] = {}  # each live peer's bytes sent at the last reading
        self._sends: deque[tuple[float, int]] = (
            deque()
        )  # (time, bytes the swarm sent since the reading before)
        self._last_time: float | None = None
        self._first_time = 0.0

    def compose(self) -> ComposeResult:
        yield Label("tokens/s", classes="spark-label", id="throughput-label")
        yield Sparkline([], id="throughput")
        yield Label("bandwidth (bytes sent/s, all peers)", classes="spark-label", id="bandwidth-label")
        yield Sparkline([], id="bandwidth")

    def record(self, snapshot: SwarmSnapshot) -> None:
        """Take a reading (every snapshot, even while the screen is frozen)."""
        self._throughput.append(snapshot.tokens_per_second)
        # What each peer sent since the last reading: a peer that left takes nothing away, and
        # one seen again (after a freeze, or a new one) adds nothing the first time (its whole
        # count read as 504 MB/s).
        sent = {pid: p.bytes_sent for pid, p in snapshot.peers.items()}
        fresh = sum(max(0, now - self._sent[pid]) for pid, now in sent.items() if pid in self._sent)
        self._sent = sent
        if self._last_time is not None and snapshot.time > self._last_time:
            self._sends.append((snapshot.time, fresh))
            while self._sends and self._sends[0][0] <= snapshot.time - BANDWIDTH_WINDOW:
                self._sends.popleft()
            seconds = min(BANDWIDTH_WINDOW, snapshot.time - self._first_time)
            self._bandwidth.append(sum(b for _, b in self._sends) / max(seconds, 1e-9))
        if self._last_time is None:
            self._first_time = snapshot.time
        self._last_time = snapshot.time

    def show(self) -> None:
        self.query_one("#throughput", Sparkline).data = list(self._throughput) or [0.0]
        self.query_one("#bandwidth", Sparkline).data = list(self._bandwidth) or [0.0]
        rate = self._throughput[-1] if self._throughput else 0
        # layout=False: a label's box is one line the column's width (app.tcss), whatever it
        # says; a layout on every reading re-rendered every widget on the screen.
        self.query_one("#throughput-label", Label).update(
            f"tokens/s  [b]{human_rate(rate)}[/b]", layout=False
        )
        bandwidth = self._bandwidth[-1] if self._bandwidth else 0
        self.query_one("#bandwidth-label", Label).update(
            f"bandwidth, all peers  [b]{human_bytes(bandwidth)}/s[/b] [dim](last {BANDWIDTH_WINDOW:.0f} s)[/]",
            layout=False,
        )


class EventLog(RichLog):
    """The swarm's events (joined, left, rounds, steering, lagging, errors), newest last."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(markup=True, wrap=False, max_lines=500, **kwargs)

    def add(self, events: list[Any]) -> None:
        for event in events:
            stamp = time.strftime("%H:%M:%S", time.localtime(event.time))
            # The message is a sentence that says what kind of event it is; the colour says it too.
            self.write(Text.assemble((f"{stamp} ", "dim"), (event.message, EVENT_STYLE.get(event.kind, ""))))


class _NameCell(Text):
    """The name cell, which also knows its row's peer id (for sorting by our own order)."""

    def __init__(self, name: str, peer_id: str, style: str = "") -> None:
        super().__init__(name, style=style, justify="left", end="")
        self.peer_id = peer_id


MEAN_POINTS = 400
"""Points of the mean loss drawn at most (a terminal chart is a few hundred columns wide)."""


def _mean_series(series: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """The mean loss over peers at each time one of them reported (last value carried forward),
    once every peer has reported; thinned to MEAN_POINTS. One pass over the points in time order
    with a running sum: per peer and time it took 0.7-1.8 s a refresh with 200 peers whose
    heartbeats come at different times (stop 57, a review)."""
    events = sorted((t, i, v) for i, points in enumerate(series) for t, v in points)
    latest: list[float | None] = [None] * len(series)
    total, known, mean = 0.0, 0, []
    for index, (t, i, v) in enumerate(events):
        if latest[i] is None:
            known += 1
        else:
            total -= latest[i]
        latest[i] = v
        total += v
        last_at_t = index + 1 == len(events) or events[index + 1][0] != t
        if known == len(series) and last_at_t:
            mean.append((t, total / known))
    if len(mean) > MEAN_POINTS:
        stride = -(-len(mean) // MEAN_POINTS)
        mean = mean[::stride] + ([mean[-1]] if (len(mean) - 1) % stride else [])
    return mean
