"""--sweep-prune's decisions: the paired test against the leader (hand-computed), the configs meeting
at each evaluation, a config that leaves releasing the others, a sweep of one never pruning."""

from __future__ import annotations

import asyncio
import math

import pytest

from grpo_flyte.config.run import RunConfig
from grpo_flyte.loop import pruning
from grpo_flyte.loop.pruning import Pruning, prune


def test_a_config_stops_only_when_clearly_below_the_leader():
    # lr=1: every question 1 below the leader's: differences -1, sd 0, a half-width 0: stopped
    stopped = prune({"lr=2e-4": [1.0, 1.0, 1.0, 1.0], "lr=1": [0.0, 0.0, 0.0, 0.0]}, "eval_accuracy")
    assert list(stopped) == ["lr=1"]
    assert stopped["lr=1"] == (
        "held-out accuracy 0.0% is 100.0 pp +- 0.0 pp (99%) below the leader lr=2e-4's 100.0%, paired over the same 4 questions"
    )
    # differences 0, 0, -1, -1: mean -0.5, sd sqrt(1/3), 99% half-width 2.576 sqrt(1/3) / 2 = 0.744 > 0.5: both go on
    assert 2.576 * math.sqrt(1 / 3) / 2 == pytest.approx(0.7436, abs=1e-4)
    assert prune({"a": [1.0, 1.0, 1.0, 1.0], "b": [1.0, 1.0, 0.0, 0.0]}, "eval_accuracy") == {}
    # one config, or one question (no interval): nobody stops
    assert prune({"a": [1.0, 0.0]}, "eval_accuracy") == {}
    assert prune({"a": [1.0], "b": [0.0]}, "eval_accuracy") == {}


def test_the_configs_meet_at_each_evaluation_and_one_that_leaves_releases_the_others():
    decided = []
    configs = {"run-a": ("a", RunConfig(eval_every=1)), "run-b": ("b", RunConfig(eval_every=1)), "run-c": ("c", RunConfig(eval_every=1))}

    async def sweep():
        with pruning.pruning(configs, lambda *d: decided.append(d)):
            first = asyncio.gather(
                pruning.evaluated("run-a", 1, "eval_accuracy", [1.0, 1.0, 1.0]),
                pruning.evaluated("run-b", 1, "eval_accuracy", [0.0, 0.0, 0.0]),
            )
            await asyncio.sleep(0.05)
            assert not first.done()  # run-c has not reported: a and b wait for it
            pruning.leave("run-c")  # it ended (finished, or failed): they decide without it
            a, b = await first
            assert a is None and b.startswith("held-out accuracy 0.0% is 100.0 pp")
            # b stopped: at the next evaluation a is alone and goes on at once, unpruned
            assert await pruning.evaluated("run-a", 2, "eval_accuracy", [0.0, 0.0, 0.0]) is None
            assert await pruning.evaluated("run-b", 2, "eval_accuracy", [1.0, 1.0, 1.0]) is None  # stopped: not counted

    asyncio.run(sweep())
    assert [(name, iteration) for name, iteration, _ in decided] == [("b", 1)]


def test_a_config_not_due_to_evaluate_is_not_waited_for_and_a_lone_config_never_prunes():
    configs = {"run-a": ("a", RunConfig(eval_every=1)), "run-b": ("b", RunConfig(eval_every=2))}

    async def sweep():
        with pruning.pruning(configs, lambda *d: None) as sweep:
            assert isinstance(sweep, Pruning)
            # iteration 1: b evaluates every 2, so a decides alone
            assert await asyncio.wait_for(pruning.evaluated("run-a", 1, "eval_accuracy", [0.0]), 1.0) is None
        with pruning.pruning({"run-a": configs["run-a"]}, lambda *d: None) as alone:
            assert alone is None
            assert await pruning.evaluated("run-a", 2, "eval_accuracy", [0.0]) is None

    asyncio.run(sweep())


def test_a_config_already_past_an_evaluation_is_not_waited_for_there():
    # a resumed sweep: a is at iteration 3 when b, killed earlier, evaluates iteration 2
    configs = {"run-a": ("a", RunConfig(eval_every=1)), "run-b": ("b", RunConfig(eval_every=1))}

    async def sweep():
        with pruning.pruning(configs, lambda *d: None):
            b_at_2 = asyncio.ensure_future(pruning.evaluated("run-b", 2, "eval_reward", [0.0, 0.0]))
            await asyncio.sleep(0.05)
            assert not b_at_2.done()  # a may still come to iteration 2
            a_at_3 = asyncio.ensure_future(pruning.evaluated("run-a", 3, "eval_reward", [1.0, 1.0]))
            assert await asyncio.wait_for(b_at_2, 1.0) is None  # a is past 2: b decides alone, and goes on
            a, b = await asyncio.wait_for(asyncio.gather(a_at_3, pruning.evaluated("run-b", 3, "eval_reward", [0.0, 0.0])), 1.0)
            assert a is None and b.startswith("held-out reward 0.000")  # at 3 both are there: b stops

    asyncio.run(sweep())


def test_a_config_at_its_last_evaluation_is_not_stopped_but_still_leads():
    # a and b end at iteration 2, c at 4; at 2, b and c are clearly below a (every question 1 below)
    configs = {
        "run-a": ("a", RunConfig(eval_every=1, iterations=2)),
        "run-b": ("b", RunConfig(eval_every=1, iterations=2)),
        "run-c": ("c", RunConfig(eval_every=1, iterations=4)),
    }
    decided = []

    async def sweep():
        with pruning.pruning(configs, lambda *d: decided.append(d)):
            a, b, c = await asyncio.wait_for(
                asyncio.gather(
                    pruning.evaluated("run-a", 2, "eval_accuracy", [1.0, 1.0, 1.0]),
                    pruning.evaluated("run-b", 2, "eval_accuracy", [0.0, 0.0, 0.0]),
                    pruning.evaluated("run-c", 2, "eval_accuracy", [0.0, 0.0, 0.0]),
                ),
                1.0,
            )
            # b's last evaluation: stopping it saves nothing, it ends complete; c has 2 iterations left
            assert a is None and b is None and c.startswith("held-out accuracy 0.0% is 100.0 pp")

    asyncio.run(sweep())
    assert [(name, iteration) for name, iteration, _ in decided] == [("c", 2)]
