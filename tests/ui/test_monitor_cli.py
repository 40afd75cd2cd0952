"""`workbench replay` / `workbench monitor` from the command line: errors, and --web serving."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

RECORDING = Path(__file__).parents[2] / "notebooks" / "data" / "sample_run.jsonl"


def workbench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "workbench", *args],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def test_replay_of_a_missing_or_bad_file_is_one_line(tmp_path) -> None:
    result = workbench("replay", str(tmp_path / "missing.jsonl"))
    assert result.returncode == 2 and result.stderr.startswith("error: cannot read the recording")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hello": 1}\n')
    result = workbench("replay", str(bad))
    assert result.returncode == 2 and "not a workbench monitor recording" in result.stderr


def test_odd_recorded_lines_are_one_line_and_a_nan_loss_is_left_out_as_live(tmp_path) -> None:
    """Stop 57, a review: `[]`, `null` or a list of ignored peers in a recording raised an
    AttributeError traceback; a recorded NaN loss went into `status --json` as NaN (not JSON)
    and crashed the TUI's charts. A live read leaves such a heartbeat out: so does a replay."""
    import json

    from swarm.monitor import RECORD_FORMAT
    from tests.ui.fake import heartbeat

    header = json.dumps({"format": RECORD_FORMAT}) + "\n"
    good = heartbeat(0, 1000.0, 3).model_dump(mode="json")
    nan = {**heartbeat(1, 1000.0, 3).model_dump(mode="json"), "loss": float("nan")}
    reading = {"time": 1000.0, "run_id": "r", "peers": [good, nan], "ignored": {}}
    for line, message in (
        ("[]", "not list"),
        ("null", "not NoneType"),
        (json.dumps({**reading, "ignored": ["QmX"]}), "ignored"),
    ):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(header + line + "\n")
        result = workbench("status", "--replay", str(bad), "--json")
        assert result.returncode == 2 and "Traceback" not in result.stderr and message in result.stderr, (
            result.stderr
        )
    recording = tmp_path / "nan.jsonl"
    recording.write_text(header + json.dumps(reading) + "\n")
    result = workbench("status", "--replay", str(recording), "--json")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout.strip().splitlines()[-1], parse_constant=lambda c: 1 / 0)  # no NaN
    assert [p["peer_id"] for p in shown["peers"]] == [good["peer_id"]]


def test_monitor_needs_a_valid_address() -> None:
    result = workbench("monitor", "/ip4/127.0.0.1/tcp/1", "--connect-timeout", "2")
    assert result.returncode == 2 and "lacks the peer id" in result.stderr


def test_without_a_terminal_the_monitor_says_what_to_use_instead() -> None:
    """In a script or a pipe the full-screen app would print escape codes and wait for keys:
    one line instead, before connecting to anything."""
    result = workbench("replay", str(RECORDING))
    assert result.returncode == 2 and "is a full-screen terminal app" in result.stderr, result.stderr
    assert "--web serves the app to a browser" in result.stderr and "\x1b[" not in result.stdout
    assert "`workbench status --replay FILE`" in result.stderr, result.stderr
    address = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    started = time.monotonic()
    result = workbench("monitor", address, "--connect-timeout", "30")
    assert result.returncode == 2 and "`workbench status MULTIADDR --watch 2`" in result.stderr, result.stderr
    assert time.monotonic() - started < 20  # said at once, not after the connect timeout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_web_serves_the_app_on_localhost() -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "workbench", "replay", str(RECORDING), "--web", "--web-port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).read().decode()
                break
            except OSError:
                assert process.poll() is None, process.stderr.read().decode()
                assert time.monotonic() < deadline, "the web monitor did not come up"
                time.sleep(0.3)
        assert "textual" in page.lower() and f"127.0.0.1:{port}" in page
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
