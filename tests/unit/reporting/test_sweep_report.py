"""A sweep's comparison: each config's figures, each setting's mean and worst seed, the report's
overlaid curves, and names and errors shown as text, never as HTML."""

from __future__ import annotations

import pytest

from grpo_flyte.reporting.sweep_report import ConfigOutcome, comparison_lines, figures, render_sweep_report, seed_summary


def _outcome(lr: float, seed: int, accuracies: list[float], status: str = "complete", error: str | None = None) -> ConfigOutcome:
    history = [{"iteration": 0, "eval_accuracy": accuracies[0], "eval_accuracy_ci95": 0.05}]
    for i, acc in enumerate(accuracies[1:], start=1):
        history.append({"iteration": i, "mean_reward": 0.1 * i, "iteration_s": 2.0 * i, "eval_accuracy": acc, "eval_accuracy_ci95": 0.05})
    return ConfigOutcome(
        name=f"lr={lr}_seed={seed}", overrides={"learning_rate": lr, "seed": seed}, seed=seed, status=status, error=error, history=history
    )


def test_a_configs_figures_are_its_first_final_and_best_held_out_and_mean_seconds():
    line = figures(_outcome(1e-4, 0, [0.2, 0.5, 0.4]), "eval_accuracy")
    assert (line["first"], line["final"], line["best"], line["best_iteration"]) == (0.2, 0.4, 0.5, 1)
    assert line["iterations_done"] == 2
    assert line["seconds_per_iteration"] == pytest.approx(3.0)  # (2 + 4) / 2


def test_each_setting_gets_the_mean_and_the_worst_of_its_seeds():
    outcomes = [
        _outcome(1e-4, 0, [0.2, 0.30]),
        _outcome(1e-4, 1, [0.2, 0.40]),
        _outcome(1e-4, 2, [0.2, 0.20]),
        _outcome(2e-4, 0, [0.2, 0.6, 0.10]),
        _outcome(2e-4, 1, [0.2, 0.50]),
    ]
    summary = seed_summary([figures(o, "eval_accuracy") for o in outcomes])
    by_lr = {s["setting"]["learning_rate"]: s for s in summary}
    assert by_lr[1e-4]["seeds"] == [0, 1, 2]
    assert by_lr[1e-4]["final_mean"] == pytest.approx(0.3) and by_lr[1e-4]["final_worst"] == 0.2
    assert by_lr[2e-4]["final_mean"] == pytest.approx(0.3) and by_lr[2e-4]["final_worst"] == 0.1
    assert by_lr[2e-4]["best_mean"] == pytest.approx(0.55) and by_lr[2e-4]["best_worst"] == 0.5


def test_a_failed_config_without_evaluations_counts_in_no_mean():
    outcomes = [
        _outcome(1e-4, 0, [0.2, 0.4]),
        ConfigOutcome(name="bad", overrides={"learning_rate": 1e-4, "seed": 1}, seed=1, status="failed"),
    ]
    (setting,) = seed_summary([figures(o, "eval_accuracy") for o in outcomes])
    assert setting["seeds"] == [0, 1] and setting["evaluated"] == 1 and setting["final_mean"] == 0.4


def test_the_report_overlays_every_config_names_failures_and_escapes_text():
    outcomes = [
        _outcome(1e-4, 0, [0.2, 0.3]),
        _outcome(1e-4, 1, [0.2, 0.4]),
        _outcome(2e-4, 0, [0.2], status="failed", error="reward <script>alert(1)</script> raised"),
    ]
    html = render_sweep_report(outcomes, "failed")
    assert html.startswith("<!DOCTYPE html>") and "2 of 3 configs complete; failed: lr=0.0002_seed=0" in html
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    for title in ("Held-out accuracy", "Held-out reward", "Training reward", "Seconds per iteration"):
        assert title in html
    # one series per config on the held-out accuracy chart, each with its interval band
    chart = html[html.index("Held-out accuracy (95% interval)") : html.index("Held-out reward")]
    assert all(o.name in chart for o in outcomes[:2]) and chart.count("<polygon") == 2
    assert "Over seeds" in html and "0.350" in html  # lr=1e-4: (0.3 + 0.4) / 2


def test_the_console_ends_a_sweep_with_each_configs_line_and_each_settings_seeds():
    outcomes = [
        _outcome(1e-4, 0, [0.2, 0.5, 0.4]),
        _outcome(1e-4, 1, [0.2, 0.3], status="failed", error="reward 'mine' raised: boom"),
    ]
    lines = comparison_lines(outcomes, {"lr=0.0001_seed=0": 2, "lr=0.0001_seed=1": 2})
    assert lines[0] == "sweep: 1 of 2 configs complete; held-out accuracy per config (first -> final, best):"
    assert lines[1].split() == "lr=0.0001_seed=0 complete 2/2 iterations 20.0% -> 40.0% best 50.0% (iteration 1) 3.0 s/iteration".split()
    assert lines[2].split()[:6] == ["lr=0.0001_seed=1", "failed", "1/2", "iterations", "20.0%", "->"]
    assert lines[2].endswith("  failed: reward 'mine' raised: boom")
    assert lines[1].index("->") == lines[2].index("->")  # in columns
    assert lines[3] == ("over seeds 0, 1 of learning_rate=0.0001: final 35.0% mean, 30.0% worst seed; best 40.0% mean, 30.0% worst seed")
    # a config without held-out evaluations (eval_size 0) shows dashes, one seed no seed line
    bare = ConfigOutcome(name="a", overrides={}, seed=0, history=[{"iteration": 1, "mean_reward": 0.5, "iteration_s": 1.0}])
    assert comparison_lines([bare], {"a": 3})[1].split() == [
        "a",
        "pending",
        "1/3",
        "iterations",
        "\u2013",
        "->",
        "\u2013",
        "1.0",
        "s/iteration",
    ]


def test_configs_compare_per_accelerator_hour_on_a_cluster_and_per_wall_hour_anywhere():
    cheap = _outcome(1e-4, 0, [0.2, 0.5, 0.4])
    costly = _outcome(2e-4, 0, [0.2, 0.6])
    for outcome, (wall, accelerator) in ((cheap, (1800.0, 0.25)), (costly, (3600.0, 1.0))):
        for row in outcome.history:
            row.update(wall_s=wall / len(outcome.history), driver_s=0.0, accelerator_hours=accelerator / len(outcome.history))
    first, second = figures(cheap, "eval_accuracy"), figures(costly, "eval_accuracy")
    # cheap: gain 0.5 - 0.2 = 0.3 in 0.25 accelerator-hours (1.2 per hour) and half an hour of wall clock (0.6)
    assert (first["gain"], first["accelerator_hours"]) == (pytest.approx(0.3), pytest.approx(0.25))
    assert (first["gain_per_accelerator_hour"], first["gain_per_hour"]) == (pytest.approx(1.2), pytest.approx(0.6))
    # costly: a larger gain (0.4) at a higher price: 0.4 per accelerator-hour
    assert second["gain_per_accelerator_hour"] == pytest.approx(0.4)
    assert "gain / accelerator-hour" in render_sweep_report([cheap, costly], "complete")
    # a local run's rows have no accelerator-hours: none, not 0
    assert figures(_outcome(1e-4, 1, [0.2, 0.3]), "eval_accuracy")["gain_per_accelerator_hour"] is None


def test_a_pruned_config_is_marked_where_and_why_it_stopped():
    stopped = _outcome(1.0, 0, [0.2, 0.0], status="pruned").model_copy(update={"stopped": "iteration 1: held-out accuracy 0.0% is ..."})
    lines = comparison_lines([_outcome(1e-4, 0, [0.2, 0.3, 0.4]), stopped], {"lr=0.0001_seed=0": 2, "lr=1.0_seed=0": 2})
    assert (
        lines[0] == "sweep: 1 of 2 configs complete, 1 stopped early by --sweep-prune; held-out accuracy per config (first -> final, best):"
    )
    assert lines[2].endswith("pruned at iteration 1: held-out accuracy 0.0% is ...")
    report = render_sweep_report([stopped], "complete")
    assert "stopped by --sweep-prune: lr=1.0_seed=0" in report and "iteration 1: held-out accuracy 0.0% is ..." in report
