"""Random linear sketches: check a ring's sum against what each member says it sent.

The gloo ring's TCP connections carry no proof of who is at the other end. Before a member
trusts the sum it got back, it checks it: every member publishes, over the group's
authenticated board, a sketch ``s_i = R x_i`` of the contribution it put into the ring, and
``R (Σ x_i)`` must equal ``Σ s_i`` up to rounding. ``R`` (``k`` rows) is drawn from a seed only
the group's members know (hivemind's group id, sent over its encrypted channel), so nobody
outside the group can craft a change the sketch misses; a substituted, missing or extra
contribution changes the sum by a vector ``δ`` with ``|R δ| ~ |δ|`` per row.

``R`` is structured so that it costs one small matmul per round instead of ``k`` random numbers
per element: the vector is cut into chunks of ``CHUNK`` elements, ``R[i, c·CHUNK + l] =
w[i, c] · P[i, l]`` with ``w`` (k, chunks) and ``P`` (k, CHUNK) Gaussian from the seed. For a
25 M-element update that is one (k, 6104) @ (6104, 4096) matmul, about 10 ms on one core.

The tolerance: rounding in the ring (the wire codec's precision, once per hop) and in the
sketch's own float32 sums make ``R (Σ x_i) - Σ s_i`` a small random vector; per row it is
about the size of the rounding error's norm, bounded here by ``slack · Σ |x_i|``. A change
smaller than that (about 1e-4 of the update with fp32 on the wire, 1e-2 with fp16) passes, as
rounding would; anything an attacker gains from must be larger. See docs/security.md.

fp16's rounding is relative only down to 2^-14: below, its values are 2^-24 apart whatever their
size, so tiny updates (elements around 1e-6, as at the end of a cosine schedule) round by 3 % of
themselves and failed the relative bound in every round (20 of 20, 3 members). :func:`floor`
adds what that absolute rounding can sum to, which needs the vector's length.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

CHUNK = 4096
ROWS = 8
BLOCK = 32  # chunks per product in Sketcher.rows
# Relative precision of one value on the wire (fp16 keeps 11 significant bits, fp32 24).
WIRE_EPSILON = {"fp16": 2.0**-11, "none": 2.0**-24}
# The largest rounding error of one value however small it is (fp16's subnormal spacing 2^-24;
# fp32's is negligible).
WIRE_FLOOR = {"fp16": 2.0**-25, "none": 2.0**-150}
SIGMAS = 8.0  # a rounding error's projection stays below 8 standard deviations


@dataclass(frozen=True)
class Sketch:
    """What a member says it put into the ring: ``R x`` (ROWS values) and ``|x|``."""

    rows: tuple[float, ...]
    norm: float

    def to_bytes(self) -> bytes:
        return torch.tensor([*self.rows, self.norm], dtype=torch.float64).numpy().tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> Sketch:
        """Raises ValueError for anything but ROWS + 1 finite float64 values."""
        if len(data) != 8 * (ROWS + 1):
            raise ValueError(f"a sketch is {8 * (ROWS + 1)} bytes, got {len(data)}")
        values = torch.frombuffer(bytearray(data), dtype=torch.float64).tolist()
        return cls(tuple(values[:-1]), values[-1])


def _matrices(seed: bytes, chunks: int, fast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(seed).digest()[:8], "little"))
    outer = torch.randn(ROWS, chunks, generator=generator)  # (k, chunks)
    if fast:  # drawn in float32 and widened: 0.09 ms instead of 0.53 ms on one core here
        inner = torch.randn(ROWS, CHUNK, generator=generator).double()
    else:
        inner = torch.randn(ROWS, CHUNK, generator=generator, dtype=torch.float64)  # (k, CHUNK)
    return outer, inner


class Sketcher:
    """One group's ``R`` for a vector of ``count`` elements, applied a segment at a time (so the
    sketches can run while the ring reduces the other segments)."""

    def __init__(self, seed: bytes, count: int, *, fast: bool = False) -> None:
        """``fast``: another R for the same seed, drawn 6x faster; every member must use the
        same (the direct plane's version 2 does; hivemind's path's checks and the state's
        witnesses keep the first, which peers of earlier releases draw too)."""
        self.count = count
        self.outer, self.inner = _matrices(seed, max(1, -(-count // CHUNK)), fast)

    def rows(self, segment: torch.Tensor, start: int = 0) -> torch.Tensor:
        """``R[:, start:start + len] @ segment`` in float64, (k,); ``start`` is a multiple of
        CHUNK, and only the vector's last segment may end inside a chunk."""
        assert segment.dtype == torch.float32 and start % CHUNK == 0, f"{segment.dtype=} {start=}"
        count, first = segment.numel(), start // CHUNK
        whole = count // CHUNK
        # Chunks first, weighted and summed (one matmul that reads the segment once), then the
        # in-chunk weights: R x = Σ_l P[:, l] · Σ_c w[:, c] X[c, l].
        mixed = torch.zeros(ROWS, CHUNK, dtype=torch.float64)
        if whole:
            # In blocks of BLOCK chunks (512 KB of the segment, in L2): MKL's kernel for a (k, n) @
            # (n, CHUNK) product with a long n reads the segment 1.5-1.8x slower than its blocks'.
            part = torch.zeros(ROWS, CHUNK)
            chunks = segment[: whole * CHUNK].view(whole, CHUNK)
            for lo in range(0, whole, BLOCK):
                hi = min(lo + BLOCK, whole)
                part.addmm_(self.outer[:, first + lo : first + hi], chunks[lo:hi])
            mixed += part.double()  # (k, CHUNK)
        if count % CHUNK:
            tail = segment[whole * CHUNK :]
            mixed[:, : tail.numel()] += (
                self.outer[:, first + whole : first + whole + 1].double() * tail.double()
            )
        return (mixed * self.inner).sum(1)  # (k,)


def sketch(flat: torch.Tensor, seed: bytes, *, norm: bool = True) -> Sketch:
    """The sketch of a 1-D float32 tensor under the group's seed (``norm``: also its length)."""
    flat = flat.detach().reshape(-1)
    rows = Sketcher(seed, flat.numel()).rows(flat)
    length = float(torch.linalg.vector_norm(flat)) if norm else 0.0
    return Sketch(tuple(rows.tolist()), length)


def slack(codec: str, members: int) -> float:
    """The tolerance per row, as a fraction of the members' summed norms."""
    wire = WIRE_EPSILON.get(codec, WIRE_EPSILON["fp16"])
    # The codec rounds each contribution once (members' sketches are of what they meant to send),
    # the ring rounds each partial sum once per hop (members - 1 hops), and the sketch's float32
    # sums add about 2^-24 · sqrt(chunks) relative error.
    return SIGMAS * ((members + 1) * wire + 2.0**-24 * 4096)


def floor(codec: str, roundings: int, count: int) -> float:
    """The absolute rounding allowed per row for ``count`` values rounded ``roundings`` times
    each: an error uniform in ±WIRE_FLOOR (standard deviation WIRE_FLOOR/√3) per value and
    rounding, projected on a row of R (entries of variance 1), has a standard deviation of
    WIRE_FLOOR · sqrt(roundings · count / 3); SIGMAS of those."""
    return SIGMAS * WIRE_FLOOR.get(codec, WIRE_FLOOR["fp16"]) * math.sqrt(roundings * max(count, 0) / 3)


def mismatch(
    result: Sketch, parts: list[Sketch], codec: str, *, count: int, allowance: float = 0.0
) -> str | None:
    """Why the ring's result does not match the sum of the members' sketches, or None
    (``count``: the vector's length; ``allowance``: rounding allowed on top of the ring's, per row).

    A non-finite value (a member sent NaN, or says it did) cannot be checked here: the mean is
    then NaN too, and the outer step's own check refuses it, naming the NaN (optim.robust)."""
    values = [*result.rows, *(v for p in parts for v in (*p.rows, p.norm))]
    if not all(math.isfinite(v) for v in values) or any(p.norm < 0 for p in parts):
        return None if not all(math.isfinite(v) for v in result.rows) else "a member's sketch is not finite"
    bound = slack(codec, len(parts)) * sum(p.norm for p in parts) + allowance
    bound += floor(codec, len(parts) + 1, count) + 1e-30
    worst = max(abs(r - sum(p.rows[i] for p in parts)) for i, r in enumerate(result.rows))
    if worst > bound:
        return f"the sum is off by {worst:.3g} (rounding allows {bound:.3g})"
    return None


# --- checking a downloaded state ------------------------------------------------------------
#
# A joiner cannot hash the state it downloads: honest peers' θ agree only up to rounding (hivemind
# sends each member the mean minus its own part, rounded by the wire codec). So it sketches θ,
# one sketch per tensor, under a seed the donor never sees (sent only to other peers, who answer
# while the state streams), and compares with theirs. The donor cannot know R while it serves,
# so a θ it changed by more than rounding fails the comparison with overwhelming probability.

STATE_TOLERANCE = 1e-3
"""Per tensor, per row: |R a - R b| <= STATE_TOLERANCE · max(|a|, |b|). Peers that averaged together
differ by far less (bit-identical on the direct plane, ~1e-6 on hivemind's with fp16); a served θ
off by 1 % of any one tensor's norm fails with probability above 1 - 1e-8."""
STATE_FLOOR = 1e-7
"""Plus this fraction of the whole θ's norm, for tensors near zero."""


def state_sketches(params: Sequence[torch.Tensor], seed: bytes) -> list[Sketch]:
    """One sketch per tensor of θ, each tensor with its own R (the seed and its index)."""
    return [
        sketch(t.detach().float().reshape(-1).contiguous(), seed + i.to_bytes(4, "little"))
        for i, t in enumerate(params)
    ]


def state_mismatch(mine: Sequence[Sketch], theirs: Sequence[Sketch]) -> str | None:
    """Why two peers' θ (as sketched under one seed) differ by more than rounding, or None."""
    if len(mine) != len(theirs):
        return f"{len(theirs)} tensors against {len(mine)}"
    # A floor for tensors near zero (a bias that barely moved): rounding there is relative to
    # the updates, which scale with the whole model rather than with that tensor.
    floor = STATE_FLOOR * math.sqrt(sum(a.norm**2 for a in mine if math.isfinite(a.norm)))
    for index, (a, b) in enumerate(zip(mine, theirs)):
        values = [*a.rows, a.norm, *b.rows, b.norm]
        if not all(math.isfinite(v) for v in values):
            return f"tensor {index} is not finite"
        bound = STATE_TOLERANCE * max(a.norm, b.norm) + floor + 1e-30
        worst = max([abs(x - y) for x, y in zip(a.rows, b.rows)] + [abs(a.norm - b.norm)])
        if worst > bound:
            return f"tensor {index} differs by {worst:.3g} (rounding allows {bound:.3g})"
    return None
