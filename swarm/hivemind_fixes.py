"""Fixes to hivemind's step control, applied once on import (by :mod:`swarm.group_averager`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hivemind.averaging.control import StepControl

logger = logging.getLogger(__name__)


def _quiet_step_control_del(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """hivemind's ``StepControl.__del__`` asserts that a trigger was attached; a step that a
    signal interrupted before hivemind attached one (SIGTERM to a peer's process group kills the
    averager first) then printed an AssertionError traceback at exit. Nothing is pending then."""

    def __del__(self) -> None:
        if getattr(self, "_trigger", None) is not None:
            original(self)

    return __del__


StepControl.__del__ = _quiet_step_control_del(StepControl.__del__)


def _quiet_cancelled_result(original: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    """A peer cancels a step whose group it no longer wants (the others finished the round);
    when the all-reduce had just begun in hivemind's averager process, hivemind then sets the
    cancelled step's result and logs "Task exception was never retrieved ... InvalidStateError"
    with a traceback. The peer has moved on (its round falls back; a stale θ is re-downloaded):
    the result has nobody to go to."""

    def set_result(self, result: Any) -> None:
        if self.cancelled():
            logger.debug("a cancelled averaging step finished anyway; its result is dropped")
            return
        original(self, result)

    return set_result


StepControl.set_result = _quiet_cancelled_result(StepControl.set_result)
