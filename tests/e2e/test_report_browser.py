"""The report in a real browser: headless Chromium loads report.html without console errors and
every chart draws every one of its series, checked in the DOM and in the screenshot's pixels.

Needs Debian's `chromium` (`make test` installs it) and Pillow (the dev extra). Without them these
tests skip locally but fail when CI is set, so CI cannot pass without running them.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import pytest

from grpo_flyte.report_helpers import METRIC_CHARTS, render_report, reward_charts
from grpo_flyte.reporting.charts import _SERIES_COLOURS
from tests.support.headless_chromium import Chromium, find_chromium

try:
    from PIL import Image
except ImportError:  # the dev extra has it; the fixture below explains
    Image = None

# A chart's series counts as drawn with at least this many of its colour's pixels inside the chart.
MIN_SERIES_PIXELS = 20
# Anti-aliasing blends edges; the middle of a 2-unit stroke or a 3-unit dot keeps the exact colour,
# so a small per-channel tolerance is enough and stays far from every other colour in the report.
COLOUR_TOLERANCE = 12

EVIL_COMPLETION = (
    "Step 1: 12 < 15 & 15 > 3.\n"
    '<script>console.error("escaping failed: script ran")</script>'
    '<img src="no-such-image.png" onerror="console.error(\'escaping failed: onerror ran\')">\n'
    "#### 27"
)


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="module")
def browser():
    executable = find_chromium()
    missing = []
    if executable is None:
        missing.append("chromium (`make chromium` or `apt-get install chromium` installs it)")
    if Image is None:
        missing.append("Pillow (`pip install -e '.[dev]'`)")
    if missing:
        message = "the browser tests need " + " and ".join(missing)
        if _in_ci():
            pytest.fail(f"CI is set, so not skipping: {message}", pytrace=False)
        pytest.skip(message)
    with Chromium(executable) as chromium:
        yield chromium


def _iteration_row(i: int) -> dict[str, object]:
    """One metrics.jsonl row with every key driver.iteration_metrics writes, the values moving with i."""
    return {
        "iteration": i,
        "adapter_version": i,
        "mean_reward": 0.10 + 0.12 * i,
        "accuracy": 0.02 + 0.08 * i,
        "format_rate": 0.20 + 0.15 * i,
        "loss": 0.01 - 0.004 * i,
        "num_rollouts": 64,
        "num_groups": 8 + (i % 2),
        "topup_groups": i % 2,
        "num_contributing": 40 + i,
        "frac_zero_std_groups": 0.5 - 0.1 * i,
        "num_updates": 1,
        "num_tokens": 1800 + 50 * i,
        "kl": 0.001 * i * i,
        "clip_fraction": 0.01 * i,
        "is_ratio_mean": 1.0 + 0.01 * i,
        "is_ratio_max": 1.5 + 0.2 * i,
        "is_ess": 1.0 - 0.01 * i,
        "is_clipped_fraction": 0.02 * i,
        "staleness_mean": min(i, 2) * 0.75,  # a --max-staleness 2 run (with K=1 mean and max are one line)
        "staleness_max": min(i, 2),
        "stale_dropped": 0,
        "batch_wait_s": 0.5,
        "entropy": 0.9 - 0.05 * i,
        "grad_norm": 0.3 + 0.1 * (i % 3),
        "completion_len_mean": 30.0 - 2 * i,
        "completion_len_max": 64 - 4 * i,
        "truncated_fraction": 0.3 - 0.05 * i,
        "reward/correct": 0.02 + 0.08 * i,
        "reward/format": 0.20 + 0.15 * i,
        "reward_errors": 0,
        "generate_s": 58.1 - i,
        "generate_tokens_per_s": 31.0 + i,
        "score_s": 0.1,
        "reward_model_s": 6.0 + 0.5 * i,  # a run with a reward model among its rewards (apart from score_s: both stay visible)
        "score_tokens_per_s": 18000.0,
        "train_s": 24.1 + i,
        "train_tokens_per_s": 75.0,
        "iteration_s": 82.3,
        # with --train-processes or several train GPUs, and with the 'judge' reward
        "train_restore_s": 6.0 + i,
        "judge_s": 12.0 + i,
        "judge_calls": 8 + i,
        "judge_retries": i % 3,
        "judge_invalid": i % 2,
        "judge_split_groups": (i + 1) % 2,
        # a multi-turn run's (--env): every chart of the report is drawn by this history
        "turns_mean": 1.4 + 0.1 * i,
        "tool_calls_mean": 0.5 + 0.1 * i,
        "tool_call_rate": 0.45 + 0.1 * i,
        "tool_errors": i % 2,
        "model_tokens_mean": 40.0 + i,
        "env_tokens_mean": 12.0 + i,
        "ended/done": 60 - i,
        "ended/turn_tokens": 4 + i,
        # the peak memory (records.MemoryMetrics), the GPU's as a GPU run records it; apart, so every series stays visible
        "peak_rss_gb": 2.4 + 0.1 * i,
        "generate_peak_rss_gb": 1.9 + 0.05 * i,
        "score_peak_rss_gb": 0.3,
        "train_peak_rss_gb": 1.3 + 0.1 * i,
        "generate_peak_gpu_gb": 12.0 + 0.2 * i,
        "train_peak_gpu_gb": 8.0 + 0.5 * i,
        "generate_peak_gpu_allocated_gb": 10.0 + 0.1 * i,
        "train_peak_gpu_allocated_gb": 5.0 + 0.4 * i,
        # where the row's wall clock went (records.StageCost): each stage apart, so every series stays visible
        "wall_s": 100.0,
        "wait_generate_s": 50.0 - i,
        "wait_score_s": 4.0,
        "wait_train_s": 25.0 + i,
        "wait_eval_s": 12.0,
        "driver_s": 9.0,
        "busy_generate_s": 62.0,
        "busy_train_s": 25.0 + i,
    }


def _eval_metrics(i: int) -> dict[str, object]:
    """The keys driver.run_eval adds to a row."""
    return {
        "eval_reward": 0.2 + 0.1 * i,
        "eval_reward_ci95": 0.18,
        "eval_accuracy": 0.1 + 0.05 * i,
        "eval_accuracy_ci95": 0.15,
        "eval_format_rate": 0.1 * i,
        "eval_reward/correct": 0.1 + 0.05 * i,
        "eval_reward/format": 0.1 * i,
        "eval_reward_errors": 0,
        "eval_size": 20,
        "eval_s": 15.5,
        "eval_tool_call_rate": 0.4 + 0.12 * i,
        "eval_tool_call_rate_ci95": 0.2,
        "eval_turns_mean": 1.5,
    }


def _guard(i: int) -> dict[str, object]:
    """What the guard records: the best evaluation on evaluated rows, and a rollback at iteration 3
    (its marker is drawn on every chart, in a colour no series has)."""
    guard: dict[str, object] = {"select_by": "eval_accuracy", "best_iteration": 2 if i >= 2 else 0} if i % 2 == 0 else {}
    if i == 3:
        guard.update(
            guard_event="rollback", guard_signal="entropy", guard_reason="entropy at or below 0.02 <b>nats</b>", lr_scale=0.5, rollbacks=1
        )
    return guard


def _history() -> list[dict[str, object]]:
    """A 4-iteration run evaluated before training and every 2 iterations, as the driver records it."""
    history: list[dict[str, object]] = [{"iteration": 0, "adapter_version": 0, **_eval_metrics(0), **_guard(0), "peak_rss_gb": 1.8}]
    for i in range(1, 5):
        history.append({**_iteration_row(i), **(_eval_metrics(i) if i % 2 == 0 else {}), **_guard(i)})
    return history


# The charts of this history: the fixed ones, then one per named reward.
ALL_CHARTS = (*METRIC_CHARTS, *reward_charts(_history()))


def _report(tmp_path: Path, extra_head: str = "", strip_marks: bool = False, turns: list | None = None) -> Path:
    document = render_report(
        title="grpo_flyte: GRPO + LoRA <browser test>",
        status="running",
        config={"model": "embedded", "dataset": "arithmetic", "note": "</td><b>not bold</b>"},
        history=_history(),
        best_completion={"question": "What is 12 + 15?", "answer": "27", "completion": EVIL_COMPLETION, "reward": 1.0, "turns": turns},
    )
    if strip_marks:
        document = re.sub(r"<polyline [^>]*/>|<circle .*?</circle>", "", document)
    document = document.replace("</head>", f"{extra_head}</head>")
    path = tmp_path / "report.html"
    path.write_text(document, encoding="utf-8")
    return path


# Per chart: its title, its box in page pixels, and per legend entry the series' colour and how many
# polylines and dots of that colour the browser laid out with a non-empty box inside the chart.
_CHARTS_JS = """
[...document.querySelectorAll('figure')].filter(f => f.querySelector('svg')).map(figure => {
  const svg = figure.querySelector('svg'), box = svg.getBoundingClientRect();
  const inside = r => r.width + r.height > 0 && r.right > box.left && r.left < box.right
                      && r.bottom > box.top && r.top < box.bottom;
  return {
    title: figure.querySelector('figcaption').textContent,
    box: [box.left + scrollX, box.top + scrollY, box.right + scrollX, box.bottom + scrollY],
    series: [...figure.querySelectorAll('.legend li')].map(li => {
      const colour = li.querySelector('.swatch').style.background;
      const marks = [...svg.querySelectorAll('polyline, circle')].filter(el => {
        const paint = getComputedStyle(el)[el.tagName === 'polyline' ? 'stroke' : 'fill'];
        return paint === colour && inside(el.getBoundingClientRect());
      });
      return {key: li.textContent, colour, marks: marks.length};
    }),
  };
})
"""


def _rgb(css: str) -> tuple[int, int, int]:
    """'rgb(9, 105, 218)' or '#0969da' as a tuple."""
    if css.startswith("#"):
        return tuple(int(css[i : i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]
    return tuple(int(v) for v in re.findall(r"\d+", css)[:3])  # type: ignore[return-value]


def _pixels_of(colours: dict[tuple[int, ...], int], target: tuple[int, int, int]) -> int:
    return sum(count for rgb, count in colours.items() if all(abs(a - b) <= COLOUR_TOLERANCE for a, b in zip(rgb, target, strict=False)))


def _chart_problems(browser: Chromium, png: bytes) -> list[str]:
    """Every series that a chart lists in its legend but did not visibly draw, as text; [] when all drew."""
    screenshot = Image.open(io.BytesIO(png)).convert("RGB")
    problems = []
    for chart in browser.evaluate(_CHARTS_JS):
        box = tuple(round(v) for v in chart["box"])
        crop = screenshot.crop(box)
        colours = {rgb: count for count, rgb in crop.getcolors(maxcolors=crop.width * crop.height)}
        for series in chart["series"]:
            pixels = _pixels_of(colours, _rgb(series["colour"]))
            if series["marks"] == 0 or pixels < MIN_SERIES_PIXELS:
                problems.append(f"{chart['title']}: {series['key']} has {series['marks']} marks and {pixels} pixels of {series['colour']}")
    return problems


def test_history_covers_every_chart():
    keys = {key for row in _history() for key in row}
    assert {key for _, chart_keys in METRIC_CHARTS for key in chart_keys} <= keys
    assert [title for title, _ in reward_charts(_history())] == ["Reward 'correct' (mean score)", "Reward 'format' (mean score)"]


def test_report_loads_without_errors_and_every_chart_draws_every_series(browser, tmp_path):
    page = browser.load(_report(tmp_path), width=1100)
    assert page.errors == []
    png = browser.screenshot()
    (tmp_path / "report.png").write_bytes(png)  # kept by pytest for a look when this fails
    charts = browser.evaluate(_CHARTS_JS)
    assert [chart["title"] for chart in charts] == [title for title, _ in ALL_CHARTS]
    assert all(series["marks"] >= 2 for chart in charts for series in chart["series"])  # a line and dots
    assert _chart_problems(browser, png) == []


def test_untrusted_text_stays_text(browser, tmp_path):
    page = browser.load(_report(tmp_path))
    assert page.errors == []  # an unescaped <script> or <img onerror> would have logged one
    assert browser.evaluate("document.scripts.length + document.images.length") == 0
    assert browser.evaluate("document.querySelector('pre.completion').textContent") == EVIL_COMPLETION
    assert browser.evaluate("document.title") == "grpo_flyte: GRPO + LoRA <browser test>"
    assert browser.evaluate("document.querySelectorAll('b').length") == 0  # the config's "</td><b>"


@pytest.mark.parametrize("width", [375, 800, 1100])
def test_report_fits_the_window_width(browser, tmp_path, width):
    """No sideways scrolling of the page: wide content (the table) scrolls inside its own box."""
    browser.load(_report(tmp_path), width=width)
    assert browser.evaluate("document.documentElement.scrollWidth") <= width
    figure_widths = browser.evaluate("[...document.querySelectorAll('figure')].map(f => f.getBoundingClientRect().right)")
    assert max(figure_widths) <= width


EPISODE = [
    {"role": "model", "text": "<calc>12+15</calc>", "num_tokens": 9},
    {"role": "tool", "text": EVIL_COMPLETION, "num_tokens": 30},
    {"role": "model", "text": "#### 27", "num_tokens": 6},
]


def test_an_episode_shows_the_environments_turns_apart_and_as_text(browser, tmp_path):
    page = browser.load(_report(tmp_path, turns=EPISODE), width=1100)
    assert page.errors == [] and browser.evaluate("document.scripts.length + document.images.length") == 0
    turns = browser.evaluate(
        "[...document.querySelectorAll('.episode .turn')].map(t => ({cls: t.className, who: t.querySelector('.who').textContent,"
        " text: t.querySelector('pre').textContent, left: t.getBoundingClientRect().left,"
        " border: getComputedStyle(t).borderLeftColor}))"
    )
    assert [t["cls"] for t in turns] == ["turn model", "turn env", "turn model"]
    assert turns[1]["text"] == EVIL_COMPLETION and turns[1]["who"].startswith("environment (tool)")
    # set apart: indented, and another colour than the model's turns
    assert turns[1]["left"] > turns[0]["left"] and turns[1]["border"] != turns[0]["border"] == turns[2]["border"]


# ----------------------------------------------------------------------------- negative controls


def test_console_check_catches_script_errors_and_failed_loads(browser, tmp_path):
    broken = (
        "<script>console.error('deliberate console.error');"
        "console.log('a log line is not an error'); notDefined();</script>"
        '<link rel="stylesheet" href="missing.css">'
    )
    page = browser.load(_report(tmp_path, extra_head=broken))
    assert len(page.errors) == 3, page.errors
    assert any("deliberate console.error" in e for e in page.errors)
    assert any("notDefined" in e for e in page.errors)
    assert any("missing.css" in e for e in page.errors)


@pytest.mark.parametrize(
    ("rule", "marks_left"),
    [("display:none", False), ("opacity:0", True)],  # opacity:0 keeps the layout: only the pixels tell
)
def test_marks_check_catches_a_hidden_series(browser, tmp_path, rule, marks_left):
    second = _SERIES_COLOURS[1]
    hide = f'<style>svg [stroke="{second}"],svg [fill="{second}"]{{{rule}}}</style>'
    browser.load(_report(tmp_path, extra_head=hide))
    problems = _chart_problems(browser, browser.screenshot())
    charts_with_two = [title for title, keys in ALL_CHARTS if len(keys) > 1]
    assert [p.rsplit(": ", 1)[0] for p in problems] == charts_with_two  # titles may hold a colon too
    assert all(" 0 pixels" in p and (" 0 marks" not in p) == marks_left for p in problems), problems


def test_marks_check_catches_charts_without_marks(browser, tmp_path):
    browser.load(_report(tmp_path, strip_marks=True))
    problems = _chart_problems(browser, browser.screenshot())
    assert len(problems) == sum(len(keys) for _, keys in ALL_CHARTS)
