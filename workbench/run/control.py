"""The run owner's steering, as one peer applies it (the records: :mod:`swarm.steering`).

New settings (outer lr, H, codec) and checkpoint requests are applied at a round boundary, at
the outer step the owner named, so that every peer changes θ the same way; a pause is honoured
between inner steps, with heartbeats going on."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from swarm.records import EARLIER_KEPT, Stage

logger = logging.getLogger(__name__)

RETUNED = ("outer_lr", "inner_steps", "codec")
"""The settings steering changes through the outer loop's ``retune``."""


def _served_before(latest: Any, outer_step: int) -> int:
    """The checkpoint requests a peer joining at ``outer_step`` does not serve: those of the
    newest version due by then (none due: those before the oldest version the record keeps)."""
    due = latest.due(outer_step, after=0)
    if due is not None:
        return due.checkpoint
    oldest = latest.earlier[-1] if latest.earlier else latest.step()
    # Whether the oldest version asked for one is not kept: if it did, the request is not due
    # yet and must be served; if not, writing one more checkpoint is harmless.
    return 0 if oldest.version == 1 else max(0, oldest.checkpoint - 1)


def steered_problem(config: Any, control: Any) -> str | None:
    """Why a run of ``config`` cannot take ``control``'s outer lr, H and update codec, by the
    rules `workbench start` checks (None: it can). The optimizer's own checks took some of
    them: a trimmed-mean run applied a top-k codec that its start refuses."""
    import dataclasses

    changes = {
        key: value
        for key, value in dict(
            outer_lr=control.outer_lr, inner_steps=control.inner_steps, codec=control.codec
        ).items()
        if value is not None
    }
    if not changes:
        return None
    try:
        dataclasses.replace(config, diloco=dataclasses.replace(config.diloco, **changes))
    except (ValueError, TypeError) as error:
        return str(error)
    return None


def _changes_outer_settings(latest: Any, control: Any) -> bool:
    """Whether ``control`` (a version of the record ``latest``) changes the outer lr, H or codec
    from the version before it, as the record keeps it (the first version: whether it sets
    them; one whose predecessor the record no longer keeps: not known, so not refused)."""
    versions = [latest.step(), *latest.earlier]
    before = next((v for v in versions if v.version < control.version), None)
    if before is None and control.version > 1 and len(latest.earlier) >= EARLIER_KEPT:
        return False
    keys = ("outer_lr", "inner_steps", "codec")
    return any(getattr(control, k) != (getattr(before, k) if before else None) for k in keys)


class Steering:
    """Applies the owner's :class:`swarm.steering.ControlState` versions to one peer.

    ``watcher``: the owner's control record (None: a run without a manifest, no steering);
    ``emit`` (event, **fields), ``publish`` (heartbeat now), ``beat`` (stage) and ``checkpoint``
    (write one, its path or None) are the peer's."""

    def __init__(
        self,
        watcher: Any,
        *,
        name: str,
        peer_id: str,
        joiner: bool,
        emit: Callable[..., None],
        publish: Callable[[], None],
        beat: Callable[[Stage], None],
        checkpoint: Callable[[], Any],
        can_checkpoint: bool = True,
        check: Callable[[Any], str | None] = lambda control: None,
    ) -> None:
        self.watcher = watcher
        self.name, self.peer_id, self.joiner = name, peer_id, joiner
        self.emit, self.publish, self.beat, self.checkpoint = emit, publish, beat, checkpoint
        self.can_checkpoint = can_checkpoint
        self.check = check
        """Why this peer's run cannot take a version's outer lr, H and codec (None: it can)."""
        """False for a peer without a --run-dir: a request it cannot write is not retried."""
        self.version = 0
        """The owner's ControlState version whose settings this peer applied."""
        self.checkpoints = 0
        """Checkpoint requests seen (a counter in the control record)."""
        self.round_seconds: float | None = None
        """The owner's time box for rounds (None: the peer's own ``--round-seconds``)."""
        self.settings: dict[str, Any] = {}
        """Every setting steering changed on this peer, newest value (a checkpoint keeps them)."""
        self.refused: tuple[int, str] = (0, "")
        """The last version refused (nothing of it applied) and why, for the heartbeat: the
        owner's `steer` counted it as applied (a review)."""
        self.joined = False
        """A joiner's first look at the owner's record is taken (the requests it does not serve)."""
        self.owed = 0
        """A checkpoint request not written yet (its counter; 0: none): the peer's checkpoint
        was refused at the time (an overlapped round still averaging), and it is tried again at
        each round boundary until one is written. Once, it was used up unwritten."""

    def apply(self, outer: Any, *, data_parallel: bool) -> None:
        """At a round boundary: adopt the owner's newest settings once their step has come.

        Every peer applies a version at the same outer step (``from_step``), so a new outer lr
        changes θ the same way everywhere. A bad value is logged and skipped, never half-applied.
        """
        if self.watcher is None:
            return
        if self.owed:
            self._write_checkpoint(self.owed, outer)
        latest = self.watcher.poll(force=True)
        if latest is None or latest.version <= self.version:
            return
        if self.version == 0 and self.joiner and not self.joined:
            # A joiner does not replay old checkpoint requests, those due before it came; one not
            # due yet it writes with the others (taking the newest version's count, it never did).
            self.joined = True
            self.checkpoints = _served_before(latest, outer.outer_step_count)
        # The newest version whose step has come (one the owner changed again before this peer
        # read it is in ``earlier``, and applied at its own step, as on the others).
        control = latest.due(outer.outer_step_count, after=self.version)
        if control is None:
            return
        changes: dict[str, Any] = {}
        if not data_parallel:
            try:
                # The run's own rules first (streaming's H divisible by its fragments, no top-k
                # under a trimmed mean...): the optimizer alone took some a run refuses at start.
                problem = self.check(control)
                if problem:
                    raise ValueError(problem)
                changes = outer.retune(
                    outer_lr=control.outer_lr, inner_steps=control.inner_steps, codec=control.codec
                )
            except ValueError as error:
                self._refuse(control, str(error), outer)
                return  # nothing of it (its time box, its checkpoint): never half-applied
        elif _changes_outer_settings(latest, control):
            # A version that changes them is refused whole (the owner's `steer` then says so:
            # it printed "1/1 peers applied", a review, stop 71); later versions carry the same
            # values, and apply (a checkpoint request, a time box), on a joiner too.
            self._refuse(
                control,
                "outer lr, H and update codec do not apply to a data-parallel run (it has no outer step)",
                outer,
            )
            return
        if control.round_seconds is not None and control.round_seconds != self.round_seconds:
            self.round_seconds = control.round_seconds
            changes["round_seconds"] = control.round_seconds
        self.settings.update((k, v) for k, v in changes.items() if k in (*RETUNED, "round_seconds"))
        self.version = control.version
        if control.checkpoint > self.checkpoints:
            changes["checkpoint"] = str(self._write_checkpoint(control.checkpoint, outer))
        self.emit(
            "control_applied", version=control.version, outer_step=outer.outer_step_count, changes=changes
        )
        logger.info("%s: applied control v%d: %s", self.name, control.version, changes or "no change")
        self.publish()

    def _refuse(self, control: Any, why: str, outer: Any) -> None:
        """Apply nothing of ``control``: said in the log, the events and the heartbeat, which the
        owner's `steer` reads (it counted a refused version as applied, a review)."""
        logger.error("%s: control v%d not applied: %s", self.name, control.version, why)
        self.refused = (control.version, why)
        self.version = control.version  # not tried again each round: said once, and refused
        self.emit(
            "control_applied",
            version=control.version,
            outer_step=outer.outer_step_count,
            changes={"error": why},
        )
        self.publish()

    def _write_checkpoint(self, request: int, outer: Any) -> Any:
        """Write the checkpoint of request number ``request``; its path, or None (owed then)."""
        before, self.checkpoints = self.checkpoints, request  # written with this count, so that a
        path = self.checkpoint()  # peer resumed from it does not write it again
        if path is None and self.can_checkpoint:
            self.checkpoints, self.owed = before, request
            logger.info("%s: the checkpoint the owner asked for is tried again at the next round", self.name)
            return None
        if self.owed:
            logger.info(
                "%s: wrote the checkpoint the owner asked for, at outer step %d",
                self.name,
                outer.outer_step_count,
            )
        self.owed = 0
        return path

    def restore(self, version: int, settings: dict[str, Any], outer: Any, *, checkpoints: int = 0) -> None:
        """After a resume: the steered settings the checkpoint was written with, their version
        and the checkpoint requests served (so neither the same version nor the request that
        wrote the checkpoint is applied twice; newer ones still are)."""
        self.version = version
        self.checkpoints = checkpoints
        outer_settings = {k: v for k, v in settings.items() if k in RETUNED}
        if outer_settings:
            outer.retune(**outer_settings)
        if settings.get("round_seconds") is not None:
            self.round_seconds = float(settings["round_seconds"])
        self.settings = dict(settings)

    def wait_while_paused(
        self, outer_step: int, stage: Stage, idle: Callable[[], Any] = lambda: None
    ) -> float:
        """Between inner steps: idle while the owner has this peer paused (heartbeats go on),
        then go back to ``stage``. ``idle()`` runs every 0.2 s meanwhile (the trainer's step
        boundary: a joiner asking for AdamW's state is answered, not kept waiting 5 s). The
        seconds it was paused: the round's time, rate and time box leave them out."""
        if self.watcher is None:
            return 0.0
        control = self.watcher.poll()
        if control is None or not control.pauses(self.peer_id, self.name):
            return 0.0
        start = time.monotonic()
        logger.info("%s: paused by the run owner (control v%d)", self.name, control.version)
        self.emit("paused", version=control.version, outer_step=outer_step)
        while control is not None and control.pauses(self.peer_id, self.name):
            self.beat(Stage.PAUSED)
            idle()
            time.sleep(0.2)
            control = self.watcher.poll()
        logger.info("%s: resumed", self.name)
        self.emit("resumed", outer_step=outer_step)
        self.beat(stage)
        return time.monotonic() - start
