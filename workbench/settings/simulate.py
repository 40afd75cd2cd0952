"""The settings of ``workbench simulate`` beyond the optimizer's (N virtual peers in one process)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from workbench.settings import setting
from workbench.settings.run import VIRTUAL_ROUND_SECONDS


def speeds_text(text: str) -> str:
    """``--speeds``: numbers separated by commas, checked where given (a flag, a file, a
    variable). Checked only by `simulate` itself, ``speeds = "1,abc"`` passed `config show` and
    every peer command, and ``speeds = ""`` was taken as none (a review, stop 71)."""
    try:
        speeds = [float(part) for part in text.split(",")]
    except ValueError:
        speeds = []
    if not speeds or not all(0 < speed < math.inf for speed in speeds):
        raise argparse.ArgumentTypeError("must be positive numbers separated by commas, e.g. 1,1,0.5,0.5")
    return text


def straggler_text(text: str) -> str:
    """``--straggler``: RANK:FRACTION, checked where given (as :func:`speeds_text`)."""
    rank, colon, fraction = text.partition(":")
    try:
        int(rank), float(fraction)
    except ValueError:
        colon = ""
    if not colon:
        raise argparse.ArgumentTypeError("must look like RANK:FRACTION, e.g. 3:0.5")
    return text


@dataclass(kw_only=True)
class Swarm:
    """How many virtual peers, for how long."""

    peers: int = setting(4, "virtual peers (default: 4)", bound="peers")
    steps: int = setting(200, "inner steps per peer (default: 200)", bound="steps")


@dataclass(kw_only=True)
class Bench:
    """The virtual peers' faults and speeds (the model and data are the peers' settings)."""

    straggler: list[str] = setting(
        [],
        "a peer that runs only FRACTION of each round's steps, e.g. 3:0.5 (repeatable)",
        kind="list",
        metavar="RANK:FRACTION",
        parse=straggler_text,
    )
    dropout: float = setting(0.0, "probability a peer misses a round", bound="dropout")
    speeds: str | None = setting(
        None,
        "each peer's speed on a virtual clock, e.g. 1,1,0.5,0.5: a speed-1 peer's inner step "
        "takes --step-seconds; the JSON reports virtual_seconds and each peer's utilization",
        metavar="S1,S2,...",
        joined=",",
        parse=speeds_text,
    )
    round_seconds: float = setting(0.0, VIRTUAL_ROUND_SECONDS, bound="round_seconds", metavar="T")
    step_seconds: float = setting(
        1.0, "virtual seconds of one inner step at speed 1 (default: 1)", bound="step_seconds"
    )
    seed: int = setting(0, "model init, data order and dropout seed (default: 0)", bound="seed")
    threads: int = setting(1, "torch threads per process (default: 1)", bound="threads")
    json: bool = setting(False, "print one JSON object on stdout", kind="switch")
