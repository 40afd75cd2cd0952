"""A :class:`RunConfig` back into flags: the join command another machine pastes, and the
flags a local peer of the demo is started with (:func:`workbench.local.launch.peer_arguments`).
The inverse of :func:`workbench.cli.options.build_config`: both must round-trip."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from workbench.cli.optimizer_flags import unused_knobs
from workbench.settings.commands import command_settings

if TYPE_CHECKING:
    from workbench.config import RunConfig


def method_arguments(config: RunConfig) -> list[str]:
    """``--method`` and the schedule flags of a dp or streaming run, the preset of a sparseloco
    or local_sgd run (a diloco run: none)."""
    chosen = config.outer_method
    if chosen.every_step:
        return ["--method", chosen.name]
    if config.preset is not None:
        return ["--method", config.preset]
    if not chosen.fragmented:
        return []
    args = ["--method", "streaming", "--fragments", str(config.fragments)]
    if config.sync_delay:
        args += ["--sync-delay", str(config.sync_delay)]
    if config.alpha is not None:
        args += ["--alpha", repr(config.alpha)]
    return args


def optimizer_arguments(config: RunConfig, *, changed_only: bool = False) -> list[str]:
    """The optimizer flags that rebuild ``config.diloco`` on top of its method's preset (with
    :func:`method_arguments`), those its method takes; ``changed_only``: only those that differ
    from the preset's (for a join command people read)."""
    from optim.api import method
    from workbench.config import RunConfig

    preset = method(config.preset) if config.preset is not None else None
    knobs = preset.knobs if preset is not None else config.outer_method.knobs
    values = _optimizer_values(config, knobs)
    if changed_only:
        base = RunConfig() if preset is None else RunConfig(diloco=preset.config(config.diloco.inner_steps))
        defaults = _optimizer_values(base, knobs)
        # A delayed run's outer defaults are not DiLoCoConfig's (optim.api.DELAYED_OUTER): spell them out.
        kept = ("outer_lr", "outer_momentum") if config.diloco.delay == 1 else ()
        values = {k: v for k, v in values.items() if v != defaults[k] or k in kept}
    settings = command_settings("start")
    return [part for key, value in values.items() for part in settings[key].render(value)]


def _optimizer_values(config: RunConfig, knobs: Sequence[str]) -> dict[str, Any]:
    """The optimizer settings among ``knobs`` that DiLoCoConfig holds, in the schema's order,
    read where the schema says they live (streaming's are :func:`method_arguments`')."""
    values = {
        key: item.read(config)
        for key, item in command_settings("start").items()
        if key in knobs and (item.target or "").startswith("diloco.")
    }
    if "eager" in values and config.diloco.delay != 1:
        values["eager"] = None  # no late mean to apply: --eager would be refused
    for key in unused_knobs(config.diloco):  # knobs the run does not use would be refused too
        if key in values:
            values[key] = None
    return values


def setting_arguments(config: RunConfig, keys: Sequence[str], *, changed_only: bool = False) -> list[str]:
    """The flags of ``keys`` (settings with a place in the config) that rebuild ``config``;
    ``changed_only``: only those that differ from the defaults."""
    from workbench.config import RunConfig

    settings = command_settings("start")
    defaults = RunConfig()
    args = []
    for key in keys:
        value = settings[key].read(config)
        if not changed_only or value != settings[key].read(defaults):
            args += settings[key].render(value)
    return args


def model_flags(config: RunConfig) -> list[str]:
    """``--model NAME [--block-size T]``: the flags that rebuild ``config``'s model; ValueError
    for a model that is neither a preset (any block size) nor a Hugging Face folder."""
    from workbench.run.model import PRESETS

    context = config.model.block_size
    name = config.hf_model or next(
        (n for n, make in PRESETS.items() if replace(make(), block_size=context) == config.model), None
    )
    if name is None:
        raise ValueError("only presets and Hugging Face folders have flags; share this model config yourself")
    # the context a bare --model gives (a Hugging Face folder reads with the default preset's)
    usual = PRESETS["small" if config.hf_model else name]().block_size
    return ["--model", name] + (["--block-size", str(context)] if context != usual else [])


SHARED = (
    "inner_steps",
    "inner_lr",
    "grad_clip",
    "weight_decay",
    "beta1",
    "beta2",
    "warmup_steps",
    "codec",
    "aggregate",
)
"""Settings every peer must share, or their global params drift apart round after round (the
clip too: with dp, each peer clips and steps the averaged gradient itself)."""
SHARED_RUN = ("tokenizer", "rounds", "round_seconds")
"""And: token ids shape the model, the inner lr's cosine follows the run's length, rounds of the
same length for every peer."""
FINGERPRINTED = ("inner_steps", "codec")
"""Of those, the ones the run's fingerprint covers (with the outer optimizer's knobs)."""
UNCHECKED = tuple(key for key in (*SHARED, *SHARED_RUN) if key not in FINGERPRINTED)
"""Those the run's fingerprint does not cover (a joiner with another is not refused)."""


def from_elsewhere(sources: dict[str, str], config: RunConfig) -> list[str]:
    """The shared settings a joiner took from its own config file or ``WORKBENCH_*`` variables,
    not from its flags (the join command's): "inner_lr 0.002 (env WORKBENCH_INNER_LR)"."""
    settings = command_settings("join")
    return [
        f"{key} {settings[key].read(config)} ({sources[key]})"
        for key in UNCHECKED
        if sources.get(key, "default") not in ("flag", "default")
    ]


def join_command(config: RunConfig, addresses: Sequence[str]) -> str:
    """The exact command another machine pastes to join this run."""
    from workbench.config import RunConfig

    parts = ["workbench", "join", *method_arguments(config)]
    parts += setting_arguments(config, ("run_id",), changed_only=True)
    model = model_flags(config)  # a model folder must exist on the joiner's machine too
    if model != model_flags(RunConfig()):
        parts += model
    parts += setting_arguments(config, SHARED, changed_only=True)
    parts += optimizer_arguments(config, changed_only=True)
    parts += setting_arguments(config, (*SHARED_RUN, "owner"), changed_only=True)
    if config.peer.secret:  # never print the secret itself: it is shared privately
        parts += ["--secret", "SECRET"]
    return shlex.join(parts + list(addresses))  # a folder's name with a space stays one argument
