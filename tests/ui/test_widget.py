"""The notebook widget's Python side: state sync, and commands arriving as front-end state."""

from __future__ import annotations

from tests.ui.fake import FakeSource
from workbench.notebook.widget import SwarmWidget


def widget(**options) -> SwarmWidget:
    source = FakeSource(**options)
    source.position = len(source.snapshots) - 1  # the last reading: 4 peers at round 12
    return SwarmWidget(source, autostart=False)


def test_the_snapshot_syncs_to_the_front_end() -> None:
    w = widget()
    state = w.get_state()
    assert state["title"] == "run fake-run"
    assert [p["name"] for p in state["snapshot"]["peers"]] == ["alpha", "bravo", "charlie", "delta"]
    assert state["snapshot"]["outer_round"] == 12
    assert set(state["loss_series"]) == {"alpha", "bravo", "charlie", "delta"}
    assert state["steer_reason"] is None


def test_a_pause_click_from_the_front_end_reaches_steering() -> None:
    w = widget()
    w.set_state({"command": {"action": "pause", "peer": "bravo", "nonce": 1}})
    assert w.source.published == [{"paused": ["bravo"]}]
    assert w.message.startswith("published control v1")


def test_steer_from_the_front_end_and_from_python() -> None:
    w = widget()
    w.set_state({"command": {"action": "steer", "outer_lr": 0.5, "inner_steps": 30, "nonce": 2}})
    assert w.source.published == [{"outer_lr": 0.5, "inner_steps": 30}]
    w.steer(outer_lr=0.25)
    assert w.source.published[-1] == {"outer_lr": 0.25}
    w.set_state({"command": {"action": "steer", "round_seconds": 12, "nonce": 6}})
    assert w.source.published[-1] == {"round_seconds": 12.0}
    w.set_state({"command": {"action": "steer", "round_seconds": -1, "nonce": 7}})
    assert w.message == "refused: --round-seconds must be in [0, 86400] (got -1.0)"


def test_bad_commands_are_refused_with_a_message() -> None:
    w = widget()
    w.set_state({"command": {"action": "steer", "nonce": 3}})
    assert w.message == "refused: nothing to change: give an outer lr, H or round seconds"
    w.set_state({"command": {"action": "explode", "nonce": 4}})
    assert w.message.startswith("refused: unknown command")
    assert w.source.published == []


def test_non_owners_see_the_reason_and_cannot_steer() -> None:
    w = widget(owner=False)
    assert "only the run owner" in w.steer_reason
    w.set_state({"command": {"action": "pause", "peer": "alpha", "nonce": 5}})
    assert w.message.startswith("refused: only the run owner")


def test_static_html_fallback() -> None:
    w = widget()
    data, _ = w._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data
    assert "<table>" in data["text/html"] and "charlie" in data["text/html"]
