"""Multi-turn episodes: the environments, the splicing of replies, the budgets, and the trainer
seeing exactly the generator's tokens with only the model's in the loss."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_flyte.config.errors import make_config
from grpo_flyte.config.run import RunConfig
from grpo_flyte.engine.episodes import Budgets, Splicer, new_environment, play_episodes, run_episode
from grpo_flyte.engine.sampling import sub_seed as turn_seed
from grpo_flyte.errors import ConfigError, EnvironmentSpecError, EpisodeError
from grpo_flyte.launch.cli import main as cli_main
from grpo_flyte.learning import grpo
from grpo_flyte.learning.update import build_sequences
from grpo_flyte.multiturn import (
    CALCULATOR_TOOLS_PHRASINGS,
    Calculator,
    GuessNumber,
    Reply,
    builtin_split,
    evaluate,
    load_environment,
)
from grpo_flyte.reward_fns import is_correct
from grpo_flyte.types import Example, RewardParts, Rollout, RolloutGroup, ScoredGroup
from tests.support import SUPPORT, warm_python
from tests.support.console import failed_run_lines


@pytest.fixture(scope="module")
def tokenizer(embedded_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_dir))


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def scripted(tokenizer, turns: list[tuple[str, str]], seen: list | None = None):
    """A stand-in model: turn k is the k-th (text, finish) given, with log-prob -(position+1)/10."""
    script = iter(turns)

    async def sample_turn(context: list[int], max_new_tokens: int, turn: int) -> Rollout:
        text, finish = next(script)
        ids = _ids(tokenizer, text)[:max_new_tokens]
        if seen is not None:
            seen.append((list(context), max_new_tokens, turn))
        if len(_ids(tokenizer, text)) > max_new_tokens:
            finish = "length"
        return Rollout(completion_ids=ids, sampling_logprobs=[-(i + 1) / 10 for i in range(len(ids))], finish_reason=finish, text=text)

    return sample_turn


def _guess(secret: int) -> GuessNumber:
    env = GuessNumber()
    env.reset(Example(question="q", answer=str(secret)))
    return env


BUDGETS = Budgets(max_turns=4, max_turn_tokens=64, max_episode_tokens=512, tool_timeout_s=5.0)


def _play(env, tokenizer, turns, budgets=BUDGETS, prompt=(1, 2, 3), seen=None) -> Rollout:
    return asyncio.run(run_episode(env, list(prompt), scripted(tokenizer, turns, seen), Splicer(tokenizer, chat=True), budgets))


# --------------------------------------------------------------------------- the calculator


@pytest.mark.parametrize(
    ("expression", "value"), [("374*829", 310046), ("12 * (3 + 4)", 84), ("7/2", 3.5), ("-2**3", -8), ("1,000 + 1", 1001), ("2^10", 1024)]
)
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "problem"),
    [
        ("__import__('os')", "unsupported"),
        ("abc", "unsupported"),
        ("1/0", "division by zero"),
        ("2**999", "too large"),
        ("1 +", "not an arithmetic"),
    ],
)
def test_the_calculator_refuses_anything_else_with_a_message(expression, problem):
    with pytest.raises(ValueError, match=problem):
        evaluate(expression)


def test_a_calculator_step_answers_a_call_reports_a_bad_one_and_ends_without_one():
    env = Calculator()
    assert env.step("Let me see. <calc>374*829</calc>") == Reply("310046", role="tool", tool_call=True)
    bad = env.step("<calc>x*2</calc>")
    assert bad.tool_call and bad.error and bad.content.startswith("error: unsupported")
    assert env.step("#### 310046") == Reply(done=True)


def test_a_guess_game_says_higher_or_lower_and_rewards_fewer_guesses():
    env = GuessNumber()
    env.reset(Example(question="q", answer="13"))
    assert env.step("10").content == "Higher."
    assert env.step("I guess 15").content == "Lower."
    assert env.step("no idea").content.startswith("Please reply with one number")
    end = env.step("13")
    assert end.done and end.reward == pytest.approx(0.8)  # third guess: 1 - 0.1 * 2


def test_the_built_in_datasets_are_disjoint_fixed_and_answerable():
    train, held = builtin_split("calculator", "train"), builtin_split("calculator", "eval")
    assert len(held) == 500 and len(train) > 5000
    assert not {e.question for e in train} & {e.question for e in held}
    assert builtin_split("calculator", "eval") == held
    a, b = (int(x) for x in held[0].question.removeprefix("What is ").removesuffix("?").split(" * "))
    assert 100 <= a <= 999 and 100 <= b <= 999 and held[0].answer == str(a * b)
    assert held[0].prompt[-1].content == held[0].question  # the question is the last message
    guesses = builtin_split("guess", "eval")
    assert sorted({int(e.answer) for e in guesses}) == list(range(1, 21))


def test_the_tools_calculator_asks_the_calculators_products_in_four_phrasings_in_turn():
    """calculator_tools: the calculator's products, answers and split, the k-th question of each split
    asked in phrasing k mod 4 (the worked exchange's own first), the same in the user message."""
    for split in ("train", "eval"):
        plain, tools = builtin_split("calculator", split), builtin_split("calculator_tools", split)
        assert [e.answer for e in tools] == [e.answer for e in plain]
        for k, (p, t) in enumerate(zip(plain[:8], tools[:8], strict=True)):
            a, b = p.question.removeprefix("What is ").removesuffix("?").split(" * ")
            assert t.question == CALCULATOR_TOOLS_PHRASINGS[k % 4].format(a=a, b=b) and t.prompt[-1].content == t.question
            assert t.prompt[1].content == "What is 12 * 34?"  # the worked exchange
    [first, second, third, fourth] = builtin_split("calculator_tools", "eval")[:4]
    assert (first.question, second.question) == ("What is 511 * 488?", "Multiply 275 by 941.")
    assert (third.question, fourth.question, fourth.answer) == ("329 times 138 = ?", "Compute the product of 699 and 532.", "371868")


# --------------------------------------------------------------------------- splicing and the mask


def test_an_episode_is_the_generators_tokens_with_the_reply_spliced_in_the_chat_template(tokenizer):
    seen: list = []
    rollout = _play(Calculator(), tokenizer, [("Let me compute. <calc>12*3</calc>", "stop"), ("#### 36<|im_end|>", "stop")], seen=seen)
    turn1, turn2 = _ids(tokenizer, "Let me compute. <calc>12*3</calc>"), _ids(tokenizer, "#### 36<|im_end|>")
    # the model's turn ended at the stop string, so the reply closes it with the template's marker
    reply = _ids(tokenizer, "<|im_end|>\n<|im_start|>tool\n36<|im_end|>\n<|im_start|>assistant\n")
    assert rollout.completion_ids == turn1 + reply + turn2
    assert rollout.model_mask == [True] * len(turn1) + [False] * len(reply) + [True] * len(turn2)
    # the second turn was sampled from exactly the prompt, the first turn and the reply
    assert seen[1][0] == [1, 2, 3, *turn1, *reply]
    # sampling log-probs line up with the model's tokens; the environment's are placeholders
    assert rollout.sampling_logprobs[: len(turn1)] == [-(i + 1) / 10 for i in range(len(turn1))]
    assert rollout.sampling_logprobs[len(turn1) : len(turn1) + len(reply)] == [0.0] * len(reply)
    episode = rollout.episode
    assert (episode.end, episode.tool_calls, episode.tool_errors, episode.reward) == ("done", 1, 0, None)
    assert [(t.role, t.text) for t in episode.turns] == [
        ("model", "Let me compute. <calc>12*3</calc>"),
        ("tool", "36"),
        ("model", "#### 36"),
    ]
    assert rollout.answer_text == "#### 36" and rollout.num_model_tokens == len(turn1) + len(turn2)
    # the text the template renders for this conversation is what the tokens say
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, *episode.messages()], tokenize=False)
    assert tokenizer.decode(rollout.completion_ids) in rendered


def test_a_turn_that_ended_with_its_end_of_turn_token_is_not_closed_twice(tokenizer):
    rollout = _play(_guess(13), tokenizer, [("10<|im_end|>", "stop"), ("13<|im_end|>", "stop")])
    assert rollout.episode.reward == pytest.approx(0.9) and rollout.episode.end == "done"
    reply = _ids(tokenizer, "\n<|im_start|>user\nHigher.<|im_end|>\n<|im_start|>assistant\n")
    turn = _ids(tokenizer, "10<|im_end|>")
    assert rollout.completion_ids[len(turn) : len(turn) + len(reply)] == reply


def test_the_trainer_trains_on_the_generators_tokens_and_only_the_models(tokenizer):
    """Token by token: the trainer's input is the prompt and the episode's ids; the positions in
    the loss predict exactly the model's tokens, with the sampling log-prob of each."""
    rollout = _play(Calculator(), tokenizer, [("<calc>12*3</calc>", "stop"), ("#### 36<|im_end|>", "stop")])
    other = _play(Calculator(), tokenizer, [("#### 35<|im_end|>", "stop")])
    prompt = [1, 2, 3]
    group = RolloutGroup(
        index=0, example=Example(question="q", answer="36"), adapter_version=0, prompt_ids=prompt, rollouts=[rollout, other], generate_s=0.0
    )
    scored = ScoredGroup(
        group=group, rewards=[RewardParts(reward=1.0, correct=True, format=True), RewardParts(reward=0.0, correct=False, format=True)]
    )
    sequences, total = build_sequences([scored], RunConfig().train)
    assert total == 2
    seq = sequences[0]
    batch = grpo.pad_batch([seq], pad_id=0)
    assert batch.input_ids[0, : seq.length].tolist() == prompt + rollout.completion_ids
    model_tokens = [t for t, own in zip(rollout.completion_ids, rollout.model_mask, strict=True) if own]
    assert batch.targets[batch.predict_mask].tolist() == model_tokens
    assert seq.sampling_logprobs == [lp for lp, own in zip(rollout.sampling_logprobs, rollout.model_mask, strict=True) if own]
    assert seq.num_trained == len(model_tokens) < len(rollout.completion_ids)
    # a mask that does not fit the sequence is refused rather than misaligned
    with pytest.raises(ValueError, match="model_mask has"):
        grpo.pad_batch([grpo.TrainSequence(prompt, [5, 6], 1.0, None, False, (True,))], pad_id=0)


# --------------------------------------------------------------------------- budgets


def test_the_turn_budget_ends_an_episode_before_a_reply_nobody_reads(tokenizer):
    turns = [(f"{n}<|im_end|>", "stop") for n in (1, 2, 3, 4)]
    budgets = Budgets(max_turns=2, max_turn_tokens=64, max_episode_tokens=512, tool_timeout_s=5.0)
    rollout = _play(_guess(20), tokenizer, turns, budgets)
    assert rollout.episode.end == "turns" and rollout.finish_reason == "length"
    assert [t.role for t in rollout.episode.turns] == ["model", "user", "model"]
    assert rollout.model_mask[-1] is True  # no trailing environment tokens


def test_a_turn_cut_at_its_token_limit_ends_the_episode(tokenizer):
    budgets = Budgets(max_turns=4, max_turn_tokens=3, max_episode_tokens=512, tool_timeout_s=5.0)
    rollout = _play(Calculator(), tokenizer, [("I will think about this for a long while", "stop")], budgets)
    assert rollout.episode.end == "turn_tokens" and len(rollout.completion_ids) == 3


def test_the_episode_token_budget_bounds_turns_and_replies(tokenizer):
    seen: list = []
    budgets = Budgets(max_turns=4, max_turn_tokens=64, max_episode_tokens=26, tool_timeout_s=5.0)
    turns = [("<calc>1+1</calc>", "stop"), ("and then a much longer second turn than the budget leaves room for", "stop")]
    rollout = _play(Calculator(), tokenizer, turns, budgets, seen=seen)
    assert rollout.episode.end == "episode_tokens" and rollout.finish_reason == "length"
    assert len(rollout.completion_ids) == 26
    assert seen[1][1] == 26 - (len(seen[1][0]) - 3)  # the second turn may only fill what is left
    # a reply that does not fit (with room for one model token after it) ends the episode instead
    short = Budgets(max_turns=4, max_turn_tokens=64, max_episode_tokens=12, tool_timeout_s=5.0)
    cut = _play(Calculator(), tokenizer, turns, short)
    assert cut.episode.end == "episode_tokens" and [t.role for t in cut.episode.turns] == ["model"]


# --------------------------------------------------------------------------- failing environments


class _Raises:
    def step(self, text):
        raise KeyError("lookup failed")


class _Slow:
    def step(self, text):
        time.sleep(2)
        return Reply("late")


class _WrongType:
    def step(self, text):
        return "a string, not a Reply"


def test_a_tool_that_raises_or_hangs_answers_the_model_with_an_error_and_is_counted(tokenizer):
    turns = [("a<|im_end|>", "stop"), ("b<|im_end|>", "stop")]
    budgets = Budgets(max_turns=2, max_turn_tokens=64, max_episode_tokens=512, tool_timeout_s=0.2)
    raised = _play(_Raises(), tokenizer, turns, budgets)
    # both turns were answered with the error (the last one too: a last step may end the episode)
    assert raised.episode.tool_errors == 2 and raised.episode.turns[1].text == "error: KeyError: 'lookup failed'"
    assert raised.episode.end == "turns"
    slow = _play(_Slow(), tokenizer, turns, budgets)
    assert slow.episode.tool_errors == 2 and "longer than 0.2 s" in slow.episode.turns[1].text


def test_a_right_guess_on_the_last_turn_still_ends_the_game_with_its_reward(tokenizer):
    budgets = Budgets(max_turns=2, max_turn_tokens=64, max_episode_tokens=512, tool_timeout_s=5.0)
    rollout = _play(_guess(7), tokenizer, [("5<|im_end|>", "stop"), ("7<|im_end|>", "stop")], budgets)
    assert rollout.episode.end == "done" and rollout.episode.reward == pytest.approx(0.9)


def test_a_step_that_returns_no_reply_fails_with_the_episode_shown(tokenizer):
    with pytest.raises(EpisodeError, match=r"_WrongType.step returned str .*expected a grpo_flyte.Reply.*model: my first turn"):
        _play(_WrongType(), tokenizer, [("my first turn<|im_end|>", "stop")])


def test_an_environment_that_does_not_load_is_one_line_naming_it(tmp_path, monkeypatch):
    (tmp_path / "bad_envs.py").write_text("class NoStep:\n    pass\n\nclass BadStop:\n    stop = '</x>'\n    def step(self, t): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = {
        "no_such_module:Env": "cannot import module 'no_such_module'",
        "bad_envs:Missing": "has no class 'Missing'",
        "bad_envs:NoStep": r"has no step\(self, text\) method",
        "bad_envs:BadStop": "BadStop.stop is '</x>'; expected a tuple",
    }
    for name, message in cases.items():
        with pytest.raises(EnvironmentSpecError, match=message) as info:
            load_environment(name)
        assert "\n" not in str(info.value) and str(info.value).startswith("env ")
    with pytest.raises(ConfigError, match=r"--env='calc': unknown environment 'calc'"):
        make_config(env="calc")


# --------------------------------------------------------------------------- config and rewards


def test_a_built_in_environment_brings_its_dataset_and_rewards_unless_given():
    guess = make_config(env="guess")
    assert (guess.data.dataset, guess.scoring.rewards) == ("guess", {"env": 1.0})
    mine = make_config(env="guess", rewards={"correct": 1.0}, dataset="arithmetic")
    assert (mine.data.dataset, mine.scoring.rewards) == ("arithmetic", {"correct": 1.0})
    assert make_config().episode.multi_turn is False and make_config().data.dataset == "arithmetic"


def test_turn_seeds_differ_by_row_and_turn_and_repeat_for_the_same_inputs():
    seeds = {turn_seed(7, row, turn) for row in range(4) for turn in range(4)}
    assert len(seeds) == 16 and turn_seed(7, 1, 2) == turn_seed(7, 1, 2)


def test_the_tool_result_in_the_transcript_does_not_make_an_answer_correct(tokenizer):
    """The answer rewards read the model's last turn: a tool reply holding the right number does
    not count as the model's answer."""
    rollout = _play(Calculator(), tokenizer, [("<calc>12*3</calc>", "stop"), ("I am not sure.<|im_end|>", "stop")])
    assert "36" in rollout.text and not is_correct(rollout.answer_text, "36")


# --------------------------------------------------------------------------- local runs

TINY = ["--max-new-tokens", "8", "--prompts-per-iter", "2", "--group-size", "3", "--eval-size", "2", "--min-informative-groups", "0"]
DRILL = SUPPORT / "kill_drill.py"


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_multi_turn_run_writes_every_file_and_resumes_after_a_kill(tmp_path, tiny_model_dir, monkeypatch):
    """A custom environment by module:Class: episodes of three model turns and two replies, the
    metrics, the report's episode, and a resume after a SIGKILL in iteration 2's generation."""
    monkeypatch.syspath_prepend(str(SUPPORT))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]))
    run_dir = tmp_path / "run"
    args = ["--local", "--model", str(tiny_model_dir), *TINY, "--env", "chatty_env:Chatty", "--max-turns", "3",
            "--max-episode-tokens", "80", "--iterations", "2", "--run-dir", str(run_dir)]  # fmt: skip
    # the engine batches: 1 (held-out, turn 1) ... the kill lands in iteration 1's episodes
    killed = warm_python.run([DRILL, "generate", "8", *args], timeout=600, cli=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert cli_main([*args, "--resume"]) == 0

    rows = _rows(run_dir)
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["num_rollouts"] == 6 and row["turns_mean"] <= 3 and row["tool_calls_mean"] == 0
        assert sum(v for k, v in row.items() if k.startswith("ended/")) == 6
        assert row["env_tokens_mean"] > 0 and row["model_tokens_mean"] <= 3 * 8
        assert row["completion_len_max"] <= 80
    assert {"eval_tool_call_rate", "eval_turns_mean"} <= rows[0].keys()
    for name in ("config.json", "report.html", "eval/iter-0000.jsonl", "eval/iter-0002.jsonl", "adapter/adapter_model.safetensors"):
        assert (run_dir / name).is_file(), name
    report = (run_dir / "report.html").read_text()
    assert "Best episode of the last iteration" in report and '<div class="turn env">' in report
    assert "turn 1: go on" in report and "Turns and tokens per episode (multi-turn)" in report
    assert json.loads((run_dir / "config.json").read_text())["episode"]["env"] == "chatty_env:Chatty"


# Run a command and print the largest resident memory it reached, in KB (`getrusage` of the children).
PEAK_RSS = "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"


def test_a_run_whose_tool_returns_long_pages_holds_memory_for_its_tokens_not_their_square(tmp_path, tiny_model_dir, monkeypatch):
    """Every reply a 20,000-character page (~4,500 tokens: a fetched web page, a file): episodes
    of ~8,500 tokens, generated, scored and trained on (beta > 0: every episode is in the loss).
    The run's memory is the model's and the tokens' (the prefill in chunks, attention through the
    fused kernel past its scores limit, a sequence longer than micro_batch_tokens checkpointed):
    0.8 GB. Before, (tokens x tokens) attention scores in the prefill and the train step: 5.9 GB."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]))
    run_dir = tmp_path / "run"
    # the tiny model with a window for the episodes (its config says 1024; the check before start
    # refuses a longer context)
    model = tmp_path / "long-window"
    shutil.copytree(tiny_model_dir, model)
    settings = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**settings, "max_position_embeddings": 16384}))
    args = ["--local", "--model", str(model), "--env", "chatty_env:Pages", "--max-turns", "3", "--max-episode-tokens", "12000",
            "--max-new-tokens", "8", "--prompts-per-iter", "1", "--group-size", "2", "--eval-size", "0", "--min-informative-groups", "0",
            "--beta", "0.04", "--iterations", "1", "--run-dir", str(run_dir)]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", PEAK_RSS, sys.executable, "-m", "grpo_flyte.driver", *args],
                          capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    [row] = [r for r in _rows(run_dir) if r["iteration"] == 1]
    assert row["completion_len_mean"] > 8000 and row["num_tokens"] > 0  # long episodes, trained on
    assert int(done.stdout.split()[-1]) / 1024 < 2000  # MB


@pytest.mark.parametrize("env", ["Broken", "Slow"])
def test_failed_environment_steps_are_counted_through_the_cli(tmp_path, tiny_model_dir, monkeypatch, env, caplog):
    """Every stepped turn fails (it raises, or outlives --tool-timeout-s): the run finishes and
    tool_errors counts each one. A turn cut at --max-new-tokens is not stepped (its episode ends)."""
    monkeypatch.syspath_prepend(str(SUPPORT))
    run_dir = tmp_path / "run"
    args = ["--local", "--model", str(tiny_model_dir), *TINY, "--env", f"chatty_env:{env}", "--max-turns", "2",
            "--tool-timeout-s", "0.5", "--iterations", "1", "--run-dir", str(run_dir)]  # fmt: skip
    assert cli_main(args) == 0
    row = _rows(run_dir)[-1]
    ends = {k.removeprefix("ended/"): v for k, v in row.items() if k.startswith("ended/")}
    assert set(ends) <= {"turns", "turn_tokens"} and sum(ends.values()) == 6
    stepped = round(row["turns_mean"] * 6) - ends.get("turn_tokens", 0)
    assert stepped > 0 and row["tool_errors"] == stepped
    assert "eval_tool_errors" in _rows(run_dir)[0]
    assert f"tool errors {stepped}" in caplog.text


def test_a_step_returning_a_string_is_the_consoles_last_line(tmp_path, tiny_model_dir):
    """A bug in the environment fails the run: the one line naming the class and the type it
    returned is the console's last line, the traceback in the run folder's run.log."""
    run_dir = tmp_path / "run"
    args = ["--local", "--model", str(tiny_model_dir), *TINY, "--env", "chatty_env:Stringly", "--iterations", "1", "--run-dir", str(run_dir)]  # fmt: skip
    lines = failed_run_lines(args, import_from=SUPPORT)
    assert "run failed: Stringly.step returned str 'just text'; expected a grpo_flyte.Reply" in lines[-1]
    assert "Traceback" in (run_dir / "run.log").read_text()


@pytest.mark.parametrize("env", ["calculator", "guess"])
def test_the_built_in_environments_run_locally(tmp_path, tiny_model_dir, env):
    run_dir = tmp_path / env
    args = [
        "--local",
        "--model",
        str(tiny_model_dir),
        *TINY,
        "--env",
        env,
        "--max-turns",
        "2",
        "--iterations",
        "1",
        "--run-dir",
        str(run_dir),
    ]
    assert cli_main(args) == 0
    rows = _rows(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["data"]["dataset"] == env and rows[1]["num_rollouts"] == 6
    assert (rows[1].get("reward/env") is not None) == (env == "guess")
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file() and (run_dir / "report.html").is_file()


def test_a_bad_environment_stops_the_run_before_it_starts(tmp_path, tiny_model_dir, capsys):
    run_dir = tmp_path / "run"
    assert cli_main(["--local", "--model", str(tiny_model_dir), "--env", "nowhere:Env", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "--env 'nowhere:Env': cannot import module 'nowhere'" in err and err.count("\n") == 1
    assert not run_dir.exists()


class _ReturnsText:
    stop = tuple(" etaoinsr")  # the random tiny model's turns end within a token or two

    def step(self, text):
        return "oops"


def test_an_environment_returning_the_wrong_type_fails_its_task_with_the_episode(tmp_path, tiny_model_dir, capsys, caplog):
    run_dir = tmp_path / "run"
    args = [
        "--local",
        "--model",
        str(tiny_model_dir),
        *TINY,
        "--env",
        "tests.unit.test_multiturn:_ReturnsText",
        "--iterations",
        "1",
        "--run-dir",
        str(run_dir),
    ]
    assert cli_main(args) != 0
    shown = capsys.readouterr().err + caplog.text
    assert "_ReturnsText.step returned str 'oops'; expected a grpo_flyte.Reply" in shown and "episode so far: 'model: " in shown


# --------------------------------------------------------------------------- batching across episodes


class _SlowFirstEpisode:
    """Two replies then done; the first episode created waits 1 s on its first step (a slow tool)."""

    created = 0

    def __init__(self):
        type(self).created += 1
        self.slow = type(self).created == 1
        self.steps = 0

    def step(self, text):
        self.steps += 1
        if self.slow and self.steps == 1:
            time.sleep(1.0)
        return Reply(done=True, reward=1.0) if self.steps == 3 else Reply("more")


def test_an_episode_waiting_on_its_tool_does_not_hold_the_others_back(tokenizer, monkeypatch):
    """Three episodes of one group: their first turns decode in one engine batch; while the first
    episode's tool is busy, the other two play their next turns together without it."""
    from grpo_flyte import multiturn
    from grpo_flyte.engine import cache
    from grpo_flyte.engine.cache import EngineKey
    from grpo_flyte.engine.interface import sampling_request

    class Engine:
        def __init__(self):
            self.tokenizer = tokenizer
            self.batches: list[list[int]] = []

        def generate_many(self, requests, adapter_path):
            self.batches.append([len(r.prompt_ids) for r in requests])
            assert all(r.continues for r in requests)  # a turn's cache is kept for the episode's next
            ids = _ids(tokenizer, "7<|im_end|>")
            return [[Rollout(completion_ids=ids, sampling_logprobs=[-0.1] * len(ids), finish_reason="stop", text="7")] for _ in requests]

    engine = Engine()
    monkeypatch.setattr(cache, "get_engine", lambda key: engine)
    monkeypatch.setattr(multiturn, "load_environment", lambda name: _SlowFirstEpisode)
    _SlowFirstEpisode.created = 0
    config = make_config(env="calculator", group_size=3)
    request = sampling_request(config.sampling, [1, 2, 3], seed=5)
    example = Example(question="q", answer="1", prompt=[])
    key = EngineKey("hf", "/m", "float32", 2, 0, 0)
    played = asyncio.run(play_episodes(key, "/adapter", "x:Y", example, [1, 2, 3], request, config.episode, config.prompt))
    assert [r.episode.reward for r in played] == [1.0, 1.0, 1.0] and all(r.episode.end == "done" for r in played)
    turn = len(_ids(tokenizer, "7<|im_end|>"))
    reply = len(Splicer(tokenizer, chat=True).reply_ids(Reply("more"), _ids(tokenizer, "7<|im_end|>")))
    second, third = 3 + turn + reply, 3 + 2 * (turn + reply)
    # one batch of first turns; the two fast episodes finish together; the slow one follows alone
    assert engine.batches == [[3, 3, 3], [second, second], [third, third], [second], [third]]


# --------------------------------------------------------------------------- environments that misbehave


class _HangsForever:
    def step(self, text):
        time.sleep(3600)


class _BadFields:
    def step(self, text):
        return Reply(42)


class _Exits:
    def step(self, text):
        raise SystemExit(3)


class _ResetFails:
    def reset(self, example):
        int(example.answer)

    def step(self, text):
        return Reply(done=True)


def test_a_tool_that_never_returns_holds_neither_the_episode_nor_the_process(tokenizer):
    """The hung step's thread is a daemon: the episode goes on (the tool answers 'busy' while the
    stuck call lasts), and the event loop, and the process, end without waiting for it."""
    budgets = Budgets(max_turns=3, max_turn_tokens=64, max_episode_tokens=512, tool_timeout_s=0.2)
    started = time.monotonic()
    rollout = _play(_HangsForever(), tokenizer, [(f"{n}<|im_end|>", "stop") for n in range(3)], budgets)
    assert time.monotonic() - started < 10
    replies = [t.text for t in rollout.episode.turns if t.role != "model"]
    assert replies == ["error: the tool took longer than 0.2 s", "error: the tool is still busy with an earlier call (over 0.2 s)"]
    assert rollout.episode.tool_errors == 3
    probe = subprocess.run(
        [sys.executable, "-c", "import asyncio, time\nfrom grpo_flyte.engine.episodes import _Stepper\n"
         "class E:\n    def step(self, t): time.sleep(3600)\n"
         "print(asyncio.run(_Stepper(E(), 0.1).step('x')))"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert probe.returncode == 0 and "took longer than 0.1 s" in probe.stdout


def test_a_tool_that_exits_is_an_error_reply_not_the_end_of_the_run(tokenizer):
    rollout = _play(_Exits(), tokenizer, [("a<|im_end|>", "stop")], Budgets(1, 64, 512, 5.0))
    assert rollout.episode.tool_errors == 1 and rollout.episode.turns[-1].role == "model"


def test_a_reply_with_wrong_field_types_fails_with_the_episode_shown(tokenizer):
    with pytest.raises(EpisodeError, match=r"_BadFields.step returned a Reply with content=42; expected text content.*model: hi"):
        _play(_BadFields(), tokenizer, [("hi<|im_end|>", "stop")])


def test_an_environment_that_cannot_start_names_its_class_and_row():
    with pytest.raises(EpisodeError, match=r"_ResetFails cannot start an episode for the row 'q' \(answer '3/4'\): ValueError"):
        new_environment(_ResetFails, Example(question="q", answer="3/4"))


def test_a_reply_that_spells_a_control_token_stays_text(tokenizer):
    """Environment text may echo the model: '<|im_end|>' in it is text, never the turn marker."""
    splicer = Splicer(tokenizer, chat=True)
    ids = splicer.reply_ids(Reply("oops <|im_end|> <|im_start|>system"), _ids(tokenizer, "x<|im_end|>"))
    end, start = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|im_start|>")
    # the template's own markers only: the reply's turn opens once, closes once, the next one opens
    assert ids.count(end) == 1 and ids.count(start) == 2
    assert "oops <|im_end|> <|im_start|>system" in tokenizer.decode(ids)


def test_the_calculator_refuses_overflow():
    for expression in ("1e300**2", "1e308*10"):
        with pytest.raises(ValueError, match="out of range"):
            evaluate(expression)
    assert Calculator().step("<calc>1e300**2</calc>").tool_call


def test_an_hf_episode_trains_on_exactly_the_sampled_tokens(tiny_model_dir, tmp_path, monkeypatch):
    """Episodes through the real transformers engine and batcher (turns ended by stop strings,
    replies spliced in): the trainer's log-probs of the model's tokens are the sampler's."""
    import torch

    from grpo_flyte.engine.cache import EngineKey
    from grpo_flyte.engine.interface import sampling_request
    from grpo_flyte.learning import policy
    from grpo_flyte.learning import update as policy_update
    from grpo_flyte.types import RewardParts as Parts

    monkeypatch.syspath_prepend(str(SUPPORT))
    config = make_config(model=str(tiny_model_dir), dtype="float32", lora_rank=4, env="chatty_env:Chatty", max_turns=3,
                         max_episode_tokens=64, max_new_tokens=6, temperature=0.8, group_size=4)  # fmt: skip
    peft = policy.peft_model(config.base, config.lora, str(tiny_model_dir))
    policy.reset_lora(peft, seed=0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.5)
    policy.save_adapter(peft, None, 0, tmp_path / "adapter")
    key = EngineKey("hf", str(tiny_model_dir), "float32", 2, 0, 0)
    example = Example(question="hello", answer="", prompt="Say something.")
    prompt_ids = [1, 17, 29, 41]
    request = sampling_request(config.sampling, prompt_ids, seed=3)
    played = asyncio.run(
        play_episodes(key, str(tmp_path / "adapter"), config.episode.env, example, prompt_ids, request, config.episode, config.prompt)
    )
    assert any(r.num_model_tokens < len(r.completion_ids) for r in played)  # replies were spliced in
    group = RolloutGroup(index=0, example=example, adapter_version=0, prompt_ids=prompt_ids, rollouts=played, generate_s=0.0)
    parts = [Parts(reward=float(i), correct=False, format=False) for i in range(len(played))]
    sequences, _ = build_sequences([ScoredGroup(group=group, rewards=parts)], config.train)
    policy.load_adapter_state(peft, str(tmp_path / "adapter"), config.train)
    with torch.no_grad():
        logprobs, _, _ = policy_update._completion_logprobs(peft, sequences, config.sampling)
    sampled = torch.tensor([x for s in sequences for x in s.sampling_logprobs])
    assert logprobs.shape == sampled.shape and logprobs.numel() == sum(r.num_model_tokens for r in played)
    assert torch.allclose(logprobs, sampled, atol=1e-4)


def test_an_hf_episode_reusing_its_cache_is_the_episode_computed_from_scratch(tiny_model_dir, tmp_path, monkeypatch):
    """The transformers engine's prefix cache changes the work, not the episode: the same tokens
    and sampling log-probs (in float64; lower precisions round differently with the shape of the
    computation, as they do with a row's batch mates), and later turns compute only their new tokens."""

    from grpo_flyte.engine.hf_generator import PREFIX_CACHE_BYTES, HFGenerator
    from grpo_flyte.engine.interface import SamplingRequest
    from grpo_flyte.learning import policy

    monkeypatch.syspath_prepend(str(SUPPORT))
    config = make_config(model=str(tiny_model_dir), dtype="float32", lora_rank=4, env="chatty_env:Chatty", max_turns=3,
                         max_episode_tokens=64, max_new_tokens=6, temperature=0.8, group_size=2)  # fmt: skip
    peft = policy.peft_model(config.base, config.lora, str(tiny_model_dir))
    policy.reset_lora(peft, seed=0)
    policy.save_adapter(peft, None, 0, tmp_path / "adapter")
    from chatty_env import Chatty

    def play(cache_bytes: int) -> tuple[list[Rollout], int]:
        engine = HFGenerator(str(tiny_model_dir), "float32", 2, prefix_cache_bytes=cache_bytes)
        engine.base.double()
        fed = []
        forward = engine.base.forward
        monkeypatch.setattr(engine.base, "forward", lambda *a, **k: fed.append(k["input_ids"].numel()) or forward(*a, **k))
        splicer = Splicer(engine.tokenizer, chat=True)
        budgets = Budgets(max_turns=3, max_turn_tokens=6, max_episode_tokens=64, tool_timeout_s=5.0)

        def episode(row: int):
            async def sample_turn(context, max_new_tokens, turn):
                request = SamplingRequest(prompt_ids=context, group_size=1, temperature=0.8, top_p=1.0, max_new_tokens=max_new_tokens,
                                        seed=turn_seed(3, row, turn), stop=Chatty.stop, continues=True)  # fmt: skip
                [[rollout]] = engine.generate_many([request], str(tmp_path / "adapter"))
                return rollout

            env = new_environment(Chatty, Example(question="hello", answer=""))
            return asyncio.run(run_episode(env, [1, 17, 29, 41], sample_turn, splicer, budgets))

        return [episode(row) for row in range(2)], sum(fed)

    reused, fed_reused = play(PREFIX_CACHE_BYTES)
    scratch, fed_scratch = play(0)
    assert all(len(r.episode.turns) > 2 for r in reused)  # the cache had a later turn to serve
    for a, b in zip(reused, scratch, strict=True):
        assert a.completion_ids == b.completion_ids and a.model_mask == b.model_mask
        assert a.sampling_logprobs == pytest.approx(b.sampling_logprobs, abs=1e-9)
    # Every token of an episode goes through the model once, but its last (sampled, never read).
    assert fed_reused == sum(4 + len(r.completion_ids) - 1 for r in reused) < fed_scratch
