"""What a peer tells others about itself: what its rounds measured (:class:`RoundStats`, read
by its heartbeat and its summary) and its events (:class:`Events`: ``<run_dir>/metrics.jsonl``
and the exporters, TensorBoard and W&B, fed the same records)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Any

from optim import robust
from swarm.records import PROTOCOL, PeerHeartbeat, Stage, is_name, printable

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RoundStats:
    """A peer's running figures, as its heartbeat shows them."""

    last_loss: float | None = None
    samples_per_second: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    last_round_seconds: float | None = None
    last_round_steps: int = 0
    """Inner steps of the last round: H, or what fit in a time-boxed round."""
    group_size: int = 0
    dp_bytes: int = 0
    """What data-parallel would have all-reduced for the same inner steps (fp32 gradients)."""
    last_error: str | None = None
    last_round_spread: float = 0.0
    """Seconds between the first and the last arrival of the last round's group."""
    last_round_last: str = ""
    """Who of the last round's group arrived last."""
    last_round_alone: str = ""
    """Why this peer stepped alone in its last round ("" when it averaged)."""

    def arrivals(self, report: Any) -> None:
        """The last round's arrivals from its members' info (other peers' claims: malformed
        entries are skipped, and a name that is not a valid peer name is left out: it goes into
        this peer's heartbeat, whose schema would refuse it), or why this peer was alone."""
        alone = report.group_size <= 1
        self.last_round_alone = (report.error or "no other peer in this round")[:200] if alone else ""
        times = [
            (float(g["arrived"]), _claimed_name(g.get("name")))
            for g in (report.group_info if not alone else [])
            if isinstance(g, dict)
            and isinstance(g.get("arrived"), (int, float))
            and not isinstance(g.get("arrived"), bool)
            and math.isfinite(g["arrived"])
        ]
        if len(times) < 2:
            self.last_round_spread, self.last_round_last = 0.0, ""
            return
        last, name = max(times)
        self.last_round_spread, self.last_round_last = min(last - min(times)[0], 86400.0), name


def _claimed_name(name: Any) -> str:
    """A name another peer gave in its gathered info, cut to 64 characters; "" unless it is a
    valid peer name (a round mate once named itself "x]" and this peer's next heartbeat failed
    its own schema, stopping the peer)."""
    name = str(name or "")[:64]
    return name if is_name(name) else ""


def _ends_mid_line(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            handle.seek(-1, os.SEEK_END)
            return handle.read(1) != b"\n"
    except OSError:  # empty (seek before the start), or unreadable
        return False


class Events:
    """One JSON object per line in ``metrics.jsonl``, and the same record to every exporter; an
    exporter that fails is dropped (a dashboard must never stop training)."""

    def __init__(self) -> None:
        self.name = "peer"
        self._file = None
        self._failed = False  # the last write to the file failed (said once until one succeeds)
        self.exporters: list[Any] = []

    def open(self, run_dir: Path | None, *, name: str, exporters: list[Any]) -> None:
        self.name = name
        if run_dir is not None:
            path = run_dir / "metrics.jsonl"
            self._file = open(path, "a", buffering=1)  # noqa: SIM115
            if _ends_mid_line(path):  # killed mid-line, or a full disk: end that line first
                with contextlib.suppress(OSError):  # (its next event went onto it, and the
                    self._file.write("\n")  # export refused the whole file)
        self.exporters = exporters

    def emit(self, event: str, **fields: Any) -> None:
        record = {"event": event, "time": time.time(), "peer": self.name, **fields}
        if self._file:
            try:
                self._file.write(json.dumps(record) + "\n")
                self._failed = False
            except OSError as error:  # a full disk: the events are lost, training goes on
                if not self._failed:
                    logger.error(
                        "%s: cannot write metrics.jsonl (%s); its events are lost until it can",
                        self.name,
                        error,
                    )
                self._failed = True
        for exporter in list(self.exporters):  # a copy: a failing one is dropped, the rest still get it
            try:
                exporter.write(record)
            except Exception as error:  # noqa: BLE001 - a dashboard must never stop training
                logger.warning("%s: dropping the %s exporter: %s", self.name, type(exporter).__name__, error)
                self.exporters.remove(exporter)

    def close(self) -> None:
        if self._file:
            try:
                self._file.close()
            except OSError as error:  # its last lines could not be flushed (a full disk)
                logger.error("%s: closing metrics.jsonl: %s", self.name, error)
            self._file = None
        for exporter in self.exporters:
            try:
                exporter.close()
            except Exception as error:  # noqa: BLE001
                logger.warning("closing the %s exporter: %s", type(exporter).__name__, error)
        self.exporters = []


def round_note(report: Any) -> str:
    """The end of a round's log line: why it averaged alone, or what kept its mean out. The
    optimizer has just logged a refusal in full as an error (:func:`optim.contribution.judge`):
    the line names its cause only, not the whole message again."""
    if not report.error:
        return ""
    if report.group_size <= 1:
        return f"  (alone: {report.error})"
    if report.applied:  # a finite mean, applied (this peer's own Δ was not)
        return f"  ({report.error})"
    cause = re.sub(r"^round \d+: |; the global params were left unchanged.*$", "", report.error)
    return f"  (not applied: {cause})"


def round_fields(
    report: Any,
    info: dict[str, Any],
    outer_step: int,
    stats: RoundStats,
    *,
    eval_loss: float,
    resync: str | None,
) -> dict[str, Any]:
    """A ``round`` event's fields from the sync's report (:class:`optim.averager.RoundReport`)
    and the info this peer sent with it (its outer step and θ fingerprint)."""
    return dict(
        outer_step=outer_step,
        loss=stats.last_loss,
        eval_loss=eval_loss,
        group_size=report.group_size,
        pending=report.pending,  # overlapped: the first sync has nothing averaged yet
        plane=report.plane,
        bytes_sent=report.bytes_sent,
        bytes_received=report.bytes_received,
        averaging_seconds=report.seconds,
        matchmaking_seconds=report.matchmaking_seconds,  # of which: until the group formed
        alone_reason=report.error,
        resync=resync,
        samples_per_second=stats.samples_per_second,
        inner_steps=stats.last_round_steps,  # this peer's H of the round (time boxes: its own)
        arrival_spread=stats.last_round_spread,  # the group's first to last arrival, and who was last
        last_arrived=stats.last_round_last,
        # |θ| as this round started: equal on peers at the same outer step that agree
        # (the model itself may differ: an eager peer trains θ + its own offset)
        global_norm=math.sqrt(sum(f * f for f in info["fingerprint"])),
        local_update_norm=report.local_norm,
        mean_update_norm=report.mean_norm,
        # each member's averaging weight (samples this round; a torchrun node: all ranks'), as
        # the group counted it: a claim of 1e9 is recorded as what it counted for (16x the
        # others' median), not as claimed (export showed 1e9 as a member's weight; a review)
        group_weights=sorted(
            robust.counted_weights(
                [g["weight"] for g in report.group_info if isinstance(g.get("weight"), (int, float))]
            )
        ),
    )


def heartbeat_of(peer: Any) -> PeerHeartbeat:
    """A :class:`workbench.run.peer.Peer`'s heartbeat now: its stage, clock, figures and claims."""
    from hivemind.utils import get_dht_time

    stats, diloco = peer.stats, peer.diloco
    return PeerHeartbeat(
        peer_id=peer.peer_id,
        name=peer.name,
        stage=peer.stage,
        outer_step=diloco.outer_step_count if diloco else 0,
        inner_step=diloco.inner_step_count if diloco else 0,
        inner_steps=peer.config.round_steps,
        loss=stats.last_loss,
        samples_per_second=stats.samples_per_second,
        bytes_sent=stats.bytes_sent,
        bytes_received=stats.bytes_received,
        device=str(peer.device or "cpu"),
        time=get_dht_time(),
        last_round_seconds=stats.last_round_seconds,
        group_size=stats.group_size,
        control_version=peer.steering.version,
        protocol=PROTOCOL,
        control_refused=peer.steering.refused[0],
        control_refusal=printable(peer.steering.refused[1])[:200],
        addresses=[] if peer.config.network.client_mode else peer.addresses[:16],
        tokens_per_second=stats.samples_per_second * peer.config.model.block_size,
        dp_bytes=stats.dp_bytes,
        rounds=peer.config.total_rounds if peer.config.peer.rounds else 0,
        last_error=stats.last_error[:300] if stats.last_error else None,
        ignored={peer: why[:200] for peer, why in list(peer.board.ignored.items())[-16:]},
        averaged_with=[tag for p, tag in tuple(peer.averager.vouching.mates.items()) if p != peer.peer_id][
            -16:
        ]
        if peer.averager
        else [],
        serving=bool(peer.averager and peer.averager.serving.answering),
        last_round_steps=stats.last_round_steps,
        round_wait_seconds=peer.averager.barrier.wait.seconds if peer.averager else 0.0,
        averaging_deadline_seconds=peer.averager.averaging_deadline.seconds if peer.averager else 0.0,
        matchmaking_window_seconds=peer.averager.matchmaking_window.seconds if peer.averager else 0.0,
        last_round_spread=stats.last_round_spread,
        last_round_last=stats.last_round_last,
        last_round_alone=stats.last_round_alone,
        download_progress=(
            (peer.averager.download_progress() or 0.0)
            if peer.averager and peer.stage is Stage.DOWNLOADING
            else 0.0
        ),
        final_theta=peer.final_theta if peer.stage in (Stage.FINISHING, Stage.LEAVING) else [],
        settled=peer.settled and peer.stage is Stage.FINISHING,
        download_donors=(
            min(64, peer.averager.download_donors())
            if peer.averager and peer.stage is Stage.DOWNLOADING
            else 0
        ),
    )
