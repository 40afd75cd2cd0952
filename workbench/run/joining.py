"""Joining a run: the run exists, it trains the same model with the same optimizer settings
(the manifest's fingerprint), and ``--min-peers`` are there before the first round."""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

from swarm.claims import MAX_MATES
from swarm.errors import SwarmError
from swarm.manifest import model_fingerprint
from swarm.records import PEER_ID_PATTERN, RunKeys, RunManifest, Stage
from workbench.config import RunConfig

logger = logging.getLogger(__name__)


RUN_WAIT = (3.0, 10.0)
"""Seconds a joiner waits for a live peer of its run: its --connect-timeout, within these."""


def check_run_exists(
    board: Any,
    run_id: str,
    connect_timeout: float = RUN_WAIT[1],
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """A joiner must find at least one live peer of the run, or the run id is wrong. It waits
    ``connect_timeout`` seconds, within :data:`RUN_WAIT` (a live peer's heartbeat is read at
    once; the floor leaves the DHT a moment to answer)."""
    timeout = min(max(connect_timeout, RUN_WAIT[0]), RUN_WAIT[1])
    deadline = clock() + timeout
    while clock() < deadline:
        if board.fetch():
            return
        sleep(0.3)
    gone = board.fetch(include_leaving=True)
    if gone:  # their last heartbeats said "leaving" (within their expiration): the run is ending
        step = max(p.outer_step for p in gone.values())
        done = all(p.done for p in gone.values())
        raise SwarmError(
            f"run '{run_id}' is over: its last {len(gone)} peer(s) left at outer step {step}"
            + (" after their last round" if done else "")
            + ": there is nothing to join (start a new run with `workbench start`, or resume "
            "from a checkpoint with --resume)"
        )
    raise SwarmError(
        f"connected to the swarm, but no live peer of run '{run_id}' answered within "
        f"{timeout:.0f} s: check that --run-id and --secret match the run's (a private run's "
        "peers are invisible without its secret, and a wrong one looks like no run at all)"
    )


def fingerprint(config: RunConfig, model: Any, *, before_aggregate: bool = False) -> tuple[str, str]:
    """(fingerprint, summary) of a peer's model and the optimizer settings all peers share.
    ``before_aggregate``: as releases before stop 62 computed it (without ``--aggregate``): a
    trimmed-mean peer's checkpoint of one still resumes."""
    from workbench.cli.optimizer_flags import canonical

    optimizer = dict(
        method=config.method,
        fragments=config.fragments if config.outer_method.fragmented else None,
        outer=dataclasses.asdict(canonical(config.diloco)),  # the knobs it uses: as its join command says
        compression=config.averaging.compression,
    )
    if config.outer_method.fragmented:  # τ and α: whose clock leads, and how fragments merge
        optimizer["schedule"] = dict(sync_delay=config.sync_delay, alpha=config.alpha)
    if config.averaging.aggregate != "mean" and not before_aggregate:
        # A trimmed-mean peer in a mean run was let in: its group's means differed from the
        # others', it downloaded the state 18 times in 10 rounds and ended on another θ (a
        # review). Only when not the mean: a mean run's fingerprint (its checkpoints') is as before.
        optimizer["aggregate"] = config.averaging.aggregate
    # What differs between two peers' optimizer settings most often, in words: the refusal shows
    # both summaries (streaming's F, τ, α and the wire codec read alike in both before, a review).
    extra = ""
    if config.outer_method.fragmented:
        extra += f" F={config.fragments} tau={config.sync_delay}"
        extra += f" alpha={config.alpha}" if config.alpha is not None else ""
    if config.averaging.compression != "none":
        extra += f" wire {config.averaging.compression}"
    if config.averaging.aggregate != "mean":
        extra += f" {config.averaging.aggregate}"
    summary = (
        f"{type(model).__name__} {model.num_params() / 1e6:.2f}M params, block size {config.model.block_size}, "
        f"{config.method} "
        f"H={config.diloco.inner_steps} outer lr {config.diloco.outer_lr} codec {config.diloco.codec}{extra}"
    )
    return model_fingerprint(model, optimizer), summary


FRAGMENTED = ("fragments", "sync_delay", "alpha")
"""Settings the fingerprint covers for a streaming run, beside the method, the wire codec, the
aggregation and the outer optimizer's (``diloco.*``)."""


def fingerprinted_flags(config: RunConfig, model: Any) -> dict[str, str]:
    """What :func:`fingerprint` covers, by flag (``{"--update-codec": "int8", ...}``, the model as
    ``model``): a refused ``--resume`` names the flags that differ."""
    from workbench.cli.optimizer_flags import canonical
    from workbench.settings.commands import command_settings

    shown = dataclasses.replace(config, diloco=canonical(config.diloco))  # as the fingerprint takes it
    flags = {
        "model": f"{type(model).__name__} {model.num_params()} params, block size {config.model.block_size}",
        "--method": config.method,
    }
    taken = (
        "averaging.compression",
        "averaging.aggregate",
        *(FRAGMENTED if config.outer_method.fragmented else ()),
    )
    for item in command_settings("start").values():
        if item.target and (item.target in taken or item.target.startswith("diloco.")):
            flags[item.flag] = str(item.read(shown))
    return flags


def settle_manifest(
    config: RunConfig, store: Any, keys: RunKeys, model: Any, name: str
) -> RunManifest | None:
    """The first peer publishes the run manifest (and becomes the owner named in the join
    command); a joiner finds it and refuses a run with another model. None: a joiner found no
    manifest (its owner left?), so nothing is checked and steering is off."""
    from swarm.identity import key_hash
    from swarm.manifest import check_fingerprint, find_manifest, owner_mismatch, publish_manifest

    fingerprint_, summary = fingerprint(config, model)
    if not config.network.initial_peers:
        manifest = RunManifest(
            run_id=config.peer.run_id,
            owner=key_hash(store.public_key),
            fingerprint=fingerprint_,
            summary=summary,
            created=time.time(),
        )
        publish_manifest(store, keys, manifest)
        config.peer.owner = manifest.owner  # the join command names it: joiners trust only this owner
        return manifest
    manifest = find_manifest(store, keys, owner=config.peer.owner)
    if manifest is None:
        wrong = owner_mismatch(store, keys, config.peer.owner)
        if wrong:  # a run is there, owned by someone else than the join command says
            raise SwarmError(wrong)
    if manifest is None:
        logger.warning(
            "%s: run '%s' has no manifest in the DHT (its owner left?): cannot check the model "
            "fingerprint, and steering is off for this peer",
            name,
            config.peer.run_id,
        )
    else:
        check_fingerprint(manifest, fingerprint_, summary)
    return manifest


def download_state(
    averager: Any,
    rounds: Any,
    *,
    emit: Callable[..., None],
    name: str,
    run_id: str,
    reason: str,
    avoid: Iterable[str] = (),
    at_step: int | None = None,
    only: Iterable[str] | None = None,
    oldest_unconfirmed: int | None = None,
    keep_own: bool = False,
) -> bool:
    """Adopt the global state of the most advanced peer whose θ the others confirm (three
    tries, a second apart); False if nobody could serve it. ``avoid``: peers not to take it from
    (nor ask about it): they hold the θ this peer is leaving. ``at_step``: only a state at that
    outer step; ``only``: from these donors only; ``oldest_unconfirmed``: a state at an earlier
    outer step only if another peer at its step confirms it. ``keep_own``: a state that is this
    peer's own θ at its own step (a peer resumed from a checkpoint, its swarm resumed where
    it was too) is not loaded: loading it dropped what only the checkpoint holds (error
    feedback's residuals, the eager stand-in, streaming's fragments not synced yet, its AdamW)."""
    from workbench.run.progress_bar import progress

    started = time.monotonic()
    for attempt in range(3):
        title = f"{name}: downloading the global state ({reason})"
        with progress(title, total=1.0, unit="share") as bar:

            def show(share: float | None, bar=bar, title=title) -> None:
                donors = averager.download_donors()
                bar.show(share, f"{title} from {donors} donors" if donors > 1 else None)

            averager.on_download = show
            try:
                state = averager.download_state(
                    avoid=avoid,
                    at_step=at_step,
                    only=only,
                    since=rounds.outer_step_count,
                    oldest_unconfirmed=oldest_unconfirmed,
                )
            finally:
                averager.on_download = None
        if state is not None and keep_own and holds(rounds, state):
            logger.info(
                "%s: the swarm holds this peer's own θ at outer step %d: it goes on from its checkpoint",
                name,
                state.outer_step,
            )
            emit("state_confirmed", outer_step=state.outer_step, reason=reason)
            return True
        if state is not None:
            try:
                rounds.load_outer_state(state)
            except ValueError as error:
                raise SwarmError(
                    f"run '{run_id}' trains another model: {error} (use the --model and flags from the run's join command)"
                ) from None
            averager.set_state_priority(state.outer_step)
            seconds = time.monotonic() - started
            logger.info(
                "%s: downloaded the global state at outer step %d (%s, %.1f s)",
                name,
                state.outer_step,
                reason,
                seconds,
            )
            emit(
                "state_downloaded",
                outer_step=state.outer_step,
                reason=reason,
                seconds=seconds,
                optimizer_tensors=len(state.inner),  # AdamW's moments, from a donor past its first round
            )
            return True
        logger.info("%s: no peer served the state yet (attempt %d of 3)", name, attempt + 1)
        time.sleep(1.0)
    return False


def holds(rounds: Any, state: Any) -> bool:
    """Whether ``rounds`` holds ``state``'s θ at its outer step (up to the rounding by which
    peers' θ differ on hivemind's path, about 1e-6 of a tensor's scale)."""
    import torch

    if state.outer_step != rounds.outer_step_count or len(state.params) != len(rounds.global_params):
        return False
    for mine, theirs in zip(rounds.global_params, state.params):
        if mine.shape != theirs.shape:
            return False
        scale = float(mine.abs().max()) if mine.numel() else 0.0
        if not bool(torch.allclose(mine, theirs.to(mine.dtype), rtol=0.0, atol=1e-5 * scale + 1e-12)):
            return False
    return True


def checked_mates(value: Any) -> list[str]:
    """A checkpoint's round mates: peer ids (a file from an earlier release has none; anything
    malformed is none)."""
    if not isinstance(value, list):
        return []
    return [m for m in value[:MAX_MATES] if isinstance(m, str) and re.fullmatch(PEER_ID_PATTERN, m)]


def wait_for_mates(
    board: Any, beat: Callable[[Stage], None], mates: list[str], *, timeout: float, name: str
) -> bool:
    """Whether one of ``mates`` (peer ids: a heartbeat under one is that peer's own, signed) is
    live within ``timeout`` seconds: the run's first peer, resumed, waits for the round mates it
    recorded to come back to its address. False at once without mates."""
    if not mates or timeout <= 0:
        return False
    logger.info(
        "%s: resumed from a checkpoint of a run with other peers: waiting up to %.0f s for one of "
        "the %d it last averaged with",
        name,
        timeout,
        len(mates),
    )
    deadline, wanted = time.monotonic() + timeout, set(mates)
    while True:
        beat(Stage.JOINING)
        if wanted & set(board.fetch()):
            return True
        if time.monotonic() > deadline:
            logger.info(
                "%s: none of them came back within %.0f s: it trains on from its checkpoint", name, timeout
            )
            return False
        time.sleep(0.5)


def wait_for_peers(
    board: Any, beat: Callable[[Stage], None], *, wanted: int, timeout: float, name: str
) -> None:
    """``--min-peers``: wait until ``wanted`` peers (this one included) can train.

    A peer still downloading the state does not count yet: starting without it would put
    this peer a round ahead by the time the download lands, and with ``--overlap`` the
    first round would then be averaged alone (the state served to the newcomer waits for
    that round's mean, so the newcomer cannot be waited for)."""
    if wanted <= 1:
        return
    start = time.monotonic()
    deadline, told = start + timeout, start - 15.0  # said at once, then every 15 s
    while True:
        beat(Stage.JOINING)
        present = sum(p.stage is not Stage.DOWNLOADING for p in board.fetch().values())
        if present >= wanted:
            return
        if time.monotonic() - told >= 15.0:  # up to --min-peers' 120 s said nothing at all
            told = time.monotonic()
            logger.info(
                "%s: waiting for --min-peers %d: %d peer(s) here so far (%.0f s left before starting anyway)",
                name,
                wanted,
                present,
                deadline - told,
            )
        if time.monotonic() > deadline:
            logger.warning(
                "%s: only %d of %d peers after %.0f s; starting anyway", name, present, wanted, timeout
            )
            return
        time.sleep(0.3)


def steps_this_round(
    board: Any,
    peer_id: str,
    outer_step: int,
    steps: int,
    vouched: Collection[str] = (),
    *,
    in_step: bool = False,
) -> int:
    """``steps`` (H), or fewer for a peer that joined mid-round, so that it reaches the barrier
    with the others training this round (from their heartbeats). ``in_step``: this peer
    averaged with its round mates last round (and downloaded nothing since), so it starts this
    round with them: all of it. (A mate's heartbeat published a step into the round, as its
    serving a joiner republishes it at once, cut such a peer's round by that step, and its
    weight with it: group weights 40:64 for 40:80, and a run that drifted from the simulator.)

    A heartbeat's inner step is a claim: the most advanced of the peers that averaged with this
    one is believed; otherwise the median of the others (a fresh key claiming to be at step H-1
    alone would cut a joiner's first round to one step and its update to noise)."""
    if in_step:
        return steps
    training = [
        p
        for p in board.fetch().values()
        if p.peer_id != peer_id and p.outer_step == outer_step and p.stage is Stage.TRAINING
    ]
    mates = [p.inner_step for p in training if p.peer_id in vouched]
    if mates:
        return max(1, steps - max(mates))
    claims = sorted(p.inner_step for p in training)
    return max(1, steps - claims[(len(claims) - 1) // 2]) if claims else steps


def peer_batches(config: RunConfig, corpus: Any, peer_id: str):
    """A peer's stream of training batches: its shard (``--shard i/n``, the same stream
    ``optim.sim`` gives virtual peer i), or its own stream seeded by the run seed and its id."""
    block, batch = config.model.block_size, config.data.batch_size
    shard = config.peer.shard
    if shard is not None and corpus.presharded:  # a dataset sharded by record
        return corpus.batches(block_size=block, batch_size=batch, seed=config.peer.seed + shard)
    if shard is not None:
        return corpus.batches(
            block_size=block,
            batch_size=batch,
            seed=config.peer.seed,
            shard=shard,
            num_shards=config.peer.num_shards,
        )
    # Each peer draws from its own stream: seed mixed with the peer id.
    seed = (config.peer.seed * 1_000_003 + int.from_bytes(peer_id.encode()[-8:], "little")) % 2**62
    return corpus.batches(block_size=block, batch_size=batch, seed=seed)


def follower_batches(config: RunConfig, corpus: Any, rank: int, node: str):
    """The batches of rank ``rank`` of a torchrun node (``node``: what tells this node from the
    others, see :func:`workbench.run.node.follow`): from the node's shard of the data, as its
    rank 0 (the peer) reads it, in a stream of its own. Followers read the whole training split
    whatever --shard said, and rank 1 of every node with the same --seed drew the same batches."""
    import zlib

    block, batch = config.model.block_size, config.data.batch_size
    seed = (config.peer.seed * 1_000_003 + 7919 * rank + zlib.crc32(node.encode())) % 2**62
    shard = config.peer.shard
    if shard is not None and not corpus.presharded:
        return corpus.batches(
            block_size=block, batch_size=batch, seed=seed, shard=shard, num_shards=config.peer.num_shards
        )
    return corpus.batches(block_size=block, batch_size=batch, seed=seed)  # a dataset: sharded by record
