"""The rules that turn the optimizer's settings (declared in :mod:`workbench.settings.optimizer`,
one set for `start`, `join`, `demo`, `simulate`, TOML keys and ``Experiment`` keywords) into a
:class:`~optim.diloco.DiLoCoConfig`. Imports no torch: ``--help`` stays fast.

Each method takes the flags it can use; any other is an error naming what the method does use
(exit 2, one line), never silently ignored.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from optim.api import DELAYED_OUTER, KNOBS, STREAMING_KNOBS, method

if TYPE_CHECKING:
    from optim.diloco import DiLoCoConfig


TOPK_KNOBS = ("topk_density", "topk_chunk", "topk_bits", "topk_mean")
"""Knobs of the topk update codec: with another codec they would change nothing."""


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The optimizer flags given explicitly (not None), by dest."""
    return {name: getattr(args, name) for name in sorted(KNOBS) if getattr(args, name, None) is not None}


def _default_inner_steps(args: argparse.Namespace) -> int:
    """H when the command's user gives none (the demo's is its own)."""
    from workbench.settings.commands import PEER_COMMANDS, defaults

    command = getattr(args, "command", None)
    return defaults(command if command in (*PEER_COMMANDS, "simulate") else "start")["inner_steps"]


def _as_given(args: argparse.Namespace, name: str) -> str:
    """A knob's flag as the user gave it: a switch set false is its ``--no-`` form."""
    return "--no-" + flag(name)[2:] if getattr(args, name, None) is False else flag(name)


def check_method_flags(args: argparse.Namespace) -> None:
    """Raise ValueError (one line) for a flag ``args.method`` cannot use."""
    chosen = method(args.method)
    wrong = [name for name in given(args) if name not in chosen.knobs]
    if chosen.every_step and getattr(args, "inner_steps", None) not in (None, 1, _default_inner_steps(args)):
        wrong.insert(0, "inner_steps")  # it syncs every step: H is 1 (a value at the default: not given)
    if wrong:
        usable = ", ".join(flag(n) for n in chosen.knobs) or "no outer flags"
        raise ValueError(
            f"--method {chosen.name} cannot use {', '.join(_as_given(args, n) for n in wrong)}: {chosen.why_not}; "
            f"it takes {usable}"
        )


def outer_config(args: argparse.Namespace) -> DiLoCoConfig:
    """The method's preset, then every optimizer flag given explicitly on top of it."""
    check_method_flags(args)
    chosen = method(args.method)
    base = chosen.config(args.inner_steps)
    if chosen.every_step:  # gradients every step; --inner-steps and the outer flags do not apply
        ratio = getattr(args, "outlier_ratio", None)
        return replace(
            base,
            clip_norm=args.clip_norm or 0.0,
            outlier_ratio=base.outlier_ratio if ratio is None else ratio,
        )
    overrides = given(args)
    for name in STREAMING_KNOBS:
        overrides.pop(name, None)
    if "update_codec" in overrides:
        overrides["codec"] = overrides.pop("update_codec")
    if "ef_decay" in overrides:
        overrides["error_decay"] = overrides.pop("ef_decay")
    if overrides.get("codec", "topk") != "topk" and "topk_mean" not in overrides:
        overrides["topk_mean"] = "group"  # sparseloco's kept mean needs its top-k codec
    if overrides.get("overlap") and overrides.get("delay") is None:
        overrides["delay"] = 1
    if "eager" in overrides and overrides.get("delay", base.delay) != 1:
        raise ValueError(
            f"--{'' if overrides['eager'] else 'no-'}eager chooses how a late mean is applied: "
            "add --overlap (or --delay 1)"
        )
    if chosen.name == "diloco" and overrides.get("delay") == 1:
        # A delayed round's update is a round stale and the paper's 0.9 momentum compounds it
        # (the naive delay diverges): defaults measured for each (optim.api.DELAYED_OUTER).
        lr, momentum = DELAYED_OUTER["naive" if overrides.get("eager") is False else "eager"]
        overrides.setdefault("outer_lr", lr)
        overrides.setdefault("outer_momentum", momentum)
    momentum = overrides.get("outer_momentum", base.outer_momentum)
    nesterov = momentum > 0 and (base.nesterov or "outer_momentum" in overrides)
    config = replace(base, **overrides, nesterov=nesterov)
    check_codec_flags(given(args), config)
    return config


def canonical(config: DiLoCoConfig) -> DiLoCoConfig:
    """``config`` with the knobs it does not use at their defaults, for the run's fingerprint:
    the join command leaves unused knobs out, so `start --method sparseloco --update-codec int8`
    (sparseloco's topk knobs, unused) printed a join command whose joiners were refused as
    training another model. The config itself keeps them: a codec steered to topk later uses
    them (the method's, not DiLoCoConfig's defaults)."""
    fields = {"ef_decay": "error_decay"}
    default = type(config)()
    unused = [fields.get(key, key) for key in unused_knobs(config)]
    return replace(config, **{name: getattr(default, name) for name in unused})


def unused_knobs(config: DiLoCoConfig) -> tuple[str, ...]:
    """The codec knobs ``config`` would not use: the topk codec's without that codec, the
    error-feedback decay without error feedback, and error feedback itself with the lossless
    codec (its residual stays zero: sparseloco's, with --update-codec none)."""
    topk = TOPK_KNOBS if config.codec != "topk" else ()
    feedback = ("error_feedback", "ef_decay") if config.codec == "none" else ()
    decay = () if config.error_feedback or feedback else ("ef_decay",)
    return (*topk, *feedback, *decay)


def check_codec_flags(flags: dict[str, Any], config: DiLoCoConfig) -> None:
    """Raise ValueError (one line) for a codec knob the run's update codec or error feedback
    would ignore, and for error feedback with the lossless codec (a residual that stays zero)."""
    unused = unused_knobs(config)
    if wrong := [flag(n) for n in TOPK_KNOBS if n in flags and n in unused]:
        raise ValueError(
            f"{', '.join(wrong)} shape{'s' if len(wrong) == 1 else ''} the topk update codec, and this "
            f"run's update codec is {config.codec}: add --update-codec topk, or drop {' and '.join(wrong)}"
        )
    if flags.get("error_feedback") and config.codec == "none":
        raise ValueError(
            "--error-feedback keeps what a lossy update codec dropped, and this run's update codec "
            "is none (lossless: nothing is dropped): add --update-codec int8 (or fp16, bf16, int4, "
            "topk), or drop --error-feedback"
        )
    if "ef_decay" in flags and "ef_decay" in unused:
        raise ValueError(
            "--ef-decay sets how fast error feedback's residual decays, and error feedback is off: "
            "add --error-feedback, or drop --ef-decay"
        )


def effective(name: str, config: DiLoCoConfig, **streaming: Any) -> dict[str, Any]:
    """The settings a run uses, for ``simulate --json``'s ``config`` object."""
    outer = not method(name).every_step
    return {
        "method": name,
        "inner_steps": config.inner_steps if outer else 1,
        "outer_lr": config.outer_lr if outer else None,
        "outer_momentum": config.outer_momentum if outer else None,
        "nesterov": outer and config.nesterov,
        "codec": config.codec,
        "topk_density": config.topk_density if config.codec == "topk" else None,
        "chunk": config.topk_chunk if config.codec == "topk" else None,
        "topk_bits": config.topk_bits if config.codec == "topk" else None,
        "topk_mean": config.topk_mean if config.codec == "topk" else None,
        "error_feedback": config.error_feedback,
        "ef_decay": config.error_decay if config.error_feedback else None,
        "delay": config.delay,
        "overlap": config.overlap,
        "eager": config.eager_updates,
        **streaming,
    }
