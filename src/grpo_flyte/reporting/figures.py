"""This module writes the held-out figures as a person reads them: a value (a percentage for the
accuracy), a difference (percentage points), an interval's half-width, the metric's name. The
console, the report, the model card and the guard's messages share them."""

from __future__ import annotations


def plus_minus(half_width: float | None) -> str:
    """A 95% interval's half-width as the console, report and model card show it."""
    return f"+- {half_width:.3f}" if half_width is not None else "(one question: no interval)"


def accuracy_interval(lo: float | None, hi: float | None) -> str:
    """The held-out accuracy's 95% interval (a proportion's: inside [0, 1]) as '[10.9%, 25.5%]';
    '' for a row written before the bounds existed."""
    return f"[{lo:.1%}, {hi:.1%}]" if lo is not None and hi is not None else ""


def shown(metric: str | None, value: float) -> str:
    """A value of a held-out metric (eval_accuracy, eval_reward) as a person reads it: a percentage for the accuracy."""
    return f"{value:.1%}" if metric == "eval_accuracy" else f"{value:.3f}"


def shown_change(metric: str | None, value: float) -> str:
    """A difference of a held-out metric: percentage points for the accuracy."""
    return f"{value * 100:.1f} pp" if metric == "eval_accuracy" else f"{value:.3f}"


def change_plus_minus(metric: str | None, half_width: float | None) -> str:
    """An interval's half-width around a difference of a held-out metric."""
    return f"+- {shown_change(metric, half_width)}" if half_width is not None else "(one question: no interval)"


def metric_name(metric: str | None) -> str:
    return "held-out accuracy" if metric == "eval_accuracy" else "held-out reward"
