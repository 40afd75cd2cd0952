"""Braille line charts drawn straight into Rich text: a title, a framed plot with the y axis's
ticks on its left and the x axis's below it, a legend in the plot's top-left corner.

Each character cell holds 2 x 4 braille dots, so a 64 x 41 cell chart draws 128 x 148 dots.
Built for the TUI's loss chart, where plotext cost about 35 ms a refresh at any size (25 ms to
build its figure, 10 ms for Rich to decode the ANSI text it returns) and this costs a few
milliseconds: docs/performance.md, "The TUI's refresh with 256 peers".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rich.cells import cell_len
from rich.text import Text

# The bit of each dot in a braille cell (U+2800 + bits), by [row][column].
_DOT = ((0x01, 0x08), (0x02, 0x10), (0x04, 0x20), (0x40, 0x80))
FRAME = "dim"
LEGEND_MARK = "▄▄"
LIMIT = 1e150
"""Values beyond ±LIMIT are drawn at it: spans of any two values stay finite (a loss of -1e308
beside 1e308 overflowed), and so do ticks and positions."""


@dataclass(frozen=True)
class Line:
    label: str
    points: Sequence[tuple[float, float]]
    """(x, y) in x order; non-finite values are left out."""
    style: str = ""


def nice_ticks(low: float, high: float, most: int) -> list[float]:
    """Round values (1, 2, 2.5 or 5 times a power of ten apart) within [low, high], as many as
    fit in ``most``."""
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low or most < 2:
        return [low] if math.isfinite(low) else []
    power = 10 ** math.floor(math.log10((high - low) / (most - 1)))
    ticks: list[float] = []
    for step in sorted(m * power * scale for m in (1, 2, 2.5, 5) for scale in (0.1, 1, 10, 100)):
        first, last = math.ceil(low / step - 1e-9), math.floor(high / step + 1e-9)
        if last - first + 1 <= most:  # the finest round step that gives at most ``most``
            ticks = [k * step for k in range(first, last + 1)] if last > first else []
            break
    return ticks if ticks else [low, high]  # fewer than two round values fit: the ends


def tick_label(value: float, step: float) -> str:
    """``value`` with as many decimals as the ticks' spacing needs (no "-0"); in scientific
    notation, with the digits that tell ticks apart, for large values or fine steps."""
    if not (step > 0 and math.isfinite(step)):
        return f"{value:.6g}"
    if step >= 1e-4 and abs(value) < 1e6:
        decimals = next((d for d in range(7) if abs(step * 10**d - round(step * 10**d)) < 1e-6 * 10**d), 6)
        text = f"{value:.{decimals}f}"
    else:
        digits = min(12, max(1, math.ceil(math.log10(max(abs(value), step) / step)) + 1))
        text = f"{value:.{digits}g}"
    return text.lstrip("-") if float(text) == 0 else text


def fit(text: str, width: int) -> str:
    """``text`` cut to ``width`` terminal cells (a CJK character takes two)."""
    if cell_len(text) <= width:
        return text
    out, used = [], 0
    for char in text:
        used += cell_len(char)
        if used > width:
            break
        out.append(char)
    return "".join(out)


def centered(text: str, width: int) -> str:
    text = fit(text, max(width, 0))
    left = (width - cell_len(text)) // 2
    return " " * left + text + " " * (width - left - cell_len(text))


def render(
    lines: Sequence[Line],
    width: int,
    height: int,
    *,
    title: str = "",
    xlabel: str = "",
    absolute_x: bool = False,
    x_until: float | None = None,
) -> Text:
    """The chart of ``lines`` in ``width`` x ``height`` cells: x labels as given, or as their
    absolute values with ``absolute_x`` (seconds ago); the x axis from the first point to the
    last, or to ``x_until`` if that is further (now, on a chart of the past)."""
    out = Text(no_wrap=True, overflow="crop")
    out.append(centered(title, width), style="bold")
    points = [
        [
            (min(max(x, -LIMIT), LIMIT), min(max(y, -LIMIT), LIMIT))
            for x, y in line.points
            if math.isfinite(x) and math.isfinite(y)
        ]
        for line in lines
    ]
    xs = [x for series in points for x, _ in series]
    ys = [y for series in points for _, y in series]
    rows = height - 5  # title, frame top and bottom, x ticks, x label
    if rows < 2 or width < 16 or not xs:
        if not xs and height > 1:
            out.append("\n" + centered("no data yet", width), style=FRAME)
        return out
    until = x_until if x_until is not None and math.isfinite(x_until) else None
    x_low, x_high = min(xs), max(xs) if until is None else max(*xs, min(max(until, -LIMIT), LIMIT))
    y_low, y_high = min(ys), max(ys)
    if y_high - y_low <= 1e-9 * max(abs(y_low), abs(y_high)) or y_high == y_low:  # flat: a band round it
        pad = max(0.5, 1e-3 * abs(y_high))
        y_low, y_high = y_low - pad, y_high + pad
    if x_high - x_low <= 1e-9 * max(abs(x_low), abs(x_high)) or x_high == x_low:
        pad = max(1.0, 1e-3 * abs(x_high))
        # One instant: on a chart that ends at ``x_until`` (now), widened into the past only.
        x_low, x_high = (x_low - pad, x_high) if until is not None else (x_low - pad, x_high + pad)
    y_ticks = nice_ticks(y_low, y_high, max(2, min(6, rows // 3 + 1)))
    y_step = min(b - a for a, b in zip(y_ticks, y_ticks[1:])) if len(y_ticks) > 1 else y_high - y_low
    y_labels = [tick_label(v, y_step) for v in y_ticks]
    gutter = max((len(label) for label in y_labels), default=1) + 1
    columns = width - gutter - 1
    if columns < 4:
        return out
    cells = [[0] * columns for _ in range(rows)]
    styles: list[list[str | None]] = [[None] * columns for _ in range(rows)]
    dots_x, dots_y = 2 * columns - 1, 4 * rows - 1

    def place_x(x: float) -> int:  # the dot column of x (its character: // 2)
        return min(max(round((x - x_low) / (x_high - x_low) * dots_x), 0), dots_x)

    def place_y(y: float) -> int:  # the dot row of y, from the top (its character: // 4)
        return min(max(round((y_high - y) / (y_high - y_low) * dots_y), 0), dots_y)

    def dot(px: int, py: int, style: str) -> None:
        row, column = py // 4, px // 2
        cells[row][column] |= _DOT[py % 4][px % 2]
        styles[row][column] = style

    for line, series in zip(lines, points):
        last = None
        for x, y in series:
            px, py = place_x(x), place_y(y)
            if last is None:
                dot(px, py, line.style)
            else:
                steps = max(abs(px - last[0]), abs(py - last[1]), 1)
                for k in range(1, steps + 1):
                    dot(
                        last[0] + round((px - last[0]) * k / steps),
                        last[1] + round((py - last[1]) * k / steps),
                        line.style,
                    )
            last = (px, py)

    # A tick on the row where a line at its value is drawn (a rows - 1 scale put 1 in 10 a row off).
    label_at = {place_y(v) // 4: label for v, label in zip(y_ticks, y_labels)}
    legend = [line for line, series in zip(lines, points) if series][:rows]
    out.append("\n" + " " * (gutter - 1) + "┌" + "─" * columns + "┐", style=FRAME)
    for row in range(rows):
        out.append("\n")
        label = label_at.get(row)
        out.append((label or "").rjust(gutter - 1) + ("┤" if label is not None else "│"), style=FRAME)
        start = 0
        if row < len(legend):
            entry = fit(f"{LEGEND_MARK} {legend[row].label}", max(0, columns - 1))
            out.append(LEGEND_MARK[: len(entry)], style=legend[row].style)
            out.append(entry[len(LEGEND_MARK) :])
            start = cell_len(entry)
        run, run_style = [], None
        for column in range(start, columns):
            bits, style = cells[row][column], styles[row][column]
            style = style if bits else None
            if style != run_style and run:
                out.append("".join(run), style=run_style or "")
                run = []
            run_style = style
            run.append(chr(0x2800 + bits) if bits else " ")
        if run:
            out.append("".join(run), style=run_style or "")
        out.append("│", style=FRAME)
    x_ticks = nice_ticks(x_low, x_high, max(2, min(10, columns // 8)))  # a label every 8 columns at most
    x_step = min(b - a for a, b in zip(x_ticks, x_ticks[1:])) if len(x_ticks) > 1 else x_high - x_low
    places = {place_x(v) // 2: v for v in x_ticks}
    bottom = "".join("┬" if c in places else "─" for c in range(columns))
    out.append("\n" + " " * (gutter - 1) + "└" + bottom + "┘", style=FRAME)
    under = [" "] * (width + 1)
    taken = -1
    for column, value in sorted(places.items()):
        label = tick_label(abs(value) if absolute_x else value, x_step)
        at = min(max(gutter + column - len(label) // 2, taken + 2), width - len(label))
        if at <= taken:
            continue
        under[at : at + len(label)] = label
        taken = at + len(label) - 1
    out.append("\n" + "".join(under[:width]), style=FRAME)
    out.append("\n" + centered(xlabel, width))
    return out
