"""Command-line manners: examples in every --help, shell completion, NO_COLOR on a terminal."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.cli.command import build_parser, main

RECORDING = Path(__file__).parents[2] / "notebooks" / "data" / "sample_run.jsonl"
COLOR = re.compile(rb"\x1b\[[0-9;]*?(?:3[0-7]|38;[0-9;]+|9[0-7])m")


def _subcommands() -> dict[str, object]:
    action = next(a for a in build_parser()._actions if a.dest == "command")
    return dict(action.choices)


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_every_command_has_help_with_an_example(command: str) -> None:
    text = _subcommands()[command].format_help()
    assert "example" in text.lower(), f"`workbench {command} --help` shows no example"


@pytest.mark.parametrize("shell", ["bash", "zsh", "tcsh"])
def test_completion_covers_every_command_and_new_flags(shell: str, capsys) -> None:
    assert main(["completion", shell]) == 0
    script = capsys.readouterr().out
    flags = (
        ["--overlap", "--dataset", "--tensorboard", "--model"] if shell != "tcsh" else []
    )  # tcsh: commands only
    for word in [*_subcommands(), *flags]:
        assert word in script, f"{word} missing from the {shell} completion"


def _on_a_terminal(*args: str, env: dict[str, str]) -> bytes:
    """stdout+stderr of `workbench args` run on a pseudo-terminal (where rich uses colour)."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "workbench", *args],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env=env,
        close_fds=True,
    )
    os.close(follower)
    output = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 30)
        if not ready:
            break
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
    process.wait(timeout=30)
    os.close(leader)
    return output


def test_no_color_turns_colour_off_on_a_terminal() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    env.update(TERM="xterm-256color", COLUMNS="160")
    coloured = _on_a_terminal("status", "--replay", str(RECORDING), env=env)
    assert b"peer" in coloured and COLOR.search(coloured), coloured[:500]  # colour by default
    plain = _on_a_terminal("status", "--replay", str(RECORDING), env={**env, "NO_COLOR": "1"})
    assert b"peer" in plain and not COLOR.search(plain), COLOR.findall(plain)[:5]


def test_long_work_shows_a_progress_bar_on_a_terminal_only(tmp_path: Path) -> None:
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(30):
        (folder / f"{i}.txt").write_text("the swarm averages its pseudo-gradients\n" * 200)
    args = ["simulate", "--peers", "1", "--steps", "2", "--model", "tiny", "--data", str(folder)]
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    on_terminal = _on_a_terminal(*args, env={**env, "TERM": "xterm-256color"})
    # The bar cuts a long description to the terminal's width (pytest's tmp path grows with each
    # session on a machine): the start of the folder's path is all that is sure to be shown.
    shown = b"reading " + str(folder).encode()[:20]
    assert shown in on_terminal, on_terminal[-800:]
    piped = subprocess.run(
        [sys.executable, "-m", "workbench", *args], capture_output=True, env=env, timeout=120
    )
    assert piped.returncode == 0, piped.stderr[-800:]
    assert shown not in piped.stderr + piped.stdout  # logs stay plain


INTERRUPTED_WHILE_LOADING = """
import builtins, sys
real = builtins.__import__
def interrupted(name, *args, **kwargs):
    if name == "workbench.cli.command":
        raise KeyboardInterrupt  # Ctrl+C while the command's modules load (about 0.5 s)
    return real(name, *args, **kwargs)
builtins.__import__ = interrupted
from workbench.cli import main
sys.exit(main(["start", "--model", "tiny"]))
"""


def test_ctrl_c_while_the_command_loads_stops_it_with_one_line() -> None:
    """Before, an import's traceback (40 lines from pydantic or platform.py) and exit 1."""
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_WHILE_LOADING], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stderr) == (130, "stopped.\n"), done.stderr[-2000:]


def test_torch_s_developer_lines_stay_out_of_the_peer_s_log(monkeypatch) -> None:
    """torch logs "FakeTensor cache stats: ..." at INFO when the process exits; its import sets
    its loggers to WARNING, but a Ctrl+C during that import (a peer stopped as it starts) left
    them at the root's INFO, and the lines came out after "stopped."."""
    import logging

    from workbench.cli.command import _configure_logging

    monkeypatch.setenv("HIVEMIND_LOGLEVEL", os.environ.get("HIVEMIND_LOGLEVEL", "INFO"))  # restored after
    levels = {name: logging.getLogger(name).level for name in ("torch", "hivemind", "multiaddr")}
    try:
        logging.getLogger("torch").setLevel(logging.NOTSET)  # as a torch import cut short leaves it
        _configure_logging(0)
        assert not logging.getLogger("torch._subclasses.fake_tensor").isEnabledFor(logging.INFO)
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def test_log_lines_go_to_stderr_as_it_is_when_they_come(monkeypatch) -> None:
    """A progress bar (rich's live display) redirects sys.stderr to print each line above the
    bar: the log handler held the stream it started with, wrote past the bar, and a joiner's
    terminal kept "downloading the global state ━━━ 0% -:--:… 0:00:0012:20:51 I downloaded ..."
    (a review, stop 60)."""
    import io
    import logging
    import sys

    from workbench.cli.command import _CurrentStderr

    handler = _CurrentStderr()
    handler.setFormatter(logging.Formatter("%(message)s"))
    redirected = io.StringIO()
    monkeypatch.setattr(sys, "stderr", redirected)
    handler.emit(logging.LogRecord("x", logging.INFO, __file__, 1, "downloaded the state", None, None))
    assert redirected.getvalue() == "downloaded the state\n"
