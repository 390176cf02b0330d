"""Tests for the self-contained HTML run report."""

from __future__ import annotations

import math
import os
import re
from html.parser import HTMLParser

import pytest

from grpo_flyte.report_helpers import METRIC_CHARTS, render_report, render_report_fragment
from grpo_flyte.reporting.charts import nice_ticks
from grpo_flyte.runtime import files
from grpo_flyte.runtime.files import write_text_atomic as write_report_atomic

MINUS = "\u2212"


def _row(iteration: int, **overrides: object) -> dict[str, object]:
    row: dict[str, object] = {
        "iteration": iteration,
        "adapter_version": iteration,
        "mean_reward": 0.25 * iteration,
        "accuracy": 0.25 * iteration,
        "format_rate": 0.5 + 0.1 * iteration,
        "loss": 0.85 - 0.05 * iteration,
        "num_rollouts": 64,
        "generate_s": 12.34,
        "score_s": 0.56,
        "train_s": 7.89,
        "iteration_s": 21.0,
    }
    row.update(overrides)
    return row


def _render(history, **kwargs) -> str:
    args = {"title": "Run", "status": "running", "config": {"model": "tiny"}, "history": history}
    args.update(kwargs)
    return render_report(**args)


class _TagCollector(HTMLParser):
    """Records every start and end tag, so structure can be asserted on."""

    def __init__(self) -> None:
        super().__init__()
        self.starts: list[str] = []
        self.ends: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.starts.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.starts.append(tag)
        self.ends.append(tag)

    def handle_endtag(self, tag):
        self.ends.append(tag)


def _parse(document: str) -> _TagCollector:
    parser = _TagCollector()
    parser.feed(document)
    parser.close()
    return parser


def _svgs(document: str) -> dict[str, str]:
    """SVG markup keyed by its aria-label's chart title."""
    found = re.findall(r'<svg role="img" aria-label="([^"]*)".*?</svg>', document, flags=re.DOTALL)
    blocks = re.findall(r"<svg .*?</svg>", document, flags=re.DOTALL)
    assert len(found) == len(blocks)
    return {label.split(":")[0]: block for label, block in zip(found, blocks, strict=False)}


def _section(document: str, start: str, end: str) -> str:
    return document.split(start, 1)[1].split(end, 1)[0]


def test_empty_history_shows_placeholder_and_no_charts():
    document = _render([])
    assert "No iterations finished yet" in document
    assert "<polyline" not in document
    assert "<svg" not in document
    assert '<table class="iterations"' not in document
    assert 'class="cards"' not in document
    assert "tiny" in document  # config card still shown


def test_two_rows_cards_charts_and_table():
    history = [_row(1), _row(2)]  # mean_reward 0.25 -> 0.5, loss 0.8 -> 0.75
    document = _render(history, status="complete")

    assert re.search(r'<span class="badge status-complete"[^>]*>complete</span>', document)

    cards = _section(document, 'class="cards"', "</section>")
    reward_card = _section(cards, "stat-mean_reward", "</div></div>")
    assert ">0.5<" in reward_card
    assert "+0.25 since previous" in reward_card
    loss_card = _section(cards, "stat-loss", "</div></div>")
    assert f"{MINUS}0.05 since previous" in loss_card
    assert "good" in loss_card  # falling loss is good news
    accuracy_card = _section(cards, "stat-accuracy", "</div></div>")
    assert "50.0%" in accuracy_card
    assert "+25.0 pp" in accuracy_card
    assert "+1 since previous" in _section(cards, "stat-adapter_version", "</div></div>")

    svgs = _svgs(document)
    assert set(svgs) == {"Reward, accuracy and format rate", "Loss", "Seconds per stage"}
    assert svgs["Reward, accuracy and format rate"].count("<circle") == 6
    assert svgs["Reward, accuracy and format rate"].count("<polyline") == 3
    assert svgs["Loss"].count("<circle") == 2
    assert "Held-out evaluation" not in document

    body = _section(document, "<tbody>", "</tbody>")
    assert body.count("<tr>") == 2
    first_cells = re.findall(r"<tr><td>(\d+)</td>", body)
    assert first_cells == ["2", "1"]  # newest first
    assert "12.3" in body and "12.34" not in body  # seconds with one decimal


def test_single_row_has_no_delta_but_visible_point():
    document = _render([_row(1)])
    assert "since previous" not in document
    svgs = _svgs(document)
    assert svgs["Loss"].count("<circle") == 1
    assert "<polyline" not in svgs["Loss"]


def test_extra_key_adds_chart_and_column_absent_key_omits_chart():
    history = [_row(1, eval_accuracy=0.4), _row(2, eval_accuracy=0.6, kl=0.01)]
    document = _render(history)
    svgs = _svgs(document)
    assert "Held-out evaluation" in svgs
    assert svgs["Held-out evaluation"].count("<circle") == 2
    assert "KL divergence" in svgs and svgs["KL divergence"].count("<circle") == 1
    assert "Gradient norm" not in svgs
    headers = re.findall(r'<th scope="col">([^<]*)</th>', document)
    assert headers[-2:] == ["eval_accuracy", "kl"]  # first-seen order, after fixed columns
    assert headers[0] == "Iteration"

    plain = _render([_row(1), _row(2)])
    assert "Held-out evaluation" not in plain
    assert "eval_accuracy" not in plain


def test_missing_values_render_dash_and_are_skipped():
    history = [_row(1), _row(2, loss=None)]
    del history[1]["score_s"]
    document = _render(history)
    assert _svgs(document)["Loss"].count("<circle") == 1
    newest = _section(document, "<tbody><tr>", "</tr>")
    assert newest.count("<td>\u2013</td>") == 2


def test_escaping_of_untrusted_strings():
    evil = "</pre><script>alert(1)</script>"
    document = render_report(
        title='<img src=x onerror="1">',
        status="failed",
        message="<b>boom</b>",
        config={"<k>": evil, "lr": 1e-5},
        history=[_row(1, **{"<weird>": 1.0})],
        best_completion={"question": evil, "answer": "<i>4</i>", "completion": evil, "reward": 1.0},
    )
    assert "<script" not in document.lower()
    assert "&lt;/pre&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in document
    assert "&lt;img src=x onerror=&quot;1&quot;&gt;" in document
    assert "&lt;b&gt;boom&lt;/b&gt;" in document
    assert "&lt;i&gt;4&lt;/i&gt;" in document
    assert "&lt;k&gt;" in document and "&lt;weird&gt;" in document
    tags = _parse(document)
    assert "script" not in tags.starts
    assert "img" not in tags.starts and "b" not in tags.starts and "i" not in tags.starts
    assert tags.starts.count("pre") == tags.ends.count("pre") == 1


def test_no_external_references():
    document = _render([_row(1), _row(2)], best_completion={"completion": "see http://x"})
    without_completion = document.replace("see http://x", "")
    assert not re.search(r"https?://", without_completion)
    assert not re.search(r"\b(src|href)=", document)


def test_flat_series_and_nan_do_not_crash_and_nan_is_skipped():
    history = [
        _row(1, mean_reward=0.5, accuracy=0.5, format_rate=1.0, loss=0.3),
        _row(2, mean_reward=0.5, accuracy=0.5, format_rate=1.0, loss=math.nan),
        _row(3, mean_reward=0.5, accuracy=0.5, format_rate=1.0, loss=math.inf),
    ]
    document = _render(history)
    svgs = _svgs(document)
    assert svgs["Reward, accuracy and format rate"].count("<circle") == 9
    assert svgs["Loss"].count("<circle") == 1  # nan and inf skipped
    assert "nan" not in svgs["Loss"].lower() and "inf" not in svgs["Loss"].lower()
    coordinates = re.findall(r'c[xy]="([^"]+)"', "".join(svgs.values()))
    assert coordinates and all(math.isfinite(float(value)) for value in coordinates)
    assert "NaN" in _section(document, "<tbody>", "</tbody>")
    # The last loss is inf and the previous NaN: no delta can be computed.
    assert "since previous" not in _section(document, "stat-loss", "</div></div>")


def test_all_nan_series_still_renders_axes():
    document = _render([_row(1, loss=math.nan), _row(2, loss=math.nan)])
    loss = _svgs(document)["Loss"]
    assert "<circle" not in loss and "<line" in loss


@pytest.mark.parametrize("status", ["done", "", "Running"])
def test_unknown_status_raises(status):
    with pytest.raises(ValueError) as excinfo:
        _render([], status=status)
    assert repr(status) in str(excinfo.value)
    assert "running" in str(excinfo.value) and "complete" in str(excinfo.value)


@pytest.mark.parametrize("status", ["running", "complete", "failed"])
def test_each_status_has_its_own_colour(status):
    document = _render([], status=status)
    badge = re.search(r'<span class="badge status-(\w+)" style="background:(#\w+)">(\w+)</span>', document)
    assert badge and badge.group(1) == badge.group(3) == status
    others = [s for s in ("running", "complete", "failed") if s != status]
    for other in others:
        other_badge = re.search(r"background:(#\w+)\">", _render([], status=other))
        assert other_badge.group(1) != badge.group(2)


def test_document_parses_and_svg_tags_balance():
    history = [_row(i, eval_reward=0.1 * i, eval_accuracy=0.2 * i) for i in range(1, 6)]
    document = _render(history, best_completion={"question": "q", "answer": "a", "completion": "c", "reward": 1})
    tags = _parse(document)
    assert tags.starts.count("svg") == tags.ends.count("svg") == 4
    assert tags.starts.count("figure") == tags.ends.count("figure") == 4
    assert tags.starts.count("svg") == len(re.findall(r'<svg role="img" aria-label="[^"]+"', document))
    for tag in ("html", "body", "main", "table", "tbody", "polyline", "circle", "title"):
        assert tags.starts.count(tag) == tags.ends.count(tag), tag


def test_metric_charts_shape():
    titles = [title for title, _ in METRIC_CHARTS]
    assert titles[:2] == ["Reward, accuracy and format rate", "Loss"]
    assert METRIC_CHARTS[0][1] == ("mean_reward", "accuracy", "format_rate")
    assert all(isinstance(keys, tuple) and keys for _, keys in METRIC_CHARTS)


def test_best_completion_is_shown():
    best = {"question": "2+2?", "answer": "4", "completion": "<answer>4</answer>", "reward": 0.875}
    document = _render([_row(1)], best_completion=best)
    assert '<pre class="completion">&lt;answer&gt;4&lt;/answer&gt;</pre>' in document
    assert "<dd>2+2?</dd>" in document and "<dd>4</dd>" in document and "<dd>0.875</dd>" in document


def test_the_judges_scores_for_the_best_completions_group_are_shown_escaped():
    best = {
        "question": "2+2?",
        "answer": "4",
        "completion": "#### 4",
        "reward": 1.0,
        "judge_scores": [0.25, 1.0, 0.0],
        "group_texts": ["#### 5", "#### 4", "<script>alert(1)</script>"],
        "index": 1,
    }
    document = _render([_row(1)], best_completion=best)
    table = document.split('<table class="judge">', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td><td><code>(.*?)</code></td></tr>", table)
    assert rows == [("1", "0.25", "#### 5"), ("2 (best)", "1", "#### 4"), ("3", "0", "&lt;script&gt;alert(1)&lt;/script&gt;")]
    assert "<script>" not in document
    # without a judge, no such table
    plain = {k: v for k, v in best.items() if k not in ("judge_scores", "group_texts", "index")}
    assert '<table class="judge">' not in _render([_row(1)], best_completion=plain)


def test_write_report_atomic_writes_and_leaves_no_temp(tmp_path):
    target = tmp_path / "report.html"
    write_report_atomic(target, "<p>one</p>")
    write_report_atomic(str(target), "<p>two \u2013 ü</p>")
    assert target.read_text(encoding="utf-8") == "<p>two \u2013 ü</p>"
    assert os.listdir(tmp_path) == ["report.html"]


def test_write_report_atomic_rejects_non_str_and_keeps_old(tmp_path):
    target = tmp_path / "report.html"
    write_report_atomic(target, "old")
    with pytest.raises(TypeError):
        write_report_atomic(target, b"new")  # type: ignore[arg-type]
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["report.html"]


def test_write_report_atomic_failed_replace_keeps_old(tmp_path, monkeypatch):
    target = tmp_path / "report.html"
    write_report_atomic(target, "old")

    def broken_replace(src, dst):
        raise OSError("disk on fire")

    monkeypatch.setattr(files.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk on fire"):
        write_report_atomic(target, "new")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["report.html"]


def test_held_out_cards_compare_with_the_first_evaluation():
    history = [
        {"iteration": 0, "adapter_version": 0, "eval_reward": 0.2, "eval_accuracy": 0.1},
        {**_row(1)},
        {**_row(2), "eval_reward": 0.45, "eval_accuracy": 0.15},
    ]
    document = _render(history, status="complete")
    cards = _section(document, 'class="cards"', "</section>")
    held_out = _section(cards, "stat-eval_reward", "</div></div>")
    assert ">0.45<" in held_out and "+0.25 since iteration 0" in held_out
    assert "+5.0 pp since iteration 0" in _section(cards, "stat-eval_accuracy", "</div></div>")
    # the training cards compare iterations 2 and 1, not the evaluation-only row
    assert "+0.25 since previous" in _section(cards, "stat-mean_reward", "</div></div>")
    assert "2 iterations finished" in document
    assert "Held-out evaluation" in _svgs(document)


def test_each_named_reward_has_its_own_chart_with_held_out_on_the_same_axes():
    history = [
        {"iteration": 0, "eval_reward": 0.1, "eval_reward/correct": 0.1, "eval_reward/<b>mod:fn": 0.0},
        _row(1, **{"reward/correct": 0.2, "reward/<b>mod:fn": 0.5, "reward_errors": 0}),
        _row(
            2,
            **{
                "reward/correct": 0.4,
                "reward/<b>mod:fn": 0.7,
                "reward_errors": 0,
                "eval_reward/correct": 0.3,
                "eval_reward/<b>mod:fn": 0.6,
            },
        ),
    ]
    svgs = _svgs(_render(history))
    correct = svgs["Reward &#x27;correct&#x27; (mean score)"]
    assert correct.count("<circle") == 2 + 2  # train at iterations 1, 2; held out at 0, 2
    custom = [title for title in svgs if title.startswith("Reward &#x27;&lt;b&gt;mod")]  # escaped like any text
    assert len(custom) == 1 and svgs[custom[0]].count("<circle") == 4
    assert "Reward errors (scored 0)" not in svgs  # no failures, no chart
    history[2]["reward_errors"] = 3
    assert _svgs(_render(history))["Reward errors (scored 0)"].count("<circle") == 2


def test_the_report_tab_gets_a_fragment_and_the_run_folder_a_document(tmp_path, tiny_model_dir, monkeypatch):
    """flyte.report.replace puts its content inside the tab's own page: a whole document there
    would nest <html> in <html>. The local report.html is the whole document around the same body."""
    from types import SimpleNamespace

    import flyte.report

    from grpo_flyte.launch.cli import main as cli_main

    sent: list[str] = []

    async def replace(html: str, do_flush: bool = False) -> None:
        sent.append(html)

    monkeypatch.setattr(flyte.report, "replace", SimpleNamespace(aio=replace))
    run_dir = tmp_path / "run"
    args = ["--local", "--model", str(tiny_model_dir), "--max-new-tokens", "4", "--prompts-per-iter", "2", "--group-size", "2",
            "--eval-size", "2", "--min-informative-groups", "0", "--iterations", "1", "--run-dir", str(run_dir)]  # fmt: skip
    assert cli_main(args) == 0
    assert sent, "the driver published no report"
    for fragment in sent:
        assert fragment.startswith("<style>") and fragment.endswith("</main>")
        assert not re.search(r"<(!doctype|html|head|body)[\s>]", fragment, re.IGNORECASE)
    document = (run_dir / "report.html").read_text()
    assert document.startswith("<!DOCTYPE html>") and document.rstrip().endswith("</body></html>")
    # the same style and content: the tab's last fragment opens as the file's body does
    assert sent[-1][:2000] in document


# --------------------------------------------------------------------------- axes, bands, refresh


@pytest.mark.parametrize(
    ("lo", "hi", "ticks"),
    [
        (0.0, 1.0, [0.0, 0.5, 1.0]),
        (0.13, 0.87, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]),
        (-0.31, 0.05, [-0.4, -0.3, -0.2, -0.1, 0.0, 0.1]),
        (12.0, 74.0, [0.0, 20.0, 40.0, 60.0, 80.0]),
        (0.0021, 0.0029, [0.002, 0.0022, 0.0024, 0.0026, 0.0028, 0.003]),
    ],
)
def test_nice_ticks_hand_computed(lo, hi, ticks):
    assert nice_ticks(lo, hi) == ticks


def test_held_out_curves_carry_their_95_percent_band_and_round_ticks():
    history = [
        _row(i, eval_reward=0.1 * i, eval_reward_ci95=0.05, eval_accuracy=0.2 * i, eval_accuracy_ci95=float("inf")) for i in range(1, 4)
    ]
    held_out = _svgs(_render(history))["Held-out evaluation"]
    bands = re.findall(r'<polygon class="band"[^>]*points="([^"]+)"', held_out)
    assert len(bands) == 1  # eval_reward's; an infinite interval (one question) draws none
    assert len(bands[0].split()) == 6  # three points along the top, three back along the bottom
    labels = re.findall(r'text-anchor="end">([^<]+)<', held_out)
    assert all(len(label) <= 4 for label in labels), labels  # 0.2, 0.4, ... not 0.2378


def _y_labels(history: list[dict[str, object]]) -> list[float]:
    held_out = _svgs(_render(history))["Held-out evaluation"]
    return [float(label.replace(MINUS, "-")) for label in re.findall(r'text-anchor="end">([^<]+)<', held_out)]


def test_the_accuracy_band_is_its_bounds_and_never_leaves_0_to_1():
    # an older row's half-width of 0.98 around 0.5 reaches -0.48..1.48: the band stops at 0 and 1
    old = [_row(i, eval_accuracy=0.5, eval_accuracy_ci95=0.98) for i in range(1, 3)]
    assert (min(_y_labels(old)), max(_y_labels(old))) == (0.0, 1.0)
    # a new row's bounds are drawn as they are (0.25..0.75), not the half-width around the value
    new = [_row(i, eval_accuracy=0.5, eval_accuracy_ci95=0.98, eval_accuracy_lo=0.25, eval_accuracy_hi=0.75) for i in range(1, 3)]
    assert min(_y_labels(new)) >= 0.2 and max(_y_labels(new)) <= 0.8, _y_labels(new)


def test_a_running_local_report_reloads_itself_and_a_finished_one_does_not():
    running = render_report(title="t", status="running", config={}, history=[_row(1)])
    assert '<meta http-equiv="refresh" content="30">' in running
    assert "refresh" not in render_report(title="t", status="complete", config={}, history=[_row(1)])
    assert "refresh" not in render_report_fragment(title="t", status="running", config={}, history=[_row(1)])


def test_held_out_answers_are_shown_escaped_and_cut():
    answers = [
        {"question": "What is 2 + 2?", "answer": "4", "completion": "<script>alert(1)</script> #### 4", "reward": 1.2, "correct": True},
        {"question": "What is 3 + 3?", "answer": "6", "completion": "x" * 1000, "reward": 0.0, "correct": False},
    ]
    document = render_report(title="t", status="complete", config={}, history=[_row(1)], held_out_answers=answers)
    table = document.split('class="kv held-out"', 1)[1].split("</table>", 1)[0]
    assert "<script>" not in document and "&lt;script&gt;alert(1)&lt;/script&gt; #### 4" in table
    assert "x" * 400 + " \u2026" in table and "x" * 401 not in table
    assert table.count("<tr>") == 3 and ">yes<" in table and ">no<" in table
    assert "Held-out answers" not in render_report(title="t", status="complete", config={}, history=[_row(1)])


def test_sampled_held_out_answers_show_the_first_completion_and_the_share_correct():
    """num_generations_eval: each question's first sampled completion, its mean reward and its share correct."""
    completions = [{"completion": "4", "reward": 1.0, "correct": True}, {"completion": "5", "reward": 0.0, "correct": False}] * 2
    answers = [
        {"question": "What is 2 + 2?", "answer": "4", "completion": "4", "reward": 0.5, "correct": 0.5, "completions": completions},
        {"question": "What is 3 + 3?", "answer": "6", "completion": "6", "reward": 1.0, "correct": 1.0, "completions": completions},
    ]
    document = render_report(title="t", status="complete", config={}, history=[_row(1)], held_out_answers=answers)
    table = document.split('class="kv held-out"', 1)[1].split("</table>", 1)[0]
    assert "First of 4 sampled answers" in table and "Mean reward" in table and "Greedy answer" not in table
    assert ">50%<" in table and ">100%<" in table and ">yes<" not in table


def test_the_guards_events_are_marked_on_the_charts_and_the_best_adapter_has_a_card():
    reason = "held-out accuracy 7.0% is 28.5 pp +- 8.6 pp below the best, iteration 1's 35.5% <b>"
    history = [
        {"iteration": 0, "adapter_version": 0, "eval_reward": 0.18, "eval_accuracy": 0.18, "select_by": "eval_accuracy", "best_iteration": 0},
        _row(1, eval_reward=0.355, eval_accuracy=0.355, select_by="eval_accuracy", best_iteration=1, guard_event="new_best"),
        _row(2, eval_reward=0.07, eval_accuracy=0.07, select_by="eval_accuracy", best_iteration=1, vs_best=-0.285, guard_event="rollback", guard_reason=reason),
        _row(3, guard_event="early_stop", guard_reason="stopped at iteration 3"),
    ]  # fmt: skip
    html = _render(history)
    charts = {figure.split("</figcaption>")[0]: figure for figure in html.split("<figure><figcaption>")[1:]}
    for title in ("Loss", "Held-out evaluation"):
        assert charts[title].count('class="guard-marker rollback"') == 1 and charts[title].count('class="guard-marker early_stop"') == 1
    assert "new_best" not in html.split("<table")[0]  # a new best is no event to mark; the best's iteration is
    assert charts["Held-out evaluation"].count('class="guard-marker best"') == 1 and "guard-marker best" not in charts["Loss"]
    assert "<title>held-out accuracy 7.0% is 28.5 pp +- 8.6 pp below the best, iteration 1&#x27;s 35.5% &lt;b&gt;</title>" in html
    card = html.split('class="stat stat-best"')[1].split("</div></div>")[0]
    assert "Best adapter (held-out accuracy)" in card and "35.5%" in card and "iteration 1" in card
    # the marker's colour is no series colour: the browser test finds each series by its colour
    from grpo_flyte.reporting.charts import _BEST_COLOUR, _MARKER_COLOUR, _SERIES_COLOURS

    assert {_MARKER_COLOUR, _BEST_COLOUR}.isdisjoint(_SERIES_COLOURS)


def test_the_completions_sample_is_shown_escaped_and_capped():
    evil = "</pre><script>alert(1)</script>"
    sample = [
        {
            "iteration": 3,
            "group": i // 2,
            "question": f"<q{i}>",
            "answer": "4",
            "completion": evil,
            "reward": 1.0 - i / 10,
            "advantage": -0.5,
        }
        for i in range(14)
    ]
    document = render_report(title="t", status="running", config={}, history=[_row(1)], completions=sample)
    assert "<script" not in document.lower()
    assert "Completions of iteration 3" in document and "12 of 14" in document
    section = _section(document, "Completions of iteration", "</table>")
    assert section.count("<tr>") == 1 + 12  # the header and the first 12
    assert "&lt;q0&gt;" in section and "&lt;q11&gt;" in section and "&lt;q12&gt;" not in section
    assert "&lt;/pre&gt;&lt;script&gt;" in section and "<td>-0.5</td>" in section  # the advantage
    assert "Completions of" not in render_report(title="t", status="running", config={}, history=[_row(1)])
