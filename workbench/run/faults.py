"""Fault injection as a peer applies it: only the local lab (``workbench.local``) and tests pass
a fault file (``--fault-file``, :mod:`swarm.faults`); without one this reads nothing."""

from __future__ import annotations

import logging
import time
from typing import Any

from swarm.faults import FaultReader

logger = logging.getLogger(__name__)


class InjectedFaults:
    """The faults in a peer's fault file, applied between inner steps: a throttle (every step
    sleeps), a corrupt (NaN) or oversized (1000x) update, or a claim of 1e9 samples, in the next
    round."""

    def __init__(self, path: str | None, name: str) -> None:
        self.reader = FaultReader(path)
        self.name = name
        self.throttle = 0.0

    def apply(self, averager: Any) -> None:
        try:
            changed = self.reader.poll()
        except (OSError, ValueError) as error:
            logger.warning("%s: unusable fault file %s: %s", self.name, self.reader.path, error)
            changed = None
        if changed is not None:
            plan, fired = changed
            self.throttle = plan.throttle_ms / 1000
            if averager is not None and "corrupt_next" in fired:
                averager.corrupt_next = True
            if averager is not None and "oversize_next" in fired:
                averager.scale_next = 1000.0
            if averager is not None and "overclaim_next" in fired:
                averager.claim_next = 1e9
            logger.warning("%s: fault injection: %s", self.name, plan)
        if self.throttle:
            time.sleep(self.throttle)
