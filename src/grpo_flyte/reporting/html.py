"""This module builds the HTML around a report: its style sheet, its header and document, escaping and number formatting.

Shared by the run report (grpo_flyte.report_helpers) and a sweep's comparison
(grpo_flyte.reporting.sweep_report). A page has inline CSS only: no scripts, no external styles,
fonts or images, so it can be opened anywhere and shown in a Flyte report without network access.
Everything that comes from data is escaped, because completions are untrusted model output.
"""

from __future__ import annotations

import datetime as _dt
import html
import math

STATUSES = ("running", "complete", "failed")
# A local report of a run still going reloads itself this often (seconds); a finished one does not.
REFRESH_S = 30

DASH = "\u2013"
MINUS = "\u2212"

_STATUS_COLOURS = {"running": "#0969da", "complete": "#1a7f37", "failed": "#cf222e"}

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


def escape(value: object) -> str:
    """Text (a config's name, an error, a completion) as HTML that shows it and runs nothing."""
    return html.escape(str(value), quote=True)


def finite(value: object) -> float | None:
    """The value as a finite float, or None when it cannot be plotted or compared."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def format_value(value: object, kind: str) -> str:
    """Format a table or card value by `kind` (int, pct, sec or num); the result is already HTML-safe."""
    if value is None:
        return DASH
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return escape(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("\u221e" if value > 0 else MINUS + "\u221e")
    if kind == "int" and float(value).is_integer():
        return str(int(value))
    if kind == "pct":
        return f"{value * 100:.1f}%"
    if kind == "sec":
        return f"{value:.1f}"
    return f"{value:.4g}"


def _header(title: str, status: str, message: str | None, n_rows: int) -> str:
    badge = f'<span class="badge status-{status}" style="background:{_STATUS_COLOURS[status]}">{status}</span>'
    parts = [f"<header><h1>{escape(title)} {badge}</h1>"]
    if message:
        parts.append(f'<p class="message {status}">{escape(message)}</p>')
    generated = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    noun = "iteration" if n_rows == 1 else "iterations"
    parts.append(f'<p class="meta">{n_rows} {noun} finished \u00b7 generated {generated}</p>')
    parts.append("</header>")
    return "".join(parts)


def render_page(title: str, status: str, message: str | None, body: str, n_rows: int = 0, whole: bool = True) -> str:
    """A report page around `body` (HTML its caller escaped), with the run report's style and
    header: a whole self-contained document that reloads itself every REFRESH_S seconds while
    `status` is running, or (`whole=False`) the fragment a Flyte report tab takes."""
    if status not in STATUSES:
        raise ValueError(f"unknown report status {status!r}; expected one of {', '.join(STATUSES)}")
    fragment = f"<style>{_CSS}</style><main>{_header(title, status, message, n_rows)}{body}</main>"
    return document(title, status, fragment) if whole else fragment


def document(title: str, status: str, fragment: str) -> str:
    """A page's fragment as one whole HTML document titled `title`, reloading itself every
    REFRESH_S seconds while `status` is running (an HTML meta refresh: no script)."""
    refresh = f'<meta http-equiv="refresh" content="{REFRESH_S}">' if status == "running" else ""
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width,initial-scale=1">{refresh}'
        f"<title>{escape(title)}</title></head><body>{fragment}</body></html>\n"
    )
