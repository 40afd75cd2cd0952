"""Which settings each command takes, as argparse options and as checked values.

``start`` and ``join`` take the training settings and the peer's (network, access, outputs);
``demo`` the training settings and its own (:class:`~workbench.settings.run.Demo`), with
:data:`~workbench.settings.run.DEMO_DEFAULTS`; ``simulate`` the optimizer's and its own.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from workbench.settings import Setting, add_section, settings, unknown
from workbench.settings.optimizer import SIMULATE_ALIASES, Optimizer
from workbench.settings.run import (
    DEMO_DEFAULTS,
    Averaging,
    Demo,
    Machine,
    ModelAndData,
    Network,
    Outputs,
    RunAccess,
    Schedule,
)
from workbench.settings.simulate import Bench, Swarm

TRAINING = {
    "model and data": (ModelAndData, Machine),
    "DiLoCo": (Optimizer, Schedule),
    "averaging": (Averaging,),
}
"""The settings every peer command takes, by ``--help`` group."""
PEER = {"network": (Network, RunAccess, Outputs)}
"""What ``start`` and ``join`` add: where the peer listens, which run it trusts, what it writes."""
PEER_COMMANDS = ("start", "join", "demo")


def sections(command: str) -> tuple[type, ...]:
    """The sections of a peer command (``start``, ``join``, ``demo``) or ``simulate``."""
    if command == "simulate":
        return (Swarm, Optimizer, ModelAndData, Bench)
    if command not in PEER_COMMANDS:
        raise ValueError(f"no settings for command '{command}'")
    own = (Demo,) if command == "demo" else tuple(s for group in PEER.values() for s in group)
    training = tuple(s for group in TRAINING.values() for s in group)
    return (*own, *training) if command == "demo" else (*training, *own)


def command_settings(command: str) -> dict[str, Setting]:
    """Every setting of ``command`` by key (a key declared twice keeps its first declaration:
    the demo's own ``run_dir``)."""
    found: dict[str, Setting] = {}
    for section in sections(command):
        for item in settings(section):
            found.setdefault(item.key, item)
    return found


def defaults(command: str) -> dict[str, Any]:
    """``command``'s settings at their defaults (the demo's own defaults applied)."""
    values = {key: item.initial() for key, item in command_settings(command).items()}
    if command == "demo":
        values.update(DEMO_DEFAULTS)
    return values


def add_training_options(parser: argparse.ArgumentParser) -> None:
    """``--config`` and the training settings, by group (every peer command's)."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="read settings from this TOML file (keys are the flags' names: inner_steps = 20); "
        "flags given here override it, WORKBENCH_* variables sit below it",
    )
    for title, group_sections in TRAINING.items():
        group = parser.add_argument_group(title)
        for section in group_sections:
            add_section(group, section)


def add_peer_options(parser: argparse.ArgumentParser) -> None:
    """``start`` and ``join``'s options (and ``config show``'s)."""
    add_training_options(parser)
    for title, group_sections in PEER.items():
        group = parser.add_argument_group(title)
        for section in group_sections:
            add_section(group, section)


def add_demo_options(parser: argparse.ArgumentParser) -> None:
    """The demo's own options, then the training settings at the demo's defaults."""
    add_section(parser, Demo)
    add_training_options(parser)
    parser.set_defaults(**DEMO_DEFAULTS)
    for action in parser._actions:  # the help says the demo's default, not a peer's
        if action.dest in DEMO_DEFAULTS and action.help and "default: " in action.help:
            action.help = re.sub(
                r"default: [^;,)]+", f"default: {DEMO_DEFAULTS[action.dest]}", action.help, count=1
            )
        if action.dest == "shard":  # the demo deals peer I shard I/N: still parsed, to say so
            action.help = argparse.SUPPRESS


def add_simulate_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="read settings from this TOML file, the same file start, join and demo read (their "
        "own keys are ignored here); flags given here override it, WORKBENCH_* variables sit below it",
    )
    add_section(parser, Swarm)
    add_section(parser.add_argument_group(Optimizer.__doc__), Optimizer, **SIMULATE_ALIASES)
    add_section(parser.add_argument_group("model and data"), ModelAndData)  # as the peers take them
    add_section(parser, Bench)


def values_of(command: str, given: dict[str, Any], *, origin: str = "") -> argparse.Namespace:
    """``command``'s settings with ``given`` (by key, as Python values) checked the way the
    flags are and put over the defaults: what parsing the flags would give, without argv.
    None, or False for a switch without a ``--no-`` form, is "not given"; a number may
    also come as the flag's text (``inner_lr="1e-3"``)."""
    known = command_settings(command)
    values = defaults(command)
    for key, value in given.items():
        if key not in known:
            raise unknown(key, known, "setting", f"`workbench {command} --help` lists them")
        item = known[key]
        if value is None or (value is False and item.kind == "switch" and item.negation is None):
            continue
        if isinstance(value, str) and item.numeric:
            values[key] = item.from_text(value, f"{origin}{key}")
        else:
            values[key] = item.check(value, f"{origin}{key}")
    return argparse.Namespace(command=command, **values)
