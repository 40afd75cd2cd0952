"""Names the command line offers as choices, importable without torch (`workbench --help` stays
fast). tests/unit/test_cli.py checks that each list matches the registry it mirrors."""

from __future__ import annotations

from swarm.bounds import UPDATE_CODECS  # noqa: F401 - one list for the CLI, steering and the TUI

MODEL_PRESETS = ("medium", "small", "tiny")
"""workbench.run.model.PRESETS"""
WANDB_MODES = ("offline", "online", "disabled")
"""wandb.init's modes that workbench.run.exporters accepts"""
