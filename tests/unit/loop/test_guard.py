"""The run's guard: its pure functions against hand-computed values, then rigged runs through the CLI
(the tiny model) that collapse, roll back, stop, stop early, and resume after a kill."""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import uuid
from pathlib import Path

import pytest
from flyte.io import Dir

from grpo_flyte.config.run import RunConfig
from grpo_flyte.config.training import GuardConfig
from grpo_flyte.launch.cli import main as cli_main
from grpo_flyte.learning import update as policy_update
from grpo_flyte.loop.answers import EvalAnswer
from grpo_flyte.loop.guard import (
    COLLAPSE_Z,
    SIGNAL_RUN,
    GuardState,
    assess,
    best_summary,
    degenerate,
    paired,
    question_values,
    resolve_metric,
    restore_from,
)
from grpo_flyte.loop.state import LoopState
from grpo_flyte.records import EvalMetrics, TrainMetrics
from grpo_flyte.types import AdapterRef, Example, MetricsRow
from tests.support import SUPPORT, warm_python

LR = RunConfig().train.learning_rate  # the runs below keep the default learning rate

DRILL = SUPPORT / "kill_drill.py"
SRC = Path(__file__).resolve().parents[3] / "src"
TINY = ["--max-new-tokens", "8", "--prompts-per-iter", "2", "--group-size", "3", "--eval-size", "2", "--min-informative-groups", "0"]


# --------------------------------------------------------------------------- pure functions


def test_select_by_auto_is_the_accuracy_only_when_every_question_has_an_answer():
    answered = [Example(question="1 + 1", answer="2"), Example(question="2 + 2", answer="4")]
    assert resolve_metric("auto", answered) == "eval_accuracy"
    assert resolve_metric("auto", [*answered, Example(question="a poem", answer=" ")]) == "eval_reward"
    assert resolve_metric("auto", []) == "eval_reward"
    assert resolve_metric("eval_reward", answered) == "eval_reward"


def test_question_values_are_the_accuracy_or_the_reward_per_question():
    answers = [
        EvalAnswer(question="q", answer="2", completion="2", reward=1.2, correct=True, format=True, scores={}),
        EvalAnswer(question="q", answer="3", completion="4", reward=0.2, correct=False, format=True, scores={}),
    ]
    assert question_values(answers, "eval_accuracy") == [1.0, 0.0]
    assert question_values(answers, "eval_reward") == [1.2, 0.2]


def test_with_sampled_completions_a_questions_accuracy_is_its_share_correct():
    """num_generations_eval: `correct` is the share of a question's completions that are correct,
    and the guard compares those shares question by question."""
    answers = [
        EvalAnswer(question="q", answer="2", completion="2", reward=2 / 3, correct=2 / 3, format=1.0, scores={}),
        EvalAnswer(question="q", answer="3", completion="4", reward=0.0, correct=0.0, format=0.0, scores={}),
    ]
    assert question_values(answers, "eval_accuracy") == [pytest.approx(2 / 3), 0.0]
    assert question_values(answers, "eval_reward") == [pytest.approx(2 / 3), 0.0]


def test_the_paired_difference_of_shares_in_between_0_and_1():
    # 3 completions a question: shares 1, 2/3, 1/3, 1 against 1/3, 1/3, 2/3, 0; differences 2/3, 1/3,
    # -1/3, 1: mean 5/12, deviations 1/4, -1/12, -3/4, 7/12: squares sum 9/144 + 1/144 + 81/144 + 49/144
    # = 140/144, sample variance 140 / 432, standard error its root / 2
    mean, half = paired([1.0, 2 / 3, 1 / 3, 1.0], [1 / 3, 1 / 3, 2 / 3, 0.0])
    assert mean == pytest.approx(5 / 12)
    assert half == pytest.approx(COLLAPSE_Z * math.sqrt(140 / 432) / 2)


def test_a_collapse_on_questions_shares_correct():
    g = Replay(on_collapse="warn")
    g.step([2 / 3, 1.0, 1.0, 2 / 3])  # the best: 5/6 of the completions correct
    # every question lost a third or two: differences -2/3, -1, -2/3, -1/3: mean -2/3, sample sd
    # sqrt(2/27), 99% half-width 2.576 * sqrt(2/27) / 2 = 0.35: a collapse
    fallen = g.step([0.0, 0.0, 1 / 3, 1 / 3])
    assert fallen.vs_best == pytest.approx(-2 / 3) and fallen.vs_best_ci99 == pytest.approx(COLLAPSE_Z * math.sqrt(2 / 27) / 2)
    assert (fallen.guard_event, fallen.guard_signal) == ("collapse", "held_out")


def test_the_paired_difference_and_its_99_percent_interval():
    # differences 0, -1, 1, 1: mean 0.25, sample sd sqrt(2.75 / 3), standard error sd / 2
    mean, half = paired([1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0])
    assert mean == pytest.approx(0.25)
    assert half == pytest.approx(COLLAPSE_Z * math.sqrt(2.75 / 3) / 2)
    assert paired([1.0, 1.0], [0.0, 0.0]) == (1.0, 0.0)  # every question moved alike: no spread
    assert paired([1.0], [0.0]) == (1.0, None)
    with pytest.raises(ValueError, match="the held-out set changed"):
        paired([1.0], [0.0, 1.0])


def _train(**values) -> TrainMetrics:
    """An iteration's training metrics: a healthy start's unless `values` say otherwise."""
    fields = dict(
        mean_reward=0.2, accuracy=0.2, format_rate=0.0, reward_means={}, reward_errors=0, loss=0.0, num_rollouts=64,
        num_groups=8, topup_groups=0, num_contributing=32, frac_zero_std_groups=0.5, num_updates=1, num_tokens=900,
        kl=None, clip_fraction=0.0, is_ratio_mean=1.0, is_ratio_max=1.5, is_ess=0.99, entropy=0.5, grad_norm=0.3,
        completion_len_mean=17.0, completion_len_max=64, truncated_fraction=0.0, generate_s=1.0, score_s=0.1,
        train_s=1.0, iteration_s=2.0, generate_tokens_per_s=1.0, score_tokens_per_s=1.0, train_tokens_per_s=1.0,
    )  # fmt: skip
    return TrainMetrics(**{**fields, **values})


def _eval(value: float, n: int = 4) -> EvalMetrics:
    return EvalMetrics(
        eval_reward=value, eval_reward_ci95=0.1, eval_accuracy=value, eval_accuracy_ci95=0.1, eval_format_rate=0.0,
        eval_reward_means={}, eval_reward_errors=0, eval_size=n, eval_s=1.0,
    )  # fmt: skip


def _adapter(version: int) -> AdapterRef:
    return AdapterRef(version=version, dir=Dir(path=f"/run/flyte/adapters/v{version:04d}"))


class Replay:
    """Feeds iterations to `judge` as the driver does, keeping the history and the state."""

    def __init__(self, **config):
        self.config = GuardConfig(**config)
        self.state = GuardState(metric="eval_accuracy")
        self.history: list[MetricsRow] = []

    def step(self, values: list[float] | None = None, last: bool = False, **train):
        i = len(self.history)
        row = MetricsRow(
            iteration=i,
            adapter_version=i,
            train=_train(**train) if i else None,
            eval=_eval(sum(values) / len(values), len(values)) if values is not None else None,
        )
        self.state, record = assess(self.config, self.state, [*self.history, row], values, _adapter(i), last)
        self.history.append(row.model_copy(update={"guard": record}))
        return record


def test_a_new_best_a_tie_and_a_collapse_on_the_held_out_set():
    g = Replay(on_collapse="warn")
    first = g.step([0.0, 0.0, 1.0, 0.0])  # the evaluation before training: the first best, no comparison
    assert (first.best_iteration, first.vs_best, first.guard_event) == (0, None, None)
    better = g.step([1.0, 1.0, 1.0, 0.0])
    assert better.guard_event == "new_best" and better.best_iteration == 1 and better.vs_best == pytest.approx(0.5)
    assert g.state.best.iteration == 1 and g.state.best.values == [1.0, 1.0, 1.0, 0.0]
    tie = g.step([1.0, 1.0, 0.0, 1.0])  # as good, not better: the first to reach a value stays the best
    assert tie.guard_event is None and tie.best_iteration == 1 and g.state.evals_since_best == 1
    # 2 of 4 lost: -0.5 with a 99% half-width of 2.576 * 0.577 / 2 = 0.74: within it, no collapse
    within = g.step([0.0, 0.0, 1.0, 0.0])
    assert within.guard_event is None and within.vs_best == pytest.approx(-0.5)
    assert within.vs_best_ci99 == pytest.approx(COLLAPSE_Z * math.sqrt(1 / 3) / 2)
    fallen = g.step([0.0, 0.0, 0.0, 0.0])  # 3 of 4 lost, none gained: -0.75 +- 0.64
    assert (fallen.guard_event, fallen.guard_signal) == ("collapse", "held_out")
    assert fallen.guard_reason == "held-out accuracy 0.0% is 75.0 pp +- 64.4 pp below the best, iteration 1's 75.0%"
    assert g.state.best.iteration == 1 and g.state.rollbacks == 0 and g.state.stopped is None  # warn changes nothing


def test_rollbacks_scale_the_learning_rate_until_max_rollbacks_then_the_run_stops():
    g = Replay(on_collapse="rollback", max_rollbacks=2, rollback_lr_factor=0.25)
    g.step([1.0, 1.0])
    first = g.step([0.0, 0.0])
    assert (first.guard_event, first.rollbacks, first.lr_scale) == ("rollback", 1, 0.25)
    assert first.guard_reason.endswith(
        "rolled back to iteration 0's adapter and its optimizer state, learning rate x0.25 from here (rollback 1 of at most 2)"
    )
    assert restore_from(g.state, _adapter(1)) == AdapterRef(version=1, dir=_adapter(0).dir)  # the best's weights, the run's version
    assert g.step([0.0, 0.0]).lr_scale == 0.0625 and g.state.rollbacks == 2
    stop = g.step([0.0, 0.0])
    assert stop.guard_event == "stop" and g.state.rollbacks == 2 and g.state.lr_scale == 0.0625
    assert g.state.stopped == stop.guard_reason
    assert stop.guard_reason.startswith("stopped at iteration 3: collapse (held_out), held-out accuracy 0.0% is 100.0 pp")
    assert stop.guard_reason.endswith("; 2 rollbacks already (--max-rollbacks 2)")


def test_the_last_iteration_and_a_run_without_evaluations_only_record_a_collapse():
    g = Replay(on_collapse="rollback")
    g.step([1.0, 1.0])
    last = g.step([0.0, 0.0], last=True)  # nothing follows: neither a rollback nor a stop
    assert last.guard_event == "collapse" and g.state.rollbacks == 0 and g.state.stopped is None
    blind = Replay(on_collapse="rollback")
    blind.step()
    for i in range(3 + SIGNAL_RUN):  # a start to fall from, then the floor
        record = blind.step(accuracy=0.3 if i < 3 else 0.0)
    assert [r.guard.guard_event for r in blind.history if r.guard] == ["collapse"]
    assert record.guard_signal == "accuracy_floor" and blind.state.rollbacks == 0
    assert record.guard_reason == (
        "training accuracy at or below 2% for 3 iterations, from 30% at the start; nothing was evaluated, so nothing to roll back to"
    )


def test_early_stop_after_patience_evaluations_without_a_new_best():
    g = Replay(on_collapse="warn", early_stop_patience=2)
    g.step([0.0, 1.0])
    assert g.step([0.0, 1.0]) is not None and g.state.stopped is None  # 1 without a new best
    g.step(accuracy=0.2)  # an iteration without an evaluation does not count
    assert g.state.evals_since_best == 1
    stop = g.step([1.0, 0.0])
    assert stop.guard_event == "early_stop" and g.state.stopped == stop.guard_reason
    assert stop.guard_reason == "stopped at iteration 3: 2 held-out evaluations in a row without a new best (--early-stop-patience 2)"
    last = Replay(early_stop_patience=1)
    last.step([1.0])
    assert last.step([0.0], last=True).guard_event is None and last.state.stopped is None  # the run ends there anyway


@pytest.mark.parametrize(
    ("signal", "start", "fallen"),
    [
        ("accuracy_floor", {"accuracy": 0.1}, {"accuracy": 0.02}),
        ("no_spread", {"frac_zero_std_groups": 0.6, "mean_reward": 0.2}, {"frac_zero_std_groups": 0.9, "mean_reward": 0.05}),
        ("entropy", {"entropy": 0.5}, {"entropy": 0.02}),
        ("short", {"completion_len_mean": 20.0}, {"completion_len_mean": 5.0}),
        ("ess", {"is_ess": 0.99}, {"is_ess": 0.5}),
    ],
)
def test_each_signal_fires_after_its_run_of_iterations_and_once(signal, start, fallen):
    g = Replay(on_collapse="warn")
    g.step([0.5, 0.5])
    for _ in range(3):
        assert g.step(**start) is None
    for _ in range(SIGNAL_RUN - 1):
        assert g.step(**fallen) is None
    record = g.step(**fallen)
    assert (record.guard_event, record.guard_signal) == ("collapse", signal)
    assert g.state.watch_from == len(g.history)  # what fired is not read again: the next collapse needs a new run
    assert g.step(**fallen) is None


def test_signals_read_measured_iterations_only_and_never_fire_from_the_start():
    g = Replay()
    g.step([0.5, 0.5])
    for _ in range(6):  # a run that starts at the floor has not fallen to it
        assert g.step(accuracy=0.0) is None
    h = Replay(on_collapse="warn")
    h.step([0.5, 0.5])
    for _ in range(3):
        h.step()
    h.step(entropy=0.0)
    h.step(entropy=0.0, num_tokens=0)  # no optimizer step: its 0 is no measurement
    h.step(entropy=0.0, num_tokens=0)
    assert h.step(entropy=0.0) is None
    assert h.step(entropy=0.0).guard_signal == "entropy"  # the third measured one


def test_accuracy_signals_only_when_the_accuracy_selects(monkeypatch):
    history = [MetricsRow(iteration=i, adapter_version=i, train=_train(accuracy=0.3 if i <= 3 else 0.0)) for i in range(1, 7)]
    assert degenerate(history, 1, "eval_accuracy")[0] == "accuracy_floor"
    assert degenerate(history, 1, "eval_reward") is None  # a task without answers: accuracy is not measured
    assert degenerate(history, 5, "eval_accuracy") is None  # since the last collapse: too few iterations


def test_the_summary_names_the_best_iteration_and_the_difference_with_its_interval():
    g = Replay(on_collapse="warn")
    g.step([0.0, 0.0, 1.0, 0.0])
    g.step([1.0, 1.0, 1.0, 0.0])
    g.step([0.0, 0.0, 0.0, 0.0])
    assert best_summary(g.history) == (
        "best adapter: iteration 1 (held-out accuracy 75.0%, --select-by eval_accuracy), 75.0 pp +- 64.4 pp above the final "
        "adapter's 0.0% (iteration 2); paired over the same questions, 99% interval"
    )
    g.step(accuracy=0.2)
    assert best_summary(g.history) == (
        "best adapter: iteration 1 (held-out accuracy 75.0%, --select-by eval_accuracy), 75.0 pp +- 64.4 pp above iteration "
        "2's, the last evaluation's 0.0%; the final adapter (iteration 3) was not evaluated; paired over the same questions, 99% interval"
    )
    h = Replay()
    h.step([0.0, 1.0])
    assert best_summary(h.history) == "best adapter: iteration 0 (held-out accuracy 50.0%, --select-by eval_accuracy), the only evaluation"
    h.step([1.0, 1.0])
    assert best_summary(h.history) == (
        "best adapter: iteration 1 (held-out accuracy 100.0%, --select-by eval_accuracy), 50.0 pp +- 128.8 pp above the best "
        "before it (iteration 0); paired over the same questions, 99% interval"
    )
    assert best_summary([MetricsRow(iteration=1, adapter_version=1, train=_train())]) is None


def test_the_guard_state_survives_the_checkpoint_with_portable_paths(tmp_path):
    from grpo_flyte.loop.state import checkpoint_payload

    g = Replay()
    g.step([1.0, 0.0])
    state = LoopState(iterations_done=0, adapter=_adapter(0), history=g.history, guard=g.state)
    again = LoopState.model_validate_json(checkpoint_payload(state))
    assert again.guard == state.guard and again.history == state.history


def test_a_metrics_row_round_trips_through_its_flat_form():
    g = Replay(on_collapse="rollback")
    g.step([1.0, 1.0])
    g.step([0.0, 0.0], **{"reward_means": {"correct": 0.5}})
    for row in g.history:
        assert MetricsRow.from_flat(json.loads(json.dumps(row.flat()))) == row


# --------------------------------------------------------------------------- through the CLI (the tiny model)


def rigged_reward(tmp_path: Path, run_dir: Path, held_out: list[float]) -> str:
    """A reward module whose held-out scores are set: every question of the evaluation after k
    iterations (k rows in metrics.jsonl, which is rewritten from the checkpoint on a resume) scores
    held_out[k]. A training group's completions score 0, 1, 2 in order, so every step trains. A
    module name of its own: the reward workers of this process keep the modules they imported."""
    module = f"rigged_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(
        "import pathlib\n"
        f"METRICS = pathlib.Path({str(run_dir / 'metrics.jsonl')!r})\n"
        f"HELD_OUT = {held_out!r}\n\n\n"
        "def rigged(completions, **kwargs):\n"
        "    rows = METRICS.read_text().count('\\n') if METRICS.is_file() else 0\n"
        "    if len(completions) == 1:  # a held-out question (training groups have 3)\n"
        "        return [HELD_OUT[min(rows, len(HELD_OUT) - 1)]]\n"
        "    return [float(i) for i in range(len(completions))]\n"
    )
    return f"{module}:rigged=1"


def _args(model: Path, run_dir: Path, iterations: int, reward: str, *more: str) -> list[str]:
    return [
        "--local", "--model", str(model), *TINY, "--iterations", str(iterations), "--eval-every", "1",
        "--rewards", reward, "--select-by", "eval_reward", "--truncated", "keep", "--run-dir", str(run_dir), *more,
    ]  # fmt: skip


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _events(rows: list[dict]) -> dict[int, str]:
    return {r["iteration"]: r["guard_event"] for r in rows if "guard_event" in r}


def _lora(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def _same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def _same_optimizer_state(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(
        a[p].keys() == b[p].keys() and all(torch.equal(torch.as_tensor(a[p][k]), torch.as_tensor(b[p][k])) for k in a[p]) for p in a
    )


@pytest.fixture
def recorded_steps(monkeypatch):
    """Every train step's starting point in this process: the LoRA weights, the optimizer state,
    the learning rate it was given and its step index, then its resulting weights."""
    from peft import get_peft_model_state_dict

    steps: list[dict] = []
    original = policy_update.grpo_step

    def recording(model, optimizer, sequences, train, sampling, steps_=(0, 0), *rest, **kwargs):
        lora = lambda: {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}  # noqa: E731
        step = {"lora": lora(), "optimizer": copy.deepcopy(optimizer.state_dict()["state"]), "lr": train.learning_rate, "index": steps_[0]}
        stats = original(model, optimizer, sequences, train, sampling, steps_, *rest, **kwargs)
        steps.append({**step, "after": lora(), "optimizer_after": copy.deepcopy(optimizer.state_dict()["state"])})
        return stats

    monkeypatch.setattr(policy_update, "grpo_step", recording)
    return steps


def test_a_collapse_rolls_back_to_the_best_adapter_and_its_optimizer_state_at_a_lower_learning_rate(
    tmp_path, tiny_model_dir, monkeypatch, recorded_steps, caplog
):
    import torch

    run_dir = tmp_path / "run"
    reward = rigged_reward(tmp_path, run_dir, [0.0, 1.0, 2.0, -5.0, 2.0])
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level("INFO", logger="grpo_flyte"):
        assert cli_main(_args(tiny_model_dir, run_dir, 5, reward, "--adapters-to-keep", "1")) == 0
    rows = _rows(run_dir)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3, 4, 5] and [r["adapter_version"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert _events(rows) == {1: "new_best", 2: "new_best", 3: "rollback"}
    assert (rows[3]["rollbacks"], rows[3]["lr_scale"], rows[3]["guard_signal"]) == (1, 0.5, "held_out")
    assert [r["best_iteration"] for r in rows] == [0, 1, 2, 2, 2, 2]
    assert rows[3]["vs_best"] == -7.0 and rows[3]["vs_best_ci99"] == 0.0 and rows[4]["vs_best"] == 0.0

    # iteration 4 started from iteration 2's adapter (weights and AdamW state), not from iteration 3's
    # (which the warm optimizer of this process held): the best one's folder was read back
    v2, v3 = recorded_steps[1]["after"], recorded_steps[2]["after"]
    assert not _same(v2, v3)
    assert _same(recorded_steps[3]["lora"], v2)
    best_optimizer = torch.load(run_dir / "flyte" / "adapters" / "v0002" / "optimizer.pt", weights_only=True)["state"]
    assert _same_optimizer_state(recorded_steps[3]["optimizer"], best_optimizer)
    assert not _same_optimizer_state(recorded_steps[2]["optimizer_after"], best_optimizer)  # iteration 3's own state
    # the learning rate halved from the rollback on; the schedule's step index goes on with the run's versions
    assert [s["lr"] for s in recorded_steps] == [LR, LR, LR, LR * 0.5, LR * 0.5]
    assert [s["index"] for s in recorded_steps] == [0, 1, 2, 3, 4] and [r["lr"] for r in rows[4:]] == [LR * 0.5, LR * 0.5]

    # the best adapter's folder outlived --adapters-to-keep 1; best/ holds it, adapter/ the final one
    assert sorted(p.name for p in (run_dir / "flyte" / "adapters").iterdir()) == ["v0002", "v0005"]
    assert _same(_lora(run_dir / "best"), v2) and not (run_dir / "best" / "optimizer.pt").exists()
    assert json.loads((run_dir / "best" / "grpo_state.json").read_text())["version"] == 2
    assert _same(_lora(run_dir / "adapter"), recorded_steps[4]["after"])
    lines = [r.getMessage() for r in caplog.records if r.name == "grpo_flyte"]
    rollback = "ROLLBACK (held_out): held-out reward -5.000 is 7.000 +- 0.000 below the best, iteration 2's 2.000; rolled back to"
    assert any(line.strip().startswith(rollback) for message in lines for line in message.splitlines())
    assert lines[-1] == (
        "best adapter: iteration 2 (held-out reward 2.000, --select-by eval_reward), 0.000 +- 0.000 above the final adapter's "
        "2.000 (iteration 5); paired over the same questions, 99% interval"
    )
    report = (run_dir / "report.html").read_text()
    charts = {figure.split("</figcaption>")[0]: figure for figure in report.split("<figure><figcaption>")[1:]}
    assert all('class="guard-marker rollback"' in charts[title] for title in ("Loss", "Held-out evaluation", "Entropy"))
    assert 'class="guard-marker best"' in charts["Held-out evaluation"] and 'class="guard-marker best"' not in charts["Loss"]
    assert "best adapter: iteration 2" in report and "Best adapter (held-out reward)" in report


@pytest.mark.parametrize("mode", ["warn", "stop"])
def test_warn_goes_on_and_stop_ends_the_run_at_the_first_collapse(tmp_path, tiny_model_dir, monkeypatch, caplog, mode):
    run_dir = tmp_path / "run"
    reward = rigged_reward(tmp_path, run_dir, [0.0, 1.0, -5.0, -5.0, 1.0])
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level("INFO", logger="grpo_flyte"):
        assert cli_main(_args(tiny_model_dir, run_dir, 4, reward, "--on-collapse", mode)) == 0
    rows = _rows(run_dir)
    if mode == "warn":
        assert _events(rows) == {1: "new_best", 2: "collapse", 3: "collapse"} and len(rows) == 5
        assert json.loads((run_dir / "adapter" / "grpo_state.json").read_text())["version"] == 4
    else:
        assert _events(rows) == {1: "new_best", 2: "stop"} and len(rows) == 3
        messages = [r.getMessage() for r in caplog.records if r.name == "grpo_flyte"]
        assert messages[-2].startswith(
            "stopped at iteration 2: collapse (held_out), held-out reward -5.000 is 6.000 +- 0.000 below the best"
        )
        assert any(line.strip() == messages[-2] for message in messages[:-2] for line in message.splitlines())  # the iteration's line too
        assert json.loads((run_dir / "adapter" / "grpo_state.json").read_text())["version"] == 2
    assert json.loads((run_dir / "best" / "grpo_state.json").read_text())["version"] == 1


def test_a_run_that_keeps_collapsing_stops_after_max_rollbacks(tmp_path, tiny_model_dir, monkeypatch, caplog):
    run_dir = tmp_path / "run"
    reward = rigged_reward(tmp_path, run_dir, [0.0, 1.0, -5.0])
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level("INFO", logger="grpo_flyte"):
        assert cli_main(_args(tiny_model_dir, run_dir, 6, reward, "--max-rollbacks", "2", "--rollback-lr-factor", "0.1")) == 0
    rows = _rows(run_dir)
    assert _events(rows) == {1: "new_best", 2: "rollback", 3: "rollback", 4: "stop"} and len(rows) == 5
    assert [r["lr"] for r in rows[1:]] == pytest.approx([LR, LR, LR * 0.1, LR * 0.01])
    messages = [r.getMessage() for r in caplog.records if r.name == "grpo_flyte"]
    assert messages[-2].startswith("stopped at iteration 4: collapse (held_out)") and messages[-2].endswith(
        "2 rollbacks already (--max-rollbacks 2)"
    )
    assert messages[-1].startswith("best adapter: iteration 1 (held-out reward 1.000, --select-by eval_reward), 6.000 +- 0.000 above")
    state = LoopState.model_validate_json((run_dir / "flyte" / "checkpoint").read_bytes())
    assert state.guard.stopped == messages[-2] and state.guard.rollbacks == 2
    # a resume of the stopped run trains nothing more
    assert cli_main([*_args(tiny_model_dir, run_dir, 6, reward, "--max-rollbacks", "2", "--rollback-lr-factor", "0.1"), "--resume"]) == 0
    assert _rows(run_dir) == rows


def test_early_stop_patience_stops_a_stalled_run(tmp_path, tiny_model_dir, monkeypatch, caplog):
    run_dir = tmp_path / "run"
    reward = rigged_reward(tmp_path, run_dir, [0.0])
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level("INFO", logger="grpo_flyte"):
        assert cli_main(_args(tiny_model_dir, run_dir, 6, reward, "--early-stop-patience", "2")) == 0
    rows = _rows(run_dir)
    assert _events(rows) == {2: "early_stop"} and len(rows) == 3
    messages = [r.getMessage() for r in caplog.records if r.name == "grpo_flyte"]
    assert messages[-2] == "stopped at iteration 2: 2 held-out evaluations in a row without a new best (--early-stop-patience 2)"
    assert messages[-1] == (
        "nothing trained beat the start: the best adapter is iteration 0's, the untrained one (held-out reward 0.000, "
        "--select-by eval_reward), 0.000 +- 0.000 above the final adapter's 0.000 (iteration 2); paired over the same "
        "questions, 99% interval"
    )
    assert json.loads((run_dir / "best" / "grpo_state.json").read_text())["version"] == 0


def test_an_untrained_best_is_merged_only_once_an_adapter_is_chosen(tmp_path, tiny_model_dir, monkeypatch, caplog):
    """No trained adapter beat the start: --export-merged skips the merge and the last line says why
    and how to choose; a resume with --export-adapter final merges the last iteration's adapter."""
    run_dir = tmp_path / "run"
    reward = rigged_reward(tmp_path, run_dir, [0.0])
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level("INFO", logger="grpo_flyte"):
        assert cli_main(_args(tiny_model_dir, run_dir, 2, reward, "--export-merged")) == 0
    last = [r.getMessage() for r in caplog.records if r.name == "grpo_flyte"][-1]
    assert last.startswith("nothing trained beat the start: the best adapter is iteration 0's, the untrained one")
    assert last.endswith(
        "; --export-merged skipped: best/ is the untrained start; choose with --export-adapter final (the last iteration's "
        "adapter) or best (the start), e.g. a local run: python -m grpo_flyte.driver --local --resume --run-dir DIR "
        "--export-adapter final"
    )
    assert not (run_dir / "merged").exists()
    caplog.clear()
    with caplog.at_level("INFO", logger="grpo_flyte"):
        assert cli_main(_args(tiny_model_dir, run_dir, 2, reward, "--export-merged", "--export-adapter", "final", "--resume")) == 0
    messages = [r.getMessage() for r in caplog.records if r.name == "grpo_flyte"]
    assert any(m.startswith("merged model (base + adapter v2;") for m in messages), messages
    assert "skipped" not in messages[-1]
    assert (run_dir / "merged" / "config.json").is_file()
    assert json.loads((run_dir / "config.json").read_text())["guard"]["export_adapter"] == "final"


def test_unchosen_start_names_what_it_skips_only_when_nothing_was_chosen():
    from grpo_flyte.loop.publishing import unchosen_start

    g = Replay()
    g.step([1.0, 0.0])
    g.step([0.0, 0.0])  # below the start: the best stays iteration 0
    assert best_summary(g.history).startswith("nothing trained beat the start: the best adapter is iteration 0's")
    both = RunConfig(export_merged=True, push_to_hub="me/model")
    assert unchosen_start(both, g.history).startswith("--export-merged and --push-to-hub skipped: best/ is the untrained start")
    assert unchosen_start(RunConfig(), g.history) is None  # nothing to ship
    chosen = RunConfig(export_merged=True, export_adapter="best")
    assert unchosen_start(chosen, g.history) is None  # the start, chosen on purpose
    g.step([1.0, 1.0])  # a trained adapter beats the start
    assert unchosen_start(both, g.history) is None
    h = Replay()
    h.step([1.0, 0.0])  # only the start evaluated, nothing trained
    assert unchosen_start(both, h.history) is None


# A kill before the rollback is checkpointed (the iteration is done again: one rollback), and after
# it, while the next step trains from the best adapter (the resume trains from it too: no second
# one); pipelined, after it (the batches in flight, regenerated from the restored adapter, are too).
@pytest.mark.parametrize(("point", "nth", "flags"), [("checkpoint", 4, []), ("train", 4, []), ("train", 4, ["--max-staleness", "1"])])
def test_a_guarded_run_killed_around_its_rollback_resumes_with_one_rollback_and_the_same_best(tmp_path, tiny_model_dir, point, nth, flags):
    run_dir = tmp_path / "run"
    reward = rigged_reward(tmp_path, run_dir, [0.0, 1.0, 2.0, -5.0, 2.0])
    args = _args(tiny_model_dir, run_dir, 5, reward, *flags)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(SRC)])}
    killed = warm_python.run([DRILL, point, str(nth), *args], env=env, timeout=300, cli=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    state = LoopState.model_validate_json((run_dir / "flyte" / "checkpoint").read_bytes())
    assert state.iterations_done == (2 if point == "checkpoint" else 3)
    resumed = warm_python.run(["-m", "grpo_flyte.driver", *args, "--resume"], env=env, timeout=300, cli=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = _rows(run_dir)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert _events(rows) == {1: "new_best", 2: "new_best", 3: "rollback"}
    assert [r["lr"] for r in rows[1:]] == [LR, LR, LR, LR * 0.5, LR * 0.5]
    state = LoopState.model_validate_json((run_dir / "flyte" / "checkpoint").read_bytes())
    assert (state.guard.rollbacks, state.guard.lr_scale, state.guard.best.iteration) == (1, 0.5, 2)
    assert _same(_lora(run_dir / "best"), _lora(run_dir / "flyte" / "adapters" / "v0002"))
    if flags:  # as in the run that was not killed (below)
        assert [(r["staleness_max"], r["stale_dropped"]) for r in rows[1:]] == [(0, 0), (1, 0), (1, 0), (0, 0), (1, 0)]


def test_a_pipelined_run_regenerates_its_batches_from_the_restored_adapter(tmp_path, tiny_model_dir, monkeypatch):
    run_dir = tmp_path / "run"
    reward = rigged_reward(tmp_path, run_dir, [0.0, 1.0, 2.0, -5.0, 2.0])
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli_main(_args(tiny_model_dir, run_dir, 5, reward, "--max-staleness", "1")) == 0
    rows = _rows(run_dir)
    assert _events(rows) == {1: "new_best", 2: "new_best", 3: "rollback"}
    # one version behind, but iteration 4's batch came from the restored adapter (the version the run
    # was at, 3, with iteration 2's weights): nothing the collapsed adapter generated was trained
    assert [(r["staleness_max"], r["stale_dropped"]) for r in rows[1:]] == [(0, 0), (1, 0), (1, 0), (0, 0), (1, 0)]
    state = LoopState.model_validate_json((run_dir / "flyte" / "checkpoint").read_bytes())
    assert state.in_flight == {} and state.guard.rollbacks == 1


def test_a_rollback_with_two_train_processes(tmp_path, tiny_model_dir, monkeypatch):
    run_dir = tmp_path / "run"
    reward = rigged_reward(tmp_path, run_dir, [0.0, 1.0, -5.0, 1.0])
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(SRC)]))  # the spawned train processes
    assert cli_main(_args(tiny_model_dir, run_dir, 3, reward, "--train-processes", "2")) == 0
    rows = _rows(run_dir)
    assert _events(rows) == {1: "new_best", 2: "rollback"}
    assert [(r["train_world_size"], r["lr"]) for r in rows[1:]] == [(2, LR), (2, LR), (2, LR * 0.5)]


def test_on_the_recipe_sweeps_runs_the_guard_leaves_every_healthy_run_alone_and_catches_the_collapse():
    """The thresholds' evidence (docs/measurements.md, "The guard"): the sweep's finished runs, as the
    guard reads them. A run counts as collapsed when its held-out accuracy ended more than 10 points
    below its best and below its start."""
    data = json.loads((Path(__file__).resolve().parents[2] / "data" / "guard_sweep_runs.json").read_text())
    first: dict[str, tuple[int, str] | None] = {}
    for name, run in data["runs"].items():
        g = Replay(on_collapse="warn")
        for row in run["rows"]:
            values = [float(c) for c in run["correct"][str(row["iteration"])]] if str(row["iteration"]) in run["correct"] else None
            if row["iteration"] == 0:
                g.step(values)
            else:
                g.step(values, **{k: v for k, v in row.items() if k != "iteration"})
        events = [(r.iteration, r.guard.guard_signal) for r in g.history if r.guard and r.guard.guard_event == "collapse"]
        first[name] = events[0] if events else None
    assert {name for name, run in data["runs"].items() if run["collapsed"]} == {"lr=0.0005, constant, seed 1"}
    assert first == {name: (10, "held_out") if run["collapsed"] else None for name, run in data["runs"].items()}
