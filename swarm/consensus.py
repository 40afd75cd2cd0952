"""Checking hivemind's all-reduce: every member of a group must end with the same weighted mean.

hivemind's butterfly all-reduce survives faults by leaving them out, and says nothing: a member
whose stream to a reducer fails keeps its own values for that reducer's part, and a reducer that
bans a slow sender averages that part without it, and both steps report success. The members
then hold different "means" (seen under load: two peers' means 1e-5 apart in norm, their θ 1e-3
apart after the round), which the next round's θ check finds only one round later, with a state
download; after a run's last round, never.

So on hivemind's plane each member sketches its weighted contribution before the all-reduce and
the result it got after it (:mod:`swarm.sketch`, under the group's secret seed), and posts both
to the group's board. Every member checks every member's result against the sum of the
contributions, so all reach the same verdict from the same posts: a round that did not give
everyone the mean fails for all of them, like any failed round. A member whose all-reduce failed
posts :data:`FAILED` so that the others do not wait for it.

With ``--aggregate trimmed-mean`` the result is not linear in the contributions, so it cannot
be checked against their sketches: :func:`disagreement` then checks that every member got the
same result (up to each one's own rounding), which catches a member left with its own values for
a part, the fault that matters here (a reducer's trimming is its own business: it is the robust
rule).

Tolerance: hivemind returns to member j ``x_j + Q(mean - Q(x_j))`` for the parts others reduce
(``Q``: the wire codec), so its result differs from the mean by about one rounding of its own
unscaled ``x_j`` and of the delta, on top of the contributions' roundings that the direct plane
allows for (:func:`swarm.sketch.slack`). int8's quantization error (up to half of a heavy-tailed
tensor's norm) is too large for a useful bound: int8 rounds are not checked.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swarm.sketch import CHUNK, ROWS, SIGMAS, WIRE_EPSILON, Sketch, Sketcher, floor, mismatch

CHECKED_CODECS = ("none", "fp16")
FAILED = b"failed"
"""Posted by a member whose all-reduce raised: the round fails for every member at once."""


class TensorSketcher:
    """One ``R`` over a list of tensors, each starting at a chunk boundary of a virtual vector
    (the gaps are zeros), so that any tensor can be sketched on its own and the sum of the
    tensors' sketches is the sketch of them all."""

    def __init__(self, seed: bytes, numels: Sequence[int]) -> None:
        self.offsets: list[int] = []
        self.count = sum(numels)
        """Elements in the tensors (the gaps between them are exact zeros)."""
        end = 0
        for count in numels:
            self.offsets.append(end)
            end += -(-count // CHUNK) * CHUNK
        self._sketcher = Sketcher(seed, max(end, 1))

    def sketch(self, tensors: Sequence[torch.Tensor], scale: float = 1.0) -> Sketch:
        """``R (scale · x)`` and ``|scale · x|`` for the tensors ``x`` (read only)."""
        rows = torch.zeros(ROWS, dtype=torch.float64)
        squares = 0.0
        for tensor, offset in zip(tensors, self.offsets, strict=True):
            flat = tensor.detach().reshape(-1).float()
            rows += self._sketcher.rows(flat, offset)
            squares += float(torch.linalg.vector_norm(flat)) ** 2
        return Sketch(tuple((rows * scale).tolist()), abs(scale) * math.sqrt(squares))


def scaled(sketch: Sketch, factor: float) -> Sketch:
    """The sketch of ``factor · x`` from the sketch of ``x`` (a sketch is linear)."""
    return Sketch(tuple(factor * r for r in sketch.rows), abs(factor) * sketch.norm)


@dataclass(frozen=True)
class Post:
    """What a member says after hivemind's all-reduce: the sketch of what it put in (scaled by
    its share of the group's weight), the norm of its own unscaled update, and the sketch of
    what it got back."""

    sent: Sketch
    own_norm: float
    got: tuple[float, ...]

    def to_bytes(self) -> bytes:
        return self.sent.to_bytes() + struct.pack(f"<{ROWS + 1}d", self.own_norm, *self.got)

    @classmethod
    def from_bytes(cls, data: bytes) -> Post:
        """Raises ValueError for anything but the exact layout of finite-or-not float64s."""
        size = 8 * (ROWS + 1)
        if len(data) != 2 * size:
            raise ValueError(f"a post is {2 * size} bytes, got {len(data)}")
        own_norm, *got = struct.unpack(f"<{ROWS + 1}d", data[size:])
        return cls(Sketch.from_bytes(data[:size]), own_norm, tuple(got))


def disagreement(posts: Sequence[bytes], codec: str, *, count: int, linear: bool = True) -> str | None:
    """Why the members (posts in rank order) did not all end with the group's mean, or None
    (``count``: the elements averaged, the same for every member; ``linear=False``, a trimmed
    mean: why they did not all end with the same result).

    Non-finite values are let through, as on the direct plane: the mean is then not finite and
    the outer step's own check refuses it, naming the NaN (optim.robust)."""
    parsed: list[Post] = []
    for rank, data in enumerate(posts):
        if data == FAILED:
            return f"member {rank}'s all-reduce failed"
        try:
            parsed.append(Post.from_bytes(data))
        except ValueError as error:
            return f"member {rank} posted a malformed check ({error})"
    sent = [p.sent for p in parsed]
    wire = WIRE_EPSILON.get(codec, WIRE_EPSILON["fp16"])
    if not linear:
        return _unequal(parsed, wire, floor(codec, 2 * (len(parsed) + 2), count))
    for rank, post in enumerate(parsed):
        if not math.isfinite(post.own_norm) or post.own_norm < 0:
            if math.isfinite(post.own_norm):
                return f"member {rank} posted a negative norm"
            continue
        # This member's own rounding (its x_j and the delta it got back, about |x_j| + |mean|).
        allowance = 3 * SIGMAS * wire * post.own_norm + floor(codec, 2, count)
        why = mismatch(Sketch(post.got, 0.0), sent, codec, count=count, allowance=allowance)
        if why is not None:
            return f"member {rank} did not get the group's mean: {why}"
    return None


def _unequal(parsed: list[Post], wire: float, absolute: float) -> str | None:
    """Why some member's result differs from the first member's by more than their own roundings
    (each member adds the result it got for another reducer's part to its own ``x_j``, rounded
    by the wire codec, about ``|x_j|`` and the result's size, which is at most ``sqrt(Σ |x_i|²)``
    for a trimmed mean; ``absolute``: the roundings of tiny values, :func:`swarm.sketch.floor`),
    or None."""
    finite = [all(math.isfinite(v) for v in p.got) for p in parsed]
    if not any(finite):
        return None  # NaN for everyone: the outer step's own check refuses it on every member
    if not all(finite):
        return f"members {[r for r, f in enumerate(finite) if not f]} got a non-finite result, the others did not"
    norms = [p.own_norm for p in parsed]
    if not all(math.isfinite(n) and n >= 0 for n in norms):
        return "a member posted a norm that is negative or not finite"
    result = math.sqrt(sum(n * n for n in norms))
    first = parsed[0]
    for rank, post in enumerate(parsed[1:], start=1):
        bound = SIGMAS * wire * (3 * (post.own_norm + first.own_norm) + 2 * result) + absolute + 1e-30
        worst = max(abs(a - b) for a, b in zip(post.got, first.got))
        if worst > bound:
            return (
                f"member {rank}'s result differs from member 0's by {worst:.3g} (rounding allows {bound:.3g})"
            )
    return None
