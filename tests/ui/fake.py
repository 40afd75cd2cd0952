"""A deterministic snapshot source for UI tests: fixed peers, fixed clock, recorded commands."""

from __future__ import annotations

from typing import Any

from swarm.errors import SwarmError
from swarm.monitor import Reading, SwarmMonitor, SwarmSnapshot
from swarm.records import ControlState, PeerHeartbeat

NAMES = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"]
STAGES = ["training", "averaging", "training", "waiting", "downloading", "training"]


def peer_id(index: int) -> str:
    return f"QmPeer{index:03d}" + "x" * 40


def heartbeat(index: int, t: float, step: int, **overrides: Any) -> PeerHeartbeat:
    name = NAMES[index] if index < len(NAMES) else f"peer-{index:03d}"
    fields = dict(
        peer_id=peer_id(index),
        name=name,
        stage=STAGES[index % len(STAGES)],
        outer_step=max(0, step - (2 if index == 3 else 0)),  # delta lags two rounds
        inner_step=(7 * index + step) % 20,
        inner_steps=20,
        last_round_steps=20 - index % 3 * 4,  # time boxes: slower peers fit fewer steps
        loss=round(3.2 - 0.05 * step + 0.03 * index, 4),
        samples_per_second=20.0 + index,
        tokens_per_second=(20.0 + index) * 128,
        bytes_sent=3_700_000 * step,
        bytes_received=3_700_000 * step,
        dp_bytes=3_700_000 * step * 20,
        device="cpu",
        time=t,
        last_round_seconds=14.0 + index / 2,
        group_size=4,
        last_round_spread=1.8,
        last_round_last="bravo",
        control_version=0,
        rounds=40,
        addresses=[f"/ip4/127.0.0.1/tcp/{40000 + index}/p2p/{peer_id(index)}"] if index != 2 else [],
    )
    if fields["stage"] == "downloading":
        fields["download_progress"] = 0.37
    fields.update(overrides)
    return PeerHeartbeat.model_validate(fields)


class FakeFaults:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []

    def reason(self, peer: str) -> str | None:
        return None if peer != peer_id(2) else "this peer runs on another machine"

    def stopped(self, peer: str) -> bool:
        return peer == peer_id(6)  # FakeSource(leavers=3)'s third leaver, killed from the monitor

    def inject(self, peer: str, request) -> str:
        self.calls.append((request.fault.value, peer, request.argument))
        return f"{request.fault.value} {peer[:10]}"


class FakeSource:
    """``peers`` peers over ``steps`` readings at t = 1000, 1010, ...; poll() returns the next."""

    interval = 0.05

    def __init__(
        self, *, peers: int = 4, steps: int = 12, owner: bool = True, faults: bool = True, leavers: int = 0
    ) -> None:
        """``leavers``: that many more peers, gone after step 8 (the first says it leaves, the
        next ones' heartbeats expire, the third is killed from the monitor)."""
        self.title = "run fake-run"
        self.owner = owner
        self.faults = FakeFaults() if faults else None
        self.published: list[dict[str, Any]] = []
        self.control: ControlState | None = None
        self.monitor = SwarmMonitor()
        self.snapshots: list[SwarmSnapshot] = []
        for step in range(1, steps + 1):
            t = 1000.0 + 10 * step
            count = min(peers, 3 if step < 3 else peers)
            group = dict(group_size=count + (leavers if step <= 8 else 0))  # everyone averaged together
            beats = {peer_id(i): heartbeat(i, t, step, **group) for i in range(count)}
            for i in range(peers, peers + leavers):
                if step <= 8:
                    beats[peer_id(i)] = heartbeat(i, t, step, **group)
                elif step == 9 and i == peers:
                    beats[peer_id(i)] = heartbeat(i, t, step - 1, stage="leaving")
                if step == 8 and i == peers + 2:
                    self.monitor.note_killed(peer_id(i))
            self.snapshots.append(self.monitor.ingest(Reading(t, "fake-run", beats)))
        self.position = 0
        self.closed = False

    def poll(self) -> SwarmSnapshot:
        snapshot = self.snapshots[min(self.position, len(self.snapshots) - 1)]
        self.position += 1
        return snapshot

    def steering_reason(self) -> str | None:
        return (
            None
            if self.owner
            else "only the run owner (0123456789abcdef) can steer; this key is fedcba9876543210"
        )

    def steer(self, **changes: Any) -> ControlState:
        if not self.owner:
            raise SwarmError(self.steering_reason())
        self.published.append(changes)
        version = len(self.published)
        fields = {k: v for k, v in changes.items() if k not in ("checkpoint", "pause", "resume")}
        held = list(self.control.paused) if self.control is not None else []
        if "pause" in changes or "resume" in changes:  # as swarm.steering.Steering.publish does
            held = [p for p in held if p not in changes.get("resume", [])] + list(changes.get("pause", []))
            fields["paused"] = held
        self.control = ControlState(version=version, from_step=14, **fields)
        return self.control

    def close(self) -> None:
        self.closed = True
