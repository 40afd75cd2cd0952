"""Settings from a TOML file and ``WORKBENCH_*`` environment variables, under the CLI's flags.

Precedence, highest first: a flag on the command line, the ``--config`` file, an environment
variable ``WORKBENCH_<KEY>`` (``WORKBENCH_INNER_STEPS=20``), the built-in default.

A file's keys are the long flags' names with ``_`` (``inner_steps = 20`` is ``--inner-steps
20``). Tables only group keys and may be named freely: ``[diloco] outer_lr = 0.5`` is
``outer_lr = 0.5``. Values keep TOML's types (an integer, a float, true/false, a string, a list
of strings for a repeatable flag); each is checked the way its flag is (type, choices), and an
unknown key or a wrong type is an error naming the file, the key and the fix. Keys of the other
commands (``peers`` is the demo's, ``steps`` simulate's, ``announce`` a peer's) are accepted and
ignored, so that one file serves ``start``, ``join``, ``demo`` and ``simulate`` alike.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from workbench.settings import Setting

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


ENV_PREFIX = "WORKBENCH_"
# Options that are not settings of a run: where the file is, and how loudly to log.
NOT_SETTINGS = {"help", "config", "verbose", "verbose_after", "command", "json", "sources"}


class ConfigError(ValueError):
    """A config file or WORKBENCH_* variable the workbench cannot use; the message says why."""


def settings_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's settable options by key (dest), positional arguments excluded; a switch's own
    flag, not its ``--no-`` form (``config keys`` listed ``eager`` as ``--no-eager``, its help and
    its default: the opposite of the key)."""
    found: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if action.option_strings and action.dest not in NOT_SETTINGS and action.dest != argparse.SUPPRESS:
            found.setdefault(action.dest, action)
    return found


def read_file(path: str | os.PathLike) -> dict[str, Any]:
    """A TOML file's keys, tables flattened (``[diloco] outer_lr`` -> ``outer_lr``)."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # (Notepad's byte-order mark: a review)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist (check the path given to --config)") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read config file {path}: {error}") from None
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path} is not valid TOML: {error}") from None
    except ValueError as error:  # an integer of 5000 digits: Python's limit on int(text)
        raise ConfigError(f"{path}: a number is too long ({str(error).split(';')[0]})") from None
    flat: dict[str, Any] = {}
    for key, value in document.items():
        if isinstance(value, dict) and _takes_a_value(key.replace("-", "_")):
            # ``outer_lr = { inner_steps = 5 }`` was a table, flattened: it set inner_steps, and
            # outer_lr nothing, without a word (a review, stop 69)
            raise ConfigError(
                f"{path}: {key} is a setting, not a table: write {key} = <value> (a table's name "
                "only groups keys, like [diloco])"
            )
        entries = value.items() if isinstance(value, dict) else [(key, value)]
        for name, item in entries:
            if isinstance(item, dict):
                raise ConfigError(f"{path}: table [{key}.{name}] is nested too deep; use one level of tables")
            name = name.replace("-", "_")
            if name in flat:
                raise ConfigError(f"{path}: '{name}' is set twice")
            flat[name] = item
    return flat


def _takes_a_value(key: str) -> bool:
    """Whether ``key`` is a number or a switch of some command (a table may share a text
    setting's name: ``[data]`` groups the data's keys)."""
    from workbench.settings.commands import PEER_COMMANDS, command_settings

    found = [command_settings(c)[key] for c in (*PEER_COMMANDS, "simulate") if key in command_settings(c)]
    return any(item.numeric or item.kind == "switch" for item in found)


def _setting(key: str, command: str | None = None) -> Setting:
    """``key``'s declaration: ``command``'s own first (``simulate`` declares some keys itself)."""
    from workbench.settings.commands import PEER_COMMANDS, command_settings

    order = (*PEER_COMMANDS, "simulate")
    if command in order:
        order = (command, *order)
    return next(command_settings(c)[key] for c in order if key in command_settings(c))


def _check(key: str, value: Any, origin: str, command: str | None = None) -> Any:
    """A file's value for ``key``, checked like the flag would be."""
    try:
        return _checked_text(key, _setting(key, command).check(value, f"{origin}: {key}"), f"{origin}: {key}")
    except ValueError as error:
        raise ConfigError(str(error)) from None


def env_value(key: str, text: str, variable: str) -> Any:
    """A WORKBENCH_* variable's ``text`` for ``key``, checked as `start` checks it (ConfigError
    naming ``variable``): for the commands that read a few variables without a config file."""
    return _from_env(key, text, variable, "start")


def _from_env(key: str, text: str, variable: str, command: str | None = None) -> Any:
    """An environment variable's text for ``key``, converted like the flag's argument."""
    try:
        return _checked_text(key, _setting(key, command).from_text(text, variable), variable)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _checked_text(key: str, value: Any, origin: str) -> Any:
    """``value`` if the run would take it for ``key`` (a text setting the run checks when it is
    built: a host, a run id...); checked now, so that a flag overriding it does not hide it (the
    next command without the flag would stop on it)."""
    from swarm.addresses import listen_address
    from swarm.errors import SwarmError
    from swarm.records import RunKeys, check_name, check_owner, check_run_id

    checks = {
        "host": lambda text: listen_address(text, 0),
        "run_id": check_run_id,
        "owner": check_owner,
        "name": check_name,
        "secret": lambda text: RunKeys("workbench", text),  # its own check of a secret's length
    }
    if key in checks and isinstance(value, str):
        try:
            checks[key](value)
        except (ValueError, SwarmError) as error:
            shown = "(set, not shown)" if key == "secret" else _quoted(value)
            raise ValueError(f"{origin} = {shown}: {error}") from None
    return value


def explicit_keys(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The keys set by a flag in ``argv`` (parsed again with every default suppressed)."""
    saved = [(action, action.default) for action in parser._actions]
    saved_defaults = dict(parser._defaults)
    try:
        for action in parser._actions:
            action.default = argparse.SUPPRESS
        parser._defaults.clear()
        namespace, _ = parser.parse_known_args(list(argv))
    finally:
        for action, default in saved:
            action.default = default
        parser._defaults.update(saved_defaults)
    return set(vars(namespace))


def layer(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    argv: Sequence[str],
    *,
    known_elsewhere: set[str] = frozenset(),
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Fill ``args`` (parsed from ``argv`` by the command's ``parser``) with the ``--config``
    file's and the environment's values where no flag was given. Returns each key's source:
    ``flag``, ``file PATH``, ``env NAME`` or ``default``."""
    environ = os.environ if environ is None else environ
    command = getattr(args, "command", None)
    actions = settings_of(parser)
    given = explicit_keys(parser, argv) & set(actions)
    sources = {key: "flag" if key in given else "default" for key in actions}
    from workbench.settings.commands import command_settings

    for key, item in command_settings("demo" if command == "demo" else "start").items():
        if key in sources and key not in given and item.default_env and item.default_env in environ:
            sources[key] = f"env {item.default_env}"  # the default read from it (--secret)
    # Lowest first, so that a higher layer overwrites.
    # A bad value is refused even where a flag overrides it: the file or variable is wrong,
    # and the next command without that flag would take it.
    # Another command's keys are checked too, and skipped (one file and one environment serve
    # start, join, demo and simulate): `config show` passed `peers = "eight"`, which demo refused.
    for key in sorted({*actions, *known_elsewhere}):
        variable = ENV_PREFIX + key.upper()
        if variable in environ:
            value = _from_env(key, environ[variable], variable, command if key in actions else None)
            if key not in actions:
                _skipped(key, value, variable, command)
            elif key not in given:
                setattr(args, key, value)
                sources[key] = f"env {variable}"
    path = getattr(args, "config", None)
    if path is not None and not str(path).strip():
        raise ConfigError("--config is empty: give the path of a TOML file, or leave --config out")
    if path:
        for key, value in read_file(path).items():
            if key not in actions:
                if key in known_elsewhere:
                    _skipped(key, _check(key, value, str(path)), str(path), command)
                    continue  # another command's setting (one file serves start, join, demo, simulate)
                close = difflib.get_close_matches(key, [*actions, *known_elsewhere], n=1)
                hint = f" (did you mean {close[0]}?)" if close else " (see `workbench config keys`)"
                raise ConfigError(f"{path}: unknown key {_quoted(key)}{hint}")
            value = _check(key, value, str(path), command)
            if key not in given:
                setattr(args, key, value)
                sources[key] = f"file {path}"
    return sources


def _skipped(key: str, value: Any, origin: str, command: str | None) -> None:
    """Another command's setting, checked and left to it; simulate's --codec is its update codec,
    so a wire codec given for the peers is said to be skipped."""
    if command == "simulate" and key == "codec":
        logging.getLogger(__name__).warning(
            "%s: simulate skips codec = %r, the real peers' wire codec; the simulator's is "
            "update_codec (its --codec flag)",
            origin,
            value,
        )


def to_toml(values: Mapping[str, Any], preset: Mapping[str, Any] | None = None) -> str:
    """``key = value`` lines a config file can hold (None values are left out as comments, with
    the value ``preset`` gives them, if any: ``# update_codec = "topk"``)."""
    lines = []
    for key, value in values.items():
        if value is None:
            given = (preset or {}).get(key)
            lines.append(f"# {key} =" if given is None else f"# {key} = {_toml_value(given)}")
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return _quoted(str(value), '"')


def _quoted(text: str, quote: str = "'") -> str:
    """``text`` as a TOML basic string (``quote`` '"') or for a message: one line, whatever it
    holds (a key or path with a newline printed two lines, and TOML refused the file written)."""
    escaped = json.dumps(text, ensure_ascii=False)[1:-1].replace(
        "\x7f", "\\u007f"
    )  # \\, \", \n, \t, \u0000: as TOML reads them
    return f'"{escaped}"' if quote == '"' else f"'{escaped}'"
