"""Low-communication outer optimizers on plain torch. No network, no UI.

The training loop stays plain PyTorch: wrap the model and its inner optimizer in an outer
optimizer, call ``outer.step()`` after every inner step, and give it an :class:`Averager`
(the in-process one here, or ``swarm.averaging.SwarmAverager`` for a real swarm).
"""

from __future__ import annotations

from optim.averager import Averager, LocalAverager, RoundReport
from optim.diloco import DiLoCo, DiLoCoConfig, OuterState

__all__ = ["Averager", "DiLoCo", "DiLoCoConfig", "LocalAverager", "OuterState", "RoundReport"]
