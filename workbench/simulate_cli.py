"""The `workbench simulate` parser, apart from workbench.simulate so that it imports without torch."""

from __future__ import annotations

import argparse

from swarm.bounds import parser as bounded
from workbench.names import SIMULATE_METHODS, UPDATE_CODECS


def add_simulate_parser(commands) -> None:
    parser = commands.add_parser(
        "simulate",
        help="compare outer optimizers on N virtual peers in this process",
        description="Run an outer optimizer on N virtual peers in one process (exact, deterministic for a seed).",
        epilog="examples:\n  workbench simulate --method diloco --peers 8 --steps 400\n"
        "  workbench simulate --method sparseloco --update-codec topk --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--method", default="diloco", choices=SIMULATE_METHODS, help="outer method (default: diloco)"
    )
    parser.add_argument("--peers", type=bounded("peers"), default=4, help="virtual peers (default: 4)")
    parser.add_argument(
        "--inner-steps",
        type=bounded("inner_steps"),
        default=50,
        metavar="H",
        help="inner steps per round (default: 50)",
    )
    parser.add_argument(
        "--steps", type=bounded("steps"), default=200, help="inner steps per peer (default: 200)"
    )
    parser.add_argument(
        "--codec",
        default="none",
        choices=UPDATE_CODECS,
        help="pseudo-gradient codec from optim.codecs (default: none)",
    )
    parser.add_argument(
        "--error-feedback", action="store_true", help="keep what the codec drops for the next round"
    )
    parser.add_argument(
        "--density",
        type=bounded("density"),
        default=0.01,
        help="fraction kept by the topk codec (default: 0.01)",
    )
    parser.add_argument("--outer-lr", type=bounded("outer_lr"), default=0.7)
    parser.add_argument("--outer-momentum", type=bounded("outer_momentum"), default=0.9)
    parser.add_argument("--inner-lr", type=bounded("inner_lr"), default=1e-3)
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
        "--fragments", type=bounded("fragments"), default=4, help="streaming: fragments (default: 4)"
    )
    parser.add_argument(
        "--sync-delay",
        type=bounded("sync_delay"),
        default=0,
        help="streaming: steps from reduction to merge (τ)",
    )
    parser.add_argument(
        "--alpha", type=bounded("alpha"), default=0.0, help="streaming: local weight at the merge"
    )
    parser.add_argument("--seed", type=bounded("seed"), default=0)
    parser.add_argument(
        "--threads", type=bounded("threads"), default=1, help="torch threads per process (default: 1)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
