"""Modal screens: peer detail, steering form and confirmation, fault injection, help."""

from __future__ import annotations

import time
from typing import Any

from rich.markup import escape
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label, Markdown, Select, Static

from swarm import bounds
from swarm.faults import Fault, FaultRequest
from swarm.monitor import SwarmSnapshot
from swarm.records import IDLE
from tui.format import human_bytes, human_duration

HELP = """\
# Swarm monitor: keys

| key | action |
|---|---|
| `↑` `↓` / mouse | move in the peers table |
| `enter` | details of the highlighted peer |
| `s` / click a header | sort by the next column / that column (again: reverse) |
| `/` | filter peers by name, stage, device or id (`esc` clears) |
| `e` | steer the run: outer lr, H, codec, pause/resume a peer (run owner only) |
| `f` | inject a fault into the highlighted peer (peers this demo launched) |
| `p` | pause / resume screen updates (polling goes on) |
| `+` `-` | widen / narrow the loss chart's time window |
| `m` | maximize the focused panel (`esc` restores) |
| `x` | export the current snapshot as JSON |
| `c` | clear the peers that left from the table (they go by themselves after 5 minutes) |
| `ctrl+p` | command palette: steer, export, screenshot, themes (ANSI fallback) |
| `?` / `f1` | this help |
| `q` / `ctrl+c` | quit |

The summary line: run, outer round, live peers (clients: peers that accept no inbound
connections), tokens per second, bytes sent against what data-parallel training would have
sent for the same steps, the estimated time left, and the steering state.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark,f1", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="dialog"):
            yield Markdown(HELP)
            yield Button("Close", id="close", variant="primary")

    @on(Button.Pressed, "#close")
    def close(self) -> None:
        self.dismiss()


class PeerScreen(ModalScreen[None]):
    """One peer: its latest heartbeat, addresses, history and recent events."""

    BINDINGS = [Binding("escape,q", "dismiss", "Close")]

    def __init__(self, snapshot: SwarmSnapshot, peer_id: str) -> None:
        super().__init__()
        self.snapshot = snapshot
        self.peer_id = peer_id

    def compose(self) -> ComposeResult:
        p = self.snapshot.peers.get(self.peer_id)
        gone = self.snapshot.departed.get(self.peer_id)
        with VerticalScroll(id="dialog"):
            if p is None and gone is not None:
                when = time.strftime("%H:%M:%S", time.localtime(gone.time))
                yield Label(
                    f"{escape(gone.heartbeat.name)} left the run at {when} ({escape(gone.how)}), at outer step "
                    f"{gone.heartbeat.outer_step}."
                )
            elif p is None:
                yield Label("This peer has left the run.")
            else:
                yield Static(Text.from_markup(f"[b]{escape(p.name)}[/b]  [dim]{escape(p.peer_id)}[/dim]"))
                rows: list[tuple[str, Any]] = [
                    ("stage", p.stage.value),
                    ("device", p.device),
                    ("outer step", p.outer_step),
                    ("inner step", f"{p.inner_step}/{p.inner_steps}"),
                    ("loss", "-" if p.loss is None else f"{p.loss:.4f}"),
                    # a peer training nothing now (paused, downloading...) carries its last round's
                    (
                        "samples/s" + (" (last round)" if p.stage in IDLE else ""),
                        f"{p.samples_per_second:.1f}",
                    ),
                    ("tokens/s" + (" (last round)" if p.stage in IDLE else ""), f"{p.tokens_per_second:.0f}"),
                    ("sent / received", f"{human_bytes(p.bytes_sent)} / {human_bytes(p.bytes_received)}"),
                    ("data-parallel would have sent", human_bytes(p.dp_bytes)),
                    ("last round", human_duration(p.last_round_seconds)),
                    ("inner steps last round", p.last_round_steps or "-"),
                    (
                        "waits: mate / group / avg",
                        f"{p.round_wait_seconds:.1f} s / {p.matchmaking_window_seconds:.1f} s / "
                        f"{p.averaging_deadline_seconds:.1f} s"
                        if p.round_wait_seconds
                        else "-",
                    ),
                    ("group size", p.group_size or "-"),
                    ("last round's group", _last_round(p)),
                    ("control version", p.control_version or "-"),
                    ("last problem", p.last_error or "-"),
                    ("addresses", "\n".join(p.addresses) or "none (client mode)"),
                ]
                lines = []
                for key, value in rows:
                    text = str(value).replace("\n", "\n" + " " * 32)
                    lines.append(f"[dim]{key:>30}[/]  {escape(text)}")
                yield Static("\n".join(lines), id="facts")
                history = self.snapshot.history.get(self.peer_id, {})
                losses = [v for _, v in history.get("loss", [])][-60:]
                if losses:
                    yield Label(f"loss, last {len(losses)} heartbeats: {losses[0]:.3f} -> {losses[-1]:.3f}")
                    from textual.widgets import Sparkline

                    yield Sparkline(losses, id="peer-loss")
            events = [e for e in self.snapshot.events if e.peer_id == self.peer_id][-12:]
            yield Label("recent events" if events else "no events yet", classes="section")
            for event in events:
                when = time.strftime("%H:%M:%S", time.localtime(event.time))
                yield Static(f"[dim]{when}[/dim] {escape(event.message)}")
            yield Button("Close", id="close", variant="primary")

    @on(Button.Pressed, "#close")
    def close(self) -> None:
        self.dismiss()


FIELDS = (
    ("outer-lr", "outer_lr", "outer lr"),
    ("inner-steps", "inner_steps", "inner steps H"),
    ("round-seconds", "round_seconds", "round seconds"),
)
"""The steering form's number fields: (input id, bound and change name, label)."""


class SteerScreen(ModalScreen[dict[str, Any] | None]):
    """The steering form; returns the changes to publish (after a confirmation) or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(
        self,
        *,
        reason: str | None,
        current: dict[str, Any],
        peer: tuple[str, str] | None,
        paused: list[str],
        draft: dict[str, Any] | None = None,
        running_h: int | None = None,
    ) -> None:
        super().__init__()
        self.reason = reason
        self.current = current
        self.running_h = running_h  # the H most live peers train with (unsteered: not in the record)
        self.peer = peer  # (peer id, name) of the highlighted row
        self.paused = paused
        self.draft = draft or {}  # what a publish that failed sent: the form starts with it
        self.changes: dict[str, Any] = {}

    def _drafted(self, key: str) -> str:
        value = self.draft.get(key)
        return "" if value is None else str(value)

    def on_mount(self) -> None:
        # The first box takes the keys at once: the dialog had the focus, and a user typing a
        # value typed into nothing until Tab (a review, stop 71).
        first = self.query_one("#outer-lr", Input)
        if not first.disabled:
            first.focus()

    def compose(self) -> ComposeResult:
        disabled = self.reason is not None
        with VerticalScroll(id="dialog"):
            yield Label("[b]Steer the run[/b]  (applied by every peer at the same outer step)")
            if disabled:
                yield Label(f"[b red]Disabled:[/b red] {self.reason}", id="reason")
            with Grid(id="form"):
                yield Label("outer lr")
                yield Input(
                    self._drafted("outer_lr"),
                    placeholder=str(self.current.get("outer_lr") or "unchanged"),
                    id="outer-lr",
                    disabled=disabled,
                )
                yield Label("inner steps H")
                yield Input(
                    self._drafted("inner_steps"),
                    placeholder=str(
                        self.current.get("inner_steps")
                        or (f"unchanged ({self.running_h} now)" if self.running_h else "unchanged")
                    ),
                    id="inner-steps",
                    disabled=disabled,
                )
                yield Label("round seconds")
                yield Input(
                    self._drafted("round_seconds"),
                    placeholder=str(self.current.get("round_seconds") or "unchanged (0: H steps)"),
                    id="round-seconds",
                    disabled=disabled,
                )
                yield Label("codec")
                yield Select(
                    [(name, name) for name in bounds.UPDATE_CODECS],
                    prompt=str(self.current.get("codec") or "unchanged"),
                    value=self.draft.get("codec") or Select.NULL,
                    id="codec",
                    disabled=disabled,
                )
                if self.peer is not None:
                    peer_id, name = self.peer
                    is_paused = peer_id in self.paused or name in self.paused
                    yield Label("peer")
                    drafted = peer_id in (self.draft.get("resume") or self.draft.get("pause") or [])
                    yield Checkbox(
                        f"{'resume' if is_paused else 'pause'} {escape(name)}",
                        drafted,
                        id="toggle-pause",
                        disabled=disabled,
                    )
                yield Label("checkpoint")
                yield Checkbox(
                    "every peer writes one now",
                    bool(self.draft.get("checkpoint")),
                    id="checkpoint",
                    disabled=disabled,
                )
            yield Label("", id="error")
            yield Label("", id="confirm")
            with Horizontal(id="buttons"):
                yield Button("Review", id="review", variant="primary", disabled=disabled)
                yield Button("Publish", id="publish", variant="warning", disabled=True)
                yield Button("Cancel", id="cancel")

    def _read(self) -> dict[str, Any]:
        changes: dict[str, Any] = {}
        for field, name, label in FIELDS:
            value = self._number(field, name, label)
            if value is not None:  # round seconds: time-boxed rounds (0 turns them off)
                changes[name] = value
        codec = self.query_one("#codec", Select).selection  # None while blank
        if codec is not None:
            changes["codec"] = codec
        toggles = self.query("#toggle-pause")
        if toggles and toggles.first(Checkbox).value and self.peer is not None:
            peer_id, name = self.peer
            # As changes to the record as it is when published (the list shown was read a poll
            # ago: another pause made meanwhile would be dropped).
            if peer_id in self.paused or name in self.paused:
                changes["resume"] = [peer_id, name]
            else:
                changes["pause"] = [peer_id]  # names are anyone's to take: the id
        if self.query_one("#checkpoint", Checkbox).value:
            changes["checkpoint"] = True
        return changes

    def _number(self, field: str, name: str, label: str) -> float | None:
        """The field's value within ``name``'s bounds (as the flags and every peer check them,
        :mod:`swarm.bounds`), None if blank; ValueError naming the field otherwise. Plain text:
        the number inputs dropped what they did not take (0,5 became 05, 2.5 became 25)."""
        text = self.query_one(f"#{field}", Input).value.strip()
        if not text:
            return None
        bound = bounds.BOUNDS[name]
        try:
            value = float(text)
        except ValueError:
            hint = f" (a decimal point, not a comma: {text.replace(',', '.')})" if "," in text else ""
            raise ValueError(f"{label}: {text!r} is not a number{hint}") from None
        if bound.integer and value.is_integer() and abs(value) < 2**53:
            value = int(value)
        try:
            return bounds.check(name, value)
        except ValueError:
            kind = "a whole number " if bound.integer else ""
            raise ValueError(f"{label} must be {kind}{bound.describe()} (got {text})") from None

    @on(Button.Pressed, "#review")
    def review(self) -> None:
        error, confirm = self.query_one("#error", Label), self.query_one("#confirm", Label)
        try:
            self.changes = self._read()
        except ValueError as problem:
            error.update(f"[red]{escape(str(problem))}[/red]")
            return
        error.update("")
        if not self.changes:
            confirm.update("Nothing to change.")
            return
        listed = ", ".join(f"{k} = {v}" for k, v in self.changes.items())
        confirm.update(f"Publish a new control version with {listed}?")
        self.query_one("#publish", Button).disabled = False
        self.query_one("#publish", Button).focus()

    @on(Input.Changed)
    @on(Select.Changed)
    @on(Checkbox.Changed)
    def _edited(self) -> None:
        """An edit after Review: Publish would send what was reviewed, not what the form says."""
        publish = self.query_one("#publish", Button)
        if not publish.disabled:
            publish.disabled = True
            self.query_one("#confirm", Label).update("Changed since the review: press Review again.")

    @on(Button.Pressed, "#publish")
    def publish(self) -> None:
        self.dismiss(self.changes)

    @on(Button.Pressed, "#restart")
    def restart(self) -> None:
        self.dismiss(FaultRequest(Fault.RESTART))

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class FaultScreen(ModalScreen[FaultRequest | None]):
    """Fault injection for one peer this machine launched; returns the request or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    FAULTS = [
        (
            FaultRequest(Fault.KILL),
            "Kill (SIGKILL): the round falls back, the peer stays dimmed in the table (restart it here)",
        ),
        (
            FaultRequest(Fault.FREEZE, 30.0),
            "Freeze 30 s (SIGSTOP): a straggler that catches up by downloading state",
        ),
        (FaultRequest(Fault.THROTTLE, 500), "Throttle: 500 ms extra per inner step"),
        (FaultRequest(Fault.THROTTLE, 0), "Remove the throttle"),
        (FaultRequest(Fault.CORRUPT), "Send a corrupt (NaN) update next round: the group rejects it"),
        (
            FaultRequest(Fault.OVERSIZE),
            "Send 1000x the update it declares next round: the group refuses the round",
        ),
        (
            FaultRequest(Fault.OVERCLAIM),
            "Claim 1e9 samples next round: the group counts it as 16x the others, not the whole mean",
        ),
    ]

    def __init__(self, *, name: str, reason: str | None, stopped: bool = False) -> None:
        super().__init__()
        self.peer_name = name
        self.reason = reason
        self.stopped = stopped

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="dialog"):
            if self.stopped:  # a demo peer that was killed or exited: it can only be brought back
                yield Label(f"[b]{escape(self.peer_name)} is not running[/b]")
                yield Button(
                    "Restart: the same identity and run dir; it downloads the state and rejoins",
                    id="restart",
                    variant="primary",
                )
                yield Button("Cancel", id="cancel")
                return
            yield Label(f"[b]Inject a fault into {escape(self.peer_name)}[/b]")
            if self.reason:
                yield Label(f"[b red]Disabled:[/b red] {self.reason}", id="reason")
            for index, (_, text) in enumerate(self.FAULTS):
                yield Button(text, id=f"fault-{index}", disabled=self.reason is not None, classes="fault")
            yield Button("Cancel", id="cancel")

    @on(Button.Pressed, ".fault")
    def chosen(self, event: Button.Pressed) -> None:
        request, _ = self.FAULTS[int(str(event.button.id).split("-")[1])]
        self.dismiss(request)

    @on(Button.Pressed, "#restart")
    def restart(self) -> None:
        self.dismiss(FaultRequest(Fault.RESTART))

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


def _last_round(p: Any) -> str:
    """Who came last to this peer's last round and how late, or why it stepped alone."""
    if p.last_round_alone:
        return f"stepped alone: {p.last_round_alone}"
    if p.last_round_last:
        return f"{p.group_size} peers, {p.last_round_last} came last, {p.last_round_spread:.1f} s after the first"
    return "-"
