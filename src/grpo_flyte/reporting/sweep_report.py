"""This module compares a sweep's configs: each config's outcome and figures (a line of
`sweep.jsonl`), each setting's mean and worst seed, and the report that overlays every config's
curves.

Pure functions of the configs' metrics rows (`MetricsRow.flat()`), so a local sweep (its run
folders) and a cluster sweep (its `RunResult`s) compare the same way.
"""

from __future__ import annotations

from statistics import fmean
from typing import Any, Literal

from pydantic import BaseModel

from grpo_flyte.reporting.charts import overlay_chart
from grpo_flyte.reporting.cost import totals
from grpo_flyte.reporting.html import escape, render_page

Status = Literal["pending", "running", "complete", "failed", "pruned"]
# The curves the comparison overlays: (title, metrics key).
OVERLAID = (
    ("Held-out accuracy (95% interval)", "eval_accuracy"),
    ("Held-out reward (95% interval)", "eval_reward"),
    ("Training reward", "mean_reward"),
    ("Seconds per iteration", "iteration_s"),
)
REPORT_TITLE = "grpo_flyte sweep"


class ConfigOutcome(BaseModel):
    """Where one config of a sweep stands: what it changes, its base model, its status, why it
    failed or where and why --sweep-prune stopped it, its rows."""

    name: str
    overrides: dict[str, Any]
    seed: int
    model: str = ""
    status: Status = "pending"
    error: str | None = None
    history: list[dict[str, Any]] = []
    stopped: str | None = None  # --sweep-prune stopped it: at which iteration and why (loop.pruning)


def held_out_key(outcomes: list[ConfigOutcome]) -> str:
    """The held-out figure the table ranks by: accuracy where the rows have it, else reward."""
    has_accuracy = any(row.get("eval_accuracy") is not None for o in outcomes for row in o.history)
    return "eval_accuracy" if has_accuracy else "eval_reward"


def figures(outcome: ConfigOutcome, key: str) -> dict[str, Any]:
    """One config's line of `sweep.jsonl`: its outcome and base model, final and best held-out
    figure (and at which iteration), iterations done and mean seconds per iteration."""
    evaluated = [(row["iteration"], row[key]) for row in outcome.history if row.get(key) is not None]
    seconds = [row["iteration_s"] for row in outcome.history if row.get("iteration_s") is not None]
    best = max(evaluated, key=lambda point: point[1]) if evaluated else None
    return {
        "name": outcome.name,
        "overrides": outcome.overrides,
        "seed": outcome.seed,
        "model": outcome.model,
        "status": outcome.status,
        "error": outcome.error,
        "stopped": outcome.stopped,
        "iterations_done": max((row["iteration"] for row in outcome.history), default=0),
        "metric": key,
        "first": evaluated[0][1] if evaluated else None,
        "final": evaluated[-1][1] if evaluated else None,
        "best": best[1] if best else None,
        "best_iteration": best[0] if best else None,
        "seconds_per_iteration": fmean(seconds) if seconds else None,
        **cost_figures(outcome.history, evaluated[0][1] if evaluated else None, best[1] if best else None),
    }


def cost_figures(history: list[dict[str, Any]], first: float | None, best: float | None) -> dict[str, Any]:
    """What a config cost and what it bought: its wall hours, accelerator-hours and dollars (summed
    over its rows; None where its rows have none: a local run has no accelerators), the held-out
    gain (best - first) and that gain per accelerator-hour and per wall hour."""
    summed = totals(history)
    hours = summed.get("wall_s", 0.0) / 3600.0 or None
    accelerator = summed.get("accelerator_hours") or None
    gain = best - first if best is not None and first is not None else None
    return {
        "wall_hours": hours,
        "accelerator_hours": accelerator,
        "dollars": summed.get("dollars"),
        "gain": gain,
        "gain_per_accelerator_hour": gain / accelerator if gain is not None and accelerator else None,
        "gain_per_hour": gain / hours if gain is not None and hours else None,
    }


def seed_summary(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each setting's figures over its seeds (the configs that differ in the seed only): the mean
    and the worst seed's final and best held-out figure, over the configs that have one."""
    settings: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        setting = {k: v for k, v in line["overrides"].items() if k != "seed"}
        settings.setdefault(repr(sorted(setting.items())), []).append({**line, "setting": setting})
    summary = []
    for members in settings.values():
        finals = [m["final"] for m in members if m["final"] is not None]
        bests = [m["best"] for m in members if m["best"] is not None]
        summary.append(
            {
                "setting": members[0]["setting"],
                "seeds": sorted(m["seed"] for m in members),
                "evaluated": len(finals),
                "final_mean": fmean(finals) if finals else None,
                "final_worst": min(finals) if finals else None,
                "best_mean": fmean(bests) if bests else None,
                "best_worst": min(bests) if bests else None,
            }
        )
    return summary


def _shown(key: str, value: float | None) -> str:
    """A held-out figure as the console writes it: accuracy in percent, reward to 3 places."""
    return "\u2013" if value is None else f"{value:.1%}" if key == "eval_accuracy" else f"{value:.3f}"


def comparison_lines(outcomes: list[ConfigOutcome], iterations: dict[str, int]) -> list[str]:
    """The comparison as the console ends a sweep with it: a line per config (status, iterations
    done of `iterations[name]`, first -> final held-out figure, the best and its iteration, seconds
    per iteration, why it failed) and, with several seeds, each setting's mean and worst seed."""
    key = held_out_key(outcomes)
    lines = [figures(o, key) for o in outcomes]
    what = "accuracy" if key == "eval_accuracy" else "reward"
    done = sum(line["status"] == "complete" for line in lines)
    pruned = sum(line["status"] == "pruned" for line in lines)
    stopped = f", {pruned} stopped early by --sweep-prune" if pruned else ""
    out = [f"sweep: {done} of {len(lines)} configs complete{stopped}; held-out {what} per config (first -> final, best):"]
    width = max(len(line["name"]) for line in lines)
    for line in lines:
        best = f"best {_shown(key, line['best'])} (iteration {line['best_iteration']})" if line["best"] is not None else ""
        seconds = f"{line['seconds_per_iteration']:.1f} s/iteration" if line["seconds_per_iteration"] is not None else ""
        cells = [
            line["name"].ljust(width),
            line["status"].ljust(8),
            f"{line['iterations_done']}/{iterations.get(line['name'], '?')} iterations".ljust(16),
            f"{_shown(key, line['first'])} -> {_shown(key, line['final'])}".ljust(17),
            best.ljust(25),
            seconds,
        ]
        out.append(
            "  ".join(cells).rstrip()
            + (f"  failed: {line['error']}" if line["error"] else "")
            + (f"  pruned at {line['stopped']}" if line["stopped"] else "")
        )
    if len({o.seed for o in outcomes}) > 1:
        for s in seed_summary(lines):
            setting = ", ".join(f"{k}={v}" for k, v in s["setting"].items())
            out.append(
                f"over seeds {', '.join(map(str, s['seeds']))}{' of ' + setting if setting else ''}: "
                f"final {_shown(key, s['final_mean'])} mean, {_shown(key, s['final_worst'])} worst seed; "
                f"best {_shown(key, s['best_mean'])} mean, {_shown(key, s['best_worst'])} worst seed"
            )
    return out


def _number(value: Any) -> str:
    return "\u2013" if value is None else f"{value:.3f}" if isinstance(value, float) else escape(value)


def _setting(overrides: dict[str, Any]) -> str:
    return escape(", ".join(f"{k}={v}" for k, v in overrides.items()) or "(the base config)")


def _table(head: list[str], rows: list[list[str]]) -> str:
    heads = "".join(f'<th scope="col">{escape(h)}</th>' for h in head)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<div class="scroll"><table class="iterations"><thead><tr>{heads}</tr></thead><tbody>{body}</tbody></table></div>'


def render_sweep_fragment(outcomes: list[ConfigOutcome], status: str) -> str:
    """The comparison as a Flyte report tab takes it (`render_sweep_report` without the document around it)."""
    return render_sweep_report(outcomes, status, whole=False)


def render_sweep_report(outcomes: list[ConfigOutcome], status: str, whole: bool = True) -> str:
    """The comparison page: every config's curves overlaid, the table of final and best held-out
    figures, what each cost and its gain per accelerator-hour (on a cluster) and per wall hour (and
    which configs failed, and why), and with several seeds each setting's mean and
    worst seed. Names and errors are escaped: a config's values and an error's text are data."""
    key = held_out_key(outcomes)
    lines = [figures(o, key) for o in outcomes]
    histories = {o.name: o.history for o in outcomes}
    charts = "".join(overlay_chart(title, metric, histories) for title, metric in OVERLAID)
    table = _table(
        [
            "config",
            "model",
            "status",
            f"first {key}",
            f"final {key}",
            f"best {key}",
            "best at",
            "iterations",
            "s / iteration",
            "gain (best - first)",
            "accelerator-hours",
            "gain / accelerator-hour",
            "gain / wall hour",
            "why it failed",
            "stopped by --sweep-prune (where, why)",
        ],
        [
            [
                escape(line["name"]),
                escape(line["model"]),
                escape(line["status"]),
                _number(line["first"]),
                _number(line["final"]),
                _number(line["best"]),
                _number(line["best_iteration"]),
                _number(line["iterations_done"]),
                _number(line["seconds_per_iteration"]),
                _number(line["gain"]),
                _number(line["accelerator_hours"]),
                _number(line["gain_per_accelerator_hour"]),
                _number(line["gain_per_hour"]),
                escape(line["error"] or ""),
                escape(line["stopped"] or ""),
            ]
            for line in lines
        ],
    )
    body = f'<h2>Held-out figures</h2>{table}<h2>Curves</h2><section class="charts">{charts}</section>'
    if len({o.seed for o in outcomes}) > 1:
        summary = seed_summary(lines)
        body += "<h2>Over seeds</h2>" + _table(
            ["setting", "seeds", f"final {key}: mean", "worst seed", f"best {key}: mean", "worst seed"],
            [
                [
                    _setting(s["setting"]),
                    escape(", ".join(map(str, s["seeds"]))),
                    _number(s["final_mean"]),
                    _number(s["final_worst"]),
                    _number(s["best_mean"]),
                    _number(s["best_worst"]),
                ]
                for s in summary
            ],
        )
    failed = [o.name for o in outcomes if o.status == "failed"]
    done = sum(o.status == "complete" for o in outcomes)
    pruned = [o.name for o in outcomes if o.status == "pruned"]
    message = (
        f"{done} of {len(outcomes)} configs complete"
        + (f"; stopped by --sweep-prune: {', '.join(pruned)}" if pruned else "")
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    page_status = status if status in ("running", "complete", "failed") else "running"
    rows = sum(1 for o in outcomes for row in o.history if "mean_reward" in row)
    return render_page(REPORT_TITLE, page_status, message, body, n_rows=rows, whole=whole)
