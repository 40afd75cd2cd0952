"""A :class:`RunConfig` back into flags: the join command another machine pastes, and the
flags a local peer of the demo is started with (:func:`workbench.local.launch.peer_arguments`).
The inverse of :func:`workbench.cli.options.build_config`: both must round-trip."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workbench.config import RunConfig


def method_arguments(config: RunConfig) -> list[str]:
    """``--method`` and the schedule flags of a dp or streaming run (a diloco run: none)."""
    chosen = config.outer_method
    if chosen.every_step:
        return ["--method", chosen.name]
    if not chosen.fragmented:
        return []
    args = ["--method", "streaming", "--fragments", str(config.fragments)]
    if config.sync_delay:
        args += ["--sync-delay", str(config.sync_delay)]
    if config.alpha is not None:
        args += ["--alpha", repr(config.alpha)]
    return args


def optimizer_arguments(config: RunConfig, *, changed_only: bool = False) -> list[str]:
    """The optimizer flags that rebuild ``config.diloco``, those its method takes (a sparseloco
    or local_sgd run is a diloco run with the preset's settings spelled out); ``changed_only``:
    only those that differ from DiLoCoConfig's defaults (for a join command people read)."""
    from optim.diloco import DiLoCoConfig

    values = _optimizer_values(config.diloco)
    if changed_only:
        defaults = _optimizer_values(DiLoCoConfig())
        # A delayed run's outer defaults are not DiLoCoConfig's (optim.api.DELAYED_OUTER): spell them out.
        kept = ("outer_lr", "outer_momentum") if config.diloco.delay == 1 else ()
        values = {k: v for k, v in values.items() if v != defaults[k] or k in kept}
    args = []
    for dest, value in values.items():
        if dest not in config.outer_method.knobs or value is None:
            continue
        flag = "--" + dest.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:
            args.append("--no-" + flag[2:])
        else:
            args += [flag, value]
    return args


def _optimizer_values(d) -> dict[str, str | bool | None]:
    return {
        "outer_lr": repr(d.outer_lr),
        "outer_momentum": repr(d.outer_momentum),
        "update_codec": d.codec,
        "topk_density": repr(d.topk_density),
        "topk_chunk": str(d.topk_chunk),
        "topk_bits": str(d.topk_bits),
        "topk_mean": d.topk_mean,
        "ef_decay": repr(d.error_decay),
        "delay": str(d.delay),
        "outlier_ratio": repr(d.outlier_ratio),
        "clip_norm": repr(d.clip_norm),
        "error_feedback": d.error_feedback or None,
        "overlap": d.overlap or None,
        "eager": None if d.eager is None or d.delay != 1 else d.eager,
    }


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


def join_command(config: RunConfig, addresses: Sequence[str]) -> str:
    """The exact command another machine pastes to join this run."""
    from workbench.config import RunConfig

    parts = ["workbench", "join", *method_arguments(config)]
    if config.peer.run_id != "workbench":
        parts += ["--run-id", config.peer.run_id]
    defaults = RunConfig()
    model = model_flags(config)  # a model folder must exist on the joiner's machine too
    if model != model_flags(defaults):
        parts += model
    # Settings every peer must share, or their global params drift apart round after round.
    for flag, value, default in (
        ("--inner-steps", config.diloco.inner_steps, defaults.diloco.inner_steps),
        ("--inner-lr", config.train.inner_lr, defaults.train.inner_lr),
        ("--codec", config.averaging.compression, defaults.averaging.compression),
        ("--aggregate", config.averaging.aggregate, defaults.averaging.aggregate),
    ):
        if value != default:
            parts += [flag, str(value)]
    parts += optimizer_arguments(config, changed_only=True)
    if config.data.tokenizer:  # token ids shape the model: every peer needs the same tokenizer
        parts += ["--tokenizer", config.data.tokenizer]
    if config.peer.rounds:  # the inner lr schedule (cosine to the end) depends on the run's length
        parts += ["--rounds", str(config.peer.rounds)]
    if config.peer.round_seconds:  # rounds of the same length for every peer
        parts += ["--round-seconds", repr(config.peer.round_seconds)]
    if config.peer.owner:
        parts += ["--owner", config.peer.owner]
    if config.peer.secret:  # never print the secret itself: it is shared privately
        parts += ["--secret", "SECRET"]
    return " ".join(parts + list(addresses))
