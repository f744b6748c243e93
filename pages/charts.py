"""Small SVG charts for the dashboard: a bar chart (e.g. runs per minute over
the last hour) and a line chart (e.g. p50 and p95 durations per bucket, with
a gap where a bucket has no data).

Rendered on the server so the dashboard needs no JavaScript or charting
library and works offline; each chart is also described in words (title and
desc) because to a screen reader it is a single image.
"""

import hashlib
import math
import re
from collections.abc import Mapping, Sequence

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

WIDTH = 600
HEIGHT = 200
LEFT = 48  # room for the y-axis labels
RIGHT = 12
TOP = 24  # room for the unit caption and the legend
BOTTOM = 24  # room for the x-axis labels
PLOT_LEFT, PLOT_RIGHT, PLOT_TOP, PLOT_BOTTOM = LEFT, WIDTH - RIGHT, TOP, HEIGHT - BOTTOM
BAR_FILL = 0.8  # share of each slot a bar covers; the rest keeps bars apart
# Default ink for when the page stylesheet is missing: a grey with 4.5:1
# contrast on white and on black. The stylesheet's classes override it.
NEUTRAL = "#767676"
# Without the stylesheet every line is the same grey, so dashes tell them apart.
DASHES = ("", "6 3", "2 3", "8 3 2 3")
LEGEND_CHAR_WIDTH = 6.5  # rough advance of an 11px sans-serif character

# XML 1.0 cannot carry these even as character references.
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")

Number = int | float


def _text(value: object) -> str:
    return escape(_XML_INVALID.sub("\ufffd", str(value)))


def _clean(values: Sequence[Number | None]) -> list[float | None]:
    # NaN or infinity would end up in coordinates; a bucket that produced one
    # has no usable data. Negative counts and durations do not occur, so the
    # axis starts at 0 and a negative value is drawn on the baseline.
    return [None if v is None or not math.isfinite(v) else max(0.0, float(v)) for v in values]


def _check_labels(labels: Sequence[str], count: int, what: str) -> None:
    if len(labels) != count:
        raise ValueError(f"{len(labels)} labels for {count} {what}")


def _number(value: float) -> str:
    if value == int(value):
        return str(int(value))
    if value < 1:  # fixed decimals would round a 0.004 s latency to "0"
        return f"{value:.2g}"
    return f"{value:.{0 if value >= 100 else 1 if value >= 10 else 2}f}".rstrip("0").rstrip(".")


def _with_unit(value: float, unit: str) -> str:
    return f"{_number(value)} {unit}" if unit else _number(value)


def _axis_max(peak: float) -> float:
    """The first round number (1, 1.5, 2, 2.5, 3, 4, 5, 6 or 8 times a power
    of ten) at or above the peak, so the top label is easy to read without
    wasting much height; 1 for an all-zero chart."""
    if peak <= 0:
        return 1.0
    scale = 10 ** math.floor(math.log10(peak))
    # The default only matters if float rounding puts 10 * scale just under the peak.
    return next((step * scale for step in (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10) if step * scale >= peak), peak)


def _y(value: float, axis_max: float) -> float:
    return round(PLOT_BOTTOM - (PLOT_BOTTOM - PLOT_TOP) * value / axis_max, 1)


def _open(kind: str, title: str, desc: str) -> list[str]:
    # Ids come from the content: stable output, and two charts on one page
    # only share an id when they would also share its text.
    key = hashlib.blake2s(f"{title}|{desc}".encode(errors="surrogatepass"), digest_size=4).hexdigest()
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart chart-{kind}" role="img" '
        f'aria-labelledby="chart-{key}-title" aria-describedby="chart-{key}-desc" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" width="100%" font-family="system-ui, sans-serif" font-size="11">',
        f'<title id="chart-{key}-title">{_text(title)}</title>',
        f'<desc id="chart-{key}-desc">{_text(desc)}</desc>',
    ]


def _unit_caption(unit: str) -> str:
    return f'<text class="chart-unit" x="0" y="12">{_text(unit)}</text>' if unit else ""


def _y_max_label(axis_max: float | None) -> str:
    # Without data any top value would be made up, so none is shown.
    if axis_max is None:
        return ""
    x, y = PLOT_LEFT - 4, PLOT_TOP + 4
    return f'<text class="chart-y-max" x="{x}" y="{y}" text-anchor="end">{_number(axis_max)}</text>'


def _axes(axis_max: float | None, unit: str) -> str:
    return (
        '<g class="chart-axis">'
        f'<path d="M{PLOT_LEFT},{PLOT_TOP} V{PLOT_BOTTOM} H{PLOT_RIGHT}" fill="none" stroke="{NEUTRAL}"/>'
        f"{_y_max_label(axis_max)}"
        f'<text class="chart-y-zero" x="{PLOT_LEFT - 4}" y="{PLOT_BOTTOM}" text-anchor="end">0</text>'
        f"{_unit_caption(unit)}"
        "</g>"
    )


def _x_labels(labels: Sequence[str], x_of: Sequence[float]) -> str:
    """First, middle and last label; the ends are anchored inwards so they are
    not clipped at the edges of the chart."""
    if not labels:
        return ""
    last = len(labels) - 1
    if last == 0:
        picks, positions = {0: "middle"}, {}
    else:
        # Listed middle first so that, with two labels, the ends win.
        picks = {last // 2: "middle", 0: "start", last: "end"}
        positions = {0: PLOT_LEFT, last: PLOT_RIGHT}
    return "".join(
        f'<text class="chart-x-label" x="{positions.get(i, x_of[i])}" y="{HEIGHT - 6}" '
        f'text-anchor="{anchor}">{_text(labels[i])}</text>'
        for i, anchor in sorted(picks.items())
    )


def _notice(message: str) -> str:
    # An empty plot looks broken; saying why on the chart itself avoids that.
    x = (PLOT_LEFT + PLOT_RIGHT) // 2
    y = (PLOT_TOP + PLOT_BOTTOM) // 2
    return f'<text class="chart-empty" x="{x}" y="{y}" text-anchor="middle" font-size="14">{_text(message)}</text>'


def _peak(values: Sequence[float | None], labels: Sequence[str]) -> tuple[float, str]:
    # max() keeps the first of equal values: the earliest time it was reached.
    index = max((i for i, v in enumerate(values) if v is not None), key=lambda i: values[i])
    return values[index], labels[index]


def _bar_desc(values: Sequence[float | None], labels: Sequence[str], unit: str) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "no data"
    span = f"{len(values)} values from {labels[0]} to {labels[-1]}"
    missing = len(values) - len(present)
    gaps = f", {missing} without data" if missing else ""
    if not any(present):
        return f"all values are {_with_unit(0, unit)}; {span}{gaps}"
    peak, at = _peak(values, labels)
    return f"max {_with_unit(peak, unit)} at {at}, min {_with_unit(min(present), unit)}; {span}{gaps}"


def _bars(values: Sequence[float | None], labels: Sequence[str], axis_max: float, unit: str, slot: float) -> str:
    width = round(slot * BAR_FILL, 2)
    parts = []
    for i, value in enumerate(values):
        if value is None:  # no bar at all, so a gap reads differently from a zero
            continue
        top = _y(value, axis_max)
        parts.append(
            f'<rect class="chart-bar" x="{round(PLOT_LEFT + slot * i + (slot - width) / 2, 2)}" y="{top}" '
            f'width="{width}" height="{round(PLOT_BOTTOM - top, 1)}" fill="{NEUTRAL}">'
            f"<title>{_text(labels[i])}: {_text(_with_unit(value, unit))}</title></rect>"
        )
    return "".join(parts)


def bar_chart_svg(values: Sequence[Number | None], *, labels: Sequence[str], title: str, unit: str = "") -> SafeString:
    """One bar per value (None: no data, no bar), with ``labels`` naming each
    value, e.g. the minute it counts. Raises ValueError if the lengths differ."""
    _check_labels(labels, len(values), "values")
    cleaned = _clean(values)
    desc = _bar_desc(cleaned, labels, unit)
    present = [v for v in cleaned if v is not None]
    axis_max = _axis_max(max(present, default=0.0))
    slot = (PLOT_RIGHT - PLOT_LEFT) / max(len(values), 1)  # the width each value gets
    parts = _open("bars", title, desc)
    parts.append(_axes(axis_max if present else None, unit))
    parts.append(_x_labels(labels, [PLOT_LEFT + slot * (i + 0.5) for i in range(len(values))]))
    if present:
        parts.append(_bars(cleaned, labels, axis_max, unit, slot))
    if not any(present):
        parts.append(_notice("No data" if not present else f"All values {_with_unit(0, unit)}"))
    parts.append("</svg>")
    return mark_safe("".join(parts))


def _series_desc(name: str, values: Sequence[float | None], labels: Sequence[str], unit: str) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return f"{name}: no data"
    if not any(present):
        return f"{name}: all {_with_unit(0, unit)}"
    peak, at = _peak(values, labels)
    missing = len(values) - len(present)
    gaps = f" ({missing} of {len(values)} without data)" if missing else ""
    return f"{name}: max {_with_unit(peak, unit)} at {at}, latest {_with_unit(present[-1], unit)}{gaps}"


def _line_desc(series: Mapping[str, Sequence[float | None]], labels: Sequence[str], unit: str) -> str:
    if not any(v is not None for values in series.values() for v in values):
        return "no data"
    span = f"{len(labels)} points from {labels[0]} to {labels[-1]}"
    return "; ".join(_series_desc(name, values, labels, unit) for name, values in series.items()) + f"; {span}"


def _dash(index: int) -> str:
    dash = DASHES[index % len(DASHES)]
    return f' stroke-dasharray="{dash}"' if dash else ""


def _runs_of_points(values: Sequence[float | None]) -> list[list[int]]:
    """Indices of the unbroken stretches of data between gaps."""
    runs: list[list[int]] = []
    for i, value in enumerate(values):
        if value is None:
            continue
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _line(index: int, values: Sequence[float | None], x_of: Sequence[float], axis_max: float) -> str:
    """One path per series, restarted (a new M) after each gap. A point with
    no neighbour would be an invisible zero-length stroke, so it is a dot."""
    segments, dots = [], []
    for run in _runs_of_points(values):
        points = [(round(x_of[i], 1), _y(values[i], axis_max)) for i in run]
        if len(points) == 1:
            dots.append(
                f'<circle class="chart-point chart-point-{index}" cx="{points[0][0]}" cy="{points[0][1]}" '
                f'r="2.5" fill="{NEUTRAL}"/>'
            )
        else:
            segments.append("M" + " L".join(f"{x},{y}" for x, y in points))
    path = (
        f'<path class="chart-line chart-line-{index}" d="{" ".join(segments)}" fill="none" stroke="{NEUTRAL}" '
        f'stroke-width="2"{_dash(index)}/>'
        if segments
        else ""
    )
    return path + "".join(dots)


def _legend(names: Sequence[str]) -> str:
    """Right-aligned in the top margin; widths are estimated, there being no
    text metrics on the server."""
    entries = []
    x = float(PLOT_RIGHT)
    for index in reversed(range(len(names))):
        x -= 20 + LEGEND_CHAR_WIDTH * len(names[index])
        entries.append(
            f'<path class="chart-legend-swatch chart-line-{index}" d="M{round(x, 1)},8 h14" fill="none" '
            f'stroke="{NEUTRAL}" stroke-width="2"{_dash(index)}/>'
            f'<text class="chart-legend-label" x="{round(x + 17, 1)}" y="12">{_text(names[index])}</text>'
        )
        x -= 8
    return '<g class="chart-legend">' + "".join(reversed(entries)) + "</g>"


def line_chart_svg(
    series: Mapping[str, Sequence[Number | None]], *, labels: Sequence[str], title: str, unit: str = ""
) -> SafeString:
    """One line per named series over the shared ``labels`` (None: no data, a
    gap in that line). Raises ValueError if a series' length differs from the
    labels'."""
    for name, values in series.items():
        _check_labels(labels, len(values), f"points in series {name!r}")
    cleaned = {str(name): _clean(values) for name, values in series.items()}
    desc = _line_desc(cleaned, labels, unit)
    present = [v for values in cleaned.values() for v in values if v is not None]
    axis_max = _axis_max(max(present, default=0.0))
    step = (PLOT_RIGHT - PLOT_LEFT) / max(len(labels) - 1, 1)
    # A single point sits in the middle rather than against the y axis.
    x_of = [PLOT_LEFT + step * i for i in range(len(labels))] if len(labels) > 1 else [(PLOT_LEFT + PLOT_RIGHT) / 2]
    parts = _open("lines", title, desc)
    parts.append(_axes(axis_max if present else None, unit))
    parts.append(_x_labels(labels, x_of))
    if cleaned:
        parts.append(_legend(list(cleaned)))
    parts.extend(_line(index, values, x_of, axis_max) for index, values in enumerate(cleaned.values()))
    if not any(present):
        parts.append(_notice("No data" if not present else f"All values {_with_unit(0, unit)}"))
    parts.append("</svg>")
    return mark_safe("".join(parts))
