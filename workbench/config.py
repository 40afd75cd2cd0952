"""The config tree of a run: one dataclass per component, one tree for CLI, TUI and notebooks.

Every component checks its own values where it is built (``__post_init__``) and raises
``ValueError`` (or ``SwarmError``) with the fix; :func:`presets` are small functions.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from optim.api import Method, Sync, method, names
from optim.diloco import DiLoCoConfig
from swarm.averaging_config import AveragingConfig
from swarm.dht import NetworkConfig
from swarm.errors import SwarmError
from swarm.records import check_name, check_owner, check_run_id
from workbench.names import WANDB_MODES
from workbench.run.data import DataConfig
from workbench.run.model import ModelConfig


@dataclass(kw_only=True)
class TrainConfig:
    """The inner loop: AdamW on each peer's own data (its state never leaves the peer)."""

    inner_lr: float = 1e-3
    """Peak AdamW learning rate (OpenDiLoCo uses 4e-4 at 150M params; tiny models like 1e-3)."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 20
    """Linear warmup of the inner lr over this many steps, then cosine decay to 10% when the run
    has a known length, else constant."""
    grad_clip: float = 1.0
    """Clip each inner step's gradient norm to this (0 disables)."""
    threads: int = 0
    """torch CPU threads (0: torch's default). Local multi-peer demos use 1 per peer."""

    def __post_init__(self) -> None:
        if not 0 < self.inner_lr < 1:
            raise ValueError(f"inner lr must be in (0, 1) (got {self.inner_lr}); try 1e-3")
        if not 0 <= self.weight_decay < 1:
            raise ValueError(f"weight decay must be in [0, 1) (got {self.weight_decay}); try 0.1")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ValueError(f"{name} must be in [0, 1) (got {value})")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup steps must be >= 0 (got {self.warmup_steps})")
        if not self.grad_clip >= 0:  # written so that NaN fails too
            raise ValueError(f"grad clip must be >= 0 (got {self.grad_clip}); 0 disables clipping")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (got {self.threads}); 0 lets torch decide")

    def lr_factor(self, step: int, total_steps: int | None) -> float:
        """Multiplier of ``inner_lr`` at inner step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if not total_steps or total_steps <= self.warmup_steps:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / (total_steps - self.warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass(kw_only=True)
class PeerConfig:
    """This peer's place in the run."""

    run_id: str = "workbench"
    """Names the run in the DHT; every peer of a run uses the same id."""
    name: str | None = None
    """Shown in monitors; defaults to the start of the peer id."""
    rounds: int = 0
    """Stop after this many outer rounds (0: run until Ctrl+C)."""
    round_seconds: float = 0.0
    """Time-boxed rounds: each round's inner steps end after this many seconds (at least one
    step, at most H), so a fast peer trains more steps than a slow one and its pseudo-gradient
    weighs its samples; 0: every round is H steps."""
    min_peers: int = 1
    """Wait for this many peers (this one included) before the first round."""
    wait_timeout: float = 120.0
    """At most this many seconds waiting for ``min_peers``; then train with who is there."""
    eval_every: int = 1
    """Evaluate the global params every this many rounds."""
    eval_batches: int = 8
    """Held-out batches per evaluation."""
    seed: int = 0
    """Seeds the model init (identical on every peer) and this peer's data order."""
    shard: int | None = None
    """Read only shard ``shard`` of ``num_shards`` contiguous slices of the training split
    (None: the whole split, in an order seeded by this peer's id)."""
    num_shards: int = 1
    device: str = "auto"
    """auto (CUDA when present, with bf16 autocast), cpu, or cuda[:N]."""
    run_dir: str | None = None
    """Where to write metrics.jsonl and the final global params (none: write nothing)."""
    secret: str | None = None
    """Private run: peers without this secret can neither find, join nor write to the run."""
    checkpoint_every: int = 0
    """Write ``<run_dir>/checkpoint.pt`` every this many outer rounds (0: only when the owner
    asks, through steering)."""
    resume: str | None = None
    """Continue from the checkpoint in this folder (a stopped peer's --run-dir)."""
    fault_file: str | None = None
    """Testing: a JSON file of injected faults ({"throttle_ms": N, "corrupt_next": T}) read
    between inner steps; the demo's fault-injection menu writes it."""
    owner: str | None = None
    """The run owner's key hash (printed by `workbench start`): trust only its manifest and steering."""
    tensorboard: str | None = None
    """Also write the metrics as TensorBoard scalars to this folder ("" : <run_dir>/tensorboard)."""
    wandb_project: str | None = None
    """Also log the metrics to this W&B project (offline by default: see ``wandb_mode``)."""
    wandb_mode: str = "offline"
    """offline (written under <run_dir>/wandb, upload later with ``wandb sync``), online or disabled."""

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        if self.resume and os.path.exists(self.resume) and not os.path.isdir(self.resume):
            folder = os.path.dirname(self.resume) or "."
            raise ValueError(
                f"--resume {self.resume} is a file: give the folder that holds it (--resume {folder})"
            )
        if self.run_dir and os.path.exists(self.run_dir) and not os.path.isdir(self.run_dir):
            raise ValueError(f"--run-dir {self.run_dir} is a file: give a folder (a peer's run folder)")
        if self.run_dir:  # before anything starts: mkdir said only "[Errno 20] Not a directory"
            found = next((p for p in Path(self.run_dir).expanduser().parents if p.exists()), None)
            if found is not None and not found.is_dir():
                raise ValueError(f"--run-dir {self.run_dir}: {found} is a file, not a folder: give a folder")
        if self.tensorboard == "" and not self.run_dir:
            raise ValueError("--tensorboard without a folder writes into the run folder: add --run-dir DIR")
        if self.wandb_mode not in WANDB_MODES:
            raise ValueError(f"unknown --wandb-mode {self.wandb_mode!r}: choose {', '.join(WANDB_MODES)}")
        if self.wandb_mode == "online" and not self.wandb_project:
            raise ValueError(
                f"--wandb-mode {self.wandb_mode} logs to a W&B project, and none is given: add --wandb PROJECT"
            )
        if self.secret == "SECRET":
            raise ValueError(
                "--secret SECRET is the join command's placeholder: replace SECRET with the run's "
                "secret (its owner gives it to you privately)"
            )
        if self.secret is not None and len(self.secret) < 8:
            raise ValueError("a run secret must be at least 8 characters (use a long random one)")
        try:
            check_owner(self.owner)
        except SwarmError as error:
            raise ValueError(str(error)) from None
        if self.name is not None:
            try:
                check_name(self.name)  # as every other peer checks its heartbeat's
            except SwarmError as error:
                raise ValueError(str(error)) from None
        if self.rounds < 0:
            raise ValueError(f"rounds must be >= 0 (got {self.rounds}); 0 runs until Ctrl+C")
        if not 1 <= self.min_peers <= 1024:
            raise ValueError(f"min peers must be within 1..1024 (got {self.min_peers})")
        if not self.wait_timeout >= 0:  # written so that NaN fails too
            raise ValueError(f"wait timeout must be >= 0 (got {self.wait_timeout})")
        if self.shard is not None and not 0 <= self.shard < self.num_shards:
            raise ValueError(
                f"shard must be in 0..{self.num_shards - 1} for {self.num_shards} shards (got {self.shard})"
            )
        if self.checkpoint_every < 0:
            raise ValueError(
                f"checkpoint every must be >= 0 rounds (got {self.checkpoint_every}); 0 turns it off"
            )
        if self.checkpoint_every and not self.run_dir:
            raise ValueError(
                f"--checkpoint-every {self.checkpoint_every} needs a folder to write them in: add --run-dir DIR"
            )
        if self.eval_every < 1:
            raise ValueError(f"eval every must be >= 1 round (got {self.eval_every})")
        if self.eval_batches < 1:
            raise ValueError(f"eval batches must be >= 1 (got {self.eval_batches})")


@dataclass(kw_only=True)
class RunConfig:
    """Everything one peer needs; the CLI, the launcher and notebooks build this tree."""

    method: str = "diloco"
    """diloco (the family: its settings are in ``diloco``), dp (data-parallel: gradients
    averaged every step; ``diloco`` then only keeps the state, with H=1) or streaming
    (Streaming DiLoCo: ``fragments`` synced one at a time, every H/F steps, with ``diloco``'s
    outer settings)."""
    fragments: int = 4
    """streaming: how many fragments the parameters are split into."""
    sync_delay: int = 0
    """streaming: τ, inner steps a fragment's all-reduce runs in the background before its
    merge (< H/F); 0 merges in the step it is averaged."""
    alpha: float | None = None
    """streaming: the local fragment's weight at the merge (None: StreamingConfig's default,
    0.5 with τ > 0, else 0)."""
    preset: str | None = None
    """The ``--method`` whose preset built ``diloco`` when it is not diloco's own (sparseloco,
    local_sgd: real peers run them as diloco). The join command names it, so that a joiner
    holds the knobs the run does not use yet as the run does (a codec steered to topk later
    uses them: with DiLoCoConfig's instead, joiners compressed otherwise than the owner)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The preset's shape; with ``hf_model``, only its ``block_size`` (the context) applies."""
    hf_model: str | None = None
    """A folder with a Hugging Face causal-LM ``config.json`` (and maybe weights) to train
    instead of a preset (``--model DIR``; the ``[hf]`` extra)."""
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    peer: PeerConfig = field(default_factory=PeerConfig)
    simulated: bool = False
    """Built for the simulator (``Experiment(backend="sim")``), which runs streaming's fragments
    on any schedule: the checks only real peers need (H divisible by F, no --delay) are not
    made, as `workbench simulate` does not make them."""

    @property
    def outer_method(self) -> Method:
        """What :attr:`method` does (:mod:`optim.api`)."""
        return method(self.method)

    @property
    def overlapped(self) -> bool:
        """Rounds average in the background while the next trains (``--overlap``, or streaming
        with τ > 0): a peer's clock is one past the round it averages."""
        return self.diloco.overlap or (self.outer_method.fragmented and self.sync_delay > 0)

    @property
    def round_steps(self) -> int:
        """Inner steps between two syncs: H, or H/F for streaming (one fragment per sync).
        Data-parallel keeps its state with DiLoCo(H=1), so its H is 1 here too."""
        return self.diloco.inner_steps // (self.fragments if self.outer_method.fragmented else 1)

    @property
    def total_rounds(self) -> int:
        """Syncs in a run of ``--rounds``: streaming syncs every fragment once per round."""
        return self.peer.rounds * self.outer_method.syncs_per_round(self.fragments)

    def __post_init__(self) -> None:
        if self.method not in names(real_peers=True):
            raise ValueError(
                f"unknown method '{self.method}'; choose {', '.join(names(real_peers=True))} "
                "(local_sgd and sparseloco are diloco with their preset's settings)"
            )
        if (
            self.outer_method.fragmented
            and not self.simulated
            and (self.fragments < 1 or self.diloco.inner_steps % self.fragments or self.diloco.delay)
        ):
            h, f = self.diloco.inner_steps, max(1, self.fragments)
            fits = [str(n) for n in range(2, 9) if h % n == 0]
            near = sorted({h - h % f or f, h - h % f + f})  # the multiples of F around H ("4 or 4" for H=1)
            hint = f"--inner-steps {' or '.join(map(str, near))}" + (
                f", or --fragments {' or '.join(fits)}" if fits else ""
            )
            if h % f == 0:  # only --delay is wrong
                hint = "drop --delay (streaming overlaps its fragments with --sync-delay)"
            raise ValueError(
                f"streaming on real peers needs --inner-steps ({h}) divisible by "
                f"--fragments ({self.fragments}) and no --delay; e.g. {hint}"
            )
        if self.outer_method.every_step and self.peer.round_seconds:
            raise ValueError(
                f"--round-seconds boxes a round of inner steps, and --method {self.method} syncs "
                "every step (a round is one step): drop --round-seconds"
            )
        if self.outer_method.fragmented and self.diloco.topk_mean != "group":
            raise ValueError(
                "--topk-mean kept is for --method diloco, local_sgd and sparseloco: streaming averages "
                "each fragment over the whole group (drop --topk-mean)"
            )
        if self.diloco.topk_mean == "kept" and (
            self.averaging.aggregate != "mean" or self.averaging.compression not in ("none", "fp16")
        ):
            raise ValueError(
                "--topk-mean kept divides by the members' summed weights and needs an exact wire: use "
                "--aggregate mean and --codec none or fp16 (or --topk-mean group)"
            )
        if self.averaging.aggregate == "trimmed-mean" and self.diloco.codec == "topk":
            raise ValueError(
                "--aggregate trimmed-mean drops each coordinate's largest and smallest values, and with a "
                "top-k update codec (--update-codec topk, or --method sparseloco) most members send 0 for "
                "most coordinates, so trimming erases the kept values (484 nonzeros became 25 in a test): "
                "use --aggregate mean with topk"
            )
        if not self.outer_method.fragmented and (self.sync_delay or self.alpha is not None):
            raise ValueError(f"--sync-delay and --alpha belong to --method streaming (got {self.method})")
        per_fragment = self.diloco.inner_steps // max(self.fragments, 1)
        if self.outer_method.fragmented and not 0 <= self.sync_delay < per_fragment:
            raise ValueError(
                f"--sync-delay must be below the {per_fragment} inner steps between two fragment syncs "
                f"(H/F = {self.diloco.inner_steps}/{self.fragments}; got {self.sync_delay})"
            )
        if self.alpha is not None and not 0 <= self.alpha < 1:
            raise ValueError(f"--alpha must be in [0, 1) (got {self.alpha})")
        if self.diloco.overlap and self.outer_method.sync is not Sync.ROUNDS:
            raise ValueError(f"--overlap works with --method diloco only (got {self.method})")
        if self.outer_method.every_step and (
            self.diloco.inner_steps,
            self.diloco.outer_lr,
            self.diloco.outer_momentum,
        ) != (1, 1.0, 0.0):
            raise ValueError(
                "data-parallel keeps its state with DiLoCo(H=1, outer lr 1, no momentum): use optim.data_parallel.data_parallel_state()"
            )
