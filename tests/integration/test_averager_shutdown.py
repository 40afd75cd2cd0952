"""An averager's shutdown leaves nothing behind: hivemind never closed the averager process's
replica of the DHT's p2p client, and its unix socket file (``hivemind-p2pclient-*.sock``) stayed
in the temp folder, one per averager any peer, test or benchmark ever started."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def _listening_unix_sockets(pid: int) -> set[str]:
    """The paths of the unix sockets process ``pid`` holds open (by inode, from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    paths = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes:
            paths.add(fields[7])
    return paths


def test_an_averager_s_shutdown_removes_its_p2p_client_socket_file():
    from hivemind import DHT

    from swarm.group_averager import GroupAverager

    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        averager = GroupAverager(
            [torch.zeros(10)], dht, prefix="cleanup", state_provider=None, target_group_size=2,
            allow_state_sharing=False, start=True,
        )  # fmt: skip
        sockets = {p for p in _listening_unix_sockets(averager.pid) if "hivemind-p2pclient" in p}
        assert sockets, "the averager process holds no p2p client socket: this test no longer finds it"
        assert all(Path(p).exists() for p in sockets)
        averager.shutdown()
        assert not averager.is_alive()
        assert [p for p in sockets if Path(p).exists()] == []
    finally:
        dht.shutdown()


_SLOW_DHT = r"""
import os, signal, sys, time
import torch
from hivemind import DHT
from swarm.group_averager import GroupAverager

dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
averager = GroupAverager(
    [torch.zeros(10)], dht, prefix="declare", state_provider=lambda: None, target_group_size=2,
    declare_state_period=0.3, start=True,
)
time.sleep(1.0)  # a few declarations answered
os.kill(dht.pid, signal.SIGSTOP)  # the DHT stops answering: the next declarations expire unanswered
time.sleep(2.0)
os.kill(dht.pid, signal.SIGCONT)
time.sleep(1.0)
averager.shutdown()
dht.shutdown()
print("done", flush=True)
"""


def test_a_state_declaration_the_dht_does_not_answer_in_time_prints_no_traceback(tmp_path):
    """hivemind declares the state for download in fire-and-forget tasks, each bounded by its
    declaration's lifetime; one the DHT did not answer in time (a busy machine, a stalled DHT
    process) ended with a TimeoutError nobody retrieved, and asyncio printed "Task exception was
    never retrieved" with a traceback into the peer's log, once per period."""
    import subprocess
    import sys

    script = tmp_path / "slow_dht.py"
    script.write_text(_SLOW_DHT)
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )  # fmt: skip
    assert run.returncode == 0 and "done" in run.stdout, run.stderr[-3000:]
    assert "never retrieved" not in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]


_STARTS_A_DHT_IN_A_THREAD = """
import sys, threading, time
from swarm.dht import NetworkConfig, start_dht

def start():
    dht = start_dht(NetworkConfig())  # a notebook's run starts its view's DHT in the run's thread
    print("ready", flush=True)
    time.sleep(600)

threading.Thread(target=start, daemon=True).start()
time.sleep(600)
"""


def test_a_dht_started_in_a_thread_ends_with_its_process_killed():
    """The notebook's run thread starts its view's DHT: a kernel killed with SIGKILL (the OOM
    killer, `kill -9`) left that DHT process and its p2p daemon running for good, holding their
    port (a review, stop 60). The orphan watch armed only forks of the main thread."""
    import contextlib
    import signal
    import subprocess
    import sys

    import psutil

    process = subprocess.Popen(
        [sys.executable, "-c", _STARTS_A_DHT_IN_A_THREAD], stdout=subprocess.PIPE, text=True
    )
    children = []
    try:
        assert process.stdout.readline().strip() == "ready"
        children = psutil.Process(process.pid).children(recursive=True)
        assert any("p2pd" in " ".join(p.cmdline()[:1]) for p in children), [p.cmdline()[:2] for p in children]
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        _, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, [p.cmdline()[:3] for p in alive]
    finally:
        process.kill()
        for child in children:  # orphans, if the watch failed
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
