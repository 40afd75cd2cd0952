"""Swarm Workbench: config, model and data, the peer loop, the launcher and the CLI."""

from __future__ import annotations

__version__ = "0.1.0"
