"""The owner's console in the monitor: steering the run and injecting faults into local
peers, through the source (it holds no networking of its own)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.text import Text
from textual import on, work
from textual.message import Message

from swarm.errors import SwarmError
from swarm.faults import FaultRequest
from tui.polling import PolledApp
from tui.screens import FaultScreen, SteerScreen
from tui.widgets import EventLog


class OwnerConsole(PolledApp):
    """Steering (``e``) and fault injection (``f``): the app's ``snapshot``, ``source``,
    ``published``, :meth:`selected_peer` and :meth:`render_summary` are SwarmApp's."""

    class Published(Message):
        """Steering the publishing thread published, for the UI thread."""

        def __init__(self, state: Any) -> None:  # (Message.control is Textual's: the sender widget)
            super().__init__()
            self.state = state

    def action_steer(self) -> None:
        control = self.snapshot.control if self.snapshot else None
        current = control.model_dump() if control else {}
        paused = list(control.paused) if control else []
        peer = self.selected_peer()
        left = peer is not None and self.snapshot is not None and peer[0] not in self.snapshot.peers
        if left and not (peer[0] in paused or peer[1] in paused):
            peer = None  # a peer that left: nothing to pause (`workbench steer` refuses it too)
        draft, self.unpublished = self.unpublished, None
        toggled = (draft or {}).get("pause") or (draft or {}).get("resume")
        if toggled:  # the failed publish's pause or resume, whichever row the cursor is on now
            known = self.snapshot.peers.get(toggled[0]) if self.snapshot else None
            peer = (toggled[0], toggled[1] if len(toggled) > 1 else known.name if known else toggled[0])
        # The H the peers train with, for the form's hint: the record holds only steered values
        # (it said "unchanged", a review, stop 71); the most common among live heartbeats.
        counts = Counter(
            p.inner_steps for p in (self.snapshot.peers.values() if self.snapshot else ()) if p.inner_steps
        )
        screen = SteerScreen(
            reason=self.source.steering_reason(),
            current=current,
            peer=peer,
            paused=paused,
            draft=draft,
            running_h=counts.most_common(1)[0][0] if counts else None,
        )
        self.push_screen(screen, self._steer_chosen)

    unpublished: dict[str, Any] | None = None
    """What a publish that failed sent: the next steering form starts with it (it was lost)."""

    def _steer_chosen(self, changes: dict[str, Any] | None) -> None:
        if changes:
            self.notify("publishing...", timeout=3)
            self.publish(changes)

    @work(thread=True, exclusive=True, group="steer")
    def publish(self, changes: dict[str, Any]) -> None:
        try:
            control = self.source.steer(**changes)
        except Exception as error:  # noqa: BLE001 - a DHT gone (BrokenPipeError...) ended the app
            self.unpublished = changes
            why = (
                str(error)
                if isinstance(error, (SwarmError, ValueError))
                else f"{type(error).__name__}: {error}"
            )
            self.notify(f"{why} (press e: the form keeps what you entered)", severity="error", timeout=10)
            return
        self.post_message(self.Published(control))

    @on(Published)
    def _published(self, message: Published) -> None:
        control = self.published = message.state
        self.notify(f"published control v{control.version}, applied from outer step {control.from_step}")
        if self.snapshot is not None:
            self.render_summary()

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
        stopped = faults is not None and faults.stopped(peer[0])
        self.push_screen(
            FaultScreen(name=peer[1], reason=reason, stopped=stopped),
            lambda choice: self._fault_chosen(peer, choice),
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
        self.query_one("#events", EventLog).write(Text.assemble(("   fault ", "bold red"), message))
