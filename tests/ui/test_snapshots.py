"""SVG snapshots of the monitor at 80x24, 160x50 and 200x60 (pytest-textual-snapshot).

Regenerate after an intended change with `pytest tests/ui --snapshot-update`, then look at the
SVGs in tests/ui/__snapshots__/ before committing them.
"""

from __future__ import annotations

import time

import pytest
from textual.widgets import Input

from tests.ui.fake import FakeSource
from tui.app import SwarmApp


@pytest.fixture(autouse=True)
def utc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "UTC")  # the event log prints local times
    time.tzset()


def fed(**options) -> tuple[SwarmApp, object]:
    app = SwarmApp(FakeSource(**options), poll=False, clock=False)

    async def feed(pilot) -> None:
        for snapshot in app.source.snapshots:
            app.show(snapshot)
        await pilot.pause()

    return app, feed


@pytest.mark.parametrize("peers", [3, 64], ids=["3-peers", "64-peers"])
@pytest.mark.parametrize("size", [(80, 24), (160, 50), (200, 60)], ids=["80x24", "160x50", "200x60"])
def test_overview(snap_compare, size, peers) -> None:
    app, feed = fed(peers=peers)
    assert snap_compare(app, terminal_size=size, run_before=feed)


async def steady_cursor(pilot) -> None:
    """Stop the focused input's cursor blinking (shown, as the SVG has it): a snapshot taken
    half a second late on a loaded machine caught it blinked off (1 of 4 runs beside the suite)."""
    for box in pilot.app.screen.query(Input):
        box.cursor_blink = False
    await pilot.pause()


def test_steering_dialog(snap_compare) -> None:
    app, feed = fed()

    async def open_form(pilot) -> None:
        await feed(pilot)
        await pilot.press("e")
        await pilot.pause()
        await steady_cursor(pilot)

    assert snap_compare(app, terminal_size=(120, 40), run_before=open_form)


def test_steering_disabled_for_non_owners(snap_compare) -> None:
    app, feed = fed(owner=False)

    async def open_form(pilot) -> None:
        await feed(pilot)
        await pilot.press("e")
        await pilot.pause()

    assert snap_compare(app, terminal_size=(120, 40), run_before=open_form)


def test_peer_detail(snap_compare) -> None:
    app, feed = fed()

    async def open_detail(pilot) -> None:
        await feed(pilot)
        await pilot.press("down", "enter")
        await pilot.pause()

    assert snap_compare(app, terminal_size=(120, 40), run_before=open_detail)


def test_peers_that_left_stay_dimmed_with_how_and_when(snap_compare) -> None:
    app, feed = fed(leavers=3)
    assert snap_compare(app, terminal_size=(160, 50), run_before=feed)
