"""The TUI's braille line chart (tui.chart): what it draws, and that no size or data breaks it."""

from __future__ import annotations

import math

import pytest
from rich.cells import cell_len

from tui import chart


def rows(text) -> list[str]:
    return text.plain.split("\n")


def test_a_rising_line_goes_from_the_bottom_left_to_the_top_right_with_round_ticks() -> None:
    line = chart.Line("alpha", [(-100.0 + k, k / 100) for k in range(101)], "red")
    text = chart.render([line], 40, 20, title="loss", xlabel="seconds ago", absolute_x=True)
    lines = rows(text)
    assert len(lines) == 20 and all(cell_len(r) <= 40 for r in lines)
    assert lines[0].strip() == "loss" and lines[-1].strip() == "seconds ago"
    plot = [r[min(i for i in (r.find("│"), r.find("┤")) if i >= 0) + 1 : r.rfind("│")] for r in lines[2:-3]]
    assert len({len(p) for p in plot}) == 1  # a frame as wide on every row
    assert plot[0].rstrip()[-1] != " " and plot[-1][0] != " "  # (0 s ago, 1.0) and (100 s ago, 0.0)
    assert plot[0].startswith("▄▄ alpha")  # the legend, top left
    labels = [r.split("┤")[0].strip() for r in lines[2:-3] if "┤" in r]
    assert labels[0] == "1.0" and labels[-1] == "0.0" and len(labels) >= 3
    ticks = lines[-2].split()
    assert ticks[0] == "100" and ticks[-1] == "0"  # seconds ago, not -100
    assert any(span.style == "red" for span in text.spans)


def test_any_size_and_any_data_draws_within_its_box() -> None:
    data = [
        [],
        [chart.Line("one point", [(0.0, 3.0)])],
        [chart.Line("flat", [(-5.0, 2.0), (0.0, 2.0)])],
        [chart.Line("nan", [(-2.0, math.nan), (-1.0, 1.0), (0.0, math.inf)])],
        [chart.Line("narrow", [(-1.0, 2.61), (0.0, 2.64)]), chart.Line("huge", [(-1e9, 1e30), (0.0, -1e30)])],
        [chart.Line(f"peer-{k}", [(-60.0 + t, 3 - t / 50 + k / 100) for t in range(61)]) for k in range(9)],
        # A review (stop 68): a flat 1e17 (padding of ±0.5 lost in it) divided by zero and
        # crashed the monitor; -1e308 beside 1e308 overflowed; a CJK name widened its row.
        [chart.Line("flat-huge", [(-3.0, 1e17), (0.0, 1e17)])],
        [chart.Line("extremes", [(-1e308, -1e308), (1e308, 1e308)])],
        [
            chart.Line("tiny", [(-1.0, 1e-300), (0.0, 2e-300)]),
            chart.Line("finer", [(0.0, 2.0), (1e-9, 2.0 + 1e-9)]),
        ],
        [chart.Line("学習ノード東京第一", [(-1.0, 1.0), (0.0, 2.0)])],
    ]
    for lines in data:
        for width in (0, 1, 5, 16, 17, 30, 64, 97):
            for height in (0, 1, 2, 5, 6, 7, 12, 41):
                for until in (None, 0.0):
                    text = chart.render(
                        lines,
                        width,
                        height,
                        title="loss (window 2m00s, +/-)",
                        xlabel="seconds ago",
                        x_until=until,
                    )
                    drawn = rows(text)
                    assert len(drawn) <= max(height, 1), (width, height, drawn)
                    assert all(cell_len(r) <= max(width, 0) for r in drawn), (width, height, drawn)


def test_a_tick_sits_on_the_row_its_value_is_drawn_on() -> None:
    """A review (stop 68): ticks were placed on a rows - 1 scale and dots on 4 * rows - 1, so a
    flat line at a tick's value was drawn a row away from its label in 91 of 870 cases."""
    for height in range(7, 30):
        for top in (1.3, 2.0, 3.7, 10.0):
            ticks = chart.nice_ticks(0.0, top, max(2, min(6, (height - 5) // 3 + 1)))
            for value in ticks:
                lines = [
                    chart.Line("edges", [(0.0, 0.0), (1.0, top)]),
                    chart.Line("at", [(0.0, value), (1.0, value)]),
                ]
                drawn = rows(chart.render(lines, 40, height))[2:-3]
                label = chart.tick_label(value, min(b - a for a, b in zip(ticks, ticks[1:])))
                row = next(r for r in drawn if "┤" in r and r.split("┤")[0].strip() == label)
                assert row.rstrip().rstrip("│")[-1] != " ", (height, top, value, drawn)  # the flat line's end


def test_the_first_reading_of_a_chart_of_the_past_shows_no_future() -> None:
    """A review (stop 68): one instant was widened both ways, so the first reading's axis read
    "1.0 0.5 0.0 0.5 1.0 seconds ago" with the data in the middle."""
    text = chart.render([chart.Line("a", [(0.0, 2.0)])], 60, 12, x_until=0.0)  # a heartbeat of now
    assert all(float(tick) <= 0 for tick in rows(text)[-2].split())


def test_round_ticks() -> None:
    assert chart.nice_ticks(0, 1, 6) == [0, 0.2, 0.4, 0.6000000000000001, 0.8, 1.0]
    assert chart.nice_ticks(2.6, 3.9, 6) == [2.75, 3.0, 3.25, 3.5, 3.75]  # the finest that fit
    assert chart.nice_ticks(2.61, 2.64, 2) == pytest.approx([2.62, 2.64])
    assert chart.nice_ticks(2.611, 2.619, 2) == [2.611, 2.619]  # none fits: the ends
    assert [chart.tick_label(v, 0.5) for v in (-0.0, -0.01, 2.5)] == ["0.0", "0.0", "2.5"]
    assert [chart.tick_label(v, 0.25) for v in (2.75, 3.0)] == ["2.75", "3.00"]
    assert chart.tick_label(-100, 20) == "-100" and chart.tick_label(0.6000000000000001, 0.2) == "0.6"


def test_a_chart_of_the_past_ends_at_now() -> None:
    line = chart.Line("a", [(-50.3, 1.0), (-0.4, 2.0)])
    ticks = rows(chart.render([line], 50, 12, absolute_x=True, x_until=0.0))[-2].split()
    assert ticks[-1] == "0"  # the last heartbeat came 0.4 s ago: the axis still ends at now
    assert rows(chart.render([line], 50, 12, absolute_x=True))[-2].split()[-1] != "0"
