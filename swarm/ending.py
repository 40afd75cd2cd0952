"""The end of a finite run: the peers that end at the same outer step leave holding one θ.

A round checks the θ its members *start* from (:func:`swarm.gathered.diverged_from_group`), so
a peer that ends its last round on another θ than the others (it stepped alone, or its group
split from theirs) has no later round to notice: the churn soak ended twice with one live peer's
θ 4e-4 away from the other three (2026-12-03). So after its last round a peer stays a while in
stage ``finishing``, publishing a sketch of its θ under a seed every peer derives from the step
(:func:`final_sketch`), and the peers that end at that step compare (:func:`verdict`):

- most of them (this one counted) hold another θ: it downloads that θ from them;
- the others hold its θ and nobody it waits for is still in its last rounds: it says it is
  ``settled``, and leaves once those holding its θ say so too (or have left);
- otherwise it waits (the ones holding another θ download it from this one), at most a round
  wait.

Settling first: peers that averaged with different others see different votes. P3, which
averaged only with P2, saw P2 on its θ and left; P2 also saw P0 and P1 on another θ, lost the
vote and downloaded theirs: the run ended on two θ (a review, stop 59: 60 of 434 such 4-peer
cases). P3 now waits for P2 to be settled, sees it switch, and follows.

Heartbeats are claims (:mod:`swarm.claims`): only peers that averaged with this one in a
verified round vote or are waited for, and the state downloaded is checked by witnesses like
any other download. The sketch's seed is public: it decides nothing a peer's word does not.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from swarm.records import PeerHeartbeat, Stage
from swarm.sketch import ROWS, state_sketches

SEED = b"workbench-final-theta:"
TOLERANCE = 1e-5
"""Two θ are the same when every row of their sketches, and their lengths, differ by at most
this fraction of the longer one. A row sees a difference δ in any direction as about |δ| (a
per-tensor length barely moves when δ is orthogonal to θ): peers that averaged together are
bit-identical, on either plane (swarm.butterfly); the soak's split was about 1e-3 of |θ| away."""


def final_sketch(params: Sequence[torch.Tensor], step: int) -> list[float]:
    """θ at ``step`` as ROWS projections and its length: the tensors' sketches under the step's
    public seed (:func:`swarm.sketch.state_sketches`) summed, a projection of the whole θ."""
    parts = state_sketches(params, SEED + step.to_bytes(8, "little"))
    rows = [math.fsum(part.rows[i] for part in parts) for i in range(ROWS)]
    return [*rows, math.sqrt(math.fsum(part.norm**2 for part in parts))]


def parse(values: Sequence[float]) -> list[float] | None:
    """A published sketch, or None if it is not ROWS finite rows and a length >= 0."""
    if len(values) != ROWS + 1 or not all(math.isfinite(v) for v in values) or values[-1] < 0:
        return None
    return [float(v) for v in values]


def same_theta(a: Sequence[float], b: Sequence[float], rel_tol: float = TOLERANCE) -> bool:
    bound = rel_tol * max(a[-1], b[-1]) + 1e-30
    return all(abs(x - y) <= bound for x, y in zip(a, b))


@dataclass(frozen=True)
class Ending:
    """What a finishing peer does next: ``leave``, ``settle`` (say it would leave, and wait for
    the round mates holding its θ to say so), ``wait`` or ``download`` (from ``holders``, the
    peers holding the θ most of them hold)."""

    action: str
    why: str
    holders: frozenset[str] = frozenset()
    agreeing: int = 0
    """Peers that end at this step holding this peer's θ (itself not counted)."""


def verdict(
    peer_id: str, mine: Sequence[float], step: int, beats: Iterable[PeerHeartbeat], vouched: set[str]
) -> Ending:
    """What this peer, which ended its rounds at ``step`` holding θ sketched as ``mine``, makes of
    the others' heartbeats ("leaving" ones included): the peers that averaged with it
    (``vouched``) and end at that step vote with their θ (ties go to the θ held by the lowest
    peer id, as in a round), those that left with it too; those still in their last rounds
    are waited for."""
    ending = [
        b
        for b in beats
        if b.peer_id != peer_id and b.peer_id in vouched and b.rounds == step and b.stage is not Stage.PAUSED
    ]
    votes, still = {peer_id: list(mine)}, []
    for b in ending:
        done = b.stage in (Stage.FINISHING, Stage.LEAVING) and b.outer_step == step
        theta = parse(b.final_theta) if done else None
        if theta is not None:  # finishing, or gone (it left holding that θ)
            votes[b.peer_id] = theta
        elif b.outer_step <= step and b.stage not in (Stage.FINISHING, Stage.LEAVING):
            still.append(b.name)  # in its last rounds, or its heartbeat not yet "finishing"
    still.sort()

    # Peers ending at this step that this one never averaged with do not vote (fresh keys are
    # free), but they break a tie between the θs the voters hold: peers that trust different
    # others each saw their own θ win a tie (P1 trusts P2; P2 trusts P1 and P3, who holds P2's
    # θ), each waited for the other to download, and they left on different θ.
    outside = [
        parse(b.final_theta)
        for b in beats
        if b.peer_id != peer_id
        and b.peer_id not in vouched
        and b.rounds == step
        and b.stage in (Stage.FINISHING, Stage.LEAVING)
        and b.outer_step == step
    ]
    outside = [theta for theta in outside if theta is not None]

    def agreeing(theta: list[float]) -> set[str]:
        return {peer for peer, other in votes.items() if same_theta(theta, other)}

    def rank(peer: str) -> tuple[int, int, str]:
        held = agreeing(votes[peer])
        return -len(held), -sum(same_theta(votes[peer], other) for other in outside), min(held)

    best = min(votes, key=rank)
    mates = agreeing(votes[peer_id]) - {peer_id}
    holders = agreeing(votes[best])
    # A round mate that left holding this θ left on this peer's word (it was settled): this
    # peer no longer takes another θ (the mate cannot follow it any more).
    left_on_it = any(b.stage is Stage.LEAVING and b.peer_id in mates for b in ending)
    # While some are still in their last rounds, only a θ that wins whatever they end on.
    if (
        not left_on_it
        and peer_id not in holders
        and (not still or len(holders) > len(votes) - len(holders) + len(still))
    ):
        return Ending(
            "download",
            f"{len(holders)} of {len(votes)} peers that end at outer step {step} hold another θ",
            frozenset(holders),
            len(mates),
        )
    others = len(votes) - 1 - len(mates)
    if others or still:  # the others to download this one's θ, or the vote to settle
        parts = [f"{others} peer(s) on another θ"] if others else []
        parts += [f"{', '.join(still)} still in their last rounds"] if still else []
        return Ending("wait", "; ".join(parts), agreeing=len(mates))
    unsettled = sorted(
        b.name for b in ending if b.peer_id in mates and b.stage is Stage.FINISHING and not b.settled
    )
    if unsettled:  # they may yet see a vote this one cannot (peers it never averaged with)
        return Ending("settle", f"{', '.join(unsettled)} not settled on this θ yet", agreeing=len(mates))
    return Ending(
        "leave", f"{len(mates)} other peer(s) end at outer step {step} on this θ", agreeing=len(mates)
    )
