"""Names the command line offers as choices, importable without torch (`workbench --help` stays
fast). tests/unit/test_cli.py checks that each list matches the registry it mirrors."""

from __future__ import annotations

UPDATE_CODECS = ("bf16", "fp16", "int4", "int8", "none", "topk")
"""optim.codecs.CODECS"""
MODEL_PRESETS = ("medium", "small", "tiny")
"""workbench.model.PRESETS"""
SIMULATE_METHODS = ("dp", "local_sgd", "diloco", "sparseloco", "streaming")
"""workbench.simulate.METHODS"""
WANDB_MODES = ("offline", "online", "disabled")
"""wandb.init's modes that workbench.exporters accepts"""
NAIVE_DELAY_MOMENTUM = 0.6
"""The outer momentum ``--no-eager`` defaults to: the naive one-step delay diverges with the
paper's 0.9 (the update it applies is a round stale; momentum compounds it). Measured in
docs/optimizers.md."""
