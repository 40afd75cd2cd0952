"""The settings of ``workbench simulate`` beyond the optimizer's (N virtual peers in one process)."""

from __future__ import annotations

from dataclasses import dataclass

from workbench.settings import setting
from workbench.settings.run import VIRTUAL_ROUND_SECONDS


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
    )
    dropout: float = setting(0.0, "probability a peer misses a round", bound="dropout")
    speeds: str | None = setting(
        None,
        "each peer's speed on a virtual clock, e.g. 1,1,0.5,0.5: a speed-1 peer's inner step "
        "takes --step-seconds; the JSON reports virtual_seconds and each peer's utilization",
        metavar="S1,S2,...",
        joined=",",
    )
    round_seconds: float = setting(0.0, VIRTUAL_ROUND_SECONDS, bound="round_seconds", metavar="T")
    step_seconds: float = setting(
        1.0, "virtual seconds of one inner step at speed 1 (default: 1)", bound="step_seconds"
    )
    seed: int = setting(0, "model init, data order and dropout seed (default: 0)", bound="seed")
    threads: int = setting(1, "torch threads per process (default: 1)", bound="threads")
    json: bool = setting(False, "print one JSON object on stdout", kind="switch")
