"""Averaging settings, apart from :mod:`swarm.averaging` so they import without hivemind."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.errors import SwarmError

# wire codec name -> bytes per element sent (hivemind's NoCompression, Float16Compression,
# Uniform8BitQuantization; the last one needs numpy < 2.4, see pyproject.toml)
CODEC_BYTES: dict[str, float] = {"none": 4.0, "fp16": 2.0, "int8": 1.0}


@dataclass(kw_only=True)
class AveragingConfig:
    """How peers find each other for a round and how long they wait."""

    matchmaking_time: float = 2.0
    """Seconds a group stays open for members after the barrier (loopback: 1-2 s; internet: 5+)."""
    averaging_timeout: float = 30.0
    """Give up on a round (and step locally) after this many seconds of matchmaking + all-reduce."""
    round_wait: float = 60.0
    """At most this many seconds waiting at the barrier for peers still training the same round."""
    compression: str = "none"
    """Wire codec for pseudo-gradients: none, fp16 or int8."""
    data_plane: str = "direct"
    """direct: a formed group whose members all accept connections moves its tensors over its
    own gloo ring (hivemind still finds the group; see swarm.dataplane); hivemind: always
    hivemind's butterfly all-reduce through its p2p daemon (slower, but relayed through NAT)."""
    aggregate: str = "mean"
    """mean: the weighted mean; trimmed-mean: per coordinate, drop each group's largest and
    smallest value and average the rest (unweighted; a lone NaN or huge update moves nothing).
    trimmed-mean runs on hivemind's plane (the direct plane's ring can only sum)."""

    def __post_init__(self) -> None:
        if self.compression not in CODEC_BYTES:
            raise SwarmError(f"unknown codec '{self.compression}'; choose one of: {', '.join(CODEC_BYTES)}")
        if not 0.1 <= self.matchmaking_time <= 120:
            raise SwarmError(f"matchmaking time must be within 0.1..120 s (got {self.matchmaking_time})")
        if not self.matchmaking_time < self.averaging_timeout <= 3600:
            raise SwarmError(
                f"averaging timeout ({self.averaging_timeout} s) must exceed the matchmaking time "
                f"({self.matchmaking_time} s) and be at most 3600 s"
            )
        if self.aggregate not in ("mean", "trimmed-mean"):
            raise SwarmError(f"unknown aggregate '{self.aggregate}'; choose mean or trimmed-mean")
        if self.data_plane not in ("direct", "hivemind"):
            raise SwarmError(f"unknown data plane '{self.data_plane}'; choose direct or hivemind")
        if not 0 <= self.round_wait <= 3600:
            raise SwarmError(f"round wait must be within 0..3600 s (got {self.round_wait})")
