"""An exported model's held-out answers compared with those of the adapter it came from (pure: no
Flyte, no torch).

An export can answer differently from its adapter while its weights look right: a tokenizer or
chat template that did not travel, a LoRA scale lost in the merge, a dtype round trip. So each
exported form answers the run's held-out questions, greedily, with the evaluation the run itself
uses, and is compared with the adapter on the same questions:

- agreement: the share of questions whose completion text is identical to the adapter's;
- the paired difference of the held-out metric (`--select-by`'s, as the guard compares
  adapters), d_q = export_q - adapter_q per question q, its mean and the half-width of its 95%
  interval, 1.96 * stdev(d) / sqrt(n).

The export fails when it answers worse beyond that interval (mean(d) + half-width < 0) or when
more than `max_disagreement` of its answers differ from the adapter's (DEFAULT_MAX_DISAGREEMENT).
"""

from __future__ import annotations

import statistics

from grpo_flyte.loop.answers import EvalAnswer
from grpo_flyte.loop.guard import Metric, question_values
from grpo_flyte.loop.metrics import mean_ci95
from grpo_flyte.reporting.figures import change_plus_minus, metric_name, shown, shown_change
from grpo_flyte.types import ExportCheck

__all__ = ["DEFAULT_MAX_DISAGREEMENT", "EXPORT_FILE", "RUN_FAILED_TAIL", "ExportCheck", "check_line", "compare"]

# The share of held-out answers an export may word differently from its adapter. A faithful export
# in float32 answers every question alike; in 16 bits the merged weights round W + s*B@A once where
# the adapter rounds W and s*B@A apart, and a greedy completion that meets a near-tie can take the
# other token and go on differently from there. A broken export (wrong template, lost scale)
# changes most answers.
DEFAULT_MAX_DISAGREEMENT = 0.2
EXPORT_FILE = "export.json"  # the check, written into the exported form
RUN_FAILED_TAIL = "nothing was kept or pushed"  # a run's --export-merged or --push-to-hub that failed its check


def compare(
    export_answers: list[EvalAnswer],
    adapter_answers: list[EvalAnswer],
    metric: Metric,
    max_disagreement: float = DEFAULT_MAX_DISAGREEMENT,
    **names: object,
) -> ExportCheck:
    """The export's answers against the adapter's, question by question (both in the held-out
    order); `names`: the check's form, path, loaded_with, adapter and adapter_iteration."""
    export, adapter = export_answers, adapter_answers
    if len(export) != len(adapter) or not export:
        raise ValueError(f"an export's {len(export)} held-out answers compared with its adapter's {len(adapter)}")
    for ours, theirs in zip(export, adapter, strict=True):
        if ours.question != theirs.question:
            raise ValueError(f"held-out question {ours.question!r} paired with {theirs.question!r}: the orders differ")
    agreement = statistics.fmean(float(a.completion == b.completion) for a, b in zip(export, adapter, strict=True))
    ours, theirs = question_values(export, metric), question_values(adapter, metric)
    difference, half = mean_ci95([a - b for a, b in zip(ours, theirs, strict=True)])
    failures = []
    if difference + (half or 0.0) < 0:
        failures.append(
            f"{metric_name(metric)} {shown(metric, statistics.fmean(ours))} is {shown_change(metric, -difference)} "
            f"{change_plus_minus(metric, half)} below the adapter's {shown(metric, statistics.fmean(theirs))} (paired, 95%)"
        )
    if 1.0 - agreement > max_disagreement:
        failures.append(
            f"{1.0 - agreement:.1%} of its answers differ from the adapter's (at most {max_disagreement:.0%}: --max-disagreement)"
        )
    return ExportCheck(
        questions=len(export),
        metric=metric,
        agreement=agreement,
        max_disagreement=max_disagreement,
        export_accuracy=statistics.fmean(float(a.correct) for a in export),
        adapter_accuracy=statistics.fmean(float(a.correct) for a in adapter),
        export_reward=statistics.fmean(a.reward for a in export),
        adapter_reward=statistics.fmean(a.reward for a in adapter),
        difference=difference,
        difference_ci95=half,
        failure="; ".join(failures) or None,
        **names,
    )


def check_line(check: ExportCheck, failed_tail: str = "nothing was written") -> str:
    """The check in one line, as the export command prints it (a run's own export, which keeps its
    adapters, ends a failure with RUN_FAILED_TAIL)."""
    metric = check.metric
    export_value = check.export_accuracy if metric == "eval_accuracy" else check.export_reward
    adapter_value = check.adapter_accuracy if metric == "eval_accuracy" else check.adapter_reward
    figures = (
        f"{check.agreement:.1%} of {check.questions} held-out answers identical to the adapter's; {metric_name(metric)} "
        f"{shown(metric, export_value)} against the adapter's {shown(metric, adapter_value)}, "
        f"{'+' if check.difference >= 0 else '-'}{shown_change(metric, abs(check.difference))} "
        f"{change_plus_minus(metric, check.difference_ci95)} (paired, 95%)"
    )
    if check.failure is not None:
        return f"export {check.form} failed its check: {check.failure}; {figures}; {failed_tail}"
    return f"export {check.form} verified: {figures}; written to {check.path}, the check in its {EXPORT_FILE}"
