"""The bounds of every numeric setting, in one place: flags, config files, steering and the UIs.

A value outside its bounds is refused before anything starts (argparse turns the
``ValueError`` of :func:`check` into exit 2 with one line), and a steering message outside them
is refused by every peer. Torch-free and hivemind-free, so the TUI and ``--help`` import it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass

UPDATE_CODECS = ("bf16", "fp16", "int4", "int8", "none", "topk")
"""The pseudo-gradient codecs (``optim.codecs.CODECS``, checked by tests/unit/test_cli.py): the
values ``--update-codec`` and a steering record's ``codec`` may take."""


@dataclass(frozen=True)
class Bound:
    """``low <= value <= high`` (strict where ``open_low`` / ``open_high``); ``integer``: whole
    numbers."""

    low: float
    high: float
    integer: bool = False
    open_low: bool = False
    open_high: bool = False

    def describe(self) -> str:
        low, high = (str(int(x)) if self.integer else f"{x:g}" for x in (self.low, self.high))
        return f"in {'(' if self.open_low else '['}{low}, {high}{')' if self.open_high else ']'}"

    def contains(self, value: float) -> bool:
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an int too large for a float (a traceback, exit 1: a review)
            return False
        above = value > self.low if self.open_low else value >= self.low
        below = value < self.high if self.open_high else value <= self.high
        return finite and above and below


_DAY = 86_400.0
BOUNDS: dict[str, Bound] = {
    # training
    "inner_steps": Bound(1, 100_000, integer=True),
    "batch_size": Bound(1, 65_536, integer=True),
    "max_bytes": Bound(1024, 10**13, integer=True),
    "block_size": Bound(1, 1_048_576, integer=True),
    "seed": Bound(0, 2**31 - 1, integer=True),
    "threads": Bound(0, 1024, integer=True),
    "inner_lr": Bound(0, 1, open_low=True, open_high=True),
    "outer_lr": Bound(0, 10, open_low=True),
    "outer_momentum": Bound(0, 1, open_high=True),
    "topk_density": Bound(0, 1, open_low=True),
    "density": Bound(0, 1, open_low=True),
    "topk_chunk": Bound(0, 2**24, integer=True),
    "ef_decay": Bound(0, 1),
    "fragments": Bound(1, 1024, integer=True),
    "sync_delay": Bound(0, 100_000, integer=True),
    "alpha": Bound(0, 1, open_high=True),
    "dropout": Bound(0, 1, open_high=True),
    "outlier_ratio": Bound(0, 1e6),
    "clip_norm": Bound(0, 1e12),
    "grad_clip": Bound(0, 1e12),
    "weight_decay": Bound(0, 1, open_high=True),
    "beta1": Bound(0, 1, open_high=True),
    "beta2": Bound(0, 1, open_high=True),
    "warmup_steps": Bound(0, 10**9, integer=True),
    "rounds": Bound(0, 10**9, integer=True),
    "round_seconds": Bound(0, _DAY),
    "step_seconds": Bound(0, _DAY, open_low=True),
    "steps": Bound(1, 10**9, integer=True),
    "eval_every": Bound(1, 10**9, integer=True),
    "checkpoint_every": Bound(0, 10**9, integer=True),
    # averaging and network
    "matchmaking_time": Bound(0.1, 120),
    "averaging_timeout": Bound(0.1, 3600, open_low=True),
    "port": Bound(0, 65_535, integer=True),
    "web_port": Bound(1, 65_535, integer=True),
    "connect_timeout": Bound(1, 600),
    "min_peers": Bound(1, 1024, integer=True),
    "peers": Bound(1, 1024, integer=True),
    # commands
    "timeout": Bound(1, 30 * _DAY),
    "interval": Bound(0.05, 3600),
    "watch": Bound(0.5, 3600),
    "wait": Bound(0, 3600),
    "from_step": Bound(0, 10**9, integer=True),
}


def whole(value: object) -> bool:
    """Whether ``value`` (from another machine, after msgpack) is an int and not a bool: msgpack
    keeps ``true`` a bool, and ``isinstance(True, int)`` holds, so a shape of ``[true, 4]``
    passed a plain int check and broke the tensor view made from it."""
    return isinstance(value, int) and not isinstance(value, bool)


def check(name: str, value: float) -> float:
    """``value`` if it is within ``name``'s bounds, else ValueError with one line saying which."""
    bound = BOUNDS[name]
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{flag} must be a number (got {value!r})")
    if bound.integer and isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{flag} must be an integer (got {value!r})")
    if not bound.contains(value):
        raise ValueError(f"{flag} must be {bound.describe()} (got {shown(value)})")
    return int(value) if bound.integer else float(value)


def shown(value: float) -> str:
    """``value`` for an error line: a huge integer by its size (its 400 digits were the line;
    past 4,300 Python refuses to write it at all)."""
    if isinstance(value, int) and abs(value) >= 10**18:
        return f"an integer of {len(str(abs(value))) if value.bit_length() < 14_000 else 'over 4,000'} digits"
    return repr(value)


def parser(name: str) -> Callable[[str], float]:
    """An argparse ``type=`` for ``name``: parses the text, then :func:`check` s it. argparse
    prints its ArgumentTypeError as ``argument --flag: must be ...`` and exits with 2."""
    bound = BOUNDS[name]

    def parse(text: str) -> float:
        try:
            value = int(text) if bound.integer else float(text)
        except (TypeError, ValueError):
            raise ValueError(text) from None  # argparse: "invalid integer value: 'x'"
        try:
            return check(name, value)
        except ValueError as error:
            raise argparse.ArgumentTypeError("must " + str(error).split(" must ", 1)[1]) from None

    parse.numeric = True  # type: ignore[attr-defined]  # config files give numbers, not text
    parse.__name__ = "integer" if bound.integer else "number"
    return parse
