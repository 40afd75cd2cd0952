"""Plain functions that turn snapshot values into short cell text (tested without a terminal)."""

from __future__ import annotations

import math

from swarm.monitor import SwarmSnapshot
from swarm.records import IDLE, PeerHeartbeat, Stage

STAGE_STYLE = {
    Stage.JOINING: "dim",
    Stage.DOWNLOADING: "cyan",
    Stage.TRAINING: "green",
    Stage.WAITING: "yellow",
    Stage.AVERAGING: "magenta",
    Stage.PAUSED: "bold yellow",
    Stage.FINISHING: "blue",
    Stage.LEAVING: "dim",
}


def human_bytes(count: float) -> str:
    """1234567 -> '1.2 MB' (decimal units, as network people count)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


def human_rate(per_second: float) -> str:
    """12345.6 -> '12.3k'."""
    if per_second >= 1e6:
        return f"{per_second / 1e6:.1f}M"
    if per_second >= 1e3:
        return f"{per_second / 1e3:.1f}k"
    return f"{per_second:.0f}"


def human_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    seconds = max(0, int(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def eta_seconds(snapshot: SwarmSnapshot) -> float | None:
    """Time left for the run's planned rounds, from the peers' round times (None: open-ended).
    Both the median of what the peers say: one heartbeat claiming 10¹² rounds made the ETA
    2,777,777,777 h (a review, stop 59)."""
    planned = sorted(p.rounds for p in snapshot.peers.values() if p.rounds)
    times = sorted(p.last_round_seconds for p in snapshot.peers.values() if p.last_round_seconds)
    if not planned or not times:
        return None
    return max(0, planned[len(planned) // 2] - snapshot.outer_round) * times[len(times) // 2]


def bytes_saved(snapshot: SwarmSnapshot) -> tuple[int, int]:
    """(bytes the live peers sent, bytes data-parallel would have sent for the same steps)."""
    peers = snapshot.peers.values()
    return sum(p.bytes_sent for p in peers), sum(p.dp_bytes for p in peers)


def stage_text(p: PeerHeartbeat) -> str:
    """The stage, with a download's progress once the donor has said how large the state is."""
    if p.stage is Stage.DOWNLOADING and p.download_progress > 0:
        donors = f" from {p.download_donors} donors" if p.download_donors > 1 else ""
        return f"download {p.download_progress:.0%}{donors}"
    return p.stage.value


def number(value: float, width: int, decimals: int) -> str:
    """``value`` in at most ``width`` characters: fewer decimals first, then k/M (the table's
    columns have fixed widths, and a cell longer than its column is cut: a loss of 10.825 read
    10.82, 12345.6 samples/s read 12345.)."""
    for places in range(decimals, -1, -1):
        text = f"{value:.{places}f}"
        if len(text) <= width:
            return text
    return human_rate(value)


def count(value: int, width: int) -> str:
    """A whole number in at most ``width`` characters (``width`` >= 4 fits any): thousands as k,
    then M, G, T, P, rounded down (150000 -> 150k, 12345678 -> 12M). Thousands alone did not fit:
    a lag of 150,000 read 150 in its 3-wide column, an outer step of 12,345,678 read 12345."""
    for power, suffix in enumerate(("", "k", "M", "G", "T", "P", "E")):
        text = f"{value // 1000**power}{suffix}"
        if len(text) <= width:
            return text
    return text


def _seconds(seconds: float, width: int) -> str:
    text = f"{seconds:.1f}s"
    return text if len(text) <= width else human_duration(seconds)  # a 20-minute round: 20m34s


def peer_row(p: PeerHeartbeat, top: int, widths: dict[str, int] | None = None) -> dict[str, str]:
    """The peers table's cells for one heartbeat (column key -> text), each within its column's
    ``widths`` where given (H=1000 showed inner 999/100)."""
    w = widths or {}
    inner = f"{p.inner_step}/{p.inner_steps}"
    if len(inner) > w.get("inner", len(inner)):
        inner = f"{count(p.inner_step, 4)}/{count(p.inner_steps, 4)}"
    return {
        "name": p.name,
        "stage": stage_text(p),
        "inner": inner,
        # the inner steps its last round took (time boxes: its own)
        "h": count(p.last_round_steps, w.get("h", 9)) if p.last_round_steps else "-",
        "outer": count(p.outer_step, w.get("outer", 9)),
        "lag": count(max(0, top - p.outer_step), w.get("lag", 9)),
        "loss": "-" if p.loss is None else number(p.loss, w.get("loss", 9), 3),
        "speed": "-" if p.stage in IDLE else number(p.samples_per_second, w.get("speed", 9), 1),
        "sent": human_bytes(p.bytes_sent),
        "received": human_bytes(p.bytes_received),
        "round": "-" if p.last_round_seconds is None else _seconds(p.last_round_seconds, w.get("round", 9)),
        "group": str(p.group_size or "-"),
        "control": f"v{count(p.control_version, w.get('control', 9) - 1)}" if p.control_version else "-",
    }


def sort_key(p: PeerHeartbeat, column: str, top: int):
    """A value to sort peers by ``column`` (numbers as numbers; missing values last)."""
    numeric = {
        "inner": p.inner_step,
        "h": p.last_round_steps,
        "outer": p.outer_step,
        "lag": top - p.outer_step,
        "loss": p.loss if p.loss is not None else math.inf,
        "speed": p.samples_per_second,
        "sent": p.bytes_sent,
        "received": p.bytes_received,
        "round": p.last_round_seconds if p.last_round_seconds is not None else math.inf,
        "group": p.group_size,
        "control": p.control_version,
    }
    if column in numeric:
        return (numeric[column], p.name)
    return (str(getattr(p, column, p.name) if column != "stage" else p.stage.value), p.name)


def matches(p: PeerHeartbeat, text: str, stage: str | None = None) -> bool:
    """The filter: a case-insensitive substring of the name, stage, device or peer id.
    ``stage``: the stage cell as shown, where it is not the heartbeat's (a peer that left)."""
    text = text.strip().lower()
    shown = p.stage.value if stage is None else stage
    return not text or any(text in field.lower() for field in (p.name, shown, p.device, p.peer_id))
