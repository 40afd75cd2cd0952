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
