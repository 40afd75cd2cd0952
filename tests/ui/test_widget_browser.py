"""The widget's JS in a real headless browser (Debian's chromium through Playwright; never a
downloaded browser): it renders the peers, and a click reaches the Python widget.

The page loads the packaged widget.js with a minimal anywidget model whose state lives in the
Python SwarmWidget of this test: reads and save_changes() go through functions the test
exposes to the page, i.e. the same set_state path Jupyter's comm messages take.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ui.fake import FakeSource, peer_id
from workbench.notebook.widget import SwarmWidget

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium); never a downloaded browser"
)

SYNCED = ("title", "snapshot", "loss_series", "steer_reason", "message", "command")

PAGE = """<!doctype html><html><body><div id="root"></div><script type="module">
import widget from "/widget.js";
const state = JSON.parse(await window.pyGetState());
const handlers = {};
const model = {
  get: (key) => state[key],
  set: (key, value) => { state[key] = value; },
  on: (event, callback) => { (handlers[event] ||= []).push(callback); },
  save_changes: async () => {
    const fresh = JSON.parse(await window.pySetState(JSON.stringify({ command: state.command })));
    for (const [key, value] of Object.entries(fresh)) {
      state[key] = value;
      (handlers["change:" + key] || []).forEach((callback) => callback());
    }
  },
};
// A reading, as the widget's poll thread makes it: every synced trait that changed is sent.
window.reading = async () => {
  const fresh = JSON.parse(await window.pyGetState());
  for (const [key, value] of Object.entries(fresh)) {
    if (JSON.stringify(state[key]) === JSON.stringify(value)) continue;
    state[key] = value;
    (handlers["change:" + key] || []).forEach((callback) => callback());
  }
};
widget.render({ model, el: document.getElementById("root") });
window.rendered = true;
</script></body></html>"""


def _page(source: FakeSource):
    """The widget over ``source``'s last snapshot."""
    source.position = len(source.snapshots) - 1
    return SwarmWidget(source, autostart=False)


@contextlib.contextmanager
def _opened(widget: SwarmWidget) -> Iterator[tuple[Any, list[str]]]:
    """(a browser page showing ``widget`` through the packaged widget.js, the page's errors)."""
    from playwright.sync_api import sync_playwright

    script = Path(__file__).parents[2] / "workbench" / "notebook" / "widget.js"

    def state() -> str:
        return json.dumps({k: v for k, v in widget.get_state().items() if k in SYNCED})

    def set_state(changes: str) -> str:
        widget.set_state(json.loads(changes))
        return state()

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.expose_function("pyGetState", state)
            page.expose_function("pySetState", set_state)
            page.route(
                "http://widget.test/widget.js",
                lambda route: route.fulfill(body=script.read_text(), content_type="text/javascript"),
            )
            page.route(
                "http://widget.test/", lambda route: route.fulfill(body=PAGE, content_type="text/html")
            )
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto("http://widget.test/")
            page.wait_for_function("window.rendered === true", timeout=10_000)
            yield page, errors
        finally:
            browser.close()


def test_the_widget_shows_downloads_and_the_peers_that_left() -> None:
    with _opened(_page(FakeSource(peers=6, leavers=3))) as (page, _):
        stages = page.locator("table.swb-peers tr[data-peer] td.stage").all_inner_texts()
        assert "download 37%" in stages, stages
        gone = page.locator("table.swb-peers tr.swb-departed td.stage").all_inner_texts()
        assert len(gone) == 3 and sum("(killed from the monitor)" in g for g in gone) == 1, gone


def test_the_widget_renders_peers_and_a_click_reaches_python() -> None:
    source = FakeSource()
    with _opened(_page(source)) as (page, errors):
        names = page.locator("table.swb-peers tr[data-peer] td:first-child").all_inner_texts()
        assert names == ["alpha", "bravo", "charlie", "delta"], errors
        assert page.locator("svg.swb-chart polyline").count() == 4

        page.locator("tr[data-peer] >> nth=1").locator("button.swb-pause").click()
        page.wait_for_function(
            "document.querySelector('.swb-message').textContent.startsWith('published')", timeout=10_000
        )
        assert source.published == [{"pause": [peer_id(1)]}]

        page.fill("input.swb-lr", "0.45")
        page.click("button.swb-steer")
        page.wait_for_function(
            "document.querySelector('.swb-message').textContent.includes('v2')", timeout=10_000
        )
        assert source.published[-1] == {"outer_lr": 0.45}
        assert not errors, errors


def test_what_the_user_types_survives_the_readings_and_a_bad_h_is_not_sent() -> None:
    """The widget drew itself anew at every reading (once a second on a live run), steering form
    included: what the user typed was gone before Steer was clicked. And parseInt sent H=2 for
    "2.5". A diverged run's NaN loss (sent as "nan") left the widget blank (toFixed threw)."""
    source = FakeSource()
    source.position = 2  # a reading from the middle of the run: the next ones differ
    widget = SwarmWidget(source, autostart=False)
    with _opened(widget) as (page, errors):
        page.fill("input.swb-lr", "0.45")
        page.fill("input.swb-h", "2.5")
        page.focus("input.swb-h")
        for _ in range(3):
            widget.refresh()
            page.evaluate("window.reading()")
        assert page.locator("table.swb-peers tr[data-peer]").count() == 4  # the view did move on
        assert page.input_value("input.swb-lr") == "0.45" and page.input_value("input.swb-h") == "2.5"
        assert page.evaluate("document.activeElement.className") == "swb-h"
        page.click("button.swb-steer")
        assert page.inner_text(".swb-message") == "H must be a whole number, not 2.5"
        assert source.published == []
        page.fill("input.swb-h", "1e3")  # what a number box takes: H = 1000, not 1
        page.click("button.swb-steer")
        page.wait_for_function(
            "document.querySelector('.swb-message').textContent.includes('v1')", timeout=10_000
        )
        assert source.published == [{"outer_lr": 0.45, "inner_steps": 1000}]
        snapshot = dict(widget.snapshot, mean_loss="nan")
        snapshot["peers"] = [dict(p, loss="nan") for p in widget.snapshot["peers"]]
        widget.snapshot = snapshot
        page.evaluate("window.reading()")
        assert page.inner_text(".swb-summary").count("nan") == 1
        assert not errors, errors
