"""Choices of the optimizer settings that torch-free code (the command line) offers too."""

from __future__ import annotations

TOPK_MEANS = ("group", "kept")
"""How a group averages sparse updates (``DiLoCoConfig.topk_mean``): over the whole group, or
each coordinate over the members that kept it."""
