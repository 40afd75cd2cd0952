"""Deadlines learned from the swarm's recent rounds instead of fixed ones.

A fixed round wait (60 s) and averaging timeout (30 s) are either far too long for a fast
swarm (a peer that died holds every round for a minute) or too short for a slow one. A
:class:`LearnedDeadline` keeps the last rounds' measured durations (how long this peer's barrier
waited for its last round mate, how long an averaging attempt took) and answers a high
percentile of them times a factor, plus a margin, within bounds: the configured value is the
ceiling, so a swarm never waits longer than before, and it is also the answer until enough
rounds were seen.

A round mate that keeps arriving after the learned wait is then averaged without sooner; it
finds itself behind, downloads the state and is back in the next round it makes in time. A
barrier that gave up on a round mate it has averaged with forgets what it learned (the mate
may have slowed down for good: it could never make the learned wait again), and waits up to
the configured value until it has learned anew; so does a round that ran out of its learned
averaging time with round mates still averaging (all-reduces that slowed down for good).
"""

from __future__ import annotations

import math
import threading
from collections import deque


class LearnedDeadline:
    """``clamp(factor · quantile(recent) + margin, floor, ceiling)`` seconds; ``ceiling`` until
    ``warmup`` durations were observed."""

    def __init__(
        self,
        *,
        ceiling: float,
        floor: float,
        window: int = 20,
        warmup: int = 5,
        quantile: float = 0.9,
        factor: float = 2.0,
        margin: float = 1.0,
    ) -> None:
        if not 0 <= floor <= ceiling:
            raise ValueError(f"a deadline's floor ({floor}) must be within 0..ceiling ({ceiling})")
        self.ceiling, self.floor = ceiling, floor
        self.warmup, self.quantile, self.factor, self.margin = warmup, quantile, factor, margin
        self._seen: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        """One round's duration; a non-finite or negative one is ignored."""
        if math.isfinite(seconds) and seconds >= 0:
            with self._lock:
                self._seen.append(seconds)

    def forget(self) -> None:
        """Start learning again: ``ceiling`` until ``warmup`` durations are observed anew."""
        with self._lock:
            self._seen.clear()

    @property
    def learned(self) -> bool:
        return len(self._seen) >= self.warmup

    @property
    def seconds(self) -> float:
        with self._lock:
            seen = sorted(self._seen)
        if len(seen) < self.warmup:
            return self.ceiling
        high = seen[min(len(seen) - 1, math.ceil(self.quantile * len(seen)) - 1)]
        return min(self.ceiling, max(self.floor, self.factor * high + self.margin))


MATCHMAKING_FLOOR = 0.5
"""The shortest matchmaking window a peer learns (s): a group on one machine forms in ~0.1 s;
across the internet a join request and the leader's answer take a few round trips."""


def matchmaking_window(ceiling: float) -> LearnedDeadline:
    """How long matchmaking waits for a round's group to form: learned from how long the last
    groups took (from this peer's step until its group formed; a group that was not complete
    took the whole window, which pushes it back up), within ``MATCHMAKING_FLOOR``..``ceiling``
    (``--matchmaking-time``)."""
    return LearnedDeadline(ceiling=ceiling, floor=min(ceiling, MATCHMAKING_FLOOR), factor=2.0, margin=0.25)
