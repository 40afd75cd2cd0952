"""`workbench status MULTIADDR...`: who is in a run and what each peer is doing, without a UI.

Joins the DHT as a client (no inbound connections, nothing trained or served) with the run's
record validators, and prints the :class:`~swarm.monitor.SwarmSnapshot` of the run once (or
every ``--watch`` seconds): a table, or JSON with ``--json``. ``--record FILE`` keeps every
reading for ``workbench status --replay FILE`` (and the TUI's replay) later.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from swarm.bounds import parser as bounded
from swarm.dht import NetworkConfig
from swarm.errors import SwarmError
from swarm.monitor import strict_json
from swarm.records import RunKeys, check_owner

STATUS_WIDTH = 240
"""Columns of `status`'s table when it goes to a file or a pipe (a table takes what it needs)."""


def add_observer_options(parser: argparse.ArgumentParser) -> None:
    from workbench.cli.options import add_run_access_options

    # WORKBENCH_RUN_ID as the peers take it (`status` beside a peer started with it looked for
    # run 'workbench', while WORKBENCH_RUN_SECRET was taken)
    # Their WORKBENCH_* variables are read after parsing (observer_settings), checked as `start`
    # checks them and named in the error: an empty one fell back to the default silently here
    # (`start` refuses it), and a bad timeout was said as --connect-timeout (a review, stop 69).
    parser.add_argument(
        "--run-id", default=None, help="the run's name (default: $WORKBENCH_RUN_ID, else workbench)"
    )
    parser.add_argument(
        "--connect-timeout",
        type=bounded("connect_timeout"),
        default=None,
        help="seconds to reach the peers (default: $WORKBENCH_CONNECT_TIMEOUT, else 20)",
    )
    add_run_access_options(parser)
    parser.set_defaults(secret=None, owner=os.environ.get("WORKBENCH_OWNER"))


OBSERVED = (
    # (key, its variables in the peers' order, the default): `start` with WORKBENCH_SECRET made a
    # private run that `status` in the same shell could not find (it read WORKBENCH_RUN_SECRET only)
    ("run_id", ("WORKBENCH_RUN_ID",), "workbench"),
    ("connect_timeout", ("WORKBENCH_CONNECT_TIMEOUT",), 20.0),
    ("secret", ("WORKBENCH_SECRET", "WORKBENCH_RUN_SECRET"), None),
)


def observer_settings(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` of `status`, `steer`, `doctor` or `monitor` with --run-id, --connect-timeout and
    --secret not given on the command line taken from their WORKBENCH_* variables, each checked
    as `start` checks it (a ConfigError naming the variable), else the defaults. Idempotent."""
    from workbench.cli.configfile import ConfigError, env_value

    for key, variables, default in OBSERVED:
        if getattr(args, key, None) is not None:
            continue
        variable = next((v for v in variables if v in os.environ), None)
        try:
            value = default if variable is None else env_value(key, os.environ[variable], variable)
        except ConfigError as error:
            raise SwarmError(str(error)) from None
        setattr(args, key, value)
    return args


def add_status_parser(commands) -> None:
    parser = commands.add_parser(
        "status",
        help="print the peers of a running swarm (read-only)",
        description="Print the live peers of a run, read from the DHT as a client. Example:\n"
        "  workbench status /ip4/127.0.0.1/tcp/31337/p2p/QmXyz... --json\n"
        "  workbench status --replay run.jsonl --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("peers", nargs="*", metavar="MULTIADDR", help="any peer of the run")
    add_observer_options(parser)
    parser.add_argument("--json", action="store_true", help="one JSON object per read on stdout")
    parser.add_argument(
        "--watch", type=bounded("watch"), metavar="SECONDS", help="read again every SECONDS until Ctrl+C"
    )
    parser.add_argument("--record", metavar="FILE", help="append every reading to FILE (JSONL) for replay")
    parser.add_argument("--replay", metavar="FILE", help="print a recorded run instead of a live one")


def open_observer(args: argparse.Namespace, *, signing_key: str | None = None):
    """(session, monitor reader) for a read-only client of the run named by ``args``."""
    from swarm.addresses import peer_ids
    from swarm.monitor import dht_reader
    from swarm.session import connect

    if not args.peers:
        raise SwarmError("give the multiaddr of any peer of the run (what `workbench start` printed)")
    observer_settings(args)
    keys = RunKeys(args.run_id, args.secret)
    network = NetworkConfig(
        initial_peers=list(args.peers), client_mode=True, connect_timeout=args.connect_timeout
    )
    session = connect(network, keys, signing_key=signing_key)
    # The peers the user joined through vote on flags when the owner's peer is not there.
    anchors = peer_ids(args.peers)
    return session, dht_reader(session.board, session.store, keys, owner=args.owner, anchors=anchors)


def render(data: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    control = data.get("control") or {}
    count = len(data["peers"])
    title = (
        f"run {escape(str(data['run_id']))}: {count} peer{'' if count == 1 else 's'}, round {data['outer_round']}"
        + (f", control v{control['version']}" if control else "")
    )
    table = Table(title=title, title_justify="left")
    columns = (
        "name",
        "stage",
        "outer",
        "inner",
        "last H",
        "loss",
        "samples/s",
        "MB sent",
        "group",
        "ctl",
        "device",
        "peer id",
    )
    for column in columns:
        table.add_column(
            column, justify="left" if column in ("name", "stage", "device", "peer id") else "right"
        )
    for p in data["peers"]:
        table.add_row(
            escape(p["name"]) + (" (lagging)" if p.get("lagging") else ""),
            p["stage"] + (f" {p['download_progress']:.0%}" if p.get("download_progress") else ""),
            str(p["outer_step"]),
            f"{p['inner_step']}/{p['inner_steps']}",
            str(p.get("last_round_steps") or ""),  # time-boxed rounds: each peer's own H
            "" if p["loss"] is None else f"{p['loss']:.3f}",
            "-" if p.get("idle") else f"{p['samples_per_second']:.0f}",  # idle: its last round's
            f"{p['bytes_sent'] / 1e6:.1f}",
            str(p.get("group_size", "")),
            str(p.get("control_version", 0)),
            escape(p["device"]),
            escape(p["peer_id"][-12:]),
        )
    # Into a file or a pipe (a log, `--watch` under a service manager) rich assumes 80 columns
    # and cuts every cell to "…": there, as wide as the table needs (COLUMNS still wins).
    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    console = Console(width=STATUS_WIDTH if wide else None)
    console.print(table)
    if line := _deadlines(data["peers"]):
        console.print(line)
    for liar in data.get("ignored", []):
        console.print(f"  [red]ignored[/red] {escape(liar['peer_id'][-12:])}: {escape(liar['reason'])}")
    voters = data.get("flag_voters")
    if data.get("ignored") and isinstance(voters, list) and voters:
        whose = {
            "owner": "the owner's peer"
            + (" and its round mates" if len(voters) > 1 else " (no round mates seen yet)"),
            "mates": "the owner's peer's round mates (the owner's peer gone)",
            "joined": "the peers given on the command line and their round mates (the owner's peer not seen)",
        }.get(data.get("flags_from"), "every live peer (neither the owner's peer nor a peer given here seen)")
        console.print(f"  [dim](other peers' flags are counted from {len(voters)}: {whose})[/dim]")
    for gone in data.get("departed", []):
        when = time.strftime("%H:%M:%S", time.localtime(gone["time"]))
        console.print(
            f"  [dim]left[/dim] {escape(gone['name'])} at {when} ({escape(gone['how'])}), outer step {gone['outer_step']}"
        )
    for event in data.get("events", []):
        console.print(f"  {escape(event['message'])}")


def _deadlines(peers: list[dict]) -> str | None:
    """The deadlines line: each the median of the peers that learned it (0 is "not learned yet":
    two peers just joined beside one that had learned 10 s read "waits 0.0 s")."""

    def median(key: str) -> str:
        known = sorted(p[key] for p in peers if p.get(key))
        return f"{known[len(known) // 2]:.1f} s" if known else "? s"

    if not any(p.get("round_wait_seconds") for p in peers):
        return None
    return (
        f"  deadlines (median of the peers, learned from the last rounds): the barrier waits "
        f"{median('round_wait_seconds')} for a round mate, matchmaking {median('matchmaking_window_seconds')} "
        f"for the group, averaging gives up after {median('averaging_deadline_seconds')}"
    )


def run_status_command(args: argparse.Namespace) -> int:
    if args.watch is not None and not 0.5 <= args.watch <= 3600:
        raise SwarmError(f"--watch must be within 0.5..3600 s (got {args.watch})")
    show = (
        (lambda data: print(json.dumps(strict_json(data), allow_nan=False), flush=True))
        if args.json
        else render
    )
    if args.replay:
        from swarm.monitor import replay

        ignored = [
            flag
            for flag, given in (
                ("a MULTIADDR", args.peers),
                ("--record", args.record),
                ("--watch", args.watch is not None),
                ("--owner", args.owner),
            )
            if given
        ]
        if ignored:  # it would read no live run: these did nothing (--record made no file)
            raise SwarmError(
                f"--replay prints a recorded run, so {', '.join(ignored)} would do nothing: drop "
                f"{'it' if len(ignored) == 1 else 'them'} (to record a live run: `workbench status "
                "MULTIADDR --record FILE`)"
            )

        shown = 0
        for shown, snapshot in enumerate(replay(args.replay), start=1):  # noqa: B007 - counted
            show(snapshot.to_json())
        if not shown:  # as the monitor says it
            raise SwarmError(f"{args.replay} holds no readings")
        return 0
    from swarm.monitor import SwarmMonitor

    observer_settings(args)
    RunKeys(args.run_id, args.secret)  # a bad run id, secret or owner fails before connecting
    check_owner(args.owner)
    new_record = bool(args.record) and not Path(args.record).exists()
    if args.record:  # so does a --record file that cannot be written, or is not a recording
        from swarm.monitor import open_recording

        open_recording(args.record).close()
    try:
        session, read = open_observer(args)
    except BaseException:
        if new_record:  # a refused run leaves no recording of nothing behind ("holds no readings")
            _remove_if_empty(Path(args.record))
        raise
    monitor = SwarmMonitor(read, record_to=args.record)
    try:
        while True:
            try:
                snapshot = monitor.poll()
            except SwarmError as error:
                if args.watch is None:
                    raise
                print(f"warning: {error}", file=sys.stderr)  # a watch goes on: the DHT may be back
                time.sleep(args.watch)
                continue
            show(snapshot.to_json())
            if args.watch is None:
                if not snapshot.peers:
                    print(
                        f"no live peer of run '{args.run_id}' (check --run-id and --secret)", file=sys.stderr
                    )
                    return 1
                return 0
            time.sleep(args.watch)
    finally:
        monitor.close()
        session.close()


def _remove_if_empty(path: Path) -> None:
    """Remove a recording this command made that holds its header only."""
    try:
        if len(path.read_text(errors="replace").splitlines()) <= 1:
            path.unlink()
    except OSError:
        pass
