"""Pilot tests of the swarm monitor on a deterministic fake source (no network)."""

from __future__ import annotations

import json

import pytest
from textual.widgets import Button, Checkbox, DataTable, Input, Select, Static

from tests.ui.fake import FakeSource, peer_id
from tui.app import SwarmApp
from tui.screens import FaultScreen, HelpScreen, PeerScreen, SteerScreen


async def started(app: SwarmApp, pilot, readings: int | None = None) -> None:
    """Feed the fake source's readings straight into the app (no poll thread: deterministic)."""
    for snapshot in app.source.snapshots[:readings]:
        app.show(snapshot)
    await pilot.pause()


async def click_again(pilot, selector: str) -> None:
    """Click a button clicked a moment ago. Textual ignores a click on a button still showing
    its last press (0.2 s): a second click at once did nothing on a fast machine (stop 58's CI)."""
    button = pilot.app.screen.query_one(selector, Button)
    while button.has_class("-active"):
        await pilot.pause(0.05)
    await pilot.click(selector)


def names(app: SwarmApp) -> list[str]:
    table = app.query_one("#peers", DataTable)
    return [str(table.get_row_at(i)[0]) for i in range(table.row_count)]


@pytest.fixture
def app() -> SwarmApp:
    return SwarmApp(FakeSource(), poll=False)


async def test_the_table_shows_every_live_peer_keyed_by_id(app) -> None:
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot, readings=2)
        assert names(app) == ["alpha", "bravo", "charlie"]
        await started(app, pilot)
        assert names(app) == ["alpha", "bravo", "charlie", "delta"]
        table = app.query_one("#peers", DataTable)
        assert [str(k.value) for k in table.rows] == [peer_id(i) for i in range(4)]
        row = table.get_row(peer_id(3))
        assert str(row[5]) == "2"  # delta lags two rounds
        summary = str(app.query_one("#summary", Static).render())
        assert "round 12" in summary and "peers 4" in summary and "1 lagging" in summary
        assert "20x more" in summary  # bytes sent vs what data-parallel would have sent


def test_every_cell_fits_its_column() -> None:
    """The table's columns have fixed widths and cut what is longer: H=1000 showed inner
    999/100 (and H=2000 1500/200), a loss of 10.826 read 10.82, 12345.6 samples/s read 12345., control v1000 v100."""
    from tests.ui.fake import heartbeat
    from tui.format import peer_row
    from tui.widgets import WIDTHS

    p = heartbeat(0, 1000.0, 3, inner_step=1500, inner_steps=2000, loss=10.826, samples_per_second=12345.6)
    p = p.model_copy(update=dict(control_version=1000, last_round_steps=1000))
    row = peer_row(p, 3, WIDTHS)
    assert (row["inner"], row["loss"], row["speed"], row["control"], row["h"]) == (
        "1500/2000", "10.83", "12346", "v1000", "1000",
    )  # fmt: skip
    huge = p.model_copy(
        update=dict(
            inner_step=99_999, inner_steps=100_000, samples_per_second=2.5e6, last_round_seconds=1234.5
        )
    )
    row = peer_row(huge, 5000, WIDTHS)
    assert (row["inner"], row["speed"], row["round"], row["lag"]) == ("99k/100k", "2.5M", "20m34s", "4997")
    assert all(len(row[key]) <= width for key, width in WIDTHS.items() if key != "stage"), row


def test_the_bandwidth_is_what_the_peers_sent_averaged_over_a_window() -> None:
    """Peers say the bytes they sent once per round: a rate from one reading to the next read
    0 B/s then a spike; a peer seen again after a freeze added its whole count at once (504 MB/s
    for about 1 MB/s), and one that left made the sum fall."""
    from swarm.monitor import Reading, SwarmMonitor
    from tests.ui.fake import heartbeat
    from tui.widgets import Rates

    monitor, rates = SwarmMonitor(), Rates()
    sent = {0: 0, 1: 0}
    for t in range(0, 121):  # a reading a second; each peer sends 10 MB at the end of a 10 s round
        if t % 10 == 0 and t:
            sent = {i: b + 10_000_000 for i, b in sent.items()}
        peers = {
            heartbeat(i, float(t), 1).peer_id: heartbeat(i, float(t), 1, bytes_sent=b)
            for i, b in sent.items()
        }
        if 60 <= t < 90:  # peer 1 frozen: gone from the readings, then back with all it sent
            peers.pop(heartbeat(1, 0.0, 1).peer_id)
        rates.record(monitor.ingest(Reading(float(t), "r", peers)))
    steady = list(rates._bandwidth)[40:60]  # both peers: 2 MB/s
    assert all(1.5e6 <= b <= 2.5e6 for b in steady), steady
    assert max(rates._bandwidth) < 3e6  # no spike when peer 1 came back with 120 MB


async def test_sort_by_any_column_and_reverse(app) -> None:
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot)
        app.sort_by("loss")
        await pilot.pause()
        assert names(app) == ["alpha", "bravo", "charlie", "delta"]  # loss rises with the index
        app.sort_by("loss")
        await pilot.pause()
        assert names(app) == ["delta", "charlie", "bravo", "alpha"]
        await pilot.press("s")  # next column after loss: samples/s
        assert app.sort_column == "speed" and not app.sort_reverse
        app.sort_by("lag")
        app.sort_by("lag")
        await pilot.pause()
        assert names(app)[0] == "delta"


async def test_a_sort_back_to_the_order_rows_came_in_is_shown(app) -> None:
    """DataTable.sort reorders what is shown, not ``rows``: a sort back to the order the rows
    came in was taken as done, and the table stayed reversed."""
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot)
        app.sort_by("lag")
        app.sort_by("lag")  # descending
        await pilot.pause()
        assert names(app)[0] == "delta"
        app.sort_by("name")
        await pilot.pause()
        assert names(app) == ["alpha", "bravo", "charlie", "delta"]


def broken_pipe(**changes):  # type: ignore[no-untyped-def]
    """A steer whose DHT process is gone."""
    raise BrokenPipeError(32, "Broken pipe")


async def test_a_publish_that_fails_keeps_the_app_and_the_form(app) -> None:
    """A steer that raised anything but SwarmError/ValueError (a DHT process gone: BrokenPipeError)
    ended the app; and any refusal threw the form away, to be typed again."""

    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot)
        app.source.steer = broken_pipe
        await pilot.press("e")
        app.screen.query_one("#outer-lr", Input).value = "0.5"
        app.screen.query_one("#checkpoint", Checkbox).value = True
        await pilot.click("#review")
        await pilot.click("#publish")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.is_running and app.unpublished == {"outer_lr": 0.5, "checkpoint": True}
        await pilot.press("e")
        assert app.screen.query_one("#outer-lr", Input).value == "0.5"
        assert app.screen.query_one("#checkpoint", Checkbox).value


async def test_a_failed_publishs_pause_is_kept_when_the_cursor_moved(app) -> None:
    """The form kept a failed publish's lr, but its pause of alpha was lost if the user moved
    the cursor to bravo before pressing e again (the form showed bravo's toggle, unticked)."""

    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot)
        app.source.steer = broken_pipe
        await pilot.press("e")
        toggle = app.screen.query_one("#toggle-pause", Checkbox)
        paused_name = str(toggle.label).split(" ", 1)[1]
        toggle.value = True
        await pilot.click("#review")
        await pilot.click("#publish")
        await app.workers.wait_for_complete()
        await pilot.pause()
        await pilot.press("down", "down", "e")
        toggle = app.screen.query_one("#toggle-pause", Checkbox)
        assert toggle.value and str(toggle.label) == f"pause {paused_name}", toggle.label


async def test_filter_with_slash_and_clear_with_escape(app) -> None:
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot)
        await pilot.press("slash")
        assert app.query_one("#filter", Input).display
        await pilot.press(*"wait")
        assert names(app) == ["delta"]  # matches its stage, "waiting"
        await pilot.press("enter", "escape")
        assert names(app) == ["alpha", "bravo", "charlie", "delta"]
        assert not app.query_one("#filter", Input).display


async def test_enter_opens_the_peer_detail(app) -> None:
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot)
        await pilot.press("down", "enter")
        assert isinstance(app.screen, PeerScreen)
        assert app.screen.peer_id == peer_id(1)
        text = " ".join(str(w.render()) for w in app.screen.query(Static))
        assert "bravo" in text and "/ip4/127.0.0.1/tcp/40001" in text and "is in the run" in text
        await pilot.press("escape")
        assert not isinstance(app.screen, PeerScreen)


async def test_steering_form_confirms_then_publishes(app) -> None:
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot)
        await pilot.press("e")
        assert isinstance(app.screen, SteerScreen)
        app.screen.query_one("#outer-lr", Input).value = "0.5"
        app.screen.query_one("#inner-steps", Input).value = "25"
        app.screen.query_one("#round-seconds", Input).value = "12"
        app.screen.query_one("#toggle-pause", Checkbox).value = True
        app.screen.query_one("#codec", Select).value = "int8"
        await pilot.click("#review")
        assert "outer_lr = 0.5" in str(app.screen.query_one("#confirm").render())
        assert app.source.published == []  # nothing before the confirmation
        await pilot.click("#publish")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.source.published == [
            {
                "outer_lr": 0.5,
                "inner_steps": 25,
                "round_seconds": 12.0,
                "codec": "int8",
                "pause": [peer_id(0)],
            }
        ]
        summary = str(app.query_one("#summary", Static).render())
        assert "0/4 peers applied v1" in summary


async def test_an_edit_after_review_must_be_reviewed_again(app) -> None:
    """Stop 57, a review: Publish stayed enabled after an edit and sent what was reviewed."""
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot)
        await pilot.press("e")
        app.screen.query_one("#outer-lr", Input).value = "0.5"
        await pilot.click("#review")
        assert not app.screen.query_one("#publish").disabled
        app.screen.query_one("#outer-lr", Input).value = "0.1"
        await pilot.pause()
        assert app.screen.query_one("#publish").disabled
        assert "Review again" in str(app.screen.query_one("#confirm").render())
        await click_again(pilot, "#review")
        await pilot.click("#publish")
        await pilot.pause()
        await app.workers.wait_for_complete()
        assert app.source.published == [{"outer_lr": 0.1}]


async def test_a_bad_steering_value_is_refused_in_the_form(app) -> None:
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot)
        await pilot.press("e")
        app.screen.query_one("#outer-lr", Input).value = "50"
        await pilot.click("#review")
        assert "outer lr must be in (0, 10] (got 50)" in str(app.screen.query_one("#error").render())
        assert app.screen.query_one("#publish").disabled


@pytest.mark.parametrize(
    ("field", "typed", "said"),
    [
        ("#outer-lr", "0,5", "outer lr: '0,5' is not a number (a decimal point, not a comma: 0.5)"),
        ("#inner-steps", "2.5", "inner steps H must be a whole number in [1, 100000] (got 2.5)"),
        ("#outer-lr", "1e", "outer lr: '1e' is not a number"),
        ("#inner-steps", "-", "inner steps H: '-' is not a number"),
        ("#outer-lr", "[/red]", "outer lr: '[/red]' is not a number"),
    ],
)
async def test_a_steering_value_is_taken_as_typed_or_refused_naming_its_field(
    app, field, typed, said
) -> None:
    """The number inputs dropped what they did not take: "0,5" became 05 (published as outer lr
    5, 10x the intent), "2.5" H became 25 and "1e3" 13; "1e" was Python's "could not convert
    string to float" without the field's name (a review, 2026-12-06)."""
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot)
        await pilot.press("e")
        app.screen.query_one(field, Input).focus()
        await pilot.press(*typed)
        assert app.screen.query_one(field, Input).value == typed
        await pilot.click("#review")
        assert said in str(app.screen.query_one("#error").render())
        assert app.screen.query_one("#publish").disabled


async def test_a_steering_value_in_exponent_form_is_its_number(app) -> None:
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot)
        await pilot.press("e")
        app.screen.query_one("#inner-steps", Input).focus()
        await pilot.press(*"1e3")
        await pilot.click("#review")
        assert app.screen.changes == {"inner_steps": 1000}


@pytest.mark.parametrize("screen", ["steer", "faults"])
async def test_a_dialog_at_80x24_scrolls_to_what_the_keyboard_reaches(app, screen) -> None:
    """At 80x24 the steering form's Review/Publish buttons and confirmation, and the fault
    menu's last faults, were below the dialog's edge and did not scroll: Tab reached buttons the
    user could not see (a review, 2026-12-06)."""
    async with app.run_test(size=(80, 24)) as pilot:
        await started(app, pilot)
        await pilot.press("down", "e" if screen == "steer" else "f")
        dialog = app.screen.query_one("#dialog")
        last = list(app.screen.query(Button))[-1]
        for _ in range(20):  # Tab, as a keyboard user reaches it
            if app.focused is last:
                break
            await pilot.press("tab")
        assert app.focused is last and dialog.max_scroll_y > 0
        for _ in range(40):  # the scroll is animated
            if dialog.content_region.contains_region(last.region):
                break
            await pilot.pause(0.05)
        assert dialog.content_region.contains_region(last.region), (dialog.content_region, last.region)


async def test_steering_is_disabled_with_the_reason_for_non_owners() -> None:
    app = SwarmApp(FakeSource(owner=False), poll=False)
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot)
        await pilot.press("e")
        assert "only the run owner" in str(app.screen.query_one("#reason").render())
        assert app.screen.query_one("#outer-lr", Input).disabled
        assert app.screen.query_one("#review").disabled


async def test_fault_menu_reaches_the_injector(app) -> None:
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot)
        await pilot.press("down", "f")
        assert isinstance(app.screen, FaultScreen)
        await pilot.click("#fault-1")  # freeze 30 s
        await pilot.pause()
        assert app.source.faults.calls == [("freeze", peer_id(1), 30.0)]


async def test_fault_menu_is_disabled_for_remote_peers(app) -> None:
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot)
        await pilot.press("down", "down", "f")  # charlie: "runs on another machine"
        assert "another machine" in str(app.screen.query_one("#reason").render())
        assert all(button.disabled for button in app.screen.query(".fault"))


async def test_help_pause_window_export(app, tmp_path) -> None:
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot, readings=6)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.press("p")
        assert app.updates_paused
        app.show(app.source.snapshots[-1])
        await pilot.pause()
        assert "round 6" in str(app.query_one("#summary", Static).render())  # frozen
        await pilot.press("p")
        assert "round 12" in str(app.query_one("#summary", Static).render())
        window = app.window
        await pilot.press("plus")
        assert app.window == window + 1
        path = app.action_export(str(tmp_path / "snap.json"))
        assert json.loads(path.read_text())["outer_round"] == 12
        # A folder that cannot be written: a notice, and the monitor keeps running (it crashed,
        # and in the demo closing the monitor stops the peers).
        assert app.action_export(str(tmp_path / "missing" / "snap.json")) is None
        await pilot.pause()
        assert app.is_running
        assert any("could not write" in str(n.message) for n in app._notifications)


async def test_maximize_a_panel(app) -> None:
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot)
        await pilot.press("m")
        assert app.screen.maximized is app.query_one("#peers")
        await pilot.press("escape")
        assert app.screen.maximized is None
        await pilot.press("m", "slash")  # the filter box is outside the maximized table
        assert app.screen.maximized is None and app.query_one("#filter", Input).has_focus
        assert app.query_one("#filter", Input).region.area > 0


async def test_the_poll_worker_feeds_the_app() -> None:
    """With polling on, the worker thread reads the source and the table fills by itself."""
    source = FakeSource()
    app = SwarmApp(source)
    async with app.run_test(size=(120, 40)) as pilot:
        for _ in range(100):
            await pilot.pause(0.05)
            if source.position >= 5:
                break
        assert source.position >= 5 and app.query_one("#peers", DataTable).row_count >= 3


async def test_256_peers_render(app) -> None:
    app = SwarmApp(FakeSource(peers=256, steps=4), poll=False)
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot)
        assert app.query_one("#peers", DataTable).row_count == 256


def test_a_snapshot_that_arrives_while_the_app_closes_is_dropped() -> None:
    """The poll worker's last snapshot can land after the screen is gone (seen under load as a
    WorkerFailed: NoMatches '#events' at exit): it is dropped, not an error."""
    source = FakeSource()
    app = SwarmApp(source, poll=False)
    app.show(source.poll())
    assert app.snapshot is None


async def test_peers_that_left_stay_below_the_live_ones_until_cleared() -> None:
    app = SwarmApp(FakeSource(leavers=3), poll=False)
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot, readings=8)
        assert names(app) == ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "peer-006"]
        await started(app, pilot)
        assert names(app) == ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "peer-006"]
        table = app.query_one("#peers", DataTable)
        stages = {str(table.get_row(peer_id(i))[0]): str(table.get_row(peer_id(i))[1]) for i in range(4, 7)}
        assert [s.split()[0] for s in stages.values()] == ["exit", "expired", "killed"], stages
        app.sort_by("loss")  # the user's order applies to the live peers; those that left stay below
        app.sort_by("loss")
        await pilot.pause()
        assert sorted(names(app)[4:]) == ["echo", "foxtrot", "peer-006"]  # they left together
        assert names(app)[:4] == ["delta", "charlie", "bravo", "alpha"]
        await pilot.press("down", "down", "down", "down", "enter")  # a peer that left: how and when
        await pilot.pause()
        assert isinstance(app.screen, PeerScreen)
        await pilot.press("escape")
        await pilot.press("c")
        await pilot.pause()
        assert names(app) == ["delta", "charlie", "bravo", "alpha"]
        app.show(app.source.snapshots[-1])  # the same departures are not shown again
        await pilot.pause()
        assert len(names(app)) == 4


async def test_the_filter_matches_a_departed_peers_stage_as_shown() -> None:
    """A peer that left shows how it left ("expired 10:32"), but the filter matched the stage
    of its last heartbeat: "expired" found nothing, "train" found a peer long gone."""
    app = SwarmApp(FakeSource(leavers=3), poll=False)
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot)
        every = names(app)
        await pilot.press("slash", *"expired")
        assert names(app) == [every[5]]  # the second leaver's heartbeat expired
        await pilot.press("escape", "slash", *"train")
        assert names(app) and every[5] not in names(app)
        await pilot.press("escape", "slash", *"exit")
        assert names(app) == [every[4]]


async def test_the_steering_form_offers_no_pause_for_a_peer_that_left() -> None:
    """Stop 57, a review: the form offered to pause a departed peer, which `workbench steer`
    refuses ("no live peer is named ...")."""
    app = SwarmApp(FakeSource(leavers=3), poll=False)
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot)
        table = app.query_one("#peers", DataTable)
        table.move_cursor(row=table.get_row_index(peer_id(5)))
        await pilot.press("e")
        assert isinstance(app.screen, SteerScreen) and not app.screen.query("#toggle-pause")
        await pilot.press("escape")
        table.move_cursor(row=table.get_row_index(peer_id(0)))  # a live one: offered
        await pilot.press("e")
        assert app.screen.query("#toggle-pause")


async def test_f_on_a_stopped_demo_peer_offers_a_restart() -> None:
    app = SwarmApp(FakeSource(leavers=3), poll=False)
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot)
        table = app.query_one("#peers", DataTable)
        table.move_cursor(row=table.get_row_index(peer_id(6)))  # killed from the monitor
        await pilot.press("f")
        assert isinstance(app.screen, FaultScreen) and not app.screen.query(".fault")
        await pilot.click("#restart")
        await pilot.pause()
        assert app.source.faults.calls == [("restart", peer_id(6), None)]


async def test_a_lying_peers_detail_shows_the_flag_as_text(app) -> None:
    """The departed peer's line put its reason into markup unescaped: a reason from peers'
    heartbeats ("lied [/b]", flagged by most of them) crashed the detail screen."""
    from swarm.monitor import Reading, SwarmMonitor
    from tests.ui.fake import heartbeat

    monitor, liar = SwarmMonitor(), peer_id(3)
    for t, flag in ((1000.0, {}), (1001.0, {liar: "lied [/b]"})):
        beats = {peer_id(i): heartbeat(i, t, 5, ignored=flag if i < 3 else {}) for i in range(4)}
        snapshot = monitor.ingest(Reading(t, "r", beats))
    async with app.run_test(size=(160, 50)) as pilot:
        app.push_screen(PeerScreen(snapshot, liar))
        await pilot.pause()
        text = " ".join(str(w.render()) for w in app.screen.query("Label"))
        assert "lied [/b]" in text


async def test_the_lag_cell_shows_lagging_even_when_its_number_stays() -> None:
    """A cell was redrawn only when its text changed: a peer that began lagging with the same
    lag kept its plain look while the summary said "1 lagging" (and a paused one stayed yellow)."""
    import dataclasses

    app = SwarmApp(FakeSource(), poll=False)
    async with app.run_test(size=(160, 50)) as pilot:
        snapshot = app.source.snapshots[-1]
        app.show(dataclasses.replace(snapshot, lagging=[]))
        await pilot.pause()
        table = app.query_one("#peers", DataTable)
        assert getattr(table.get_cell(peer_id(3), "lag"), "style", None) != "bold yellow"
        app.show(dataclasses.replace(snapshot, lagging=[peer_id(3)]))
        await pilot.pause()
        assert getattr(table.get_cell(peer_id(3), "lag"), "style", None) == "bold yellow"


async def test_the_table_paints_every_reading_and_keeps_no_stale_renders() -> None:
    """Stop 66: a cell is rendered again only when its value changed (DataTable dropped every
    cell's render whenever any cell changed: 65 ms a refresh with 256 peers), and DataTable's
    own caches of renders no reading can use again are emptied. What is painted is each
    reading's, row by row, whatever the cache holds."""
    from tui.format import peer_row
    from tui.widgets import WIDTHS

    app = SwarmApp(FakeSource(peers=6, steps=12), poll=False)
    async with app.run_test(size=(160, 50)) as pilot:
        table = app.query_one("#peers", DataTable)
        for snapshot in app.source.snapshots:
            app.show(snapshot)
            await pilot.pause()
            painted = [table.render_line(y).text for y in range(table.size.height)]
            for peer in snapshot.peers.values():
                cells = peer_row(peer, snapshot.outer_round, WIDTHS)
                line = next(line for line in painted if f" {cells['name']} " in line)
                for key in ("inner", "outer", "loss", "sent", "round"):
                    assert f" {cells[key]}" in line, (key, cells[key], line)
        assert len(table._cell_render_cache) <= 6 * len(table.columns) + len(table.columns)


async def test_what_the_table_paints_from_its_caches_is_what_it_paints_without_them() -> None:
    """The table keeps each cell's render while its value stays (stop 66): readings, cursor
    moves, sorts, a theme change and cleared departures paint what a table with every cache
    dropped paints (a review's oracle)."""
    app = SwarmApp(FakeSource(peers=6, steps=12, leavers=3), poll=False)
    async with app.run_test(size=(160, 50)) as pilot:
        table = app.query_one("#peers", DataTable)
        differ = []
        for i, snapshot in enumerate(app.source.snapshots):
            app.show(snapshot)
            await pilot.pause()
            if i % 3 == 0:
                await pilot.press("down")
            if i % 4 == 1:
                table.sort_next()
            if i == 5:
                app.action_ansi_theme()
            if i == 7:
                await pilot.press("c")
            await pilot.pause()
            table._pseudo_class_state = table.get_pseudo_class_state()
            cached = [list(table.render_line(y)) for y in range(table.size.height)]
            table._clear_caches()
            fresh = [list(table.render_line(y)) for y in range(table.size.height)]
            differ += [(i, y) for y in range(len(cached)) if cached[y] != fresh[y]]
        assert not differ, differ


async def test_a_departed_rows_changed_cells_stay_dim() -> None:
    """A peer that left and is then flagged as lying (its leaving heartbeat still in the DHT)
    changes its departed record while its row stays departed: the cells that changed were
    drawn undimmed, in the live stage's colour (a review of stop 66's cell updates)."""
    import dataclasses

    from swarm.narration import Departed
    from swarm.records import Stage

    app = SwarmApp(FakeSource(peers=6, steps=3), poll=False)
    async with app.run_test(size=(160, 50)) as pilot:
        table = app.query_one("#peers", DataTable)
        snapshot, gone = app.source.snapshots[-1], peer_id(1)
        beat = snapshot.peers[gone]
        peers = {k: v for k, v in snapshot.peers.items() if k != gone}
        left = dataclasses.replace(
            snapshot, peers=peers, departed={gone: Departed(beat, "clean exit", snapshot.time)}
        )
        app.show(left)
        await pilot.pause()
        later = beat.model_copy(update=dict(stage=Stage.LEAVING, inner_step=beat.inner_step + 1, loss=1.234))
        flagged = dataclasses.replace(
            left,
            time=snapshot.time + 120,
            departed={gone: Departed(later, "ignored for lying: absurd", snapshot.time + 120)},
        )
        app.show(flagged)
        await pilot.pause()
        styles = {
            k: getattr(table.get_cell(gone, k), "style", None) for k in ("name", "stage", "inner", "loss")
        }
        assert set(styles.values()) == {"dim"}, styles
        assert str(table.get_cell(gone, "stage")).startswith("lying")


async def test_ctrl_c_quits_as_q_does(app) -> None:
    """Textual 8 answers Ctrl+C with a hint to press Ctrl+Q; a terminal's user presses Ctrl+C."""
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot)
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert not app.is_running


@pytest.mark.parametrize("key", ["question_mark", "enter", "e"])
async def test_ctrl_c_quits_from_a_dialog_too(app, key) -> None:
    """In Help, a peer's detail or the steering form, Ctrl+C did nothing (a review, 2026-12-06)."""
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot)
        await pilot.press(key)
        assert app.screen is not app.screen_stack[0]
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert not app.is_running


def test_the_eta_is_the_median_of_what_the_peers_say() -> None:
    """One heartbeat claiming 10¹² planned rounds (or a round of a day) made the ETA absurd for
    everyone watching (a review, stop 59): the median of the claims."""
    from swarm.monitor import Reading, SwarmMonitor
    from tests.ui.fake import heartbeat
    from tui.format import eta_seconds

    def snapshot(liar: dict) -> object:
        beats = {peer_id(i): heartbeat(i, 1000.0, 10, rounds=110, last_round_seconds=5.0) for i in range(3)}
        beats[peer_id(3)] = heartbeat(3, 1000.0, 10, **liar)
        return SwarmMonitor().ingest(Reading(1000.0, "r", beats))

    honest = eta_seconds(snapshot(dict(rounds=110, last_round_seconds=5.0)))
    assert honest is not None and honest <= 100 * 5.0
    assert eta_seconds(snapshot(dict(rounds=10**12, last_round_seconds=86400.0))) == honest


def test_the_summary_says_a_peer_refused_the_owners_change() -> None:
    """A peer refused v1 (a value its run cannot take): the summary counted it as applied."""
    import dataclasses

    from swarm.records import ControlState
    from tests.ui.fake import heartbeat
    from tui.widgets import summary_text

    snapshot = FakeSource().snapshots[-1]
    refusing = heartbeat(
        1, snapshot.time, 12, control_version=1, control_refused=1, control_refusal="H=6 [no]"
    )
    others = {p: b.model_copy(update={"control_version": 1}) for p, b in snapshot.peers.items()}
    others[peer_id(1)] = refusing
    said = summary_text(dataclasses.replace(snapshot, peers=others, control=ControlState(version=1)))
    assert "3/4 peers applied v1" in said and "(1 refused: H=6 \\[no])" in said, said


async def test_a_monitor_that_loses_the_dht_says_so_and_keeps_its_last_view() -> None:
    """The monitor's own DHT stopped answering: the board fell back to its last known peers,
    which showed frozen for two minutes and then all "left" (heartbeat expired), with no word
    of the outage (a review, 2026-12-06). Heartbeats here are stamped 127 s old, so the board's
    fallback expires them 3 s into the outage."""
    import types

    from swarm.dht import dht_time
    from swarm.errors import SwarmError
    from swarm.progress import ProgressBoard
    from swarm.records import RunKeys
    from tests.ui.fake import heartbeat
    from workbench.sources import LiveSource

    class Store:
        down = False

        def read(self, key, model):  # type: ignore[no-untyped-def]
            if self.down:
                raise SwarmError(f"a read of {key} timed out after 5 s (the DHT did not answer)")
            if key.endswith("peers"):
                return {f"key{i}": heartbeat(i, dht_time() - 127, 10) for i in range(3)}
            return {}

        def store(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            return True

    class Board(ProgressBoard):
        def peer_id_of(self, public_key):  # type: ignore[no-untyped-def]
            return peer_id(int(public_key[3:]))

        def _keep_in_touch(self, peers):  # type: ignore[no-untyped-def]
            pass

    store, keys = Store(), RunKeys("gone")
    session = types.SimpleNamespace(keys=keys, store=store, board=Board(store, keys), close=lambda: None)
    source = LiveSource(session)
    source.interval = 0.3
    app = SwarmApp(source)
    async with app.run_test(size=(160, 50)) as pilot:
        for _ in range(30):
            await pilot.pause(0.1)
            if app.snapshot is not None and len(app.snapshot.peers) == 3:
                break
        assert app.snapshot is not None and len(app.snapshot.peers) == 3
        store.down = True
        await pilot.pause(4.5)
        assert len(app.snapshot.peers) == 3 and not app.snapshot.departed  # the last view stands
        said = [str(n.message) for n in app._notifications]
        assert any("cannot read the run from the DHT" in m for m in said), said
    source.ended = True


async def test_the_loss_chart_follows_the_tables_filter_and_cursor() -> None:
    """The chart drew the first 8 peers by name whatever the table showed: with 12 peers the
    other 4 had no line, and neither the filter nor the cursor could bring one up."""
    from tui.widgets import CHART_PEERS

    app = SwarmApp(FakeSource(peers=12, steps=4), poll=False)
    async with app.run_test(size=(160, 50)) as pilot:
        await started(app, pilot)
        chart = app.chart
        assert len(chart.shown) == CHART_PEERS == 8
        assert "8 of 12 peers" in chart.heading  # which ones: said
        last = [str(k.value) for k in app.table.rows][-1]
        assert last not in chart.shown
        await pilot.press(*["down"] * 11)  # the cursor on the last row: its peer gets a line
        await pilot.pause()
        assert last in chart.shown and len(chart.shown) == 8
        await pilot.press("slash", *app.snapshot.peers[peer_id(1)].name, "enter")
        await pilot.pause()
        assert chart.shown == [peer_id(1)]


FROZEN = """
import asyncio, gc
from tests.ui.fake import FakeSource
from tui.app import SwarmApp

async def main(freeze):
    app = SwarmApp(FakeSource(peers=4, steps=2), poll=False, clock=False, freeze_startup=freeze)
    async with app.run_test(size=(120, 40)) as pilot:
        before = gc.get_freeze_count()
        for _ in range(2):
            app.show(app.source.poll())
            await pilot.pause()
        print(before, gc.get_freeze_count())

asyncio.run(main(False))
asyncio.run(main(True))
"""


def test_the_monitors_own_process_freezes_its_startup_objects_once_the_first_reading_is_shown() -> None:
    """`workbench monitor` (run_app) freezes what its startup left alive out of the garbage
    collector's full collections (the worst refreshes with 256 peers were theirs); an app among
    others (a test's) does not. In a process of its own: a freeze is for the process's life."""
    import inspect
    import subprocess
    import sys

    import tui.app

    done = subprocess.run([sys.executable, "-c", FROZEN], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    (plain_before, plain_after), (before, after) = [
        map(int, line.split()) for line in done.stdout.splitlines()
    ]
    assert plain_after == plain_before and before == plain_before and after > before + 10_000
    assert "freeze_startup=True" in inspect.getsource(tui.app.run_app)
