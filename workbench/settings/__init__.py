"""The settings schema: every setting of a run declared once, as a field of a torch-free
dataclass (one per component, as torchtitan's job config), carrying its default, bounds,
choices, help and flag.

Everything else is generated from these declarations:

- the argparse options of ``start``, ``join``, ``demo``, ``config show`` and ``simulate``
  (:func:`add_section`);
- the keys of a ``--config`` TOML file and the ``WORKBENCH_<KEY>`` variables
  (:meth:`Setting.check`, :meth:`Setting.from_text`; ``workbench config keys`` lists them);
- ``Experiment``'s keyword arguments, checked the same way and built into the config directly
  (:func:`values_of`);
- the flags that rebuild a config: the join command another machine pastes and each demo
  peer's arguments (:meth:`Setting.read` and :meth:`Setting.render`).

A setting's key is its field's name: the argparse dest, the TOML key, ``WORKBENCH_<KEY>``, the
``Experiment`` keyword; its flag is ``--`` + the key with ``-`` for ``_``. Numeric bounds live
in :mod:`swarm.bounds` (steering and the monitor read them too): a setting names its bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import numbers
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from swarm.bounds import BOUNDS, shown
from swarm.bounds import parser as bounded

MISSING: Any = dataclasses.MISSING


@dataclass(frozen=True)
class Setting:
    """One setting: how it is given (flag, file, variable, keyword), checked and shown."""

    key: str
    default: Any
    help: str
    kind: str = "text"
    """text, int, float (numbers: see ``bound``), switch (a bare flag: true/false), or list (a
    repeatable flag)."""
    bound: str | None = None
    """The :data:`swarm.bounds.BOUNDS` entry a number must satisfy."""
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    """Turns a flag's text into the value (and checks it); None: ``kind``'s own."""
    target: str | None = None
    """Where the built :class:`~workbench.config.RunConfig` keeps the value (``train.inner_lr``);
    None where building it takes more than a copy (see workbench.cli.options.build_config)."""
    negation: str | None = None
    """A switch's ``--no-`` form, with this help (``--no-eager``)."""
    off_flag: str | None = None
    """The ``negation``'s flag where ``--no-`` + the flag reads wrong (``--no-tui``'s: ``--tui``)."""
    off_unless_given: bool = False
    """The switch is off when not given (its ``--no-`` form only undoes a config file's or an
    environment variable's ``true``), so False rebuilds with no flag; else (``--no-eager``:
    on by default with ``--overlap``) False rebuilds as the ``--no-`` form."""
    bare: str | None = None
    """The value of the flag given without one (``--tensorboard`` alone), for an optional value."""
    default_env: str | None = None
    """An environment variable whose value is the default (read when a parser is built)."""
    joined: str | None = None
    """A text of items (``--speeds 1,1,0.5``): a list given as data (TOML, a keyword) is joined
    with this separator into the flag's text."""

    @property
    def off(self) -> str:
        """The flag that turns this switch off (with a ``negation``)."""
        return self.off_flag or "--no-" + self.flag[2:]

    def initial(self) -> Any:
        """The default, read now (``default_env``; a fresh list for a list)."""
        if self.default_env is not None:
            return os.environ.get(self.default_env, self.default)
        return list(self.default) if isinstance(self.default, list) else self.default

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def numeric(self) -> bool:
        return self.bound is not None or self.kind in ("int", "float")

    def text_parser(self) -> Callable[[str], Any] | None:
        """The argparse ``type=``: the bound's parser, ``parse``, or int/float."""
        if self.bound is not None:
            return bounded(self.bound)
        return self.parse or {"int": int, "float": float}.get(self.kind)

    # --- the command line ------------------------------------------------------------------

    def add_to(self, group: Any, *, default: Any = MISSING, help: str | None = None, aliases=()) -> None:
        """This setting's option(s) on an argparse parser or group."""
        kwargs: dict[str, Any] = dict(dest=self.key, help=help if help is not None else self.help)
        kwargs["default"] = self.initial() if default is MISSING else default
        flags = (self.flag, *aliases)
        if self.kind == "switch":
            group.add_argument(*flags, action="store_true", **kwargs)
            if self.negation is not None:
                group.add_argument(self.off, dest=self.key, action="store_false", help=self.negation)
            return
        if self.kind == "list":
            group.add_argument(*flags, action="append", metavar=self.metavar, **kwargs)
            return
        if self.bare is not None:
            kwargs.update(nargs="?", const=self.bare)
        group.add_argument(
            *flags, type=self.text_parser(), choices=self.choices, metavar=self.metavar, **kwargs
        )

    # --- values given as data: a TOML file, an environment variable, a keyword argument ----------

    def check(self, value: Any, origin: str) -> Any:
        """A value given as data (TOML, ``Experiment``), checked like the flag; ``origin`` names
        where it came from in the error (``run.toml: inner_steps``)."""
        if self.kind == "switch":
            if not isinstance(value, bool):
                raise ValueError(
                    f"{origin} must be true or false (it is the switch {self.flag}), got {value!r}"
                )
            return value  # the key names the setting (``eager = false`` is --no-eager)
        if self.kind == "list":
            items = value if isinstance(value, (list, tuple)) else [value]
            return [self._scalar(item, origin) for item in items]
        if self.joined is not None and isinstance(value, (list, tuple)):
            if not all(isinstance(v, (int, float, str)) and not isinstance(v, bool) for v in value):
                raise ValueError(f"{origin} must be a list of numbers (like {self.flag}), got {value!r}")
            value = self.joined.join(map(str, value))
        return self._scalar(value, origin)

    def _scalar(self, value: Any, origin: str) -> Any:
        parse = self.text_parser()
        if isinstance(value, str) and parse is not None and not self.numeric:
            try:
                value = parse(value)
            except (TypeError, ValueError, argparse.ArgumentTypeError) as error:
                raise ValueError(f"{origin} = {value!r}: {error}") from None
        elif self.numeric:
            integer = self.kind == "int" or (self.bound is not None and BOUNDS[self.bound].integer)
            # numbers.Integral/Real: NumPy's too (a sweep over np.arange gives np.int64)
            ok = not isinstance(value, bool) and isinstance(
                value, numbers.Integral if integer else numbers.Real
            )
            if not ok:
                expected = "an integer" if integer else "a number"
                raise ValueError(
                    f"{origin} must be {expected} (like {self.flag}), got {type(value).__name__} {value!r}"
                )
            value = int(value) if isinstance(value, numbers.Integral) else float(value)
            if isinstance(value, int) and abs(value) >= 10**18:  # no bound reaches it; its digits
                # made the error line (past 4,300 of them Python refuses to write it: a review)
                wanted = f"be {BOUNDS[self.bound].describe()}" if self.bound else "be a smaller number"
                raise ValueError(f"{origin} must {wanted} (got {shown(value)})")
            try:
                value = parse(str(value)) if parse else value
            except argparse.ArgumentTypeError as error:
                raise ValueError(f"{origin} = {value!r}: {error}") from None
        elif not isinstance(value, str):
            raise ValueError(
                f"{origin} must be a string (like {self.flag}), got {type(value).__name__} {value!r}"
            )
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{origin} = {value!r} is not one of {', '.join(map(str, self.choices))}")
        return value

    def from_text(self, text: str, variable: str) -> Any:
        """An environment variable's text, converted like the flag's argument."""
        if self.kind == "switch":
            truth = {"1": True, "true": True, "yes": True, "on": True}
            truth.update({"0": False, "false": False, "no": False, "off": False})
            if text.strip().lower() not in truth:
                raise ValueError(f"{variable}={text!r}: use 1/0, true/false, yes/no or on/off")
            return truth[text.strip().lower()]
        if self.kind == "list":
            return [self._text_scalar(item, variable) for item in text.split()]
        return self._text_scalar(text, variable)

    def _text_scalar(self, text: str, variable: str) -> Any:
        parse = self.text_parser() or str
        try:
            value = parse(text)
        except argparse.ArgumentTypeError as error:
            raise ValueError(f"{variable}={text!r}: {error}") from None
        except (TypeError, ValueError):
            kind = {"integer": "an integer", "number": "a number", "int": "an integer", "float": "a number"}
            raise ValueError(f"{variable}={text!r} must be {kind.get(parse.__name__, 'a value')}") from None
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{variable}={text!r} is not one of {', '.join(map(str, self.choices))}")
        return value

    # --- back into flags -------------------------------------------------------------------

    def read(self, config: Any) -> Any:
        """This setting's value in a built config (follows ``target``)."""
        if self.target is None:
            raise AttributeError(f"{self.key} has no single place in the config")
        value = config
        for part in self.target.split("."):
            value = getattr(value, part)
        return value

    def render(self, value: Any) -> list[str]:
        """The flags that give ``value`` (nothing for None, or an unset switch)."""
        if value is None or (value is False and (self.negation is None or self.off_unless_given)):
            return []
        if value is True:
            return [self.flag]
        if value is False:
            return [self.off]
        if self.kind == "list":
            return [part for item in value for part in (self.flag, str(item))]
        return [self.flag, repr(value) if isinstance(value, float) else str(value)]


def setting(default: Any = None, help: str = "", **meta: Any) -> Any:
    """A dataclass field declaring a setting (its key is the field's name)."""
    metadata = {"setting": meta, "help": help}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def settings(section: type) -> Iterator[Setting]:
    """A section's settings, in declaration order."""
    for f in dataclasses.fields(section):
        meta = f.metadata["setting"]
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        yield Setting(key=f.name, default=default, help=f.metadata["help"], **meta)


def add_section(
    group: Any, section: type, *, skip: tuple[str, ...] = (), **overrides: dict[str, Any]
) -> None:
    """Every setting of ``section`` as options of ``group``; ``overrides`` maps a key to
    ``add_to``'s keywords (another default, help or aliases for one command)."""
    for item in settings(section):
        if item.key not in skip:
            item.add_to(group, **overrides.get(item.key, {}))


def unknown(key: str, known: Mapping[str, Any] | list[str], what: str, otherwise: str) -> ValueError:
    """An unknown key's error: the closest known key, else where to look."""
    close = difflib.get_close_matches(key, list(known), n=1)
    return ValueError(f"unknown {what} '{key}' ({f'did you mean {close[0]}?' if close else otherwise})")
