"""`workbench demo`: N real peers as separate processes on 127.0.0.1, watched until done.

Each peer is the public CLI (`workbench start` for the first, `workbench join ADDR` for the
rest), so what the demo runs is exactly what a user would type; the commands are written to
``<run_dir>/commands.txt``. Peers report through ``<run_dir>/<peer>/metrics.jsonl``; their
logs go to ``<run_dir>/<peer>/peer.log``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from swarm.errors import SwarmError
from swarm.faults import FaultPlan
from workbench.cli.argv import method_arguments, model_flags, optimizer_arguments, setting_arguments
from workbench.config import RunConfig
from workbench.local.demo_table import DemoTable, describe
from workbench.run.checkpoint import NAME as CHECKPOINT
from workbench.run.checkpoint import PREVIOUS as PREVIOUS_CHECKPOINT
from workbench.run.checkpoint import make_folder, run_dir_holder
from workbench.run.stopping import LAUNCHER_PID, not_interrupted, stopped_by_signals

logger = logging.getLogger(__name__)


class LaunchError(SwarmError):
    """A local peer failed to start or died; the message carries its last log lines."""


class DemoFailed(LaunchError):
    """The demo started but did not finish: a peer failed, or time ran out (exit status 1, not a
    mistake's 2: a script can tell them apart)."""


@dataclass
class LocalPeer:
    """One peer process of the demo and what it has reported so far."""

    name: str
    directory: Path
    process: subprocess.Popen
    events: list[dict[str, Any]] = field(default_factory=list)
    _thaw_timer: threading.Timer | None = field(default=None, repr=False)
    _offset: int = 0

    @property
    def metrics(self) -> Path:
        return self.directory / "metrics.jsonl"

    def poll_events(self) -> list[dict[str, Any]]:
        """New complete lines of metrics.jsonl since the last call."""
        if not self.metrics.exists():
            return []
        with open(self.metrics, "rb") as file:
            file.seek(self._offset)
            chunk = file.read()
        end = chunk.rfind(b"\n") + 1
        self._offset += end
        new = []
        for line in chunk[:end].splitlines():
            if not line.strip():
                continue
            try:
                new.append(json.loads(line))
            except json.JSONDecodeError:  # cut short by a kill; its restart ended the line
                logger.debug("%s: an event line cut short: %r", self.name, line[:80])
        self.events.extend(new)
        return new

    def last(self, event: str) -> dict[str, Any] | None:
        return next((e for e in reversed(self.events) if e["event"] == event), None)

    def kill(self) -> None:
        """SIGKILL the peer (no goodbye): the others must notice by its heartbeat expiring."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def freeze(self, seconds: float) -> None:
        """SIGSTOP the peer now and SIGCONT it ``seconds`` later: a straggler. Frozen again, it
        thaws ``seconds`` after the last freeze (the first one's timer thawed it early)."""
        if not 0 < seconds <= 3600:  # written so that NaN fails too
            raise LaunchError(f"a freeze lasts more than 0 and at most 3600 s (got {seconds})")
        os.killpg(self.process.pid, signal.SIGSTOP)
        if self._thaw_timer is not None:
            self._thaw_timer.cancel()
        self._thaw_timer = timer = threading.Timer(seconds, self._thaw)
        timer.daemon = True
        timer.start()

    def _thaw(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGCONT)

    @property
    def fault_file(self) -> Path:
        return self.directory / "faults.json"

    def write_faults(self, **faults: float) -> None:
        """Merge ``faults`` (swarm.faults.FaultPlan's fields) into the file the peer reads
        between inner steps (``--fault-file``)."""
        FaultPlan.update(self.fault_file, **faults)

    def log_tail(self, lines: int = 8) -> str:
        return "\n".join(f"    {line}" for line in self._log_lines()[-lines:])

    def log_end(self, lines: int = 3) -> str:
        """Where its log is and its last lines, on one line (a LaunchError is one line: the
        newlines of a multi-line one were printed as ``\\n``)."""
        end = " | ".join(line.strip() for line in self._log_lines()[-lines:] if line.strip())
        return f"the end of its log ({self.directory / 'peer.log'}): {end or '(empty)'}"

    def _log_lines(self) -> list[str]:
        log = self.directory / "peer.log"
        return log.read_text(errors="replace").strip().splitlines() if log.exists() else []


PEER_SETTINGS = (
    "batch_size",
    "device",
    "seed",
    "threads",
    "inner_steps",
    "inner_lr",
    "grad_clip",
    "weight_decay",
    "beta1",
    "beta2",
    "warmup_steps",
    "rounds",
    "round_seconds",
    "eval_every",
    "codec",
    "matchmaking_time",
    "averaging_timeout",
    "data_plane",
    "aggregate",
    "run_id",
    "min_peers",
    "data",
    "dataset",
    "dataset_split",
    "dataset_subset",
    "streaming",
    "text_field",
    "max_bytes",
    "tokenizer",
)
"""The settings a demo peer gets as they are (the model, the optimizer's, the shard and the
per-peer folders are written below)."""


STALE = ("metrics.jsonl", "global_params.pt", "faults.json", CHECKPOINT, PREVIOUS_CHECKPOINT)
"""What a peer of an earlier demo in the same --run-dir left that this one must not take for its own."""

MAX_LOCAL_PEERS = 64
"""Peers one machine's launcher starts (each is a process with its DHT and p2p daemon)."""


def peer_arguments(config: RunConfig, *, name: str, run_dir: Path) -> list[str]:
    """CLI flags that rebuild ``config`` for one local peer."""
    try:
        model = model_flags(config)
    except ValueError:
        raise LaunchError(
            "the demo launches model presets or Hugging Face folders only; pick one with --model"
        ) from None
    args = [
        *model,
        *setting_arguments(config, PEER_SETTINGS),
        *optimizer_arguments(config),
        *method_arguments(config),
        *[
            "--name",
            name,
            "--run-dir",
            str(run_dir / name),
            "--fault-file",
            str(run_dir / name / "faults.json"),
        ],
    ]
    if config.peer.shard is not None:
        args += ["--shard", f"{config.peer.shard}/{config.peer.num_shards}"]
    if config.peer.tensorboard is not None:  # one folder per peer
        args += [
            "--tensorboard",
            str(Path(config.peer.tensorboard) / name) if config.peer.tensorboard else "",
        ]
    if config.peer.wandb_project:
        args += ["--wandb", config.peer.wandb_project, "--wandb-mode", config.peer.wandb_mode]
    return args


class LocalSwarm:
    """Starts, watches and stops N local peers."""

    def __init__(self, config: RunConfig, *, peers: int, run_dir: Path) -> None:
        if not 1 <= peers <= MAX_LOCAL_PEERS:
            raise LaunchError(f"--peers must be within 1..{MAX_LOCAL_PEERS} on one machine (got {peers})")
        self.config = config
        self.count = peers
        self.run_dir = run_dir
        self.peers: list[LocalPeer] = []

    def _spawn(
        self,
        command: str,
        name: str,
        extra: list[str],
        *,
        again: bool = False,
        env: dict[str, str] | None = None,
        last: Sequence[str] = (),
    ) -> LocalPeer:
        """Start one peer in ``run_dir/name``; ``again``: a restart, which keeps its log of events
        (and its identity key and checkpoints, as every start does); ``env``: more variables
        (a secret, which must not be on a command line); ``last``: flags after the demo's own
        (they win)."""
        directory = self.run_dir / name
        directory.mkdir(parents=True, exist_ok=True)
        # A reused --run-dir starts clean (its checkpoints too: a peer refuses a --run-dir holding
        # one without --resume); a restarted peer keeps its events and loses its faults.
        for leftover in ("faults.json",) if again else STALE:
            (directory / leftover).unlink(missing_ok=True)
        argv = [
            sys.executable,
            "-m",
            "workbench",
            command,
            *extra,
            *peer_arguments(self.config, name=name, run_dir=self.run_dir),
            *last,
        ]
        with open(self.run_dir / "commands.txt", "a") as file:  # pasted into a shell: quoted
            file.write(shlex.join(["workbench", *argv[3:]]) + "\n")
        log = open(directory / "peer.log", "ab" if again else "wb")  # noqa: SIM115 - the child owns it
        # A new session: Ctrl+C in the demo's terminal reaches the launcher only, which then
        # stops each peer itself (in order, with a deadline).
        process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            # It stops by itself if this process is gone without stopping it (killed, a notebook
            # kernel restarted): workbench.run.stopping.stop_with_launcher.
            env={**_inherited(), **(env or {}), "PYTHONUNBUFFERED": "1", LAUNCHER_PID: str(os.getpid())},
        )
        log.close()
        peer = LocalPeer(name=name, directory=directory, process=process)
        if not again:
            self.peers.append(peer)
        return peer

    def restart(self, name: str) -> LocalPeer:
        """Start a stopped peer again in its own directory: its identity key (the same peer id),
        its last checkpoint if it wrote one (``--resume``), and its shard. It joins through a
        running peer, downloads the swarm's state and trains to the run's end."""
        index = next((i for i, p in enumerate(self.peers) if p.name == name), None)
        if index is None:
            raise LaunchError(f"no peer named {name} was launched here")
        old = self.peers[index]
        if old.process.poll() is None:
            raise LaunchError(f"{name} is still running")
        live = [p for p in self.peers if p.process.poll() is None and p.last("started")]
        if not live:
            raise LaunchError("no running peer to join through: every peer of this demo has stopped")
        extra = [live[0].last("started")["addresses"][0], "--shard", f"{index}/{self.count}"]
        if (old.directory / CHECKPOINT).exists() or (old.directory / PREVIOUS_CHECKPOINT).exists():
            extra += ["--resume", str(old.directory)]
        old.poll_events()
        # Not the demo's --min-peers (all of its peers): the run is under way, and a peer
        # restarted beside one still stopped waited for it 120 s in "joining" (a review, stop 59).
        peer = self._spawn("join", name, extra, again=True, last=["--min-peers", "1"])
        peer.events, peer._offset = old.events, old._offset
        self.peers[index] = peer
        return peer

    def start(self, timeout: float = 120.0) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Before anything of a reused --run-dir is removed: a demo still running there lost its
        # metrics, checkpoints and log to the second one, which then failed on the peers' locks.
        for folder in sorted(self.run_dir.glob("peer-*")):
            holder = run_dir_holder(folder)
            if holder is not None:
                raise LaunchError(
                    f"--run-dir {self.run_dir} is in use: {folder.name} is running there (pid {holder}); "
                    "stop that demo first or give this one another --run-dir"
                )
        (self.run_dir / "commands.txt").write_text("")
        # A reused --run-dir of a bigger demo: its other peers' events would be exported (and
        # replayed) with this run's.
        for folder in self.run_dir.glob("peer-*"):
            index = folder.name.removeprefix("peer-")
            if folder.is_dir() and index.isdigit() and int(index) >= self.count:
                for leftover in STALE:
                    (folder / leftover).unlink(missing_ok=True)
        # Each peer reads its own slice of the data, as the simulator's virtual peers do.
        first = self._spawn("start", "peer-0", ["--shard", f"0/{self.count}"])
        deadline = time.monotonic() + timeout
        while (started := first.last("started")) is None:
            first.poll_events()
            self.check_alive()
            if time.monotonic() > deadline:
                raise DemoFailed(f"peer-0 did not start within {timeout:.0f} s; {first.log_end()}")
            time.sleep(0.2)
        address = started["addresses"][0]
        for index in range(1, self.count):
            self._spawn("join", f"peer-{index}", [address, "--shard", f"{index}/{self.count}"])

    def failures(self, told: set[int]) -> list[str]:
        """A line for each peer process that failed on its own (an error's exit status; a fault's
        kill is a signal) and is not in ``told`` yet (its pid: a restarted peer keeps its name),
        which it is added to."""
        lines = []
        for peer in self.peers:
            code = peer.process.poll()
            if code is not None and code > 0 and not peer.last("done") and peer.process.pid not in told:
                told.add(peer.process.pid)
                lines.append(f"{peer.name} exited with status {code}: {peer.log_end()}")
        return lines

    def check_alive(self) -> None:
        for peer in self.peers:
            code = peer.process.poll()
            if code is not None and (code != 0 or not peer.last("done")):
                peer.poll_events()
                if code == 0 and peer.last("done"):
                    continue
                raise DemoFailed(f"{peer.name} exited with status {code} before finishing; {peer.log_end()}")

    def poll(self) -> list[dict[str, Any]]:
        return list(itertools.chain.from_iterable(peer.poll_events() for peer in self.peers))

    def finished(self) -> bool:
        return len(self.peers) == self.count and all(
            p.process.poll() == 0 and p.last("done") for p in self.peers
        )

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, grace: float = 8.0) -> None:
        """SIGINT every peer (they announce leaving and shut down), then SIGKILL stragglers;
        a second Ctrl+C or a closing terminal meanwhile waits until they are stopped."""
        with not_interrupted():
            self._stop(grace)

    def _stop(self, grace: float) -> None:
        for peer in self.peers:
            if peer.process.poll() is None:
                peer.process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + grace
        for peer in self.peers:
            try:
                peer.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                    os.killpg(peer.process.pid, signal.SIGKILL)
                peer.process.wait()

    def initial_loss(self) -> float:
        """The run's initial eval loss: the highest a peer evaluated before training (a restarted
        peer evaluates again at the state it downloaded, lower: its `done` event names that one)."""
        return max(e["eval_loss"] for p in self.peers for e in p.events if e["event"] == "initial_eval")

    def result(self, seconds: float) -> dict[str, Any]:
        """The demo's JSON contract, from what every peer reported."""
        done = [peer.last("done") for peer in self.peers]
        params = [torch.load(p.directory / "global_params.pt") for p in self.peers]
        diff = 0.0
        for a, b in itertools.combinations(params, 2):
            diff = max(diff, max(float((x - y).abs().max()) for x, y in zip(a, b)))
        # An overlapped run's first sync reports nothing averaged yet: neither a round alone nor
        # a group of one in the mean (3.625 for 4 peers that averaged every round together).
        averaged = [e for p in self.peers for e in p.events if e["event"] == "round" and not e.get("pending")]
        return {
            "peers": self.count,
            "outer_rounds": min(d["outer_rounds"] for d in done),
            "initial_loss": self.initial_loss(),
            "final_loss": sum(d["final_eval_loss"] for d in done) / len(done),
            "params_max_abs_diff": diff,
            # Every round's bytes, a killed and restarted peer's first process's too (its `done`
            # counts only the process that wrote it, unless it resumed a checkpoint).
            "bytes_sent": sum(
                e["bytes_sent"] for p in self.peers for e in p.events if e["event"] in ("round", "final_sync")
            ),
            "seconds": round(seconds, 2),
            "rounds_alone": sum(1 for e in averaged if e["group_size"] <= 1),
            "mean_group_size": sum(e["group_size"] for e in averaged) / max(1, len(averaged)),
            "run_dir": str(self.run_dir),
        }


def run_demo(config: RunConfig, *, peers: int, run_dir: Path, timeout: float, show) -> dict[str, Any]:
    """Run the demo to the end; ``show(event)`` is called for every peer event."""
    swarm = LocalSwarm(config, peers=peers, run_dir=run_dir)
    started = time.monotonic()
    # `timeout`, service managers (SIGTERM) and a closed terminal (SIGHUP) stop the peers too.
    with stopped_by_signals(), swarm:
        swarm.start(timeout)  # peer-0's start-up too (a big model or a dataset read on a CPU)
        for event in (e for p in swarm.peers for e in p.events):
            show(event)
        while not swarm.finished():
            for event in swarm.poll():
                show(event)
            swarm.check_alive()
            if time.monotonic() - started > timeout:
                raise DemoFailed(f"the demo did not finish within {timeout:.0f} s (see {run_dir})")
            time.sleep(0.25)
        for event in swarm.poll():
            show(event)
        return swarm.result(time.monotonic() - started)


def run_demo_tui(config: RunConfig, *, peers: int, run_dir: Path, console, timeout: float = 900.0) -> int:
    """`workbench demo` in a terminal: the swarm monitor over the local peers, with steering
    (peer-0's key is the run's owner key) and fault injection. Quitting the app stops the peers."""
    from tui.app import SwarmApp, run_until_stopped
    from workbench.sources import DemoSource

    swarm = LocalSwarm(config, peers=peers, run_dir=run_dir)
    source = None
    with stopped_by_signals(), swarm:
        swarm.start(timeout)
        source = DemoSource.of(swarm)
        app = SwarmApp(source, freeze_startup=True)  # the demo's own process, as `workbench monitor`'s
        stop = threading.Event()

        def supervise() -> None:
            """Collect the peers' events; tell the user when a peer fails on its own and when
            every peer has exited. (A joiner that failed before its first heartbeat never showed
            in the monitor, and the others waited for it in "joining", unsaid: a review, stop 59.)"""
            told: set[int] = set()
            while not stop.wait(0.5):
                swarm.poll()
                for line in swarm.failures(told):
                    app.call_from_thread(app.notify, line, severity="error", timeout=30)
                if all(peer.process.poll() is not None for peer in swarm.peers):
                    done = sum(1 for peer in swarm.peers if peer.last("done"))
                    app.call_from_thread(
                        app.notify,
                        f"all peers exited ({done} finished their rounds): press q to quit",
                        timeout=30,
                    )
                    return

        watcher = threading.Thread(target=supervise, daemon=True)
        watcher.start()
        try:
            run_until_stopped(app)
        finally:
            stop.set()
            if source is not None:
                source.close()
        # Peers that failed on their own (an error's exit status; a fault's kill is a signal),
        # before quitting stopped the others.
        failed = [p for p in swarm.peers if (p.process.poll() or 0) > 0 and not p.last("done")]
    swarm.poll()
    finals = [peer.last("done") for peer in swarm.peers if peer.last("done")]
    if finals:
        final = sum(d["final_eval_loss"] for d in finals) / len(finals)
        console.print(
            f"[bold]done[/]: {len(finals)} of {peers} peers finished, eval loss "
            f"{swarm.initial_loss():.3f} -> {final:.3f}; logs in {run_dir}",
            soft_wrap=True,
        )
    else:
        console.print(f"stopped; logs in {run_dir}", soft_wrap=True)
    if failed and not finals:
        from rich.markup import escape

        console.print(
            f"[red]{len(failed)} of {peers} peers failed[/]: {failed[0].name}: {escape(failed[0].log_end())}",
            soft_wrap=True,
            highlight=False,
        )
        return 1
    return 0


AGREE = 1e-4
"""The largest difference between two peers' final θ that the demo calls agreement (peers that
agree differ by float rounding: 3e-08 in the README's run)."""


def run_demo_command(config: RunConfig, args: argparse.Namespace) -> int:
    """`workbench demo`: progress on stderr, the JSON result on stdout with --json."""
    from dataclasses import replace

    from rich.console import Console

    if config.peer.rounds < 1:
        raise LaunchError("the demo needs --rounds >= 1")
    if config.peer.shard is not None:
        raise LaunchError("the demo gives each peer its own shard (I/N for peer I); drop --shard")
    if not 1 <= args.peers <= MAX_LOCAL_PEERS:
        raise LaunchError(f"--peers must be within 1..{MAX_LOCAL_PEERS} on one machine (got {args.peers})")
    from workbench.run.model import pick_device

    pick_device(config.peer.device)  # --device cuda without a GPU: said once, before 4 peers say it
    # A bad --data or --dataset (missing, empty, too small for the model's context), said once
    # as what it is, exit 2: each peer failed on it, and the demo reported "peer-0 exited with
    # status 2 before finishing", exit 1 (a review, stop 71). Peer 0's shard, as each peer gets one.
    from workbench.run.training import load_data

    load_data(replace(config, peer=replace(config.peer, shard=0, num_shards=args.peers)))
    run_dir = make_folder(args.run_dir or tempfile.mkdtemp(prefix="workbench-demo-"))
    config = replace(
        config, peer=replace(config.peer, run_id=f"demo-{uuid.uuid4().hex[:8]}", min_peers=args.peers)
    )
    console = Console(stderr=True)
    headless = args.headless or not (sys.stdout.isatty() and sys.stderr.isatty())
    console.print(
        f"[bold]workbench demo[/]: {args.peers} peer{'s' if args.peers != 1 else ''} on 127.0.0.1, "
        f"{config.peer.rounds} round{'s' if config.peer.rounds != 1 else ''} of "
        f"H={config.diloco.inner_steps} inner steps, model {args.model}; logs in {run_dir}",
        soft_wrap=True,
    )
    if headless:
        syncs = config.outer_method.syncs_per_round(config.fragments)

        def show(event: dict[str, Any]) -> None:
            line = describe(event, syncs)
            if line:
                console.print(line, highlight=False, soft_wrap=True)

        result = run_demo(config, peers=args.peers, run_dir=run_dir, timeout=args.timeout, show=show)
    elif args.no_tui or args.json:
        from rich.live import Live

        table = DemoTable(
            peers=args.peers,
            rounds=config.peer.rounds,
            syncs_per_round=config.outer_method.syncs_per_round(config.fragments),
        )
        with Live(table.render(), console=console, refresh_per_second=4) as live:

            def show(event: dict[str, Any]) -> None:
                table.update(event)
                live.update(table.render())

            result = run_demo(config, peers=args.peers, run_dir=run_dir, timeout=args.timeout, show=show)
    else:
        return run_demo_tui(config, peers=args.peers, run_dir=run_dir, console=console, timeout=args.timeout)
    diff = result["params_max_abs_diff"]
    # Peers that ended on different θ (one thawed after the others finished, trained alone):
    # "params agree to 3.3e-01" read as success; the final loss is then a mean of two models.
    agreement = (
        f"params agree to {diff:.1e}"
        if diff <= AGREE
        else f"[bold yellow]params differ by {diff:.1e}[/] ({result['rounds_alone']} rounds alone: the "
        "peers ended on different θ; see each peer's log)"
    )
    console.print(
        f"[bold]done[/] in {result['seconds']:.0f} s: eval loss {result['initial_loss']:.3f} -> "
        f"{result['final_loss']:.3f}, {agreement}, {result['bytes_sent'] / 1e6:.1f} MB sent in all",
        soft_wrap=True,
    )
    if args.json:
        print(json.dumps(result), flush=True)
    return 0


def _inherited() -> dict[str, str]:
    """This process's environment less the ``WORKBENCH_*`` settings: a peer gets its settings as
    flags (:func:`peer_arguments`), and a variable the demo itself leaves out reached every peer
    (``WORKBENCH_PORT``: all on one port; ``WORKBENCH_IDENTITY``: one key, one peer id;
    ``WORKBENCH_BLOCK_SIZE`` over the demo's ``--block-size``; a run secret the demo's view did not
    hold)."""
    return {key: value for key, value in os.environ.items() if not key.startswith("WORKBENCH_")}
