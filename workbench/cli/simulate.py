"""The `workbench simulate` parser, apart from workbench.simulate so that it imports without torch."""

from __future__ import annotations

import argparse

from swarm.bounds import parser as bounded
from workbench.cli.optimizer_flags import add_optimizer_options, add_round_seconds


def add_simulate_parser(commands) -> None:
    parser = commands.add_parser(
        "simulate",
        help="compare outer optimizers on N virtual peers in this process",
        description="Run an outer optimizer on N virtual peers in one process (exact, deterministic for a seed).",
        epilog="examples:\n  workbench simulate --method diloco --peers 8 --steps 400\n"
        "  workbench simulate --method sparseloco --json\n"
        "  workbench simulate --method diloco --overlap --peers 4 --inner-steps 10 --steps 40 --model tiny --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--peers", type=bounded("peers"), default=4, help="virtual peers (default: 4)")
    parser.add_argument(
        "--steps", type=bounded("steps"), default=200, help="inner steps per peer (default: 200)"
    )
    add_optimizer_options(
        parser.add_argument_group("optimizer (the same flags as start and join)"), simulate=True
    )
    parser.add_argument("--model", default="small", help="model preset (default: small)")
    parser.add_argument(
        "--data", metavar="PATH", help="text file or folder (default: the Python stdlib's source)"
    )
    parser.add_argument("--batch-size", type=bounded("batch_size"), default=16)
    parser.add_argument(
        "--straggler",
        action="append",
        default=[],
        metavar="RANK:FRACTION",
        help="a peer that runs only FRACTION of each round's steps, e.g. 3:0.5 (repeatable)",
    )
    parser.add_argument(
        "--dropout", type=bounded("dropout"), default=0.0, help="probability a peer misses a round"
    )
    parser.add_argument(
        "--speeds",
        metavar="S1,S2,...",
        help="each peer's speed on a virtual clock, e.g. 1,1,0.5,0.5: a speed-1 peer's inner step "
        "takes --step-seconds; the JSON reports virtual_seconds and each peer's utilization",
    )
    add_round_seconds(parser, virtual=True)
    parser.add_argument(
        "--step-seconds",
        type=bounded("step_seconds"),
        default=1.0,
        help="virtual seconds of one inner step at speed 1 (default: 1)",
    )
    parser.add_argument("--seed", type=bounded("seed"), default=0)
    parser.add_argument(
        "--threads", type=bounded("threads"), default=1, help="torch threads per process (default: 1)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
