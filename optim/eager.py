"""torch's AdamW and SGD without torch's compiler, for processes that never compile.

Every ``torch.optim`` optimizer imports ``torch._dynamo`` (and sympy with it) the first time
it builds a param group or steps: ``add_param_group``, ``zero_grad``, ``state_dict`` and
``load_state_dict`` are wrapped so that dynamo skips them, and ``step`` is wrapped to set the
grad mode between two graph breaks. That import costs about as much CPU as ``import torch``
(2 s here), and a peer, which compiles nothing, paid it at every start, as did each of a
node's ranks. These classes call torch's own methods without those wrappers: the same
arithmetic, the same state dicts, the same step hooks. Under ``torch.compile`` they would be
traced rather than skipped; code that compiles its training step should use torch's classes.
"""

from __future__ import annotations

import inspect
from typing import Any, TypeVar

import torch

_SKIPPED_BY_DYNAMO = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")

OptimizerClass = TypeVar("OptimizerClass", bound=type[torch.optim.Optimizer])


def _without_compiler(cls: OptimizerClass) -> OptimizerClass:
    """Give ``cls`` its torch base class's methods, unwrapped (see the module docstring)."""
    base = cls.__mro__[1]
    for name in _SKIPPED_BY_DYNAMO:
        setattr(cls, name, inspect.unwrap(getattr(base, name)))
    step = inspect.unwrap(base.step)  # past the step hooks torch adds at the first instance

    def eager_step(self: torch.optim.Optimizer, closure: Any = None) -> Any:
        before = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults.get("differentiable", False))
            return step(self, closure)
        finally:
            torch.set_grad_enabled(before)

    eager_step.__doc__ = step.__doc__
    cls.step = eager_step
    return cls


@_without_compiler
class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` that does not import the compiler (see the module docstring)."""


@_without_compiler
class SGD(torch.optim.SGD):
    """``torch.optim.SGD`` that does not import the compiler (see the module docstring)."""
