"""Local SGD / FedAvg: plain parameter averaging every H local steps.

McMahan et al., 2017, "Communication-Efficient Learning of Deep Networks from Decentralized
Data", https://arxiv.org/abs/1602.05629.

Averaging parameters is DiLoCo's outer step with lr 1 and no momentum: θ ← θ − mean(θ − θ_i)
= mean(θ_i). So LocalSGD is a preset of :class:`~optim.diloco.DiLoCo`, not a second code path:
the same phases, state download and codecs apply.
"""

from __future__ import annotations

from optim.diloco import DiLoCo, DiLoCoConfig

__all__ = ["DiLoCo", "local_sgd"]


def local_sgd(*, inner_steps: int = 50) -> DiLoCoConfig:
    """FedAvg every ``inner_steps`` steps: outer SGD with lr 1, no momentum."""
    return DiLoCoConfig(inner_steps=inner_steps, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
