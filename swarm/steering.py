"""Steering: the run owner changes a live run; peers check the signature and apply it.

The owner publishes a versioned :class:`~swarm.records.ControlState` under ``<ns>_control``,
signed with its key (the ``--identity`` file of ``workbench start``). Every peer polls it,
accepts it only from the key whose hash the run manifest names as owner, applies it at its
next safe point (between rounds; a pause between inner steps) and echoes the applied version
in its heartbeat. A control record from anybody else is ignored and logged once.

One API for every front end (CLI, TUI, notebook widgets)::

    steering = Steering(store, keys, owner=manifest.owner)
    steering.publish(outer_lr=0.5, inner_steps=20)      # -> ControlState(version=...)
    steering.pause("peer-3"); steering.resume("peer-3")
    steering.propagation(board.fetch())                  # -> (3, 4): 3 of 4 peers applied it
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Any

from swarm.claims import Ignored
from swarm.errors import SwarmError
from swarm.records import (
    EARLIER_KEPT,
    LONG_TTL,
    MAX_VERSION,
    ControlState,
    ControlStep,
    PeerHeartbeat,
    RunKeys,
    Stage,
    applied,
)
from swarm.store import SignedStore

logger = logging.getLogger(__name__)

CONTROL_TTL = LONG_TTL  # the owner republishes it while it runs
REFUSAL_LOG_SECONDS = 60.0  # at most one line a minute about non-owners' steering records


class ControlWatcher:
    """Peer side: the newest control state signed by the run's owner."""

    def __init__(self, store: SignedStore, keys: RunKeys, owner: str, *, period: float = 2.0) -> None:
        self.store = store
        self.keys = keys
        self.owner = owner
        self.period = period
        self.latest: ControlState | None = None
        self._last_poll = 0.0
        self._rejected = Ignored()  # writers whose changes were refused (bounded)
        self._said = -math.inf  # when the last refusal was logged
        self._unsaid = 0  # keys refused since then, not logged

    def poll(self, *, force: bool = False, strict: bool = False) -> ControlState | None:
        """The owner's newest ControlState (None before the first); reads the DHT at most once
        per ``period`` seconds unless ``force``. A read the DHT does not answer keeps the last
        one seen (``strict``: raises its SwarmError instead)."""
        from swarm.identity import key_hash

        now = time.monotonic()
        if not force and now - self._last_poll < self.period:
            return self.latest
        self._last_poll = now
        try:
            records = self.store.read(self.keys.control, ControlState)
        except SwarmError as error:
            if strict:
                raise
            logger.debug("control poll: %s", error)
            return self.latest
        for public_key, control in records.items():
            writer = key_hash(public_key)
            if writer != self.owner:
                self._refuse(writer, control, now)
                continue
            # The DHT keeps one record per writer's key, the one stored last: two publishes at
            # once (the CLI beside the TUI) made two different records of one version, and a
            # peer that read the first kept it while the others took the second (a review, stop
            # 59). A record of the same version published later is taken: every reader ends on
            # the one the DHT kept (its expiration is its time plus the TTL), and never flips
            # back to the other when a replica answers with it.
            newer = self.latest is None or control.version > self.latest.version
            if newer or (control.version == self.latest.version and control.time > self.latest.time):
                self.latest = control
        if self._unsaid and now - self._said >= REFUSAL_LOG_SECONDS:
            logger.warning(
                "ignored steering changes from %d more key(s): only the run owner %s can steer",
                self._unsaid,
                self.owner,
            )
            self._said, self._unsaid = now, 0
        return self.latest

    def _refuse(self, writer: str, control: ControlState, now: float) -> None:
        """Log a non-owner's steering record once per key, and at most one such line a minute
        (keys are free: a flood of them, or of versions, must not flood the log)."""
        if not self._rejected.add(writer, "steers without being the owner"):
            return
        if now - self._said < REFUSAL_LOG_SECONDS:
            self._unsaid += 1
            return
        more = f" (and {self._unsaid} other key(s) since the last such line)" if self._unsaid else ""
        logger.warning(
            "ignored steering changes from %s (version %d): only the run owner %s can steer%s",
            writer,
            control.version,
            self.owner,
            more,
        )
        self._said, self._unsaid = now, 0


class Steering:
    """Owner side: publish new versions of the run's ControlState."""

    def __init__(self, store: SignedStore, keys: RunKeys, *, owner: str, board=None) -> None:
        from swarm.identity import key_hash

        self.board = board  # to pick the step a change takes effect at
        self.store = store
        self.keys = keys
        self.owner = owner
        self.key = key_hash(store.public_key)
        self.watcher = ControlWatcher(store, keys, owner, period=0.0)

    @property
    def is_owner(self) -> bool:
        return self.key == self.owner

    def why_not(self) -> str | None:
        """Why this key cannot steer the run (for UIs to show next to disabled controls)."""
        if self.is_owner:
            return None
        return (
            f"only the run owner ({self.owner}) can steer; this key is {self.key}: give the owner's "
            "key file (the --identity of `workbench start`, else <run-dir>/identity.key) with --key"
        )

    def current(self) -> ControlState | None:
        return self.watcher.poll(force=True)

    def _read(self) -> ControlState | None:
        """The current record, to build the next version on; SwarmError when the DHT does not
        answer (a version built on nothing restarted at 1: peers past it ignored every change
        up to their own version, and the pause list was dropped)."""
        try:
            return self.watcher.poll(force=True, strict=True)
        except SwarmError as error:
            raise SwarmError(
                f"could not read the run's steering record ({error}): nothing was changed; try again"
            ) from None

    def publish(
        self,
        *,
        outer_lr: float | None = None,
        inner_steps: int | None = None,
        codec: str | None = None,
        paused: list[str] | None = None,
        round_seconds: float | None = None,
        checkpoint: bool = False,
        from_step: int | None = None,
        version: int | None = None,
        pause: list[str] | None = None,
        resume: list[str] | None = None,
    ) -> ControlState:
        """A new version with these changes on top of the current one; raises SwarmError for a
        non-owner or a bad value (nothing is published then). Peers apply it at the start of
        outer step ``from_step`` (default: two rounds after the run's, the upper median of the live
        peers' claimed steps, so every peer has polled it by then). ``version``: number it at
        least this (a resumed owner's settings, past the version its checkpoint holds). ``pause``
        and ``resume``: ids (or names) added to and dropped from the paused list as the record
        holds it now (a UI's list, read seconds earlier, dropped a pause made meanwhile)."""
        from hivemind.utils import get_dht_time
        from pydantic import ValidationError

        reason = self.why_not()
        if reason:
            raise SwarmError(reason)
        current = self._read()
        base = current.model_dump() if current else {"version": 0}
        if pause or resume:
            held = list(paused if paused is not None else base.get("paused", []))
            paused = [p for p in held if p not in set(resume or ())]
            paused += [p for p in dict.fromkeys(pause or ()) if p not in paused]
        updates = dict(
            outer_lr=outer_lr,
            inner_steps=inner_steps,
            codec=codec,
            paused=paused,
            round_seconds=round_seconds,
        )
        fields = {**base, **{k: v for k, v in updates.items() if v is not None}}
        peers = self.board.fetch() if self.board is not None else {}
        counted = {
            i: p for i, p in peers.items() if p.stage not in (Stage.JOINING, Stage.DOWNLOADING, Stage.PAUSED)
        }
        if not counted:  # every peer paused (or joining): the run stands where the paused ones do
            counted = {i: p for i, p in peers.items() if p.stage is Stage.PAUSED}
        # The owner's own peers' heartbeats (signed with its key) are the only claims it need not
        # take on trust: where one trains, it says where the run is. Otherwise the upper median of
        # the live peers' claims (keys are free: more fresh keys than honest peers move it, so
        # with no peer of the owner's live, --from-step is the way to be sure).
        # (Not counted: peers still joining, at step 0 until their download lands, and paused
        # ones, whose step stands still while the others train on; with every peer paused, a
        # resume found no step and the run could not be resumed from the TUI, whose form has no
        # --from-step.)
        writers = getattr(self.board, "writers", {})
        own = [p for i, p in counted.items() if writers.get(i) == self.owner]
        if current is None and peers:
            # No record found: peers may still hold versions of one the DHT lost; a version at or
            # below theirs would be ignored. The owner's own peers' say (unless restarted without
            # their checkpoint, at 0), else the live peers' median; never past half of MAX_VERSION
            # (strangers' claims must not number the owner's changes out of the versions left).
            mine = [p.control_version for p in own]
            held = sorted(p.control_version for p in peers.values())
            floor = max(mine) if mine and max(mine) > 0 else held[len(held) // 2]
            fields["version"] = max(fields["version"], min(floor, MAX_VERSION // 2))
        fields["version"] = max(fields["version"] + 1, version or 0)  # ``version``: at least this
        fields["checkpoint"] = base.get("checkpoint", 0) + (1 if checkpoint else 0)
        fields["time"] = get_dht_time()
        fields["earlier"] = [current.step(), *current.earlier][:EARLIER_KEPT] if current else []
        # A heartbeat is anyone's to sign, and its step a claim: with the most advanced claim, one
        # key claiming 10^9 put every change out of reach (and refused every --from-step).
        steps = sorted(p.outer_step for p in (own or counted.values()))
        if not steps and from_step is None:
            # Nobody whose step says where the run is: a change "two rounds ahead" of 0 was
            # published at outer step 2 of a run at step 1127, and each peer applied it at its
            # own next round.
            others = f"all {len(peers)} live peers are joining or downloading" if peers else "no live peer"
            raise SwarmError(
                f"cannot tell the run's outer step: {others}; try again once a peer trains, or give "
                "the step to apply the change at (`workbench steer --from-step N`; the monitor's form "
                "has no such field)"
            )
        ahead = max(steps) if own else (steps[len(steps) // 2] if steps else -1)
        # Versions apply in order: one due before the version it follows would carry that
        # version's settings to peers before its step.
        floor = current.from_step if current else 0
        replaced: list[ControlStep] = []
        if from_step is None:
            from_step = max(ahead + 2, floor)
            if current is not None and floor > ahead + 2:
                logger.warning(
                    "v%d (%s) is not applied yet, at outer step %d: this change follows it; to replace "
                    "it instead, give --from-step %d (or any step before %d)",
                    current.version, current.changes(), floor, ahead + 2, floor,
                )  # fmt: skip
        elif from_step <= ahead:
            # Each peer would apply it at its next round's start, wherever that is: not together.
            raise SwarmError(
                f"--from-step {from_step}: the run is at outer step {ahead} already, and each peer "
                f"would apply the change at its own next round; use --from-step {ahead + 2} or later "
                "(or leave it out: two rounds ahead)"
            )
        elif current is not None and from_step < floor:
            # The versions not applied yet whose step comes after this one are replaced: this one
            # is made on the settings the peers hold now, and theirs are dropped. Refused before,
            # one --from-step 10^9 held every later change back for the run (a review, stop 71).
            # Not one a live peer may have applied already (a peer claims its step): the record
            # cannot take a setting back to the flags the run started with, and that peer would
            # keep it while the others never take it (a review of the first version).
            reached = max((p.outer_step for p in counted.values()), default=-1)  # (any claim: safe side)
            applied = [v for v in (current.step(), *current.earlier) if from_step < v.from_step <= reached]
            if applied:
                raise SwarmError(
                    f"--from-step {from_step}: v{applied[0].version} ({applied[0].changes()}) applies from outer "
                    f"step {applied[0].from_step}, which a live peer has reached (outer step {reached}): it cannot "
                    f"be replaced; publish the settings you want with --from-step {floor} or later"
                )
            fields, replaced = self._replacing(current, fields, updates, from_step)
        fields["from_step"] = from_step
        try:
            control = ControlState.model_validate(fields)
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
            raise SwarmError(f"invalid steering change: {problems}") from None
        if not self.store.store(self.keys.control, control, ttl=CONTROL_TTL, wait=True):
            raise SwarmError("the DHT did not take the steering change; try again")
        self.watcher.latest = control
        kept = self.watcher.poll(force=True)
        if kept is not None and (kept.version, kept.time) > (control.version, control.time):
            # Another publish with the owner's key at the same moment (another UI, a script):
            # the DHT kept one of the two, and peers take the one it kept.
            raise SwarmError(
                f"another steering change (v{kept.version}: {kept.changes()}) was published at the same "
                f"moment and replaced this one ({control.changes()}); check `workbench status` and "
                "publish again if it is still wanted"
            )
        for version in replaced:  # (said once the replacement is stored, not before)
            logger.warning(
                "replaces v%d (%s from outer step %d), not applied yet: dropped",
                version.version, version.changes(), version.from_step,
            )  # fmt: skip
        logger.info("published control version %d: %s", control.version, control.changes())
        return control

    @staticmethod
    def _replacing(
        current: ControlState, fields: dict[str, Any], updates: dict[str, Any], from_step: int
    ) -> tuple[dict[str, Any], list[ControlStep]]:
        """``fields`` of a new version due at ``from_step``, before versions of ``current`` not
        applied yet: made on the newest version due by then and the ``updates``; and the later
        versions, which it drops."""
        dropped = [v for v in (current.step(), *current.earlier) if v.from_step > from_step]
        held = current.due(from_step, after=0)  # (due by then: kept, and built on)
        settings = ("outer_lr", "inner_steps", "codec", "round_seconds")
        fields = {**fields, **{k: getattr(held, k) if held else None for k in settings}}
        fields.update({k: v for k, v in updates.items() if v is not None and k in settings})
        fields["earlier"] = [v for v in fields["earlier"] if v.from_step <= from_step]
        return fields, dropped

    def pause(self, peer: str) -> ControlState:
        """Pause ``peer`` (its id, or a name only one live peer has: the record names the id)."""
        current = self._read()
        paused = list(current.paused) if current else []
        if self.board is not None:
            peer = live_peer_id(peer, self.board.fetch())
        return self.publish(paused=[*paused, peer] if peer not in paused else paused)

    def resume(self, peer: str) -> ControlState:
        """Resume ``peer`` (its id or name: the live peers it names are resumed, however they
        were paused)."""
        current = self._read()
        names = aliases_of(peer, self.board.fetch()) if self.board is not None else {peer}
        paused = [p for p in (current.paused if current else []) if p not in names]
        return self.publish(paused=paused)

    @staticmethod
    def propagation(peers: Mapping[str, PeerHeartbeat], version: int) -> tuple[int, int]:
        """(peers that applied ``version`` or later, live peers); a paused peer applies nothing
        until it is resumed, so it is not counted."""
        return applied(peers.values(), version)


def aliases_of(peer: str, live: Mapping[str, Any]) -> set[str]:
    """``peer`` and the ids and names of the live peers it names (by id or by name): what a
    resume drops from the paused list, whichever way each was paused."""
    return {peer} | {x for i, p in live.items() if peer in (i, p.name) for x in (i, p.name)}


def live_peer_id(peer: str, live: Mapping[str, Any]) -> str:
    """The id of the one live peer (``live``: peer id -> anything with a ``name``) that ``peer``
    names, by id or by name; SwarmError if none does, or several share that name (a name is
    anyone's to take: a pause must name the id, or it would pause them all)."""
    ids = sorted(i for i, p in live.items() if peer in (i, p.name))
    if not ids:
        names = ", ".join(sorted(p.name for p in live.values())) or "none"
        raise SwarmError(f"no live peer is named {peer} (live: {names}): check `workbench status`")
    if len(ids) > 1:
        raise SwarmError(
            f"{len(ids)} live peers are named {peer} ({', '.join(ids)}): pause one by its peer id"
        )
    return ids[0]
