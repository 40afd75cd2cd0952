"""`workbench completion bash|zsh|tcsh`: a shell completion script for every command and flag.

Generated from the same argparse parser the command line uses (with shtab), so it never goes
stale. Install, e.g. for bash::

    workbench completion bash > ~/.local/share/bash-completion/completions/workbench
"""

from __future__ import annotations

import argparse

SHELLS = ("bash", "zsh", "tcsh")


def add_completion_parser(commands) -> None:
    parser = commands.add_parser(
        "completion",
        help="print a shell completion script (bash, zsh or tcsh)",
        description="Print a completion script for every workbench command and flag.",
        epilog="examples:\n"
        "  workbench completion bash > ~/.local/share/bash-completion/completions/workbench\n"
        '  workbench completion zsh > "${fpath[1]}/_workbench"',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("shell", choices=SHELLS)


def run_completion_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import shtab

    print(shtab.complete(parser, shell=args.shell))
    return 0
