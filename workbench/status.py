"""`workbench status MULTIADDR...`: who is in a run and what each peer is doing, without a UI.

Joins the DHT as a client (no inbound connections, nothing trained or served), reads the
run's heartbeats once (or every ``--watch`` seconds) and prints a table, or JSON with
``--json``. The full monitor with history and events comes with the swarm-records issue.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from swarm.dht import NetworkConfig, dht_time, shutdown_quietly, start_dht
from swarm.errors import SwarmError
from swarm.records import check_run_id


def add_status_parser(commands) -> None:
    parser = commands.add_parser(
        "status",
        help="print the peers of a running swarm (read-only)",
        description="Print the live peers of a run, read from the DHT as a client. Example:\n"
        "  workbench status /ip4/127.0.0.1/tcp/31337/p2p/12D3KooW... --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("peers", nargs="+", metavar="MULTIADDR", help="any peer of the run")
    parser.add_argument("--run-id", default="workbench", help="the run's name (default: workbench)")
    parser.add_argument("--json", action="store_true", help="one JSON object per read on stdout")
    parser.add_argument(
        "--watch", type=float, metavar="SECONDS", help="read again every SECONDS until Ctrl+C"
    )
    parser.add_argument("--connect-timeout", type=float, default=20.0, help="seconds to reach the peers")


def snapshot(board, run_id: str) -> dict[str, Any]:
    """The run's live peers as plain data (the JSON shape of `workbench status --json`)."""
    peers = sorted(board.fetch().values(), key=lambda p: p.name)
    now = dht_time()
    return {
        "run_id": run_id,
        "time": now,
        "peers": [
            {**p.model_dump(mode="json"), "seconds_since_heartbeat": round(now - p.time, 2)} for p in peers
        ],
    }


def render(data: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"run {data['run_id']}: {len(data['peers'])} peers", title_justify="left")
    for column in (
        "name",
        "stage",
        "outer step",
        "inner step",
        "loss",
        "samples/s",
        "MB sent",
        "device",
        "peer id",
    ):
        table.add_column(
            column, justify="left" if column in ("name", "stage", "device", "peer id") else "right"
        )
    for p in data["peers"]:
        table.add_row(
            p["name"],
            p["stage"],
            str(p["outer_step"]),
            f"{p['inner_step']}/{p['inner_steps']}",
            "" if p["loss"] is None else f"{p['loss']:.3f}",
            f"{p['samples_per_second']:.0f}",
            f"{p['bytes_sent'] / 1e6:.1f}",
            p["device"],
            p["peer_id"][-12:],
        )
    Console().print(table)


def run_status_command(args: argparse.Namespace) -> int:
    check_run_id(args.run_id)
    if args.watch is not None and not 0.5 <= args.watch <= 3600:
        raise SwarmError(f"--watch must be within 0.5..3600 s (got {args.watch})")
    network = NetworkConfig(
        initial_peers=list(args.peers), client_mode=True, connect_timeout=args.connect_timeout
    )
    dht = start_dht(network)
    try:
        from swarm.progress import ProgressBoard

        board = ProgressBoard(dht, args.run_id)
        while True:
            data = snapshot(board, args.run_id)
            if args.json:
                print(json.dumps(data), flush=True)
            else:
                render(data)
            if args.watch is None:
                if not data["peers"]:
                    print(f"no live peer of run '{args.run_id}' (check --run-id)", file=sys.stderr)
                    return 1
                return 0
            time.sleep(args.watch)
    finally:
        shutdown_quietly(dht)
