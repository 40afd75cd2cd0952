"""What the monitor's readers show is true (a review of the TUI, `status` and the widget, stop 60):
counts that fit their columns, deadlines nobody has learned yet left out of a median, and the
rates of peers training nothing now shown as none and left out of the swarm's total."""

from __future__ import annotations

from typing import Any

import pytest

from swarm.monitor import Reading, SwarmMonitor
from swarm.records import PeerHeartbeat
from tui.format import count, peer_row
from tui.widgets import WIDTHS


def hb(name: str, outer: int, **kw: Any) -> PeerHeartbeat:
    fields = dict(peer_id=f"id-{name}", name=name, stage="training", outer_step=outer, inner_step=1)
    return PeerHeartbeat.model_validate({**fields, "inner_steps": 5, "time": 1.0, **kw})


@pytest.mark.parametrize("width", [4, 5, 9])
def test_a_count_fits_its_column_and_reads_as_the_number(width: int) -> None:
    """ "150k" was cut to "150" in the lag's 3-wide column; 12,345,678 read 12345 in the outer
    step's 5 (thousands were the only unit)."""
    for value in (0, 999, 1000, 9999, 150_000, 999_999, 12_345_678, 2**31, 10**15, 2**63):
        text = count(value, width)
        assert len(text) <= width, (value, text)
        digits, suffix = (text[:-1], text[-1]) if text[-1].isalpha() else (text, "")
        scale = 1000 ** " kMGTPE".index(suffix or " ")
        assert int(digits) * scale <= value < (int(digits) + 1) * scale, (value, text)
    assert count(150_000, 4) == "150k" and count(12_345_678, 5) == "12M"


def test_the_peers_table_cells_fit_their_columns_in_a_long_run() -> None:
    far = hb("a", 12_345_678, inner_step=99_999, inner_steps=100_000, last_round_steps=100_000)
    far = far.model_copy(update={"control_version": 123_456})
    behind = hb("b", 0)
    for p, top in ((far, far.outer_step), (behind, 150_000)):
        cells = peer_row(p, top, WIDTHS)
        for key, width in WIDTHS.items():
            assert len(cells[key]) <= width, (key, cells[key])
    assert peer_row(behind, 150_000, WIDTHS)["lag"] == "150k"


def test_status_takes_the_median_of_the_deadlines_the_peers_learned(capsys) -> None:
    """One peer had learned its deadlines (10 / 1 / 15 s), two had just joined (0: not yet):
    `status` said "the barrier waits 0.0 s" where the TUI said 10 s."""
    from workbench.cli.status import render

    peer = dict(
        stage="training", outer_step=1, inner_step=0, inner_steps=5, loss=None,
        samples_per_second=0.0, bytes_sent=0, device="cpu",
    )  # fmt: skip
    learned = dict(round_wait_seconds=10.0, matchmaking_window_seconds=1.0, averaging_deadline_seconds=15.0)
    peers = [
        {**peer, **learned, "name": "a", "peer_id": "QmA"},
        {**peer, "name": "b", "peer_id": "QmB", "round_wait_seconds": 0.0},
        {**peer, "name": "c", "peer_id": "QmC"},
    ]
    render({"run_id": "r", "outer_round": 1, "peers": peers})
    out = " ".join(capsys.readouterr().out.split())
    assert "the barrier waits 10.0 s for a round mate, matchmaking 1.0 s for the group" in out, out
    assert "averaging gives up after 15.0 s" in out and " 0.0 s" not in out


def test_a_peer_training_nothing_now_shows_no_rate_and_counts_none(capsys) -> None:
    """Three paused peers read 20, 21 and 22 samples/s beside a swarm total of 0; a peer
    downloading again (or finishing) kept its last round's rate in the total."""
    from workbench.cli.status import render

    beats = [
        hb("a", 3, samples_per_second=20.0, tokens_per_second=2560.0),
        hb("b", 3, stage="paused", samples_per_second=21.0, tokens_per_second=2688.0),
        hb("c", 3, stage="downloading", samples_per_second=22.0, tokens_per_second=2816.0),
        hb("d", 3, stage="finishing", samples_per_second=23.0, tokens_per_second=2944.0),
    ]
    snapshot = SwarmMonitor().ingest(Reading(2.0, "r", {b.peer_id: b for b in beats}))
    assert snapshot.samples_per_second == 20.0 and snapshot.tokens_per_second == 2560.0
    assert [peer_row(b, 3, WIDTHS)["speed"] for b in beats] == ["20.0", "-", "-", "-"]
    data = snapshot.to_json()
    assert [p["idle"] for p in data["peers"]] == [False, True, True, True]
    assert [p["samples_per_second"] for p in data["peers"]] == [20.0, 21.0, 22.0, 23.0]  # the record, kept
    render(data)
    rows = [line for line in capsys.readouterr().out.splitlines() if "│" in line and " 3 " in line]
    assert len(rows) == 4 and "20" in rows[0] and not any(v in "".join(rows[1:]) for v in ("21", "22", "23"))
