"""Swarm Workbench: the config tree and, in rooms, the command line (`cli`), what a peer runs
(`run`), the local lab (`local`) and the notebook API (`notebook`)."""

from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name: str):
    """`from workbench import Experiment, compare` without slowing `workbench --help` down."""
    if name in ("Experiment", "Stopped", "compare"):
        from workbench.notebook import experiment

        return getattr(experiment, name)
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")
