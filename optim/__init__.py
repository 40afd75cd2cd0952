"""Low-communication outer optimizers on plain torch. No network, no UI.

The training loop stays plain PyTorch: wrap the model and its inner optimizer in an outer
optimizer, call ``outer.step()`` after every inner step, and give it an :class:`Averager`
(the in-process one here, or ``swarm.averaging.SwarmAverager`` for a real swarm). The methods
a run can name, and what each outer loop offers, are in :mod:`optim.api`.

Names load on first use, so that ``optim.api`` (the registry the command line reads) imports
without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Averager": "optim.averager",
    "LocalAverager": "optim.averager",
    "RoundReport": "optim.averager",
    "CODECS": "optim.codecs",
    "ErrorFeedback": "optim.codecs",
    "make_codec": "optim.codecs",
    "DataParallel": "optim.data_parallel",
    "DiLoCo": "optim.diloco",
    "DiLoCoConfig": "optim.diloco",
    "OuterState": "optim.state",
    "local_sgd": "optim.local_sgd",
    "sparseloco": "optim.sparseloco",
    "StreamingConfig": "optim.streaming",
    "StreamingDiLoCo": "optim.streaming",
    "METHODS": "optim.api",
    "Method": "optim.api",
    "OuterOptimizer": "optim.api",
    "Rounds": "optim.api",
    "method": "optim.api",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'optim' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
