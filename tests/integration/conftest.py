"""Real peers, each a `python -m workbench ...` process on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.integration

# A tiny model and short rounds: a round takes a second or two on one core.
FAST = [
    "--model",
    "tiny",
    "--inner-steps",
    "5",
    "--batch-size",
    "8",
    "--threads",
    "1",
    "--matchmaking-time",
    "1.0",
]
NETNS = pytest.mark.xdist_group("netns")
"""For tests in network namespaces: `make test` runs them on one worker, one at a time (two labs
at once could pick the same 10.x subnet)."""
JOIN_ROUNDS = 60
"""Rounds of a run that a peer joins mid-way: FAST rounds take about 0.2-0.4 s (a group forms as
soon as its members joined), and a joiner needs 5-10 s to start (corpus, key, daemon; more on a
loaded machine): 20 rounds were over before it could reach the first peer."""
PACED_ROUNDS = 16
"""Rounds of a run whose first peers are paced until the joiner is in (:func:`paced`): with 24
the joiner's rounds of three were 19-22 of them, each at full speed for three processes (what
the suite's other worker then went without), to show what ten show."""
PACE_MS = 700
"""The pace: 5 inner steps of 700 ms, so 16 rounds of a pair last at least 56 s, against a
joiner's 5-20 s to start (at 500 ms a step it downloaded at round 4-6 beside a busy suite, 8-15
at a load average of 15); once it is in, the run goes on at full speed (about 1 s a round)."""


def paced(tmp_path: Path) -> tuple[list[str], Callable[[], None]]:
    """Flags that slow a run's first peers to :data:`PACE_MS` an inner step (the lab's
    throttle, through their fault file), and the call that lifts it for both at once. A join
    test then needs no spare rounds for the joiner to arrive in (:data:`JOIN_ROUNDS`), only
    the pace's margin, and its rounds of three run at full speed."""
    from swarm.faults import FaultPlan

    pace = _throttle_file(tmp_path / "pace.json", PACE_MS)
    return ["--fault-file", str(pace)], lambda: FaultPlan.update(pace, throttle_ms=0)


def _throttle_file(path: Path, milliseconds: float) -> Path:
    """``path``, a fault file that throttles every inner step to ``milliseconds`` (written
    once: peers that share it keep reading the same file)."""
    from swarm.faults import FaultPlan

    if not path.exists():
        FaultPlan(throttle_ms=milliseconds).write(path)
    return path


def paced_join(spawn, tmp_path: Path, common: list[str], *, after: int) -> tuple[PeerProcess, ...]:
    """Peers "a" and "b" start a run with ``common`` flags, paced (:func:`paced`); "c" joins
    once "a" reported round ``after``, and the pace is lifted when "c" has downloaded the state.
    The three peers, still running."""
    pace, full_speed = paced(tmp_path)
    first = spawn("a", "start", *common, *pace, "--min-peers", "2")
    second = spawn("b", "join", first.address(), *common, *pace, "--min-peers", "2")
    first.wait_event("round", lambda e: e["outer_step"] >= after)
    third = spawn("c", "join", first.address(), *common)
    third.wait_event("state_downloaded")
    full_speed()
    return first, second, third


STEADY_MS = 100
"""The pace of :func:`steady` peers: 5 inner steps of 100 ms, a round of about 0.7 s."""


def steady(tmp_path: Path) -> list[str]:
    """Flags that pace a peer's inner steps to :data:`STEADY_MS` (the lab's throttle, through a
    fault file), for peers that only have to keep averaging while the test does something else
    (a CLI, a helper process, a heartbeat's TTL). At full speed their rounds (0.1-0.4 s) took
    the CPU that the suite's other tests run on (`make test`'s three workers share two cores):
    the steering test's pair averaged 170 rounds, a lone peer 147, to prove what ten prove."""
    return ["--fault-file", str(_throttle_file(tmp_path / "steady.json", STEADY_MS))]


def verbose_flag() -> list[str]:
    """``-v`` / ``-vv`` for the peers of the tests named in ``WB_TEST_VERBOSE``
    (``<part of the test's name>[:<level>]``, docs/development.md), else nothing."""
    pattern, _, level = os.environ.get("WB_TEST_VERBOSE", "").partition(":")
    if not pattern or pattern not in os.environ.get("PYTEST_CURRENT_TEST", ""):
        return []
    return ["-" + "v" * max(1, int(level or 1))]


class PeerProcess:
    def __init__(
        self, name: str, args: list[str], run_dir: Path, wrap: Callable[[list[str]], list[str]] = list
    ) -> None:
        self.name = name
        self.directory = run_dir / name
        self.directory.mkdir(parents=True, exist_ok=True)
        self.stdout_path = self.directory / "stdout.txt"
        self.stderr_path = self.directory / "stderr.txt"
        self.argv = [sys.executable, "-m", "workbench", *args]
        if args and args[0] in ("start", "join"):
            self.argv[3:3] = verbose_flag()
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.process = subprocess.Popen(
                wrap(self.argv),  # e.g. run inside a network namespace
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    @property
    def metrics(self) -> Path:
        return self.directory / "metrics.jsonl"

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.metrics.exists():
            return []
        # Only lines the peer finished writing: one still being written has no newline yet (and
        # may end in a nested object's "}", so "ends in }" would not tell it apart).
        lines = self.metrics.read_text().split("\n")[:-1]
        events = [json.loads(line) for line in lines if line]
        return [e for e in events if kind is None or e["event"] == kind]

    def wait_event(
        self, kind: str, predicate: Callable[[dict[str, Any]], bool] = lambda e: True, timeout: float = 90.0
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.events(kind):
                if predicate(event):
                    return event
            if self.process.poll() not in (None, 0):
                pytest.fail(f"{self.name} exited with {self.process.returncode}:\n{self.stderr()[-3000:]}")
            time.sleep(0.2)
        pytest.fail(f"{self.name}: no '{kind}' event within {timeout} s:\n{self.stderr()[-3000:]}")

    def wait(self, timeout: float = 120.0, *, progressing: bool = False, limit: float = 600.0) -> int:
        """Its exit code, once it exits within ``timeout`` s. ``progressing``: a peer running to
        the end of its rounds, which take what this machine takes: ``timeout`` s counts from the
        last event it wrote (a round, the end), up to ``limit`` s in all (a 60-round run of five
        peers in network namespaces ran past a fixed 120 s, healthy, 4 s short of its end)."""
        started = last = time.monotonic()
        size = -1
        while True:
            try:
                return self.process.wait(timeout=1.0 if progressing else timeout)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if progressing:
                written = self.metrics.stat().st_size if self.metrics.exists() else 0
                if written != size:
                    size, last = written, now
                if now - last <= timeout and now - started <= limit:
                    continue
            # Where it hangs: every thread's stack (workbench registers SIGUSR1 with faulthandler).
            self.process.send_signal(signal.SIGUSR1)
            time.sleep(2.0)
            since = "its last event" if progressing else "the wait began"
            pytest.fail(
                f"{self.name} still running {now - last:.0f} s after {since}:\n{self.stderr()[-8000:]}"
            )

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def address(self) -> str:
        return self.wait_event("started", timeout=60)["addresses"][0]

    def global_params(self) -> list[torch.Tensor]:
        return torch.load(self.directory / "global_params.pt")

    def kill(self) -> None:
        kill_group(self.process)


README_PORT = 31337


def readme_flags(lab: Any, i: int, port: int = README_PORT) -> list[str]:
    """The README's flags for a peer on another machine, for the lab's machine ``i``
    (``workbench.local.netlab.NetLab``): listen on every interface, announce its address."""
    return ["--host", "0.0.0.0", "--port", str(port), "--announce", f"/ip4/{lab.address(i)}/tcp/{port}"]


def lab_peer(lab: Any, i: int, name: str, args: list[str], tmp_path: Path) -> PeerProcess:
    """``workbench *args`` on the lab's machine ``i``, as peer ``name`` (its --run-dir under
    ``tmp_path``)."""
    where = ["--name", name, "--run-dir", str(tmp_path / name)]
    return PeerProcess(name, [*args, *where], tmp_path, wrap=lambda argv: lab.command(i, argv))


def interrupt_all(peers: list[PeerProcess] | tuple[PeerProcess, ...], timeout: float = 60) -> None:
    """Ctrl+C to every peer at once, as a user stops a run; each must then exit 0."""
    for peer in peers:
        peer.process.send_signal(signal.SIGINT)
    for peer in peers:
        assert peer.wait(timeout=timeout) == 0, peer.stderr()[-3000:]


def helper(script: str, *args: str, wrap: Callable[[list[str]], list[str]] = list) -> subprocess.Popen:
    """``python -c script args...`` in its own process group, stdout piped (an attacker, a
    squatter): stop it with :func:`kill_group`, which takes its hivemind children along.
    ``wrap``: where it runs (``lambda argv: lab.command(i, argv)``: on a lab's machine ``i``)."""
    return subprocess.Popen(
        wrap([sys.executable, "-c", script, *args]), stdout=subprocess.PIPE, text=True, start_new_session=True
    )


def workbench(
    *args: str, timeout: float = 90, wrap: Callable[[list[str]], list[str]] = list
) -> subprocess.CompletedProcess:
    """``python -m workbench args...`` to its end: a CLI command (status, steer, a refused join).
    One still running after ``timeout`` s fails the test with every thread's stack (workbench
    dumps them on SIGUSR1) and what it printed: where it hung, not only that it did. ``wrap``:
    where it runs, as :func:`helper`'s."""
    argv = wrap([sys.executable, "-m", "workbench", *args])
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGUSR1)
        time.sleep(2.0)
        process.kill()
        out, err = process.communicate()
        pytest.fail(
            f"`workbench {' '.join(args)}` still running after {timeout} s:\n{out[-2000:]}\n{err[-8000:]}"
        )
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


def workbench_all(*commands: list[str], timeout: float = 90) -> list[subprocess.CompletedProcess]:
    """Several CLI commands at once, their results in order: each spends seconds starting and
    joining the DHT, mostly waiting, so independent checks need not queue."""
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: workbench(*args, timeout=timeout), commands))


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL a process started in its own session and everything it started. hivemind's DHT
    runs in a forked child with its own p2p daemon: killing the parent alone left both running
    (and training the suite's CPU) long after the test."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@pytest.fixture
def spawn(tmp_path: Path):
    """spawn(name, *args) starts `workbench args... --name name --run-dir tmp/name`."""
    started: list[PeerProcess] = []

    def _spawn(name: str, *args: str) -> PeerProcess:
        peer = PeerProcess(name, [*args, "--name", name, "--run-dir", str(tmp_path / name)], tmp_path)
        started.append(peer)
        return peer

    yield _spawn
    for peer in started:  # never leave peers (and their p2p daemons) behind
        peer.kill()


# --- the fault-scenario report (`make faults`, `make soak`) -----------------------------------

_SCENARIO = pytest.StashKey[dict]()
SCENARIOS: list[dict[str, Any]] = []


@pytest.fixture
def scenario(request):
    """A fault scenario's figures; the test fills them, the outcome says whether it survived.

    ``rounds_lost``: rounds that some peer did not contribute to the swarm's average because of
    the fault (fallbacks to a local step, rounds skipped by a state download). ``recover_seconds``:
    from the fault to the first moment the swarm trains together again.
    """
    record: dict[str, Any] = {"scenario": request.node.name, "rounds_lost": None, "recover_seconds": None}
    request.node.stash[_SCENARIO] = record
    return record


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    record = item.stash.get(_SCENARIO, None)
    if record is not None and report.when == "call":
        SCENARIOS.append({**record, "survived": report.passed, "test_seconds": round(report.duration, 1)})
    return report


def pytest_terminal_summary(terminalreporter) -> None:
    if not SCENARIOS:
        return
    terminalreporter.write_sep("=", "fault scenarios")
    for r in SCENARIOS:
        lost = "?" if r["rounds_lost"] is None else r["rounds_lost"]
        recover = "?" if r["recover_seconds"] is None else f"{r['recover_seconds']:.1f} s"
        extra = "".join(f", {k} {v}" for k, v in r.items() if k not in _SUMMARY_KEYS)
        terminalreporter.write_line(
            f"{r['scenario']}: {'survived' if r['survived'] else 'FAILED'}, rounds lost {lost}, "
            f"recovered in {recover}{extra} (test {r['test_seconds']} s)"
        )
    path = os.environ.get("WORKBENCH_FAULTS_REPORT")
    if path:  # `make faults` keeps the figures for docs/reliability.md
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(SCENARIOS, indent=1) + "\n")


_SUMMARY_KEYS = {"scenario", "survived", "rounds_lost", "recover_seconds", "test_seconds"}


def assert_grouped(rounds: list[dict], *, skip: int = 1, share: float = 0.05, context: str = "") -> None:
    """Every round after the first ``skip`` averaged in a group, but for a few (``share``) that
    failed and say why (``alone_reason``): on a loaded machine an honest round can fail (a
    member gives up on its leader during matchmaking) and the peer falls back to its own
    update; beside a busy test suite this happened to 1 of 119 syncs. Overlapped, a sync with no
    round in flight (``pending``: the first after a state download) averaged nothing, so it
    is neither (seen at a load average of 15: a peer fell behind, downloaded, and its next sync
    reported a "round alone with no reason")."""
    later = rounds[skip:]
    apart = [r for r in later if r["group_size"] < 2 and not r.get("pending")]
    summary = [(r["outer_step"], r["group_size"], r["alone_reason"], r["resync"]) for r in rounds]
    assert all(r["alone_reason"] for r in apart), ("a round alone with no reason", summary, context)
    assert len(apart) <= share * len(later), (f"{len(apart)} of {len(later)} rounds alone", summary, context)


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b))
