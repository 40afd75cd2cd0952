"""`workbench join` with a bad or unreachable address: one line, non-zero, bounded time."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from tests.integration.conftest import FAST, workbench_all

PEER_ID = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def join(*args: str, timeout: float = 60.0) -> tuple[int, str, float]:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "workbench", "join", *args, "--model", "tiny", "--connect-timeout", "5"],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return result.returncode, result.stderr, time.monotonic() - started


@pytest.mark.parametrize(
    ("address", "hint"),
    [
        ("not-an-address", "not a multiaddr"),
        ("127.0.0.1:31337", "/ip4/127.0.0.1/tcp/31337"),
        ("/ip4/999.1.1.1/tcp/31337/p2p/" + PEER_ID, "malformed multiaddr"),
        ("/ip4/127.0.0.1/tcp/31337", "/p2p/<peer id>"),
        ("/ip4/127.0.0.1/tcp/31337/p2p/notapeerid", "malformed multiaddr"),
        ("/ip4/127.0.0.1/tcp/0/p2p/" + PEER_ID, "port 0"),
    ],
)
def test_malformed_address_is_one_line_error(address, hint):
    code, stderr, seconds = join(address)
    assert code == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert hint in lines[0]
    assert seconds < 15


@pytest.mark.integration
def test_unreachable_peer_is_one_line_error():
    """A well-formed address where nobody listens: error names the address, exits in bounded time."""
    address = f"/ip4/127.0.0.1/tcp/9/p2p/{PEER_ID}"  # port 9 (discard): nothing listens here
    code, stderr, seconds = join(address)
    assert code == 2, stderr
    errors = [line for line in stderr.strip().splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr
    assert "could not reach any bootstrap peer" in errors[0] and address in errors[0]
    assert "Traceback" not in stderr
    assert seconds < 30


@pytest.mark.integration
def test_wrong_run_id_is_one_line_error(spawn):
    """Reachable peer, but another run: say so instead of training alone."""
    peer = spawn(
        "a", "start", "--model", "tiny", "--threads", "1", "--run-id", "right-run", "--min-peers", "2"
    )
    code, stderr, seconds = join(peer.address(), "--run-id", "wrong-run")
    assert code == 2, stderr
    errors = [line for line in stderr.strip().splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "no live peer of run 'wrong-run'" in errors[0], stderr
    assert seconds < 40


@pytest.mark.integration
def test_joiner_with_another_model_is_refused(spawn):
    """A peer whose model differs from the run's stops with one line naming the mismatch."""
    peer = spawn(
        "a", "start", "--model", "tiny", "--threads", "1", "--run-id", "model-check", "--min-peers", "2"
    )
    join = ["join", peer.address(), "--run-id", "model-check", "--threads", "1"]
    owner = peer.events("started")[0]["owner"]  # (address() waited for the "started" event)
    # Side by side (each takes seconds to start, the second waits out the manifest search):
    # another model, and the right model with an --owner that is not the run's.
    # And `steer` and `status` with that --owner (by the owner itself): they said the run had no
    # manifest, "is its first peer still running?", and status said nothing.
    address, wrong = peer.address(), ["--run-id", "model-check", "--owner", "0" * 16]
    key = str(peer.directory / "identity.key")
    result, wrong_owner, steer, status = workbench_all(
        [*join, "--model", "small"],
        [*join, "--model", "tiny", "--owner", "0" * 16],
        ["steer", address, *wrong, "--key", key, "--outer-lr", "0.5"],
        ["status", address, *wrong, "--json"],
    )
    for told in (steer, status):
        assert f"no manifest by owner {'0' * 16}, only one by {owner}" in told.stderr, told.stderr
    assert steer.returncode == 2 and status.returncode == 0, (steer.stderr, status.stderr)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.strip().splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "does not match run 'model-check'" in errors[0], result.stderr
    # Both fingerprints are named: the run's (from its manifest) and the joiner's.
    run_fingerprint = peer.events("started")[0]["fingerprint"]
    assert run_fingerprint in errors[0] and "--model" in errors[0]
    assert len(set(re.findall(r"\b[0-9a-f]{16}\b", errors[0]))) == 2, errors[0]
    assert "Traceback" not in result.stderr

    # The right model, but an --owner that is not the run's: refused, not joined unchecked.
    result = wrong_owner
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.strip().splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"no manifest by owner {'0' * 16}, only one by {owner}" in errors[0], (
        result.stderr
    )


@pytest.mark.integration
def test_status_lists_the_live_peers(spawn):
    """`workbench status ADDR --json` reads the run's heartbeats as a client."""
    peer = spawn(
        "a", "start", "--model", "tiny", "--threads", "1", "--run-id", "status-run", "--min-peers", "3"
    )
    address = peer.address()
    # Another run id (side by side): no peers, exit status 1 and a hint.
    result, other = workbench_all(
        ["status", address, "--run-id", "status-run", "--json"], ["status", address, "--run-id", "nobody"]
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["run_id"] == "status-run"
    [row] = data["peers"]
    assert row["name"] == "a" and row["stage"] == "joining" and row["outer_step"] == 0
    assert row["peer_id"] in address and row["seconds_since_heartbeat"] < 10
    assert other.returncode == 1 and "no live peer of run 'nobody'" in other.stderr


@pytest.mark.integration
def test_a_joiner_started_before_its_bootstrap_peer_waits_for_it(spawn, tmp_path):
    """A script that starts `join` a moment before `start`: hivemind's daemon gives up on an
    absent bootstrap peer after 3-8 s, whatever --connect-timeout says; the joiner tries again
    until that timeout is spent, and averages with the peer once it is up."""
    import socket

    from swarm.identity import create_identity, load_private_key, peer_id_of, public_key_text

    key = create_identity(tmp_path / "a.key")
    peer_id = peer_id_of(public_key_text(load_private_key(key)))
    with socket.socket() as probe:  # a port that is free now, for the peer started later
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    common = [*FAST, "--run-id", "early", "--rounds", "3", "--min-peers", "2"]
    joiner = spawn(
        "b", "join", f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id}", *common, "--connect-timeout", "90"
    )
    deadline = time.monotonic() + 60
    while "no bootstrap peer answered yet" not in joiner.stderr():  # its first try failed
        assert joiner.process.poll() is None, joiner.stderr()
        assert time.monotonic() < deadline, joiner.stderr()
        time.sleep(0.2)
    first = spawn("a", "start", *common, "--identity", str(key), "--port", str(port))
    for peer in (first, joiner):
        assert peer.wait() == 0, peer.stderr()[-3000:]
    assert any(r["group_size"] == 2 for r in joiner.events("round")), joiner.events("round")


_SKEWED_CLOCK = """
import os, time
_real = time.time
time.time = lambda: _real() + float(os.environ["SKEW_SECONDS"])
"""

_A_DHT_NODE = """
import time
from hivemind import DHT
dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
print(str(dht.get_visible_maddrs()[0]), flush=True)
time.sleep(120)
"""


@pytest.mark.integration
def test_a_joiner_whose_clock_is_off_is_told_to_set_it(tmp_path):
    """hivemind refuses a node whose clock is more than 3 s off the peer it dials (records
    expire by the clocks): the joiner said "could not start the DHT node: local time must be
    within 3 seconds of others(local: 1796556116.63580, peer: ...)", with no fix."""
    import os
    import signal

    (tmp_path / "sitecustomize.py").write_text(_SKEWED_CLOCK)
    node = subprocess.Popen(  # its own process group: its DHT process and p2p daemon go with it
        [sys.executable, "-c", _A_DHT_NODE], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        address = node.stdout.readline().strip()
        env = dict(os.environ, PYTHONPATH=str(tmp_path), SKEW_SECONDS="-30")
        result = subprocess.run(
            [sys.executable, "-m", "workbench", "join", address, *FAST, "--run-dir", str(tmp_path / "b")],
            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip
    finally:
        os.killpg(node.pid, signal.SIGKILL)  # (node.kill() left the forked DHT and its daemon running)
        node.wait()
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    assert "this machine's clock is 30 s behind the peer it dialed" in errors[0], errors
    assert "timedatectl set-ntp true" in errors[0] and "Traceback" not in result.stderr
