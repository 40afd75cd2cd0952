"""Heartbeats are claims: what a peer may believe of them, and when a peer is caught lying.

hivemind's signatures say *who* wrote a heartbeat, not that it is true: a fresh key can publish
a schema-valid heartbeat with any outer step, stage or loss. So:

- **absurd values** (a loss of -1e30, 1e12 samples a second, a heartbeat from the future) are
  never shown or used: :func:`implausible` says why, and the peer is ignored for the rest of
  the run (an honest peer never publishes them);
- **behaviour is vouched for**: a peer that averaged with this one in a verified round
  (:class:`Vouching`) is believed when it says it is ahead (this peer then fetches the state)
  or still training (this peer waits for it, up to the round wait). An unvouched peer's word
  moves nothing that costs honest peers more than honest peers cost each other: it is waited
  for at most about one of this peer's own rounds, and its claim to be ahead is not acted on;
- **a downloaded state is checked** (:func:`judge_state`): its θ must match, under a random
  projection the donor never saw, what other peers hold at that outer step;
- **three strikes**: a peer that says it trains the round but never shows up in the group, or
  says it is rounds ahead of every peer that averaged with this one, in three rounds without
  averaging with this one in between, is ignored for the rest of the run and shown as such in the TUI, ``status`` and the widget;
- **a claim to be ahead must be borne out**: when it sends this peer to download the state and
  the download (a verified state) falls more than :data:`CLAIM_LAG` steps short of it,
  three times running with no download bearing it out in between (:meth:`Vouching.disprove`;
  an honest peer ahead whose offer failed once under load is not caught), the claimant is no
  longer believed and is ignored; averaging with it does not forgive that. A vouched peer that
  claimed to be ahead round after round held every peer that believed it out of every group.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from swarm.bounds import BOUNDS
from swarm.records import CLOCK_SLACK, MAX_VERSION, PeerHeartbeat, mate_tag

if TYPE_CHECKING:  # swarm.sketch imports torch: 1,557 modules against 636, for the monitor and status
    from swarm.sketch import Sketch

MAX_LOSS = 1e4  # a cross-entropy over any vocabulary a model here can have is far below
MAX_SAMPLES_PER_SECOND = 1e7
MAX_TOKENS_PER_SECOND = 1e10
MAX_BYTES = 1e18
FUTURE_SECONDS = CLOCK_SLACK  # clocks differ; a heartbeat minutes ahead of DHT time is made up
STRIKES = 3
CLAIM_LAG = 3
"""Steps an honest peer's claimed outer step may be past the state a download then reaches: in
rounds faster than a download, a donor's heartbeat claims the next steps before its state does
(one step, three times running, in a test with half-second rounds; more under load)."""
MAX_IGNORED = 1024  # fresh keys are free: remember at most this many liars (oldest forgotten)
MAX_MATES = 16  # round mates a heartbeat names (its ``averaged_with``)


def implausible(beat: PeerHeartbeat, now: float) -> str | None:
    """Why no honest peer would publish this heartbeat, or None."""
    if beat.loss is not None and not (math.isfinite(beat.loss) and 0 <= beat.loss <= MAX_LOSS):
        return f"a loss of {beat.loss:g}"
    if not beat.samples_per_second <= MAX_SAMPLES_PER_SECOND:
        return f"{beat.samples_per_second:g} samples a second"
    if not beat.tokens_per_second <= MAX_TOKENS_PER_SECOND:
        return f"{beat.tokens_per_second:g} tokens a second"
    if max(beat.bytes_sent, beat.bytes_received, beat.dp_bytes) > MAX_BYTES:
        return "exabytes sent"
    if beat.inner_steps > BOUNDS["inner_steps"].high or beat.inner_step > beat.inner_steps:
        return f"inner step {beat.inner_step} of {beat.inner_steps}"
    if beat.outer_step > BOUNDS["rounds"].high:
        return f"outer step {beat.outer_step}"
    if not (math.isfinite(beat.time) and beat.time <= now + FUTURE_SECONDS):
        return f"a heartbeat from {beat.time - now:.0f} s in the future"
    if beat.last_round_seconds is not None and not beat.last_round_seconds <= 30 * 86_400:
        return f"a round of {beat.last_round_seconds:g} s"
    for name in ("round_wait_seconds", "averaging_deadline_seconds", "matchmaking_window_seconds"):
        if not getattr(beat, name) <= 30 * 86_400:  # inf made `status --json` write Infinity
            return f"a {name.replace('_seconds', '').replace('_', ' ')} of {getattr(beat, name):g} s"
    if not all(math.isfinite(v) for v in beat.final_theta):  # a diverged θ's sketch, or a liar's
        return "a final θ sketch that is not finite"
    if max(beat.control_version, beat.control_refused) > MAX_VERSION + 1:
        return f"steering version {max(beat.control_version, beat.control_refused)}"
    return None


class Ignored(OrderedDict):
    """peer id -> why it is ignored for the rest of the run (bounded: oldest forgotten)."""

    def add(self, peer_id: str, reason: str) -> bool:
        """Record a liar; True if it is new."""
        new = peer_id not in self
        self[peer_id] = reason
        while len(self) > MAX_IGNORED:
            self.popitem(last=False)
        return new


class Vouching:
    """Which peers averaged with this one, and strikes against the others' claims."""

    def __init__(self) -> None:
        self.vouched: set[str] = set()
        self.mates: OrderedDict[str, str] = OrderedDict()
        """The latest round mates, most recent last (at most :data:`MAX_MATES`), each with its
        :func:`~swarm.records.mate_tag` (made once here, not at every heartbeat): the heartbeat's
        ``averaged_with``."""
        self.witnessed: set[str] = set()
        """The peers whose θ is the last state this peer downloaded (its donor, and the witnesses
        at its step that agreed; its donor alone if nobody else could confirm it), until this
        peer averages: see :meth:`swarm.barrier.RoundBarrier.witnesses_hold`."""
        self.witnessed_step: int | None = None
        """The outer step of that state."""
        self._strikes: dict[str, tuple[int, int]] = {}  # peer id -> (strikes, last round struck)
        self._disproven: OrderedDict[str, int] = OrderedDict()  # peer id -> claims not borne out

    def averaged_with(self, peer_ids: list[str], me: str | None = None) -> None:
        """A verified round's members: believed from now on, their strikes forgiven (not the
        claims a download disproved: a member can average honestly and still lie about its
        step, see :meth:`disprove`). ``me``: this peer's id, left out of :attr:`mates`; in a
        group of more than ``MAX_MATES`` others, the mates are the ``MAX_MATES / 2`` either side
        of ``me`` in the group sorted by id, round the end: so two members name each other or
        neither (all keeping the last 16 of hivemind's order, which every member sees alike,
        left the group's first members named by nobody, a review found)."""
        for peer in peer_ids:
            self.vouched.add(peer)
            self._strikes.pop(peer, None)
        named = sorted(set(peer_ids) - {me})
        if me is not None and len(named) > MAX_MATES:
            ring = sorted({*named, me})
            at, half = ring.index(me), MAX_MATES // 2
            named = [ring[(at + k) % len(ring)] for k in range(-half, half + 1) if k]
        for peer in named:
            self.mates[peer] = self.mates.get(peer) or mate_tag(peer)
            self.mates.move_to_end(peer)
        while len(self.mates) > MAX_MATES:
            self.mates.popitem(last=False)
        self.witnessed, self.witnessed_step = set(), None  # round mates decide from now on

    def confirmed_by(self, peer_ids: Iterable[str], outer_step: int) -> None:
        """This peer just took a state at ``outer_step`` that is these peers' θ (:attr:`witnessed`)."""
        self.witnessed, self.witnessed_step = set(peer_ids), outer_step

    def disprove(self, peer_id: str) -> bool:
        """``peer_id`` claimed an outer step that the download it sent this peer to did not
        reach. True the ``STRIKES``-th time running (no download bore a claim of it out in
        between, :meth:`borne_out`): then it is no longer believed (ignore it). Once is not
        enough: an honest peer ahead whose offer failed under load, while a peer at this one's
        step served, looks the same once."""
        count = self._disproven.pop(peer_id, 0) + 1
        self._disproven[peer_id] = count
        while len(self._disproven) > MAX_IGNORED:  # fresh keys are free
            self._disproven.popitem(last=False)
        if count >= STRIKES:
            self.vouched.discard(peer_id)
            self.witnessed.discard(peer_id)
            self.mates.pop(peer_id, None)
            return True
        return False

    def borne_out(self, peer_id: str) -> None:
        """A download reached the step ``peer_id`` claimed: its earlier disproofs are forgiven."""
        self._disproven.pop(peer_id, None)

    def strike(self, peer_id: str, outer_step: int) -> bool:
        """One strike per round; True once the peer has ``STRIKES`` rounds of them without
        averaging with this one in between (which forgives them)."""
        count, last = self._strikes.get(peer_id, (0, -2))
        if last == outer_step:
            return count >= STRIKES
        count += 1
        self._strikes[peer_id] = (count, outer_step)
        if count >= STRIKES:
            self.vouched.discard(peer_id)
            self.witnessed.discard(peer_id)
            self.mates.pop(peer_id, None)
            return True
        return False


def witness_order(
    peers: Sequence[PeerHeartbeat], vouched: set[str], rng: random.Random | None = None
) -> list[str]:
    """Who to ask about a downloaded θ, best witness first (see :func:`judge_state`).

    Peers that averaged with this one come first, the most advanced first. Strangers follow in
    random order, those whose claimed outer step is at least the median claim first (the
    donor, the freshest peer, is among them). Never by the claim itself: a step is anyone's to
    claim, and silent heartbeats claiming to be ahead would take every witness slot and leave
    the state unconfirmed by anyone. At random, fresh keys get the share of the slots they are
    of the peers. Strangers that cannot be dialed (client mode: no addresses) cannot answer; a
    round mate in client mode can, over the connection it keeps to this peer.
    (:func:`at_the_donors_step` then puts those claiming the donor's step first.)"""
    rng = rng or random.Random()
    reachable = [p for p in peers if p.addresses or p.peer_id in vouched]
    if not reachable:
        return []
    claims = sorted(p.outer_step for p in reachable)
    median = claims[(len(claims) - 1) // 2]
    return [
        p.peer_id
        for p in sorted(
            reachable,
            key=lambda p: (
                p.peer_id not in vouched,
                -p.outer_step if p.peer_id in vouched else p.outer_step < median,
                rng.random(),
            ),
        )
    ]


def at_the_donors_step(witnesses: Sequence[str], claims: dict[str, int], step: int) -> list[str]:
    """``witnesses`` (in :func:`witness_order`'s order) with those that claim outer step ``step``
    (the donor's) first, the order kept otherwise: only a peer at the donor's step can confirm
    its θ (:func:`judge_state`), and rounds in flight leave honest peers a step apart. A claim
    chosen to take these places gains nothing: :func:`judge_state` does not take a state that
    witnesses claiming its step left unanswered."""
    return sorted(witnesses, key=lambda peer: claims.get(peer) != step)


@dataclass(frozen=True)
class StateVerdict:
    """What a joiner makes of a downloaded state after asking other peers for their θ."""

    accept: bool
    why: str
    blame: bool = False
    """The donor served a θ that peers this one averaged with contradict: do not ask it again
    until it averages with this one (a liar, or an honest peer on the losing side of a split)."""
    contradicted: bool = False
    """Peers at the donor's step hold another θ (with ``blame`` or not): not a witness for the
    next donor either. A state refused only because nobody else holds its step is not."""
    confirmed: bool = False
    """Taken because another peer at its step holds the same θ (not on the donor's word, nor
    unconfirmed because the others moved on)."""
    on_donors_word: bool = False
    """Taken because no other peer could answer for it (not because they moved past it)."""
    witnesses: frozenset[str] = frozenset()
    """When ``confirmed``: the peers whose θ is the state's (the donor, and the witnesses at its
    step that agreed; :meth:`Vouching.confirmed_by`)."""


def judge_state(
    step: int,
    mine: Sequence[Sketch] | Mapping[str, Sequence[Sketch]],
    answers: dict[str, tuple[int, list[Sketch]] | None],
    *,
    donor: str,
    vouched: set[str],
    claims: dict[str, int] | None = None,
) -> StateVerdict:
    """Accept a state downloaded from ``donor`` at outer step ``step`` (sketched as ``mine``:
    under the one seed all were asked with, or each peer's under the seed it was asked with)?

    ``answers``: the other peers asked, each with (its outer step, its θ's sketches under the
    same seed), or None if it did not answer. Peers that averaged with this one (``vouched``)
    decide when any of them holds the step (most of them, the donor counted if it is one; a tie
    refuses); otherwise a majority of those at the step and the donor (a tie refuses). A state
    that every peer asked is past is refused if most of them (or one that averaged with this
    one) were past it before the download began (``claims``: the outer steps their heartbeats
    claimed when they were chosen as witnesses): it was old when served. Otherwise a state no
    other peer can confirm is taken from a vouched donor, when no other peer answered at all
    (the donor is then the only witness there is), or when every peer asked is past it (they
    moved on during the download: see the comment below)."""
    from swarm.sketch import state_mismatch

    at_step = {peer: got[1] for peer, got in answers.items() if got is not None and got[0] == step}
    steps = [got[0] for got in answers.values() if got is not None]
    served = mine if isinstance(mine, Mapping) else dict.fromkeys(at_step, mine)
    agree = {peer for peer, sketches in at_step.items() if state_mismatch(served[peer], sketches) is None}
    disagree = set(at_step) - agree
    witnesses = (vouched & set(at_step)) or set(at_step)
    if witnesses:
        against = witnesses & disagree
        trusted = bool(vouched & set(at_step))
        # Round mates decide, the donor one of them if it averaged with this one: a single round
        # mate (a liar, or an honest peer that took a made-up state and has not found out yet)
        # does not shut every honest donor out; a tie refuses.
        support = len(agree & witnesses) + (donor in vouched)
        if trusted and support > len(against):
            return StateVerdict(
                True,
                f"confirmed by {len(agree & witnesses)} peer(s) that averaged with this one"
                + (f" ({len(against)} disagree)" if against else ""),
                confirmed=True,
                witnesses=frozenset(agree | {donor}),
            )
        # Among strangers the donor is one vote for its own θ: an honest donor outvotes one
        # liar among two others; a lying donor must bring more liars than there are honest peers.
        if not trusted and len(agree) + 1 > len(disagree):
            return StateVerdict(
                True,
                f"confirmed by {len(agree)} of {len(at_step)} peers at outer step {step}",
                confirmed=True,
                witnesses=frozenset(agree | {donor}),
            )
        who = "peers that averaged with this one" if trusted else "most peers"
        return StateVerdict(
            False,
            f"{who} hold another θ at outer step {step} ({len(against)} of {len(witnesses)} disagree)",
            blame=trusted,
            contradicted=True,
        )
    if steps and min(steps) > step:
        old = _old_when_served(step, answers, donor=donor, vouched=vouched, claims=claims)
        if old is not None:
            return old
    if donor in vouched:
        return StateVerdict(
            True, "served by a peer that averaged with this one; no other peer is at that step"
        )
    if not steps:
        silent = [peer for peer in answers if (claims or {}).get(peer) == step]
        if silent:
            # Peers that say they hold this step were asked and said nothing: fresh keys placed
            # to take every witness slot, or peers too busy to answer. Not taken on the donor's
            # word either way (the next donor is tried).
            return StateVerdict(
                False, f"{len(silent)} peer(s) that claim outer step {step} were asked and did not answer"
            )
        return StateVerdict(
            True,
            "no other peer could confirm it: taken on the donor's word (the first round checks it)",
            on_donors_word=True,
        )
    if min(steps) > step:
        # Everyone asked moved on while this peer downloaded (rounds shorter than a download,
        # which overlapped peers do not wait for): nobody can confirm it any more, nobody
        # contradicted it. Taken: the first group round's fingerprint check still catches a
        # made-up θ (this peer then downloads again), and the step only makes it stale.
        return StateVerdict(True, f"unconfirmed: the others moved past outer step {step} during the download")
    return StateVerdict(False, f"no peer asked holds outer step {step} (they are at {sorted(set(steps))})")


def _old_when_served(
    step: int,
    answers: dict[str, tuple[int, list[Sketch]] | None],
    *,
    donor: str,
    vouched: set[str],
    claims: dict[str, int] | None,
) -> StateVerdict | None:
    """The refusal of a state at outer step ``step`` that every peer asked is past, if most of
    them (or one that averaged with this one) were past it before the download began (their
    heartbeats said so when the witnesses were chosen, ``claims``): it was old when served. A
    donor serving a made-up θ one step behind the swarm was taken this way, then found stale at
    the next round, then asked again: for ever; a vouched one too (stop 51's ``make faults``).
    (Most, not all: one fresh key claiming the donor's step would otherwise switch this off.)"""
    before = {
        peer: s for peer, s in (claims or {}).items() if peer != donor and answers.get(peer) is not None
    }
    past = {peer for peer, s in before.items() if s > step}
    if not past or not (past & vouched or 2 * len(past) > len(before)):
        return None
    return StateVerdict(
        False,
        f"{len(past)} of {len(before)} peers asked were past outer step {step} before the download "
        f"began (at {min(before[p] for p in past)} or later): the donor served an old state",
    )
