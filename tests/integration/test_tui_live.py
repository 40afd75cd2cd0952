"""The monitor app against a real 2-peer swarm: both peers appear, a steering change made in
the app's form reaches both, and both echo its version."""

from __future__ import annotations

import time

from textual.widgets import DataTable, Input, Static

from tests.integration.conftest import FAST, interrupt_all
from tui.app import SwarmApp
from workbench.sources import LiveSource


async def wait_for(pilot, predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await pilot.pause(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


async def test_the_monitor_watches_and_steers_a_live_swarm(spawn):
    # Until Ctrl+C: the monitor's DHT, the table, the form and both peers' echo take longer
    # than a run of a fixed number of FAST rounds may last on a loaded machine (60 rounds:
    # 12-40 s; a run over before the publish never applies it).
    common = [*FAST, "--run-id", "tui-live", "--rounds", "0"]
    first = spawn("a", "start", *common, "--min-peers", "2")
    address = first.address()
    second = spawn("b", "join", address, *common)
    second.wait_event("round")
    source = LiveSource.connect([address], run_id="tui-live", key=first.directory / "identity.key")
    app = SwarmApp(source)
    try:
        async with app.run_test(size=(160, 50)) as pilot:
            table = app.query_one("#peers", DataTable)
            await wait_for(pilot, lambda: table.row_count == 2, 30, "both peers in the table")
            names = sorted(str(table.get_row_at(i)[0]) for i in range(2))
            assert names == ["a", "b"]
            await wait_for(pilot, lambda: source.steering_reason() is None, 15, "steering to be enabled")

            await pilot.press("e")
            app.screen.query_one("#outer-lr", Input).value = "0.4"
            await pilot.click("#review")
            await pilot.click("#publish")
            summary = app.query_one("#summary", Static)
            await wait_for(
                pilot, lambda: "2/2 peers applied v1" in str(summary.render()), 60, "both peers to apply v1"
            )
    finally:
        source.close()
    interrupt_all((first, second))
    for peer in (first, second):
        applied = peer.events("control_applied")
        assert applied and applied[0]["version"] == 1 and applied[0]["changes"] == {"outer_lr": 0.4}
