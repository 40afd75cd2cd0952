"""The flags of the peer commands (``start``, ``join``, ``demo``) and the :class:`RunConfig`
they build; shared by the CLI, ``config``, ``status``/``steer``, the demo launcher and
``Experiment``. Torch-free at import, so ``workbench --help`` stays fast."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from optim.api import method
from swarm.averaging_config import CODEC_BYTES
from swarm.bounds import parser as bounded
from workbench.cli.optimizer_flags import add_optimizer_options, add_round_seconds, outer_config
from workbench.names import MODEL_PRESETS, WANDB_MODES

if TYPE_CHECKING:  # torch-backed modules load only when a command runs
    from workbench.config import RunConfig


EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


def _add_training_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="read settings from this TOML file (keys are the flags' names: inner_steps = 20); "
        "flags given here override it, WORKBENCH_* variables sit below it",
    )
    group = parser.add_argument_group("model and data")
    group.add_argument(
        "--model",
        default="small",
        type=_model_name,
        metavar="PRESET|DIR",
        help=f"model preset ({', '.join(MODEL_PRESETS)}; default: small, ~1.9M params) or a folder with a "
        "Hugging Face causal-LM config.json, and its weights if it has them (pip install '.[hf]')",
    )
    group.add_argument(
        "--block-size",
        type=bounded("block_size"),
        metavar="T",
        help="context length in tokens (default: the preset's, 128)",
    )
    group.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="train on this Hugging Face tokenizer's ids instead of bytes (a local folder, or a hub name)",
    )
    group.add_argument(
        "--dataset",
        metavar="NAME|PATH",
        help="read documents with the datasets library: a save_to_disk folder, data files "
        "(.jsonl/.json/.csv/.parquet/.txt) or a hub name; with --shard each peer reads its own records",
    )
    group.add_argument("--dataset-subset", metavar="NAME", help="the hub dataset's configuration name")
    group.add_argument(
        "--dataset-split", default="train", help="the dataset's split to read (default: train)"
    )
    group.add_argument(
        "--streaming",
        action="store_true",
        default=None,
        help="stream the dataset's records instead of downloading and preparing it whole",
    )
    group.add_argument(
        "--data",
        metavar="PATH",
        help="text file, .jsonl file (one record per line) or folder to train on (default: the Python "
        "stdlib's source)",
    )
    group.add_argument(
        "--text-field",
        default="text",
        help="in a .jsonl data file or a dataset, the field holding each record's text (default: text)",
    )
    group.add_argument(
        "--batch-size", type=bounded("batch_size"), default=16, help="sequences per inner step (default: 16)"
    )
    group.add_argument(
        "--device", default="auto", help="auto, cpu or cuda[:N] (default: auto = CUDA when present)"
    )
    group.add_argument(
        "--seed", type=bounded("seed"), default=0, help="model init and data order seed (default: 0)"
    )
    group.add_argument("--shard", metavar="I/N", help="read only shard I of N slices of the data (e.g. 0/4)")
    group.add_argument(
        "--threads", type=bounded("threads"), default=0, help="torch CPU threads (default: torch decides)"
    )

    group = parser.add_argument_group("DiLoCo")
    add_optimizer_options(group)
    group.add_argument(
        "--rounds",
        type=bounded("rounds"),
        default=0,
        help="stop after this many outer rounds (default: 0 = never)",
    )
    add_round_seconds(group)
    group.add_argument(
        "--eval-every",
        type=bounded("eval_every"),
        default=1,
        metavar="ROUNDS",
        help="evaluate the global params every ROUNDS rounds, and after the last (default: 1)",
    )

    group = parser.add_argument_group("averaging")
    group.add_argument(
        "--codec", default="none", choices=sorted(CODEC_BYTES), help="pseudo-gradient wire codec"
    )
    group.add_argument(
        "--matchmaking-time",
        type=bounded("matchmaking_time"),
        default=2.0,
        help="the longest a round's group stays open; a complete group forms at once, and the "
        "window is learned from the last rounds (default: 2)",
    )
    group.add_argument(
        "--averaging-timeout",
        type=bounded("averaging_timeout"),
        default=30.0,
        help="seconds before a round falls back to a local step",
    )
    group.add_argument(
        "--aggregate",
        default="mean",
        choices=("mean", "trimmed-mean"),
        help="mean (default) or trimmed-mean: per coordinate, drop the group's largest and smallest "
        "value before averaging (robust to one bad peer; takes hivemind's data plane)",
    )
    group.add_argument(
        "--data-plane",
        default="direct",
        choices=("direct", "hivemind"),
        help="direct (default): a group whose members all accept connections moves its tensors over "
        "its own gloo ring, ~10x hivemind's speed, and a joiner downloads the state in checked slices "
        "from several donors over TCP; hivemind: always hivemind's all-reduce and state stream "
        "(relayed through NAT, slower)",
    )


def _add_peer_options(parser: argparse.ArgumentParser) -> None:
    _add_training_options(parser)
    group = parser.add_argument_group("network")
    group.add_argument("--run-id", default="workbench", help="the run's name in the DHT (default: workbench)")
    group.add_argument("--name", help="this peer's display name")
    group.add_argument(
        "--host", default="127.0.0.1", help="IP to listen on (default: 127.0.0.1; 0.0.0.0 for a real network)"
    )
    group.add_argument(
        "--port", type=bounded("port"), default=0, help="TCP port to listen on (default: any free port)"
    )
    group.add_argument(
        "--announce",
        action="append",
        default=[],
        metavar="MULTIADDR",
        help="public address others dial, e.g. /ip4/203.0.113.7/tcp/31337 (repeatable)",
    )
    group.add_argument(
        "--client-mode", action="store_true", help="accept no inbound connections (behind NAT)"
    )
    group.add_argument(
        "--identity", metavar="FILE", help="private key file, for a peer id that survives restarts"
    )
    group.add_argument(
        "--connect-timeout",
        type=bounded("connect_timeout"),
        default=20.0,
        help="seconds to reach the bootstrap peers (default 20), and then for a joiner to find a "
        "live peer of its run (3 to 10 s of it)",
    )
    add_run_access_options(group)
    group.add_argument(
        "--min-peers",
        type=bounded("min_peers"),
        default=1,
        help="wait for this many peers before the first round",
    )
    group.add_argument(
        "--run-dir", metavar="DIR", help="write metrics.jsonl and the final global params here"
    )
    group.add_argument(
        "--checkpoint-every",
        type=bounded("checkpoint_every"),
        default=0,
        metavar="ROUNDS",
        help="write <run-dir>/checkpoint.pt every ROUNDS outer rounds (default 0: on request only)",
    )
    group.add_argument(
        "--resume",
        metavar="DIR",
        help="continue from the checkpoint in DIR (a stopped peer's --run-dir; also the default --run-dir)",
    )
    group.add_argument(
        "--tensorboard",
        nargs="?",
        const="",
        metavar="DIR",
        help="also write the metrics as TensorBoard scalars to DIR (default: <run-dir>/tensorboard)",
    )
    group.add_argument(
        "--wandb",
        metavar="PROJECT",
        help="also log the metrics to this W&B project (offline unless --wandb-mode)",
    )
    group.add_argument(
        "--wandb-mode",
        default="offline",
        choices=WANDB_MODES,
        help="offline (default: written under <run-dir>/wandb; upload later with `wandb sync`), online",
    )
    group.add_argument(
        "--fault-file",
        metavar="FILE",
        help="testing: read injected faults (throttle, corrupt update) from FILE between steps",
    )


def add_run_access_options(group) -> None:
    """--secret and --owner: which run to trust (shared by peers, status, steer, monitor)."""
    group.add_argument(
        "--secret",
        default=os.environ.get("WORKBENCH_RUN_SECRET"),
        help="private run: only peers with this secret find, join and write to it "
        "(default: $WORKBENCH_RUN_SECRET)",
    )
    group.add_argument(
        "--owner",
        metavar="HASH",
        help="trust only the manifest and steering of this owner key (printed by `workbench start`)",
    )


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistake reported in one line (the usage block buries it) and exit 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


PEER_COMMANDS = ("start", "join", "demo")
NEGATABLE = ("eager",)
"""Switches with a ``--no-`` form: ``Experiment(eager=False)`` is ``--no-eager``."""


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[command]


def apply_settings(
    parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str]
) -> dict[str, str]:
    """Layer the --config file and WORKBENCH_* variables under the flags of a peer command
    (see workbench.cli.configfile); returns where each setting came from."""
    from workbench.cli.configfile import layer, settings_of

    command = args.command
    rest = list(argv)[list(argv).index(command) + 1 :]
    known = {key for name in PEER_COMMANDS for key in settings_of(subparser(parser, name))}
    return layer(args, subparser(parser, command), rest, known_elsewhere=known)


def parse_shard(text: str | None) -> tuple[int | None, int]:
    """``--shard I/N`` as (I, N); (None, 1) when not given."""
    if text is None:
        return None, 1
    index, _, count = text.partition("/")
    try:
        return int(index), int(count)
    except ValueError:
        raise ValueError(f"--shard '{text}' must look like I/N, e.g. 0/4 for the first of 4 shards") from None


def _model_name(text: str) -> str:
    """``--model``: a preset's name or a folder with a Hugging Face config.json."""
    if text in MODEL_PRESETS or (Path(text).expanduser() / "config.json").is_file():
        return text
    where = (
        "that folder has no config.json" if Path(text).expanduser().is_dir() else "no such preset or folder"
    )
    raise argparse.ArgumentTypeError(
        f"unknown model {text!r} ({where}): use a preset ({', '.join(MODEL_PRESETS)}) or a folder holding "
        "a Hugging Face causal-LM config.json"
    )


def _model_shape(args: argparse.Namespace):
    from workbench.run.model import preset

    shape = preset(args.model if args.model in MODEL_PRESETS else "small")
    return replace(shape, block_size=args.block_size) if args.block_size else shape


def build_config(args: argparse.Namespace) -> RunConfig:
    """The config tree from parsed flags; raises ValueError/SwarmError on a bad value."""
    from swarm.averaging_config import AveragingConfig
    from swarm.dht import NetworkConfig
    from workbench.config import PeerConfig, RunConfig, TrainConfig
    from workbench.run.data import DataConfig

    return RunConfig(
        method=method(args.method).real_peers,
        fragments=args.fragments or 4,
        sync_delay=getattr(args, "sync_delay", None) or 0,
        alpha=getattr(args, "alpha", None),
        model=_model_shape(args),
        hf_model=None if args.model in MODEL_PRESETS else args.model,
        data=DataConfig(
            path=args.data,
            batch_size=args.batch_size,
            text_field=args.text_field,
            dataset=args.dataset,
            dataset_subset=args.dataset_subset,
            dataset_split=args.dataset_split,
            streaming=bool(args.streaming),
            tokenizer=args.tokenizer,
        ),
        train=TrainConfig(inner_lr=args.inner_lr, threads=args.threads),
        diloco=outer_config(args),
        averaging=AveragingConfig(
            matchmaking_time=args.matchmaking_time,
            averaging_timeout=args.averaging_timeout,
            compression=args.codec,
            data_plane=args.data_plane,
            aggregate=args.aggregate,
        ),
        network=NetworkConfig(
            initial_peers=list(getattr(args, "peers", None) or []) if args.command == "join" else [],
            host=getattr(args, "host", "127.0.0.1"),
            port=getattr(args, "port", 0),
            announce=list(getattr(args, "announce", [])),
            client_mode=getattr(args, "client_mode", False),
            identity_path=getattr(args, "identity", None),
            connect_timeout=getattr(args, "connect_timeout", 20.0),
        ),
        peer=PeerConfig(
            run_id=getattr(args, "run_id", "workbench"),
            name=getattr(args, "name", None),
            rounds=args.rounds,
            round_seconds=getattr(args, "round_seconds", 0.0) or 0.0,
            eval_every=args.eval_every,
            min_peers=getattr(args, "min_peers", 1),
            seed=args.seed,
            shard=parse_shard(getattr(args, "shard", None))[0],
            num_shards=parse_shard(getattr(args, "shard", None))[1],
            device=args.device,
            run_dir=getattr(args, "run_dir", None) or getattr(args, "resume", None),
            secret=getattr(args, "secret", None),
            owner=getattr(args, "owner", None),
            fault_file=getattr(args, "fault_file", None),
            checkpoint_every=getattr(args, "checkpoint_every", 0),
            resume=getattr(args, "resume", None),
            tensorboard=getattr(args, "tensorboard", None),
            wandb_project=getattr(args, "wandb", None),
            wandb_mode=getattr(args, "wandb_mode", "offline"),
        ),
    )


def _where_from(message: str, sources: dict[str, str]) -> str:
    """' (inner_lr from file run.toml)' when the bad value named in ``message`` was not a flag."""
    text = message.lower()
    named = [
        f"{key} from {source}"
        for key, source in sources.items()
        if source not in ("flag", "default") and (key.replace("_", " ") in text or key in text)
    ]
    return f" ({'; '.join(named)})" if named else ""
