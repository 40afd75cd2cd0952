"""The flags of the peer commands (``start``, ``join``, ``demo``) and the :class:`RunConfig`
they build; shared by the CLI, ``config``, ``status``/``steer``, the demo launcher and
``Experiment``. Torch-free at import, so ``workbench --help`` stays fast."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from optim.api import method
from workbench.cli.optimizer_flags import outer_config
from workbench.names import MODEL_PRESETS
from workbench.settings import add_section
from workbench.settings.commands import PEER_COMMANDS, command_settings
from workbench.settings.run import RunAccess

if TYPE_CHECKING:  # torch-backed modules load only when a command runs
    from workbench.config import RunConfig


EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


def add_run_access_options(group) -> None:
    """--secret and --owner: which run to trust (shared by peers, status, steer, monitor)."""
    add_section(group, RunAccess)


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistake reported in one line (the usage block buries it) and exit 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[command]


def apply_settings(
    parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str]
) -> dict[str, str]:
    """Layer the --config file and WORKBENCH_* variables under the flags of a peer command or
    ``simulate`` (see workbench.cli.configfile); returns where each setting came from."""
    from workbench.cli.configfile import layer, settings_of

    command = args.command
    rest = list(argv)[list(argv).index(command) + 1 :]
    known = {key for name in (*PEER_COMMANDS, "simulate") for key in settings_of(subparser(parser, name))}
    return layer(args, subparser(parser, command), rest, known_elsewhere=known)


_DASH_VALUE = re.compile(r"-(\d|\.\d|inf|nan)", re.IGNORECASE)


def attach_dash_values(argv: Sequence[str]) -> list[str]:
    """``--shard -1/4`` as ``--shard=-1/4``, ``--inner-lr -1e-3`` as ``--inner-lr=-1e-3``:
    argparse takes a value that starts with '-' (other than a plain negative number such as
    ``-1``) for a flag and says "expected one argument", which hides the real mistake;
    attached, the value reaches its own check ("must be in (0, 1)"). Only after a ``--flag``
    without a value of its own, and not past ``--``."""
    out: list[str] = []
    items = iter(argv)
    for item in items:
        if item == "--":
            out += [item, *items]
            break
        flag = item.startswith("--") and len(item) > 2 and "=" not in item
        following = next(items, None) if flag else None
        if following is None:
            out.append(item)
        elif _DASH_VALUE.match(following):
            out.append(f"{item}={following}")
        else:
            out += [item, following]
    return out


def parse_shard(text: str | None) -> tuple[int | None, int]:
    """``--shard I/N`` as (I, N); (None, 1) when not given."""
    if text is None:
        return None, 1
    index, _, count = text.partition("/")
    try:
        shard = int(index), int(count)
    except ValueError:
        raise ValueError(f"--shard '{text}' must look like I/N, e.g. 0/4 for the first of 4 shards") from None
    if not 1 <= shard[1] <= MAX_SHARDS:
        # Not after the peer started: a shard of 10^20 was refused as "0 bytes" once the join
        # command was printed.
        raise ValueError(f"--shard '{text}': N, the number of shards, must be in 1..{MAX_SHARDS} (e.g. 0/4)")
    return shard


MAX_SHARDS = 1 << 20
"""The most shards ``--shard I/N`` may cut the data into."""


def _model_shape(args: argparse.Namespace):
    from workbench.run.model import preset

    shape = preset(args.model if args.model in MODEL_PRESETS else "small")
    return replace(shape, block_size=args.block_size) if args.block_size else shape


ALL_COMMANDS = (*PEER_COMMANDS, "simulate", "demo")


def build_config(args: argparse.Namespace, *, simulated: bool = False) -> RunConfig:
    """The config tree from parsed flags (or :func:`workbench.settings.commands.values_of`);
    raises ValueError/SwarmError on a bad value (``simulated``: for the simulator, which needs
    fewer of them: :attr:`workbench.config.RunConfig.simulated`). Each setting with a ``target`` is copied to its
    place (None: the component's default); the rest take more than a copy, below."""
    from swarm.averaging_config import AveragingConfig
    from swarm.dht import NetworkConfig
    from swarm.errors import SwarmError

    parts: dict[str, dict[str, Any]] = {"data": {}, "train": {}, "averaging": {}, "network": {}, "peer": {}}
    for key, item in command_settings(args.command if args.command in ALL_COMMANDS else "start").items():
        if item.kind == "switch" and item.off_unless_given and getattr(args, key, None) is False:
            # --no-overlap undoes a file's overlap = true: off, as not given (an explicit off was
            # refused where the switch has no use, with --method dp)
            setattr(args, key, None)
    for key, item in command_settings("demo" if args.command == "demo" else "start").items():
        value = getattr(args, key, None)
        part, _, name = (item.target or "").partition(".")
        if value is not None and part in parts:
            parts[part][name] = value
    if args.command == "join":
        parts["network"]["initial_peers"] = list(args.peers)
    shard, shards = parse_shard(getattr(args, "shard", None))
    # Checked before torch is imported: a bad address or --host is told in 0.2 s, not 2-3 s (and
    # not 15 s on a loaded machine).
    network, averaging = NetworkConfig(**parts["network"]), AveragingConfig(**parts["averaging"])
    if args.command == "start" and network.client_mode:
        raise SwarmError(
            "--client-mode: the first peer of a run must accept connections, or nobody can join "
            "it (its join command would not connect); start the run on a machine others can reach "
            "(--host 0.0.0.0 --announce /ip4/PUBLIC_IP/tcp/PORT), and use --client-mode to join"
        )
    from optim.streaming import default_fragments
    from workbench.config import PeerConfig, RunConfig, TrainConfig
    from workbench.run.data import DataConfig

    diloco = outer_config(args)
    return RunConfig(
        simulated=simulated,
        method=method(args.method).real_peers,
        preset=args.method
        if method(args.method).real_peers == "diloco" and args.method != "diloco"
        else None,
        fragments=args.fragments or default_fragments(diloco.inner_steps),
        sync_delay=getattr(args, "sync_delay", None) or 0,
        alpha=getattr(args, "alpha", None),
        model=_model_shape(args),
        hf_model=None if args.model in MODEL_PRESETS else args.model,
        data=DataConfig(**parts["data"]),
        train=TrainConfig(**parts["train"]),
        diloco=diloco,
        averaging=averaging,
        network=network,
        peer=PeerConfig(
            **parts["peer"],
            shard=shard,
            num_shards=shards,
            run_dir=getattr(args, "run_dir", None) or getattr(args, "resume", None),
        ),
    )


def _where_from(message: str, sources: dict[str, str]) -> str:
    """' (inner_lr from file run.toml)' when the bad value named in ``message`` was not a flag:
    named by its key, in words or by its flag (a rule between settings names the flags: "drop
    --error-feedback" for a file's `error_feedback = true`, "--client-mode: the first peer ..."
    for `WORKBENCH_CLIENT_MODE=1`, with no word of where they came from)."""
    import re

    text = message.lower()
    flags = {
        item.key: item.flag for command in ("start", "demo") for item in command_settings(command).values()
    }

    def named_in(key: str) -> bool:
        flag = flags.get(key) or "--" + key.replace("_", "-")
        if re.search(rf"{re.escape(flag)}(?![\w-])", text):
            return True
        if "_" in key:  # "inner lr", "inner_lr": a phrase no message uses for anything else
            return key.replace("_", " ") in text or key in text
        # A one-word key as the subject of a rule ("rounds must be ..."), not any use of the word:
        # "the port is forwarded" blamed a WORKBENCH_PORT for --client-mode's rule (a review).
        return re.search(rf"(?<![\w-]){key} (must|=|is not|should)", text) is not None or text.startswith(key)

    named = [
        f"{key} from {source}"
        for key, source in sources.items()
        if source not in ("flag", "default") and named_in(key)
    ]
    return f" ({'; '.join(named)})" if named else ""
