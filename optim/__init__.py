"""Low-communication outer optimizers on plain torch. No network, no UI.

The training loop stays plain PyTorch: wrap the model and its inner optimizer in an outer
optimizer, call ``outer.step()`` after every inner step, and give it an :class:`Averager`
(the in-process one here, or ``swarm.averaging.SwarmAverager`` for a real swarm).
"""

from __future__ import annotations

from optim.averager import Averager, LocalAverager, RoundReport
from optim.codecs import CODECS, ErrorFeedback, make_codec
from optim.data_parallel import DataParallel
from optim.diloco import DiLoCo, DiLoCoConfig, OuterState
from optim.local_sgd import local_sgd
from optim.sparseloco import sparseloco
from optim.streaming import StreamingConfig, StreamingDiLoCo

__all__ = [
    "CODECS",
    "Averager",
    "DataParallel",
    "DiLoCo",
    "DiLoCoConfig",
    "ErrorFeedback",
    "LocalAverager",
    "OuterState",
    "RoundReport",
    "StreamingConfig",
    "StreamingDiLoCo",
    "local_sgd",
    "make_codec",
    "sparseloco",
]
