"""The swarm monitor: one truthful view of a run for every front end.

:class:`SwarmMonitor` turns raw readings of the DHT (every peer's heartbeat, the manifest
and the owner's control state) into a :class:`SwarmSnapshot`: live peers, per-metric history
bounded (older points thinned), and derived events (joined, left, round done, control applied, lagging).
The TUI, the notebook widgets, ``workbench status`` and the tests all read snapshots.

Readings can be recorded to a JSONL file and replayed: a replay feeds the recorded readings
through the same derivation, so it yields the same snapshots the live monitor did.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from swarm.claims import Ignored
from swarm.errors import SwarmError
from swarm.narration import DEPARTED_SECONDS, Departed, RoundSeen, left_how, round_sentence
from swarm.records import (
    IDLE,
    PEER_ID_PATTERN,
    RUN_ID_PATTERN,
    ControlState,
    PeerHeartbeat,
    RunManifest,
    Stage,
    applied,
    mate_tag,
    parse_record,
    printable,
)

logger = logging.getLogger(__name__)

METRICS = ("loss", "samples_per_second", "bytes_sent", "bytes_received", "outer_step", "last_round_seconds")
"""Per-peer heartbeat fields kept as history."""

RECORD_FORMAT = "workbench-monitor/1"


@dataclass(frozen=True)
class Reading:
    """One raw observation of the run (what a recording stores, one JSON line each)."""

    time: float
    run_id: str
    peers: dict[str, PeerHeartbeat]
    """Every heartbeat found, "leaving" ones included, by peer id."""
    manifest: RunManifest | None = None
    control: ControlState | None = None
    ignored: dict[str, str] = field(default_factory=dict)
    """Peers caught lying, by peer id: by this reader (absurd heartbeats) or by most live peers."""
    owner_peer: str | None = None
    """The peer id whose heartbeat the run's owner signed (the manifest's key), if one is live:
    whose flags, and whose round mates' flags, the monitor counts (:func:`owners_mates`)."""
    anchors: tuple[str, ...] = ()
    """The peers this reader trusts: the ones it joined the run through (the multiaddrs its user
    gave) and the peers it runs. When the monitor knows no owner's peer (it left), the live ones
    among them and their round mates vote on flags in its place (:func:`_ignored`)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "run_id": self.run_id,
            "ignored": dict(self.ignored),
            "owner_peer": self.owner_peer,
            "anchors": list(self.anchors),
            "peers": [p.model_dump(mode="json") for p in self.peers.values()],
            "manifest": self.manifest.model_dump(mode="json") if self.manifest else None,
            "control": self.control.model_dump(mode="json") if self.control else None,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Reading:
        """A recorded reading; ValueError for anything but the shape :meth:`to_json` writes.
        A heartbeat no live read would take (:func:`swarm.claims.implausible`: a NaN loss,
        which crashed the TUI's charts) is left out, as a live read leaves it out."""
        from swarm.claims import implausible

        if not isinstance(data, dict):
            raise ValueError(f"a reading is a JSON object, not {type(data).__name__}")
        listed, ignored = data.get("peers") or [], data.get("ignored") or {}
        if not isinstance(listed, list) or not isinstance(ignored, dict):
            raise ValueError("a reading's peers are a list and its ignored peers an object")
        owner_peer = data.get("owner_peer")  # (absent in recordings before 2026-12-07)
        if owner_peer is not None and not (
            isinstance(owner_peer, str) and re.fullmatch(PEER_ID_PATTERN, owner_peer)
        ):
            raise ValueError(f"a reading's owner_peer is a peer id, not {owner_peer!r}")
        anchors = data.get("anchors")  # (absent in recordings before 2026-12-07, stop 69)
        anchors = [] if anchors is None else anchors
        if not (
            isinstance(anchors, list)
            and len(anchors) <= MAX_ANCHORS
            and all(isinstance(a, str) and re.fullmatch(PEER_ID_PATTERN, a) for a in anchors)
        ):
            raise ValueError(f"a reading's anchors are at most {MAX_ANCHORS} peer ids, not {anchors!r}")
        # A recording is a file somebody may hand over (a review, stop 69): its time went to
        # time.localtime (NaN, 1e20: a traceback), its run id into Rich markup and the terminal
        # ("[/b]": a traceback; "\x1b[2J": the screen cleared), its reasons unbounded.
        when = data["time"]
        if isinstance(when, bool) or not isinstance(when, (int, float)) or not 0 <= when <= MAX_TIME:
            raise ValueError(f"a reading's time is seconds since 1970, not {str(when)[:40]!r}")
        when = float(when)
        run_id = data["run_id"]
        if not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id):
            raise ValueError(f"a reading's run_id is a run id, not {str(run_id)[:80]!r}")
        if len(ignored) > MAX_IGNORED or not all(
            isinstance(k, str) and re.fullmatch(PEER_ID_PATTERN, k) and isinstance(v, str) and len(v) <= 1000
            for k, v in ignored.items()
        ):
            raise ValueError(
                f"a reading's ignored peers are at most {MAX_IGNORED} peer ids, each with a reason of "
                "up to 1,000 characters"
            )
        peers = [parse_record(PeerHeartbeat, p) for p in listed]
        return cls(
            time=when,
            run_id=run_id,
            peers={p.peer_id: p for p in peers if p is not None and implausible(p, when) is None},
            manifest=parse_record(RunManifest, data["manifest"]) if data.get("manifest") else None,
            control=parse_record(ControlState, data["control"]) if data.get("control") else None,
            ignored={k: printable(v) for k, v in ignored.items()},
            owner_peer=owner_peer,
            anchors=tuple(anchors),
        )


MAX_ANCHORS = 64
"""Peers a reader trusts (each from a multiaddr its user gave): more are left out."""
MAX_TIME = 1e11
"""A recorded reading's time, at most (the year 5138): past it ``time.localtime`` fails."""
MAX_IGNORED = 4096
"""Ignored peers a recorded reading may list (a live reader remembers 1,024)."""


def strict_json(value: Any) -> Any:
    """``value`` with NaN and ±inf as None: JSON has no such numbers (jq, JavaScript and
    strict parsers refuse Python's ``NaN``), for `status --json` and the TUI's export."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


@dataclass(frozen=True)
class MonitorEvent:
    time: float
    kind: str
    """joined | present | left | round | control | lagging | error | ignored ("present": in the
    run at this monitor's first reading, which cannot tell when it joined)"""
    message: str
    peer_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"time": self.time, "kind": self.kind, "message": self.message, "peer_id": self.peer_id}


@dataclass
class SwarmSnapshot:
    """The run as of one reading."""

    time: float
    run_id: str
    peers: dict[str, PeerHeartbeat]
    """Live peers by peer id (a leaving peer is gone)."""
    history: dict[str, dict[str, list[tuple[float, float]]]]
    """peer id -> metric -> [(time, value)], oldest first (bounded: older points thinned, see :class:`Trail`)."""
    events: list[MonitorEvent]
    """Recent events, oldest first."""
    new_events: list[MonitorEvent]
    """The events this reading produced."""
    manifest: RunManifest | None = None
    control: ControlState | None = None
    outer_round: int = 0
    """The swarm's round: the outer step at least half the training peers claim (the upper
    median, :func:`swarm_round`), not the most advanced claim (one fresh key could set it)."""
    lagging: list[str] = field(default_factory=list)
    """Peer ids more than one round behind."""
    ignored: dict[str, str] = field(default_factory=dict)
    """Peers ignored for lying (peer id -> why); they are not in ``peers``."""
    flag_voters: list[str] = field(default_factory=list)
    """The live peers whose flags (their heartbeats' ``ignored``) counted in :attr:`ignored`:
    the run's owner's peer and its round mates (:func:`owners_mates`); without them the peers
    the monitor's user joined through and their round mates; every live peer when it knows
    none of those (see :attr:`flags_from`)."""
    flags_from: str = "all"
    """Who :attr:`flag_voters` are: ``owner`` (the owner's peer and its round mates), ``mates``
    (round mates of the owner's peer this monitor saw, the owner's peer gone now), ``joined``
    (the monitor saw neither: the live peers its user joined it through, or runs, and their
    round mates; :attr:`Reading.anchors`) or ``all`` (every live peer: it knows none of those)."""
    departed: dict[str, Departed] = field(default_factory=dict)
    """Peers that left in the last 5 minutes (or since the user last cleared them): how, when."""

    @property
    def samples_per_second(self) -> float:
        """The swarm's training speed: of the peers training now (a paused, downloading or
        finishing peer's heartbeat keeps its last round's rate, :data:`swarm.records.IDLE`)."""
        return sum(p.samples_per_second for p in self.peers.values() if p.stage not in IDLE)

    @property
    def tokens_per_second(self) -> float:
        return sum(p.tokens_per_second for p in self.peers.values() if p.stage not in IDLE)

    @property
    def mean_loss(self) -> float | None:
        losses = [p.loss for p in self.peers.values() if p.loss is not None]
        return sum(losses) / len(losses) if losses else None

    def applied(self, version: int | None = None) -> tuple[int, int]:
        """(live peers that applied the control ``version`` (default: the current one), live peers
        not paused: a paused peer applies nothing until it is resumed)."""
        version = version if version is not None else (self.control.version if self.control else 0)
        return applied(self.peers.values(), version)

    def to_json(self) -> dict[str, Any]:
        """The JSON shape of `workbench status --json`."""
        return {
            "run_id": self.run_id,
            "time": self.time,
            "outer_round": self.outer_round,
            "samples_per_second": self.samples_per_second,
            "mean_loss": self.mean_loss,
            "manifest": self.manifest.model_dump(mode="json") if self.manifest else None,
            "control": self.control.model_dump(mode="json") if self.control else None,
            "peers": [
                {
                    **p.model_dump(mode="json"),
                    # clocks differ by up to 3 s (hivemind refuses more): never "in the future"
                    "seconds_since_heartbeat": round(max(0.0, self.time - p.time), 2),
                    "lagging": p.peer_id in self.lagging,
                    "idle": p.stage in IDLE,  # trains nothing now: its rates are its last round's
                }
                for p in sorted(self.peers.values(), key=lambda p: p.name)
            ],
            "events": [e.to_json() for e in self.new_events],
            "ignored": [{"peer_id": k, "reason": v} for k, v in sorted(self.ignored.items())],
            "flag_voters": list(self.flag_voters),
            "flags_from": self.flags_from,
            "departed": [d.to_json() for d in sorted(self.departed.values(), key=lambda d: d.time)],
        }


MAX_DEPARTED = 1024  # departed peers shown (the most recent); fresh keys are free


def swarm_round(peers: Iterable[PeerHeartbeat], *, default: int = 0) -> int:
    """The outer step the swarm is at: the highest that at least half of the training peers
    claim, the upper median (all alive peers when none trains; ``default`` when none is alive).
    Not the highest claim ever seen: one fresh key claiming outer step 10^9 set the round shown
    everywhere (the TUI, `status`, its JSON, the ETA) for the monitor's lifetime, with every
    honest peer "lagging". Now it takes as many liars as honest peers (in a run of two, one:
    who of the two tells the truth is not known), and only while they are alive."""
    peers = list(peers)
    training = [p for p in peers if p.stage not in (Stage.DOWNLOADING, Stage.JOINING, Stage.PAUSED)] or peers
    if not training:
        return default
    steps = sorted((p.outer_step for p in training), reverse=True)
    return steps[(len(steps) - 1) // 2]


class SwarmMonitor:
    """Derives snapshots from readings; reads the DHT through ``read`` (a callable returning a
    :class:`Reading`) or is fed readings by :meth:`ingest` (replay, tests)."""

    def __init__(
        self,
        read: Callable[[], Reading] | None = None,
        *,
        history: int = 512,
        events: int = 200,
        record_to: str | Path | None = None,
    ) -> None:
        self.read = read
        self.history_length = history
        self._history: dict[str, dict[str, Trail]] = {}
        self._events: deque[MonitorEvent] = deque(maxlen=events)
        self._known: dict[str, PeerHeartbeat] = {}  # peers seen alive in the last reading
        self._readings = 0
        self._names: dict[str, str] = {}
        self._lagging: set[str] = set()
        self._ignored = Ignored()  # peers told as ignored (bounded: oldest forgotten)
        # The owner's peer and its round mates seen so far -> when last seen live (see _ignored).
        self._voters: OrderedDict[str, float] = OrderedDict()
        # The same for the anchors (Reading.anchors) and their round mates, used without those.
        self._anchored: OrderedDict[str, float] = OrderedDict()
        self._round = 0
        self._told = 0  # the last round told as an event
        self._seen: dict[int, dict[str, RoundSeen]] = {}  # outer step -> peer -> its round there
        self._first_seen: dict[int, float] = {}
        self._departed: dict[str, Departed] = {}
        self._killed: set[str] = set()
        self._record = open_recording(record_to) if record_to else None

    # --- live --------------------------------------------------------------------------------

    def poll(self) -> SwarmSnapshot:
        if self.read is None:
            raise SwarmError("this monitor has no DHT reader (it replays a recording)")
        return self.ingest(self.read())

    def watch(
        self, interval: float = 1.0, *, stop: Callable[[], bool] = lambda: False
    ) -> Iterator[SwarmSnapshot]:
        while not stop():
            started = time.monotonic()
            yield self.poll()
            time.sleep(max(0.0, interval - (time.monotonic() - started)))

    def note_killed(self, peer_id: str) -> None:
        """This front end killed ``peer_id``: when it vanishes, say so (not "heartbeat expired")."""
        self._killed.add(peer_id)

    def clear_departed(self) -> None:
        """Forget the peers that left (the user cleared them from the screen)."""
        self._departed.clear()

    def close(self) -> None:
        if self._record:
            record, self._record = self._record, None
            try:
                record.close()
            except OSError as error:  # a full disk: the last line's flush
                logger.warning("the recording %s may end mid-line: %s", record.name, error.strerror or error)

    def _write_record(self, reading: Reading) -> None:
        """Record ``reading``; a recording that cannot be written any more (a full disk) stops
        with a warning, and the monitor goes on (``status --watch --record`` crashed with an
        OSError traceback, and the TUI's polls all failed)."""
        try:
            self._record.write(json.dumps(reading.to_json()) + "\n")
        except OSError as error:
            logger.warning(
                "stopped recording to %s: %s (the monitor goes on; `workbench replay` reads what "
                "was recorded)",
                self._record.name,
                error.strerror or error,
            )
            self.close()

    # --- derivation ----------------------------------------------------------------------------

    def ingest(self, reading: Reading) -> SwarmSnapshot:
        if self._record:
            self._write_record(reading)
        now, new = reading.time, []
        first, self._readings = self._readings == 0, self._readings + 1

        def event(kind: str, message: str, peer_id: str | None = None) -> None:
            new.append(MonitorEvent(now, kind, message, peer_id))

        ignored, voters = _ignored(reading, self._voters, self._anchored)
        # Remembered while they live (an addition: never replaced wholesale).
        memory = {"owner": self._voters, "mates": self._voters, "joined": self._anchored}.get(voters.source)
        for pid in voters.peers if memory is not None else ():
            memory[pid] = now
            memory.move_to_end(pid)
        for kept in (self._voters, self._anchored):
            for pid in [pid for pid, seen in kept.items() if now - seen > DEPARTED_SECONDS]:
                del kept[pid]
            while len(kept) > MAX_VOTERS:
                kept.popitem(last=False)
        for pid in sorted(set(ignored) - set(self._ignored)):
            event("ignored", f"ignoring {self._names.get(pid, pid[-8:])}: {ignored[pid]}", pid)
            last = self._known.get(pid) or reading.peers.get(pid)
            if last is not None:
                self._departed[pid] = Departed(last, f"ignored for lying: {ignored[pid]}", now)
        for pid in ignored:  # told once (a flag that comes and goes is not news each time)
            self._ignored.add(pid, ignored[pid])
        alive = {
            pid: p for pid, p in reading.peers.items() if p.stage is not Stage.LEAVING and pid not in ignored
        }
        for pid, p in alive.items():
            self._names[pid] = p.name
            before = self._known.get(pid)
            if before is None and first:
                event("present", f"{p.name} is in the run ({p.device}, outer step {p.outer_step})", pid)
            elif before is None:
                back = " again" if self._departed.pop(pid, None) else ""
                event("joined", f"{p.name} joined{back} ({p.device}, outer step {p.outer_step})", pid)
            elif p.control_version > before.control_version:
                event("control", f"{p.name} applied control v{p.control_version}", pid)
            if p.last_error and (before is None or before.last_error != p.last_error):
                event("error", f"{p.name}: {p.last_error}", pid)
            self._remember(pid, p)
        for pid, before in self._known.items():
            if pid in alive:
                continue
            if pid in ignored:
                if pid not in self._departed:  # flagged again after it came back: it vanished unsaid
                    event("ignored", f"ignoring {before.name}: {ignored[pid]}", pid)
                    self._departed[pid] = Departed(before, f"ignored for lying: {ignored[pid]}", now)
                continue  # (told above when first flagged)
            how = left_how(reading.peers.get(pid), killed=pid in self._killed)
            self._killed.discard(pid)
            self._departed[pid] = Departed(before, how, now)
            event("left", f"{before.name} left at outer step {before.outer_step} ({how})", pid)
            self._lagging.discard(pid)
        self._known = dict(alive)
        for pid in [pid for pid, d in self._departed.items() if now - d.time > DEPARTED_SECONDS]:
            del self._departed[pid]
        for pid in list(self._departed)[:-MAX_DEPARTED]:  # oldest first (dicts keep order)
            del self._departed[pid]
        # Keys are free: what is kept per peer goes with the peer (alive, or shown as departed).
        kept = alive.keys() | self._departed.keys()
        for pid in [pid for pid in self._history if pid not in kept]:
            del self._history[pid]
        for pid in [pid for pid in self._names if pid not in kept]:
            del self._names[pid]
        self._killed &= kept

        top = self._round = swarm_round(alive.values(), default=self._round)
        self._tell_rounds(alive, now, event)
        lagging = {
            pid
            for pid, p in alive.items()
            if p.outer_step < top - 1 and p.stage not in (Stage.DOWNLOADING, Stage.JOINING, Stage.PAUSED)
        }
        for pid in sorted(lagging - self._lagging):
            event("lagging", f"{alive[pid].name} is {top - alive[pid].outer_step} rounds behind", pid)
        self._lagging = lagging
        self._events.extend(new)
        return SwarmSnapshot(
            time=now,
            run_id=reading.run_id,
            peers=alive,
            history={
                pid: {metric: trail.points() for metric, trail in metrics.items()}
                for pid, metrics in self._history.items()
            },
            events=list(self._events),
            new_events=new,
            manifest=reading.manifest,
            control=reading.control,
            outer_round=self._round,
            lagging=sorted(lagging),
            ignored=ignored,
            flag_voters=sorted(voters.peers),
            flags_from=voters.source,
            departed=dict(self._departed),
        )

    def _tell_rounds(self, alive: dict[str, PeerHeartbeat], now: float, event: Callable[..., None]) -> None:
        """Tell the latest round every training peer has finished (or that one finished over
        10 s ago): who averaged, who came last, who stepped alone and why, who was not there.
        Each peer's round is taken from its last heartbeat at that outer step."""
        for pid, p in alive.items():
            # group size 0: no round of its own at this step (it took the state there, by a
            # download or from a checkpoint), told as "joined at this step", not "stepped alone"
            if p.outer_step > self._told and p.group_size:
                self._seen.setdefault(p.outer_step, {})[pid] = RoundSeen.of(p)
                self._first_seen.setdefault(p.outer_step, now)
        training = [
            p for p in alive.values() if p.stage not in (Stage.DOWNLOADING, Stage.JOINING, Stage.PAUSED)
        ]
        # A round is told when every training peer finished it, or 10 s after the first did if
        # most have (a laggard does not hold it up; one peer claiming a far-off step tells nothing).
        settled = [
            step
            for step in self._seen
            if all(p.outer_step >= step for p in training)
            or (
                now - self._first_seen[step] > 10.0
                and 2 * sum(p.outer_step >= step for p in training) > len(training)
            )
        ]
        for stale in [s for s, t in self._first_seen.items() if now - t > 60.0 and s not in settled]:
            del self._seen[stale], self._first_seen[stale]  # never settled: a claim nobody followed
        for far in sorted(self._seen)[64:]:  # and at most 64 pending rounds, the nearest kept
            del self._seen[far], self._first_seen[far]
        settled = [step for step in settled if step in self._seen]
        if not settled:
            return
        step = max(settled)
        seen = {pid: r for pid, r in self._seen[step].items() if pid in alive}
        absent = {pid: p for pid, p in alive.items() if pid not in self._seen[step] and p.outer_step <= step}
        event("round", round_sentence(step, seen, absent))
        self._told = step
        for old in [s for s in self._seen if s <= step]:
            del self._seen[old]
            self._first_seen.pop(old, None)

    def _remember(self, pid: str, p: PeerHeartbeat) -> None:
        metrics = self._history.setdefault(pid, {})
        for metric in METRICS:
            value = getattr(p, metric)
            if value is None:
                continue
            metrics.setdefault(metric, Trail(self.history_length)).add((p.time, float(value)))


class Trail:
    """One metric's history, bounded by ``limit`` points: the newest half at full resolution
    (one point per heartbeat), and before them the whole run at a stride that doubles whenever
    that half is full (a plain ring of 512 heartbeats a second apart held 8.5 minutes, and the
    loss chart's 15 m, 1 h and "all" windows all showed those)."""

    def __init__(self, limit: int) -> None:
        self.recent: deque[tuple[float, float]] = deque(maxlen=max(1, limit // 2))
        self.archive: list[tuple[float, float]] = []
        self.archive_limit = max(1, limit - self.recent.maxlen)
        self.stride = 0.0  # seconds between two archived points, at least

    def add(self, point: tuple[float, float]) -> None:
        if self.recent and self.recent[-1][0] == point[0]:
            return  # one point per heartbeat, not per poll
        if len(self.recent) == self.recent.maxlen:
            leaving = self.recent[0]
            if not self.archive or leaving[0] - self.archive[-1][0] >= self.stride:
                self.archive.append(leaving)
                if len(self.archive) > self.archive_limit:
                    self.archive = self.archive[::2]
                    span = self.archive[-1][0] - self.archive[0][0]
                    self.stride = span / max(1, len(self.archive) - 1)
        self.recent.append(point)

    def points(self) -> list[tuple[float, float]]:
        return [*self.archive, *self.recent]


@dataclass(frozen=True)
class Voters:
    peers: frozenset[str]
    source: str = "all"
    """Who they are, as :attr:`SwarmSnapshot.flags_from` says."""


MAX_VOTERS = 1024  # round mates of the owner's peer a monitor remembers (fresh keys are free)


def owners_mates(
    owner_peer: str | None, peers: dict[str, PeerHeartbeat], tags: dict[str, str] | None = None
) -> set[str]:
    """The live peers that averaged with the owner's peer (or any one peer: an anchor, see
    :func:`_ignored`) by both sides' word: each names the other in ``averaged_with`` (a fresh
    key can name any peer; the owner's peer names only the peers it averaged with). Not their
    own mates in turn: a key that averaged once with an honest peer could name any number of
    fresh keys, each naming it back (a review's repro: five such keys outvoted an honest pair
    and the owner's own peer). ``tags``: each peer's :func:`mate_tag`, when the caller asks
    for several peers' mates (one SHA-256 per peer per reading, not per peer asked about)."""
    owner = peers.get(owner_peer) if owner_peer else None
    if owner is None:
        return set()
    tags = tags if tags is not None else {pid: mate_tag(pid) for pid in peers}
    shared = {tag for tag, n in Counter(tags.values()).items() if n > 1}  # a made collision: neither
    named, mine = set(owner.averaged_with) - shared, tags[owner.peer_id]
    return {
        pid
        for pid, p in peers.items()
        if pid != owner_peer and tags[pid] in named and mine in p.averaged_with
    }


def _voters(
    reading: Reading,
    live: dict[str, PeerHeartbeat],
    remembered: Iterable[str],
    anchored_before: Iterable[str] = (),
) -> Voters:
    """Whose flags count, the most trusted first: the owner's peer and its round mates (with
    the mates a monitor saw so before, while they live: the owner's peer restarted or left);
    else the reader's anchors (the peers its user joined through, or runs) and their round
    mates (with those it saw so before, ``anchored_before``: an anchor left); else every live
    peer."""
    tags = {pid: mate_tag(pid) for pid in live}
    linked = {pid for pid in remembered if pid in live} | owners_mates(reading.owner_peer, live, tags)
    if reading.owner_peer in live:
        linked.add(reading.owner_peer)
    if linked:
        return Voters(frozenset(linked), "owner" if reading.owner_peer in live else "mates")
    anchors = {pid for pid in reading.anchors[:MAX_ANCHORS] if pid in live}
    anchored = anchors | {pid for pid in anchored_before if pid in live}
    for anchor in sorted(anchors):
        anchored |= owners_mates(anchor, live, tags)
    if anchored:
        return Voters(frozenset(anchored), "joined")
    return Voters(frozenset(live), "all")


def _ignored(
    reading: Reading, remembered: Iterable[str] = (), anchored_before: Iterable[str] = ()
) -> tuple[dict[str, str], Voters]:
    """Who to leave out: the reader's own findings, and any peer flagged by most voters (one
    liar flagging honest peers moves nothing; the flags are claims too). The voters
    (:func:`_voters`) are the run's owner's peer (the heartbeat signed with the manifest's key)
    and its round mates (:func:`owners_mates`): before, every live peer voted, and one fresh
    key more than the honest peers, each flagging them all, hid every honest peer from
    `status`, the TUI and the widget. A monitor that never saw the owner's peer (a one-shot
    `status` after it left) counts the peers its user joined through and their round mates
    instead (since stop 69: before, every live peer, and the keys outvoted the honest peers
    again), and every live peer only when it knows none of those either. The owner's peer, and
    the peers its user joined through, are never hidden by flags."""
    live = {
        pid: p
        for pid, p in reading.peers.items()
        if pid not in reading.ignored and p.stage is not Stage.LEAVING
    }
    voters = _voters(reading, live, remembered, anchored_before)
    # The anchors in every mode: without --owner, the oldest manifest names the owner, and a
    # back-dated one made the attacker's own peer "the owner's peer" and its keys its mates,
    # which then hid the peers the user joined through (a review, stop 69).
    trusted = {reading.owner_peer, *reading.anchors}
    counts: dict[str, list[str]] = {}
    for pid in sorted(voters.peers):
        for flagged, why in list(live[pid].ignored.items())[:16]:
            counts.setdefault(flagged, []).append(why)
    flagged = {
        pid: whys[0]
        for pid, whys in counts.items()
        if 2 * len(whys) > len(voters.peers) and pid not in trusted
    }
    return {**flagged, **reading.ignored}, voters


def _is_recording(first_line: str) -> bool:
    try:
        header = json.loads(first_line)
    except ValueError:
        return False
    return isinstance(header, dict) and header.get("format") == RECORD_FORMAT


def open_recording(path: str | Path) -> IO[str]:
    """``path`` opened to append readings (a new file starts with the recording's header);
    SwarmError if it cannot be written, or holds something other than a recording (``--record``
    once appended to any file it was given, a run's metrics.jsonl included)."""
    path = Path(path)
    try:
        handle = open(path, "a+", buffering=1)  # noqa: SIM115 - kept open while the monitor runs
    except OSError as error:
        raise SwarmError(f"cannot write the recording {path}: {error.strerror or error}") from None
    handle.seek(0)
    try:
        first = handle.readline()
    except (OSError, ValueError):  # not text
        first = "?"
    if first and not _is_recording(first):
        handle.close()
        raise SwarmError(
            f"{path} exists and is not a workbench monitor recording: give --record a new file (or a recording to extend)"
        )
    end = handle.seek(0, os.SEEK_END)
    if end == 0:
        try:
            handle.write(json.dumps({"format": RECORD_FORMAT}) + "\n")
        except OSError as error:  # a full disk: no empty file left behind
            with contextlib.suppress(OSError):
                handle.close()
            path.unlink(missing_ok=True)
            raise SwarmError(f"cannot write the recording {path}: {error.strerror or error}") from None
        return handle
    with open(path, "rb") as raw:  # a recording cut short (a crash, a full disk) ends mid-line
        raw.seek(max(0, end - (1 << 20)))
        tail = raw.read()
    if not tail.endswith(b"\n") and tail.count(b"\n") == 0 and end == len(tail):
        handle.write("\n")  # the header alone, its newline lost: the next reading glued to it (a review)
    elif not tail.endswith(b"\n") and b"\n" in tail:
        # The cut reading is dropped (it was lost already): glued to the next one, or left as a
        # bad line before it, the readings recorded after it could not be replayed.
        handle.truncate(end - len(tail) + tail.rindex(b"\n") + 1)
        handle.seek(0, os.SEEK_END)
    return handle


def replay(path: str | Path, **options: Any) -> Iterator[SwarmSnapshot]:
    """The snapshots of a recorded run, as the live monitor derived them, read as they are
    replayed (a whole 8-hour recording's snapshots, each with its history, took gigabytes).
    A last line cut short (the recorder stopped mid-write) ends the replay with a warning; a bad
    line before it is a SwarmError."""
    monitor = SwarmMonitor(**options)
    path = Path(path)
    if path.exists() and not (path.is_file() or path.is_dir()):  # (a FIFO waited for a writer for ever)
        raise SwarmError(f"{path} is not a file: a recording is one (`workbench status --record FILE`)")
    try:
        handle = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115 - closed below; not text: no recording
    except OSError as error:
        raise SwarmError(f"cannot read the recording {path}: {error.strerror or error}") from None
    with handle:
        try:
            first = handle.readline()
        except OSError:  # a folder, say
            first = ""
        if not _is_recording(first):
            raise SwarmError(
                f"{path} is not a workbench monitor recording (record one with `workbench status --record`)"
            )
        for number, line in enumerate(handle, start=2):
            if not line.strip():
                continue
            try:
                reading = Reading.from_json(json.loads(line))
            except (ValueError, KeyError, TypeError, RecursionError) as error:  # ([[[...: a review)
                if not line.endswith("\n") and handle.read(1) == "":
                    logger.warning(
                        "%s:%d: the recording ends mid-line (cut short); replayed up to it", path, number
                    )
                    return
                raise SwarmError(f"{path}:{number}: not a monitor reading ({error})") from None
            yield monitor.ingest(reading)


def dht_reader(
    board, store, keys, *, owner: str | None = None, anchors: Iterable[str] = ()
) -> Callable[[], Reading]:
    """A :class:`Reading` source over a live DHT (heartbeats, manifest, owner's control).
    ``anchors``: the peer ids its user trusts (:attr:`Reading.anchors`)."""
    from swarm.dht import dht_time
    from swarm.manifest import find_manifest, owner_mismatch
    from swarm.steering import ControlWatcher

    state: dict[str, Any] = {"manifest": None, "watcher": None, "told": False}
    anchors = tuple(dict.fromkeys(anchors))[:MAX_ANCHORS]

    def read() -> Reading:
        if state["manifest"] is None:
            try:
                state["manifest"] = find_manifest(store, keys, owner=owner, timeout=0.0)
                wrong = None if state["manifest"] or state["told"] else owner_mismatch(store, keys, owner)
                if wrong:  # once: the run is there, under another owner than --owner says
                    state["told"] = True
                    logger.warning("%s", wrong)
            except SwarmError as error:
                logger.warning("%s", error)
            if state["manifest"] is not None:
                state["watcher"] = ControlWatcher(store, keys, state["manifest"].owner, period=0.0)
        control = state["watcher"].poll() if state["watcher"] else None
        peers = board.fetch(include_leaving=True)
        owner_key = state["manifest"].owner if state["manifest"] is not None else None
        if getattr(board, "failure", None):  # the last known peers, expiring: not a reading
            raise SwarmError(f"cannot read the run from the DHT ({board.failure}); the last reading stands")
        return Reading(
            time=dht_time(),
            run_id=keys.run_id,
            peers=peers,
            manifest=state["manifest"],
            control=control,
            ignored=dict(board.ignored),
            owner_peer=next(
                (pid for pid, writer in getattr(board, "writers", {}).items() if writer == owner_key), None
            ),
            anchors=anchors,
        )

    return read
