"""SparseLoCo: sparse pseudo-gradients with error feedback in place of outer momentum.

https://arxiv.org/abs/2508.15706 (and Templar's ``src/tplr/compress/topk.py``).
Each peer sends only the top-k entries (1-3 %) of its pseudo-gradient; what it did not send
stays in its error-feedback residual (``optim.codecs.ErrorFeedback``) and is added to the next
round's, so nothing is lost, only delayed. The residual plays the role outer momentum plays in
DiLoCo, so the outer step is plain SGD with lr 1.

Implemented as a preset of :class:`~optim.diloco.DiLoCo` (codec ``topk`` + error feedback).
Differences from the paper, kept for a later issue: values are fp16 (the paper: 2-bit), top-k
is taken per tensor (the paper: per 64-element chunk, ``TopKCodec(chunk=64)`` supports it).
"""

from __future__ import annotations

from optim.diloco import DiLoCo, DiLoCoConfig

__all__ = ["DiLoCo", "sparseloco"]


def sparseloco(*, inner_steps: int = 50, density: float = 0.01) -> DiLoCoConfig:
    """Top-k (``density``) pseudo-gradients with error feedback; outer SGD lr 1, no momentum."""
    return DiLoCoConfig(
        inner_steps=inner_steps,
        outer_lr=1.0,
        outer_momentum=0.0,
        nesterov=False,
        codec="topk",
        topk_density=density,
        error_feedback=True,
    )
