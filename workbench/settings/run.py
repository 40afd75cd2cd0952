"""The settings of a peer (``start``, ``join``, ``demo``): one section per component, in the
order ``--help`` shows them. The optimizer's are in :mod:`workbench.settings.optimizer`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from swarm.averaging_config import CODEC_BYTES
from workbench.names import MODEL_PRESETS, WANDB_MODES
from workbench.settings import setting


def model_name(text: str) -> str:
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


def device_name(text: str) -> str:
    """``--device``: auto, cpu, cuda or cuda:N, checked before anything starts (whether CUDA is
    there is the peer's to find: :func:`workbench.run.model.pick_device`). The demo started its
    peers with ``--device tpu`` and each of them failed."""
    if text in ("auto", "cpu", "cuda") or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"unknown device {text!r}: use auto, cpu, cuda or cuda:N")


def given(text: str) -> str:
    """A path or name that must not be empty: ``--resume ""`` started a fresh run without a word,
    ``--run-dir ""`` wrote nothing, ``--data ""`` read the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give a value, or leave the setting out")
    return text


@dataclass(kw_only=True)
class ModelAndData:
    """model and data"""

    model: str = setting(
        "small",
        f"model preset ({', '.join(MODEL_PRESETS)}; default: small, ~1.9M params) or a folder with a "
        "Hugging Face causal-LM config.json, and its weights if it has them (pip install '.[hf]')",
        parse=model_name,
        metavar="PRESET|DIR",
    )
    block_size: int | None = setting(
        None,
        "context length in tokens (default: the preset's: tiny 64, small 128, medium 256)",
        bound="block_size",
        metavar="T",
    )
    tokenizer: str | None = setting(
        None,
        "train on this Hugging Face tokenizer's ids instead of bytes (a local folder, or a hub name)",
        metavar="PATH",
        target="data.tokenizer",
        parse=given,
    )
    dataset: str | None = setting(
        None,
        "read documents with the datasets library: a save_to_disk folder, data files "
        "(.jsonl/.json/.csv/.parquet/.txt) or a hub name; its records are dealt among the peers' shards",
        metavar="NAME|PATH",
        target="data.dataset",
        parse=given,
    )
    dataset_subset: str | None = setting(
        None,
        "the hub dataset's configuration name",
        metavar="NAME",
        target="data.dataset_subset",
        parse=given,
    )
    dataset_split: str = setting(
        "train",
        "the dataset's split to read (default: train)",
        target="data.dataset_split",
        parse=given,
    )
    streaming: bool | None = setting(
        None,
        "stream the dataset's records instead of downloading and preparing it whole",
        kind="switch",
        negation="off, whatever a --config file or WORKBENCH_* variable says (the default)",
        off_unless_given=True,
        target="data.streaming",
    )
    data: str | None = setting(
        None,
        "text file, .jsonl file (one record per line) or folder to train on (default: the Python "
        "stdlib's source)",
        metavar="PATH",
        target="data.path",
        parse=given,
    )
    text_field: str = setting(
        "text",
        "in a .jsonl data file or a dataset, the field holding each record's text (default: text)",
        target="data.text_field",
        parse=given,
    )
    max_bytes: int = setting(
        16_000_000,
        "read at most this many bytes of text from --data or --dataset (default: 16000000; a "
        "larger corpus is read only up to it)",
        bound="max_bytes",
        metavar="N",
        target="data.max_bytes",
    )
    batch_size: int = setting(
        16, "sequences per inner step (default: 16)", bound="batch_size", target="data.batch_size"
    )


@dataclass(kw_only=True)
class Machine:
    """where a peer trains (beside its model and data; ``simulate`` has its own seed and threads)"""

    device: str = setting(
        "auto",
        "auto, cpu or cuda[:N] (default: auto = CUDA when present)",
        target="peer.device",
        parse=device_name,
    )
    seed: int = setting(0, "model init and data order seed (default: 0)", bound="seed", target="peer.seed")
    shard: str | None = setting(None, "read only shard I of N slices of the data (e.g. 0/4)", metavar="I/N")
    threads: int = setting(
        0, "torch CPU threads (default: torch decides)", bound="threads", target="train.threads"
    )


@dataclass(kw_only=True)
class Schedule:
    """How long a run lasts and how often it evaluates (the rest of the DiLoCo group)."""

    rounds: int = setting(
        0,
        "stop once the run reaches this outer round (the run's count, which a joiner inherits; "
        "default: 0 = never)",
        bound="rounds",
        target="peer.rounds",
    )
    round_seconds: float = setting(
        0.0,
        "time-boxed rounds: each peer trains as many inner steps as fit in T seconds (at least "
        "1, at most --inner-steps), weighted by its samples in the mean (default: 0 = H steps each)",
        bound="round_seconds",
        metavar="T",
        target="peer.round_seconds",
    )
    eval_every: int = setting(
        1,
        "evaluate the global params every ROUNDS rounds, and after the last (default: 1)",
        bound="eval_every",
        metavar="ROUNDS",
        target="peer.eval_every",
    )


VIRTUAL_ROUND_SECONDS = (
    "time-boxed rounds: each peer trains as many inner steps as fit in T virtual seconds at its speed "
    "(at least 1, at most --inner-steps), weighted by its samples in the mean (default: 0 = H steps each)"
)
"""``--round-seconds`` of ``simulate``, on the simulator's virtual clock."""


@dataclass(kw_only=True)
class Averaging:
    """averaging"""

    codec: str = setting(
        "none",
        "pseudo-gradient wire codec (default: none)",
        choices=tuple(sorted(CODEC_BYTES)),
        target="averaging.compression",
    )
    matchmaking_time: float = setting(
        2.0,
        "the longest a round's group stays open; a complete group forms at once, and the "
        "window is learned from the last rounds (default: 2)",
        bound="matchmaking_time",
        target="averaging.matchmaking_time",
    )
    averaging_timeout: float = setting(
        30.0,
        "seconds before a round falls back to a local step (default: 30)",
        bound="averaging_timeout",
        target="averaging.averaging_timeout",
    )
    aggregate: str = setting(
        "mean",
        "mean (default) or trimmed-mean: per coordinate, drop the group's largest and smallest "
        "value before averaging (robust to one bad peer; takes hivemind's data plane)",
        choices=("mean", "trimmed-mean"),
        target="averaging.aggregate",
    )
    data_plane: str = setting(
        "direct",
        "direct (default): a group whose members all accept connections moves its tensors over "
        "its own gloo ring (4-8x hivemind's speed from 10 MB up, 2-4x at 1 MB), and a joiner downloads the state in checked slices "
        "from several donors over TCP; hivemind: always hivemind's all-reduce and state stream "
        "(relayed through NAT, slower)",
        choices=("direct", "hivemind"),
        target="averaging.data_plane",
    )


@dataclass(kw_only=True)
class RunAccess:
    """Which run to trust: shared by peers, ``status``, ``steer`` and the monitor."""

    secret: str | None = setting(
        None,
        "private run: only peers with this secret find, join and write to it "
        "(default: $WORKBENCH_SECRET, else $WORKBENCH_RUN_SECRET)",
        default_env="WORKBENCH_RUN_SECRET",
        target="peer.secret",
    )
    owner: str | None = setting(
        None,
        "trust only the manifest and steering of this owner key (printed by `workbench start`; "
        "default: $WORKBENCH_OWNER)",
        metavar="HASH",
        target="peer.owner",
    )


@dataclass(kw_only=True)
class Network:
    """network"""

    run_id: str = setting("workbench", "the run's name in the DHT (default: workbench)", target="peer.run_id")
    name: str | None = setting(
        None, "this peer's display name (default: peer- and the end of its peer id)", target="peer.name"
    )
    host: str = setting(
        "127.0.0.1",
        "IP to listen on (default: 127.0.0.1; 0.0.0.0 for a real network)",
        target="network.host",
    )
    port: int = setting(
        0, "TCP port to listen on (default: any free port)", bound="port", target="network.port"
    )
    announce: list[str] = setting(
        [],
        "public address others dial, e.g. /ip4/203.0.113.7/tcp/31337 (repeatable)",
        kind="list",
        metavar="MULTIADDR",
        target="network.announce",
    )
    client_mode: bool = setting(
        False,
        "accept no inbound connections (behind NAT)",
        kind="switch",
        negation="off, whatever a --config file or WORKBENCH_* variable says (the default)",
        off_unless_given=True,
        target="network.client_mode",
    )
    identity: str | None = setting(
        None,
        "private key file, for a peer id that survives restarts",
        metavar="FILE",
        target="network.identity_path",
        parse=given,
    )
    connect_timeout: float = setting(
        20.0,
        "seconds to reach the bootstrap peers (default 20; tried again until then, so a join may "
        "start before its peer is up), and then for a joiner to find a live peer of its run (3 to 10 s of it)",
        bound="connect_timeout",
        target="network.connect_timeout",
    )


@dataclass(kw_only=True)
class Outputs:
    """Where a peer waits, writes and resumes (the rest of the network group)."""

    min_peers: int = setting(
        1,
        "wait (at most 120 s) for this many peers before the first round (default: 1)",
        bound="min_peers",
        target="peer.min_peers",
    )
    run_dir: str | None = setting(
        None, "write metrics.jsonl and the final global params here", metavar="DIR", parse=given
    )
    checkpoint_every: int = setting(
        0,
        "write <run-dir>/checkpoint.pt every ROUNDS outer rounds (default 0: on request only)",
        bound="checkpoint_every",
        metavar="ROUNDS",
        target="peer.checkpoint_every",
    )
    resume: str | None = setting(
        None,
        "continue from the checkpoint in DIR (a stopped peer's --run-dir; also the default --run-dir)",
        metavar="DIR",
        target="peer.resume",
        parse=given,
    )
    tensorboard: str | None = setting(
        None,
        "also write the metrics as TensorBoard scalars to DIR (default: <run-dir>/tensorboard)",
        metavar="DIR",
        bare="",
        target="peer.tensorboard",
    )
    wandb: str | None = setting(
        None,
        "also log the metrics to this W&B project (offline unless --wandb-mode)",
        metavar="PROJECT",
        target="peer.wandb_project",
        parse=given,
    )
    wandb_mode: str = setting(
        "offline",
        "offline (default: written under <run-dir>/wandb, or ./wandb without --run-dir; upload later with "
        "`wandb sync`), online",
        choices=WANDB_MODES,
        target="peer.wandb_mode",
    )
    fault_file: str | None = setting(
        None,
        "testing: read injected faults (throttle, corrupt update) from FILE between steps",
        metavar="FILE",
        target="peer.fault_file",
        parse=given,
    )


@dataclass(kw_only=True)
class Demo:
    """The demo's own settings: N local peers and how to show them."""

    peers: int = setting(4, "number of peers (default: 4)", bound="peers")
    headless: bool = setting(
        False,
        "show progress lines instead of a UI (automatic without a terminal)",
        kind="switch",
        negation="a UI even where a config file or WORKBENCH_HEADLESS asks for progress lines",
        off_unless_given=True,
    )
    no_tui: bool = setting(
        False,
        "a simple live table instead of the swarm monitor app",
        kind="switch",
        negation="the swarm monitor app even where a config file or WORKBENCH_NO_TUI asks for the table",
        off_unless_given=True,
        off_flag="--tui",
    )
    json: bool = setting(False, "print one JSON result object on stdout at the end", kind="switch")
    run_dir: str | None = setting(
        None,
        "keep each peer's metrics and logs here (default: a temp dir; a reused one starts clean)",
        metavar="DIR",
        parse=given,
    )
    timeout: float = setting(
        900.0,
        "give up after this many seconds (default: 900); in the terminal UI, on the peers' start only",
        bound="timeout",
    )


DEMO_DEFAULTS = {"inner_steps": 20, "rounds": 8, "threads": 1, "model": "small"}
"""Where the demo's defaults differ from a peer's: short rounds, one torch thread per peer."""
