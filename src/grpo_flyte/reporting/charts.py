"""This module draws inline SVG line charts of metrics by iteration: scales, axes, series, 95% bands, the guard's markers and legends.

A chart of the run report (`chart`) or one metric of several runs overlaid (`overlay_chart`, a
sweep's comparison); every label and tooltip is escaped, and the SVG scales to its container.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from grpo_flyte.reporting.html import escape, finite

# A series drawn with a shaded 95% interval: the key holding the interval's half-width.
_BANDS = {"eval_reward": "eval_reward_ci95", "eval_accuracy": "eval_accuracy_ci95", "eval_tool_call_rate": "eval_tool_call_rate_ci95"}
# A series whose rows carry its interval's bounds (a proportion's, loop.metrics.wilson_interval):
# drawn from them where a row has them, from the half-width above in older rows.
_BOUNDS = {"eval_accuracy": ("eval_accuracy_lo", "eval_accuracy_hi")}
# A proportion's band never leaves [0, 1], whatever the half-width of an older row says.
_RANGES = {"eval_accuracy": (0.0, 1.0), "eval_tool_call_rate": (0.0, 1.0)}

# The guard's events (grpo_flyte.loop.guard) marked on every chart: a dashed vertical line at the
# iteration, labelled, the reason as its tooltip; the best adapter's iteration on the held-out chart.
# The marker colours are no series colour (a series is found by its colour in the browser test).
_GUARD_MARKERS = {"collapse": "collapse", "rollback": "rollback", "stop": "stop", "early_stop": "early stop"}
_MARKER_COLOUR = "#bf3989"
_BEST_COLOUR = "#9a6700"

_SERIES_COLOURS = ("#0969da", "#d4620a", "#1a7f37", "#8250df", "#cf222e", "#6e7781")

# Chart geometry in SVG user units; the SVG scales to its container width.
_W, _H = 640, 260
_LEFT, _RIGHT, _TOP, _BOTTOM = 60, 16, 14, 40
_MAX_X_TICKS = 10


def _tick_label(value: float) -> str:
    if float(value).is_integer() and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.3g}"


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round axis values covering [lo, hi]: multiples of 1, 2 or 5 x 10^k, about `count` of them,
    the first at or below lo and the last at or above hi."""
    if not hi > lo:
        raise ValueError(f"an empty range [{lo}, {hi}]")
    rough = (hi - lo) / max(1, count - 1)
    magnitude = 10 ** math.floor(math.log10(rough))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= rough)
    first = math.floor(lo / step + 1e-9) * step
    n = math.ceil((hi - first) / step - 1e-9)
    # round() drops the float noise of k * step (0.30000000000000004 -> 0.3)
    digits = max(0, -math.floor(math.log10(step)) + 1)
    return [round(first + k * step, digits) for k in range(n + 1)]


def _points(history: Sequence[Mapping], key: str) -> list[tuple[float, float]]:
    """(iteration, value) pairs, skipping missing and non-finite values."""
    points = []
    for position, row in enumerate(history, start=1):
        y = finite(row.get(key))
        if y is None:
            continue
        x = finite(row.get("iteration"))
        points.append((x if x is not None else float(position), y))
    return points


def _span(values: Sequence[float], headroom: float) -> tuple[float, float]:
    """A non-empty range covering the values, so scaling never divides by zero."""
    lo, hi = min(values), max(values)
    if hi - lo <= 0 or not math.isfinite(hi - lo):
        pad = abs(lo) * 0.1 or 1.0
        return lo - pad, hi + pad
    pad = (hi - lo) * headroom
    return lo - pad, hi + pad


class _Scale:
    """Maps data coordinates onto the plot area of the SVG."""

    def __init__(self, xs: Sequence[float], ys: Sequence[float]) -> None:
        self.x0, self.x1 = _span(xs, 0.03)
        self.y_ticks = nice_ticks(*_span(ys, 0.0))
        self.y0, self.y1 = self.y_ticks[0], self.y_ticks[-1]
        self.width = _W - _LEFT - _RIGHT
        self.height = _H - _TOP - _BOTTOM

    def x(self, value: float) -> float:
        return _LEFT + (value - self.x0) / (self.x1 - self.x0) * self.width

    def y(self, value: float) -> float:
        return _TOP + (self.y1 - value) / (self.y1 - self.y0) * self.height


def _axes(scale: _Scale, xs: Sequence[float]) -> str:
    bottom, right = _H - _BOTTOM, _W - _RIGHT
    parts = []
    for value in scale.y_ticks:
        y = scale.y(value)
        parts.append(f'<line class="grid" x1="{_LEFT}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}"/>')
        parts.append(f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_tick_label(value)}</text>')
    ticks = sorted(set(xs))
    step = max(1, math.ceil(len(ticks) / _MAX_X_TICKS))
    for value in ticks[::step]:
        x = scale.x(value)
        parts.append(f'<line class="axis" x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 4}"/>')
        parts.append(f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{_tick_label(value)}</text>')
    parts.append(f'<line class="axis" x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{bottom}"/>')
    parts.append(f'<line class="axis" x1="{_LEFT}" y1="{bottom}" x2="{right}" y2="{bottom}"/>')
    parts.append(f'<text x="{_LEFT + scale.width / 2:.1f}" y="{_H - 6}" text-anchor="middle">iteration</text>')
    return "".join(parts)


def _band(history: Sequence[Mapping], key: str) -> list[tuple[float, float, float]]:
    """(iteration, low, high) of `key`'s 95% interval on the rows that carry a finite one: its bounds
    where the rows have them (_BOUNDS), else the value +- its half-width, inside the metric's range."""
    if key not in _BANDS:
        return []
    band = []
    for position, row in enumerate(history, start=1):
        y, half = finite(row.get(key)), finite(row.get(_BANDS[key]))
        lo_key, hi_key = _BOUNDS.get(key, ("", ""))
        lo, hi = finite(row.get(lo_key)), finite(row.get(hi_key))
        if lo is None or hi is None:
            if y is None or half is None:
                continue
            lo, hi = y - half, y + half
        floor, ceiling = _RANGES.get(key, (-math.inf, math.inf))
        x = finite(row.get("iteration"))
        band.append((x if x is not None else float(position), max(lo, floor), min(hi, ceiling)))
    return band


def _band_svg(band: Sequence[tuple[float, float, float]], colour: str, scale: _Scale) -> str:
    if len(band) < 2:
        return ""
    upper = [f"{scale.x(x):.1f},{scale.y(hi):.1f}" for x, _, hi in band]
    lower = [f"{scale.x(x):.1f},{scale.y(lo):.1f}" for x, lo, _ in reversed(band)]
    return f'<polygon class="band" fill="{colour}" fill-opacity="0.15" stroke="none" points="{" ".join(upper + lower)}"/>'


def _series_svg(key: str, points: Sequence[tuple[float, float]], colour: str, scale: _Scale) -> str:
    coords = [(scale.x(x), scale.y(y)) for x, y in points]
    parts = []
    # A one-point polyline draws nothing; the circle below keeps the point visible.
    if len(coords) > 1:
        joined = " ".join(f"{cx:.1f},{cy:.1f}" for cx, cy in coords)
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{joined}"/>')
    for (x, y), (cx, cy) in zip(points, coords, strict=True):
        tip = f"{escape(key)}, iteration {_tick_label(x)}: {y:.4g}"
        parts.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3" fill="{colour}"><title>{tip}</title></circle>')
    return "".join(parts)


def _guard_marks(history: Sequence[Mapping], best: bool) -> list[tuple[float, str, str, str, str]]:
    """(iteration, label, class, colour, tooltip) of the guard's events (and, with `best`, the best
    adapter's iteration)."""
    marks = [
        (x, _GUARD_MARKERS[str(row["guard_event"])], str(row["guard_event"]), _MARKER_COLOUR, str(row.get("guard_reason", "")))
        for row in history
        if row.get("guard_event") in _GUARD_MARKERS and (x := finite(row.get("iteration"))) is not None
    ]
    iteration = next((finite(row.get("best_iteration")) for row in reversed(history) if row.get("best_iteration") is not None), None)
    if best and iteration is not None:
        marks.append((iteration, "best", "best", _BEST_COLOUR, f"the best adapter so far: iteration {_tick_label(iteration)}"))
    return marks


def _markers_svg(marks: Sequence[tuple[float, str, str, str, str]], scale: _Scale) -> str:
    """The marks as labelled dashed vertical lines, the tooltip on each."""
    parts = []
    for x, label, css, colour, tip in marks:
        cx, bottom = scale.x(x), _H - _BOTTOM
        parts.append(
            f'<g class="guard-marker {escape(css)}"><title>{escape(tip)}</title>'
            f'<line x1="{cx:.1f}" y1="{_TOP}" x2="{cx:.1f}" y2="{bottom}" stroke="{colour}" stroke-width="1.5" stroke-dasharray="4 3"/>'
            f'<text x="{cx + 3:.1f}" y="{_TOP + 10}" style="fill:{colour}">{escape(label)}</text></g>'
        )
    return "".join(parts)


def _legend(keys: Sequence[str]) -> str:
    items = "".join(
        f'<li><span class="swatch" style="background:{_SERIES_COLOURS[i % len(_SERIES_COLOURS)]}"></span>{escape(key)}</li>'
        for i, key in enumerate(keys)
    )
    return f'<ul class="legend">{items}</ul>'


def has_key(history: Sequence[Mapping], key: str) -> bool:
    """Whether any row carries `key` (a chart of keys no row carries is not drawn)."""
    return any(row.get(key) is not None for row in history)


def chart(title: str, keys: Sequence[str], history: Sequence[Mapping], best: bool = False) -> str:
    """A titled figure of `keys` by iteration (a series each, with its 95% band where the rows have
    one), the guard's events marked and, with `best`, the best adapter's iteration."""
    keys = [key for key in keys if has_key(history, key)]
    series = [(key, _points(history, key)) for key in keys]
    bands = {key: _band(history, key) for key in keys}
    points = [point for _, pts in series for point in pts]
    band_ys = [y for band in bands.values() for _, lo, hi in band for y in (lo, hi)]
    marks = _guard_marks(history, best)
    # With nothing finite to plot, still draw empty axes rather than fail; the guard's marks widen the x-axis to them.
    scale = _Scale([x for x, _ in points] + [m[0] for m in marks] or [1.0], [y for _, y in points] + band_ys or [0.0, 1.0])
    colours = {key: _SERIES_COLOURS[i % len(_SERIES_COLOURS)] for i, key in enumerate(keys)}
    body = "".join(_band_svg(bands[key], colours[key], scale) for key in keys)
    body += _markers_svg(marks, scale)
    body += "".join(_series_svg(key, pts, colours[key], scale) for key, pts in series)
    label = escape(f"{title}: {', '.join(keys)} by iteration")
    svg = (
        f'<svg role="img" aria-label="{label}" viewBox="0 0 {_W} {_H}" '
        f'preserveAspectRatio="xMidYMid meet">{_axes(scale, [x for x, _ in points])}{body}</svg>'
    )
    return f"<figure><figcaption>{escape(title)}</figcaption>{_legend(keys)}{svg}</figure>"


def overlay_chart(title: str, key: str, histories: Mapping[str, Sequence[Mapping]]) -> str:
    """One metric of several runs on shared axes (a sweep's comparison): a series per run, named in
    the legend, each with its 95% interval band where its rows carry one."""
    names = [name for name, history in histories.items() if has_key(history, key)]
    series = {name: _points(histories[name], key) for name in names}
    bands = {name: _band(histories[name], key) for name in names}
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts] + [y for band in bands.values() for _, lo, hi in band for y in (lo, hi)]
    scale = _Scale(xs or [1.0], ys or [0.0, 1.0])
    colours = {name: _SERIES_COLOURS[i % len(_SERIES_COLOURS)] for i, name in enumerate(names)}
    body = "".join(_band_svg(bands[name], colours[name], scale) for name in names)
    body += "".join(_series_svg(f"{name}: {key}", series[name], colours[name], scale) for name in names)
    label = escape(f"{title}: {key} by iteration, one series per config")
    svg = f'<svg role="img" aria-label="{label}" viewBox="0 0 {_W} {_H}" preserveAspectRatio="xMidYMid meet">{_axes(scale, xs)}{body}</svg>'
    return f"<figure><figcaption>{escape(title)}</figcaption>{_legend(names)}{svg}</figure>"
