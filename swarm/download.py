"""A joiner's download of the global state, checked before it is used: the half of
:class:`swarm.averaging.SwarmAverager` that runs in the peer's own process.

Each try asks the averager process for the donors' offers of the direct transport
(:mod:`swarm.state_transfer`) and, when there are any, fetches the slices from all of them
straight into this process's memory (one copy of the state, nothing handed across processes).
Without offers, or when the slices cannot all be had, hivemind's stream from one donor at a time
(:meth:`swarm.group_averager.GroupAverager.load_state_from_peers`). Either way, other peers'
sketches of their θ, taken under seeds no donor sees in time to aim a θ at them, decide whether
the state is taken (:func:`swarm.claims.judge_state`): on the direct path one seed, drawn once
the donors' hashes bind their state; on the stream, which nothing binds before it ends, a seed
for each witness, so that one colluding with the donor gives away only its own.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, wait
from typing import Any

import torch

from optim.config import MAX_DELAY
from optim.contribution import global_norm
from optim.diloco import OuterState
from optim.state import shape_mismatch
from swarm.bounds import BOUNDS, whole
from swarm.claims import judge_state, witness_order
from swarm.dataplane import one_line
from swarm.errors import SwarmError
from swarm.records import Stage
from swarm.sketch import state_sketches
from swarm.state_fetch import fetch, freshest
from swarm.state_sharing import VERIFIERS

logger = logging.getLogger(__name__)

DONORS_PER_TRY = 4  # donors tried (each checked) in one download_state call
MAX_CANDIDATES = 32  # witnesses to choose from once the donor's step is known


class Downloading:
    """Mixin for :class:`swarm.averaging.SwarmAverager` (its ``averager``, ``board``,
    ``vouching``, ``beat``, ``on_download``, ``peer_id``, ``state_shapes`` and ``_refused_donors``)."""

    state_shapes: list[tuple[int, ...]] | None = None
    """The model's parameters' shapes: a state whose θ has others is a malformed donor's."""
    _download_tag = 0
    """Names each stream download (:meth:`swarm.state_sharing.StateSharing.streamed_from`)."""
    _stalled: set[str] = frozenset()  # type: ignore[assignment]
    """Donors that did not finish serving in the last call: not asked in this one."""

    def download_state(
        self,
        *,
        timeout: float = 60.0,
        avoid: Iterable[str] = (),
        at_step: int | None = None,
        only: Iterable[str] | None = None,
        since: int | None = None,
        oldest_unconfirmed: int | None = None,
    ) -> OuterState | None:
        """The global state of the most advanced peer whose θ the others confirm, or None if
        nobody served one in time.

        Any peer can declare itself the most advanced and serve a made-up θ. So each state is
        checked before it is used: while it streams, up to ``VERIFIERS`` other peers (those this
        one averaged with first) are asked for their θ's sketches under seeds the donor never
        sees (see the module's text), and the θ that arrived is sketched under each (:func:`swarm.claims.judge_state`
        decides). A refused donor is skipped for the rest of this call; one contradicted by
        peers this one averaged with, until it averages with this one. ``avoid``: peers known
        to hold a θ that this one must leave (its round mates that share the θ the group
        outvoted), neither donors nor witnesses in this call. A donor that did not finish
        serving in a call that took no state (it stalled, trickled or was dropped) is not asked
        in the next call, and is again in the one after (an honest slow donor, alone, is still
        had; a liar claiming the freshest step, so always chosen first, that stalled every call
        until its deadline kept a joiner from the honest donors for all its tries). ``at_step``: only a state at that
        outer step is taken (a peer ending its run takes the θ the others end on, not that of
        peers running on); ``only``: only from these donors. ``since``: this peer's outer step
        now; if it is still the step its last download brought (or the next: the round it
        stepped alone once behind), that download's donor is not asked in this call (its state left this peer behind again: a vouched donor serving a
        made-up θ one step old kept a peer behind for 74 downloads running; an honest donor whose
        state lagged the swarm is asked again on the next try, if nobody else serves).
        ``oldest_unconfirmed``: a state at an earlier outer step is taken only if another peer at
        its step holds the same θ, not on its donor's word (a peer far into the run that must
        download again takes no fresh joiner's init, nor a stale donor's state; a peer that
        stepped alone past the swarm still takes the swarm's state, which its holders confirm).
        """
        allowed = None if only is None else set(only)
        deadline = time.monotonic() + timeout
        skipped = set(self._refused_donors) | set(avoid)  # not asked to serve again in this call
        distrusted = set(skipped)  # not asked to witness either
        skipped |= self._stalled  # serve-only: they may still witness
        self._stalled, self._unfinished = set(), set()
        skipped |= self._paused_donors(skipped)
        last, self._last_download = getattr(self, "_last_download", None), None
        # (Its step plus the round it stepped alone once it found itself behind again.)
        behind_again = last is not None and since is not None and last[1] <= since <= last[1] + 1
        if behind_again and allowed is None and at_step is None:
            skipped.add(last[0])
        for _ in range(DONORS_PER_TRY):
            got = self._fetch_state(skipped, distrusted, deadline)
            if got is None:
                self._stalled = self._unfinished
                if self._stalled:
                    logger.info(
                        "%s did not finish serving the state; not asked in the next try",
                        ", ".join(sorted(d[-8:] for d in self._stalled)),
                    )
                return None
            state, donor, seeds, answers, claims = got
            skipped.add(donor)
            if state is None:
                distrusted.add(donor)
                continue
            if allowed is not None and donor not in allowed:
                logger.info("%s is not among the donors asked for; trying another", donor[-8:])
                continue
            if at_step is not None and state.outer_step != at_step:
                logger.info(
                    "%s served outer step %d, not %d; trying another donor",
                    donor[-8:],
                    state.outer_step,
                    at_step,
                )
                continue
            vouched = set(self.vouching.vouched)
            verdict = judge_state(
                state.outer_step,
                _sketched(state.params, seeds),
                answers,
                donor=donor,
                vouched=vouched,
                claims=claims,
            )
            if (
                verdict.accept
                and not verdict.confirmed
                and oldest_unconfirmed is not None
                and state.outer_step < oldest_unconfirmed
            ):
                # Not the donor's fault: it may be an honest peer that has just started, or one
                # left behind. (The churn soak: a peer at step 232 was offered only a fresh
                # joiner's step-0 state, nobody could confirm it, and it took it on the donor's word.)
                logger.info(
                    "the state served by %s is at outer step %d, older than %d, and no other peer "
                    "at its step confirms it (%s); trying another donor",
                    donor[-8:],
                    state.outer_step,
                    oldest_unconfirmed,
                    verdict.why,
                )
                continue
            if verdict.accept:
                logger.info(
                    "the state served by %s at outer step %d: %s", donor[-8:], state.outer_step, verdict.why
                )
                self._last_download = (donor, state.outer_step)
                # Nobody else could answer for it (the donor the only other peer asked): its
                # donor is the witness there is (swarm.barrier.RoundBarrier.witnesses_hold). Not
                # when the others moved past it meanwhile: they say the swarm is past its step.
                lone = {donor} if verdict.on_donors_word else set()
                self.vouching.confirmed_by(verdict.witnesses or lone, state.outer_step)
                return state
            logger.warning(
                "refused the state served by %s: %s; trying another donor", donor[-8:], verdict.why
            )
            if verdict.contradicted:  # else (a round ended mid-download) it may witness the next
                distrusted.add(donor)
            if verdict.blame:
                # A θ that this peer's round mates contradict: a liar's, or that of an honest peer
                # on the losing side of a split, which is no liar. Not asked to serve again until it
                # averages with this one (swarm.averaging forgives it then), and not ignored: in the
                # churn soak (2026-12-03) honest peers ignored each other this way for the rest of
                # the run, stopped waiting for each other at the barrier, and split more and more.
                self._refused_donors.add(donor)
        return None

    @property
    def last_download(self) -> tuple[str, int] | None:
        """(donor, outer step) of the state the last :meth:`download_state` call took, or None
        (none taken, or another call since)."""
        return getattr(self, "_last_download", None)

    def _paused_donors(self, skipped: set[str]) -> set[str]:
        """Paused peers, while another peer that trains could serve (not ``skipped``, dialable):
        a paused peer's θ stands still on purpose, so the state it serves is old. (A joiner
        bounced between a paused peer's old state and the running one's, which the paused
        witness could not confirm, 36 times, then started from the seed's init.)"""
        others = [p for p in self.board.fetch().values() if p.peer_id != self.peer_id]
        paused = {p.peer_id for p in others if p.stage is Stage.PAUSED}
        running = [
            p
            for p in others
            if p.stage in (Stage.TRAINING, Stage.WAITING, Stage.AVERAGING)
            and p.peer_id not in skipped
            and p.addresses
        ]
        return paused if running else set()

    def _verifiers(self, distrusted: set[str]) -> tuple[dict[str, int], set[str]]:
        """Peers to ask about a downloaded θ, best witnesses first (:func:`witness_order`), each
        with the outer step its heartbeat claims; and those of them still "joining". Not peers
        downloading or paused: their θ is not the swarm's at its step. Peers joining, after the
        others for a fresh joiner, and only when nobody else is there to ask for a peer that
        averaged before: a peer joining waits for ``--min-peers`` (it started the
        run, or it downloaded already), its θ is the run's at its own step, and it witnesses a
        state at that step only (:meth:`_fetch_state`). Left out, a joiner arriving while the
        others waited had no witness and took a lying donor's made-up θ on its word (``make
        faults``, stop 52)."""
        others = [
            p
            for p in self.board.fetch().values()
            if p.peer_id != self.peer_id
            and p.peer_id not in distrusted
            and p.stage not in (Stage.DOWNLOADING, Stage.PAUSED)
        ]
        joining = {p.peer_id for p in others if p.stage is Stage.JOINING}
        vouched = self.vouching.vouched
        claims = {p.peer_id: p.outer_step for p in others}
        order = witness_order([p for p in others if p.peer_id not in joining], vouched)
        # A peer that averaged before asks those joining only when nobody else can answer: a
        # joiner before its download may say "joining" for a moment (its init θ at outer step 0),
        # and those claiming the donor's step go first (at_the_donors_step). A peer at step 232
        # asked only fresh joiners about a step-0 state (the churn soak), got nothing it could
        # count, and took it. A fresh joiner (nothing to lose) asks them after the others: one
        # fresh key's heartbeat saying "training", or the lying donor's own, left it no witness
        # beside the peers waiting for --min-peers, and it took a made-up θ (a review, stop 59).
        if not order or not vouched:
            order += witness_order([p for p in others if p.peer_id in joining], vouched)
        chosen = {peer: claims[peer] for peer in order[:MAX_CANDIDATES]}
        return chosen, joining & set(chosen)

    def download_progress(self) -> float | None:
        """The share of the state received in the download in progress (0..1), None if the
        donor has not said how large it is yet (what it says is shown, never trusted)."""
        received, announced = self.averager.download[0], self.averager.download[1]
        return min(1.0, received / announced) if announced > 0 else None

    def download_donors(self) -> int:
        """How many donors serve the download in progress (or served the last one)."""
        return int(self.averager.download[2])

    def _fetch_state(
        self, skipped: set[str], distrusted: set[str], deadline: float
    ) -> tuple[Any, ...] | None:
        """(the state, or None if malformed; its donor; each witness's seed; their answers; the
        steps the peers asked claim) from the best donors not skipped (its witnesses: peers not
        distrusted), or None. Over the direct transport when donors offer it, else (or if it
        fails) hivemind's stream."""
        claims, joining = self._verifiers(distrusted)
        result = self._fetch_direct(skipped, claims, deadline)
        if result is None:
            # Not the failed direct try's share and donors (its 90 % "from 4 donors" stayed on
            # until the stream's first part, a review): none said until the stream's donor does.
            self.averager.download[:] = [0.0, 0.0, 0.0]
            remaining = max(1.0, deadline - time.monotonic())
            self._download_tag = tag = self._download_tag + 1
            future = self.averager.load_state_from_peers(
                wait=False,
                timeout=remaining,
                exclude=sorted(skipped),
                verifiers=list(claims)[: VERIFIERS + 1],  # one more: the donor is never asked
                tag=tag,
            )
            result = (
                self._wait(future.done, deadline, future.cancel, pause=_until(future)) and future.result()
            )
            if not result:
                self._unfinished.update(self.averager.streamed_from(tag))
        if not result:
            return None
        metadata, tensors, donor, seeds, answers = result
        try:
            state = _parse_state(metadata, tensors, self.state_shapes)
        except (SwarmError, KeyError, TypeError, ValueError) as error:
            logger.warning(
                "%s served an incomplete or malformed state (%s); trying another donor", donor[-8:], error
            )
            return None, donor, seeds, answers, claims
        # A peer still joining answers for the state's step or not at all: one whose download
        # failed holds the seed's init at outer step 0, which says nothing of a later state.
        answers = {
            peer: got
            for peer, got in answers.items()
            if peer not in joining or (got is not None and got[0] == state.outer_step)
        }
        return state, donor, seeds, answers, claims

    def _fetch_direct(
        self, skipped: set[str], verifiers: dict[str, int], deadline: float
    ) -> tuple[Any, ...] | None:
        """(metadata, tensors, the first donor, {witness: the seed}, the witnesses' answers) over the direct
        transport (:mod:`swarm.state_transfer`), straight into this process's memory; None if
        no donor offers it or the slices could not all be had."""
        asked = time.perf_counter()
        offers = self.averager.state_offers(sorted(skipped), verifiers)
        if not self._wait(offers.done, deadline, offers.cancel, pause=_until(offers)) or offers.exception():
            return None
        made, seed = offers.result()
        if not made:
            return None
        first, step, metadata, layout = freshest(made)
        chosen = [
            first,
            *(o for o, s, m, lay in made if o is not first and (s, m, lay) == (step, metadata, layout)),
        ]
        witnesses = self.averager.theta_sketches(seed)  # asked once the offers were in
        flat = torch.empty(layout.total, dtype=torch.uint8)
        progress = self.averager.download
        progress[:] = [0.0, float(layout.total), float(len(chosen))]
        outcome: dict[str, Any] = {}
        stop = threading.Event()

        def run() -> None:
            try:
                outcome["donors"] = fetch(
                    layout,
                    flat,
                    chosen,
                    progress=lambda received: progress.__setitem__(0, float(received)),
                    cancel=stop,
                )
            except Exception as error:  # noqa: BLE001 - reported below, then hivemind's stream
                outcome["error"] = error

        started = time.perf_counter()
        thread = threading.Thread(target=run, name="state-download", daemon=True)
        thread.start()
        finished = self._wait(lambda: not thread.is_alive(), deadline, stop.set, pause=thread.join)
        # A donor whose slices did not match its hashes may still serve over hivemind's stream:
        # its bytes may have been changed on the way (this transport is not encrypted), and what
        # the stream brings is checked by the witnesses like any state.
        if not finished or "error" in outcome:
            # Those dropped (too slow, bad slices), and when time ran out a donor alone (a liar
            # claiming the freshest step is alone at it) or those that sent less than half the
            # others' mean: not the honest donors beside a liar that trickled.
            delivered = [d.delivered for d in chosen]
            laggard = (sum(delivered) / len(delivered)) / 2 if len(chosen) > 1 else math.inf
            self._unfinished.update(
                d.peer for d in chosen if d.why or (not finished and d.delivered <= laggard)
            )
            logger.warning(
                "direct state download failed (%s); trying hivemind's stream",
                outcome.get("error", "too slow"),
            )
            witnesses.cancel()
            return None
        seconds = time.perf_counter() - started
        helped = [d for d in outcome["donors"] if d.delivered]
        progress[2] = float(len(helped))
        logger.info(
            "downloaded the state at outer step %d (%.0f MB) from %d donor(s) in %.2f s (%.0f MB/s; "
            "their offers took %.2f s)",
            step,
            layout.total / 1e6,
            len(helped),
            seconds,
            layout.total / 1e6 / max(seconds, 1e-9),
            started - asked,
        )
        # Not checked is not taken: witnesses that did not answer by the deadline would read as
        # "nobody answered", which judge_state takes on the donor's word.
        late = "the witnesses of the state downloaded did not answer in time; not taken"
        if not self._wait(witnesses.done, deadline, witnesses.cancel, late, pause=_until(witnesses)):
            return None
        if witnesses.exception() is not None:
            logger.warning(
                "asking witnesses about the state downloaded failed (%s); not taken", witnesses.exception()
            )
            return None
        answers = {peer: answer for peer, answer in witnesses.result().items() if peer != first.peer}
        try:  # both checked when the offer came (swarm.state_transfer.Layout.from_wire)
            tensors = layout.views(flat)
            parsed = self.averager.serializer.loads(metadata)
        except Exception as error:  # noqa: BLE001 - a donor's bytes: refused, never this peer's end
            logger.warning(
                "%s offered a malformed state (%s); trying hivemind's stream",
                first.peer[-8:],
                one_line(error),
            )
            return None
        return parsed, tensors, first.peer, dict.fromkeys(answers, seed), answers

    def _wait(
        self,
        done: Callable[[], bool],
        deadline: float,
        cancel: Callable[[], Any],
        late: str = "no peer served the state in time",
        pause: Callable[[float], Any] = time.sleep,
    ) -> bool:
        """Wait until ``done()``, keeping this peer's heartbeat alive in its stage ("downloading",
        or "finishing" for the θ the others end on) and the progress shown: the others' round
        barrier waits for a downloading peer only while it can see it. False (after ``cancel()``) at the deadline. ``pause(seconds)``: between looks,
        returning early once it is done (a sleep made each wait end up to 50 ms late: the
        offers, the slices and the witnesses, each)."""
        try:
            while not done():
                self.beat(None)
                if self.on_download is not None:
                    self.on_download(self.download_progress())
                if time.monotonic() > deadline:
                    cancel()
                    logger.warning(late)
                    return False
                pause(0.05)
        except KeyboardInterrupt:
            cancel()
            raise
        return True


def _sketched(params: list[torch.Tensor], seeds: dict[str, bytes]) -> dict[str, list[Any]]:
    """The served θ's sketches under each witness's seed (each seed sketched once: the direct
    path's witnesses share one, bound by the donors' hashes before it is drawn)."""
    by_seed = {seed: state_sketches(params, seed) for seed in set(seeds.values())}
    return {peer: by_seed[seed] for peer, seed in seeds.items()}


def _until(future: Future) -> Callable[[float], Any]:
    """A pause that ends when ``future`` is done."""
    return lambda seconds: wait([future], timeout=seconds)


def _parse_state(
    metadata: Any, tensors: list[torch.Tensor], shapes: Sequence[tuple[int, ...]] | None = None
) -> OuterState:
    """Rebuild an OuterState from what GroupAverager.get_current_state sent; SwarmError if it is
    malformed. ``shapes``: this model's parameters' (a θ of the same numbers in other shapes
    passes the witnesses, who sketch θ flattened)."""
    if not isinstance(metadata, dict):
        raise SwarmError("the state's metadata is not a dict")
    count, pending, step = (
        metadata.get(k, d) for k, d in (("num_params", -1), ("num_pending", 0), ("outer_step", -1))
    )
    if not (whole(count) and whole(pending) and whole(step)):  # int(inf) raised OverflowError
        raise SwarmError(f"its metadata's counts are not whole numbers ({count!r}, {pending!r}, {step!r})")
    inner_keys = metadata.get("inner_keys") or []
    if not isinstance(inner_keys, list):
        raise SwarmError("its inner optimizer's keys are not a list")
    if pending > MAX_QUEUED:
        # Each is a float copy of θ here: 90 of 1-byte tensors within the byte limit grew a
        # joiner by 4x what the limit allows, and the state was taken (a review, stop 72).
        raise SwarmError(
            f"it says it holds {pending} queued updates; a peer holds at most {MAX_QUEUED} "
            "(its --delay and one in flight)"
        )
    if count < 1 or pending < 0 or len(tensors) != (2 + pending) * count + len(inner_keys):
        raise SwarmError(
            f"{len(tensors)} tensors for {count} params: the donor left mid-download (hivemind ends a "
            "broken stream as if it were complete) or runs another version of workbench"
        )
    why = None if shapes is None else shape_mismatch([t.shape for t in tensors[:count]], shapes)
    if why:
        raise SwarmError(
            f"its θ does not fit this model ({why}): a malformed state, or the run trains another model "
            "(then use the --model and flags from the run's join command)"
        )
    rest = tensors[2 * count :]
    served = [rest[i * count : (i + 1) * count] for i in range(pending)]
    # Shapes and dtypes first: a float copy of a donor's 1-byte tensors is 4x what it sent.
    _check_shapes(tensors[:count], tensors[count : 2 * count], served, inner_keys, rest[pending * count :])
    if not all(t.is_floating_point() for t in tensors[: (2 + pending) * count]):
        raise SwarmError("its θ, outer momentum or queued updates are not floating-point tensors")
    queued = [[t.float() for t in q] for q in served]
    state = OuterState(
        outer_step=step,
        params=[t.float() for t in tensors[:count]],
        momentum=[t.float() for t in tensors[count : 2 * count]],
        pending=queued,
        inner=list(rest[pending * count :]),
        inner_keys=[list(k) for k in inner_keys],
    )
    _check_values(state)
    return state


MAX_QUEUED = MAX_DELAY + 1
"""Queued updates a served state may hold: an honest peer's ``--delay`` means and the one in
flight (:meth:`optim.diloco.DiLoCo.outer_state`)."""
MOMENTUM_RATIO = 10.0
"""A served outer momentum may be at most this many times θ's norm, a queued update at most θ's
norm. An honest pseudo-gradient is a small fraction of θ (momentum sums them with weights
adding up to 1 / (1 - μ): 10 for μ = 0.9); a donor's 1e30 would move the joiner's θ by 1e30."""


def _check_values(state: OuterState) -> None:
    """SwarmError unless the state's numbers are ones an honest peer could hold. The witnesses
    check θ against theirs, but not every state can be confirmed (:func:`swarm.claims.judge_state`)
    and they never see the rest: a donor's step of -1 stopped the joiner (its next heartbeat
    failed its schema), a NaN queued update stopped it at its next sync, and a queued update of
    1e30 took its θ to 1e30 (the inner optimizer's moments are checked where they are loaded:
    :func:`optim.state.load_inner_state`)."""
    step, highest = state.outer_step, BOUNDS["rounds"].high
    if not 0 <= step <= highest:
        raise SwarmError(f"its outer step {step} is outside 0..{highest}")
    norms = {"θ": global_norm(state.params), "its outer momentum": global_norm(state.momentum)}
    norms.update({f"its queued update {i}": global_norm(update) for i, update in enumerate(state.pending)})
    theta = norms.pop("θ")
    if not math.isfinite(theta):
        raise SwarmError(f"θ {_non_finite(state.params)}")
    for what, norm in norms.items():
        limit = theta * (MOMENTUM_RATIO if what == "its outer momentum" else 1.0) + 1e-6
        if not norm <= limit:
            raise SwarmError(f"{what} has norm {norm:.3g}, more than {limit:.3g} (θ's is {theta:.3g})")


def _non_finite(tensors: list[torch.Tensor]) -> str:
    if all(bool(torch.isfinite(t).all()) for t in tensors):
        return "has a norm beyond float32 (values near 1e19 or more)"
    return "holds NaN/Inf"


def _check_shapes(params, momentum, queued, inner_keys, inner) -> None:
    """SwarmError unless every tensor of a donor's state fits its θ: momentum and queued updates
    of θ's shapes, the inner optimizer's moments of their parameter's shape (only its ``step``
    a scalar). The witnesses check θ alone; without this a donor serving the honest θ and a
    scalar moment made the joiner's first AdamW step raise, and the joiner exit."""
    shapes = [tuple(t.shape) for t in params]
    for what, tensors in [("momentum", momentum)] + [(f"queued update {i}", q) for i, q in enumerate(queued)]:
        if [tuple(t.shape) for t in tensors] != shapes:
            raise SwarmError(f"its {what} does not have the parameters' shapes")
    for key, tensor in zip(inner_keys, inner):
        if not (isinstance(key, (list, tuple)) and len(key) == 2 and isinstance(key[0], int)):
            raise SwarmError(f"an inner optimizer key {key!r} is malformed")
        index, name = key
        scalar = str(name) == "step" and tensor.dim() == 0
        if not (0 <= index < len(shapes) and (scalar or tuple(tensor.shape) == shapes[index])):
            raise SwarmError(f"its inner optimizer's {name!r} of parameter {index} does not fit it")
