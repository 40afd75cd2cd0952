"""torch's AdamW and SGD without torch's compiler, for processes that never compile.

Every ``torch.optim`` optimizer imports ``torch._dynamo`` (and sympy with it) the first time
it builds a param group or steps: ``add_param_group``, ``zero_grad``, ``state_dict`` and
``load_state_dict`` are wrapped so that dynamo skips them, and ``step`` is wrapped to set the
grad mode between two graph breaks. That import costs about as much CPU as ``import torch``
(2 s here), and a peer, which compiles nothing, paid it at every start, as did each of a
node's ranks. These classes call torch's own methods without those wrappers: the same
arithmetic, the same state dicts, the same step hooks. Under ``torch.compile`` they would be
traced rather than skipped; code that compiles its training step should use torch's classes.

Only the wrappers named above are removed. A torch whose methods carry another wrapper keeps
it (and may import the compiler again: ``tests/unit/test_eager_optim.py`` then fails).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.optim import optimizer as _torch_optimizer

_SKIPPED_BY_DYNAMO = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")


def _wrapper_code(make: Callable[[Callable[..., Any]], Any]) -> Any:
    return getattr(make(lambda *args, **kwargs: None), "__code__", None)


# The code objects of torch's wrappers: the same for every method each of them wraps.
_KNOWN_WRAPPERS = {
    code
    for code in (
        _wrapper_code(torch._disable_dynamo),
        _wrapper_code(getattr(_torch_optimizer, "_use_grad_for_differentiable", lambda f: f)),
        _wrapper_code(torch.optim.Optimizer.profile_hook_step),  # added at a class's first instance
    )
    if code is not None
}

OptimizerClass = TypeVar("OptimizerClass", bound=type[torch.optim.Optimizer])


def _unwrapped(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` without torch's known wrappers (any other wrapper stays)."""
    while getattr(method, "__code__", None) in _KNOWN_WRAPPERS and hasattr(method, "__wrapped__"):
        method = method.__wrapped__
    return method


def _without_compiler(cls: OptimizerClass) -> OptimizerClass:
    """Give ``cls`` its torch base class's methods, unwrapped (see the module docstring)."""
    base = cls.__mro__[1]
    for name in _SKIPPED_BY_DYNAMO:
        setattr(cls, name, _unwrapped(getattr(base, name)))
    step = _unwrapped(base.step)

    def eager_step(self: torch.optim.Optimizer, closure: Any = None) -> Any:
        before = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            return step(self, closure)
        finally:
            torch.set_grad_enabled(before)

    eager_step.__doc__ = step.__doc__
    eager_step.__name__, eager_step.__qualname__ = "step", f"{cls.__qualname__}.step"
    cls.step = eager_step
    return cls


@_without_compiler
class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` that does not import the compiler (see the module docstring)."""


@_without_compiler
class SGD(torch.optim.SGD):
    """``torch.optim.SGD`` that does not import the compiler (see the module docstring)."""
