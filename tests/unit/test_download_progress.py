"""A state download's progress: what the averager process counts, what the heartbeat and the
monitor show, and the terminal's bar."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from swarm.averaging import SwarmAverager
from swarm.records import PeerHeartbeat
from tui.format import peer_row, stage_text


def _progress(received: float, announced: float) -> float | None:
    return SwarmAverager.download_progress(
        SimpleNamespace(averager=SimpleNamespace(download=[received, announced, 1.0]))
    )


def test_the_share_received_of_what_the_donor_announced() -> None:
    assert _progress(50.0, 200.0) == 0.25
    assert _progress(10.0, 0.0) is None  # the donor has not said yet
    assert _progress(300.0, 200.0) == 1.0  # a donor that announced too little: shown as done, never more


def test_the_heartbeat_bounds_it_and_the_table_shows_it() -> None:
    base = dict(peer_id="p", name="b", outer_step=0, inner_step=0, inner_steps=5, time=0.0)
    downloading = PeerHeartbeat.model_validate({**base, "stage": "downloading", "download_progress": 0.37})
    assert stage_text(downloading) == "download 37%" and peer_row(downloading, 3)["stage"] == "download 37%"
    assert stage_text(downloading.model_copy(update={"download_progress": 0.0})) == "downloading"
    several = downloading.model_copy(update={"download_donors": 3})
    assert stage_text(several) == "download 37% from 3 donors"
    with pytest.raises(ValidationError):  # a claim, bounded like every other
        PeerHeartbeat.model_validate({**base, "stage": "downloading", "download_donors": 10_000})
    training = PeerHeartbeat.model_validate({**base, "stage": "training", "download_progress": 0.5})
    assert stage_text(training) == "training"
    with pytest.raises(ValidationError):
        PeerHeartbeat.model_validate({**base, "stage": "downloading", "download_progress": 1.5})


def test_the_bar_is_silent_without_a_terminal(capsys) -> None:
    from workbench.run.progress_bar import progress

    with progress("downloading", total=1.0, unit="share") as bar:
        bar.show(None)
        bar.show(0.5)
    assert capsys.readouterr().err == ""


def test_a_download_s_waits_end_when_what_they_wait_for_is_done_not_at_the_next_look():
    """Each wait of a download (the offers, the slices, the witnesses) looks at the deadline every
    50 ms; between looks it used to sleep, so each ended up to 50 ms after what it waited for."""
    import threading
    import time
    from concurrent.futures import Future

    from swarm.download import _until

    future: Future = Future()
    threading.Timer(0.05, future.set_result, [None]).start()
    start = time.monotonic()
    _until(future)(60.0)  # a pause far longer than any look: it must end with the future
    assert future.done() and time.monotonic() - start < 30


def test_a_failed_direct_try_leaves_no_share_for_the_stream_after_it() -> None:
    """After a failed direct try the heartbeat said its last share (90 % "from 4 donors") until
    the stream's first part came (a review, 2026-12-06)."""
    import time

    from swarm.download import Downloading

    joiner = Downloading.__new__(Downloading)
    joiner.averager = SimpleNamespace(download=[9.0, 10.0, 4.0])
    shown: list[tuple[float | None, int]] = []

    def stream(**kwargs):  # type: ignore[no-untyped-def]
        shown.append((SwarmAverager.download_progress(joiner), SwarmAverager.download_donors(joiner)))
        raise RuntimeError("(the test's end)")

    joiner.averager.load_state_from_peers = stream
    joiner._verifiers = lambda distrusted: ({}, set())
    joiner._fetch_direct = lambda skipped, claims, deadline: None
    joiner._download_tag = 0
    with pytest.raises(RuntimeError, match="the test's end"):
        joiner._fetch_state(set(), set(), time.monotonic() + 5)
    assert shown == [(None, 0)]
