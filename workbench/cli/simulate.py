"""The `workbench simulate` parser, apart from workbench.simulate so that it imports without torch."""

from __future__ import annotations

import argparse

from workbench.settings.commands import add_simulate_options


def add_simulate_parser(commands) -> None:
    parser = commands.add_parser(
        "simulate",
        help="compare outer optimizers on N virtual peers in this process",
        description="Run an outer optimizer on N virtual peers in one process (exact, deterministic for a seed, unless the model has dropout layers).",
        epilog="examples:\n  workbench simulate --method diloco --peers 8 --steps 400\n"
        "  workbench simulate --method sparseloco --json\n"
        "  workbench simulate --method diloco --overlap --peers 4 --inner-steps 10 --steps 40 --model tiny --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_simulate_options(parser)
