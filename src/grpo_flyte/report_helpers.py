"""This module renders the self-contained HTML report of a GRPO run.

It renders stat cards, inline SVG line charts, a per-iteration table, the best
completion and the run config into one HTML document with inline CSS only: no
scripts, no external styles, fonts or images, so it can be opened anywhere and
shown in a Flyte report without network access. Everything that comes from data
is escaped, because completions are untrusted model output. The page, escaping and
number formatting are grpo_flyte.reporting.html's; the charts grpo_flyte.reporting.charts'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from grpo_flyte.reporting.charts import chart, has_key
from grpo_flyte.reporting.cost import WAIT_STAGES, accelerator_hours, pool_dollars, totals, waits, where_the_time_went
from grpo_flyte.reporting.html import DASH, MINUS, STATUSES, document, escape, finite, format_value, render_page

# One (chart title, history keys) pair per chart, with at most as many keys as reporting.charts has series colours (6). A chart is drawn only when at
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
    ("Seconds per stage", ("generate_s", "score_s", "judge_s", "reward_model_s", "train_s", "eval_s")),
    # apart from the stages: one chart has as many series as there are colours at most
    ("Seconds waiting: the trainer for its batch, a train step restoring its state", ("batch_wait_s", "train_restore_s")),
    (
        "Where the time went: seconds the loop waited, by stage",
        ("wait_generate_s", "wait_score_s", "wait_train_s", "wait_eval_s", "driver_s"),
    ),
    (
        "LLM judge: calls, retries, unparsable replies, split groups",
        ("judge_calls", "judge_retries", "judge_invalid", "judge_split_groups"),
    ),
    ("Staleness (generation ahead of training)", ("staleness_mean", "staleness_max", "stale_dropped")),
    # records.MemoryMetrics: locally the driver's process tree is the whole run's; on a cluster each task's process
    ("Peak resident memory, GB (process trees)", ("peak_rss_gb", "generate_peak_rss_gb", "score_peak_rss_gb", "train_peak_rss_gb")),
    (
        "Peak GPU memory, GB (torch: reserved, allocated)",
        ("generate_peak_gpu_gb", "train_peak_gpu_gb", "generate_peak_gpu_allocated_gb", "train_peak_gpu_allocated_gb"),
    ),
)
# The chart that marks the best adapter's iteration.
_BEST_CHART = "Held-out evaluation"

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


# --------------------------------------------------------------------------- cards


def _delta(last: object, previous: object, kind: str) -> tuple[str, float] | None:
    """Signed change as text (with a real minus sign) and as a number."""
    a, b = finite(last), finite(previous)
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
    return text.replace("-", MINUS), change


def _card(key: str, label: str, kind: str, last: Mapping, previous: Mapping | None, since: str = "previous") -> str:
    value = format_value(last.get(key), kind)
    delta_html = ""
    delta = _delta(last.get(key), previous.get(key), kind) if previous is not None else None
    if delta is not None:
        text, change = delta
        css = ""
        if change and key not in _NEUTRAL_DELTA:
            css = " good" if (change > 0) != (key in _LOWER_IS_BETTER) else " bad"
        delta_html = f'<div class="delta{css}">{text} since {escape(since)}</div>'
    return f'<div class="stat stat-{key}"><div class="label">{label}</div><div class="value">{value}</div>{delta_html}</div>'


def _cards(history: Sequence[Mapping]) -> str:
    trained = [row for row in history if "mean_reward" in row] or list(history)
    last = trained[-1]
    previous = trained[-2] if len(trained) > 1 else None
    cards = "".join(_card(key, label, kind, last, previous) for key, label, kind in _CARDS)
    evaluated = [row for row in history if finite(row.get("eval_reward")) is not None]
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
        f'<div class="value">{format_value(best.get(metric), kind)}</div><div class="delta">iteration {escape(iteration)}</div></div>'
    )


# --------------------------------------------------------------------------- charts


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
        chart(title, keys, history, best=title == _BEST_CHART)
        for title, keys in (*METRIC_CHARTS, *reward_charts(history))
        if any(has_key(history, key) for key in keys)
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
    head = "".join(f'<th scope="col">{escape(header)}</th>' for _, header, _ in columns)
    # Newest first: during a long run the latest iteration is what one looks for.
    rows = "".join(
        "<tr>" + "".join(f"<td>{format_value(row.get(key), kind)}</td>" for key, _, kind in columns) + "</tr>" for row in reversed(history)
    )
    return (
        '<h2>Iterations <span class="meta">(newest first)</span></h2>'
        f'<div class="scroll"><table class="iterations"><thead><tr>{head}</tr></thead>'
        f"<tbody>{rows}</tbody></table></div>"
    )


# --------------------------------------------------------------------------- cost

# The pools of StageCost's busy_* seconds, as the cost table names them.
_POOL_ROWS = ("generate", "score", "judge", "reward_model", "train", "driver")


def _cost(history: Sequence[Mapping], accelerators: Mapping[str, tuple[str, int]] | None, prices: Mapping[str, float] | None) -> str:
    """The run's time by stage and by pool, summed over the rows that measured it (reporting.cost):
    what the loop waited on (a partition of the wall clock) and what each pool was busy; on a
    cluster (`accelerators`) each GPU pool's accelerator-hours and dollars at `prices`."""
    summed = totals(history)
    wall = summed.get("wall_s", 0.0)
    if wall <= 0:
        return ""
    waited = waits(summed)
    busy = {pool: summed.get(f"busy_{pool}_s", 0.0) for pool in _POOL_ROWS}
    hours = accelerator_hours(busy, accelerators) if accelerators else {}
    dollars = pool_dollars(hours, accelerators, prices or {}) if accelerators else {}
    head = "<th scope='col'>Stage or pool</th><th scope='col'>Loop waited (s)</th><th scope='col'>Share of wall clock</th>"
    head += "<th scope='col'>Pool busy (s)</th>"
    if accelerators:
        head += "<th scope='col'>Accelerators</th><th scope='col'>Accelerator-hours</th><th scope='col'>Dollars</th>"
    rows = []
    for name in dict.fromkeys((*WAIT_STAGES, *_POOL_ROWS)):
        cells = [escape(name), format_value(waited.get(name), "sec"), f"{waited[name] / wall:.1%}" if name in waited else DASH]
        cells.append(format_value(busy.get(name), "sec") if name in busy else DASH)
        if accelerators:
            kind = accelerators.get(name)
            cells += [escape(f"{kind[0]} x {kind[1]}") if kind else DASH, format_value(hours.get(name), "num"), _dollars(dollars.get(name))]
        rows.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
    total = f"<p class='meta'>{escape(where_the_time_went(summed))}"
    if accelerators:
        total += f"; {summed.get('accelerator_hours', 0.0):.3f} accelerator-hours, {_dollars(summed.get('dollars'))}"
    total += " (eval runs on the generate and score pools: its seconds count as the generate pool's)</p>"
    return (
        "<h2>Where the time went</h2>" + total + f"<div class='scroll'><table class='kv cost'><thead><tr>{head}</tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table></div>"
    )


def _dollars(value: float | None) -> str:
    return f"${value:,.2f}" if value is not None else "no price"


# --------------------------------------------------------------------------- completion and config


def _text(value: object) -> str:
    return DASH if value is None else escape(value)


def _best_completion(best: Mapping | None) -> str:
    if best is None:
        return '<h2>Best completion</h2><p class="placeholder">No completion recorded yet.</p>'
    reward = best.get("reward")
    reward_text = f"{reward:.4g}" if finite(reward) is not None else format_value(reward, "num")
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
        cells.append(f"<tr><td>{label}</td><td>{format_value(score, 'num')}</td><td><code>{text}</code></td></tr>")
    return (
        "<h3>The judge's scores for this group</h3>"
        f'<table class="judge"><thead><tr><th>Completion</th><th>Judge score</th><th>Starts</th></tr></thead><tbody>{"".join(cells)}</tbody></table>'
    )


def _episode(turns: Sequence[Mapping]) -> str:
    """A multi-turn episode turn by turn: the model's turns and the RL environment's set apart (class
    and label), each turn's text escaped."""
    rows = []
    for turn in turns:
        role = str(turn.get("role", ""))
        mine = role == "model"
        label = "model" if mine else f"environment ({role})"
        rows.append(
            f'<div class="turn {"model" if mine else "env"}"><span class="who">{escape(label)}'
            f' <span class="meta">{format_value(turn.get("num_tokens"), "int")} tokens</span></span>'
            f'<pre class="completion">{_text(turn.get("text"))}</pre></div>'
        )
    return f'<div class="episode">{"".join(rows)}</div>'


# Characters of a held-out completion shown in the report's table (the run folder has them whole).
_ANSWER_CHARS = 400


def _correct(value: object) -> str:
    """A greedy answer's correctness (yes, no), or a sampled question's share of correct completions."""
    return ("yes" if value else "no") if isinstance(value, bool) or value is None else f"{float(value):.0%}"


def _held_out(answers: Sequence[Mapping] | None) -> str:
    if not answers:
        return ""
    rows = "".join(
        "<tr>"
        f"<td>{_text(a.get('question'))}</td><td>{_text(a.get('answer'))}</td>"
        f"<td><pre>{escape(_cut(str(a.get('completion', ''))))}</pre></td>"
        f"<td>{format_value(a.get('reward'), 'num')}</td><td>{_correct(a.get('correct'))}</td>"
        "</tr>"
        for a in answers
    )
    # with num_generations_eval: the first of each question's sampled completions, and its means
    sampled = next((len(a["completions"]) for a in answers if a.get("completions")), None)
    columns = (
        ("Greedy answer", "Reward", "Correct") if sampled is None else (f"First of {sampled} sampled answers", "Mean reward", "Correct")
    )
    head = "".join(f'<th scope="col">{h}</th>' for h in ("Question", "Expected", *columns))
    return (
        '<h2>Held-out answers <span class="meta">(a sample of the latest evaluation)</span></h2>'
        f'<div class="scroll"><table class="kv held-out"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>'
    )


# Completions of the last iteration shown in the report (--log-completions; the run folder has the whole sample).
_COMPLETIONS_SHOWN = 12


def _completions(sample: Sequence[Mapping] | None) -> str:
    """The latest iteration's completions (--log-completions): question, completion, reward and
    advantage, every text escaped (completions are the model's output: untrusted)."""
    if not sample:
        return ""
    shown = sample[:_COMPLETIONS_SHOWN]
    rows = "".join(
        "<tr>"
        f"<td>{format_value(c.get('group'), 'int')}</td><td>{_text(c.get('question'))}</td>"
        f"<td><pre>{escape(_cut(str(c.get('completion', ''))))}</pre></td>"
        f"<td>{format_value(c.get('reward'), 'num')}</td><td>{format_value(c.get('advantage'), 'num')}</td>"
        "</tr>"
        for c in shown
    )
    head = "".join(f'<th scope="col">{h}</th>' for h in ("Group", "Question", "Completion", "Reward", "Advantage"))
    iteration = format_value(shown[0].get("iteration"), "int")
    more = f", {len(shown)} of {len(sample)}" if len(sample) > len(shown) else ""
    return (
        f'<h2>Completions of iteration {iteration} <span class="meta">(a sample{more})</span></h2>'
        f'<div class="scroll"><table class="kv completions"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>'
    )


def _cut(text: str) -> str:
    return text if len(text) <= _ANSWER_CHARS else text[:_ANSWER_CHARS] + " \u2026"


def _config(config: Mapping[str, object]) -> str:
    if not config:
        return '<h2>Run config</h2><p class="placeholder">No config recorded.</p>'
    rows = "".join(f'<tr><th scope="row">{escape(key)}</th><td>{escape(value)}</td></tr>' for key, value in config.items())
    return f'<h2>Run config</h2><table class="kv config"><tbody>{rows}</tbody></table>'


# --------------------------------------------------------------------------- public API


def render_report(**parts: Any) -> str:
    """The whole run report as one self-contained HTML document (the local report.html): the
    fragment `render_report_fragment(**parts)` as the body of a page titled `parts["title"]`.
    While the run is going the page reloads itself every REFRESH_S seconds (an HTML meta refresh:
    no script)."""
    return document(parts["title"], parts["status"], render_report_fragment(**parts))


def render_report_fragment(
    *,
    title: str,
    status: str,
    config: dict[str, object],
    history: list[dict[str, object]],
    best_completion: dict[str, object] | None = None,
    message: str | None = None,
    held_out_answers: list[dict[str, object]] | None = None,
    completions: list[dict[str, object]] | None = None,
    accelerators: Mapping[str, tuple[str, int]] | None = None,
    prices: Mapping[str, float] | None = None,
) -> str:
    """The report as an HTML fragment (its style and its content, no document around them): what
    `flyte.report.replace` puts inside the report tab's own page, and the body of `render_report`.
    `accelerators` (a cluster run's GPU pools) and `prices` turn the cost table's busy seconds into
    accelerator-hours and dollars."""
    if status not in STATUSES:
        raise ValueError(f"unknown report status {status!r}; expected one of {', '.join(STATUSES)}")
    if history:
        progress = _cards(history) + _charts(history) + _cost(history, accelerators, prices) + _table(history)
    else:
        progress = '<p class="placeholder empty">No iterations finished yet.</p>'
    body = progress + _best_completion(best_completion) + _completions(completions) + _held_out(held_out_answers) + _config(config)
    n_rows = sum(1 for row in history if "mean_reward" in row)
    return render_page(title, status, message, body, n_rows=n_rows, whole=False)
