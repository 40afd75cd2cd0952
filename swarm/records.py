"""Records peers publish in the DHT, as pydantic models.

Stored under the run's prefix as plain dicts (``model_dump``) and validated on read, so a
malformed record from a buggy or hostile peer is dropped, never trusted. Signing records
(hivemind's RSASignatureValidator) comes with the swarm-records issue.
"""

from __future__ import annotations

import enum
import re

from pydantic import BaseModel, ConfigDict, Field

from swarm.errors import SwarmError

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def check_run_id(run_id: str) -> str:
    """Run ids prefix DHT keys and averaging groups: letters, digits, '-' and '_' only."""
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id):
        raise SwarmError(
            f"invalid run id '{run_id}': use 1-64 letters, digits, '-' or '_', starting with a letter or digit"
        )
    return run_id


class Stage(str, enum.Enum):
    """Where a peer is in its protocol, shown in every UI."""

    JOINING = "joining"  # connecting to the DHT, waiting for enough peers
    DOWNLOADING = "downloading"  # fetching the global state from another peer
    TRAINING = "training"  # running inner steps
    WAITING = "waiting"  # done with this round's inner steps, waiting for the others
    AVERAGING = "averaging"  # matchmaking and all-reduce of pseudo-gradients
    LEAVING = "leaving"  # shutting down (Ctrl+C or end of run)


class PeerHeartbeat(BaseModel):
    """One peer's progress, republished every second or so; expires when the peer dies."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    peer_id: str = Field(max_length=128)
    name: str = Field(max_length=64)
    stage: Stage
    outer_step: int = Field(ge=0)
    """Completed outer rounds: peers at the same step hold the same global params."""
    inner_step: int = Field(ge=0)
    """Inner steps done in the current round."""
    inner_steps: int = Field(ge=1)
    """H: inner steps per round on this peer."""
    loss: float | None = None
    samples_per_second: float = Field(default=0.0, ge=0)
    bytes_sent: int = Field(default=0, ge=0)
    bytes_received: int = Field(default=0, ge=0)
    device: str = Field(default="cpu", max_length=32)
    time: float
    """DHT time when published."""
