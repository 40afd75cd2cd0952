"""The notebook widget's Python side: state sync, and commands arriving as front-end state."""

from __future__ import annotations

import dataclasses

import pytest

from swarm.errors import SwarmError
from swarm.monitor import Reading, SwarmMonitor
from swarm.records import ControlState
from tests.ui.fake import FakeSource, heartbeat, peer_id
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
    assert set(state["loss_series"]) == {peer_id(i) for i in range(4)}
    assert [s["label"] for s in state["loss_series"].values()] == [
        f"{name} ({peer_id(i)[-8:]})" for i, name in enumerate(["alpha", "bravo", "charlie", "delta"])
    ]
    assert state["steer_reason"] is None


def test_peers_of_one_name_each_get_their_own_loss_line() -> None:
    """Keyed by peer id: a second "alpha" (or a peer naming itself after a line's label) takes
    no other peer's line."""
    monitor = SwarmMonitor()
    for step, t in enumerate((1000.0, 1010.0), start=1):
        beats = {peer_id(i): heartbeat(i, t, step, name="alpha") for i in range(2)}
        snapshot = monitor.ingest(Reading(t, "fake-run", beats))
    w = widget()
    w.source.poll = lambda: snapshot
    w.refresh()
    assert set(w.loss_series) == {peer_id(0), peer_id(1)}
    assert w.loss_series[peer_id(1)]["label"] == f"alpha ({peer_id(1)[-8:]})"
    assert [v for _, v in w.loss_series[peer_id(1)]["points"]] == [3.18, 3.13]


def test_a_pause_click_from_the_front_end_reaches_steering() -> None:
    w = widget()
    w.set_state({"command": {"action": "pause", "peer": peer_id(1), "nonce": 1}})
    assert w.source.published == [{"pause": [peer_id(1)]}]  # by id: a name can be shared
    assert w.message.startswith("published control v1")
    w.handle({"action": "pause", "peer": "charlie"})  # from Python, by a name only one peer has
    assert w.source.published[-1] == {"pause": [peer_id(2)]}


def test_pause_and_resume_name_one_live_peer_or_are_refused() -> None:
    w = widget()
    w.last = dataclasses.replace(w.last, control=ControlState(version=3, paused=[peer_id(0), "bravo"]))
    for command, why in [
        ({"action": "pause"}, "pause needs a peer: its id or its name (got None)"),
        ({"action": "pause", "peer": 7}, "pause needs a peer"),
        ({"action": "pause", "peer": "zulu"}, "no live peer is named zulu (live: alpha, bravo"),
        ({"action": "pause", "peer": "alpha"}, "alpha is already paused"),
        ({"action": "resume", "peer": "charlie"}, "charlie is not paused (paused: "),
    ]:
        w.set_state({"command": {**command, "nonce": len(why)}})
        assert w.message.startswith(f"refused: {why}"), w.message
    assert w.source.published == []
    w.handle({"action": "resume", "peer": peer_id(1)})  # paused by name (an older CLI): dropped too
    assert w.source.published[-1] == {"resume": sorted([peer_id(1), "bravo"])}
    # Two peers under one name (anyone can take a name): pause by id only.
    monitor = SwarmMonitor()
    beats = {peer_id(i): heartbeat(i, 1010.0, 1, name="alpha") for i in range(2)}
    w.last = monitor.ingest(Reading(1010.0, "fake-run", beats))
    with pytest.raises(SwarmError, match="2 live peers are named alpha .*pause one by its peer id"):
        w.handle({"action": "pause", "peer": "alpha"})
    w.handle({"action": "pause", "peer": peer_id(1)})
    assert w.source.published[-1] == {"pause": [peer_id(1)]}


def test_steer_from_the_front_end_and_from_python() -> None:
    w = widget()
    w.set_state({"command": {"action": "steer", "outer_lr": 0.5, "inner_steps": 30, "nonce": 2}})
    assert w.source.published == [{"outer_lr": 0.5, "inner_steps": 30}]
    w.steer(outer_lr=0.25)
    assert w.source.published[-1] == {"outer_lr": 0.25}
    w.set_state({"command": {"action": "steer", "round_seconds": 12, "nonce": 6}})
    assert w.source.published[-1] == {"round_seconds": 12.0}
    w.set_state({"command": {"action": "steer", "round_seconds": -1, "nonce": 7}})
    assert w.message == "refused: --round-seconds must be in [0, 86400] (got -1)"


def test_bad_commands_are_refused_with_a_message() -> None:
    w = widget()
    w.set_state({"command": {"action": "steer", "nonce": 3}})
    assert w.message == "refused: nothing to change: give an outer lr, H, round seconds or a codec"
    w.set_state({"command": {"action": "explode", "nonce": 4}})
    assert w.message.startswith("refused: unknown command")
    for changes, why in [
        ({"inner_steps": True}, "--inner-steps must be a number (got True)"),
        ({"outer_lr": "0.5"}, "--outer-lr must be a number"),
        ({"inner_steps": 10**9}, "--inner-steps must be"),
        ({"codec": "zip"}, "unknown codec 'zip'"),
        ({"outer_lr": 0.5, "lr": 0.1}, "cannot steer lr: choose from outer_lr"),
    ]:
        w.set_state({"command": {"action": "steer", **changes, "nonce": len(why)}})
        assert w.message.startswith(f"refused: {why}"), w.message
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


@pytest.mark.parametrize("interval", [0, -1, "1", float("nan"), True])
def test_a_poll_interval_out_of_bounds_is_refused(interval) -> None:
    with pytest.raises(ValueError, match="--interval must be"):
        SwarmWidget(FakeSource(), interval=interval, autostart=False)


def test_the_widget_stops_polling_once_the_run_is_over() -> None:
    """A simulation's source says when it is over: the widget reads its last state and its
    thread ends (one per widget kept polling a finished run until stop())."""
    from workbench.sources import SimSource

    source = SimSource("done soon", 2, inner_steps=5)
    w = SwarmWidget(source, interval=0.05)
    source.update({"rank": 0, "round": 1, "loss": 3.0, "bytes": 10})
    assert w._thread.is_alive()
    source.finish()
    w._thread.join(timeout=5)
    assert not w._thread.is_alive()
    assert {p["stage"] for p in w.snapshot["peers"]} == {"finishing"}  # its last state, read


def test_a_streaming_simulation_shows_outer_rounds_as_its_history_does() -> None:
    """The simulator's streaming rounds are single inner steps: its view said round 137 where the
    history said round 7 (H=20)."""
    from workbench.sources import SimSource

    source = SimSource("streaming", 1, inner_steps=20, per_round=20)
    source.update({"rank": 0, "round": 137, "loss": 3.0, "bytes": 10})
    assert source.poll().outer_round == 7


def test_a_closed_live_source_answers_with_its_last_reading(monkeypatch) -> None:
    """After its run ended (Experiment closes it), a live source gives its last reading, or says
    it has none, instead of polling a DHT that is shut down."""
    import types

    import workbench.sources as sources

    readings = []

    class Monitor:
        def __init__(self, read, record_to=None) -> None:
            pass

        def poll(self):
            readings.append(len(readings))
            return f"reading {readings[-1]}"

        def close(self) -> None:
            pass

    monkeypatch.setattr(sources, "SwarmMonitor", Monitor)
    monkeypatch.setattr(sources, "dht_reader", lambda *args, **kwargs: None)
    session = types.SimpleNamespace(
        keys=sources.RunKeys("closed"), board=None, store=None, close=lambda: None
    )
    source = sources.LiveSource(session)
    assert source.poll() == "reading 0"
    source.close()
    assert source.poll() == "reading 0" and readings == [0]  # no poll of the closed session
    # Never read before it closed (a run that ended with no widget open): it reads once as it
    # closes, so a widget made afterwards shows the run's last reading (it raised).
    never_read = sources.LiveSource(session)
    never_read.close()
    assert never_read.poll() == "reading 1" and readings == [0, 1]
    gone = sources.LiveSource(session)
    gone.monitor.poll = lambda: (_ for _ in ()).throw(TimeoutError("the DHT is gone"))
    gone.close()  # that last read failed: the view stays unread, said when asked
    with pytest.raises(SwarmError, match="it ended before it was read"):
        gone.poll()


def test_a_run_that_ended_cannot_be_steered_and_says_so(monkeypatch) -> None:
    """A local run's widget after `wait()`: its view was closed, yet steering looked allowed, and
    a steer or a pause raised hivemind's `OSError: handle is closed` out of the widget (a click
    did nothing visible). Now the reason says the run ended; a command is refused with it."""
    import types

    import workbench.sources as sources

    class Monitor:
        def __init__(self, read, record_to=None) -> None:
            pass

        def poll(self):
            return FakeSource().snapshots[-1]

        def close(self) -> None:
            pass

    def closed_handle(*args, **kwargs):
        raise OSError("handle is closed")

    monkeypatch.setattr(sources, "SwarmMonitor", Monitor)
    monkeypatch.setattr(sources, "dht_reader", lambda *args, **kwargs: None)
    session = types.SimpleNamespace(
        keys=sources.RunKeys("ended"),
        board=None,
        store=types.SimpleNamespace(store=closed_handle),
        close=lambda: None,
    )
    source = sources.LiveSource(session)
    source.poll()
    source.close()
    assert "has ended" in source.steering_reason()
    with pytest.raises(SwarmError, match="has ended"):
        source.steer(outer_lr=0.5)
    w = SwarmWidget(source, autostart=False)
    w.refresh()
    assert "has ended" in w.steer_reason  # the front end greys the controls out
    w.command = {"action": "steer", "outer_lr": 0.5}
    assert w.message.startswith("refused: ") and "has ended" in w.message
    w.command = {"action": "pause", "peer": peer_id(1)}
    assert "has ended" in w.message


def test_a_diverged_run_s_nan_reaches_the_front_end_as_null() -> None:
    """JSON has no NaN: a simulated run that diverged sent its NaN loss through Jupyter's
    deprecated fallback (a warning in the kernel's log at every poll)."""
    import json

    from workbench.sources import SimSource

    source = SimSource("diverged", 2, inner_steps=5)
    source.update({"rank": 0, "round": 1, "loss": float("nan"), "bytes": 10})
    w = SwarmWidget(source, autostart=False)
    w.refresh()
    json.dumps(w.get_state()["snapshot"], allow_nan=False)  # raises on a NaN
    assert [p["loss"] for p in w.snapshot["peers"] if p["peer_id"] == "sim-0"] == [None]


def test_a_simulation_s_view_shows_its_peers_speed(monkeypatch) -> None:
    """The simulator's view said 0 samples/s for the whole run (nothing set the rate), while
    docs/notebooks.md lists samples/s in the widget's summary."""
    from workbench import Experiment
    from workbench.sources import SimSource

    seen = []
    finish = SimSource.finish
    monkeypatch.setattr(
        SimSource, "finish", lambda self: (seen.extend(self.poll().peers.values()), finish(self))
    )
    Experiment(backend="sim", peers=2, steps=8, inner_steps=4, model="tiny", batch_size=2).run().wait()
    assert len(seen) == 2 and all(b.samples_per_second > 0 and b.last_round_steps == 4 for b in seen), seen
    assert all(b.last_round_seconds and b.last_round_seconds > 0 for b in seen)


def test_a_peer_paused_from_the_widget_can_be_resumed_before_the_next_poll() -> None:
    """The widget judged "paused" from its last poll: a pause then a resume (a notebook cell, or
    two clicks) refused the resume, "not paused (paused: nobody)", and the peer stayed paused."""
    w = widget()
    w.handle({"action": "pause", "peer": peer_id(1)})
    w.handle({"action": "resume", "peer": peer_id(1)})
    assert w.source.published[-1] == {"resume": sorted([peer_id(1), "bravo"])}  # by id and name
    with pytest.raises(ValueError, match="is not paused"):  # and that resume is seen too
        w.handle({"action": "resume", "peer": peer_id(1)})


def test_a_poll_failure_is_cleared_by_the_next_good_poll_and_a_replay_ends_its_thread(tmp_path) -> None:
    """ "poll failed" stayed in the widget after the DHT answered again; a replay's poll thread
    polled the finished recording for as long as the kernel lived (no `ended`)."""
    import time

    from workbench.sources import ReplaySource

    w = widget()
    failures = iter([RuntimeError("DHT hiccup")])
    poll = w.source.poll

    def flaky():  # type: ignore[no-untyped-def]
        error = next(failures, None)
        if error is not None:
            raise error
        return poll()

    w.source.poll, w.interval = flaky, 0.01
    w.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and w.source.poll is flaky and not w.message.startswith("poll failed"):
        time.sleep(0.005)
    while time.monotonic() < deadline and w.message:
        time.sleep(0.01)
    w.stop()
    assert w.message == ""
    path = tmp_path / "run.jsonl"
    live = SwarmMonitor(record_to=path)
    for snapshot_time in (1010.0, 1020.0):
        live.ingest(Reading(snapshot_time, "fake-run", {peer_id(0): heartbeat(0, snapshot_time, 1)}))
    live.close()
    replayed = SwarmWidget(ReplaySource(path, interval=0.01))
    thread = replayed._thread
    thread.join(timeout=10)
    assert not thread.is_alive() and replayed.source.ended and replayed.last.time == 1020.0
