"""Swarm Workbench: config, model and data, the peer loop, the launcher and the CLI."""

from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name: str):
    """`from workbench import Experiment, compare` without slowing `workbench --help` down."""
    if name in ("Experiment", "compare"):
        from workbench import experiment

        return getattr(experiment, name)
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")
