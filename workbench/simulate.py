"""`workbench simulate`: the optimizer family on N virtual peers in this process.

Wires the built-in model and corpus into :func:`optim.sim.simulate`. Every virtual peer
starts from the same init (same seed), reads its own shard of the training split, and runs
the same outer-optimizer code a real peer runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from optim.api import METHODS, Method, Sync, method
from optim.diloco import DiLoCoConfig
from optim.eager import AdamW
from optim.sim import InProcessSwarm, SimConfig, SimResult, VirtualPeer, simulate
from optim.streaming import StreamingConfig
from workbench.config import TrainConfig
from workbench.run.data import EVAL_BATCH_SIZE, ByteCorpus, DataConfig, evaluate
from workbench.run.model import ModelConfig
from workbench.run.progress_bar import Bar, progress
from workbench.run.training import network

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class MethodSpec:
    """Which outer method, and its DiLoCo settings where it has any."""

    method: str = "diloco"
    """A name in :data:`optim.api.METHODS`: dp (data-parallel, the baseline), local_sgd (FedAvg),
    diloco, sparseloco or streaming."""
    diloco: DiLoCoConfig
    """Inner steps, outer lr/momentum, codec and error feedback (diloco; H and codec for the rest)."""
    fragments: int = 4
    """streaming: fragments synced on staggered schedules."""
    sync_delay: int = 0
    """streaming: inner steps between a fragment's reduction and its merge (τ)."""
    alpha: float | None = None
    """streaming: weight of the local fragment at the merge (None: StreamingConfig's default)."""

    def streaming_config(self) -> StreamingConfig:
        return StreamingConfig(
            outer=self.diloco, fragments=self.fragments, sync_delay=self.sync_delay, alpha=self.alpha
        )

    def __post_init__(self) -> None:
        chosen = method(self.method)  # raises ValueError naming the choices
        if chosen.every_step and self.diloco.codec != "none":
            raise ValueError(
                "the data-parallel baseline sends fp32 gradients; use --codec none with --method dp"
            )
        if chosen.fragmented:
            self.streaming_config()  # raises ValueError for a bad fragment setting

    @property
    def outer_method(self) -> Method:
        return METHODS[self.method]

    def loop_steps(self) -> int:
        """Inner steps per round of the simulator's loop: H, or 1 where the method decides on
        its own when to sync (data-parallel every step, streaming one fragment at a time)."""
        return self.diloco.inner_steps if self.outer_method.sync is Sync.ROUNDS else 1

    def outer_config(self) -> DiLoCoConfig:
        """The outer settings as given: build them with the method's preset
        (``optim.sparseloco.sparseloco``, ``optim.local_sgd.local_sgd``) or
        ``workbench.cli.optimizer_flags.outer_config``; nothing here overrides them."""
        return self.diloco


def run_simulation(
    spec: MethodSpec,
    *,
    model: ModelConfig,
    data: DataConfig,
    train: TrainConfig,
    sim: SimConfig,
    eval_batches: int = 8,
    make_model: Callable[[], torch.nn.Module] | None = None,
    hf_model: str | None = None,
) -> SimResult:
    """The peers train the model real peers would: the preset ``model`` or the Hugging Face
    folder ``hf_model`` (``model`` then gives the context length), sized to the corpus'
    vocabulary. ``make_model``: your own module instead (one call per virtual peer; each must
    return the same initial θ). Its ``forward(x, y)`` returns ``(output, loss)``; see
    :class:`workbench.notebook.experiment.WithLoss` to add a loss function."""
    corpus = ByteCorpus.load(data)
    corpus.check_fits(model.block_size)
    held_out = corpus.eval_batches(
        block_size=model.block_size, batch_size=EVAL_BATCH_SIZE, num_batches=eval_batches
    )
    device = torch.device("cpu")
    H = spec.loop_steps()
    total = sim.steps

    def make_peer(rank: int, swarm: InProcessSwarm) -> VirtualPeer:
        net = make_model() if make_model is not None else network(model, hf_model, corpus, seed=sim.seed)
        if rank == 0 and sim.peers > 1:
            _warn_of_dropout(net)
        inner = AdamW(
            net.parameters(),
            lr=train.inner_lr,
            weight_decay=train.weight_decay,
            betas=(train.beta1, train.beta2),
        )
        outer = spec.outer_method.build(
            net,
            inner,
            swarm.averager(rank),
            spec.outer_config(),
            fragments=spec.fragments,
            sync_delay=spec.sync_delay,
            alpha=spec.alpha,
        )

        def set_lr(step: int) -> None:
            for group in inner.param_groups:
                group["lr"] = train.inner_lr * train.lr_factor(step, total)

        batches = corpus.batches(
            block_size=model.block_size,
            batch_size=data.batch_size,
            seed=sim.seed,
            shard=rank,
            num_shards=sim.peers,
        )
        return VirtualPeer(
            model=net,
            inner_optimizer=inner,
            outer=outer,
            batches=batches,
            inner_steps=H,
            set_lr=set_lr,
            grad_clip=train.grad_clip,
        )

    return simulate(make_peer, lambda net: evaluate(net, held_out, device, data.batch_size), sim)


def parse_speeds(text: str | None) -> list[float]:
    """``--speeds 1,1,0.5,0.5`` as floats (empty: every peer at speed 1)."""
    if not text:
        return []
    try:
        return [float(s) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"--speeds '{text}' must be numbers separated by commas, e.g. 1,1,0.5,0.5") from None


def _streaming_used(spec: MethodSpec) -> dict[str, Any]:
    """The streaming settings the run uses (α resolved: 0.5 with τ > 0, else 0)."""
    used = spec.streaming_config()
    return {"fragments": used.fragments, "sync_delay": used.sync_delay, "alpha": used.alpha}


def run_simulate_command(args: argparse.Namespace) -> int:
    stragglers = {}
    for text in args.straggler:
        rank, _, fraction = text.partition(":")
        try:
            stragglers[int(rank)] = float(fraction)
        except ValueError:
            raise ValueError(f"--straggler '{text}' must look like RANK:FRACTION, e.g. 3:0.5") from None
    from optim.streaming import default_fragments
    from workbench.cli.optimizer_flags import effective, outer_config
    from workbench.cli.options import build_config

    diloco = outer_config(args)
    fragments = args.fragments or default_fragments(diloco.inner_steps)  # as real peers choose it
    streaming = dict(fragments=fragments, sync_delay=args.sync_delay or 0, alpha=args.alpha)
    spec = MethodSpec(method=args.method, diloco=diloco, **streaming)
    sim = SimConfig(
        peers=args.peers,
        steps=args.steps,
        stragglers=stragglers,
        dropout=args.dropout,
        seed=args.seed,
        speeds=parse_speeds(args.speeds),
        round_seconds=args.round_seconds,
        step_seconds=args.step_seconds,
    )
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0 (got {args.threads}); 0 lets torch decide")
    if (stragglers or args.round_seconds) and spec.outer_method.sync is not Sync.ROUNDS:
        raise ValueError(
            f"--straggler and --round-seconds apply to round-based methods; {args.method} syncs "
            f"{spec.outer_method.sync.value}"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    # Progress on a terminal, from peer 0's rounds; opened at the first one, once the corpus'
    # own bar is gone (one live display at a time).
    bars = contextlib.ExitStack()
    bar: Bar | None = None

    def on_round(info: dict[str, float]) -> None:
        nonlocal bar
        if info["rank"] != 0:
            return
        if bar is None:
            bar = bars.enter_context(progress(title, total=args.steps))
        bar.show(info["step"], f"{title}: round {int(info['round'])}, loss {info['loss']:.3f}")

    title = f"{args.method} on {args.peers} virtual peers"
    # The model and data as a peer given the same settings takes them (a folder's model, its
    # --block-size, a --tokenizer or --dataset): the simulated run is the one peers would run.
    config = build_config(args, simulated=True)
    with bars:
        result = run_simulation(
            spec,
            model=config.model,
            hf_model=config.hf_model,
            data=config.data,
            train=config.train,
            sim=dataclasses.replace(sim, on_round=on_round),
        )
    summary = {
        "method": args.method,
        "peers": args.peers,
        "inner_steps": 1 if spec.outer_method.every_step else args.inner_steps,
        **(
            {"fragments": spec.fragments, "sync_delay": spec.sync_delay}  # as used (defaults too)
            if spec.outer_method.fragmented
            else {}
        ),
        "codec": spec.diloco.codec,
        "steps": args.steps,
        "final_eval_loss": result.final_eval_loss,
        "bytes_per_peer": result.bytes_per_peer,
        "seconds": round(result.seconds, 2),
        "initial_eval_loss": result.initial_eval_loss,
        "outer_rounds": result.rounds,
        "peak_bytes_per_sync": result.peak_bytes_per_sync,
        "params_max_abs_diff": result.params_max_abs_diff,
        "virtual_seconds": result.virtual_seconds,
        "utilization": [round(u, 4) for u in result.utilization],
        "steps_per_peer": result.steps_per_peer,
        "config": {
            **effective(
                args.method, spec.diloco, **(_streaming_used(spec) if spec.outer_method.fragmented else {})
            ),
            "round_seconds": args.round_seconds,
            "speeds": sim.speeds or None,
        },
    }
    if args.json:
        print(json.dumps(summary), flush=True)
    else:
        print(
            f"{args.method} on {args.peers} virtual peers, {args.steps} steps: eval loss "
            f"{result.initial_eval_loss:.3f} -> {result.final_eval_loss:.3f}, "
            f"{result.bytes_per_peer / 1e6:.1f} MB sent per peer, {result.seconds:.0f} s",
            file=sys.stderr,
        )
    rose = diverged(result.initial_eval_loss, result.final_eval_loss)
    if rose:
        print(f"warning: {rose}", file=sys.stderr)
    return 0


def diverged(initial: float, final: float) -> str | None:
    """Why a run's eval loss says it diverged (it ended above where it started, or not finite),
    or None: a simulation that got worse is worth a line, not only a number."""
    if not math.isfinite(final) or (math.isfinite(initial) and final > initial * 1.05):
        return (
            f"the eval loss ended above where it started ({initial:.3f} -> {final:.3f}): the run "
            "diverged; lower --outer-lr or --inner-lr"
        )
    return None


def _warn_of_dropout(net: torch.nn.Module) -> None:
    """The virtual peers are threads drawing from torch's one generator: with dropout (a Hugging
    Face config's 0.1, ``--dropout``) the masks each peer draws follow the threads' timing, and
    two runs of one seed differ (measured: 5.3293 / 5.3291 / 5.3290)."""
    rates = sorted(
        {m.p for m in net.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0}
    )
    if rates:
        logger.warning(
            "the model has dropout (p=%s): the virtual peers share torch's generator, so a run is not "
            "repeatable for its seed; set the dropout to 0 for one that is",
            ", ".join(f"{p:g}" for p in rates),
        )
