"""The optimizer's flags, one set for `start`, `join`, `demo` and `simulate` (and so for TOML
keys and ``Experiment`` keywords, which are named after them), and the rules that turn them
into a :class:`~optim.diloco.DiLoCoConfig`. Imports no torch: ``--help`` stays fast.

Each method takes the flags it can use; any other is an error naming what the method does use
(exit 2, one line), never silently ignored.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from optim.api import DELAYED_OUTER, KNOBS, METHODS, STREAMING_KNOBS, method
from optim.choices import TOPK_MEANS
from swarm.bounds import parser as bounded
from workbench.names import UPDATE_CODECS

if TYPE_CHECKING:
    from optim.diloco import DiLoCoConfig

# Each method's flags beyond --inner-steps and --inner-lr are its knobs in optim.api (a flag's
# argparse dest is the knob's name).


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def add_optimizer_options(group: argparse._ArgumentGroup, *, simulate: bool = False) -> None:
    """The optimizer's flags. ``simulate`` also accepts simulate's older names: ``--codec`` for
    ``--update-codec`` and ``--density`` for ``--topk-density`` (on `start`, ``--codec`` is
    the wire codec)."""
    group.add_argument(
        "--inner-steps",
        type=bounded("inner_steps"),
        default=50,
        metavar="H",
        help="inner steps per round (default: 50)",
    )
    group.add_argument(
        "--inner-lr", type=bounded("inner_lr"), default=1e-3, help="inner AdamW learning rate (default: 1e-3)"
    )
    group.add_argument(
        "--method",
        default="diloco",
        choices=tuple(METHODS),
        help="outer method: diloco, local_sgd (FedAvg), sparseloco (chunked top-k, 2-bit values, error "
        "feedback), streaming (fragments synced in turn) or dp (data-parallel: gradients averaged every "
        "step, the baseline)",
    )
    group.add_argument("--outer-lr", type=bounded("outer_lr"), help="outer SGD learning rate (diloco: 0.7)")
    group.add_argument(
        "--outer-momentum", type=bounded("outer_momentum"), help="outer Nesterov momentum (diloco: 0.9)"
    )
    group.add_argument(
        "--update-codec",
        *(["--codec"] if simulate else []),
        dest="update_codec",
        choices=UPDATE_CODECS,
        help="codec for pseudo-gradients inside the optimizer (default: none; sparseloco: topk)",
    )
    group.add_argument(
        "--topk-density",
        *(["--density"] if simulate else []),
        dest="topk_density",
        type=bounded("topk_density"),
        help="fraction of each chunk the topk codec keeps (default: 0.01; sparseloco: 128/4096)",
    )
    group.add_argument(
        "--topk-chunk",
        type=bounded("topk_chunk"),
        metavar="N",
        help="elements per top-k chunk, 0 for one top-k per tensor (default: 0; sparseloco: 4096)",
    )
    group.add_argument(
        "--topk-bits",
        type=int,
        choices=(2, 16),
        help="bits per value the topk codec keeps: 16 (fp16) or 2 (4 levels, 12-bit indices; "
        "default: 16; sparseloco: 2)",
    )
    group.add_argument(
        "--topk-mean",
        choices=TOPK_MEANS,
        help="how the group averages sparse updates: over the whole group, or each coordinate over "
        "the peers that kept it (default: group; sparseloco: kept)",
    )
    group.add_argument(
        "--error-feedback",
        action="store_true",
        default=None,
        help="keep what the update codec drops for the next round",
    )
    group.add_argument(
        "--ef-decay",
        type=bounded("ef_decay"),
        metavar="BETA",
        help="error feedback: the residual decays by BETA each round (default: 1; sparseloco: 0.95)",
    )
    group.add_argument(
        "--fragments", type=bounded("fragments"), help="streaming: fragments synced in turn (default: 4)"
    )
    group.add_argument(
        "--sync-delay",
        type=bounded("sync_delay"),
        metavar="TAU",
        help="streaming: inner steps a fragment's all-reduce runs in the background before its merge, "
        "below H/F (default: 0, merged at once)",
    )
    group.add_argument(
        "--alpha",
        type=bounded("alpha"),
        help="streaming: the local fragment's weight at the merge (default: 0, 0.5 with --sync-delay)",
    )
    group.add_argument(
        "--delay", type=int, choices=(0, 1), help="apply each round's mean one round later (default: 0)"
    )
    group.add_argument(
        "--overlap",
        action="store_true",
        default=None,
        help="average each round in the background while the next round trains (implies --delay 1)",
    )
    group.add_argument(
        "--eager",
        action="store_true",
        default=None,
        help="with --overlap or --delay 1: eager outer updates, this peer's fresh update standing in for "
        "its share of the mean still in flight (the default with them; Kale et al. 2025; outer lr / "
        f"momentum default to {DELAYED_OUTER['eager'][0]} / {DELAYED_OUTER['eager'][1]})",
    )
    group.add_argument(
        "--no-eager",
        dest="eager",
        action="store_false",
        help="with --overlap or --delay 1: the naive one-step delay instead (for comparison; its "
        f"outer lr / momentum default to {DELAYED_OUTER['naive'][0]} / {DELAYED_OUTER['naive'][1]})",
    )
    group.add_argument(
        "--outlier-ratio",
        type=bounded("outlier_ratio"),
        help="refuse a round whose update from one peer is this many times the others' median norm, "
        "or larger than declared (default: 10; 0 turns it off)",
    )
    group.add_argument(
        "--clip-norm",
        type=bounded("clip_norm"),
        help="clip this peer's pseudo-gradient to this norm before sending (default: off)",
    )


def add_round_seconds(group: Any, *, virtual: bool = False) -> None:
    """``--round-seconds``: time-boxed rounds (on the simulator's virtual clock if ``virtual``)."""
    where = "virtual seconds at its speed" if virtual else "seconds"
    group.add_argument(
        "--round-seconds",
        type=bounded("round_seconds"),
        default=0.0,
        metavar="T",
        help=f"time-boxed rounds: each peer trains as many inner steps as fit in T {where} (at least "
        "1, at most --inner-steps), weighted by its samples in the mean (default: 0 = H steps each)",
    )


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The optimizer flags given explicitly (not None), by dest."""
    return {name: getattr(args, name) for name in sorted(KNOBS) if getattr(args, name, None) is not None}


def check_method_flags(args: argparse.Namespace) -> None:
    """Raise ValueError (one line) for a flag ``args.method`` cannot use."""
    chosen = method(args.method)
    wrong = [name for name in given(args) if name not in chosen.knobs]
    if wrong:
        usable = ", ".join(flag(n) for n in chosen.knobs) or "no outer flags"
        raise ValueError(
            f"--method {chosen.name} cannot use {', '.join(flag(n) for n in wrong)}: {chosen.why_not}; "
            f"it takes {usable}"
        )


def outer_config(args: argparse.Namespace) -> DiLoCoConfig:
    """The method's preset, then every optimizer flag given explicitly on top of it."""
    check_method_flags(args)
    chosen = method(args.method)
    base = chosen.config(args.inner_steps)
    if chosen.every_step:  # gradients every step; --inner-steps and the outer flags do not apply
        return replace(base, clip_norm=args.clip_norm or 0.0)
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
    return replace(base, **overrides, nesterov=nesterov)


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
