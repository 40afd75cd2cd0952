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

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

import workbench.run.checkpoint as checkpoint
from optim.api import Sync
from optim.background import RoundInFlight
from optim.data_parallel import DataParallel
from swarm.dataplane import one_line
from swarm.dht import NetworkConfig, release_interrupted_locks, visible_addresses
from swarm.errors import SwarmError
from swarm.records import PROTOCOL, PeerHeartbeat, RunKeys, RunManifest, Stage
from swarm.session import connect
from workbench.config import RunConfig
from workbench.run import joining
from workbench.run.control import Steering, steered_problem
from workbench.run.data import check_batch_size, evaluate
from workbench.run.exporters import peer_exporters
from workbench.run.faults import InjectedFaults
from workbench.run.node import CHECK, STEP, SYNC, NodeGroup
from workbench.run.outer import OuterLoop, build_outer, start_averagers
from workbench.run.stopping import (
    close_within,
    not_interrupted,
    raise_if_stopped,
    stop_with_launcher,
    stopped_by_signals,
    stopping_now,
)
from workbench.run.telemetry import Events, RoundStats, heartbeat_of, round_fields, round_note
from workbench.run.training import build_model_and_optimizer, load_data, train_step, trained_shapes

logger = logging.getLogger(__name__)

PUBLISH_FAILURES = 20  # heartbeats (one a second or so) that failed in a row before a peer stops
RECORDS_REFRESH = 600.0
"""Seconds between the run owner's peer's stores of the manifest and the steering record."""
FINAL_DOWNLOADS = 2  # downloads of the others' final θ a finishing peer tries before it leaves as is


REJOIN_SECONDS = 30.0
"""How long the run's first peer, resumed from a checkpoint, waits for one of the round mates it
recorded to come back to it before it trains on alone (at most ``--min-peers``' wait)."""
LEFT_BEHIND_ROUNDS = 3
"""Rounds running a peer ends after the others did (and downloads their state) before it says
that it is too slow for them."""


class Peer:
    """Builds the model, data and swarm connection for ``config`` and trains until done.

    Composed of: the training parts (:mod:`workbench.run.training`: data, model), the outer
    loop over the swarm (:mod:`workbench.run.outer`), its figures and events
    (:mod:`workbench.run.telemetry`), the owner's steering (:mod:`workbench.run.control`),
    checkpoints (:mod:`workbench.run.checkpoint`) and, in the local lab, injected faults
    (:mod:`workbench.run.faults`). This class runs the rounds and publishes the heartbeat."""

    announced = False
    """Whether it said "started" (its join command is out): only then does it say "left"."""

    def __init__(
        self, config: RunConfig, *, on_started: Callable[[list[str], Path, bool], None] | None = None
    ) -> None:
        """``on_started(addresses, key, kept)``: called once the peer is reachable, with its
        addresses, its key file and whether that file is kept (else deleted when the peer exits)."""
        self.config = config
        self.schedule_steps = config.round_steps
        """The inner steps of a sync at the run's start: the unit of the inner lr schedule's
        clock, which counts syncs, so that steering H neither restarts the warmup nor skips it
        (the clock counted syncs times the H of the moment: H 50 -> 5 after the warmup sent the lr
        from 0.94 back to 0.55, a review, stop 72)."""
        self.on_started = on_started
        run_dir = config.peer.run_dir
        self.run_dir = Path(run_dir) if run_dir else None
        self.name = config.peer.name or "peer"
        self.stage = Stage.JOINING
        self.stats = RoundStats()
        self.events = Events()
        self.faults = InjectedFaults(config.peer.fault_file, self.name)
        # The network (set up by setup()).
        self.session = self.dht = self.board = self.store = None
        self.keys: RunKeys | None = None
        self.peer_id = ""
        self.addresses: list[str] = []
        self.manifest: RunManifest | None = None
        self.steering = self._steering(None)  # the owner's control record: see _check_manifest
        self._fingerprint: tuple[str, str] | None = None
        self._fingerprinted: dict[str, str] = {}
        """What the fingerprint covers, flag by flag (a refused --resume names what differs)."""
        # Training (set up by setup()): the data, the model and its optimizer, the data stream.
        self.device = self.corpus = self.eval_set = self.model = self.inner_optimizer = self.batches = None
        self.outer: OuterLoop | None = None
        self.diloco = None  # the outer loop's rounds: DiLoCo, or streaming's fragment rounds
        self.left_behind = 0  # rounds running it came after the others ended them (_note_left_behind)
        self.other_releases_said = False  # peers of an earlier release were named (_note_other_releases)
        self.rounds_done = 0  # syncs this process took part in (a stopped peer writes θ after one)
        self.in_step = False
        """Whether this peer's last round averaged with round mates and nothing reset it since
        (a state download does): it then starts this round with them, and trains all of it."""
        self.averager = None  # the averager that downloads and serves the state
        self.dp: DataParallel | None = None
        self.node: NodeGroup | None = None  # a torchrun node: this is rank 0, driving the others
        self.node_max_diff = 0.0  # the largest θ_local difference between the node's ranks seen
        self.final_theta: list[float] = []  # finishing: θ's sketch the others compare (swarm.ending)
        self.settled = False  # finishing: it would leave now on final_theta (swarm.ending)
        self._checkpoint: tuple[dict[str, Any], Path] | None = None  # --resume's, read in setup()
        self.resumed_mates: list[str] = []  # the round mates its checkpoint recorded
        self._records_kept = time.monotonic()  # when the owner's peer last stored its records
        self._control_kept = (0, 0.0)  # the steering record it stores again: version, expiration

    # --- setup ------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg = self.config
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.device, self.corpus, self.eval_set = load_data(cfg)
        self.node = NodeGroup.from_env()  # None outside torchrun
        if self.node is not None and cfg.outer_method.sync is not Sync.ROUNDS:
            raise ValueError(f"a torchrun node peer runs --method diloco (got {cfg.method})")
        self.keys = RunKeys(cfg.peer.run_id, cfg.peer.secret)
        network = cfg.network
        if not network.identity_path and self.run_dir:
            # The peer's key lives with its run directory: same peer id after a restart.
            key = self.run_dir / "identity.key"
            resumed = Path(cfg.peer.resume) / "identity.key" if cfg.peer.resume else None
            if resumed is not None and not key.exists() and resumed.exists() and resumed != key:
                # Not taken along: two resumes of one checkpoint side by side would be one peer id.
                logger.warning(
                    "resuming %s into another folder (%s): this peer gets a new key there, so a new "
                    "peer id; a run's first peer is no longer its owner then (joiners' --owner, "
                    "`workbench steer --key`): to keep it, pass --identity %s",
                    cfg.peer.resume,
                    self.run_dir,
                    resumed,
                )
            network = NetworkConfig(**{**network.__dict__, "identity_path": str(key)})
        if self.run_dir:
            checkpoint.make_folder(self.run_dir)
            self._run_dir_lock = checkpoint.hold_run_dir(self.run_dir)  # before its identity key is read
        # hivemind forks its DHT and averager processes. Forked after the model exists, a child
        # keeps the pages of the model's weights as they were when training rewrote them (or when
        # the model moved to the GPU and freed them here): a copy of the model for the rest of the
        # run. So both start before it: the averagers are made like the model's meta shapes.
        self.session = connect(network, self.keys)
        self.dht, self.board, self.store = self.session.dht, self.session.board, self.session.store
        self.peer_id = self.session.peer_id
        self.name = self.faults.name = cfg.peer.name or f"peer-{self.peer_id[-8:]}"
        self.events.open(
            self.run_dir, name=self.name, exporters=peer_exporters(cfg, self.run_dir, self.name, self.peer_id)
        )
        if cfg.network.initial_peers:
            joining.check_run_exists(self.board, cfg.peer.run_id, cfg.network.connect_timeout)
        self.outer = start_averagers(
            cfg,
            trained_shapes(cfg, self.corpus),
            dht=self.dht,
            keys=self.keys,
            board=self.board,
            beat=self.beat,
        )
        self.model, self.inner_optimizer = build_model_and_optimizer(cfg, self.device, self.corpus)
        self.fingerprint()  # of the flags it started with, before any steering
        self._check_manifest()
        # A joiner serves its state once its download is done: before, it holds the seed's init
        # at outer step 0, which a peer far into the run that had to download was offered, and
        # took (the churn soak).
        build_outer(cfg, self.model, self.inner_optimizer, self.outer, serve=not cfg.network.initial_peers)
        self.diloco, self.averager, self.dp = self.outer.rounds, self.outer.averager, self.outer.dp
        for averager in self.outer.averagers:  # "serving" is in the heartbeat: say it at once
            averager.serving.on_change = self.publish
        if cfg.peer.resume:
            # Read and checked before the peer announces itself (the join command, "started"): a
            # corrupt checkpoint or one of another model is one line and nothing announced.
            self._checkpoint = self._load_checkpoint(cfg.peer.resume)
            position = self._checkpoint[0].get("data")
            if position is not None:
                check_batch_size(position, cfg.data.batch_size)
        self._announce()

    def _steering(self, watcher: Any) -> Steering:
        return Steering(
            watcher,
            name=self.name,
            peer_id=self.peer_id,
            joiner=bool(self.config.network.initial_peers),
            emit=self.emit,
            publish=self.publish,
            beat=self.beat,
            checkpoint=self.save_checkpoint,
            can_checkpoint=self.run_dir is not None,
            check=lambda control: steered_problem(self.config, control),
        )

    def _announce(self) -> None:
        cfg = self.config
        # A joiner's first word is "downloading": the others' round barrier waits for a peer in
        # that stage, but not for one still "joining" at outer step 0.
        self.beat(Stage.DOWNLOADING if cfg.network.initial_peers else Stage.JOINING)
        addresses = visible_addresses(self.dht)
        self.addresses = addresses
        if self.on_started:  # first: whoever sees the "started" event can read the join command
            self.on_started(addresses, self.session.identity_path, self.session.key_kept)
        self.emit(
            "started",
            peer_id=self.peer_id,
            addresses=addresses,
            device=str(self.device),
            owner=self.manifest.owner if self.manifest else None,
            # which run (its manifest's): `export` tells a later run in the same folder by it
            run=f"{cfg.peer.run_id}/{self.manifest.owner}/{self.manifest.created!r}"
            if self.manifest
            else None,
            fingerprint=self.fingerprint()[0],
            params=self.model.num_params(),
            data=self.corpus.source,
        )
        self.announced = True

    def fingerprint(self) -> tuple[str, str]:
        """(fingerprint, summary) of this peer's model and the optimizer settings all peers share,
        as the peer started: steering changes the settings later, and a checkpoint must still match
        the flags its peer was started with (``--resume`` with them, not with the steered values)."""
        if self._fingerprint is None:
            self._fingerprint = joining.fingerprint(self.config, self.model)
            self._fingerprinted = joining.fingerprinted_flags(self.config, self.model)
        return self._fingerprint

    def _check_manifest(self) -> None:
        """The first peer publishes the run manifest; a joiner refuses a run with another model."""
        from swarm.steering import ControlWatcher

        manifest = joining.settle_manifest(self.config, self.store, self.keys, self.model, self.name)
        self.manifest = manifest
        self.steering = self._steering(
            ControlWatcher(self.store, self.keys, manifest.owner) if manifest else None
        )

    # --- heartbeats and events ---------------------------------------------------------------

    def beat(self, stage: Stage | None) -> None:
        """Publish this peer's heartbeat (throttled; immediately when the stage changes).
        ``None`` keeps it alive in the stage it has: a round averaging in the background
        (``--overlap``) while the main thread waits for it, or a download, must not let the
        heartbeat expire (10 s), or the others would count this peer gone."""
        raise_if_stopped()  # (a Ctrl+C lost in a destructor)
        changed = stage is not None and stage is not self.stage
        if stage is not None:
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

    def publish(self) -> None:
        """This peer's heartbeat, now (a change the others' barrier or the owner reads)."""
        self.board.publish(self.heartbeat(), force=True)

    def heartbeat(self) -> PeerHeartbeat:
        return heartbeat_of(self)

    def emit(self, event: str, **fields: Any) -> None:
        self.events.emit(event, **fields)

    # --- the run ----------------------------------------------------------------------------

    def download_state(
        self,
        reason: str,
        avoid: Iterable[str] = (),
        at_step: int | None = None,
        only: Iterable[str] | None = None,
        stage: Stage = Stage.DOWNLOADING,
        oldest_unconfirmed: int | None = None,
        keep_own: bool = False,
    ) -> bool:
        """Adopt the global state of the most advanced peer (not one of ``avoid``; at
        ``at_step`` and from ``only`` if given; before outer step ``oldest_unconfirmed`` only if
        another peer confirms it); False if nobody could serve it. ``stage``: the heartbeat's
        meanwhile."""
        self.beat(stage)
        self.in_step = False  # the state restarts the round, whose mates are part-way through it
        return joining.download_state(
            self.averager,
            self.diloco,
            emit=self.emit,
            name=self.name,
            run_id=self.config.peer.run_id,
            reason=reason,
            avoid=avoid,
            at_step=at_step,
            only=only,
            oldest_unconfirmed=oldest_unconfirmed,
            keep_own=keep_own,
        )

    def run(self) -> dict[str, Any]:
        """Train until ``rounds`` outer rounds are done (or forever); returns a summary."""
        cfg = self.config
        self.setup()
        self.batches = joining.peer_batches(cfg, self.corpus, self.peer_id)
        if cfg.peer.resume:
            self.resume(cfg.peer.resume)
            if cfg.peer.rounds and self.diloco.outer_step_count >= cfg.total_rounds:
                logger.warning(
                    "%s: the checkpoint is at outer step %d, where --rounds %d ends: nothing left to "
                    "train (raise --rounds, or 0 for until Ctrl+C)",
                    self.name,
                    self.diloco.outer_step_count,
                    cfg.peer.rounds,
                )
        # A resumed joiner keeps its checkpoint's state where the swarm holds the same θ, and takes
        # no older state on one donor's word (a fresh joiner's init, a stale donor's).
        resumed = self.diloco.outer_step_count if cfg.peer.resume else None
        joined = not cfg.network.initial_peers or self.download_state(
            "joining", oldest_unconfirmed=resumed, keep_own=resumed is not None
        )
        if (
            resumed is not None
            and not cfg.network.initial_peers
            and joining.wait_for_mates(
                self.board,
                self.beat,
                self.resumed_mates,
                timeout=min(REJOIN_SECONDS, cfg.peer.wait_timeout),
                name=self.name,
            )
        ):
            # The run's first peer resumed while its round mates trained on (they come back to
            # its address): it trained alone on its checkpoint's old state for rounds, saying
            # nobody was there, and wrote checkpoints of it (a review, stop 72). It takes theirs,
            # as a resumed joiner does (its own θ kept where they hold it).
            self.download_state("resumed beside its round mates", oldest_unconfirmed=resumed, keep_own=True)
        if not joined:
            logger.warning(
                "%s: no peer could serve the global state; %s",
                self.name,
                # (a resumed peer said "the seed's init" and went on from its checkpoint, a review)
                f"continuing from the checkpoint at outer step {resumed}"
                if resumed is not None
                else "starting from the seed's init",
            )
        elif (
            cfg.network.initial_peers and cfg.peer.rounds and self.diloco.outer_step_count >= cfg.total_rounds
        ):
            reached = self.diloco.outer_step_count // cfg.outer_method.syncs_per_round(cfg.fragments)
            logger.warning(
                "%s: the run is at outer round %d, past --rounds %d (the run's round at which a "
                "peer stops, not a count of this peer's rounds): nothing left to train (raise "
                "--rounds above %d, or 0 for until Ctrl+C)",
                self.name,
                reached,
                cfg.peer.rounds,
                reached,
            )
        if cfg.network.initial_peers:
            self.outer.start_serving()  # the run's state now (or the seed's init, if nobody served)
        joining.wait_for_peers(
            self.board, self.beat, wanted=cfg.peer.min_peers, timeout=cfg.peer.wait_timeout, name=self.name
        )
        initial_eval = self.evaluate()
        self.emit("initial_eval", outer_step=self.diloco.outer_step_count, eval_loss=initial_eval)
        logger.info(
            "%s: eval loss %.4f at outer step %d", self.name, initial_eval, self.diloco.outer_step_count
        )
        eval_loss = initial_eval
        while not cfg.peer.rounds or self.diloco.outer_step_count < self.config.total_rounds:
            eval_loss = self.one_round(eval_loss)
        return self.finish(initial_eval)

    def one_round(self, eval_loss: float) -> float:
        """Inner steps, the sync, a state download if this peer fell out of step, the round's
        event; the eval loss (this round's, or ``eval_loss`` when it is not an eval round)."""
        cfg, stats = self.config, self.stats
        round_start = time.monotonic()
        # θ_global only changes at a sync, so one fingerprint serves the whole round (for dp a
        # round is one step); computing it per inner step would norm every tensor H times.
        self.steering.apply(self.diloco, data_parallel=self.dp is not None)
        self._keep_records()
        if self.node is not None:  # the node's ranks start the round from rank 0's θ and AdamW
            self.node.command(SYNC)
            self.node.sync_state(self.model, self.inner_optimizer)
        info = dict(
            outer_step=self.diloco.outer_step_count, fingerprint=self.diloco.fingerprint(), name=self.name
        )
        steps, compute, dp_report, paused = self.train_round(info, round_start)
        round_start += paused  # not round time: the round's seconds and the ETA leave it out
        if self.node is not None:  # every rank holds the same θ_local now, or the node is broken
            self.node.command(CHECK)
            self.node_max_diff = max(self.node_max_diff, self.node.max_param_diff(self.model))
        if self.dp is not None:
            self.diloco.sync()  # commit: θ_global ← θ_local, step clock + 1
            report = dp_report
        else:
            report = self.diloco.sync(info=info)
            if cfg.overlapped:  # the clock moved on: say so now, the others' barrier reads it
                self.publish()
        self.rounds_done += 1
        stats.bytes_sent += report.bytes_sent
        stats.bytes_received += report.bytes_received
        stats.group_size = report.group_size
        stats.last_error = report.error
        stats.arrivals(report)
        # Data-parallel would have all-reduced fp32 gradients after each of these inner steps.
        group = max(report.group_size, 1)
        stats.dp_bytes += int(steps * 2 * 4 * self.model.num_params() * (group - 1) / group)
        stats.last_round_seconds = time.monotonic() - round_start
        resync = f"out of step with the swarm ({report.error})" if report.stale else None
        claims = dict(report.ahead)  # who said this peer was behind: the download must bear it out
        outvoted: set[str] = set()  # round mates holding the θ the group outvoted, like this one
        if report.group_size > 1:
            from swarm.gathered import (
                claimed_ahead,
                disowned_by_its_donor,
                diverged_from_group,
                held_by_most,
                holding_the_same_state,
            )

            # (overlapped, the report is the previous round's: judge it by what went with it)
            mine = (report.info or info) | {"peer": self.peer_id}
            resync = diverged_from_group(mine, report.group_info, ignored=self.board.ignored)
            disowned = disowned_by_its_donor(mine, report.group_info, self.averager.last_download)
            if not resync and held_by_most(mine, report.group_info, ignored=self.board.ignored):
                disowned = set()  # most of the round hold this peer's θ: it stands
            for donor in disowned:
                logger.warning(
                    "%s: %s served this peer a θ at outer step %d that its own fingerprint in this "
                    "round does not hold; downloading again, neither from it nor asking it",
                    self.name,
                    donor[-8:],
                    mine["outer_step"],
                )
                resync = resync or f"its donor {donor[-8:]} holds another θ than the one it served"
            if resync:
                claims = claimed_ahead(mine, report.group_info)
                outvoted = holding_the_same_state(mine, report.group_info) | disowned
        # A peer known to be out of date must not serve its θ at the top priority.
        self.averager.set_state_priority(self.diloco.outer_step_count - (0.5 if resync else 0.0))
        # --checkpoint-every and --eval-every count rounds; streaming syncs F fragments per round
        # (counted in syncs, F=5 --rounds 2 --checkpoint-every 1 wrote 10 checkpoints).
        syncs = cfg.outer_method.syncs_per_round(cfg.fragments)
        every = cfg.peer.checkpoint_every * syncs
        if every and self.diloco.outer_step_count % every == 0:
            self.save_checkpoint()
        self.in_step = report.group_size > 1 and not report.pending
        self._note_left_behind(report, compute)
        self._note_other_releases(report)
        if resync:
            self.resync(resync, avoid=outvoted, claims=claims)
        evaluated = self.diloco.outer_step_count % (cfg.peer.eval_every * syncs) == 0 or bool(
            cfg.peer.rounds and self.diloco.outer_step_count >= self.config.total_rounds
        )
        if evaluated:
            eval_loss = self.evaluate()
        self._report_round(report, info, eval_loss, resync, round_start, compute, evaluated)
        return eval_loss

    def _note_other_releases(self, report: Any) -> None:
        """Say once when a round alone has live peers of an earlier release beside it: their
        groups are found another way (:data:`swarm.records.PROTOCOL`), so they never average
        with this peer, and each side only saw rounds alone."""
        if report.group_size > 1 or self.board is None or self.other_releases_said:
            return
        # The peers the barrier read this round (no DHT lookup of its own: a lone peer's every round)
        older = sorted(p.name for p in self.board.last_seen.values() if p.protocol < PROTOCOL)
        if older:
            self.other_releases_said = True
            logger.warning(
                "%s: %s run(s) an earlier release of the workbench, whose peers find their groups "
                "another way: they cannot average with this peer; run one release on "
                "every peer of a run",
                self.name,
                ", ".join(older[:8]) + (f" and {len(older) - 8} more" if len(older) > 8 else ""),
            )

    def _note_left_behind(self, report: Any, compute: float) -> None:
        """Say once when this peer keeps coming after the others ended the round: a peer slower
        than they wait for downloaded the state every round, never averaged and said nothing of
        it (a review: 8 downloads, 0 bytes sent, in a run of 40 rounds)."""
        if not (report.stale and report.group_size <= 1):
            self.left_behind = 0
            return
        self.left_behind += 1
        if self.left_behind == LEFT_BEHIND_ROUNDS:
            logger.warning(
                "%s: %d rounds running the others had ended the round before this peer's %.0f s of "
                "inner steps did, and it downloaded their state instead of averaging: it is slower "
                "than they wait for (about one of their rounds for a peer they have not averaged "
                "with). Ask the run's owner for time-boxed rounds (`workbench steer --round-seconds "
                "S`: every peer averages after S seconds, whatever its speed), or use a faster device",
                self.name,
                self.left_behind,
                compute,
            )

    def resync(self, why: str, *, avoid: set[str], claims: dict[str, int]) -> None:
        """Adopt the swarm's θ after a round that found this peer out of step (``why``): not from
        ``avoid`` (round mates holding the θ it leaves); ``claims``, who said it was behind, the
        download must bear out. Before the round's eval, whose loss is then that of the params
        this peer carries on with (and matches the others')."""
        # A joiner's first round often ends out of step (it came mid-round): that is the normal
        # way in, said without a warning (a review, stop 60); later, a warning.
        first = self.rounds_done <= 1 and bool(self.config.network.initial_peers)
        logger.log(
            logging.INFO if first else logging.WARNING, "%s: %s; downloading the global state", self.name, why
        )
        # A state older than the step this round started from only if another peer at its step
        # holds it: else it is a fresh joiner's init or a donor left behind (the churn soak), taken
        # on the donor's word. (A peer that stepped alone past the swarm takes the swarm's state.)
        oldest = self.diloco.outer_step_count - 1
        if self.download_state(why, avoid=avoid, oldest_unconfirmed=oldest) and claims:
            self.averager.settle_claims(claims, self.diloco.outer_step_count)

    def evaluate(self) -> float:
        """The held-out loss of the swarm's model, θ_global (what ``global_params.pt`` keeps and
        every peer of the round holds), not of the params this peer trains from when they
        differ (streaming's fragments, a delayed, overlapped or eager round)."""
        chunk = self.config.data.batch_size  # what fits this peer's memory (the set's batches are 16)
        return self.diloco.with_global(lambda: evaluate(self.model, self.eval_set, self.device, chunk))

    def train_round(self, info: dict[str, Any], round_start: float) -> tuple[int, float, Any, float]:
        """This round's inner steps: (steps, seconds in them without the data-parallel
        all-reduce, the last data-parallel report, seconds paused by the owner). A pause is
        not round time: an hour's pause made the ETA 29 h and the rate 0.2 samples/s, and a
        time box ran out during it (one step, then the sync)."""
        cfg = self.config
        world = self.node.world_size if self.node is not None else 1
        unit = self.schedule_steps
        total_inner = cfg.total_rounds * unit if cfg.peer.rounds else None
        steps, compute, samples, dp_report, paused = 0, 0.0, 0, None, 0.0
        cap = joining.steps_this_round(
            self.board,
            self.peer_id,
            self.diloco.outer_step_count,
            cfg.round_steps,
            vouched=set(self.averager.vouching.vouched) if self.averager is not None else (),
            in_step=self.in_step,
        )
        box, started = self.round_seconds, time.monotonic()
        # Time-boxed rounds: as many steps as fit in the box (at least one, at most H).
        while steps < cap and not (box and steps and time.monotonic() - started - paused >= box):
            copies = getattr(self.diloco, "inner_copies", None)
            paused += self.steering.wait_while_paused(
                self.diloco.outer_step_count, self.stage, copies.boundary if copies else lambda: None
            )
            self.faults.apply(self.averager)
            self.beat(Stage.TRAINING)
            # The schedule follows the run's clock, not this peer's: a late joiner must not
            # restart warmup (or the cosine) and push updates far larger than the others'. Its
            # unit is a sync (the start's H steps, whatever H is now: see schedule_steps).
            run_step = (
                self.diloco.outer_step_count * unit + self.diloco.inner_step_count * unit / cfg.round_steps
            )
            for group in self.inner_optimizer.param_groups:
                group["lr"] = cfg.train.inner_lr * cfg.train.lr_factor(run_step, total_inner)
            x, y = next(self.batches)
            step_start = time.monotonic()
            self.stats.last_loss, dp_report = self.inner_step(x, y, info)
            compute += time.monotonic() - step_start - (dp_report.seconds if dp_report else 0.0)
            self.diloco.note_inner_step(samples=len(x) * world)  # the node's weight: all its ranks
            samples += len(x) * world
            steps += 1
        self.stats.samples_per_second = samples / max(time.monotonic() - round_start - paused, 1e-9)
        self.stats.last_round_steps = steps
        return steps, compute, dp_report, paused

    @property
    def round_seconds(self) -> float:
        """The time box of a round's inner steps (0: H steps): the owner's, else this peer's."""
        steered = self.steering.round_seconds
        return steered if steered is not None else self.config.peer.round_seconds

    def _report_round(
        self,
        report: Any,
        info: dict[str, Any],
        eval_loss: float,
        resync: str | None,
        round_start: float,
        compute: float,
        evaluated: bool,
    ) -> None:
        outer_step = self.diloco.outer_step_count
        self.emit(
            "round",
            **round_fields(report, info, outer_step, self.stats, eval_loss=eval_loss, resync=resync),
            evaluated=evaluated,  # else eval_loss is the last evaluation's (--eval-every)
            round_seconds=time.monotonic() - round_start,
            compute_seconds=compute,
        )
        trained = int(info.get("outer_step", outer_step - 1)) + 1
        # After a download the clock is the swarm's: the loss is of the round this peer trained.
        moved = f"; now at the swarm's outer step {outer_step}" if resync and outer_step != trained else ""
        logger.info(
            "%s: round %d  loss %.4f  eval %.4f  group %d%s%s",
            self.name,
            trained if moved else outer_step,
            self.stats.last_loss,
            eval_loss,
            report.group_size,
            round_note(report),
            moved,
        )

    def finish(self, initial_eval: float) -> dict[str, Any]:
        """After the last round: apply the last mean in flight, evaluate, write the summary."""
        cfg = self.config
        flush_start = time.monotonic()
        last = None
        if self.dp is None and (cfg.diloco.delay or cfg.overlapped):
            # The last round's mean (in flight, or queued by the blocking delay; streaming: the
            # last fragment in flight) and no eager offset: every peer ends on the swarm's θ.
            last = self.diloco.finish()
        flush_seconds = time.monotonic() - flush_start
        if last is not None:  # the last round's all-reduce: no `round` event reports it
            self.stats.bytes_sent += last.bytes_sent
            self.stats.bytes_received += last.bytes_received
            self.emit(
                "final_sync",
                outer_step=self.diloco.outer_step_count,
                group_size=last.group_size,
                plane=last.plane,
                bytes_sent=last.bytes_sent,
                bytes_received=last.bytes_received,
                averaging_seconds=last.seconds,
                wait_seconds=flush_seconds,  # of which the run's end waited for
                alone_reason=last.error,
                mean_update_norm=last.mean_norm,
            )
        ending = self.end_on_the_others_state() if self.dp is None and cfg.peer.rounds else {}
        final_eval = self.evaluate()
        summary = dict(
            peer_id=self.peer_id,
            # whole-model rounds (streaming syncs one fragment per sync: F syncs make a round)
            outer_rounds=self.diloco.outer_step_count // cfg.outer_method.syncs_per_round(cfg.fragments),
            syncs=self.diloco.outer_step_count,
            initial_eval_loss=initial_eval,
            final_eval_loss=final_eval,
            bytes_sent=self.stats.bytes_sent,
            bytes_received=self.stats.bytes_received,
            final_averaging_seconds=flush_seconds,  # overlapped: the wait for the last all-reduce
            final_group_size=last.group_size if last is not None else None,
            **ending,
        )
        if self.node is not None:
            summary.update(node_ranks=self.node.world_size, node_max_param_diff=self.node_max_diff)
        try:
            self.save_global_params()
        except checkpoint.GlobalParamsError as error:  # the rounds are done all the same: said so
            self.emit("done", **summary, global_params_error=str(error))
            raise
        self.emit("done", **summary)
        # The run's last word on a terminal, as the demo's "done" line (start and join ended on
        # "wrote the swarm's model ...": a review, stop 60).
        # The rounds this peer trained: a joiner that came at round 1410 said "done: 1446 rounds"
        # (the run's round), and one that trained none "1375 rounds" (a review, stop 64).
        trained = self.rounds_done // cfg.outer_method.syncs_per_round(cfg.fragments)
        logger.info(
            "%s: done: %s, eval loss %.4f -> %.4f, %.1f MB sent",
            self.name,
            rounds_said(trained, summary["outer_rounds"]),
            initial_eval,
            final_eval,
            self.stats.bytes_sent / 1e6,
        )
        return summary

    def save_global_params(self, *, stopped: bool = False, after: BaseException | None = None) -> None:
        """θ_global, the swarm's model (what the eval losses report), to ``<run-dir>/global_params.pt``
        (a temp file renamed over it): at the end of the run, and when the peer is ``stopped``, which
        is how a run without ``--rounds`` ends. Stopped mid-round, it is θ of the last round done;
        stopped before this session finished a round, or in the middle of changing θ, nothing is
        written (the file of an earlier session stays). ``after``: the error that stopped it (θ is
        then written only if every value is finite)."""
        if not self.run_dir or self.diloco is None:
            return
        if stopped and not self.rounds_done:
            # Stopped by an error (a refused --resume): that error is the one line to read.
            say = logger.info if after is None else logger.debug
            say("%s: stopped before a round ended: no global params written", self.name)
            return
        if not self.diloco.global_intact:
            logger.warning(
                "%s: stopped while θ was being updated: global_params.pt not written (the last "
                "checkpoint, or the file of an earlier run, stays)",
                self.name,
            )
            return
        settled = getattr(self.diloco, "settled_global", None) if stopped else None
        # Stopped: with the means a delayed or overlapped round still holds (finish() applies them).
        params = settled() if settled else self.diloco.read_global(lambda params: [p.clone() for p in params])
        if after is not None and not all(bool(torch.isfinite(p).all()) for p in params):
            logger.warning(
                "%s: stopped by an error with θ not finite: global_params.pt not written", self.name
            )
            return
        step = self.diloco.outer_step_count
        path = self.run_dir / "global_params.pt"
        temporary = path.with_name(path.name + ".tmp")
        with not_interrupted():
            try:
                torch.save(params, temporary)
                os.replace(temporary, path)
            except (OSError, RuntimeError) as error:  # torch says a full disk as "unexpected pos"
                raise checkpoint.GlobalParamsError(
                    f"could not write the swarm's model at outer step {step} to {path} "
                    f"({one_line(error)}; is the disk full?): free some space (an earlier "
                    f"{path.name} and the checkpoints in {self.run_dir} are kept)"
                ) from None
            finally:
                temporary.unlink(missing_ok=True)
        self.emit("global_params", path=str(path), outer_step=step)
        logger.info("%s: wrote the swarm's model at outer step %d to %s", self.name, step, path)

    def end_on_the_others_state(self) -> dict[str, Any]:
        """After the last round: stay (stage finishing) until the peers that averaged with this
        one and end at the same outer step hold its θ, taking theirs if most of them hold
        another (:mod:`swarm.ending`); at most a round wait. What happened, for the summary."""
        from swarm.ending import final_sketch, verdict

        step, started = self.diloco.outer_step_count, time.monotonic()
        deadline = started + self.averager.barrier.config.round_wait
        downloads = 0

        def sketch() -> list[float]:
            return self.diloco.read_global(lambda params: final_sketch(params, step))

        self.final_theta = sketch()
        while True:
            self.beat(Stage.FINISHING)
            vouched = set(self.averager.vouching.vouched)
            beats = self.board.fetch(include_leaving=True).values()
            ending = verdict(self.peer_id, self.final_theta, step, beats, vouched)
            if ending.action == "leave":
                break
            if self.settled != (ending.action == "settle"):
                self.settled = ending.action == "settle"
                if self.board is not None:  # at once, not at the next throttled beat: others wait on it
                    self.board.publish(self.heartbeat(), force=True)
            if time.monotonic() > deadline:
                logger.warning(
                    "%s: leaving without the others' agreement on the final θ: %s", self.name, ending.why
                )
                break
            if ending.action == "download" and downloads < FINAL_DOWNLOADS:
                downloads += 1
                logger.warning(
                    "%s: ended the run on another θ (%s); downloading theirs", self.name, ending.why
                )
                known = set(self.board.fetch(include_leaving=True)) | set(self.board.ignored)
                # Still "finishing" meanwhile: no round mate, nor a downloader to wait for.
                if self.download_state(
                    ending.why,
                    avoid=known - ending.holders,
                    at_step=step,
                    only=ending.holders,
                    stage=Stage.FINISHING,
                ):
                    self.final_theta = sketch()
                continue
            time.sleep(0.2)
        if ending.action == "leave" and not ending.agreeing and vouched:
            # Peers it averaged with that run on (a larger --rounds, or none: the run's owner)
            # have not left: said as such (every volunteer's --rounds run ended on "the peers it
            # averaged with had left" while the owner trained on: a review, stop 64).
            running_on = sorted(
                b.name
                for b in beats
                if b.peer_id in vouched and b.stage is not Stage.LEAVING and b.rounds != step
            )
            paused = sorted(b.name for b in beats if b.peer_id in vouched and b.stage is Stage.PAUSED)
            if paused and not running_on:
                # (It said "the peers it averaged with had left" of a peer the owner paused, a
                # review, stop 72: that peer trains on to the run's end once resumed.)
                logger.warning(
                    "%s: ended the run at outer step %d while %s, which it averaged with, %s paused by "
                    "the run's owner; its final θ is its own",
                    self.name,
                    step,
                    ", ".join(paused[:3]) + (f" and {len(paused) - 3} more" if len(paused) > 3 else ""),
                    "is" if len(paused) == 1 else "are",
                )
            elif running_on:
                logger.info(
                    "%s: done at outer step %d; %s, which it averaged with, run%s on past it",
                    self.name,
                    step,
                    ", ".join(running_on[:3])
                    + (f" and {len(running_on) - 3} more" if len(running_on) > 3 else ""),
                    "s" if len(running_on) == 1 else "",
                )
            else:
                # The peers it averaged with ended before it and left (a slower peer's last
                # rounds, alone): its θ is its own; said, not reported as the others' (a review).
                logger.warning(
                    "%s: ended the run alone at outer step %d: the peers it averaged with had left; "
                    "its final θ is its own",
                    self.name,
                    step,
                )
        return dict(
            ended_on_others_state=ending.action == "leave" and ending.agreeing > 0,
            ending_agreeing_peers=ending.agreeing,
            ending_downloads=downloads,
            ending_seconds=time.monotonic() - started,
        )

    # --- checkpoints -----------------------------------------------------------------------------

    def save_checkpoint(self) -> Path | None:
        """Everything needed to continue, atomically, in ``<run_dir>/checkpoint.pt``."""
        if self.run_dir is None:
            logger.warning("%s: a checkpoint was requested but this peer has no --run-dir", self.name)
            return None
        try:
            payload = checkpoint.training_state(self.diloco, self.model, self.inner_optimizer, self.batches)
        except RoundInFlight as why:  # the next one is tried at its time
            logger.warning(
                "%s: no checkpoint at outer step %d: %s (the earlier checkpoint stays)",
                self.name,
                self.diloco.outer_step_count,
                why,
            )
            return None
        # Ctrl+C during the save takes effect after its line and event (it came after the file
        # was written, and the peer stopped without saying it had written one).
        with not_interrupted():
            try:
                path = self._write_checkpoint(payload)
            # A full disk: the run goes on. (OSError: a backstop for a step of the save that
            # does not say it as a CheckpointError; one stopped the peer, a review of stop 69.)
            except (checkpoint.CheckpointError, OSError) as error:
                logger.error(
                    "%s: no checkpoint at outer step %d: %s; training goes on, and the next checkpoint "
                    "is tried at its time",
                    self.name,
                    self.diloco.outer_step_count,
                    error,
                )
                self.emit("checkpoint_failed", error=str(error), outer_step=self.diloco.outer_step_count)
                return None
            logger.info(
                "%s: wrote checkpoint %s at outer step %d", self.name, path, self.diloco.outer_step_count
            )
            self.emit("checkpoint", path=str(path), outer_step=self.diloco.outer_step_count)
        return path

    def _write_checkpoint(self, payload: dict[str, Any]) -> Path:
        return checkpoint.save(
            self.run_dir,
            {
                "run_id": self.config.peer.run_id,
                "owner": self.manifest.owner if self.manifest else None,  # which run of that id
                "fingerprint": self.fingerprint()[0],
                "summary": self.fingerprint()[1],
                "fingerprinted": self._fingerprinted,
                "name": self.name,
                **payload,
                "bytes": [self.stats.bytes_sent, self.stats.bytes_received, self.stats.dp_bytes],
                # The peers it last averaged with: resumed as a run's first peer, it waits for
                # them before training on alone (see run()).
                "mates": list(self.averager.vouching.mates) if self.averager is not None else [],
                "control_version": self.steering.version,
                "control_checkpoints": self.steering.checkpoints,
                "steered": dict(self.steering.settings),
                "schedule": self._schedule(),
            },
        )

    def _schedule(self) -> dict[str, float]:
        """The inner steps' settings a checkpoint keeps to say, when resumed with others, what
        changed (AdamW's own are said by checkpoint.load_moments; its lr is the schedule's)."""
        train = self.config.train
        return {
            "--inner-lr": train.inner_lr,
            "--warmup-steps": train.warmup_steps,
            "--grad-clip": train.grad_clip,
        }

    def resume(self, directory: str) -> None:
        """Continue from the checkpoint in ``directory`` (``--resume``): refuses another run or
        model. Its training state was put back as it was read (:meth:`_load_checkpoint`); here
        where its data stream and random generators were."""
        payload, path = self._checkpoint or self._load_checkpoint(directory)
        self._checkpoint = None
        checkpoint.restore_position(payload, self.batches)
        if changed := checkpoint.changed_flags(payload.get("schedule"), self._schedule()):
            logger.info("%s: %s", self.name, changed)  # as load_moments says AdamW's
        stats = self.stats
        stats.bytes_sent, stats.bytes_received, stats.dp_bytes = payload.get("bytes", [0, 0, 0])
        self.resumed_mates = joining.checked_mates(payload.get("mates"))
        self.averager.set_state_priority(self.diloco.outer_step_count)
        self._put_back_steering()
        logger.info("%s: resumed from %s at outer step %d", self.name, path, self.diloco.outer_step_count)
        self.emit("resumed_checkpoint", path=str(path), outer_step=self.diloco.outer_step_count)

    def _put_back_steering(self) -> None:
        """The run's owner, resumed from a checkpoint written after steering, trains with the
        steered settings; the DHT may hold them no longer (the record expired with the run, or
        another key owns the run now), and the join command it prints names the flags. Joiners
        then trained with other settings and fetched the state every round (30 downloads in
        25 s). So it publishes them again, from its next outer step."""
        from swarm.identity import key_hash
        from swarm.steering import Steering as Publisher
        from workbench.run.control import RETUNED

        settings = {k: v for k, v in self.steering.settings.items() if k in (*RETUNED, "round_seconds")}
        if not settings or self.manifest is None or self.manifest.owner != key_hash(self.store.public_key):
            return
        publisher = Publisher(self.store, self.keys, owner=self.manifest.owner, board=self.board)
        restored = self.steering.version
        try:
            current = publisher.current()
            if current is not None and current.version >= restored:
                return  # the owner's record holds these, or newer changes (applied as usual)
            # Numbered past the checkpoint's version: peers resumed from their own checkpoints
            # take only versions above the one they hold.
            control = publisher.publish(
                **settings, from_step=self.diloco.outer_step_count + 1, version=restored + 1
            )
        except SwarmError as error:
            logger.warning(
                "%s: could not publish the steered settings it resumed with (%s): joiners train with "
                "their own flags; steer them again with `workbench steer`",
                self.name,
                error,
            )
            return
        self.steering.version = control.version
        logger.info(
            "%s: published the steered settings it resumed with for the peers that join (control v%d, "
            "from outer step %d): %s",
            self.name,
            control.version,
            control.from_step,
            settings,
        )

    def _keep_records(self) -> None:
        """The run owner's peer stores the manifest and the steering record again every
        ``RECORDS_REFRESH`` seconds: stored once, they were gone after their 7 days, or sooner
        when the DHT nodes holding them left. The owner could then not steer (`workbench steer`:
        no manifest), and joiners went unchecked with steering off (or took a squatter's
        manifest for the run's). The steering record keeps the expiration its publisher gave
        it (a copy stored later with a later one would hide a newer version stored meanwhile),
        until half of it is gone."""
        from hivemind.utils import get_dht_time

        from swarm.identity import key_hash
        from swarm.manifest import MANIFEST_TTL
        from swarm.steering import CONTROL_TTL

        now = time.monotonic()
        if now - self._records_kept < RECORDS_REFRESH or self.manifest is None:
            return
        self._records_kept = now
        if self.manifest.owner != key_hash(self.store.public_key):
            return
        try:
            self.store.store(self.keys.manifest, self.manifest, ttl=MANIFEST_TTL)
            control = self.steering.watcher.latest if self.steering.watcher is not None else None
            if control is not None:
                version, expires = self._control_kept
                if version != control.version:  # as its publisher stored it
                    expires = control.time + CONTROL_TTL
                if expires - get_dht_time() < CONTROL_TTL / 2:
                    expires = get_dht_time() + CONTROL_TTL
                self._control_kept = (control.version, expires)
                self.store.store(self.keys.control, control, ttl=expires - get_dht_time())
        except SwarmError as error:  # fire and forget; the next refresh tries again
            logger.debug("%s: could not store the run's records again: %s", self.name, error)

    def _load_checkpoint(self, directory: str) -> tuple[dict[str, Any], Path]:
        return checkpoint.load_for(
            directory,
            run_id=self.config.peer.run_id,
            fingerprint=self.fingerprint()[0],
            summary=self.fingerprint()[1],
            fingerprinted=self._fingerprinted,
            # (an earlier release's checkpoint: its fingerprint left --aggregate out)
            also=(joining.fingerprint(self.config, self.model, before_aggregate=True)[0],),
            # A joiner's run is its owner's: a checkpoint of another owner's run of that id is
            # not resumed into it. (`start --resume` continues a run under this peer's key.)
            owner=self.manifest.owner if self.manifest and self.config.network.initial_peers else None,
            use=self._restore,
        )

    def _restore(self, payload: dict[str, Any], path: Path) -> None:
        """A checkpoint's training state into this peer; what fails here (a checkpoint of
        another release's structure, or edited) passes it over for the previous one
        (:func:`workbench.run.checkpoint.load`). Before, it was a traceback or a misleading
        line ("the downloaded state does not fit this model"), the previous one never tried."""

        def fits() -> None:
            checkpoint.check_parameters(self.model, path)
            step = self.diloco.outer_step_count
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"its outer step is {step!r}, not a count of rounds")

        checkpoint.resume_training(
            payload, self.steering, self.diloco, self.model, self.inner_optimizer, None, check=fits
        )

    def inner_step(self, x: torch.Tensor, y: torch.Tensor, info: dict[str, Any]) -> tuple[float, Any]:
        """One AdamW step; for data-parallel, with the swarm's mean gradient (and its report)."""
        raise_if_stopped()  # (a Ctrl+C lost in a destructor)
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
        if not math.isfinite(value):
            raise FloatingPointError(
                f"inner loss became {value} at outer step {self.diloco.outer_step_count}: lower --inner-lr"
            )
        return value, report

    # --- shutdown -----------------------------------------------------------------------------

    def close(self, reason: str) -> None:
        """Announce departure (best effort), then shut down the averager before the DHT."""
        release_interrupted_locks(*(self.outer.averagers if self.outer is not None else []))
        dht_alive = self.dht is not None and getattr(self.dht, "is_alive", lambda: True)()  # may be signalled
        if self.board is not None and self.peer_id and dht_alive:
            self.stage = Stage.LEAVING
            try:
                self.board.publish_now(self.heartbeat(), timeout=2.0)
            except Exception as error:
                logger.debug("could not announce leaving: %s", error)
        if self.announced:  # a peer refused before it started (a bad --resume) left nothing to say
            self.emit("left", reason=reason)
        if self.node is not None:
            try:
                self.node.stop()  # the followers return; their processes exit with ours
                self.node.close()
            except Exception as error:  # noqa: BLE001 - a follower already gone
                logger.debug("stopping the node's other ranks: %s", error)
            self.node = None
        if self.session is not None:
            self.session.close(*(self.outer.averagers if self.outer is not None else []))
        self.session = self.averager = self.dht = self.outer = None
        self.events.close()


def rounds_said(trained: int, reached: int) -> str:
    """The rounds a peer trained, for its last line, and the run's round it reached when that is
    another number (a joiner's)."""
    return f"{trained} rounds" + (f" (to the run's round {reached})" if trained != reached else "")


def run_peer(
    config: RunConfig, *, on_started: Callable[[list[str], Path, bool], None] | None = None
) -> dict[str, Any]:
    """Run a peer in the main thread; Ctrl+C, SIGTERM or SIGHUP stops it cleanly within seconds."""
    with stopped_by_signals():  # SIGTERM, SIGHUP (a closed terminal): like Ctrl+C
        stop_with_launcher()  # started by the local lab: also when the lab is gone
        peer = Peer(config, on_started=on_started)
        try:
            summary = peer.run()
            close_within(peer.close, "finished")
            return summary
        except KeyboardInterrupt:
            stopping_now()
            try:
                peer.save_global_params(stopped=True)
            except KeyboardInterrupt:  # a second Ctrl+C waited for the file: it is whole
                pass
            except Exception as error:  # noqa: BLE001 - a full disk: still leave the swarm cleanly
                logger.error("could not write the global params: %s", error)
            close_within(peer.close, "interrupted")
            raise
        except Exception as failure:
            # θ_global is the swarm's model, whatever stopped this peer (an inner loss of NaN
            # never touches it; a heartbeat that cannot be published neither): kept as a Ctrl+C
            # keeps it (it was lost, hours into a run without --rounds). A stop signal meanwhile
            # is dropped: the peer is stopping already (torchrun sends SIGTERM to every rank as
            # soon as one dies, and it cut the write short, "could not write the global params: ",
            # a review, stop 64).
            stopping_now()
            with not_interrupted(deliver=False):
                try:
                    if not isinstance(failure, checkpoint.GlobalParamsError):  # (not twice)
                        peer.save_global_params(stopped=True, after=failure)
                except Exception as error:  # noqa: BLE001 - the first failure is the one to report
                    logger.error(
                        "could not write the global params: %s", one_line(error) or type(error).__name__
                    )
                close_within(peer.close, "error")
            raise
        except BaseException:
            close_within(peer.close, "error")
            raise
