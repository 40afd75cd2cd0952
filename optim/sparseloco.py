"""SparseLoCo: sparse, 2-bit pseudo-gradients with error feedback in place of outer momentum.

Sarfi et al. 2025, "Communication Efficient LLM Pre-training with SparseLoCo",
https://arxiv.org/abs/2508.15706 (settings as in the authors' reference code).

Each round a peer adds its pseudo-gradient to its error-feedback accumulator, decayed by β
(``e ← β·e + Δ``), and sends the accumulator's top-k entries per chunk of 4096 elements
(128 of them: 3.125 %), each value quantized to 2 bits (4 levels per tensor, 6 standard
deviations wide, each level the mean of the values it holds) with a 12-bit in-chunk index:
1.75 B per kept value. What it sent, as the others decode it, leaves the accumulator. The
group's mean of the sparse updates is applied with plain SGD, lr 1, no momentum: the
accumulator plays the role outer momentum plays in DiLoCo.

Each coordinate of the group's update is averaged over the peers that kept it, as in the
reference (``topk_mean="kept"``): the all-reduce carries each peer's kept-mask next to its values
(the mask is implied by the indices in the encoded update, so the payload does not grow).

Implemented as a preset of :class:`~optim.diloco.DiLoCo` (codec ``topk`` with ``chunk``,
``value_bits=2``, ``topk_mean="kept"`` and error feedback with ``decay``). One difference from
the reference code, kept on purpose: chunks are 4096 consecutive elements of the flattened
tensor (the reference cuts 2-D weights into 64x64 blocks, the same size).
"""

from __future__ import annotations

from optim.diloco import DiLoCo, DiLoCoConfig

__all__ = ["CHUNK", "DECAY", "DENSITY", "DiLoCo", "sparseloco"]

CHUNK = 4096
DENSITY = 128 / 4096
DECAY = 0.95


def sparseloco(
    *,
    inner_steps: int = 50,
    density: float = DENSITY,
    chunk: int = CHUNK,
    bits: int = 2,
    decay: float = DECAY,
    mean: str = "kept",
) -> DiLoCoConfig:
    """SparseLoCo's published configuration (each knob overridable): chunked top-k, 2-bit values,
    error feedback decaying by ``decay``; outer SGD lr 1, no momentum."""
    return DiLoCoConfig(
        inner_steps=inner_steps,
        outer_lr=1.0,
        outer_momentum=0.0,
        nesterov=False,
        codec="topk",
        topk_density=density,
        topk_chunk=chunk,
        topk_bits=bits,
        topk_mean=mean,
        error_feedback=True,
        error_decay=decay,
    )
