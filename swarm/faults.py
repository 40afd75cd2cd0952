"""Fault injection, typed: what the local lab (``workbench demo``'s monitor, the tests) may
inject into a peer it launched, and how the peer reads it.

Two halves. A front end asks for a :class:`FaultRequest` (kill, freeze, throttle, one corrupt
update, one oversized update) through a :class:`FaultInjector`, which only a launcher that owns
the peer's process provides. Faults that act inside the peer travel as a :class:`FaultPlan`:
a small JSON file named by the peer's ``--fault-file`` (the launcher passes it; a peer started
by hand has none, and then nothing here runs). The peer reads it with a :class:`FaultReader`
between inner steps; its averager reads the state-serving faults when it serves a state.
Unknown keys and non-numbers are refused, so a typo in a test cannot silently inject nothing.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from swarm.errors import SwarmError


class Fault(enum.Enum):
    KILL = "kill"  # SIGKILL: the round falls back, the peer drops out
    FREEZE = "freeze"  # SIGSTOP for ``argument`` seconds: a straggler
    THROTTLE = "throttle"  # ``argument`` ms of sleep per inner step (0 removes it)
    CORRUPT = "corrupt"  # one NaN update next round
    OVERSIZE = "oversize"  # one update 1000x larger than declared next round
    OVERCLAIM = "overclaim"  # next round, claim 1e9 samples (the group counts 16x the others')
    RESTART = "restart"  # start a stopped peer again (its identity, checkpoint): it rejoins


@dataclass(frozen=True)
class FaultRequest:
    fault: Fault
    argument: float | None = None


class FaultInjector(Protocol):
    """Faults a front end can inject into peers this machine launched (``workbench demo``)."""

    def reason(self, peer_id: str) -> str | None:
        """Why faults cannot be injected into this peer (None: they can)."""

    def stopped(self, peer_id: str) -> bool:
        """Whether this is a peer launched here that has stopped (it can be restarted)."""

    def inject(self, peer_id: str, request: FaultRequest) -> str:
        """Inject it; returns a sentence for the event log. Raises SwarmError or OSError."""


@dataclass(frozen=True)
class FaultPlan:
    """The faults acting inside one peer (its ``--fault-file``); every field 0 means none."""

    throttle_ms: float = 0.0
    """Sleep this long per inner step (a slow peer)."""
    corrupt_next: float = 0.0
    """A token: each new value makes the peer send one NaN update (a faulty peer)."""
    oversize_next: float = 0.0
    """A token: each new value makes the peer send one update 1000x what it declares."""
    overclaim_next: float = 0.0
    """A token: each new value makes the peer claim 1e9 samples trained in its next round."""
    serve_delay_ms: float = 0.0
    """Sleep this long per streamed part of a served state (a test can kill a donor mid-download)."""
    serve_noise: float = 0.0
    """Serve θ with this much relative noise (a lying donor; this peer's own θ is untouched)."""
    serve_steps_back: float = 0.0
    """Label the served state this many outer steps older than it is: with ``serve_noise``, a
    made-up θ just behind the swarm, a step no honest peer holds any more to contradict it."""
    serve_bad_slices: float = 0.0
    """Flip a byte of every slice served over the direct transport (a donor whose slices do not
    match the hashes it offered)."""
    offer_loopback_port: float = 0.0
    """Name 127.0.0.1 and this port as the state listener in a direct offer (a donor aiming a
    joiner's connection, and its token, at a service on the joiner's own machine)."""
    state_priority: float = 0.0
    """Declare this much more than the outer step to joiners, to be picked as their donor first."""
    alone_from_step: float = 0.0
    """Average with nobody in the rounds that end at this outer step or later: a peer cut off
    from the others' groups, which steps alone (0: never)."""

    def __post_init__(self) -> None:
        # Checked where a plan is made, not only where a peer reads one: a NaN written for a peer
        # made it refuse its fault file, and every later injection (removing a throttle too)
        # failed; a throttle of -500 was taken as 0 while the message said "sleeps -500 ms".
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"fault {field.name} must be a finite number >= 0 (got {value!r})")

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        """From the file's JSON; ValueError naming an unknown key or a value that is no number."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("a fault file holds one JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        values = {}
        for key, value in data.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"fault {key} must be a finite number (got {value!r})")
            values[key] = float(value)  # (a negative one is refused where the plan is made)
        return cls(**values)

    @classmethod
    def read(cls, path: str | os.PathLike[str] | None) -> FaultPlan:
        """The plan in ``path``; no faults when there is no path or no file yet."""
        if not path:
            return cls()
        try:
            return cls.parse(Path(path).read_text())
        except FileNotFoundError:
            return cls()

    def write(self, path: str | os.PathLike[str]) -> None:
        """Atomically (a peer may read it at any moment): the fields that are set."""
        target = Path(path)
        temporary = target.with_suffix(".tmp")
        temporary.write_text(json.dumps({k: v for k, v in dataclasses.asdict(self).items() if v}))
        os.replace(temporary, target)

    @classmethod
    def update(cls, path: str | os.PathLike[str], **changes: float) -> FaultPlan:
        """Merge ``changes`` (field names, TypeError for others) into the plan in ``path``."""
        plan = dataclasses.replace(cls.read(path), **changes)
        plan.write(path)
        return plan


def check_fault_file(path: str | os.PathLike[str]) -> None:
    """SwarmError if ``path`` (``--fault-file``) is there and holds no usable plan, before the
    peer starts. Read only as the peer ran, a typo in it (an unknown fault, a negative or
    quoted value, no JSON) was one warning, and the peer ran on with no faults, exit 0 (a
    review, stop 71). No file yet is no faults: a test or the lab writes it later."""
    try:
        FaultPlan.read(path)
    except json.JSONDecodeError as error:
        raise SwarmError(f"--fault-file {path} is not JSON ({error}): write one JSON object") from None
    except (ValueError, OSError) as error:
        raise SwarmError(f"--fault-file {path}: {error}") from None


class FaultReader:
    """A peer's view of its fault file: re-read only when it changed; a one-shot fault (a new
    ``corrupt_next`` / ``oversize_next`` / ``overclaim_next`` token) is reported once."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = path
        self.plan = FaultPlan()
        self._seen: float | None = None
        self._tokens = {"corrupt_next": 0.0, "oversize_next": 0.0, "overclaim_next": 0.0}

    def poll(self) -> tuple[FaultPlan, set[str]] | None:
        """(the plan, the one-shot faults newly asked for) if the file changed since the last
        poll, else None. ValueError/OSError for a file that cannot be used (the plan is kept)."""
        if not self.path:
            return None
        try:
            changed = os.stat(self.path).st_mtime
        except FileNotFoundError:
            return None
        if changed == self._seen:
            return None
        self._seen = changed
        self.plan = FaultPlan.read(self.path)
        fired = set()
        for name, last in self._tokens.items():
            token = getattr(self.plan, name)
            if token and token != last:
                self._tokens[name] = token
                fired.add(name)
        return self.plan, fired


def fault_value(fault_file: str | None, key: str) -> float:
    """A state-serving fault of the local lab (``serve_delay_ms``, ``serve_noise``,
    ``serve_steps_back``, ``offer_loopback_port``, ``state_priority``), 0 if there is none or the file is half-written."""
    try:
        return float(getattr(FaultPlan.read(fault_file), key))
    except (OSError, ValueError):
        return 0.0
