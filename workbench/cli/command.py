"""The `workbench` command line: start a run, join one, or run a local demo swarm.

Logs go to stderr, data (the join command, --json results) to stdout. A mistake the user can
fix (bad address, bad value, unreachable peer) is one line on stderr and exit status 2. The
peer commands' flags and the config they build live in :mod:`workbench.cli.options`; each other
command in its own module, which registers its parser here.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from swarm.errors import SwarmError
from workbench import __version__
from workbench.cli.argv import from_elsewhere
from workbench.cli.options import (
    EXIT_INTERRUPTED,
    EXIT_USER_ERROR,
    _Parser,
    _where_from,
    apply_settings,
    attach_dash_values,
    build_config,
)
from workbench.settings.commands import add_demo_options, add_peer_options

if TYPE_CHECKING:
    from pathlib import Path

    from workbench.config import RunConfig

__all__ = ["EXIT_INTERRUPTED", "EXIT_USER_ERROR", "build_config", "build_parser", "main"]


EPILOG = """examples:
  workbench demo                                  4 local peers, live progress
  workbench demo --peers 2 --rounds 3 --json      one JSON object for scripts
  workbench start --host 0.0.0.0 --announce /ip4/203.0.113.7/tcp/31337 --port 31337
  workbench join /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...
  workbench status /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW... --json
  workbench simulate --method diloco --peers 4 --codec int8 --steps 400 --json
"""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="workbench",
        description="Train one model together with other peers over a hivemind swarm, with DiLoCo.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logs (-vv for hivemind's)")
    parser.add_argument("--version", action="version", version=f"workbench {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    start = commands.add_parser(
        "start",
        help="start the first peer of a new run and print the join command",
        description="Start the first peer of a new run; prints the command others paste to join.",
        epilog="examples:\n"
        "  workbench start --rounds 100 --run-dir runs/a\n"
        "  workbench start --config run.toml --host 0.0.0.0 --announce /ip4/203.0.113.5/tcp/31337\n"
        "  workbench start --model ./tiny-llama --tokenizer ./tok --dataset ./corpus --overlap\n"
        "  torchrun --nproc-per-node 2 -m workbench start --run-dir runs/node   # a 2-GPU node as one peer",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_peer_options(start)

    join = commands.add_parser(
        "join",
        help="join a running swarm through one or more of its peers",
        description="Join a run through the multiaddr(s) its peers printed.",
        epilog="examples (paste the command `workbench start` printed, then add your own flags):\n"
        "  workbench join /ip4/192.0.2.7/tcp/31337/p2p/QmXyz... --owner 090a1e6d35c847d4\n"
        "  workbench join /ip4/192.0.2.7/tcp/31337/p2p/QmXyz... --client-mode --run-dir runs/b",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    join.add_argument(
        "peers", nargs="+", metavar="MULTIADDR", help="e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW..."
    )
    add_peer_options(join)

    demo = commands.add_parser(
        "demo",
        help="run N peers on this machine (127.0.0.1) and watch them train",
        description="Launch N real peers as separate processes on 127.0.0.1.",
        epilog="examples:\n"
        "  workbench demo                        # 4 peers, 8 rounds, the swarm monitor\n"
        "  workbench demo --peers 2 --rounds 3 --headless --json > result.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_demo_options(demo)

    from workbench.cli.simulate import add_simulate_parser

    add_simulate_parser(commands)

    from workbench.cli.doctor import add_doctor_parser
    from workbench.cli.status import add_status_parser
    from workbench.cli.steer import add_steer_parser

    add_status_parser(commands)
    add_steer_parser(commands)
    add_doctor_parser(commands)
    from workbench.cli.monitor import add_monitor_parsers

    add_monitor_parsers(commands)
    from workbench.cli.completion import add_completion_parser
    from workbench.cli.config import add_config_parser
    from workbench.cli.export import add_export_parser

    add_config_parser(commands)
    add_export_parser(commands)
    add_completion_parser(commands)
    # "run with -v for details" is read after a command: `workbench start ... -v` was refused as
    # an unrecognized argument. Counted apart and added to the one before the command (_main):
    # a subcommand's parser starts from a namespace of its own.
    pending = list(commands.choices.values())
    while pending:
        command = pending.pop()
        command.add_argument(
            "-v",
            "--verbose",
            action="count",
            default=argparse.SUPPRESS,
            dest="verbose_after",
            help="more logs (-vv for hivemind's)",
        )
        for action in command._actions:  # `config show -v`
            if isinstance(action, argparse._SubParsersAction):
                pending += action.choices.values()
    return parser


class _CurrentStderr(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a record comes: a progress bar (rich's live
    display, workbench.run.progress_bar) redirects it to print each line above the bar. A
    handler holding the stream it started with wrote past the bar, and the joiner's terminal
    kept "downloading the global state ━━━ 0% -:--:… 0:00:0012:20:51 I downloaded the state"
    (a review, stop 60)."""

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ sets it: the current one is used
        pass


def _configure_logging(verbose: int) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname).1s %(message)s",
        datefmt="%H:%M:%S",
        handlers=[_CurrentStderr()],
    )
    # hivemind logs every failed matchmaking with a traceback; the peer reports those rounds
    # itself ("continuing alone: ..."), so hivemind speaks only with -v (warnings) or -vv.
    level = {0: "CRITICAL", 1: "WARNING"}.get(verbose, "DEBUG")
    os.environ.setdefault("HIVEMIND_LOGLEVEL", level)
    logging.getLogger("hivemind").setLevel(level)
    # multiaddr traces every address it parses at DEBUG (several lines per peer id): -vv only.
    logging.getLogger("multiaddr").setLevel(logging.DEBUG if verbose > 1 else logging.INFO)
    # torch's INFO lines are for its developers. Its import sets its loggers to WARNING, but a
    # Ctrl+C during that import left them at the root's INFO, and "FakeTensor cache stats: ..."
    # came out at exit.
    logging.getLogger("torch").setLevel(logging.WARNING)


def _print_join_command(config: RunConfig, addresses: list[str], key: Path, kept: bool) -> None:
    from workbench.cli.argv import join_command

    public = [a for a in addresses if "/127." not in a and "/::1/" not in a] or addresses
    print(f"Run '{config.peer.run_id}' started. Others join with:\n", flush=True)
    print(f"  {join_command(config, public[:1])}\n", flush=True)
    if len(public) > 1:
        print("Other addresses of this peer: " + " ".join(public[1:]) + "\n", flush=True)
    if config.peer.secret:
        print(
            "This run is private: give joiners the run secret in place of SECRET, privately (on a "
            "shared machine, as WORKBENCH_SECRET=... in the environment: a command line is "
            "readable by its other users).\n",
            flush=True,
        )
    print(f"The run's owner key, to steer it (`workbench steer ADDRESS --key FILE`): {key}", flush=True)
    if not kept:  # the run could not be steered once this peer is gone
        print(
            "(a temporary file, deleted when this peer exits: --run-dir DIR or --identity FILE keeps it)",
            flush=True,
        )
    print(flush=True)
    if config.network.host == "127.0.0.1":
        print(
            "(listening on 127.0.0.1 only: use --host 0.0.0.0 and --announce for other machines)\n",
            flush=True,
        )


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
    except BrokenPipeError:  # `workbench ... | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:  # Ctrl+C before a command's own handling (importing torch: 1-2 s)
        print("stopped.", file=sys.stderr)
        return 130
    if argv is None and _ran_torch:  # this process is a peer's or a simulation's (not a library call)
        from workbench.run.stopping import end_process

        end_process(code)
    return code


_ran_torch = False
"""A peer or a simulation ran here: torch's threads are up, and finalization can abort in one."""


def _one_line(error: BaseException) -> str:
    """An error's message on one line, whatever a value in it holds (a --tokenizer path with a
    newline split it in two)."""
    return str(error).replace("\r", "\\r").replace("\n", "\\n")


def _one_line_errors(run, errors) -> int:
    """``run()``; a mistake the user can fix is one line on stderr and exit status 2."""
    try:
        return run()
    except errors as error:
        print(f"error: {_one_line(error)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 0


def _unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> None:
    from workbench.cli.options import subparser

    hint = ""
    if args.command in ("start", "demo") and any("/p2p/" in item or item.startswith("/ip") for item in extra):
        hint = "; to join a run through a peer's address: workbench join ADDRESS"
    said_by = subparser(parser, args.command)
    if getattr(args, "config_command", None):  # `workbench config show: error: ...`
        said_by = subparser(said_by, args.config_command)
    said_by.error(f"unrecognized arguments: {' '.join(extra)}{hint}")


def _main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = attach_dash_values(argv if argv is not None else sys.argv[1:])
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # said by the command's own parser: "workbench start: error: ..."
            _unrecognized(parser, args, extra)
    except SystemExit as stop:  # a mistake, already said in one line (see _Parser); --help re-raises
        if stop.code == EXIT_USER_ERROR:
            return EXIT_USER_ERROR
        raise
    args.verbose += getattr(args, "verbose_after", 0)
    _configure_logging(args.verbose)
    if any(item == "--secret" or item.startswith("--secret=") for item in argv):
        # (a review, stop 64: `ps` showed a private run's secret in full to every local user)
        logging.getLogger("workbench").warning(
            "--secret on a command line is readable by every user of this machine (ps, /proc); "
            "set WORKBENCH_SECRET in the environment instead"
        )
    if not faulthandler.is_enabled():  # a crash in native code (torch, gloo) still names its Python line
        faulthandler.enable()
        if hasattr(signal, "SIGUSR1"):  # `kill -USR1 PID`: every thread's stack, for a peer that hangs
            faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.command == "config":
        from workbench.cli.config import run_config_command

        return _one_line_errors(lambda: run_config_command(parser, args, argv), (ValueError, SwarmError))
    if args.command == "completion":
        from workbench.cli.completion import run_completion_command

        return run_completion_command(parser, args)
    if args.command == "export":
        from workbench.cli.export import run_export_command

        return _one_line_errors(lambda: run_export_command(args), (ValueError, OSError))
    if args.command in ("monitor", "replay"):
        from workbench.cli.monitor import run_monitor_command

        return _one_line_errors(lambda: run_monitor_command(args, argv), SwarmError)
    if args.command in ("status", "steer", "doctor"):
        from workbench.cli.doctor import run_doctor_command
        from workbench.cli.status import run_status_command
        from workbench.cli.steer import run_steer_command

        command = {"status": run_status_command, "steer": run_steer_command, "doctor": run_doctor_command}
        return _one_line_errors(lambda: command[args.command](args), SwarmError)
    if args.command == "simulate":
        from workbench.run.data import DataError as _DataError
        from workbench.simulate import run_simulate_command

        def simulate() -> int:
            from workbench.run.stopping import stopped_by_signals

            global _ran_torch
            apply_settings(parser, args, argv)
            _ran_torch = True
            try:
                with stopped_by_signals():  # Ctrl+C, SIGTERM, SIGHUP; even started in the background
                    return run_simulate_command(args)
            except KeyboardInterrupt:  # no result: the virtual peers stopped at their next step
                print("stopped.", file=sys.stderr)
                return 130

        return _one_line_errors(simulate, (ValueError, _DataError))
    sources: dict[str, str] = {}
    try:
        sources = apply_settings(parser, args, argv)
        config = build_config(args)
    except (ValueError, SwarmError) as error:
        print(f"error: {error}{_where_from(str(error), sources)}", file=sys.stderr)
        return EXIT_USER_ERROR
    if args.command == "join" and (elsewhere := from_elsewhere(sources, config)):
        # The join command carries these only where the run changed them: a joiner's own file
        # or variables filled in the rest, and its peer trained unlike the others, unsaid.
        print(
            f"warning: {', '.join(elsewhere)}: settings a run's peers share, taken from this machine, not "
            "from the join command (which leaves out those the run keeps at their default); the run's "
            "fingerprint does not cover them: drop them here unless the run was started with the same",
            file=sys.stderr,
        )
    # The heavy imports, after the settings are checked (their errors in 0.2 s, not 2-3 s), with
    # stop signals held back and delivered after: a Ctrl+C that landed inside one (numpy's, in
    # hivemind's import of scipy) left a module half-imported, and the peer failed later with a
    # RecursionError traceback, or trained on with the signal lost (a review, stop 71).
    from workbench.run.stopping import not_interrupted

    with not_interrupted():
        import torch  # noqa: F401

        if args.command in ("start", "join"):  # (the demo's peers import it, not its launcher)
            import hivemind  # noqa: F401
    from workbench.run.data import DataError

    try:
        if args.command == "demo":
            from workbench.local.launch import DemoFailed, run_demo_command

            try:
                return run_demo_command(config, args)
            except DemoFailed as error:
                print(f"error: {error}", file=sys.stderr)
                return 1
            except KeyboardInterrupt:  # (SIGTERM and SIGHUP too) no result, as simulate's
                print("stopped.", file=sys.stderr)
                return EXIT_INTERRUPTED
        from workbench.run.node import follow, node_world
        from workbench.run.stopping import end_process

        if node_world()[0] > 0:  # a torchrun rank other than 0: rank 0 is the node's peer
            end_process(follow(config))
        from workbench.run.checkpoint import check_no_checkpoint, check_present
        from workbench.run.peer import run_peer

        if config.peer.resume:  # before the peer creates its folder, key and metrics (Peer.run reads it)
            check_present(config.peer.resume)
        if config.peer.fault_file:
            from swarm.faults import check_fault_file

            check_fault_file(config.peer.fault_file)
        if config.peer.run_dir:
            check_no_checkpoint(config.peer.run_dir, config.peer.resume)

        on_started = (
            (lambda addresses, key, kept: _print_join_command(config, addresses, key, kept))
            if args.command == "start"
            else None
        )
        global _ran_torch
        _ran_torch = True
        run_peer(config, on_started=on_started)
        return 0
    except (SwarmError, DataError) as error:  # (the demo's refusals too: "drop --shard" from a file)
        print(f"error: {_one_line(error)}{_where_from(str(error), sources)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except (ValueError, OSError) as error:  # e.g. --device cuda without a GPU, an unwritable --run-dir
        if args.verbose:
            raise
        where = _where_from(str(error), sources)
        print(f"error: {_one_line(error)}{where} (run with -v for details)", file=sys.stderr)
        return EXIT_USER_ERROR
    except FloatingPointError as error:  # training diverged: the message says what to lower
        print(f"error: {_one_line(error)}", file=sys.stderr)
        return 1
    except RuntimeError as error:  # a torchrun node's rank gone: one line, not gloo's C++ frames
        from workbench.run.node import NodeError

        if not isinstance(error, NodeError):
            raise
        print(f"error: {_one_line(error)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopped.", file=sys.stderr)
        return 0


if __name__ == "__main__":
    sys.exit(main())
