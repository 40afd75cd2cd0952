"""How the monitor tells what happened as sentences a person would write: a round (who averaged,
who came last and how late, who stepped alone and why, who was not there) and a departure
(how a peer left, and when).

Everything here is read from heartbeats, which are claims (:mod:`swarm.claims`): a peer that lies
about its last round changes the sentence about it, nothing else.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from swarm.records import PeerHeartbeat, Stage

DEPARTED_SECONDS = 300.0
"""A peer that left stays on screen this long (or until the user clears it)."""


@dataclass(frozen=True)
class RoundSeen:
    """One peer's last round, as its heartbeat at that outer step says."""

    name: str
    group_size: int
    spread: float
    """Seconds between its group's first and last arrival at the round."""
    last: str
    """The member of its group that arrived last."""
    alone: str
    """Why it stepped alone ("" when it averaged)."""

    @classmethod
    def of(cls, p: PeerHeartbeat) -> RoundSeen:
        return cls(p.name, p.group_size, p.last_round_spread, p.last_round_last, p.last_round_alone)


@dataclass(frozen=True)
class Departed:
    """A peer that left: its last heartbeat, how it left and when (reading time)."""

    heartbeat: PeerHeartbeat
    how: str
    """clean exit | heartbeat expired | killed from the monitor | ignored for lying: <why>"""
    time: float

    def to_json(self) -> dict:
        return {
            "peer_id": self.heartbeat.peer_id,
            "name": self.heartbeat.name,
            "how": self.how,
            "time": self.time,
            "outer_step": self.heartbeat.outer_step,
        }


_BUSY = {
    Stage.DOWNLOADING: "was downloading the state",
    Stage.JOINING: "was joining",
    Stage.PAUSED: "was paused",
}


def round_sentence(step: int, seen: dict[str, RoundSeen], absent: dict[str, PeerHeartbeat]) -> str:
    """``round 3: 4 peers averaged (peer-2 arrived 1.8 s after the first)``, with who stepped
    alone and why, and who was not there: ``absent`` are live peers that reported nothing for
    this step (behind, downloading, paused)."""
    averaged = [s for s in seen.values() if s.group_size >= 2]
    parts = []
    if averaged:
        sizes = Counter(s.group_size for s in averaged)
        if len(sizes) == 1 and next(iter(sizes)) == len(averaged):
            parts.append(f"{len(averaged)} peers averaged{_arrivals(averaged)}")
        elif len(averaged) == 1:  # one peer of its group seen ("1 peers averaged in groups of 2")
            parts.append(f"{averaged[0].name} averaged in a group of {averaged[0].group_size}")
        else:  # several groups (or peers we saw only some of)
            groups = " and ".join(
                str(size) for size, count in sorted(sizes.items()) for _ in range(max(1, count // size))
            )
            parts.append(f"{len(averaged)} peers averaged in groups of {groups}")
    alone = sorted((s for s in seen.values() if s.group_size < 2), key=lambda s: s.name)
    if alone and not averaged:
        parts.append("no group formed")
    parts += [f"{s.name} stepped alone ({s.alone or 'no reason given'})" for s in alone]
    for p in sorted(absent.values(), key=lambda p: p.name):
        what = _BUSY.get(p.stage) or (
            f"was {step - p.outer_step} round{'s' if step - p.outer_step > 1 else ''} behind"
            if p.outer_step < step
            else "joined at this step"
            if not p.group_size
            else "was there, unseen"
        )
        parts.append(f"{p.name} {what}")
    return f"round {step}: " + ("; ".join(parts) if parts else "done")


def _arrivals(averaged: list[RoundSeen]) -> str:
    latest = max(averaged, key=lambda s: s.spread)
    if not latest.last:  # peers of an older version say nothing of arrivals
        return ""
    if latest.spread < 0.05:
        return " (all arrived within 0.1 s)"
    return f" ({latest.last} arrived {latest.spread:.1f} s after the first)"


def left_how(gone: PeerHeartbeat | None, killed: bool) -> str:
    """How a peer that vanished from the board left: its "leaving" heartbeat, a kill from this
    monitor, or a heartbeat that expired."""
    if gone is not None and gone.stage is Stage.LEAVING:
        return "clean exit"
    return "killed from the monitor" if killed else "heartbeat expired"
