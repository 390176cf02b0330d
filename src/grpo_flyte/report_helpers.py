"""Self-contained HTML report for a GRPO run.

Renders stat cards, inline SVG line charts, a per-iteration table, the best
completion and the run config into one HTML document with inline CSS only: no
scripts, no external styles, fonts or images, so it can be opened anywhere and
shown in a Flyte report without network access. Everything that comes from data
is escaped, because completions are untrusted model output.
"""

from __future__ import annotations

import datetime as _dt
import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

STATUSES = ("running", "complete", "failed")

# One (chart title, history keys) pair per chart, with at most len(_SERIES_COLOURS) keys. A chart is drawn only when at
# least one history row carries one of its keys, so optional metrics cost nothing.
METRIC_CHARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Reward, accuracy and format rate", ("mean_reward", "accuracy", "format_rate")),
    ("Loss", ("loss",)),
    ("Held-out evaluation", ("eval_reward", "eval_accuracy")),
    ("KL divergence", ("kl",)),
    ("Gradient norm", ("grad_norm",)),
    ("Entropy", ("entropy",)),
    ("Clipped tokens, zero-variance groups, truncated completions", ("clip_fraction", "frac_zero_std_groups", "truncated_fraction")),
    ("Importance ratio (trainer / generator)", ("is_ratio_mean", "is_ratio_max")),
    ("Importance weights: effective sample size, share cut by the cap", ("is_ess", "is_clipped_fraction")),
    ("Completion length", ("completion_len_mean", "completion_len_max")),
    ("Tool use (multi-turn)", ("tool_call_rate", "eval_tool_call_rate")),
    ("Turns and tokens per episode (multi-turn)", ("turns_mean", "tool_calls_mean", "model_tokens_mean", "env_tokens_mean")),
    ("Seconds per stage", ("generate_s", "score_s", "judge_s", "train_s", "eval_s")),
    # apart from the stages: one chart has as many series as there are colours at most
    ("Seconds waiting: the trainer for its batch, a train step restoring its state", ("batch_wait_s", "train_restore_s")),
    (
        "LLM judge: calls, retries, unparsable replies, split groups",
        ("judge_calls", "judge_retries", "judge_invalid", "judge_split_groups"),
    ),
    ("Staleness (generation ahead of training)", ("staleness_mean", "staleness_max", "stale_dropped")),
)
# A series drawn with a shaded 95% interval: the key holding the interval's half-width.
_BANDS = {"eval_reward": "eval_reward_ci95", "eval_accuracy": "eval_accuracy_ci95", "eval_tool_call_rate": "eval_tool_call_rate_ci95"}

# The guard's events (grpo_flyte.loop.guard) marked on every chart: a dashed vertical line at the
# iteration, labelled, the reason as its tooltip; the best adapter's iteration on the held-out chart.
# The marker colours are no series colour (a series is found by its colour in the browser test).
_GUARD_MARKERS = {"collapse": "collapse", "rollback": "rollback", "stop": "stop", "early_stop": "early stop"}
_MARKER_COLOUR = "#bf3989"
_BEST_COLOUR = "#9a6700"
_BEST_CHART = "Held-out evaluation"

DASH = "\u2013"
_MINUS = "\u2212"

_STATUS_COLOURS = {"running": "#0969da", "complete": "#1a7f37", "failed": "#cf222e"}
_SERIES_COLOURS = ("#0969da", "#d4620a", "#1a7f37", "#8250df", "#cf222e", "#6e7781")

# (key, header, kind); kind selects the number formatter.
_FIXED_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("iteration", "Iteration", "int"),
    ("adapter_version", "Adapter", "int"),
    ("mean_reward", "Mean reward", "num"),
    ("accuracy", "Accuracy", "pct"),
    ("format_rate", "Format rate", "pct"),
    ("loss", "Loss", "num"),
    ("num_rollouts", "Rollouts", "int"),
    ("generate_s", "Generate (s)", "sec"),
    ("score_s", "Score (s)", "sec"),
    ("train_s", "Train (s)", "sec"),
    ("iteration_s", "Iteration (s)", "sec"),
)
_FIXED_KEYS = frozenset(key for key, _, _ in _FIXED_COLUMNS)

_CARDS: tuple[tuple[str, str, str], ...] = (
    ("mean_reward", "Mean reward", "num"),
    ("accuracy", "Accuracy", "pct"),
    ("format_rate", "Format rate", "pct"),
    ("loss", "Loss", "num"),
    ("adapter_version", "Adapter version", "int"),
)
# Colours the delta: a falling loss is good news, a falling reward is not.
_LOWER_IS_BETTER = frozenset({"loss"})
_NEUTRAL_DELTA = frozenset({"adapter_version"})

# Chart geometry in SVG user units; the SVG scales to its container width.
_W, _H = 640, 260
_LEFT, _RIGHT, _TOP, _BOTTOM = 60, 16, 14, 40
_MAX_X_TICKS = 10

_CSS = """
*{box-sizing:border-box}
body{margin:0;background:#f6f8fa;color:#1f2328;
 font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif}
main{max-width:1040px;margin:0 auto;padding:24px 16px 48px}
h1{font-size:24px;margin:0 0 6px;display:flex;align-items:center;gap:12px;flex-wrap:wrap}
h2{font-size:17px;margin:28px 0 10px}
.badge{font-size:12px;font-weight:600;text-transform:uppercase;letter-spacing:.04em;
 color:#fff;border-radius:999px;padding:3px 10px}
.message{margin:6px 0;white-space:pre-wrap;overflow-wrap:anywhere}
.message.failed{color:#cf222e}
.meta{color:#656d76;font-size:12px;margin:4px 0 0}
.card,.cards>div,figure{background:#fff;border:1px solid #d0d7de;border-radius:8px}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(160px,1fr));gap:12px;margin-top:18px}
.cards>div{padding:12px 14px}
.cards .label{color:#656d76;font-size:12px}
.cards .value{font-size:24px;font-weight:600;font-variant-numeric:tabular-nums}
.cards .delta{font-size:12px;color:#656d76}
.delta.good{color:#1a7f37}.delta.bad{color:#cf222e}
/* min(): on a screen narrower than 420px one column fits it, instead of scrolling sideways */
.charts{display:grid;grid-template-columns:repeat(auto-fit,minmax(min(420px,100%),1fr));gap:12px}
figure{margin:0;padding:12px}
figcaption{font-weight:600;margin-bottom:4px}
.legend{list-style:none;margin:0 0 6px;padding:0;display:flex;gap:14px;flex-wrap:wrap;font-size:12px}
.swatch{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:5px}
svg{width:100%;height:auto;display:block}
svg text{font-size:11px;fill:#656d76}
.grid{stroke:#eaeef2}.axis{stroke:#8c959f}
.scroll{overflow-x:auto}
table{border-collapse:collapse;width:100%;background:#fff;font-variant-numeric:tabular-nums}
th,td{border:1px solid #d0d7de;padding:4px 8px;text-align:right;white-space:nowrap}
th{background:#f6f8fa;font-weight:600}
.kv th,.kv td{text-align:left;white-space:normal;overflow-wrap:anywhere}
.kv th{width:30%}
.card{padding:12px 14px}
.card dl{display:grid;grid-template-columns:max-content 1fr;gap:4px 12px;margin:0 0 8px}
.card dt{color:#656d76}.card dd{margin:0;white-space:pre-wrap;overflow-wrap:anywhere}
pre{background:#f6f8fa;border:1px solid #d0d7de;border-radius:6px;padding:10px;margin:0;
 white-space:pre-wrap;overflow-wrap:anywhere;font:12px/1.45 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
.episode{display:flex;flex-direction:column;gap:8px}
.turn{border-left:4px solid #0969da;padding-left:10px}
.turn.env{border-left-color:#d4620a;margin-left:32px}
.turn.env pre{background:#fff8f0}
.who{display:block;font-weight:600;font-size:12px;margin-bottom:2px}
.placeholder{background:#fff;border:1px dashed #d0d7de;border-radius:8px;padding:28px;
 text-align:center;color:#656d76;margin-top:18px}
"""


# --------------------------------------------------------------------------- numbers


def _esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def _finite(value: object) -> float | None:
    """The value as a finite float, or None when it cannot be plotted or compared."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _format(value: object, kind: str) -> str:
    """Format a table or card value; the result is already HTML-safe."""
    if value is None:
        return DASH
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _esc(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("\u221e" if value > 0 else _MINUS + "\u221e")
    if kind == "int" and float(value).is_integer():
        return str(int(value))
    if kind == "pct":
        return f"{value * 100:.1f}%"
    if kind == "sec":
        return f"{value:.1f}"
    return f"{value:.4g}"


def _delta(last: object, previous: object, kind: str) -> tuple[str, float] | None:
    """Signed change as text (with a real minus sign) and as a number."""
    a, b = _finite(last), _finite(previous)
    if a is None or b is None:
        return None
    change = a - b
    if change == 0:
        return "no change", 0.0
    if kind == "pct":
        text = f"{change * 100:+.1f} pp"
    elif kind == "int":
        text = f"{change:+.0f}"
    else:
        text = f"{change:+.3g}"
    return text.replace("-", _MINUS), change


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


# --------------------------------------------------------------------------- header


def _header(title: str, status: str, message: str | None, n_rows: int) -> str:
    badge = f'<span class="badge status-{status}" style="background:{_STATUS_COLOURS[status]}">{status}</span>'
    parts = [f"<header><h1>{_esc(title)} {badge}</h1>"]
    if message:
        parts.append(f'<p class="message {status}">{_esc(message)}</p>')
    generated = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    noun = "iteration" if n_rows == 1 else "iterations"
    parts.append(f'<p class="meta">{n_rows} {noun} finished \u00b7 generated {generated}</p>')
    parts.append("</header>")
    return "".join(parts)


# --------------------------------------------------------------------------- cards


def _card(key: str, label: str, kind: str, last: Mapping, previous: Mapping | None, since: str = "previous") -> str:
    value = _format(last.get(key), kind)
    delta_html = ""
    delta = _delta(last.get(key), previous.get(key), kind) if previous is not None else None
    if delta is not None:
        text, change = delta
        css = ""
        if change and key not in _NEUTRAL_DELTA:
            css = " good" if (change > 0) != (key in _LOWER_IS_BETTER) else " bad"
        delta_html = f'<div class="delta{css}">{text} since {_esc(since)}</div>'
    return f'<div class="stat stat-{key}"><div class="label">{label}</div><div class="value">{value}</div>{delta_html}</div>'


def _cards(history: Sequence[Mapping]) -> str:
    trained = [row for row in history if "mean_reward" in row] or list(history)
    last = trained[-1]
    previous = trained[-2] if len(trained) > 1 else None
    cards = "".join(_card(key, label, kind, last, previous) for key, label, kind in _CARDS)
    evaluated = [row for row in history if _finite(row.get("eval_reward")) is not None]
    if evaluated:
        first, latest = evaluated[0], evaluated[-1]
        since = f"iteration {first.get('iteration', 0)}"
        before = first if latest is not first else None
        cards += _card("eval_reward", "Held-out reward", "num", latest, before, since)
        cards += _card("eval_accuracy", "Held-out accuracy", "pct", latest, before, since)
        cards += _best_card(evaluated)
    return f'<section class="cards" aria-label="Latest iteration">{cards}</section>'


def _best_card(evaluated: Sequence[Mapping]) -> str:
    """The best adapter so far by the guard's metric: its value and iteration ('' before the guard names one)."""
    latest = evaluated[-1]
    metric, iteration = latest.get("select_by"), latest.get("best_iteration")
    best = next((row for row in evaluated if row.get("iteration") == iteration), None)
    if best is None or metric not in ("eval_accuracy", "eval_reward"):
        return ""
    kind, what = ("pct", "accuracy") if metric == "eval_accuracy" else ("num", "reward")
    return (
        f'<div class="stat stat-best"><div class="label">Best adapter (held-out {what})</div>'
        f'<div class="value">{_format(best.get(metric), kind)}</div><div class="delta">iteration {_esc(iteration)}</div></div>'
    )


# --------------------------------------------------------------------------- charts


def _points(history: Sequence[Mapping], key: str) -> list[tuple[float, float]]:
    """(iteration, value) pairs, skipping missing and non-finite values."""
    points = []
    for position, row in enumerate(history, start=1):
        y = _finite(row.get(key))
        if y is None:
            continue
        x = _finite(row.get("iteration"))
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
    """(iteration, low, high) of `key`'s 95% interval on the rows that carry a finite one."""
    if key not in _BANDS:
        return []
    band = []
    for position, row in enumerate(history, start=1):
        y, half = _finite(row.get(key)), _finite(row.get(_BANDS[key]))
        if y is None or half is None:
            continue
        x = _finite(row.get("iteration"))
        band.append((x if x is not None else float(position), y - half, y + half))
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
        tip = f"{_esc(key)}, iteration {_tick_label(x)}: {y:.4g}"
        parts.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3" fill="{colour}"><title>{tip}</title></circle>')
    return "".join(parts)


def _guard_marks(history: Sequence[Mapping], best: bool) -> list[tuple[float, str, str, str, str]]:
    """(iteration, label, class, colour, tooltip) of the guard's events (and, with `best`, the best
    adapter's iteration)."""
    marks = [
        (x, _GUARD_MARKERS[str(row["guard_event"])], str(row["guard_event"]), _MARKER_COLOUR, str(row.get("guard_reason", "")))
        for row in history
        if row.get("guard_event") in _GUARD_MARKERS and (x := _finite(row.get("iteration"))) is not None
    ]
    iteration = next((_finite(row.get("best_iteration")) for row in reversed(history) if row.get("best_iteration") is not None), None)
    if best and iteration is not None:
        marks.append((iteration, "best", "best", _BEST_COLOUR, f"the best adapter so far: iteration {_tick_label(iteration)}"))
    return marks


def _markers_svg(marks: Sequence[tuple[float, str, str, str, str]], scale: _Scale) -> str:
    """The marks as labelled dashed vertical lines, the tooltip on each."""
    parts = []
    for x, label, css, colour, tip in marks:
        cx, bottom = scale.x(x), _H - _BOTTOM
        parts.append(
            f'<g class="guard-marker {_esc(css)}"><title>{_esc(tip)}</title>'
            f'<line x1="{cx:.1f}" y1="{_TOP}" x2="{cx:.1f}" y2="{bottom}" stroke="{colour}" stroke-width="1.5" stroke-dasharray="4 3"/>'
            f'<text x="{cx + 3:.1f}" y="{_TOP + 10}" style="fill:{colour}">{_esc(label)}</text></g>'
        )
    return "".join(parts)


def _legend(keys: Sequence[str]) -> str:
    items = "".join(
        f'<li><span class="swatch" style="background:{_SERIES_COLOURS[i % len(_SERIES_COLOURS)]}"></span>{_esc(key)}</li>'
        for i, key in enumerate(keys)
    )
    return f'<ul class="legend">{items}</ul>'


def _has_key(history: Sequence[Mapping], key: str) -> bool:
    return any(row.get(key) is not None for row in history)


def _chart(title: str, keys: Sequence[str], history: Sequence[Mapping]) -> str:
    keys = [key for key in keys if _has_key(history, key)]
    series = [(key, _points(history, key)) for key in keys]
    bands = {key: _band(history, key) for key in keys}
    points = [point for _, pts in series for point in pts]
    band_ys = [y for band in bands.values() for _, lo, hi in band for y in (lo, hi)]
    marks = _guard_marks(history, best=title == _BEST_CHART)
    # With nothing finite to plot, still draw empty axes rather than fail; the guard's marks widen the x-axis to them.
    scale = _Scale([x for x, _ in points] + [m[0] for m in marks] or [1.0], [y for _, y in points] + band_ys or [0.0, 1.0])
    colours = {key: _SERIES_COLOURS[i % len(_SERIES_COLOURS)] for i, key in enumerate(keys)}
    body = "".join(_band_svg(bands[key], colours[key], scale) for key in keys)
    body += _markers_svg(marks, scale)
    body += "".join(_series_svg(key, pts, colours[key], scale) for key, pts in series)
    label = _esc(f"{title}: {', '.join(keys)} by iteration")
    svg = (
        f'<svg role="img" aria-label="{label}" viewBox="0 0 {_W} {_H}" '
        f'preserveAspectRatio="xMidYMid meet">{_axes(scale, [x for x, _ in points])}{body}</svg>'
    )
    return f"<figure><figcaption>{_esc(title)}</figcaption>{_legend(keys)}{svg}</figure>"


def overlay_chart(title: str, key: str, histories: Mapping[str, Sequence[Mapping]]) -> str:
    """One metric of several runs on shared axes (a sweep's comparison): a series per run, named in
    the legend, each with its 95% interval band where its rows carry one."""
    names = [name for name, history in histories.items() if _has_key(history, key)]
    series = {name: _points(histories[name], key) for name in names}
    bands = {name: _band(histories[name], key) for name in names}
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts] + [y for band in bands.values() for _, lo, hi in band for y in (lo, hi)]
    scale = _Scale(xs or [1.0], ys or [0.0, 1.0])
    colours = {name: _SERIES_COLOURS[i % len(_SERIES_COLOURS)] for i, name in enumerate(names)}
    body = "".join(_band_svg(bands[name], colours[name], scale) for name in names)
    body += "".join(_series_svg(f"{name}: {key}", series[name], colours[name], scale) for name in names)
    label = _esc(f"{title}: {key} by iteration, one series per config")
    svg = f'<svg role="img" aria-label="{label}" viewBox="0 0 {_W} {_H}" preserveAspectRatio="xMidYMid meet">{_axes(scale, xs)}{body}</svg>'
    return f"<figure><figcaption>{_esc(title)}</figcaption>{_legend(names)}{svg}</figure>"


def render_page(title: str, status: str, message: str | None, body: str, n_rows: int = 0, whole: bool = True) -> str:
    """A report page around `body` (HTML its caller escaped), with the run report's style and
    header: a whole self-contained document that reloads itself every REFRESH_S seconds while
    `status` is running, or (`whole=False`) the fragment a Flyte report tab takes."""
    if status not in STATUSES:
        raise ValueError(f"unknown report status {status!r}; expected one of {', '.join(STATUSES)}")
    fragment = f"<style>{_CSS}</style><main>{_header(title, status, message, n_rows)}{body}</main>"
    if not whole:
        return fragment
    refresh = f'<meta http-equiv="refresh" content="{REFRESH_S}">' if status == "running" else ""
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width,initial-scale=1">{refresh}'
        f"<title>{_esc(title)}</title></head><body>{fragment}</body></html>\n"
    )


def escape(value: object) -> str:
    """Text (a config's name, an error, a completion) as HTML that shows it and runs nothing."""
    return _esc(value)


def reward_charts(history: Sequence[Mapping]) -> list[tuple[str, tuple[str, ...]]]:
    """One chart per named reward ('reward/<name>' in the rows; held-out 'eval_reward/<name>' on
    the same axes), plus the failed-score count when any reward failed."""
    names = dict.fromkeys(key.split("/", 1)[1] for row in history for key in row if key.startswith("reward/"))
    charts = [(f"Reward {name!r} (mean score)", (f"reward/{name}", f"eval_reward/{name}")) for name in names]
    if any(row.get("reward_errors") or row.get("eval_reward_errors") for row in history):
        charts.append(("Reward errors (scored 0)", ("reward_errors", "eval_reward_errors")))
    return charts


def _charts(history: Sequence[Mapping]) -> str:
    charts = [
        _chart(title, keys, history)
        for title, keys in (*METRIC_CHARTS, *reward_charts(history))
        if any(_has_key(history, key) for key in keys)
    ]
    if not charts:
        return ""
    return f'<h2>Metrics</h2><section class="charts">{"".join(charts)}</section>'


# --------------------------------------------------------------------------- table


def _extra_columns(history: Sequence[Mapping]) -> list[tuple[str, str, str]]:
    """Numeric keys beyond the fixed columns, in first-seen order."""
    seen: dict[str, None] = {}
    for row in history:
        for key, value in row.items():
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            if numeric and key not in _FIXED_KEYS:
                seen.setdefault(str(key), None)
    return [(key, key, "sec" if key.endswith("_s") else "num") for key in seen]


def _table(history: Sequence[Mapping]) -> str:
    columns = list(_FIXED_COLUMNS) + _extra_columns(history)
    head = "".join(f'<th scope="col">{_esc(header)}</th>' for _, header, _ in columns)
    # Newest first: during a long run the latest iteration is what one looks for.
    rows = "".join(
        "<tr>" + "".join(f"<td>{_format(row.get(key), kind)}</td>" for key, _, kind in columns) + "</tr>" for row in reversed(history)
    )
    return (
        '<h2>Iterations <span class="meta">(newest first)</span></h2>'
        f'<div class="scroll"><table class="iterations"><thead><tr>{head}</tr></thead>'
        f"<tbody>{rows}</tbody></table></div>"
    )


# --------------------------------------------------------------------------- completion and config


def _text(value: object) -> str:
    return DASH if value is None else _esc(value)


def _best_completion(best: Mapping | None) -> str:
    if best is None:
        return '<h2>Best completion</h2><p class="placeholder">No completion recorded yet.</p>'
    reward = best.get("reward")
    reward_text = f"{reward:.4g}" if _finite(reward) is not None else _format(reward, "num")
    fields = (
        ("Question", _text(best.get("question"))),
        ("Expected answer", _text(best.get("answer"))),
        ("Reward", reward_text),
    )
    items = "".join(f"<dt>{label}</dt><dd>{value}</dd>" for label, value in fields)
    turns = best.get("turns")
    if turns:
        return f'<h2>Best episode of the last iteration</h2><div class="card best"><dl>{items}</dl>{_episode(turns)}</div>'
    completion = _text(best.get("completion"))
    return (
        "<h2>Best completion of the last iteration</h2>"
        f'<div class="card best"><dl>{items}</dl><pre class="completion">{completion}</pre>{_judge_scores(best)}</div>'
    )


def _judge_scores(best: Mapping) -> str:
    """The LLM judge's score of every completion in the best one's group ('' without a judge)."""
    scores, texts, index = best.get("judge_scores"), best.get("group_texts") or [], best.get("index")
    if not scores:
        return ""
    cells = []
    for i, score in enumerate(scores):
        label = f"{i + 1} (best)" if i == index else str(i + 1)
        text = _text(texts[i] if i < len(texts) else None)
        cells.append(f"<tr><td>{label}</td><td>{_format(score, 'num')}</td><td><code>{text}</code></td></tr>")
    return (
        "<h3>The judge's scores for this group</h3>"
        f'<table class="judge"><thead><tr><th>Completion</th><th>Judge score</th><th>Starts</th></tr></thead><tbody>{"".join(cells)}</tbody></table>'
    )


def _episode(turns: Sequence[Mapping]) -> str:
    """A multi-turn episode turn by turn: the model's turns and the environment's set apart (class
    and label), each turn's text escaped."""
    rows = []
    for turn in turns:
        role = str(turn.get("role", ""))
        mine = role == "model"
        label = "model" if mine else f"environment ({role})"
        rows.append(
            f'<div class="turn {"model" if mine else "env"}"><span class="who">{_esc(label)}'
            f' <span class="meta">{_format(turn.get("num_tokens"), "int")} tokens</span></span>'
            f'<pre class="completion">{_text(turn.get("text"))}</pre></div>'
        )
    return f'<div class="episode">{"".join(rows)}</div>'


# Characters of a held-out completion shown in the report's table (the run folder has them whole).
_ANSWER_CHARS = 400


def _held_out(answers: Sequence[Mapping] | None) -> str:
    if not answers:
        return ""
    rows = "".join(
        "<tr>"
        f"<td>{_text(a.get('question'))}</td><td>{_text(a.get('answer'))}</td>"
        f"<td><pre>{_esc(_cut(str(a.get('completion', ''))))}</pre></td>"
        f"<td>{_format(a.get('reward'), 'num')}</td><td>{'yes' if a.get('correct') else 'no'}</td>"
        "</tr>"
        for a in answers
    )
    head = "".join(f'<th scope="col">{h}</th>' for h in ("Question", "Expected", "Greedy answer", "Reward", "Correct"))
    return (
        '<h2>Held-out answers <span class="meta">(a sample of the latest evaluation)</span></h2>'
        f'<div class="scroll"><table class="kv held-out"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>'
    )


def _cut(text: str) -> str:
    return text if len(text) <= _ANSWER_CHARS else text[:_ANSWER_CHARS] + " \u2026"


def _config(config: Mapping[str, object]) -> str:
    if not config:
        return '<h2>Run config</h2><p class="placeholder">No config recorded.</p>'
    rows = "".join(f'<tr><th scope="row">{_esc(key)}</th><td>{_esc(value)}</td></tr>' for key, value in config.items())
    return f'<h2>Run config</h2><table class="kv config"><tbody>{rows}</tbody></table>'


# --------------------------------------------------------------------------- public API


# A local report of a run still going reloads itself this often (seconds); a finished one does not.
REFRESH_S = 30


def render_report(**parts: Any) -> str:
    """The whole run report as one self-contained HTML document (the local report.html): the
    fragment `render_report_fragment(**parts)` as the body of a page titled `parts["title"]`.
    While the run is going the page reloads itself every REFRESH_S seconds (an HTML meta refresh:
    no script)."""
    refresh = f'<meta http-equiv="refresh" content="{REFRESH_S}">' if parts["status"] == "running" else ""
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width,initial-scale=1">{refresh}'
        f"<title>{_esc(parts['title'])}</title></head><body>{render_report_fragment(**parts)}</body></html>\n"
    )


def render_report_fragment(
    *,
    title: str,
    status: str,
    config: dict[str, object],
    history: list[dict[str, object]],
    best_completion: dict[str, object] | None = None,
    message: str | None = None,
    held_out_answers: list[dict[str, object]] | None = None,
) -> str:
    """The report as an HTML fragment (its style and its content, no document around them): what
    `flyte.report.replace` puts inside the report tab's own page, and the body of `render_report`."""
    if status not in STATUSES:
        raise ValueError(f"unknown report status {status!r}; expected one of {', '.join(STATUSES)}")
    if history:
        progress = _cards(history) + _charts(history) + _table(history)
    else:
        progress = '<p class="placeholder empty">No iterations finished yet.</p>'
    body = (
        _header(title, status, message, sum(1 for row in history if "mean_reward" in row))
        + progress
        + _best_completion(best_completion)
        + _held_out(held_out_answers)
        + _config(config)
    )
    return f"<style>{_CSS}</style><main>{body}</main>"
