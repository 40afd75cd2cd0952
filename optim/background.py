"""Rounds averaged in the background (an overlapped outer step, a streaming fragment in
flight): the thread that runs one, and reading the state consistently while one is in flight."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class RoundInFlight(RuntimeError):
    """The state cannot be read yet: a round averaging in the background has not delivered its
    mean, and the step count already includes that round."""


def read_settled(owner: Any, timeout: float, read: Callable[[Any], T]) -> T:
    """``read(inflight)`` under ``owner.lock`` once ``owner._inflight`` (a round, or a streaming
    fragment, averaging in the background) has finished; if another one started meanwhile, wait
    for that one instead. Serving the state this way gives a joiner the mean in flight, which
    the peer serving it is about to apply too. :class:`RoundInFlight` if it has not finished
    within ``timeout`` s: the state read then would say the round's outer step and lack its
    mean (a checkpoint written so, resumed, ended 0.06 away from the uninterrupted run)."""
    while True:
        inflight = owner._inflight
        if inflight is not None:
            concurrent.futures.wait([inflight.future], timeout=timeout)
        with owner.lock:
            if owner._inflight is inflight:
                if inflight is not None and not inflight.future.done():
                    raise RoundInFlight(
                        f"the round averaging in the background has not finished after {timeout:g} s: "
                        "the state would lack its mean"
                    )
                return read(inflight)
            # a round ended while we waited: wait for the new one


def landed(inflight: Any) -> bool:
    """Whether a background all-reduce has delivered its mean (not failed, not still running)."""
    return inflight is not None and inflight.future.done() and not inflight.future.exception()


def in_background(function, *args: Any, after: concurrent.futures.Future | None = None, **kwargs: Any):
    """``function(*args, **kwargs)`` in a daemon thread (an exit never waits on a network
    round), after ``after`` is done: one all-reduce at a time per peer."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        if after is not None:
            concurrent.futures.wait([after])
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(function(*args, **kwargs))
        except BaseException as error:  # noqa: BLE001 - handed to the caller by result()
            future.set_exception(error)

    threading.Thread(target=run, name="outer-all-reduce", daemon=True).start()
    return future
