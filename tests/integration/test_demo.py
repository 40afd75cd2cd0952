"""The scripting contract of `workbench demo --json`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.conftest import FAST

pytestmark = pytest.mark.integration


def demo(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    """`workbench demo` with 2 peers and the integration tests' fast settings; later flags win."""
    return subprocess.run(
        [sys.executable, "-m", "workbench", "demo", "--peers", "2", "--headless", "--json", *FAST,
         "--run-dir", str(tmp_path), *flags],
        capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_demo_json_contract(tmp_path):
    result = demo(tmp_path, "--rounds", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout  # stdout holds the JSON object and nothing else
    data = json.loads(lines[0])
    for key in (
        "peers",
        "outer_rounds",
        "initial_loss",
        "final_loss",
        "params_max_abs_diff",
        "bytes_sent",
        "seconds",
    ):
        assert key in data, key
    assert data["peers"] == 2 and data["outer_rounds"] == 2
    assert data["final_loss"] < data["initial_loss"]
    assert data["params_max_abs_diff"] <= 1e-5
    assert data["bytes_sent"] > 0 and data["seconds"] > 0
    assert (tmp_path / "commands.txt").read_text().count("workbench ") == 2


@pytest.mark.parametrize(
    ("method_flags", "peer_flags"),
    [
        (["--method", "sparseloco", "--topk-density", "0.05"], ["--update-codec topk", "--error-feedback"]),
        (["--update-codec", "int8", "--delay", "1"], ["--update-codec int8", "--delay 1"]),
        # H is 1 for dp: FAST's --inner-steps 5 would be refused (a flag the method cannot use)
        (["--method", "dp", "--inner-steps", "1"], ["--method dp"]),
        (
            # τ = 1: each fragment's all-reduce runs behind the next inner step (real peers)
            ["--method", "streaming", "--inner-steps", "8", "--fragments", "4", "--sync-delay", "1"],
            ["--method streaming --fragments 4 --sync-delay 1"],
        ),
    ],
    ids=["sparseloco", "int8-delayed", "data-parallel", "streaming"],
)
def test_demo_runs_other_methods_over_the_real_swarm(tmp_path, method_flags, peer_flags):
    result = demo(tmp_path, "--rounds", "3", *method_flags)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["outer_rounds"] == 3 and data["rounds_alone"] == 0
    assert data["params_max_abs_diff"] <= 1e-5
    assert data["final_loss"] < data["initial_loss"]
    commands = (tmp_path / "commands.txt").read_text()
    assert all(flag in commands for flag in peer_flags), commands


def _processes_of(run_dir) -> list:
    """Every live process whose command line names ``run_dir`` (the demo's peers carry it in
    --run-dir, their hivemind children inherit nothing of it, so their parents are checked)."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if any(str(run_dir) in part for part in process.info["cmdline"] or []):
                found.append(process)
                found += process.children(recursive=True)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return [p for p in found if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("how", ["SIGHUP", "SIGKILL"])
def test_closing_the_terminal_stops_the_demo_and_every_peer(tmp_path, how):
    """SIGHUP to the demo (what a closed terminal or SSH session sends it) mid-run: the demo
    stops every peer it started, which announce leaving, and nothing of the run is left
    within 10 s (the peers run in their own sessions: the terminal's SIGHUP reaches only the
    demo). SIGKILL (the OOM killer, a notebook kernel restarted under an ``Experiment``): the
    demo stops nobody, and the peers, which trained on alone for good, see it gone and stop
    themselves the same way (workbench.run.stopping.stop_with_launcher)."""
    import signal
    import time

    import psutil

    demo = subprocess.Popen(
        [sys.executable, "-m", "workbench", "demo", "--peers", "2", "--headless", *FAST,
         "--rounds", "500", "--run-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        metrics = [tmp_path / f"peer-{i}" / "metrics.jsonl" for i in range(2)]
        while not all(m.exists() and '"event": "round"' in m.read_text() for m in metrics):
            assert demo.poll() is None and time.monotonic() < deadline, demo.communicate()[1][-3000:]
            time.sleep(0.5)
        peers = _processes_of(tmp_path)
        assert len(peers) >= 2  # the peers and their hivemind processes
        demo.send_signal(getattr(signal, how))
        started = time.monotonic()
        demo.wait(timeout=30)
        if how == "SIGHUP":  # stopped, no result: as simulate (0 read as success to a script)
            assert demo.returncode == 130 and "stopped." in demo.stderr.read()
        gone, alive = psutil.wait_procs(peers, timeout=max(0.1, 10 - (time.monotonic() - started)))
        assert not alive and not _processes_of(tmp_path), [p.cmdline()[:4] for p in alive]
        assert time.monotonic() - started < 10.0
        for m in metrics:
            left = [json.loads(line) for line in m.read_text().splitlines() if '"event": "left"' in line]
            assert left and left[-1]["reason"] == "interrupted", m.read_text()[-2000:]
    finally:
        if demo.poll() is None:
            demo.kill()
        for process in _processes_of(tmp_path):
            process.kill()


def test_a_killed_demo_peer_restarted_from_the_monitor_downloads_the_state_and_rejoins(tmp_path):
    """The monitor's fault menu on a demo peer: Kill, then Restart on the stopped peer. It comes
    back with the same identity (peer id) and run dir, downloads the swarm's state and averages
    with the other peer again."""
    import time
    import uuid
    from dataclasses import replace

    from swarm.faults import Fault, FaultRequest
    from workbench.cli.command import build_config, build_parser
    from workbench.local.launch import LocalSwarm
    from workbench.sources import LocalFaults

    args = build_parser().parse_args(["demo", *FAST, "--rounds", "1000", "--run-dir", str(tmp_path)])
    config = build_config(args)
    config = replace(config, peer=replace(config.peer, run_id=f"restart-{uuid.uuid4().hex[:6]}", min_peers=2))
    killed: list[str] = []

    def wait_for(what, predicate, seconds=90.0):
        deadline = time.monotonic() + seconds
        while not predicate():
            swarm.poll()
            assert time.monotonic() < deadline, (
                f"no {what} within {seconds:.0f} s:\n{swarm.peers[1].log_tail(20)}"
            )
            time.sleep(0.3)

    with LocalSwarm(config, peers=2, run_dir=tmp_path) as swarm:
        swarm.start()
        faults = LocalFaults(swarm, on_kill=killed.append)
        wait_for(
            "first rounds",
            lambda: all(sum(e["event"] == "round" for e in p.events) >= 2 for p in swarm.peers),
        )
        peer_id = swarm.peers[1].last("started")["peer_id"]
        assert not faults.stopped(peer_id)
        faults.inject(peer_id, FaultRequest(Fault.KILL))
        wait_for("exit", lambda: swarm.peers[1].process.poll() is not None, 10)
        assert killed == [peer_id] and faults.stopped(peer_id)
        swarm.poll()  # what it wrote between the last read and its death
        before = len(swarm.peers[1].events)
        message = faults.inject(peer_id, FaultRequest(Fault.RESTART))
        assert "restarted peer-1" in message and swarm.peers[1].process.poll() is None
        assert len(swarm.peers[1].events) == before  # its earlier events are kept

        def rejoined() -> bool:
            new = swarm.peers[1].events[before:]
            downloaded = [i for i, e in enumerate(new) if e["event"] == "state_downloaded"]
            return bool(downloaded) and any(
                e["event"] == "round" and e["group_size"] == 2 for e in new[downloaded[0] :]
            )

        wait_for("download and a pair round after the restart", rejoined)
        starts = [e for e in swarm.peers[1].events if e["event"] == "started"]
        assert len(starts) == 2 and starts[1]["peer_id"] == peer_id  # the same identity
