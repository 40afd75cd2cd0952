"""The optimizer's settings: one set for ``start``, ``join``, ``demo`` and ``simulate`` (and so
for TOML keys and ``Experiment`` keywords). Beyond ``inner_steps``, ``inner_lr`` and
``method``, each is a knob of :mod:`optim.api` (the key is the knob's name), which says the
methods that take it; ``target`` is where :class:`~optim.diloco.DiLoCoConfig` keeps it."""

from __future__ import annotations

from dataclasses import dataclass

from optim.api import DELAYED_OUTER, METHODS
from optim.choices import TOPK_MEANS
from swarm.bounds import UPDATE_CODECS
from workbench.settings import setting


@dataclass(kw_only=True)
class Optimizer:
    """optimizer (the same flags as start and join)"""

    inner_steps: int = setting(
        50,
        "inner steps per round (default: 50)",
        bound="inner_steps",
        metavar="H",
        target="diloco.inner_steps",
    )
    inner_lr: float = setting(
        1e-3, "inner AdamW learning rate (default: 1e-3)", bound="inner_lr", target="train.inner_lr"
    )
    grad_clip: float = setting(
        1.0,
        "clip each inner step's gradient to this norm, for every method (dp: the averaged "
        "gradient's; default: 1.0; 0 turns it off)",
        bound="grad_clip",
        target="train.grad_clip",
    )
    weight_decay: float = setting(
        0.1, "inner AdamW weight decay (default: 0.1)", bound="weight_decay", target="train.weight_decay"
    )
    beta1: float = setting(0.9, "inner AdamW beta1 (default: 0.9)", bound="beta1", target="train.beta1")
    beta2: float = setting(0.95, "inner AdamW beta2 (default: 0.95)", bound="beta2", target="train.beta2")
    warmup_steps: int = setting(
        20,
        "linear warmup of the inner lr over this many inner steps, then cosine decay to a tenth "
        "when the run's length is known (--rounds; simulate: --steps) (default: 20)",
        bound="warmup_steps",
        target="train.warmup_steps",
    )
    method: str = setting(
        "diloco",
        "outer method: diloco, local_sgd (FedAvg), sparseloco (chunked top-k, 2-bit values, error "
        "feedback), streaming (fragments synced in turn) or dp (data-parallel: gradients averaged every "
        "step, the baseline)",
        choices=tuple(METHODS),
    )
    outer_lr: float | None = setting(
        None, "outer SGD learning rate (diloco: 0.7)", bound="outer_lr", target="diloco.outer_lr"
    )
    outer_momentum: float | None = setting(
        None, "outer Nesterov momentum (diloco: 0.9)", bound="outer_momentum", target="diloco.outer_momentum"
    )
    update_codec: str | None = setting(
        None,
        "codec for pseudo-gradients inside the optimizer (default: none; sparseloco: topk)",
        choices=UPDATE_CODECS,
        target="diloco.codec",
    )
    topk_density: float | None = setting(
        None,
        "fraction of each chunk the topk codec keeps (default: 0.01; sparseloco: 128/4096)",
        bound="topk_density",
        target="diloco.topk_density",
    )
    topk_chunk: int | None = setting(
        None,
        "elements per top-k chunk, 0 for one top-k per tensor (default: 0; sparseloco: 4096)",
        bound="topk_chunk",
        metavar="N",
        target="diloco.topk_chunk",
    )
    topk_bits: int | None = setting(
        None,
        "bits per value the topk codec keeps: 16 (fp16) or 2 (4 levels, 12-bit indices; "
        "default: 16; sparseloco: 2)",
        kind="int",
        choices=(2, 16),
        target="diloco.topk_bits",
    )
    topk_mean: str | None = setting(
        None,
        "how the group averages sparse updates: over the whole group, or each coordinate over "
        "the peers that kept it (default: group; sparseloco: kept)",
        choices=TOPK_MEANS,
        target="diloco.topk_mean",
    )
    error_feedback: bool | None = setting(
        None,
        "keep what the update codec drops for the next round",
        kind="switch",
        target="diloco.error_feedback",
        negation="drop what the update codec drops (sparseloco keeps it by default): the way a "
        "run's `error_feedback = false` reaches its joiners and its demo peers",
    )
    ef_decay: float | None = setting(
        None,
        "error feedback: the residual decays by BETA each round (default: 1; sparseloco: 0.95)",
        bound="ef_decay",
        metavar="BETA",
        target="diloco.error_decay",
    )
    fragments: int | None = setting(
        None,
        "streaming: fragments synced in turn (default: 4, or the count nearest 4 that divides H)",
        bound="fragments",
        target="fragments",
    )
    sync_delay: int | None = setting(
        None,
        "streaming: inner steps a fragment's all-reduce runs in the background before its merge, "
        "below H/F (default: 0, merged at once)",
        bound="sync_delay",
        metavar="TAU",
        target="sync_delay",
    )
    alpha: float | None = setting(
        None,
        "streaming: the local fragment's weight at the merge (default: 0, 0.5 with --sync-delay)",
        bound="alpha",
        target="alpha",
    )
    delay: int | None = setting(
        None,
        "apply each round's mean one round later (default: 0)",
        kind="int",
        choices=(0, 1),
        target="diloco.delay",
    )
    overlap: bool | None = setting(
        None,
        "average each round in the background while the next round trains (implies --delay 1)",
        kind="switch",
        negation="off, whatever a --config file or WORKBENCH_* variable says (the default)",
        off_unless_given=True,
        target="diloco.overlap",
    )
    eager: bool | None = setting(
        None,
        "with --overlap or --delay 1: eager outer updates, this peer's fresh update standing in for "
        "its share of the mean still in flight (the default with them; Kale et al. 2025; outer lr / "
        f"momentum default to {DELAYED_OUTER['eager'][0]} / {DELAYED_OUTER['eager'][1]})",
        kind="switch",
        negation="with --overlap or --delay 1: the naive one-step delay instead (for comparison; its "
        f"outer lr / momentum default to {DELAYED_OUTER['naive'][0]} / {DELAYED_OUTER['naive'][1]})",
        target="diloco.eager",
    )
    outlier_ratio: float | None = setting(
        None,
        "refuse a round whose update from one peer is this many times the others' median norm, "
        "or larger than declared (default: 10; 0 turns it off)",
        bound="outlier_ratio",
        target="diloco.outlier_ratio",
    )
    clip_norm: float | None = setting(
        None,
        "clip this peer's pseudo-gradient to this norm before sending (default: off)",
        bound="clip_norm",
        target="diloco.clip_norm",
    )


SIMULATE_ALIASES = {"update_codec": {"aliases": ("--codec",)}, "topk_density": {"aliases": ("--density",)}}
"""``simulate``'s older names: ``--codec`` for ``--update-codec`` and ``--density`` for
``--topk-density`` (on the peer commands, ``--codec`` is the wire codec)."""
