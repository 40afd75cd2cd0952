"""`workbench config show` and `workbench config keys`: what a run would use, and from where."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from swarm.errors import SwarmError
from workbench.cli.configfile import layer, settings_of, to_toml

EPILOG = """examples:
  workbench config show --config run.toml --sources      every setting and where it came from
  workbench config show --config run.toml --inner-steps 20 > resolved.toml
  WORKBENCH_INNER_STEPS=20 workbench config show --json
  workbench config keys                                  every key a run.toml may hold
"""


def add_config_parser(commands) -> None:
    from workbench.settings.commands import add_peer_options

    config = commands.add_parser(
        "config",
        help="show the settings a run would use (flags > --config file > WORKBENCH_* > defaults)",
        description="Resolve and show run settings, or list the keys a config file may hold.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = actions.add_parser(
        "show",
        help="the settings `workbench start` would use with these flags, file and environment",
        description="Print the resolved settings of `workbench start` (and join: the same keys) as "
        "TOML; takes every flag start takes.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    show.add_argument("--sources", action="store_true", help="say where each setting came from")
    show.add_argument("--json", action="store_true", help="one JSON object: settings and sources")
    add_peer_options(show)
    keys = actions.add_parser(
        "keys",
        help="every key a config file may hold, with its flag and meaning",
        epilog="example:\n  workbench config keys --json | jq 'keys'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    keys.add_argument("--json", action="store_true", help="as JSON")


def run_config_command(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str]) -> int:
    from workbench.cli.options import PEER_COMMANDS, _where_from, build_config, subparser

    config_parser = subparser(parser, "config")
    actions = next(a for a in config_parser._actions if isinstance(a, argparse._SubParsersAction))
    if args.config_command == "keys":
        return _print_keys(parser, args.json)
    show = actions.choices["show"]
    rest = list(argv)[list(argv).index("show") + 1 :]
    known = {key for name in (*PEER_COMMANDS, "simulate") for key in settings_of(subparser(parser, name))}
    sources = layer(args, show, rest, known_elsewhere=known)
    # A joiner's file (--client-mode, which the first peer of a run cannot take) is checked as
    # `join` checks it: `config show` refused it, and `join --config` took it (a review, stop 71).
    args.command = "join" if getattr(args, "client_mode", None) else "start"
    args.peers = getattr(args, "peers", None) or []
    # A switch turned off by a flag, file or variable (build_config reads it as not given): shown
    # as given, so that the file `config show` prints keeps it over a variable's `true` (it was
    # commented out as the method's preset, a review, stop 72).
    turned_off = {key for key in settings_of(show) if getattr(args, key, None) is False}
    try:
        config = build_config(args)  # the same checks a run makes: a bad value fails here, not at start time
    except (ValueError, SwarmError) as error:  # named like `start` names it (--host is a SwarmError)
        raise ValueError(f"{error}{_where_from(str(error), sources)}") from None
    settings = {key: False if key in turned_off else getattr(args, key) for key in settings_of(show)}
    if settings.get("secret"):  # never printed (the join command's --secret SECRET, the logs)
        settings["secret"] = None
        sources["secret"] += " (set, never printed: keep it in WORKBENCH_RUN_SECRET or pass --secret)"
    preset = _preset(settings, config, args.method)
    for key in preset:
        sources[key] = f"preset of --method {args.method}"
    if args.json:
        json.dump({"settings": settings, "sources": sources, "preset": preset}, sys.stdout, indent=2)
        print()
        return 0
    if not args.sources:
        sys.stdout.write(to_toml(settings, preset))
        return 0
    width = max(len(line) for line in to_toml(settings, preset).splitlines())
    for key, line in zip(settings, to_toml(settings, preset).splitlines()):
        print(f"{line:<{width}}  # {sources[key]}")
    return 0


def _preset(settings: dict, config, method_name: str) -> dict:
    """The values ``--method``'s preset gives the optimizer settings left unset (``config show``
    printed ``# update_codec =`` for sparseloco's topk): shown, and left unset in the file, so that
    the file keeps following the method it names."""
    from optim.api import method
    from workbench.cli.optimizer_flags import unused_knobs
    from workbench.settings.commands import command_settings

    knobs = set(method(method_name).knobs) - set(unused_knobs(config.diloco))  # not topk's without topk
    declared = command_settings("start")
    preset = {}
    for key, value in settings.items():
        if value is None and key in knobs and declared[key].target is not None:
            resolved = declared[key].read(config)
            if resolved is not None:
                preset[key] = resolved
    return preset


def _print_keys(parser: argparse.ArgumentParser, as_json: bool) -> int:
    from workbench.cli.options import PEER_COMMANDS, subparser

    rows: dict[str, dict] = {}
    commands = (*PEER_COMMANDS, "simulate")
    for command in commands:
        for key, action in settings_of(subparser(parser, command)).items():
            row = rows.setdefault(
                key,
                dict(
                    flag=action.option_strings[-1],
                    default=action.default,
                    help=action.help or "",
                    commands=[],
                ),
            )
            row["commands"].append(command)
    if as_json:
        json.dump(rows, sys.stdout, indent=2, default=str)
        print()
        return 0
    width = max(map(len, rows))
    for key, row in rows.items():
        where = "" if len(row["commands"]) == len(commands) else f" [{', '.join(row['commands'])}]"
        print(f"{key:<{width}}  {row['flag']}: {row['help']}{where}")
    return 0
