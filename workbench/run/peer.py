"""One peer of a run: the DiLoCo training loop over a real hivemind swarm.

Life of a peer (each stage is published in its heartbeat, see ``swarm.records.Stage``):

    joining      connect to the DHT; a joiner checks the run exists
    downloading  a joiner fetches θ, outer momentum and outer step from the most advanced peer
    joining      wait (bounded) until ``min_peers`` peers are present
    training     H inner AdamW steps on this peer's own shard of the data
    waiting      the round barrier: wait for the others of this round to finish theirs
    averaging    all-reduce of pseudo-gradients, outer Nesterov step, θ copied into the model
    leaving      Ctrl+C or the last round: say so in the DHT, shut down averager then DHT

Everything it does also goes to ``<run_dir>/metrics.jsonl`` (one JSON object per line) and,
at the end, the global params to ``<run_dir>/global_params.pt``; the demo launcher reads them.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from optim.averager import LocalAverager
from optim.data_parallel import DataParallel
from optim.diloco import DiLoCo
from optim.streaming import StreamingConfig, StreamingDiLoCo, StreamingRounds, split_fragments
from swarm.dht import NetworkConfig, visible_addresses
from swarm.errors import SwarmError
from swarm.faults import FaultReader
from swarm.manifest import model_fingerprint
from swarm.records import PeerHeartbeat, RunKeys, RunManifest, Stage
from swarm.session import connect
from workbench.config import RunConfig
from workbench.run.data import evaluate
from workbench.run.node import CHECK, STEP, SYNC, NodeGroup
from workbench.run.progress_bar import progress
from workbench.run.stopping import stopped_by_signals
from workbench.run.training import build_training, train_step

logger = logging.getLogger(__name__)

PUBLISH_FAILURES = 20  # heartbeats (one a second or so) that failed in a row before a peer stops


class Peer:
    """Builds the model, data and swarm connection for ``config`` and trains until done."""

    def __init__(self, config: RunConfig, *, on_started: Callable[[list[str]], None] | None = None) -> None:
        self.config = config
        self.on_started = on_started
        self.stage = Stage.JOINING
        self.dht = None
        self.session = None
        self.averager = None
        self.board = None
        self.peer_id = ""
        self.name = config.peer.name or "peer"
        self.last_loss: float | None = None
        self.samples_per_second = 0.0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.last_round_seconds: float | None = None
        self.group_size = 0
        self.dp_bytes = 0
        self.last_error: str | None = None
        self.faults = FaultReader(config.peer.fault_file)
        self.throttle = 0.0
        self.control_version = 0
        """The owner's ControlState version whose settings this peer applied."""
        self.checkpoints = 0
        self.addresses: list[str] = []
        self.manifest = None
        self.control = None
        self.metrics_file = None
        self.exporters: list = []  # TensorBoard, W&B: fed every event, as metrics.jsonl is
        self.node: NodeGroup | None = None  # a torchrun node: this is rank 0, driving the others
        self.node_max_diff = 0.0  # the largest θ_local difference between the node's ranks seen
        self.batches = None
        run_dir = config.peer.run_dir
        self.run_dir = Path(run_dir) if run_dir else None

    # --- setup ------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg = self.config
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        training = build_training(cfg)
        self.device, self.corpus, self.eval_set = training.device, training.corpus, training.eval_set
        self.model, self.inner_optimizer = training.model, training.inner_optimizer
        self.node = NodeGroup.from_env()  # None outside torchrun
        if self.node is not None and cfg.method != "diloco":
            raise ValueError(f"a torchrun node peer runs --method diloco (got {cfg.method})")
        self.keys = RunKeys(cfg.peer.run_id, cfg.peer.secret)
        network = cfg.network
        if not network.identity_path and self.run_dir:
            # The peer's key lives with its run directory: same peer id after a restart.
            network = NetworkConfig(
                **{**network.__dict__, "identity_path": str(self.run_dir / "identity.key")}
            )
        if self.run_dir:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.session = connect(network, self.keys)
        self.dht, self.board, self.store = self.session.dht, self.session.board, self.session.store
        self.peer_id = self.session.peer_id
        self.name = cfg.peer.name or f"peer-{self.peer_id[-6:]}"
        if self.run_dir:
            self.metrics_file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        if cfg.peer.tensorboard is not None or cfg.peer.wandb_project:
            from workbench.run.exporters import make_exporters

            tensorboard = cfg.peer.tensorboard
            self.exporters = make_exporters(
                tensorboard=str(self.run_dir / "tensorboard") if tensorboard == "" else tensorboard,
                wandb_project=cfg.peer.wandb_project,
                wandb_mode=cfg.peer.wandb_mode,
                wandb_dir=self.run_dir or Path("."),
                name=self.name,
                config=dict(method=cfg.method, outer=dataclasses.asdict(cfg.diloco), peer_id=self.peer_id),
            )

        from swarm.averaging import SwarmAverager

        if cfg.network.initial_peers:
            self._check_run_exists()
        self._check_manifest()
        if cfg.method == "streaming":
            self._setup_streaming(SwarmAverager)
            return self._announce()
        self.diloco = DiLoCo(self.model, self.inner_optimizer, averager=None, config=cfg.diloco)  # type: ignore[arg-type]
        self.averager = SwarmAverager(
            self.dht,
            keys=self.keys,
            tensors_like=self.diloco.global_params,
            board=self.board,
            beat=self.beat,
            state_provider=self.diloco.outer_state,
            config=cfg.averaging,
            client_mode=cfg.network.client_mode,
            fault_file=cfg.peer.fault_file,
            **self._plane_location(),
            overlapped=cfg.overlapped,
        )
        if cfg.method == "dp":
            # Gradients go through the swarm every step; DiLoCo(H=1, lr 1, no momentum) over a
            # swarm of one then just keeps θ, the step clock and the state served to joiners.
            self.dp = DataParallel(self.model, self.inner_optimizer, self.averager)
            self.diloco.averager = LocalAverager()
        else:
            self.dp = None
            self.diloco.averager = self.averager
        self._announce()

    def _setup_streaming(self, SwarmAverager) -> None:  # noqa: N803 - the class, imported late
        """One hivemind averaging group per fragment (own shapes); fragment 0's serves the state."""
        cfg = self.config
        config = StreamingConfig(
            outer=cfg.diloco, fragments=cfg.fragments, sync_delay=cfg.sync_delay, alpha=cfg.alpha
        )
        fragments = split_fragments(
            [p.numel() for p in self.model.parameters() if p.requires_grad], cfg.fragments
        )
        shapes = [p.detach().float().cpu() for p in self.model.parameters() if p.requires_grad]
        from swarm.barrier import Serving

        rounds: list[StreamingRounds] = []  # filled below; the state provider reads it lazily
        serving = Serving()  # one peer: a state request stops every fragment's barrier waiting
        self.fragment_averagers = [
            SwarmAverager(
                self.dht,
                keys=self.keys,
                tensors_like=[shapes[i] for i in indices],
                board=self.board,
                beat=self.beat,
                state_provider=lambda: rounds[0].outer_state(),
                config=cfg.averaging,
                client_mode=cfg.network.client_mode,
                group=f"fragment{f}",
                serve_state=f == 0,
                fault_file=cfg.peer.fault_file,
                **self._plane_location(),
                overlapped=cfg.overlapped,
                serving=serving,
            )
            for f, indices in enumerate(fragments)
        ]
        streaming = StreamingDiLoCo(self.model, self.inner_optimizer, self.fragment_averagers, config)
        rounds.append(StreamingRounds(streaming))
        self.diloco = rounds[0]  # the peer drives it like DiLoCo, one fragment sync per round
        self.averager = self.fragment_averagers[0]
        self.dp = None

    def _plane_location(self) -> dict[str, Any]:
        """Where this peer's direct data plane listens, and the host others dial for it (the
        first --announce's IP, else --host; none for 0.0.0.0 without --announce)."""
        network = self.config.network
        advertise = None
        for address in network.announce:
            parts = address.split("/")
            if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
                advertise = parts[2]
                break
        return dict(plane_host=network.host, plane_advertise=advertise)

    def _announce(self) -> None:
        cfg = self.config
        # A joiner's first word is "downloading": the others' round barrier waits for a peer in
        # that stage, but not for one still "joining" at outer step 0.
        self.beat(Stage.DOWNLOADING if cfg.network.initial_peers else Stage.JOINING)
        addresses = visible_addresses(self.dht)
        self.addresses = addresses
        self.emit(
            "started",
            peer_id=self.peer_id,
            addresses=addresses,
            device=str(self.device),
            owner=self.manifest.owner if self.manifest else None,
            fingerprint=self.fingerprint()[0],
            params=self.model.num_params(),
            data=self.corpus.source,
        )
        if self.on_started:
            self.on_started(addresses)

    def _check_run_exists(self, timeout: float = 10.0) -> None:
        """A joiner must find at least one live peer of the run, or the run id is wrong."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.board.fetch():
                return
            time.sleep(0.3)
        raise SwarmError(
            f"connected to the swarm, but no live peer of run '{self.config.peer.run_id}' answered within "
            f"{timeout:.0f} s: check --run-id matches the command `workbench start` printed"
        )

    def fingerprint(self) -> tuple[str, str]:
        """(fingerprint, summary) of this peer's model and the optimizer settings all peers share."""
        cfg = self.config
        optimizer = dict(
            method=cfg.method,
            fragments=cfg.fragments if cfg.method == "streaming" else None,
            outer=dataclasses.asdict(cfg.diloco),
            compression=cfg.averaging.compression,
        )
        summary = (
            f"{type(self.model).__name__} {self.model.num_params() / 1e6:.2f}M params, {cfg.method} "
            f"H={cfg.diloco.inner_steps} outer lr {cfg.diloco.outer_lr} codec {cfg.diloco.codec}"
        )
        return model_fingerprint(self.model, optimizer), summary

    def _check_manifest(self) -> None:
        """The first peer publishes the run manifest; a joiner refuses a run with another model."""
        from swarm.identity import key_hash
        from swarm.manifest import check_fingerprint, find_manifest, publish_manifest
        from swarm.steering import ControlWatcher

        cfg = self.config
        fingerprint, summary = self.fingerprint()
        if not cfg.network.initial_peers:
            manifest = RunManifest(
                run_id=cfg.peer.run_id,
                owner=key_hash(self.store.public_key),
                fingerprint=fingerprint,
                summary=summary,
                created=time.time(),
            )
            publish_manifest(self.store, self.keys, manifest)
            cfg.peer.owner = manifest.owner  # the join command names it: joiners trust only this owner
        else:
            manifest = find_manifest(self.store, self.keys, owner=cfg.peer.owner)
            if manifest is None:
                logger.warning(
                    "%s: run '%s' has no manifest in the DHT (its owner left?): cannot check the model "
                    "fingerprint, and steering is off for this peer",
                    self.name,
                    cfg.peer.run_id,
                )
            else:
                check_fingerprint(manifest, fingerprint, summary)
        self.manifest = manifest
        self.control = ControlWatcher(self.store, self.keys, manifest.owner) if manifest else None

    # --- heartbeats and events ---------------------------------------------------------------

    def beat(self, stage: Stage) -> None:
        """Publish this peer's heartbeat (throttled; immediately when the stage changes)."""
        changed = stage is not self.stage
        self.stage = stage
        if self.board is None or not self.peer_id:
            return
        self.board.publish(self.heartbeat(), force=changed)
        if self.store.failures >= PUBLISH_FAILURES and threading.current_thread() is threading.main_thread():
            # Nobody would see this peer (the others' barrier, the monitor): stop, say why once.
            raise SwarmError(
                f"{self.name} cannot publish its heartbeat to the DHT ({self.store.last_failure}, "
                f"{self.store.failures} times in a row); stopping"
            )

    def heartbeat(self) -> PeerHeartbeat:
        from hivemind.utils import get_dht_time

        diloco = getattr(self, "diloco", None)
        return PeerHeartbeat(
            peer_id=self.peer_id,
            name=self.name,
            stage=self.stage,
            outer_step=diloco.outer_step_count if diloco else 0,
            inner_step=diloco.inner_step_count if diloco else 0,
            inner_steps=self.round_steps,
            loss=self.last_loss,
            samples_per_second=self.samples_per_second,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            device=str(getattr(self, "device", "cpu")),
            time=get_dht_time(),
            last_round_seconds=self.last_round_seconds,
            group_size=self.group_size,
            control_version=self.control_version,
            addresses=[] if self.config.network.client_mode else self.addresses[:16],
            tokens_per_second=self.samples_per_second * self.config.model.block_size,
            dp_bytes=self.dp_bytes,
            rounds=self.total_rounds if self.config.peer.rounds else 0,
            last_error=self.last_error[:300] if self.last_error else None,
            ignored={peer: why[:200] for peer, why in list(self.board.ignored.items())[-16:]},
        )

    def emit(self, event: str, **fields: Any) -> None:
        record = {"event": event, "time": time.time(), "peer": self.name, **fields}
        if self.metrics_file:
            self.metrics_file.write(json.dumps(record) + "\n")
        for exporter in self.exporters:
            try:
                exporter.write(record)
            except Exception as error:  # noqa: BLE001 - a dashboard must never stop training
                logger.warning("%s: dropping the %s exporter: %s", self.name, type(exporter).__name__, error)
                self.exporters.remove(exporter)
                break

    # --- the run ----------------------------------------------------------------------------

    def download_state(self, reason: str) -> bool:
        """Adopt the global state of the most advanced peer; False if nobody could serve it."""
        self.beat(Stage.DOWNLOADING)
        started = time.monotonic()
        for attempt in range(3):
            with progress(f"{self.name}: downloading the global state ({reason})"):
                state = self.averager.download_state()
            if state is not None:
                try:
                    self.diloco.load_outer_state(state)
                except ValueError as error:
                    raise SwarmError(
                        f"run '{self.config.peer.run_id}' trains another model: {error} "
                        "(use the --model and flags from the run's join command)"
                    ) from None
                self.averager.set_state_priority(state.outer_step)
                seconds = time.monotonic() - started
                logger.info(
                    "%s: downloaded the global state at outer step %d (%s, %.1f s)",
                    self.name,
                    state.outer_step,
                    reason,
                    seconds,
                )
                self.emit("state_downloaded", outer_step=state.outer_step, reason=reason, seconds=seconds)
                return True
            logger.info("%s: no peer served the state yet (attempt %d of 3)", self.name, attempt + 1)
            time.sleep(1.0)
        return False

    def wait_for_peers(self) -> None:
        """``--min-peers``: wait until that many peers (this one included) can train.

        A peer still downloading the state does not count yet: starting without it would put
        this peer a round ahead by the time the download lands, and with ``--overlap`` the
        first round would then be averaged alone (the state served to the newcomer waits for
        that round's mean, so the newcomer cannot be waited for)."""
        wanted, timeout = self.config.peer.min_peers, self.config.peer.wait_timeout
        if wanted <= 1:
            return
        deadline = time.monotonic() + timeout
        while True:
            self.beat(Stage.JOINING)
            present = sum(p.stage is not Stage.DOWNLOADING for p in self.board.fetch().values())
            if present >= wanted:
                return
            if time.monotonic() > deadline:
                logger.warning(
                    "%s: only %d of %d peers after %.0f s; starting anyway",
                    self.name,
                    present,
                    wanted,
                    timeout,
                )
                return
            time.sleep(0.3)

    @property
    def round_steps(self) -> int:
        """Inner steps between two syncs: H, or H/F for streaming (one fragment per sync)."""
        cfg = self.config
        return (
            cfg.diloco.inner_steps // cfg.fragments if cfg.method == "streaming" else cfg.diloco.inner_steps
        )

    @property
    def total_rounds(self) -> int:
        """Syncs in a run of ``--rounds``: streaming syncs every fragment once per round."""
        cfg = self.config
        return cfg.peer.rounds * (cfg.fragments if cfg.method == "streaming" else 1)

    def steps_this_round(self) -> int:
        """H, or fewer for a peer that joined mid-round, so it reaches the barrier with the others."""
        H = self.round_steps
        mates = [
            p.inner_step
            for p in self.board.fetch().values()
            if p.peer_id != self.peer_id
            and p.outer_step == self.diloco.outer_step_count
            and p.stage is Stage.TRAINING
        ]
        return max(1, H - max(mates)) if mates else H

    def run(self) -> dict[str, Any]:
        """Train until ``rounds`` outer rounds are done (or forever); returns a summary."""
        cfg = self.config
        self.setup()
        self.batches = self._batches()
        if cfg.peer.resume:
            self.resume(cfg.peer.resume)
        if cfg.network.initial_peers and not self.download_state("joining"):
            logger.warning(
                "%s: no peer could serve the global state; starting from the seed's init", self.name
            )
        self.wait_for_peers()
        initial_eval = evaluate(self.model, self.eval_set, self.device)
        self.emit("initial_eval", outer_step=self.diloco.outer_step_count, eval_loss=initial_eval)
        logger.info(
            "%s: eval loss %.4f at outer step %d", self.name, initial_eval, self.diloco.outer_step_count
        )
        total_inner = self.total_rounds * self.round_steps if cfg.peer.rounds else None
        eval_loss = initial_eval
        while not cfg.peer.rounds or self.diloco.outer_step_count < self.total_rounds:
            round_start = time.monotonic()
            samples = steps = 0
            compute = 0.0  # seconds in inner steps, the data-parallel all-reduce excluded
            # θ_global only changes at a sync, so one fingerprint serves the whole round (for dp a
            # round is one step); computing it per inner step would norm every tensor H times.
            self.apply_control()
            if self.node is not None:  # the node's ranks start the round from rank 0's θ and AdamW
                self.node.command(SYNC)
                self.node.sync_state(self.model, self.inner_optimizer)
            world = self.node.world_size if self.node is not None else 1
            info = dict(outer_step=self.diloco.outer_step_count, fingerprint=self.diloco.fingerprint())
            for _ in range(self.steps_this_round()):
                self.wait_while_paused()
                self.read_faults()
                self.beat(Stage.TRAINING)
                # The schedule follows the run's clock, not this peer's: a late joiner must not
                # restart warmup (or the cosine) and push updates far larger than the others'.
                run_step = self.diloco.outer_step_count * self.round_steps + self.diloco.inner_step_count
                for group in self.inner_optimizer.param_groups:
                    group["lr"] = cfg.train.inner_lr * cfg.train.lr_factor(run_step, total_inner)
                x, y = next(self.batches)
                step_start = time.monotonic()
                self.last_loss, dp_report = self.inner_step(x, y, info)
                compute += time.monotonic() - step_start - (dp_report.seconds if dp_report else 0.0)
                self.diloco.note_inner_step(samples=len(x) * world)  # the node's weight: all its ranks
                samples += len(x) * world
                steps += 1
            self.samples_per_second = samples / max(time.monotonic() - round_start, 1e-9)
            if self.node is not None:  # every rank holds the same θ_local now, or the node is broken
                self.node.command(CHECK)
                self.node_max_diff = max(self.node_max_diff, self.node.max_param_diff(self.model))
            if self.dp is not None:
                self.diloco.sync()  # commit: θ_global ← θ_local, step clock + 1, state snapshot
                report = dp_report
            else:
                report = self.diloco.sync(info=info)
                if cfg.overlapped:  # the clock moved on: say so now, the others' barrier reads it
                    self.board.publish(self.heartbeat(), force=True)
            self.bytes_sent += report.bytes_sent
            self.bytes_received += report.bytes_received
            self.group_size = report.group_size
            self.last_error = report.error
            # Data-parallel would have all-reduced fp32 gradients after each of these inner steps.
            group = max(report.group_size, 1)
            self.dp_bytes += int(steps * 2 * 4 * self.model.num_params() * (group - 1) / group)
            self.last_round_seconds = time.monotonic() - round_start
            resync = f"out of step with the swarm ({report.error})" if report.stale else None
            if report.group_size > 1:
                from swarm.averaging import diverged_from_group

                # (overlapped, the report is the previous round's: judge it by what went with it)
                resync = diverged_from_group(
                    (report.info or info) | {"peer": self.peer_id}, report.group_info
                )
            # A peer known to be out of date must not serve its θ at the top priority.
            self.averager.set_state_priority(self.diloco.outer_step_count - (0.5 if resync else 0.0))
            every = cfg.peer.checkpoint_every
            if every and self.diloco.outer_step_count % every == 0:
                self.save_checkpoint()
            if resync:
                # Adopt the group's θ before evaluating, so the round's eval loss is that of the
                # params this peer carries on with (and matches the others').
                logger.warning("%s: %s; downloading the global state", self.name, resync)
                self.download_state(resync)
            if self.diloco.outer_step_count % cfg.peer.eval_every == 0 or (
                cfg.peer.rounds and self.diloco.outer_step_count >= self.total_rounds
            ):
                eval_loss = evaluate(self.model, self.eval_set, self.device)
            self.emit(
                "round",
                outer_step=self.diloco.outer_step_count,
                loss=self.last_loss,
                eval_loss=eval_loss,
                group_size=report.group_size,
                pending=report.pending,  # overlapped: the first sync has nothing averaged yet
                plane=report.plane,
                bytes_sent=report.bytes_sent,
                bytes_received=report.bytes_received,
                round_seconds=time.monotonic() - round_start,
                averaging_seconds=report.seconds,
                compute_seconds=compute,
                alone_reason=report.error,
                resync=resync,
                samples_per_second=self.samples_per_second,
                # |θ| as this round started: equal on peers at the same outer step that agree
                # (the model itself may differ: an eager peer trains θ + its own offset)
                global_norm=math.sqrt(sum(f * f for f in info["fingerprint"])),
                local_update_norm=report.local_norm,
                mean_update_norm=report.mean_norm,
                # each member's averaging weight (samples this round; a torchrun node: all ranks')
                group_weights=sorted(
                    float(g["weight"]) for g in report.group_info if isinstance(g.get("weight"), (int, float))
                ),
            )
            logger.info(
                "%s: round %d  loss %.4f  eval %.4f  group %d%s",
                self.name,
                self.diloco.outer_step_count,
                self.last_loss,
                eval_loss,
                report.group_size,
                f"  (alone: {report.error})" if report.error else "",
            )
        flush_start = time.monotonic()
        if self.dp is None and (cfg.diloco.delay or cfg.overlapped):
            # The last round's mean (in flight, or queued by the blocking delay; streaming: the
            # last fragment in flight) and no eager offset: every peer ends on the swarm's θ.
            self.diloco.finish()
        flush_seconds = time.monotonic() - flush_start
        final_eval = evaluate(self.model, self.eval_set, self.device)
        summary = dict(
            peer_id=self.peer_id,
            # whole-model rounds (streaming syncs one fragment per sync: F syncs make a round)
            outer_rounds=self.diloco.outer_step_count // (cfg.fragments if cfg.method == "streaming" else 1),
            syncs=self.diloco.outer_step_count,
            initial_eval_loss=initial_eval,
            final_eval_loss=final_eval,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            final_averaging_seconds=flush_seconds,  # overlapped: the wait for the last all-reduce
        )
        if self.node is not None:
            summary.update(node_ranks=self.node.world_size, node_max_param_diff=self.node_max_diff)
        if self.run_dir:
            torch.save(self.diloco.outer_state().params, self.run_dir / "global_params.pt")
        self.emit("done", **summary)
        return summary

    # --- steering --------------------------------------------------------------------------------

    def apply_control(self) -> None:
        """At a round boundary: adopt the owner's newest settings once their step has come.

        Every peer applies a version at the same outer step (``from_step``), so a new outer lr
        changes θ the same way everywhere. A bad value is logged and skipped, never half-applied.
        """
        if self.control is None:
            return
        control = self.control.poll(force=True)
        if control is None or control.version <= self.control_version:
            return
        if self.control_version == 0 and self.config.network.initial_peers:
            self.checkpoints = control.checkpoint  # a joiner does not replay old checkpoint requests
        if self.diloco.outer_step_count < control.from_step:
            return
        changes: dict[str, Any] = {}
        if self.dp is None:
            try:
                changes = self.diloco.retune(
                    outer_lr=control.outer_lr, inner_steps=control.inner_steps, codec=control.codec
                )
            except ValueError as error:
                logger.error("%s: control v%d not applied: %s", self.name, control.version, error)
                changes = {"error": str(error)}
        elif control.outer_lr or control.inner_steps or control.codec:
            logger.warning("%s: outer lr, H and codec do not apply to data-parallel; ignored", self.name)
        if control.checkpoint > self.checkpoints:
            self.checkpoints = control.checkpoint
            changes["checkpoint"] = str(self.save_checkpoint())
        self.control_version = control.version
        self.emit(
            "control_applied",
            version=control.version,
            outer_step=self.diloco.outer_step_count,
            changes=changes,
        )
        logger.info("%s: applied control v%d: %s", self.name, control.version, changes or "no change")
        self.board.publish(self.heartbeat(), force=True)

    def wait_while_paused(self) -> None:
        """Between inner steps: idle while the owner has this peer paused (heartbeats go on)."""
        if self.control is None:
            return
        control = self.control.poll()
        if control is None or not control.pauses(self.peer_id, self.name):
            return
        logger.info("%s: paused by the run owner (control v%d)", self.name, control.version)
        self.emit("paused", version=control.version, outer_step=self.diloco.outer_step_count)
        stage = self.stage
        while control is not None and control.pauses(self.peer_id, self.name):
            self.beat(Stage.PAUSED)
            time.sleep(0.2)
            control = self.control.poll()
        logger.info("%s: resumed", self.name)
        self.emit("resumed", outer_step=self.diloco.outer_step_count)
        self.beat(stage)

    def read_faults(self) -> None:
        """Testing (``--fault-file``, which only the local lab passes): apply the faults it
        injects (swarm.faults), between inner steps."""
        try:
            changed = self.faults.poll()
        except (OSError, ValueError) as error:
            logger.warning("%s: unusable fault file %s: %s", self.name, self.faults.path, error)
            changed = None
        if changed is not None:
            plan, fired = changed
            self.throttle = plan.throttle_ms / 1000
            if self.averager is not None and "corrupt_next" in fired:
                self.averager.corrupt_next = True
            if self.averager is not None and "oversize_next" in fired:
                self.averager.scale_next = 1000.0
            logger.warning("%s: fault injection: %s", self.name, plan)
        if self.throttle:
            time.sleep(self.throttle)

    def save_checkpoint(self) -> Path | None:
        """Everything needed to continue, atomically, in ``<run_dir>/checkpoint.pt``."""
        import workbench.run.checkpoint as checkpoint

        if self.run_dir is None:
            logger.warning("%s: a checkpoint was requested but this peer has no --run-dir", self.name)
            return None
        feedback = getattr(self.diloco, "feedback", None)
        if isinstance(feedback, list):  # streaming: one residual memory per fragment
            residuals = [f.residuals if f is not None else None for f in feedback]
        else:
            residuals = feedback.residuals if feedback is not None else None
        path = checkpoint.save(
            self.run_dir,
            {
                "run_id": self.config.peer.run_id,
                "fingerprint": self.fingerprint()[0],
                "name": self.name,
                "outer": dataclasses.asdict(self.diloco.outer_state()),
                "model": self.model.state_dict(),
                "inner_optimizer": self.inner_optimizer.state_dict(),
                "feedback": residuals,
                "data": self.batches.state_dict() if self.batches is not None else None,
                "bytes": [self.bytes_sent, self.bytes_received, self.dp_bytes],
                "control_version": self.control_version,
            },
        )
        logger.info("%s: wrote checkpoint %s at outer step %d", self.name, path, self.diloco.outer_step_count)
        self.emit("checkpoint", path=str(path), outer_step=self.diloco.outer_step_count)
        return path

    def resume(self, directory: str) -> None:
        """Continue from the checkpoint in ``directory`` (``--resume``): refuses another run or model."""
        import workbench.run.checkpoint as checkpoint
        from optim.diloco import OuterState

        payload, path = checkpoint.load(directory)
        fingerprint = self.fingerprint()[0]
        if payload.get("run_id") != self.config.peer.run_id:
            raise checkpoint.CheckpointError(
                f"{path} belongs to run '{payload.get('run_id')}', not '{self.config.peer.run_id}': pass --run-id "
                f"{payload.get('run_id')}"
            )
        if payload.get("fingerprint") != fingerprint:
            raise checkpoint.CheckpointError(
                f"{path} was written for model fingerprint {payload.get('fingerprint')}, this peer's is "
                f"{fingerprint}: resume with the flags the peer ran with"
            )
        self.model.load_state_dict(payload["model"])
        self.inner_optimizer.load_state_dict(payload["inner_optimizer"])
        self.diloco.load_outer_state(OuterState(**payload["outer"]))
        self.inner_optimizer.load_state_dict(payload["inner_optimizer"])  # load_outer_state may reset it
        feedback = getattr(self.diloco, "feedback", None)
        if isinstance(feedback, list):
            for memory, residuals in zip(feedback, payload.get("feedback") or []):
                if memory is not None:
                    memory.residuals = residuals
        elif feedback is not None:
            feedback.residuals = payload.get("feedback")
        if payload.get("data") is not None:
            self.batches.load_state_dict(payload["data"])
        self.bytes_sent, self.bytes_received, self.dp_bytes = payload.get("bytes", [0, 0, 0])
        self.control_version = int(payload.get("control_version", 0))
        self.averager.set_state_priority(self.diloco.outer_step_count)
        logger.info("%s: resumed from %s at outer step %d", self.name, path, self.diloco.outer_step_count)
        self.emit("resumed_checkpoint", path=str(path), outer_step=self.diloco.outer_step_count)

    def _batches(self):
        cfg = self.config
        if cfg.peer.shard is not None and self.corpus.presharded:  # a dataset sharded by record
            return self.corpus.batches(
                block_size=cfg.model.block_size,
                batch_size=cfg.data.batch_size,
                seed=cfg.peer.seed + cfg.peer.shard,
            )
        if cfg.peer.shard is not None:  # the same stream optim.sim gives virtual peer `shard`
            return self.corpus.batches(
                block_size=cfg.model.block_size,
                batch_size=cfg.data.batch_size,
                seed=cfg.peer.seed,
                shard=cfg.peer.shard,
                num_shards=cfg.peer.num_shards,
            )
        # Each peer draws from its own stream: seed mixed with the peer id.
        seed = (cfg.peer.seed * 1_000_003 + int.from_bytes(self.peer_id.encode()[-8:], "little")) % 2**62
        return self.corpus.batches(block_size=cfg.model.block_size, batch_size=cfg.data.batch_size, seed=seed)

    def inner_step(self, x: torch.Tensor, y: torch.Tensor, info: dict[str, Any]) -> tuple[float, Any]:
        """One AdamW step; for data-parallel, with the swarm's mean gradient (and its report)."""
        if self.node is not None:  # the other ranks take the same step on their own batches
            self.node.command(STEP, self.inner_optimizer.param_groups[0]["lr"])
        reports = []

        def before_step() -> None:
            if self.node is not None:
                self.node.average_gradients(self.model)
            if self.dp is not None:
                reports.append(self.dp.before_inner_step(samples=len(x), info=info))

        loss = train_step(
            self.model, self.inner_optimizer, x, y, self.device, self.config.train.grad_clip, before_step
        )
        report = reports[0] if reports else None
        value = float(loss.detach())
        if not torch.isfinite(torch.tensor(value)):
            raise FloatingPointError(
                f"inner loss became {value} at outer step {self.diloco.outer_step_count}: lower --inner-lr"
            )
        return value, report

    # --- shutdown -----------------------------------------------------------------------------

    def close(self, reason: str) -> None:
        """Announce departure (best effort), then shut down the averager before the DHT."""
        dht_alive = self.dht is not None and getattr(self.dht, "is_alive", lambda: True)()  # may be signalled
        if self.board is not None and self.peer_id and dht_alive:
            self.stage = Stage.LEAVING
            try:
                self.board.publish_now(self.heartbeat(), timeout=2.0)
            except Exception as error:
                logger.debug("could not announce leaving: %s", error)
        self.emit("left", reason=reason)
        if self.node is not None:
            try:
                self.node.stop()  # the followers return; their processes exit with ours
                self.node.close()
            except Exception as error:  # noqa: BLE001 - a follower already gone
                logger.debug("stopping the node's other ranks: %s", error)
            self.node = None
        averagers = getattr(self, "fragment_averagers", None) or [self.averager]
        if self.session is not None:
            self.session.close(*averagers)
        self.session = self.averager = self.dht = None
        self.fragment_averagers = []
        if self.metrics_file:
            self.metrics_file.close()
            self.metrics_file = None
        for exporter in self.exporters:
            try:
                exporter.close()
            except Exception as error:  # noqa: BLE001
                logger.warning("closing the %s exporter: %s", type(exporter).__name__, error)
        self.exporters = []


def run_peer(config: RunConfig, *, on_started: Callable[[list[str]], None] | None = None) -> dict[str, Any]:
    """Run a peer in the main thread; Ctrl+C, SIGTERM or SIGHUP stops it cleanly within seconds."""
    peer = Peer(config, on_started=on_started)
    with stopped_by_signals():  # SIGTERM, SIGHUP (a closed terminal): like Ctrl+C
        try:
            summary = peer.run()
            _close_within(peer, "finished")
            return summary
        except KeyboardInterrupt:
            _close_within(peer, "interrupted")
            raise
        except BaseException:
            _close_within(peer, "error")
            raise


CLOSE_DEADLINE = 20.0
"""Seconds a peer may take to leave (announce it, stop its averager and DHT processes)."""


def _close_within(peer: Peer, reason: str) -> None:
    """``peer.close(reason)``, and a peer told to stop is gone within ``CLOSE_DEADLINE``
    whatever its child processes do: past it, every thread's stack goes to stderr (where the
    shutdown hung) and the process exits with status 1."""
    faulthandler.dump_traceback_later(CLOSE_DEADLINE, exit=True)
    try:
        peer.close(reason)
    finally:
        faulthandler.cancel_dump_traceback_later()
