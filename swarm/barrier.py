"""The round barrier: before a round's all-reduce, wait until this round's other peers have
finished their inner steps, from their heartbeats, which are claims (:mod:`swarm.claims`).

Without it the first peer to finish would average with whoever happens to be matchmaking and
the swarm would split into groups holding different global params. :class:`RoundBarrier`
decides AVERAGE (the others are ready), ALONE (nobody to average with) or BEHIND (the swarm
is past this round: fetch the state); :class:`Serving` tells it when this peer is answering a
state request, which an overlapped barrier must not hold back.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from swarm.averaging_config import AveragingConfig
from swarm.claims import STRIKES, Vouching
from swarm.deadlines import LearnedDeadline
from swarm.records import PeerHeartbeat, Stage

logger = logging.getLogger(__name__)
T = TypeVar("T")

POLL_FIRST = 0.1
"""The barrier reads the board this often in its first second of waiting, then every
:data:`POLL_SHARE` of the time it has waited, :data:`POLL_MOST` s apart at most (and never past
one of its deadlines). Each read is a DHT lookup of the run's one heartbeat key (``latest``: a
round trip to the nodes that hold it): at ten a second, every peer waiting out a straggler's
round made that key the swarm's hot spot, and a 30 s wait cost 300 lookups (now 56)."""
POLL_SHARE = 0.1
POLL_MOST = 1.0


class Verdict(enum.Enum):
    """What the round barrier decided."""

    AVERAGE = "average"  # the others of this round are ready: matchmaking now
    ALONE = "no other peer in this round"  # step with this peer's own update
    PAUSED = "the other peers are paused by the run's owner"  # alone too (it said "no other peer")
    BEHIND = "other peers are past this round"  # this peer fell behind: fetch the state


class Serving:
    """Whether this peer is answering a request for its state right now (a joiner's download or
    a witness's sketch): the state provider wrapped by :meth:`wrap` counts the requests in
    flight. One per peer, shared by all its averagers (streaming has one per fragment)."""

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()
        # One republish at a time, each reading the count as it runs: a stop and a start on two
        # threads published "not serving" last while this peer served, until its next heartbeat.
        self._publishing = threading.Lock()
        self.on_change: Callable[[], None] = lambda: None
        """Called (from the thread that serves) when this peer starts or stops answering: the
        peer republishes its heartbeat, whose ``serving`` the others' barrier reads."""

    def wrap(self, provider: Callable[[], T]) -> Callable[[], T]:
        def provide() -> T:
            self._count_by(1)
            try:
                return provider()
            finally:
                self._count_by(-1)

        return provide

    def _count_by(self, change: int) -> None:
        with self._lock:
            before = self._count > 0
            self._count += change
            changed = (self._count > 0) != before
        if changed:
            try:
                with self._publishing:
                    self.on_change()
            except Exception as error:  # noqa: BLE001 - a heartbeat not sent must not fail a download
                logger.debug("could not republish the heartbeat: %s", error)

    @property
    def answering(self) -> bool:
        return self._count > 0


DOUBT_ROUNDS = 10
"""Rounds strangers' downloads get the grace only after one never came (:attr:`RoundBarrier.doubted`):
fresh keys, one a round, then cost a round wait every 11 rounds, about a grace a round."""


class RoundBarrier:
    """One peer's barrier, run by its averager before every round."""

    def __init__(
        self,
        *,
        board: Any,
        peer_id: str,
        beat: Callable[[Stage | None], None],
        config: AveragingConfig,
        overlapped: bool = False,
        vouching: Vouching | None = None,
        serving: Serving | None = None,
    ) -> None:
        self.board = board  # fetch() -> {peer id: PeerHeartbeat}; ignore(peer id, why)
        self.peer_id = peer_id
        self.beat = beat
        self.config = config
        self.overlapped = overlapped
        self.vouching = vouching if vouching is not None else Vouching()
        self.serving = serving if serving is not None else Serving()
        self.gap = 0.0
        """Seconds between this peer's last two rounds (its inner steps): what an honest
        newcomer's "still training" may cost before it is treated as a stranger's claim."""
        self.wait = LearnedDeadline(
            ceiling=config.round_wait,
            floor=min(config.round_wait, max(10.0, 4 * config.matchmaking_time)),
            margin=config.matchmaking_time,
        )
        """How long to wait for a round mate still training: learned from how long this
        barrier waited for its last round mates (``round_wait`` until it has seen 5 rounds). A
        peer downloading the state gets the whole ``round_wait``."""
        self.doubted: tuple[frozenset[str], int] | None = None
        """Set when a stranger said it was downloading for a whole round wait and never came (the
        peers this one had averaged with then, and the round): strangers' downloads get the grace
        only, as strangers training do, until a peer not among those averages with this one, or
        for :data:`DOUBT_ROUNDS` rounds (an honest joiner slower than a round wait, or killed
        mid-download, must not lock the next ones out for good). Fresh keys saying
        "downloading", one a round, once held every round for the whole round wait."""
        self.ahead: dict[str, int] = {}
        """The claims that made the last verdict BEHIND (peer id -> outer step claimed); empty
        after any other verdict."""
        self.expected: tuple[str, ...] = ()
        """The round mates the last AVERAGE verdict expects (peer ids), when it saw every other
        live peer ready (none otherwise, and after any other verdict). Matchmaking forms the
        group as soon as these joined instead of waiting out its window."""
        self.clock: Callable[[], float] = time.monotonic
        self.sleep: Callable[[float], None] = time.sleep
        """The barrier's time (unit tests run it on a fake clock)."""

    def wait_for_round_mates(self, outer_step: int) -> Verdict:
        """The barrier: wait until every other live peer has finished this round's inner steps.

        Heartbeats lag by up to a second, so a peer whose heartbeat still shows it averaging the
        previous round counts as "about to train this one". A peer further behind is a
        straggler: not waited for, it will fetch the state. A peer already past this round
        means this one fell behind and must fetch the state instead of averaging.

        Overlapped (run in the background while this peer trains the next round), a peer's
        clock moves to ``outer_step + 1`` the moment it ends this round's inner steps: still at
        ``outer_step`` means busy, at ``+ 1`` ready, past ``+ 1`` it has applied this round's
        mean already. A peer downloading the state (a joiner, a straggler catching up) is waited
        for, or it would land a few rounds behind again and chase the swarm for ever; but not
        while this peer serves a state (to it or as its witness): the state served holds this
        round's mean, which this wait would hold back. The same holds while another member of
        this round (a peer at ``r + 1``) says it serves: its answer waits for this round too, so
        waiting for the downloader would wait for this peer itself (until the heartbeats of both
        expired). The downloader then lands past this round, its mean queued, and the next
        round waits for it.
        """
        r = outer_step
        if self.overlapped:

            def served_now(others: list[PeerHeartbeat]) -> bool:
                return self.serving.answering or any(o.serving and o.outer_step == r + 1 for o in others)

            return self._barrier(
                r,
                behind=lambda p: p.outer_step > r + 1,
                busy=lambda p, others: (
                    (p.outer_step == r and p.stage is not Stage.DOWNLOADING)
                    or (p.stage is Stage.DOWNLOADING and not served_now(others))
                ),
                ready=lambda p: p.outer_step == r + 1 and p.stage is not Stage.DOWNLOADING,
                # Nobody at r + 1 (the others download or straggle): no group can form, and
                # failing to find one would flag this peer stale for nothing.
                need_ready=True,
            )
        return self._barrier(
            r,
            behind=lambda p: p.outer_step > r,
            busy=lambda p, others: (
                p.stage is Stage.DOWNLOADING  # a joiner: it will land on this round
                or (p.outer_step == r and p.stage in (Stage.JOINING, Stage.TRAINING))
                # a heartbeat from just before its last round ended: it is about to train this one
                or (p.outer_step == r - 1 and p.stage in (Stage.WAITING, Stage.AVERAGING))
            ),
            ready=lambda p: p.outer_step == r and p.stage in (Stage.WAITING, Stage.AVERAGING),
        )

    def _barrier(
        self,
        outer_step: int,
        *,
        behind: Callable[[PeerHeartbeat], bool],
        busy: Callable[[PeerHeartbeat, list[PeerHeartbeat]], bool],
        ready: Callable[[PeerHeartbeat], bool],
        need_ready: bool = False,
    ) -> Verdict:
        """Wait while some other live peer is ``busy`` (judged among all others; at most
        the learned wait, :attr:`wait`, or ``round_wait`` for a downloader); BEHIND as soon
        as one is past the round (``behind``); after the wait, average with the ``ready``.

        Heartbeats are claims (swarm.claims): "past the round" is believed from a peer that
        averaged with this one (or, before any did, from most of the others); "busy" keeps this
        peer waiting the full ``round_wait`` only for such a peer, an unvouched one for about one
        of this peer's own rounds. Claims not acted on are strikes; three rounds of them and the
        claimant is ignored for the rest of the run."""
        started = self.clock()
        learned = self.wait.seconds
        self.expected, self.ahead = (), {}
        # What an honest newcomer costs: about one round of inner steps (measured between this
        # peer's rounds), and at least a couple of matchmaking windows.
        grace_seconds = min(
            self.config.round_wait, max(5.0, 2 * self.config.matchmaking_time, 1.5 * self.gap)
        )
        grace = started + grace_seconds
        stale_seconds = min(grace_seconds, max(2.0, 2 * self.config.matchmaking_time))
        # A downloader that lands during this wait then trains the round it landed on (a whole H:
        # nobody else is training it): its grace, and its wait, count from its landing. Counted
        # from the wait's start, a download used them up: the peer was not waited for the moment
        # it landed, struck (a stranger), found itself behind, downloaded again, and after three
        # rounds of that was ignored for the rest of the run.
        seen_downloading: set[str] = set()
        landed: dict[str, float] = {}  # peer id -> when it was first seen done downloading
        waited_for: list[str] = []
        while True:
            self.beat(Stage.WAITING)
            # A paused peer (steering) trains nothing and averages nothing: not a round mate;
            # nor is one done with its rounds (finishing, or downloading the θ the others end on).
            # Its θ is not fetched here either: a peer that ended its last round early (alone)
            # would take the others' last round from them. The peers ending together settle on
            # one θ when they finish (swarm.ending).
            live = [
                p
                for p in self.board.fetch().values()
                if p.peer_id != self.peer_id and not self.done_for(p, outer_step)
            ]
            others = [p for p in live if p.stage is not Stage.PAUSED]
            if not others:
                return Verdict.PAUSED if live else Verdict.ALONE
            vouched = self.vouching.vouched
            ahead = [p for p in others if behind(p)]
            if self.believed_ahead(behind, others, outer_step=outer_step):
                self.ahead = {p.peer_id: p.outer_step for p in ahead}
                return Verdict.BEHIND
            # Not believed: not round mates either. Struck, unless only this peer's witnesses
            # said otherwise (one of them may be the peer left behind: see believed_ahead).
            for p in [] if self.witnesses_hold(outer_step, behind, others) else ahead:
                self.strike(
                    p,
                    outer_step,
                    f"claimed outer step {p.outer_step} ahead of every peer that averaged with this one",
                )
            others = [p for p in others if p not in ahead]
            now = self.clock()
            for p in others:
                if p.stage is Stage.DOWNLOADING:
                    seen_downloading.add(p.peer_id)
                elif p.peer_id in seen_downloading:
                    landed.setdefault(p.peer_id, now)

            def grace_of(p: PeerHeartbeat) -> float:  # never past the round wait (a liar's landing)
                if p.peer_id not in landed:
                    return grace
                return min(landed[p.peer_id] + grace_seconds, started + self.config.round_wait)

            # A joiner downloading the state is waited for like a vouched peer (a download of a
            # large state legitimately takes long); one that never shows up is struck all the same,
            # and the next strangers' downloads are doubted (:attr:`doubted`).
            if self.doubted is not None and (
                not vouched <= self.doubted[0] or outer_step >= self.doubted[1] + DOUBT_ROUNDS
            ):
                self.doubted = None  # someone new averaged with this one (a joiner that came), or time
            trusted = [
                p
                for p in others
                if p.peer_id in vouched or (p.stage is Stage.DOWNLOADING and self.doubted is None)
            ]
            busy_peers = [p for p in others if busy(p, others) and (now < grace_of(p) or p in trusted)]
            for p in others:
                if now >= grace_of(p) and busy(p, others) and p not in trusted:
                    self.strike(
                        p, outer_step, f"said it was still training round {outer_step} and never averaged"
                    )
            waiting = [p.name for p in busy_peers]
            if not waiting:
                # How far behind this peer its last mate came (not a download's length); nothing
                # when no mate came (only stragglers left: a 0 s wait pulled the learned one down).
                if not landed and any(map(ready, others)):
                    self.wait.observe(now - started)
                if need_ready and not any(map(ready, others)):
                    return Verdict.ALONE
                if not any(ready(p) or busy(p, others) for p in others):
                    # Nobody who could average this round: stragglers a round behind, peers
                    # waiting for their --min-peers. Matchmaking would wait its whole timeout for
                    # nobody (15-30 s of every round, a review); a heartbeat a moment stale gets
                    # a few seconds. (A peer still training past its grace may yet come within
                    # the matchmaking window: that one is left to matchmaking, as before.)
                    if now >= started + stale_seconds:
                        return Verdict.ALONE
                    self.sleep(_poll_pause(now - started, [started + stale_seconds - now]))
                    continue
                # Only when every other live peer is ready: one that looks neither busy nor
                # ready (a straggler, or a heartbeat a round or two stale in a fast swarm) may
                # still come, and so may be in another peer's view of this round's group.
                self.expected = tuple(p.peer_id for p in others) if all(map(ready, others)) else ()
                return Verdict.AVERAGE
            # A downloader gets the whole round wait (a large state takes long); a round mate
            # still training, what the last rounds' arrivals say (never more).
            downloading = any(p.stage is Stage.DOWNLOADING for p in busy_peers)
            limit = self.config.round_wait if downloading else learned
            # A peer that landed meanwhile: the learned wait (or its grace) from its landing,
            # within the round wait.
            since_landing = [
                landed[p.peer_id] - started + max(learned, grace_seconds)
                for p in busy_peers
                if p.peer_id in landed
            ]
            limit = min(self.config.round_wait, max([limit, *since_landing]))
            if now > started + limit:
                logger.warning(
                    "round %d: not waiting longer than %.1f s for %s%s",
                    outer_step + 1,  # named as the peers' round lines name it: by the step it ends at
                    limit,
                    waiting,
                    "" if limit >= self.config.round_wait else " (learned from the last rounds' arrivals)",
                )
                if limit < self.config.round_wait and any(
                    p.peer_id in vouched and p.stage is not Stage.DOWNLOADING for p in busy_peers
                ):
                    # A round mate slower than the learned wait: learned from the mates that came,
                    # it never grew, and the mate (its rounds 20 s against a 10 s wait) downloaded
                    # the state every round and never averaged again (a review). The next rounds
                    # wait up to the round wait, and learn again from what it takes.
                    self.wait.forget()
                for p in busy_peers:
                    # "Downloading" for a whole round wait. A stranger only training, cut off at
                    # the learned wait within its grace, is neither: it was struck for "downloading"
                    # and made every joiner's download doubted for 10 rounds.
                    if p.peer_id not in vouched and p.stage is Stage.DOWNLOADING:
                        self.doubted = (frozenset(vouched), outer_step)
                        self.strike(
                            p,
                            outer_step,
                            f"said it was downloading in round {outer_step + 1} and never averaged",
                        )
                return Verdict.AVERAGE if any(map(ready, others)) else Verdict.ALONE
            if waiting != waited_for:
                logger.debug("round %d: waiting for %s", outer_step + 1, ", ".join(waiting))
                waited_for = waiting
            self.sleep(_poll_pause(now - started, [d - now for d in (grace, started + limit)]))

    def done_for(self, peer: PeerHeartbeat, outer_step: int) -> bool:
        """Whether ``peer`` is done with its rounds, so no mate for round ``outer_step``.

        Overlapped, a peer's clock reaches its run's length as soon as it ends its last round's
        inner steps, while that round still averages in the background: it is a mate for that
        round until it says it is finishing. Counted as done, every peer averaged its last round
        alone and the run ended on as many θ as peers; the vote then made all but one download
        the θ of the lowest peer id, its own last update only (streaming with τ > 0, --overlap)."""
        if self.overlapped and peer.outer_step == outer_step + 1 and peer.stage is not Stage.FINISHING:
            return False
        return peer.done

    def believed_ahead(
        self,
        ahead: Callable[[PeerHeartbeat], bool],
        others: list[PeerHeartbeat] | None = None,
        *,
        outer_step: int | None = None,
    ) -> bool:
        """Whether the swarm is past this peer's round ``outer_step``: a peer that averaged with
        this one says so, or (before any did) most of the others do, unless the peers whose θ
        confirmed the state this peer has just taken say otherwise (:meth:`witnesses_hold`). A
        stranger's word alone is not enough."""
        if others is None:
            others = [p for p in self.board.fetch().values() if p.peer_id != self.peer_id]
        claims = [p for p in others if ahead(p)]
        vouched = self.vouching.vouched
        if any(p.peer_id in vouched for p in claims):
            return True
        if not claims or any(p.peer_id in vouched for p in others) or 2 * len(claims) <= len(others):
            return False
        return not self.witnesses_hold(outer_step, ahead, others)

    def witnesses_hold(
        self, outer_step: int | None, ahead: Callable[[PeerHeartbeat], bool], others: list[PeerHeartbeat]
    ) -> bool:
        """Whether this peer, which has averaged with nobody yet, is at the outer step of the state
        it last downloaded and most of the peers whose θ confirmed that state that are still here
        are not past it (:attr:`swarm.claims.Vouching.witnessed`): then most heartbeats saying
        otherwise are not believed for this round.

        One fresh key more than the honest peers, each claiming the swarm's step + 1 (within
        what a download may lag a claim, so no download disproved it), sent a joiner to download
        instead of averaging, every round (10 of 10 rounds with 5 honest peers and 6 keys: a
        review, stop 59); it never averaged, so nobody's word outweighed theirs. Only for the
        round the download landed on, and the witnesses' own claims count as strangers': a
        witness left behind cost a joiner every round and made it strike the honest peers, and
        one claiming a step ahead sent it to download every round, when witnesses were believed
        as round mates are (a review, stop 66). A witness left behind costs a joiner one round.
        Most of the witnesses here must hold the step: one key among them that stayed at it
        while the others moved on took the joiner's round alone, then, vouched, kept it from the
        swarm for good (a second review). A paused or finished witness says nothing of the round."""
        if outer_step is None or self.vouching.vouched or outer_step != self.vouching.witnessed_step:
            return False  # (vouched: a peer that averaged before and downloads again)
        here = [
            p
            for p in others
            if p.peer_id in self.vouching.witnessed
            and p.stage is not Stage.PAUSED
            and not self.done_for(p, outer_step)  # (overlapped: at its last round it is a mate)
        ]
        return 2 * sum(not ahead(p) for p in here) > len(here)

    def strike(self, peer: PeerHeartbeat, outer_step: int, claim: str) -> None:
        if self.vouching.strike(peer.peer_id, outer_step):
            self.board.ignore(peer.peer_id, f"{peer.name} {claim}, {STRIKES} rounds running")


def _poll_pause(waited: float, ahead: list[float]) -> float:
    """Seconds until the barrier's next read of the board, ``waited`` s into its wait, with its
    deadlines ``ahead`` s away (those already past ignored): a read lands just past a deadline
    instead of up to a pause later."""
    pause = min(POLL_MOST, max(POLL_FIRST, POLL_SHARE * waited))
    for seconds in ahead:
        if seconds >= 0:
            pause = min(pause, max(POLL_FIRST, seconds + 0.01))
    return pause
