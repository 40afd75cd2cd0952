"""swarm.faults: the typed fault plan a launcher writes and a peer reads (``--fault-file``)."""

from __future__ import annotations

import os

import pytest

from swarm.faults import FaultPlan, FaultReader


def test_a_plan_round_trips_and_updates_merge(tmp_path):
    path = tmp_path / "faults.json"
    assert FaultPlan.read(path) == FaultPlan()  # no file yet: no faults
    FaultPlan(throttle_ms=500).write(path)
    plan = FaultPlan.update(path, corrupt_next=1.5)
    assert plan == FaultPlan(throttle_ms=500, corrupt_next=1.5) == FaultPlan.read(path)
    with pytest.raises(TypeError):
        FaultPlan.update(path, throttle=3)  # not a field: refused, not silently ignored


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"throttle": 5}', ["unknown fault", "throttle", "throttle_ms"]),
        ('{"serve_noise": "lots"}', ["serve_noise", "finite number"]),
        ('{"serve_noise": true}', ["serve_noise", "finite number"]),
        ("[1, 2]", ["one JSON object"]),
        ('{"throttle_ms": -500}', ["throttle_ms", ">= 0", "-500"]),  # (read as 0 before stop 71)
    ],
)
def test_a_bad_plan_is_refused_by_name(text, words):
    with pytest.raises(ValueError) as error:
        FaultPlan.parse(text)
    assert all(word in str(error.value) for word in words), str(error.value)


def test_the_reader_rereads_on_change_and_fires_a_one_shot_fault_once(tmp_path):
    path = tmp_path / "faults.json"
    reader = FaultReader(path)
    assert reader.poll() is None  # no file: nothing to do
    FaultPlan(corrupt_next=1).write(path)
    plan, fired = reader.poll()
    assert plan.corrupt_next == 1 and fired == {"corrupt_next"}
    assert reader.poll() is None  # unchanged
    FaultPlan(corrupt_next=1, oversize_next=1, throttle_ms=20).write(path)
    os.utime(path, (1, 1))  # a new mtime even on a coarse clock
    plan, fired = reader.poll()
    assert fired == {"oversize_next"} and plan.throttle_ms == 20  # the same corrupt token: not again
    FaultPlan(corrupt_next=1, oversize_next=1, overclaim_next=2, throttle_ms=20).write(path)
    os.utime(path, (2, 2))
    assert reader.poll()[1] == {"overclaim_next"}
    path.write_text('{"nope": 1}')
    with pytest.raises(ValueError):
        reader.poll()
    assert reader.plan.throttle_ms == 20  # the last good plan is kept
    assert FaultReader(None).poll() is None  # a peer started by hand has no fault file


@pytest.mark.parametrize("value", [-500.0, float("nan"), float("inf")])
def test_a_bad_value_is_refused_where_the_fault_is_written(tmp_path, value):
    """A NaN written for a peer made it refuse its fault file, and every later injection (removing
    a throttle too) failed; -500 was taken as 0 while the UI said "sleeps -500 ms" (a review,
    stop 59). The plan refuses it, and the file is left as it was."""
    path = tmp_path / "faults.json"
    FaultPlan.update(path, throttle_ms=100.0)
    with pytest.raises(ValueError, match="throttle_ms must be a finite number >= 0"):
        FaultPlan.update(path, throttle_ms=value)
    assert FaultPlan.read(path).throttle_ms == 100.0
    assert FaultPlan.update(path, throttle_ms=0.0).throttle_ms == 0.0


def test_a_peer_frozen_again_thaws_after_the_last_freeze(monkeypatch):
    """The first freeze's timer thawed it: a 3 s freeze given 2 s into another lasted 1 s."""
    import workbench.local.launch as launch

    signals: list[str] = []
    timers: list[list] = []

    class Timer:
        daemon = False

        def __init__(self, seconds, action) -> None:
            self.record = [seconds, "pending"]
            timers.append(self.record)

        def start(self) -> None:
            pass

        def cancel(self) -> None:
            self.record[1] = "cancelled"

    monkeypatch.setattr(launch.threading, "Timer", Timer)
    monkeypatch.setattr(launch.os, "killpg", lambda pid, signum: signals.append(signum.name))
    peer = launch.LocalPeer(name="p", directory=None, process=type("P", (), {"pid": 1})())  # type: ignore[arg-type]
    peer.freeze(3.0)
    peer.freeze(3.0)
    assert signals == ["SIGSTOP", "SIGSTOP"] and timers == [[3.0, "cancelled"], [3.0, "pending"]]
    with pytest.raises(launch.LaunchError, match="at most 3600 s"):
        peer.freeze(float("nan"))


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"explode": 1}', ["unknown fault(s) explode", "known:"]),
        ('{"throttle_ms": "fast"}', ["throttle_ms", "finite number"]),
        ('{"throttle_ms": -500}', ["throttle_ms", ">= 0"]),
        ("{\n,", ["is not JSON", "write one JSON object"]),
        (None, ["Is a directory"]),
    ],
)
def test_a_peer_given_a_bad_fault_file_stops_before_it_starts_with_one_line(tmp_path, capsys, text, words):
    """A typo in a fault file was one warning as the peer ran, which then ran with no faults and
    exited 0 (a review, stop 71): `start` refuses it first, exit 2, and makes no run folder. No
    file yet is no faults (a test or the lab writes it later)."""
    from workbench.cli.command import EXIT_USER_ERROR, main

    path = tmp_path / "faults.json"
    if text is None:
        path.mkdir()
    else:
        path.write_text(text)
    run_dir = tmp_path / "run"
    assert main(["start", "--fault-file", str(path), "--run-dir", str(run_dir)]) == EXIT_USER_ERROR
    said = capsys.readouterr().err.strip()
    assert said.startswith(f"error: --fault-file {path}") and len(said.splitlines()) == 1, said
    assert all(word in said for word in words), said
    assert not run_dir.exists()
