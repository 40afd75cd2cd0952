"""`workbench monitor`, `workbench replay`: the Textual swarm monitor over a live or recorded run.

``--web`` serves the same app in a browser through textual-serve on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys

from swarm.bounds import parser as bounded
from swarm.errors import SwarmError


def add_monitor_parsers(commands) -> None:
    from workbench.cli.status import add_observer_options

    monitor = commands.add_parser(
        "monitor",
        help="open the live swarm monitor (terminal UI) on a running swarm",
        description="Watch and steer a live run in a terminal UI. Example:\n"
        "  workbench monitor /ip4/127.0.0.1/tcp/31337/p2p/QmXyz... --key run/identity.key",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    monitor.add_argument("peers", nargs="+", metavar="MULTIADDR", help="any peer of the run")
    add_observer_options(monitor)
    monitor.add_argument("--key", metavar="FILE", help="the run owner's key file: enables steering")
    monitor.add_argument("--record", metavar="FILE", help="also record every reading to FILE (JSONL)")
    _add_web_options(monitor)

    replay = commands.add_parser(
        "replay",
        help="open the monitor on a recorded run (`workbench status --record FILE`)",
        description="Replay a recorded run in the terminal UI.",
        epilog="example:\n  workbench status /ip4/127.0.0.1/tcp/31337/p2p/QmXyz... --record run.jsonl\n"
        "  workbench replay run.jsonl --interval 0.2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    replay.add_argument("file", metavar="FILE", help="a recording made with --record")
    replay.add_argument(
        "--interval",
        type=bounded("interval"),
        default=0.5,
        help="seconds between two recorded readings (default 0.5)",
    )
    _add_web_options(replay)


def _add_web_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--web", action="store_true", help="serve the app in a browser on 127.0.0.1")
    parser.add_argument(
        "--web-port", type=bounded("web_port"), default=8000, help="port for --web (default 8000)"
    )


def run_monitor_command(args: argparse.Namespace, argv: list[str]) -> int:
    from workbench.sources import LiveSource, ReplaySource

    if args.web:
        _check_port(args.web_port)
    if args.command == "replay":
        source = ReplaySource(args.file, interval=args.interval)
    else:
        from swarm.addresses import parse_peer_addresses
        from swarm.records import check_owner
        from workbench.cli.status import observer_settings

        parse_peer_addresses(args.peers)  # a bad address first: it needs no terminal to be said
        observer_settings(args)
        check_owner(args.owner)
        if not args.web:
            _need_a_terminal("monitor")
        if args.record:  # a --record file that cannot be written, or is not a recording: before connecting
            from swarm.monitor import open_recording

            open_recording(args.record).close()
        source = LiveSource.connect(
            args.peers,
            run_id=args.run_id,
            secret=args.secret,
            owner=args.owner,
            key=args.key,
            connect_timeout=args.connect_timeout,
            record_to=None if args.web else args.record,
        )
    if args.web:
        # Checked here, as without --web: served as they were, a missing recording, a bad key or
        # an unreachable peer were said only in the browser, with the server running on.
        source.close()
        return _serve(argv, args.web_port)
    if args.command == "replay":
        _need_a_terminal("replay", source.close)
    from tui.app import run_app
    from workbench.run.stopping import stopped_by_signals

    with stopped_by_signals():  # a closed terminal (SIGHUP) closes the source's DHT process too
        run_app(source)
    return 0


def _need_a_terminal(command: str, cleanup=lambda: None) -> None:
    """The monitor is a full-screen app drawn on stderr and read from stdin: without a terminal
    there (a script, a pipe, a CI log) it would fill the output with escape codes and wait for
    keys nobody can press. textual-serve (``--web``) runs it with its own driver."""
    if os.environ.get("TEXTUAL_DRIVER") or (sys.stdin.isatty() and sys.stderr.isatty()):
        return
    cleanup()
    instead = (
        "`workbench status MULTIADDR --watch 2` (or --json) prints the same readings as lines, and "
        if command == "monitor"
        else "`workbench status --replay FILE` (or --json) prints the recorded readings as lines, and "
    )
    raise SwarmError(
        f"`workbench {command}` is a full-screen terminal app, and stdin or stderr is not a terminal "
        f"here: {instead}--web serves the app to a browser"
    )


def _serve(argv: list[str], port: int) -> int:
    """The same command without --web, served to a browser by textual-serve."""
    from textual_serve.server import Server

    _check_port(port)
    command = [arg for arg in argv if arg != "--web"]
    if "--web-port" in command:
        at = command.index("--web-port")
        del command[at : at + 2]
    shell = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "workbench", *command])
    print(f"serving the monitor on http://127.0.0.1:{port} (Ctrl+C stops)", file=sys.stderr)
    Server(shell, host="127.0.0.1", port=port, title="swarm workbench").serve()
    return 0


def _check_port(port: int) -> None:
    if not 1 <= port <= 65535:
        raise SwarmError(f"--web-port must be within 1..65535 (got {port})")
    with socket.socket() as probe:  # textual-serve would say so only in a traceback, after "serving"
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as error:
            raise SwarmError(
                f"cannot serve the monitor on 127.0.0.1:{port} ({error.strerror}): pick another --web-port"
            ) from None
