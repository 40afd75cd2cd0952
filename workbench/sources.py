"""Where a monitor's snapshots come from: a live swarm, a recording, or peers this machine runs.

The TUI and the notebook widgets only ever see a :class:`SnapshotSource`: ``poll()`` for the
next :class:`~swarm.monitor.SwarmSnapshot`, steering through ``swarm.steering`` (with the
reason when it is not allowed), and fault injection for peers this machine launched.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from swarm.errors import SwarmError
from swarm.faults import Fault, FaultInjector, FaultRequest
from swarm.monitor import SwarmMonitor, SwarmSnapshot, dht_reader, replay
from swarm.records import ControlState, RunKeys

logger = logging.getLogger(__name__)


class SnapshotSource(Protocol):
    title: str
    interval: float
    """Seconds between two polls."""
    faults: FaultInjector | None

    def poll(self) -> SwarmSnapshot: ...
    def steering_reason(self) -> str | None:
        """Why this front end cannot steer (None: it can)."""

    def steer(self, **changes: Any) -> ControlState: ...
    def close(self) -> None: ...


class LiveSource:
    """A live run read from the DHT; steers when opened with the owner's key."""

    interval = 1.0

    def __init__(
        self,
        session,
        *,
        owner: str | None = None,
        record_to: str | Path | None = None,
        anchors: Iterable[str] = (),
    ) -> None:
        """``anchors``: the peer ids this view trusts (joined through, or run by this machine):
        their flags count when the owner's peer is not there (:attr:`swarm.monitor.Reading.anchors`)."""
        self.session = session
        self.keys: RunKeys = session.keys
        self.title = f"run {self.keys.run_id}"
        self.monitor = SwarmMonitor(
            dht_reader(session.board, session.store, self.keys, owner=owner, anchors=anchors),
            record_to=record_to,
        )
        self.faults: FaultInjector | None = None
        self._steering = None
        self._last: SwarmSnapshot | None = None
        self._lock = threading.Lock()  # poll runs in the UI's worker thread, steer in the UI thread
        self.ended = False
        """Closed (the run it watched is over): a poll gives the last reading."""

    @classmethod
    def connect(
        cls,
        peers: list[str],
        *,
        run_id: str,
        secret: str | None = None,
        owner: str | None = None,
        key: str | Path | None = None,
        connect_timeout: float = 20.0,
        record_to: str | Path | None = None,
        anchors: Iterable[str] = (),
    ) -> LiveSource:
        """Join the run through ``peers`` (multiaddrs); those peers, and ``anchors`` (peer ids:
        the peers this machine runs), are trusted (see :meth:`__init__`)."""
        from swarm.addresses import peer_ids
        from swarm.dht import NetworkConfig
        from swarm.session import connect

        keys = RunKeys(run_id, secret)
        network = NetworkConfig(initial_peers=list(peers), client_mode=True, connect_timeout=connect_timeout)
        trusted = [*anchors, *peer_ids(peers)]
        return cls(connect(network, keys, signing_key=key), owner=owner, record_to=record_to, anchors=trusted)

    def poll(self) -> SwarmSnapshot:
        with self._lock:
            if self.ended and self._last is None:
                raise SwarmError(f"{self.title}: its view is closed, and it ended before it was read")
            if not self.ended:
                self._last = self.monitor.poll()
            return self._last

    def _steering_api(self):
        from swarm.steering import Steering

        if self._steering is None and self._last is not None and self._last.manifest is not None:
            self._steering = Steering(
                self.session.store, self.keys, owner=self._last.manifest.owner, board=self.session.board
            )
        return self._steering

    def steering_reason(self) -> str | None:
        if self.ended:  # its DHT is closed: a steer or a pause raised hivemind's OSError
            return f"{self.title} has ended: its view is closed, nothing is left to steer"
        steering = self._steering_api()
        if steering is None:
            return "the run's manifest was not found yet (its owner may have left): steering is off"
        return steering.why_not()

    def steer(self, **changes: Any) -> ControlState:
        steering = None if self.ended else self._steering_api()
        if steering is None:
            raise SwarmError(self.steering_reason() or "steering is off")
        with self._lock:
            if self.ended:  # closed while this waited for the lock
                raise SwarmError(self.steering_reason())
            return steering.publish(**changes)

    def read_once(self, *, again: bool = False) -> SwarmSnapshot | None:
        """Read the run if nothing has yet (a run that ends with no widget open: a widget made
        afterwards said "ended before it was read"), or ``again``; the view it now holds (None:
        never read). The notebook reads it every second while its peers run, and at their end
        until it shows the end, so that the view closes on the run's end (a widget made after
        a short run showed round 0 and no peer: its one read came as they left, never seen
        alive; one open during it stopped a round before the end); closing reads it if
        nothing has."""
        with self._lock:  # not in the middle of a poll
            if (again or self._last is None) and not self.ended:
                try:
                    self._last = self.monitor.poll()
                except Exception as error:  # noqa: BLE001 - a DHT gone: the view stays unread
                    logger.debug("%s: no last reading: %s", self.title, error)
            return self._last

    def close(self) -> None:
        self.read_once()
        with self._lock:
            self.ended = True
        self.monitor.close()
        self.session.close()


class ReplaySource:
    """A recorded run (``workbench status --record``), replayed one reading per ``interval``."""

    faults = None

    def __init__(self, path: str | Path, *, interval: float = 0.5) -> None:
        self.path = Path(path)
        # Read as it is shown: the whole recording's snapshots (each with its history) took
        # 750 MB for 30 minutes of 16 peers, and 10 s before the first frame.
        self._readings = replay(self.path)
        self._last = next(self._readings, None)
        if self._last is None:
            raise SwarmError(f"{self.path} holds no readings")
        self._first = True
        self._lock = threading.Lock()
        self.title = f"replay of {self._last.run_id} ({self.path.name})"
        self.interval = interval
        self.position = 0
        self.ended = False
        """Set once the recording's last reading was shown: a widget's poll thread then ends (it
        polled a finished replay, 150 times in 8 s, for as long as the kernel lived)."""

    def poll(self) -> SwarmSnapshot:
        """The next reading; once the recording is over, the last one again with no new events
        (its events were logged again at every poll, pushing the replay's history out of the log).
        Safe from two threads (a widget's poll and a refresh() by hand)."""
        with self._lock:
            self.position += 1
            if self._first:
                self._first = False
                return self._last
            following = next(self._readings, None)
            self.ended = following is None
            self._last = dataclasses.replace(self._last, new_events=[]) if following is None else following
            return self._last

    def steering_reason(self) -> str | None:
        return "a recording cannot be steered"

    def steer(self, **changes: Any) -> ControlState:
        raise SwarmError(self.steering_reason())

    def close(self) -> None:
        pass


class LocalFaults:
    """Fault injection into the peers of a :class:`~workbench.local.launch.LocalSwarm` (this machine's)."""

    def __init__(self, swarm, on_kill: Callable[[str], None] | None = None) -> None:
        self.swarm = swarm
        self.on_kill = on_kill  # the monitor's note_killed: the peer's departure is told as a kill

    def _peer(self, peer_id: str):
        for peer in self.swarm.peers:
            started = peer.last("started")
            if started and started.get("peer_id") == peer_id:
                return peer
        return None

    def reason(self, peer_id: str) -> str | None:
        peer = self._peer(peer_id)
        if peer is None:
            return "this peer runs on another machine: faults only go to peers this demo launched"
        if peer.process.poll() is not None:
            return f"{peer.name} is not running"
        return None

    def stopped(self, peer_id: str) -> bool:
        peer = self._peer(peer_id)
        return peer is not None and peer.process.poll() is not None

    def _checked(self, peer_id: str):
        reason = self.reason(peer_id)
        if reason:
            raise SwarmError(reason)
        return self._peer(peer_id)

    def inject(self, peer_id: str, request: FaultRequest) -> str:
        if request.fault is Fault.RESTART:
            if not self.stopped(peer_id):
                raise SwarmError(self.reason(peer_id) or "only a stopped peer can be restarted")
            peer = self.swarm.restart(self._peer(peer_id).name)
            return f"restarted {peer.name} with its identity and run dir: it downloads the state and rejoins"
        peer = self._checked(peer_id)
        fault, argument = request.fault, request.argument
        if fault is Fault.KILL:
            if self.on_kill is not None:
                self.on_kill(peer_id)
            peer.kill()
            return f"killed {peer.name} (SIGKILL): watch the others fall back and carry on"
        if fault is Fault.FREEZE:
            seconds = float(argument or 30.0)
            peer.freeze(seconds)
            return f"froze {peer.name} for {seconds:.0f} s (SIGSTOP): a straggler; it catches up by downloading state"
        if fault is Fault.THROTTLE:
            milliseconds = float(argument or 0.0)
            peer.write_faults(throttle_ms=milliseconds)
            return f"{peer.name} now sleeps {milliseconds:.0f} ms per inner step"
        if fault is Fault.CORRUPT:
            peer.write_faults(corrupt_next=time.time())
            return f"{peer.name} will send a corrupt (NaN) update next round: the group must reject it"
        if fault is Fault.OVERSIZE:
            peer.write_faults(oversize_next=time.time())
            return f"{peer.name} will send 1000x the update it declares next round: the group must refuse the round"
        if fault is Fault.OVERCLAIM:
            peer.write_faults(overclaim_next=time.time())
            return (
                f"{peer.name} will claim 1e9 samples next round: the group must count it as at most "
                "16x the others' median"
            )
        raise ValueError(f"unknown fault {fault!r}")


class DemoSource(LiveSource):
    """The live view of a ``workbench demo``: steering with peer-0's key, faults for every peer."""

    def __init__(self, session, swarm) -> None:
        started = (peer.last("started") for peer in swarm.peers)
        super().__init__(session, anchors=[event["peer_id"] for event in started if event])
        self.title = f"demo {self.keys.run_id} ({swarm.count} local peers)"
        self.faults = LocalFaults(swarm, on_kill=self.monitor.note_killed)

    @classmethod
    def of(cls, swarm) -> DemoSource:
        """Connect to a started :class:`~workbench.local.launch.LocalSwarm` as a client, signing with
        peer-0's key (the run's owner key: the demo owns the run)."""
        from swarm.dht import NetworkConfig
        from swarm.session import connect

        address = swarm.peers[0].last("started")["addresses"][0]
        session = connect(
            NetworkConfig(initial_peers=[address], client_mode=True),
            RunKeys(swarm.config.peer.run_id),
            signing_key=swarm.run_dir / "peer-0" / "identity.key",
        )
        return cls(session, swarm)


class SimSource:
    """The live view of a simulated swarm (``Experiment(backend="sim")``): each virtual peer's
    progress as a heartbeat, through the same monitor as a real run. Nothing to steer."""

    interval = 0.5
    faults = None

    def __init__(self, title: str, peers: int, *, inner_steps: int, per_round: int = 1) -> None:
        """``per_round``: simulator rounds per outer round (streaming's are single inner steps:
        its view said round 137 where the history said round 7)."""
        from swarm.records import PeerHeartbeat, Stage

        self.per_round = max(1, per_round)
        self.title = f"simulation: {title}"
        self.monitor = SwarmMonitor()
        self._lock = threading.Lock()
        self._beats = {
            rank: PeerHeartbeat(
                peer_id=f"sim-{rank}",
                name=f"virtual-{rank}",
                stage=Stage.JOINING,
                outer_step=0,
                inner_step=0,
                inner_steps=inner_steps,
                device="cpu (simulated)",
                time=time.time(),
            )
            for rank in range(peers)
        }
        self._done = False
        self._round_ended = dict.fromkeys(self._beats, time.monotonic())

    def update(self, info: dict[str, float]) -> None:
        """Called from a virtual peer's thread after each of its rounds (SimConfig.on_round)."""
        from swarm.records import Stage

        rank = int(info["rank"])
        with self._lock:
            beat = self._beats[rank]
            now = time.monotonic()  # the round's wall time: its rate (the view said 0 samples/s)
            seconds, self._round_ended[rank] = max(now - self._round_ended[rank], 1e-6), now
            self._beats[rank] = beat.model_copy(
                update=dict(
                    stage=Stage.TRAINING,
                    samples_per_second=float(info.get("samples", 0)) / seconds,
                    last_round_seconds=seconds,
                    last_round_steps=int(info.get("steps", 0)),
                    outer_step=-(-int(info["round"]) // self.per_round),
                    loss=float(info["loss"]),
                    bytes_sent=int(info["bytes"]),
                    bytes_received=int(info["bytes"]),
                    group_size=len(self._beats),
                    time=time.time(),
                )
            )

    @property
    def ended(self) -> bool:
        """The simulation is over (its last state stays in view)."""
        return self._done

    def finish(self) -> None:
        """The run ended: its peers stay in view, done with their rounds (not "left": the
        widget would then show an empty swarm and no loss curves)."""
        from swarm.records import Stage

        with self._lock:
            self._done = True
            self._beats = {
                r: b.model_copy(update=dict(stage=Stage.FINISHING, time=time.time()))
                for r, b in self._beats.items()
            }

    def poll(self) -> SwarmSnapshot:
        from swarm.monitor import Reading

        with self._lock:
            beats = {b.peer_id: b for b in self._beats.values()}
            return self.monitor.ingest(Reading(time.time(), "simulation", beats))

    def steering_reason(self) -> str | None:
        return "a simulated run is not steered live (change its settings and run it again)"

    def steer(self, **changes: Any) -> ControlState:
        raise SwarmError(self.steering_reason())

    def close(self) -> None:
        pass
