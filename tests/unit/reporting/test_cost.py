"""Where a run's time went: accelerator-hours, dollars at a price table, the done line's words."""

from __future__ import annotations

import pytest

from grpo_flyte.config.constants import LIST_PRICES
from grpo_flyte.config.run import RunConfig
from grpo_flyte.loop.metrics import stage_cost
from grpo_flyte.records import EvalMetrics, TrainMetrics
from grpo_flyte.report_helpers import render_report
from grpo_flyte.reporting.cost import (
    accelerator_hours,
    cluster_accelerators,
    pool_dollars,
    prices_with_defaults,
    totals,
    where_the_time_went,
)
from grpo_flyte.types import MetricsRow

# The stated price table of these tests: dollars per accelerator-hour.
PRICES = {"L4": 0.80, "A100": 4.00}


def test_dollars_at_a_stated_price_table():
    pools = cluster_accelerators({"generate": "L4:1", "train": "A100:4", "judge": "H100:1"}, train_nodes=1)
    assert pools == {"generate": ("L4", 1), "train": ("A100", 4), "judge": ("H100", 1)}
    busy = {"generate": 1800.0, "train": 900.0, "judge": 3600.0, "score": 500.0, "driver": 100.0}
    hours = accelerator_hours(busy, pools)
    # generate: 1800 s x 1 GPU = 0.5 h; train: 900 s x 4 GPUs = 1.0 h; judge 1 h; CPU pools none
    assert hours == {"generate": pytest.approx(0.5), "train": pytest.approx(1.0), "judge": pytest.approx(1.0)}
    # 0.5 h x $0.80 = $0.40; 1.0 h x $4.00 = $4.00; no price for H100: None, not $0
    assert pool_dollars(hours, pools, PRICES) == {"generate": pytest.approx(0.40), "train": pytest.approx(4.00), "judge": None}
    # two train nodes double the train step's accelerators
    assert cluster_accelerators({"train": "A100:4"}, train_nodes=2) == {"train": ("A100", 8)}


def test_prices_given_replace_the_list_price_of_their_type_only():
    table = prices_with_defaults(RunConfig(prices={"L4": 0.5, "H100": 6.0}).prices, LIST_PRICES)
    assert table == {"L4": 0.5, "A100": LIST_PRICES["A100"], "H100": 6.0, "H200": LIST_PRICES["H200"]}
    with pytest.raises(ValueError, match="expected dollars per hour"):
        RunConfig(prices={"L4": -1.0})
    with pytest.raises(ValueError, match="without the count"):
        RunConfig(prices={"L4:1": 1.0})


def _train(**timings: float) -> TrainMetrics:
    base = dict(
        mean_reward=0.0, accuracy=0.0, format_rate=0.0, reward_means={}, reward_errors=0, loss=0.0, num_rollouts=1, num_groups=1,
        topup_groups=0, num_contributing=0, frac_zero_std_groups=0.0, num_updates=0, num_tokens=0, kl=None, clip_fraction=0.0,
        is_ratio_mean=1.0, is_ratio_max=1.0, entropy=0.0, grad_norm=0.0, completion_len_mean=1.0, completion_len_max=1,
        truncated_fraction=0.0, generate_tokens_per_s=0.0, score_tokens_per_s=0.0, train_tokens_per_s=0.0, iteration_s=0.0,
    )  # fmt: skip
    return TrainMetrics(**base, **timings)


def _held_out(eval_s: float) -> EvalMetrics:
    return EvalMetrics(eval_reward=0.0, eval_reward_ci95=None, eval_accuracy=0.0, eval_accuracy_ci95=None, eval_format_rate=0.0,
                       eval_reward_means={}, eval_reward_errors=0, eval_size=1, eval_s=eval_s)  # fmt: skip


def test_a_rows_stages_partition_its_wall_clock_and_the_cluster_rows_cost_is_priced():
    # synchronous: the batch took 10 s (8 generating, 2 of scoring tail), training 5, evaluation 3,
    # in a row of 20 s: the driver's own 2 s are what is left
    train = _train(generate_s=8.0, score_s=2.0, batch_wait_s=10.0, train_s=5.0, score_busy_s=6.0, judge_s=4.0)
    row = MetricsRow(iteration=1, adapter_version=1, train=train, eval=_held_out(3.0))
    cost = stage_cost(row, 20.0)
    assert (cost.wait_generate_s, cost.wait_score_s, cost.wait_train_s, cost.wait_eval_s, cost.driver_s) == (8.0, 2.0, 5.0, 3.0, 2.0)
    assert (cost.busy_generate_s, cost.busy_score_s, cost.busy_judge_s, cost.busy_train_s) == (11.0, 6.0, 4.0, 5.0)
    assert cost.accelerator_hours is None and cost.dollars is None  # a local run: no accelerators
    # pipelined: the batch was generated ahead and the trainer waited 1 s for its scoring tail only
    ahead = MetricsRow(iteration=2, adapter_version=2, train=_train(generate_s=8.0, score_s=2.0, batch_wait_s=1.0, train_s=5.0))
    waited = stage_cost(ahead, 7.0)
    assert (waited.wait_generate_s, waited.wait_score_s, waited.driver_s) == (0.0, 1.0, 1.0)
    # on a cluster: generate 11 s x 1 L4 + judge 4 s x 1 L4 + train 5 s x 4 A100 = 15 L4-s + 20 A100-s
    pools = {"generate": ("L4", 1), "judge": ("L4", 1), "reward_model": ("L4", 1), "train": ("A100", 4)}
    priced = stage_cost(row, 20.0, pools, PRICES)
    assert priced.accelerator_hours == pytest.approx(35.0 / 3600)
    assert priced.dollars == pytest.approx(15.0 / 3600 * 0.80 + 20.0 / 3600 * 4.00)
    # a type without a price leaves the dollars unknown, not low
    assert stage_cost(row, 20.0, {**pools, "judge": ("H100", 1)}, PRICES).dollars is None


def test_the_done_line_names_the_largest_stage_and_its_share():
    rows = [
        MetricsRow(iteration=0, adapter_version=0, eval=_held_out(3.0)),
        MetricsRow(iteration=1, adapter_version=1, train=_train(generate_s=60.0, score_s=2.0, batch_wait_s=62.0, train_s=25.0)),
    ]
    rows = [r.model_copy(update={"cost": stage_cost(r, wall)}) for r, wall in zip(rows, (5.0, 95.0), strict=True)]
    summed = totals([r.flat() for r in rows])
    assert summed["wall_s"] == 100.0 and summed["driver_s"] == pytest.approx(10.0)  # 2 + 8
    assert where_the_time_went(summed) == "generate 60% of 1m40s, train 25%, driver 10%, eval 3%, score 2%"
    # the rows round-trip through metrics.jsonl; an old row without them reads as before
    assert MetricsRow.from_flat(rows[1].flat()) == rows[1]
    assert MetricsRow.from_flat({"iteration": 0, "adapter_version": 0}).cost is None
    assert where_the_time_went(totals([{"iteration": 1, "generate_s": 3.0}])) == ""
    # the report's table: what the loop waited on and what each pool was busy, with accelerators on a cluster
    report = render_report(title="t", status="complete", config={}, history=[r.flat() for r in rows],
                           accelerators={"generate": ("L4", 1), "train": ("A100", 1)}, prices=PRICES)  # fmt: skip
    section = report.split("<h2>Where the time went</h2>", 1)[1].split("</table>", 1)[0]
    assert "generate 60% of 1m40s" in section and "L4 x 1" in section and "A100 x 1" in section


def test_a_local_runs_stage_seconds_add_up_to_its_wall_clock(tmp_path, tiny_model_dir, caplog):
    import json
    import logging
    import time

    from grpo_flyte.launch.cli import main as cli_main

    tiny = ["--max-new-tokens", "8", "--prompts-per-iter", "2", "--group-size", "3", "--eval-size", "2", "--min-informative-groups", "0"]
    run_dir = tmp_path / "run"
    started = time.perf_counter()
    with caplog.at_level(logging.INFO):
        assert cli_main(["--local", "--model", str(tiny_model_dir), *tiny, "--iterations", "2", "--run-dir", str(run_dir)]) == 0
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows:  # each row's stages are a partition of its wall clock, the driver's share what is left
        stages = row["wait_generate_s"] + row["wait_score_s"] + row["wait_train_s"] + row["wait_eval_s"] + row["driver_s"]
        assert stages == pytest.approx(row["wall_s"], rel=1e-6)
        assert row["busy_train_s"] == row.get("train_s", 0.0) and row.get("accelerator_hours") is None
    # the rows cover the command from its start (its checks and Flyte's start-up are the first row's
    # driver_s); what they leave is the argument parsing, the last checkpoint and report, and the
    # adapter's export (measured: 11.5 s of 12.0 s, 96%; 0.9 leaves room for a loaded machine)
    covered = sum(row["wall_s"] for row in rows)
    assert 0.9 * wall <= covered <= wall, (covered, wall)
    done = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("done: "))
    assert "; the time went to " in done and "% of " in done
