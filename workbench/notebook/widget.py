"""`SwarmWidget`: the live swarm view in Jupyter (anywidget; JS in widget.js, shipped here).

Python side: a thread polls a :class:`~workbench.sources.SnapshotSource` and syncs the
snapshot to the front end; the front end sends commands (pause/resume a peer, steer outer lr
and H) by setting the ``command`` trait, handled here through the same steering API the
terminal UI uses. Where no widget front end runs (nbconvert, GitHub), the notebook shows a
static HTML table of the last snapshot instead.
"""

from __future__ import annotations

import html
import logging
import math
import threading
from pathlib import Path
from typing import Any

import anywidget
import traitlets

from swarm import bounds
from swarm.errors import SwarmError
from swarm.monitor import strict_json
from swarm.steering import aliases_of, live_peer_id

logger = logging.getLogger(__name__)

STEERABLE = ("outer_lr", "inner_steps", "round_seconds", "codec")
POLL_FAILED = "poll failed: "  # a poll's message, cleared by the next good poll


class SwarmWidget(anywidget.AnyWidget):
    _esm = Path(__file__).with_name("widget.js")

    title = traitlets.Unicode("").tag(sync=True)
    snapshot = traitlets.Dict().tag(sync=True)
    """SwarmSnapshot.to_json() of the latest reading."""
    loss_series = traitlets.Dict().tag(sync=True)
    """Peer name (and "mean") -> [[seconds ago, loss], ...] for the chart."""
    steer_reason = traitlets.Unicode(None, allow_none=True).tag(sync=True)
    """Why the controls are disabled (None: this notebook can steer)."""
    message = traitlets.Unicode("").tag(sync=True)
    """The outcome of the last command, shown under the controls."""
    command = traitlets.Dict().tag(sync=True)
    """Set by the front end: {"action": "pause"|"resume"|"steer", ...}."""

    def __init__(
        self, source, *, interval: float | None = None, autostart: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        if interval is not None:
            interval = bounds.check("interval", interval)  # seconds between polls
        self.source = source
        self.title = source.title
        self.interval = interval or source.interval
        self.last = None
        self._published: Any = None  # the ControlState this widget last published
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.observe(self._on_command, names="command")
        self.refresh()
        if autostart:
            self.start()

    # --- polling ---------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="swarm-widget", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        """Poll every ``interval`` until stop(), or until the run is over: its last state read,
        nothing more will change (a thread per widget kept polling a finished run for good)."""
        while not self._stop.wait(self.interval):
            over = getattr(self.source, "ended", False)  # before the read: it then holds the end
            try:
                self.refresh()
            except Exception as error:  # a poll hiccup: keep the last view, say so
                self.message = f"{POLL_FAILED}{error}"
            else:
                if self.message.startswith(POLL_FAILED):  # (it stayed after the DHT answered again)
                    self.message = ""
            if over:
                return

    def refresh(self) -> None:
        """Read the source once and sync the view."""
        snapshot = self.source.poll()
        self.last = snapshot
        self.steer_reason = self.source.steering_reason()
        series: dict[str, dict[str, Any]] = {}  # by peer id: a name is anyone's to take
        for peer_id, peer in snapshot.peers.items():
            points = snapshot.history.get(peer_id, {}).get("loss", [])[-120:]
            if points:
                series[peer_id] = {
                    "label": f"{peer.name} ({peer_id[-8:]})",
                    # A diverged run's NaN would make the whole chart's scale NaN.
                    "points": [[round(t - snapshot.time, 2), v] for t, v in points if math.isfinite(v)],
                }
        self.loss_series = series
        # NaN as null (shown "-"): JSON has no NaN, and Jupyter sent a diverged run's through a
        # deprecated fallback, with a warning in the kernel's log each poll
        self.snapshot = strict_json(snapshot.to_json())

    # --- commands ----------------------------------------------------------------------------------

    def _on_command(self, change: dict[str, Any]) -> None:
        command = dict(change["new"] or {})
        if not command:
            return
        try:
            self.message = self.handle(command)
        except (SwarmError, ValueError, TypeError) as error:
            self.message = f"refused: {error}"
        except Exception as error:  # noqa: BLE001 - a front end's click: said in the widget, not lost in the kernel's log
            logger.warning("widget command %s failed", command.get("action"), exc_info=True)
            self.message = f"failed: {type(error).__name__}: {error}"

    def handle(self, command: dict[str, Any]) -> str:
        """Run one front-end command; returns what to tell the user (ValueError or SwarmError,
        naming what was wrong, for a command that cannot be run: nothing is published then)."""
        action = command.get("action")
        control = self.last.control if self.last is not None else None
        if self._published is not None and (control is None or self._published.version > control.version):
            # Published here since the last poll: a pause just made was "not paused" until the
            # next read (a notebook's pause then resume refused the resume, and the peer stayed paused)
            control = self._published
        paused = list(control.paused) if control else []
        if action in ("pause", "resume"):
            peer = command.get("peer")
            if not isinstance(peer, str) or not peer:
                raise ValueError(f"{action} needs a peer: its id or its name (got {peer!r})")
            live = self.last.peers if self.last is not None else {}
            if action == "pause":
                target = live_peer_id(peer, live)  # by id: a name can be shared
                if target in paused:
                    raise ValueError(f"{peer} is already paused")
                result = self.source.steer(pause=[target])  # on the record as it is now
            else:
                aliases = aliases_of(peer, live)
                if not aliases & set(paused):
                    raise ValueError(f"{peer} is not paused (paused: {', '.join(paused) or 'nobody'})")
                result = self.source.steer(resume=sorted(aliases))
        elif action == "steer":
            unknown = sorted(set(command) - {"action", "nonce", *STEERABLE})
            if unknown:
                raise ValueError(f"cannot steer {', '.join(unknown)}: choose from {', '.join(STEERABLE)}")
            changes = {k: command[k] for k in STEERABLE if command.get(k) is not None}
            if not changes:
                raise ValueError("nothing to change: give an outer lr, H, round seconds or a codec")
            for name in ("outer_lr", "inner_steps", "round_seconds"):  # the flags' bounds
                if name in changes:
                    changes[name] = bounds.check(name, changes[name])
            if "codec" in changes and changes["codec"] not in bounds.UPDATE_CODECS:
                raise ValueError(
                    f"unknown codec {changes['codec']!r} (choose from {', '.join(bounds.UPDATE_CODECS)})"
                )
            result = self.source.steer(**changes)
        else:
            raise ValueError(f"unknown command {action!r}: pause, resume or steer")
        self._published = result
        return f"published control v{result.version} (applied from outer step {result.from_step})"

    def steer(self, **changes: Any) -> str:
        """The same path as the widget's steer button, from Python."""
        return self.handle({"action": "steer", **changes})

    # --- static fallback ------------------------------------------------------------------------------

    def _repr_mimebundle_(self, **kwargs: Any):
        bundle = super()._repr_mimebundle_(**kwargs)
        data, metadata = bundle if isinstance(bundle, tuple) else (bundle, {})
        data = dict(data or {})
        data["text/html"] = self.static_html()
        return data, metadata

    def static_html(self) -> str:
        """The last snapshot as a plain HTML table (what nbconvert and GitHub show)."""
        snap = self.snapshot or {}
        rows = "".join(
            "<tr>"
            + "".join(
                f"<td>{html.escape(str(v))}</td>"
                for v in (
                    p["name"],
                    p["stage"],
                    p["outer_step"],
                    f"{p['inner_step']}/{p['inner_steps']}",
                    p.get("last_round_steps") or "-",
                    "-" if p["loss"] is None else f"{p['loss']:.3f}",
                    "-" if p.get("idle") else f"{p['samples_per_second']:.1f}",
                    p["bytes_sent"],
                )
            )
            + "</tr>"
            for p in snap.get("peers", [])
        )
        head = "".join(
            f"<th>{h}</th>"
            for h in ("name", "stage", "outer", "inner", "last H", "loss", "samples/s", "bytes sent")
        )
        return (
            f"<div><b>{html.escape(self.title)}</b>: round {snap.get('outer_round', 0)}, "
            f"{len(snap.get('peers', []))} peers (static view: run the notebook for the live widget)"
            f"<table><tr>{head}</tr>{rows}</table>"
            + "".join(
                f"<div>ignored {html.escape(liar['peer_id'][-8:])}: {html.escape(liar['reason'])}</div>"
                for liar in snap.get("ignored", [])
            )
            + "</div>"
        )
