"""Names the command line offers as choices, importable without torch (`workbench --help` stays
fast). tests/unit/test_cli.py checks that each list matches the registry it mirrors."""

from __future__ import annotations

from swarm.bounds import UPDATE_CODECS  # noqa: F401 - one list for the CLI, steering and the TUI

MODEL_PRESETS = ("medium", "small", "tiny")
"""workbench.run.model.PRESETS"""
SIMULATE_METHODS = ("dp", "local_sgd", "diloco", "sparseloco", "streaming")
"""workbench.simulate.METHODS"""
WANDB_MODES = ("offline", "online", "disabled")
"""wandb.init's modes that workbench.run.exporters accepts"""
DELAYED_OUTER = {"eager": (0.8, 0.3), "naive": (1.0, 0.0)}
"""(outer lr, outer momentum) DiLoCo defaults to with ``--overlap`` / ``--delay 1``: the update a
delayed round applies is a round stale, and the paper's momentum 0.9 compounds the staleness
(naive: eval loss 3.45 at H=50 against 2.17 without momentum; eager: 2.50 against 1.92).
Measured in docs/optimizers.md."""
