"""Averaging pseudo-gradients over a real swarm with hivemind's DecentralizedAverager.

One round, as :meth:`SwarmAverager.all_reduce` runs it:

1. **Barrier** (:mod:`swarm.barrier`). Announce "waiting" and wait (at most ``round_wait``
   seconds) until every live peer at the same outer step has finished its inner steps.
   Without it the first peer to finish would average with whoever happens to be matchmaking
   and the swarm would split into groups holding different global params.
2. **Matchmaking + all-reduce.** ``step(scheduled_time=now + window)``: peers that passed the
   barrier within that window form one group, as soon as every round mate the barrier saw
   ready has joined (else when the window ends); the weighted mean replaces the tensors. Each
   member's ``info`` (outer step, fingerprint of θ) is all-gathered. The window is learned
   from how long the last groups took to form (``matchmaking_time`` at most).
3. **Fallback.** No group (a lone peer) or a failed round: keep this peer's own tensors and
   say so in the report; the outer step is then a local one.

Serving state to late joiners: hivemind calls :meth:`get_current_state` in a background
thread of this process; the ``state_provider`` must return a consistent copy.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any  # noqa: UP035 - hivemind reads typing's name to detect streams

import torch
from hivemind.compression import (
    Float16Compression,
    NoCompression,
    Uniform8BitQuantization,
)

from optim.averager import RoundReport
from optim.diloco import OuterState
from swarm.averaging_config import CODEC_BYTES, AveragingConfig
from swarm.barrier import DOUBT_ROUNDS, RoundBarrier, Serving, Verdict
from swarm.claims import CLAIM_LAG, STRIKES, Vouching
from swarm.deadlines import LearnedDeadline, matchmaking_window
from swarm.dht import quiet_children
from swarm.download import Downloading
from swarm.group_averager import GroupAverager, fault_value
from swarm.hivemind_fixes import stopping
from swarm.progress import ProgressBoard
from swarm.records import PROTOCOL, PeerHeartbeat, RunKeys, Stage

logger = logging.getLogger(__name__)

MAX_SILENT = 1024
"""Silent leaders remembered (their round): fresh keys are free."""
MISSED_RINGS = 2
"""A member that never came to a ring of this peer's group is left out of the round from its
second time running (:meth:`SwarmAverager._count_miss`, :meth:`SwarmAverager._blame_spoilers`)."""
MISS_WINDOW = 2
"""Misses "running" are at most this many rounds apart: a key that got into one group of this
peer's in two (its join busy with the last group) and spoiled each was never twice running at
1, and a leader paid the senders' timeout (10 s) every other round (stop 71)."""

# wire codec name -> hivemind codec
CODECS: dict[str, Callable[[], Any]] = {
    "none": NoCompression,
    "fp16": Float16Compression,
    "int8": Uniform8BitQuantization,
}
assert set(CODECS) == set(CODEC_BYTES), f"{set(CODECS)=} {set(CODEC_BYTES)=}"


def _peer_name(peer: Any) -> str:
    """A hivemind PeerID in base58 (what heartbeats and the gathered info call a peer)."""
    return peer.to_base58() if hasattr(peer, "to_base58") else str(peer)


class SwarmAverager(Downloading):
    """An :class:`optim.Averager` over hivemind; also downloads and serves the global state."""

    keeps_tensors_on_failure = True
    syncs_apart = 1  # (set per averager in __init__; here for bare objects in tests)
    began_allreduce = False
    """Whether the last attempt's group formed and began its all-reduce (:meth:`_attempt`)."""
    """Each attempt averages a copy in hivemind's buffers; the caller's tensors get the mean only
    once an attempt succeeded (optim.averager.Averager)."""

    def __init__(
        self,
        dht,
        *,
        keys: RunKeys,
        tensors_like: Sequence[torch.Tensor],
        board: ProgressBoard,
        beat: Callable[[Stage | None], None],
        state_provider: Callable[[], OuterState],
        config: AveragingConfig,
        theta_provider: Callable[[], OuterState] | None = None,
        client_mode: bool = False,
        group: str = "diloco",
        serve_state: bool = True,
        fault_file: str | None = None,
        plane_host: str = "127.0.0.1",
        plane_advertise: str | None = None,
        overlapped: bool = False,
        serving: Serving | None = None,
        vouching: Vouching | None = None,
        masks: int = 0,
        state_shapes: Sequence[Sequence[int]] | None = None,
        syncs_apart: int = 1,
    ) -> None:
        """``masks``: the last tensors of ``tensors_like`` are kept-masks (``--topk-mean kept``),
        scaled in the group's all-reduce like the updates beside them (gathered.mask_scale).
        ``state_shapes``: the shapes of the model's parameters (θ): a downloaded state in other
        shapes is a malformed donor's (None: not checked here; the model refuses it later).
        ``syncs_apart``: the outer steps (syncs) between two rounds of this averager's group
        (streaming's fragments: F, one fragment a sync). ``tensors_like`` may be meta tensors:
        only their shapes are read. The state is served
        (``serve_state``) once :meth:`start_serving` says the state provider can answer."""
        self.dht = dht
        self.board = board
        self.serving = serving if serving is not None else Serving()
        self.on_download: Callable[[float | None], None] | None = None
        """Told the download's progress every 50 ms while it runs (a terminal's progress bar)."""
        """Set while this peer answers a state request (see the overlapped barrier)."""
        state_provider = self.serving.wrap(state_provider)
        if theta_provider is not None:  # the state less the inner optimizer's: what a witness sketches
            theta_provider = self.serving.wrap(theta_provider)
        self.overlapped = overlapped
        """Rounds run in the background (DiLoCo's ``overlap``): a peer's heartbeat shows the
        round it trains, one past the round it averages, and this thread leaves its stage alone."""
        self.lag = int(overlapped)
        """How far a round mate's clock is past the round being averaged."""
        # Overlapped, this thread only keeps the heartbeat alive (beat(None)): the main thread
        # may wait for this round longer than a heartbeat lives.
        self.beat = (lambda stage: beat(None)) if overlapped else beat
        self.config = config
        self._serves_state = serve_state and not client_mode
        self.peer_id = dht.peer_id.to_base58()
        self.vouching = vouching if vouching is not None else Vouching()
        if board is not None:  # round mates stay among the peers it redials
            board.vouched = self.vouching.vouched
        """Peers that averaged with this one in a verified round: their claims are believed (one
        for all of a peer's averagers: streaming's fragments share it)."""
        self._refused_donors: set[str] = set()
        self._silent_leaders: dict[str, int] = {}  # peer id -> the round it spoiled a group in (left out)
        self._missed: OrderedDict[str, tuple[int, int]] = OrderedDict()
        """peer id -> (the rings of this averager's groups it never came to, running, the round of
        the last): see :meth:`_count_miss` (each of streaming's fragments counts its own: one
        stall in two fragments' groups is once in each)."""
        self._no_shows_until = -1
        """Before this outer step, a round whose only mates are strangers is not retried: a
        round failed with only strangers "ready" at its step, none of whom came to a group (set
        then, for DOUBT_ROUNDS rounds, renewed while they keep not coming; cleared by a round
        averaged). One fresh key's heartbeat "waiting" beside a lone peer held each of its
        rounds to the averaging deadline (28 s of 30), retrying (a red-team review, stop 59);
        now that costs one round, then one attempt a round, which gives them the matchmaking
        window, not the deadline (stop 67: it waited to the deadline, every round), and no
        download: strangers doubted so averaged with nobody here, so a failed round with them
        does not make this peer's θ stale (:meth:`_failed`)."""
        self.state_shapes = None if state_shapes is None else [tuple(s) for s in state_shapes]
        self.syncs_apart = syncs_apart
        self._last_download: tuple[str, int] | None = None  # (donor, outer step): see download_state
        self.barrier = RoundBarrier(
            board=board,
            peer_id=self.peer_id,
            beat=self.beat,
            config=config,
            overlapped=overlapped,
            vouching=self.vouching,
            serving=self.serving,
        )
        self._last_return = time.monotonic()
        self.averaging_deadline = LearnedDeadline(
            ceiling=config.averaging_timeout,
            floor=min(config.averaging_timeout, max(15.0, 5 * config.matchmaking_time)),
            factor=3.0,
            margin=2 * config.matchmaking_time + 2.0,
        )
        """How long a round's matchmaking and all-reduce may take: learned from the last
        successful rounds (``averaging_timeout`` until 5 were seen, and never more)."""
        self.matchmaking_window = matchmaking_window(config.matchmaking_time)
        self.formed_after = 0.0
        """How long the last successful attempt's group took to form (s)."""
        self.corrupt_next = False
        """Testing: send NaN instead of this peer's update in the next round (a faulty peer)."""
        self.scale_next = 0.0
        """Testing: multiply the next update sent by this factor (a peer lying about its update)."""
        self.claim_next = 0.0
        """Testing: claim this weight (samples) in the next round (a peer lying about its weight)."""
        codec, self.bytes_per_element = CODECS[config.compression], CODEC_BYTES[config.compression]
        # Not zeros_like: of a meta tensor it imports torch's meta registrations and sympy, about
        # 0.4 s of every peer's start.
        buffers = [torch.zeros(t.shape, dtype=torch.float32, device="cpu") for t in tensors_like]
        self.numel = sum(b.numel() for b in buffers)
        plane = config.data_plane
        if keys.secret and plane == "direct":
            # gloo's TCP pairs are not encrypted: a private run's updates stay on hivemind's
            # path, which its daemon encrypts (TLS 1.3). The cost is in docs/performance.md.
            logger.info("private run: averaging over hivemind's encrypted path, not the direct plane")
            plane = "hivemind"
        handler = signal.getsignal(signal.SIGINT)
        self.averager = GroupAverager(
            buffers,
            dht,
            prefix=keys.group(group),  # peers average only with the same group name and shapes
            state_provider=state_provider,
            theta_provider=theta_provider,
            fault_file=fault_file,
            masks=masks,
            data_plane=plane,
            aggregate=config.aggregate,
            plane_host=plane_host,
            plane_advertise=plane_advertise,
            codec=config.compression,
            ready_snapshots=not overlapped,  # see StateSharing._init_state_sharing
            donor_subkey=getattr(getattr(board, "store", None), "subkey", None),  # this peer's signed key
            members_key=keys.peers if keys.secret else None,  # a private run's state: its peers' only
            state_numel=None if state_shapes is None else sum(math.prod(s) for s in state_shapes),
            # The shortest window; each step asks for the learned one (scheduled_time).
            min_matchmaking_time=self.matchmaking_window.floor,
            request_timeout=max(3.0, config.matchmaking_time),
            allreduce_timeout=config.averaging_timeout,
            next_chunk_timeout=min(10.0, config.averaging_timeout),
            compression=codec(),
            state_compression=NoCompression(),
            client_mode=client_mode,
            allow_state_sharing=False,  # until start_serving: the state provider has no state yet
            declare_state_period=10,
            shutdown_timeout=3,
            start=False,
        )
        try:
            # hivemind makes the calling process ignore SIGINT here (averager.py: signal(SIGINT,
            # SIG_IGN)) and would leave Ctrl+C dead for the rest of the run: restore it.
            with quiet_children():
                self.averager.run_in_background(await_ready=True, timeout=30)
        finally:
            signal.signal(signal.SIGINT, handler)

    # --- one round --------------------------------------------------------------------------

    def all_reduce(
        self, tensors: Sequence[torch.Tensor], *, weight: float, info: dict[str, Any] | None = None
    ) -> RoundReport:
        info = dict(info or {}, peer=self.peer_id, arrived=time.time())  # wall clock: the others read it
        self.barrier.gap = time.monotonic() - self._last_return
        try:
            return self._round(tensors, weight=weight, info=info)
        finally:
            self._last_return = time.monotonic()

    def _round(self, tensors: Sequence[torch.Tensor], *, weight: float, info: dict[str, Any]) -> RoundReport:
        cut_off = fault_value(self.averager._fault_file, "alone_from_step")  # testing: a partition
        if cut_off and int(info.get("outer_step", 0)) + 1 >= cut_off:
            return self._alone(info, "fault injection: cut off from the others' groups")
        verdict = self.wait_for_round_mates(int(info.get("outer_step", 0)))
        if verdict is not Verdict.AVERAGE:
            report = self._alone(info, verdict.value)
            report.stale = verdict is Verdict.BEHIND
            report.ahead = dict(self.barrier.ahead)
            return report
        if self.claim_next:  # fault injection: a peer lying about its weight, in every attempt
            weight, self.claim_next = self.claim_next, 0.0
            info = dict(info, weight=weight)
            logger.warning("fault injection: claiming %g samples this round", weight)
        started = time.monotonic()
        budget = self.averaging_deadline.seconds
        deadline = started + budget
        attempt, direct_before = 0, self.averager.direct_rounds.value
        while True:
            attempt += 1
            gathered, error = self._attempt(tensors, weight, info, deadline, attempt)
            self._blame_spoilers(int(info.get("outer_step", 0)))  # (found by a success too)
            if gathered:
                break
            # We retry here rather than let hivemind do it: hivemind retries on the buffers as a
            # failed all-reduce left them (half averaged) and would report a wrong mean as a
            # success. Each attempt starts from this peer's own Δ; retry only while the others
            # of this round are still averaging, and while time is left.
            outer_step = int(info.get("outer_step", 0))
            others = [p for p in self.board.fetch().values() if p.peer_id != self.peer_id]
            moved_on = any(p.outer_step > outer_step + self.lag and not p.done for p in others)
            mates = self._ready_mates(others, outer_step)
            strangers = bool(mates) and not any(p.peer_id in self.vouching.vouched for p in mates)
            doubted = self._doubted([p.peer_id for p in mates], outer_step)  # they came to no group before
            if doubted or not mates or deadline - time.monotonic() < self.config.matchmaking_time + 1.0:
                if strangers:  # (renewed while they keep not coming)
                    self._no_shows_until = outer_step + 1 + DOUBT_ROUNDS
                elif mates and self.began_allreduce and budget < self.averaging_deadline.ceiling:
                    # Out of the learned time in an all-reduce (its group formed) with round mates
                    # still averaging: learn anew from the ceiling (as the barrier does). Learned
                    # from successes only, a few fast rounds taught 15 s, and once honest
                    # all-reduces needed 20 s (a slower link, congestion) every round failed at
                    # 15 s, for the rest of the run (a review, stop 72). The price: until 5 rounds succeed again, a round that
                    # fails anyway (for another reason) fails at the timeout, not the learned time
                    # (a review of the fix: rounds failing 1 in 2, 405 s in 20 rounds for 225 s).
                    # Not for a group that never formed: a mate that died, its heartbeat not yet
                    # expired, would have the next rounds wait the whole timeout for it.
                    self.averaging_deadline.forget()
                if doubted:
                    # Strangers that keep not coming averaged with nobody here: this peer's θ is
                    # not presumed stale on their account (one key sorting first sent a lone peer
                    # to download after every such round), nor on a stranger's claim to be ahead.
                    moved_on = self.barrier.believed_ahead(
                        lambda p, step=outer_step: p.outer_step > step + self.lag and not p.done,
                        others,
                        outer_step=outer_step,
                    )
                return self._failed(
                    info, error, mates=[] if doubted else [p.peer_id for p in mates], moved_on=moved_on
                )
            logger.debug("round %d: attempt %d failed (%s); retrying", outer_step + 1, attempt, error)
        self.averaging_deadline.observe(time.monotonic() - started)
        self._no_shows_until = -1
        # Success: the buffers now hold the group's weighted mean. Its members (hivemind's
        # authenticated peer ids, not what they wrote in their info) are vouched for.
        members = [peer.to_base58() for peer in gathered if hasattr(peer, "to_base58")]
        self.vouching.averaged_with(members, me=self.peer_id)
        for member in members:  # it came: its missed rings are forgiven
            self._missed.pop(member, None)
        self._refused_donors.difference_update(members)  # on this θ now: a donor again
        with self.averager.get_tensors() as buffers:
            for buffer, tensor in zip(buffers, tensors):
                tensor.copy_(buffer)
        group = len(gathered)
        payload = self.numel * self.bytes_per_element
        # Butterfly all-reduce: each peer sends (n-1)/n of its vector and receives (n-1)/n of
        # each partner's part (reduce-scatter), then the same again for the results (all-gather).
        moved = int(2 * payload * (group - 1) / group)
        return RoundReport(
            group_size=group,
            bytes_sent=moved,
            bytes_received=moved,
            # Each member's info under the peer id hivemind authenticated, not the one it wrote
            # (a member that copied another's id once emptied the robust check's median).
            group_info=[
                dict(data, peer=_peer_name(peer)) for peer, data in gathered.items() if isinstance(data, dict)
            ],
            robust_mean=self.config.aggregate == "trimmed-mean",
            matchmaking_seconds=self.formed_after,
            plane="direct" if self.averager.direct_rounds.value > direct_before else "hivemind",
        )

    def _attempt(
        self,
        tensors: Sequence[torch.Tensor],
        weight: float,
        info: dict[str, Any],
        deadline: float,
        attempt: int = 1,
    ) -> tuple[dict[Any, Any] | None, str]:
        """One matchmaking + all-reduce from this peer's own tensors; (gathered, why it failed)."""
        from hivemind.utils import get_dht_time

        self.beat(Stage.AVERAGING)
        # A retry waits out the whole window: whoever the barrier expected did not all come.
        window = self.matchmaking_window.seconds if attempt == 1 else self.config.matchmaking_time
        # Bounded: a ring of an earlier round may still hold the buffers (a ring mate that sends
        # its part just fast enough for gloo's per-segment timeout keeps it going for many times
        # the round's); this step then fails at its deadline, heartbeats going on, rather than
        # waiting on the lock for as long as that mate likes.
        lock = self.averager.lock_averaged_tensors
        while not lock.acquire(timeout=1.0):
            self.beat(Stage.AVERAGING)
            if time.monotonic() > deadline:
                return None, "the ring of an earlier round still holds this peer's buffers"
        try:
            buffers = self.averager._averaged_tensors  # noqa: SLF001 - what get_tensors() yields, under its lock
            for buffer, tensor in zip(buffers, tensors):
                buffer.copy_(tensor)
            self.averager.generation.value += 1  # an abandoned step must not rescale these
            if self.corrupt_next:  # fault injection: behave like a faulty peer, once
                self.corrupt_next = False
                for buffer in buffers:
                    buffer.fill_(float("nan"))
                logger.warning("fault injection: sending a corrupt (NaN) update this round")
            if self.scale_next:  # fault injection: a lying peer (1000x what it declared), once
                factor, self.scale_next = self.scale_next, 0.0
                for buffer in buffers:
                    buffer.mul_(factor)
                logger.warning("fault injection: sending %gx this round's update", factor)
        finally:
            lock.release()
        asked = time.time()  # the averager process stamps the group's forming with time.time()
        expected = self.barrier.expected if attempt == 1 else ()
        # Mates that are all strangers that came to no group here in the last rounds get the
        # window to come, not the round's whole deadline: one fresh key "waiting" beside a lone
        # peer held every one of its rounds to the deadline (30 s against 0.7 s rounds, stop 67).
        # (The slack is the averaging deadline's margin: two honest strangers that doubt each
        # other after a failed round still meet within it, or they would never average again.)
        patience = window + 2 * self.config.matchmaking_time + 2.0
        outer_step = int(info.get("outer_step", 0))
        # The barrier names the mates when every other peer is ready; otherwise (a second key
        # "waiting" a few steps back, say) the ones ready at this step are on the board.
        # (The board is read only while a doubt is armed; without one, no mates to doubt.)
        if expected or self.board is None or outer_step >= self._no_shows_until:
            ready = list(expected)
        else:
            ready = [p.peer_id for p in self._ready_mates(self.board.fetch().values(), outer_step)]
        doubted = self._doubted(ready, outer_step)
        control = self.averager.step(
            allow_retries=False,  # see all_reduce
            gather=info,
            weight=weight,
            expected=expected,
            allowed=self.round_peers(int(info.get("outer_step", 0))),
            scheduled_time=get_dht_time() + window,
            timeout=max(self.config.matchmaking_time + 0.5, deadline - time.monotonic()),
            wait=False,
        )
        try:
            # Poll rather than block, so heartbeats continue and Ctrl+C lands here.
            begun, hard_deadline = time.monotonic(), deadline + 10.0
            outer_step, next_check = int(info.get("outer_step", 0)), time.monotonic() + 1.0
            while not control.done():
                self.beat(Stage.AVERAGING)
                if time.monotonic() > hard_deadline:  # hivemind missed its own deadline
                    control.cancel()
                    return None, f"averaging did not finish by its deadline ({hard_deadline - begun:.0f} s)"
                if time.monotonic() > next_check:
                    # Came too late for this round's group (e.g. a joiner that downloaded the
                    # state while the others were averaging): they are past this round and wait
                    # at their next barrier for us, so stop now rather than at the timeout.
                    next_check = time.monotonic() + 1.0
                    # Never cancel a step whose all-reduce began: hivemind would then try to set
                    # the result of a cancelled future and log an InvalidStateError, and a step
                    # that just finished (stage FINISHED, result not yet seen here) would be
                    # thrown away although the others averaged with this peer. ``began_allreduce``
                    # stays set once the stage was RUNNING_ALLREDUCE; the stage does not.
                    if control.began_allreduce:
                        time.sleep(0.05)
                        continue
                    if doubted and time.monotonic() - begun > patience:
                        control.cancel()
                        return (
                            None,
                            "its only round mates, strangers that came to no group before, did not come",
                        )
                    live = self.board.fetch()
                    others = [p for i, p in live.items() if i != self.peer_id]
                    if self.barrier.believed_ahead(
                        lambda p: p.outer_step > outer_step + self.lag, others, outer_step=outer_step
                    ):
                        control.cancel()
                        return None, "the others finished this round without this peer"
                    if expected and not any(mate in live for mate in expected):
                        # Every mate the group waits for stopped publishing (frozen, gone): a
                        # healthy peer of a pair waited out the whole freeze (30 s), then took
                        # the frozen peer's state (a review of the lab). It goes on alone; the
                        # frozen one, back, finds itself behind and downloads.
                        control.cancel()
                        return None, "its round mates stopped answering (their heartbeats expired)"
                time.sleep(0.05)
            gathered = control.result()
        except KeyboardInterrupt:
            stopping()  # a child ended by the same signal may hold hivemind's update lock
            control.cancel()
            raise
        except (Exception, asyncio.CancelledError) as error:  # hivemind may cancel a step it gave up on
            return None, f"averaging failed: {type(error).__name__}: {error}"
        finally:
            self.began_allreduce = bool(getattr(control, "began_allreduce", False))
        self.formed_after = 0.0
        if gathered and self.averager.assembled.value > asked:
            self.formed_after = self.averager.assembled.value - asked
            self.matchmaking_window.observe(self.formed_after)
        return (gathered, "") if gathered else (None, "could not find a group")

    def _ready_mates(self, beats: Iterable[PeerHeartbeat], outer_step: int) -> list[PeerHeartbeat]:
        """The others ready to average this round (at its step, not done; waiting or averaging,
        any stage when overlapped). Overlapped, a mate in its run's last round has its clock at
        the run's length while that round averages: a mate until it says it is finishing, as
        the barrier counts it (:meth:`swarm.barrier.RoundBarrier.done_for`). Counted as done
        here, a last round whose first attempt failed was never retried: it ended alone, and
        the run on as many θ as peers (a review, stop 72)."""
        return [
            p
            for p in beats
            if p.peer_id != self.peer_id
            and p.outer_step == outer_step + self.lag
            and not self.barrier.done_for(p, outer_step)
            and (self.overlapped or p.stage in (Stage.WAITING, Stage.AVERAGING))
        ]

    def _doubted(self, mates: Sequence[str], outer_step: int) -> bool:
        """``mates`` are all strangers (none vouched for) and this round is within
        :data:`DOUBT_ROUNDS` of one whose only mates, strangers, came to no group
        (:attr:`_no_shows_until`)."""
        return (
            bool(mates)
            and outer_step < self._no_shows_until
            and not any(m in self.vouching.vouched for m in mates)
        )

    def round_peers(self, outer_step: int) -> tuple[str, ...]:
        """The peers this one may group with (lead, follow or take in): the run's peers whose
        heartbeats it last read (the barrier's or the retry's read: live, none it ignores), and
        itself, less those that spoiled this round's earlier attempts (:meth:`_blame_spoilers`).
        A fresh key that never
        published one, leading groups it never began or joining groups it never came to, is in
        no group of this peer's (a red-team review: either made every round of a pair end
        alone). Without a board: anybody."""
        if self.board is None:
            return ()
        silent = {peer for peer, step in self._silent_leaders.items() if step == outer_step}
        # Not peers of an earlier release: they meet at another member's board, and a group of
        # both waited at two until its deadline, every attempt (a review, 2026-12-06).
        current = {peer for peer, beat in self.board.last_seen.items() if beat.protocol >= PROTOCOL}
        return tuple(sorted({*current, self.peer_id} - silent))

    def _blame_spoilers(self, outer_step: int) -> None:
        """After an attempt: the peers that spoiled its group, as this peer saw for itself, are
        left out of this round's other attempts, and strangers struck (three rounds of it and
        they are ignored for the run): a leader that accepted this peer into its group and then
        said nothing (:func:`swarm.hivemind_fixes.watch_leaders`), at once; a member that never
        came to the ring of a group this peer led, or a leader that never opened its board
        (:meth:`swarm.group_averager.GroupAverager.no_shows`), from its second time since it
        last averaged with this one: an honest peer late to a ring under load, or that gave up
        on the group as hivemind formed it, comes to the next; the same for a member that sent
        this peer nothing in a group on hivemind's path (its leader, for a follower:
        :meth:`swarm.group_averager.GroupAverager.stalled`). A fresh key with a heartbeat
        "waiting" at the round's step did either every attempt, and every round of a pair
        ended alone at the averaging deadline (red-team reviews, 2026-12-06)."""
        spoilers = [
            (peer, "accepted this peer into its group and never began it")
            for peer in getattr(self.averager, "silent_leaders", list)()
        ]
        for told, what in (
            ("no_shows", "was in this peer's group and never came to its ring"),
            ("stalled", "was in this peer's group and sent it nothing on hivemind's path"),
        ):
            spoilers += [
                (peer, what)
                for peer in getattr(self.averager, told, list)()
                if self._count_miss(peer, outer_step) >= MISSED_RINGS
            ]
        # Declines are only left out of the round, never struck: an honest peer that fell
        # behind declines the groups formed as it gave up its step (1 round in 5 to 25 under
        # load, docs/reliability.md), a slow joiner maybe every round; a decline costs 0.1 s.
        declined = [
            peer
            for peer in getattr(self.averager, "decliners", list)()
            if self._count_miss(peer, outer_step) >= MISSED_RINGS
        ]
        # A member whose ring address refused this peer's own dial on a new ring of its group
        # is left out of the round at once and never struck: a dead address it posted, or its
        # firewall (an honest peer that cannot take gloo's connections turns its own plane off
        # after three rings, and takes hivemind's path).
        # Before, it was in every retry: each one failed until the averaging deadline, and three
        # switched this peer's plane off (docs/security.md).
        unreachable = list(getattr(self.averager, "unreachable", list)())
        spared = {*declined, *unreachable}
        for peer, what in [
            *spoilers,
            *((peer, "declined this peer's rings") for peer in declined),
            *((peer, "could not be reached on this peer's ring") for peer in unreachable),
        ]:
            self._silent_leaders[peer] = outer_step
            heartbeat = self.board.last_seen.get(peer) if self.board is not None else None
            logger.info("round %d: %s %s", outer_step + 1, peer[-8:], what)
            # A round mate is only left out of this round's retries: one frozen, or late under
            # load, must not be ignored for the run (it averaged with this one before).
            if heartbeat is not None and peer not in self.vouching.vouched and peer not in spared:
                self.barrier.strike(heartbeat, outer_step, what)
        while len(self._silent_leaders) > MAX_SILENT:  # fresh keys are free
            self._silent_leaders.pop(next(iter(self._silent_leaders)))

    def _count_miss(self, peer: str, outer_step: int) -> int:
        """``peer`` never came to the ring of a group of this averager's in round ``outer_step``:
        how many times running, since it last averaged with this one, each within
        :data:`MISS_WINDOW` of this averager's rounds of the last (an honest peer whose step was cancelled just as
        its group formed, once in a while, must not add up over a run)."""
        count, last = self._missed.pop(peer, (0, outer_step))
        # (In this averager's rounds: a streaming fragment's come F syncs apart, and no key that
        # spoiled each of its groups was ever twice running, a review, stop 72.)
        count = count + 1 if outer_step - last <= MISS_WINDOW * self.syncs_apart else 1
        self._missed[peer] = (count, outer_step)
        while len(self._missed) > MAX_SILENT:  # fresh keys are free
            self._missed.popitem(last=False)
        return count

    def _failed(
        self, info: dict[str, Any], reason: str, *, mates: list[str], moved_on: bool = True
    ) -> RoundReport:
        """The others of this round were ready but the round failed for this peer: they may
        have averaged without it, so after its local step its θ is presumed stale.

        With no mate left at this round, only if a peer is past it (``moved_on``): the others
        averaged without it. Peers behind it (a straggler still training the round before, a
        joiner that has just landed at this step and trains) averaged nothing: presumed stale
        all the same, a peer downloaded three times for a state older than its own (refused),
        or took the joiner's and lost its own round.

        Unless the round failed for them too: then every one of them would download the
        others' θ at once (each from the other, with two peers), land on different clocks and
        miss the next round's group as well, for ever (seen with --overlap after a straggler
        came back). So when round mates are still here, only a peer with a mate that sorts
        before it (peer ids) fetches the state: the first one keeps its θ for the others to
        fetch. If the others did average without it, the next group's θ check catches it."""
        report = self._alone(info, reason)
        report.stale = (not mates and moved_on) or any(mate < self.peer_id for mate in mates)
        report.failed = True
        return report

    def _alone(self, info: dict[str, Any], reason: str) -> RoundReport:
        # The round that ends at outer step + 1: what the peer's own round line calls it.
        logger.info(
            "round %d: %s; continuing alone with this peer's own update",
            int(info.get("outer_step", 0)) + 1,
            reason,
        )
        return RoundReport(group_size=1, group_info=[info], error=reason)

    def settle_claims(self, claims: dict[str, int], reached: int) -> None:
        """After a state download that ``claims`` (peer id -> the outer step it said it held)
        sent this peer to, which reached outer step ``reached``: a claimant more than
        :data:`swarm.claims.CLAIM_LAG` steps past it is disproven once
        (:meth:`swarm.claims.Vouching.disprove`: the third time running, it is no longer
        believed and is ignored); one it bore out is forgiven.

        One step was not enough: in a swarm whose rounds are faster than a download, an honest
        donor's state lags the step its heartbeat already claims (with rounds of half a second,
        honest peers were disproven three times running and ignored, measured). A member that
        claims a few steps more than it holds is not caught (docs/security.md)."""
        for peer, step in claims.items():
            if peer == self.peer_id:
                continue
            if step <= reached + CLAIM_LAG:
                if step <= reached:
                    self.vouching.borne_out(peer)
                continue
            why = f"claimed outer step {step}, and the download it sent this peer to reached only {reached}"
            if self.vouching.disprove(peer):
                self.board.ignore(peer, f"{why}, {STRIKES} times running")
            else:
                logger.info("peer %s %s", peer[-8:], why)

    def wait_for_round_mates(self, outer_step: int) -> Verdict:
        """The round barrier (:class:`swarm.barrier.RoundBarrier`)."""
        return self.barrier.wait_for_round_mates(outer_step)

    def expected_group(self) -> int:
        """This peer and the live peers that would average with it (not paused, not done):
        what eager updates stand in for before a first mean lands (:class:`optim.Averager`).
        Heartbeats are claims: an estimate, used for one round."""
        others = [
            p
            for p in self.board.fetch().values()
            if p.peer_id != self.peer_id and p.stage not in (Stage.PAUSED, Stage.LEAVING) and not p.done
        ]
        return 1 + len(others)

    # --- state for late joiners ---------------------------------------------------------------

    def start_serving(self) -> None:
        """Offer the state to joiners from now on (if this averager serves it): the state
        provider has the outer loop's state to answer with."""
        self.averager.allow_state_sharing = self._serves_state

    def set_state_priority(self, outer_step: int) -> None:
        """Joiners download from the peer with the highest outer step."""
        if self.averager.allow_state_sharing:
            claimed = fault_value(self.averager._fault_file, "state_priority")  # testing: a lying donor
            # The lie moves with the step, as an honest peer's priority does: each change has the
            # state snapshotted ahead of joiners, so the liar's offer comes as fast as theirs. (A
            # constant lie left it snapshotting on request, past the joiner's wait for offers.)
            self.averager.state_sharing_priority = claimed + outer_step if claimed else float(outer_step)

    def shutdown(self) -> None:
        self.averager.shutdown()
