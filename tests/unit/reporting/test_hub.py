"""The model card's held-out section says how the questions were answered."""

from __future__ import annotations

from grpo_flyte.config.run import RunConfig
from grpo_flyte.records import EvalMetrics
from grpo_flyte.reporting.hub import model_card
from grpo_flyte.types import MetricsRow


def _history() -> list[MetricsRow]:
    def evaluated(iteration: int, value: float) -> MetricsRow:
        metrics = EvalMetrics(
            eval_reward=value, eval_reward_ci95=0.1, eval_accuracy=value, eval_accuracy_ci95=0.1, eval_format_rate=0.0,
            eval_reward_means={}, eval_reward_errors=0, eval_size=20, eval_s=1.0,
        )  # fmt: skip
        return MetricsRow(iteration=iteration, adapter_version=iteration, eval=metrics)

    return [evaluated(0, 0.2), evaluated(1, 0.4)]


def test_the_card_says_greedy_by_default_and_sampled_with_num_generations_eval():
    greedy = model_card(RunConfig(), _history(), merged=False)
    assert "## Held-out evaluation (20 questions, greedy)" in greedy
    sampled = model_card(RunConfig(num_generations_eval=4, temperature=0.7), _history(), merged=False)
    assert "## Held-out evaluation (20 questions, 4 sampled completions each at temperature 0.7, means per question)" in sampled
    assert "greedy" not in sampled


def test_the_card_gives_the_accuracy_interval_of_a_proportion_and_older_rows_still_render():
    rows = _history()
    rows[1] = rows[1].model_copy(update={"eval": rows[1].eval.model_copy(update={"eval_accuracy_lo": 0.219, "eval_accuracy_hi": 0.613})})
    card = model_card(RunConfig(), rows, merged=False)
    assert "| after (iteration 1) | 0.400 +- 0.100 | 40.0% [21.9%, 61.3%] |" in card
    assert "| before training (iteration 0) | 0.200 +- 0.100 | 20.0%  |" in card  # a row without bounds: none shown
