"""Cost of one monitor refresh (summary, peers table in place, loss chart, sparklines).

    python -m benchmarks.tui_refresh [--peers 256] [--refreshes 30]

Baseline: the same refresh with 4 peers, measured in this run. Reported: mean and worst
milliseconds per refresh for ``--peers`` peers (target: under 100 ms for 256), from a reading
handed to the app until Textual has laid out and painted it (``mean_ms``, ``max_ms``; the
widgets' own updates alone: ``update_mean_ms``), the ratio to the baseline, and the monitor's
own derivation (SwarmMonitor.ingest) per reading, the readings built beforehand. Runs the app
headless (Textual's test driver). Writes benchmarks/results/tui_refresh.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from swarm.monitor import Reading, SwarmMonitor
from tests.ui.fake import FakeSource, heartbeat, peer_id
from tui.app import SwarmApp

RESULTS = Path(__file__).parent / "results"


async def measure(peers: int, refreshes: int) -> dict:
    ingest_ms = _ingest_ms(peers, refreshes + 2)
    # freeze_startup as `workbench monitor` runs it (tui.app.run_app)
    app = SwarmApp(FakeSource(peers=peers, steps=1), poll=False, clock=False, freeze_startup=True)
    monitor = SwarmMonitor()
    times, updates = [], []
    async with app.run_test(size=(160, 50)) as pilot:
        for step in range(1, refreshes + 3):
            # Each reading made just before its refresh (not timed), as a live monitor makes it:
            # the readings built beforehand (stop 60 to 65) held a copy of every peer's history
            # each, which every full garbage collection walked (about 160 ms with 256 peers).
            snapshot = monitor.ingest(_reading(peers, step))
            started = time.perf_counter()
            app.show(snapshot)
            await pilot.pause()  # Textual lays out and paints it, as it would between two polls
            times.append((time.perf_counter() - started) * 1000)
            updates.append(app.last_refresh_seconds * 1000)  # the widgets' updates alone
            del snapshot  # the app holds the one it shows
    times, updates = times[2:], updates[2:]  # the first refreshes build the rows
    return {
        "peers": peers,
        "mean_ms": statistics.mean(times),
        "max_ms": max(times),
        "update_mean_ms": statistics.mean(updates),
        "ingest_ms_per_reading": ingest_ms,
    }


def _reading(peers: int, step: int) -> Reading:
    """The monitor's reading of ``peers`` peers at ``step`` (tests.ui.fake's heartbeats)."""
    t = 1000.0 + 10 * step
    return Reading(t, "fake-run", {peer_id(i): heartbeat(i, t, step, group_size=peers) for i in range(peers)})


def _ingest_ms(peers: int, steps: int) -> float:
    """SwarmMonitor.ingest per reading of ``peers`` peers, the readings built first (FakeSource's
    construction, timed before stop 60, built the heartbeats too)."""
    readings = [_reading(peers, step) for step in range(1, steps + 1)]
    monitor = SwarmMonitor()
    started = time.perf_counter()
    for reading in readings:
        monitor.ingest(reading)
    return (time.perf_counter() - started) * 1000 / len(readings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=256)
    parser.add_argument("--refreshes", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS / "tui_refresh.json")
    args = parser.parse_args()
    baseline = asyncio.run(measure(4, args.refreshes))
    result = asyncio.run(measure(args.peers, args.refreshes))
    result["ratio_to_4_peers"] = result["mean_ms"] / baseline["mean_ms"]
    report = {"baseline": baseline, "result": result, "target_ms": 100, "met": result["max_ms"] < 100}
    print(
        f"refresh, 4 peers (baseline): {baseline['mean_ms']:.1f} ms mean, {baseline['max_ms']:.1f} ms worst"
    )
    print(
        f"refresh, {args.peers} peers: {result['mean_ms']:.1f} ms mean, {result['max_ms']:.1f} ms worst "
        f"({result['ratio_to_4_peers']:.1f}x the baseline); target < 100 ms: {'met' if report['met'] else 'MISSED'}"
    )
    print(f"monitor derivation: {result['ingest_ms_per_reading']:.2f} ms per reading of {args.peers} peers")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
