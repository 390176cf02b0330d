"""The `judge_group` task and the 'judge' reward in a run: one judge call per group, the retry of an
unparsable reply, chunks that land at their completions, the failure policy, config errors before
any task starts, the metrics and the report."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import shutil
import signal

import pytest
from flyte.io import Dir

from grpo_flyte import judge as judge_module
from grpo_flyte.config.errors import make_config
from grpo_flyte.config.generation import JudgeConfig, RewardConfig
from grpo_flyte.data import train_eval_split
from grpo_flyte.engine import batching, cache
from grpo_flyte.engine.cache import EngineKey
from grpo_flyte.engine.hf_generator import HFGenerator
from grpo_flyte.errors import ConfigError, RewardError
from grpo_flyte.launch.cli import main as cli_main
from grpo_flyte.launch.cli import parse_args
from grpo_flyte.types import Example, Rollout, RolloutGroup

TINY = ["--max-new-tokens", "8", "--prompts-per-iter", "2", "--group-size", "3", "--eval-size", "2", "--min-informative-groups", "0"]


def _group(texts: list[str]) -> RolloutGroup:
    rollouts = [Rollout(completion_ids=[1], sampling_logprobs=[0.0], finish_reason="stop", text=t) for t in texts]
    example = Example(question="What is 13 + 14?", answer="27")
    return RolloutGroup(index=0, example=example, adapter_version=0, prompt_ids=[1], rollouts=rollouts, generate_s=0.0)


class ScriptedJudge:
    """Stands in for the judge's engine: replies from a script, and records every prompt's answers."""

    def __init__(self, tokenizer, replies):
        self.tokenizer = tokenizer
        self.replies = replies  # (number of answers in the prompt, attempt) -> reply text
        self.prompts: list[list[str]] = []

    async def generate_groups(self, key, adapter_path, requests):
        assert adapter_path is None  # the judge runs the model as it is
        [request] = requests
        text = self.tokenizer.decode(request.prompt_ids)
        answers = re.findall(r"Answer (\d+):\n(.*?)(?=\n\nAnswer \d+:|<\|im_end\|>)", text, re.DOTALL)
        self.prompts.append([a for _, a in answers])
        attempt = sum(len(p) == len(answers) for p in self.prompts) - 1
        reply = self.replies(len(answers), attempt, request)
        return [[Rollout(completion_ids=[1], sampling_logprobs=[0.0], finish_reason="stop", text=reply)]]


@pytest.fixture
def scripted(monkeypatch, embedded_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)

    def install(replies) -> ScriptedJudge:
        fake = ScriptedJudge(tokenizer, replies)
        monkeypatch.setattr(cache, "get_engine", lambda key: fake)
        monkeypatch.setattr(batching, "generate_groups", fake.generate_groups)
        return fake

    return install


KEY = EngineKey("hf", "/judge", "float32", 0, 0, 0, slot="judge")


def test_one_call_scores_the_whole_group(scripted):
    fake = scripted(lambda n, attempt, request: "0.9, 0.1, 0.5]}")
    verdict = asyncio.run(judge_module.judge(KEY, JudgeConfig(judge_model="x"), "fail", _group(["27", "26", "twenty-seven"])))
    assert fake.prompts == [["27", "26", "twenty-seven"]]
    assert (verdict.scores, verdict.failed) == ([0.9, 0.1, 0.5], [False] * 3)
    assert (verdict.calls, verdict.retries, verdict.invalid, verdict.chunks) == (1, 0, 0, 1)


def test_an_unparsable_reply_is_sampled_once_more(scripted):
    def replies(n, attempt, request):
        assert request.regex is not None and request.greedy == (attempt == 0)  # the retry samples
        assert request.stop == ("}",)  # a reply ends with its object, not at the token budget
        return "Answer 1 is best." if attempt == 0 else "1, 0]}"

    scripted(replies)
    verdict = asyncio.run(judge_module.judge(KEY, JudgeConfig(judge_model="x"), "fail", _group(["27", "26"])))
    assert (verdict.scores, verdict.calls, verdict.retries, verdict.invalid) == ([1.0, 0.0], 1, 1, 0)


def test_a_group_still_unparsable_fails_or_scores_zero_and_is_counted(scripted):
    scripted(lambda n, attempt, request: "0.5]}")  # one score for two answers, twice
    with pytest.raises(
        RewardError, match=r"reward 'judge'.*not \{\"scores\": \[\.\.\.\]\} with 2 numbers.*'0\.5\]\}'.*on_reward_error='zero'"
    ):
        asyncio.run(judge_module.judge(KEY, JudgeConfig(judge_model="x"), "fail", _group(["27", "26"])))
    verdict = asyncio.run(judge_module.judge(KEY, JudgeConfig(judge_model="x"), "zero", _group(["27", "26"])))
    assert (verdict.scores, verdict.failed, verdict.invalid, verdict.retries) == ([0.0, 0.0], [True, True], 1, 1)


def test_a_group_too_long_for_the_context_is_split_and_each_chunk_lands_at_its_completions(scripted):
    # each reply scores its answers by their position in the group: the answer text says it
    def replies(n, attempt, request):
        answers = fake.prompts[-1]
        return ", ".join(f"0.{int(a.split()[0])}" for a in answers) + "]}"

    fake = scripted(replies)
    texts = [f"{i} " + "word " * 60 for i in range(6)]
    verdict = asyncio.run(judge_module.judge(KEY, JudgeConfig(judge_model="x", judge_context_tokens=400), "fail", _group(texts)))
    assert verdict.chunks > 1 and verdict.calls == verdict.chunks == len(fake.prompts)
    assert [a.split()[0] for prompt in fake.prompts for a in prompt] == [str(i) for i in range(6)]  # in order, each once
    assert verdict.scores == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]


# --------------------------------------------------------------------------- config errors, before any task


def test_the_judge_reward_needs_a_judge_model_and_a_readable_rubric(tmp_path):
    with pytest.raises(ConfigError, match="--rewards names 'judge' but --judge-model is not set"):
        make_config(rewards={"judge": 1.0})
    with pytest.raises(ConfigError, match=r"--judge-rubric='missing.txt': rubric file 'missing.txt' cannot be read"):
        make_config(rewards={"judge": 1.0}, judge_model="embedded", judge_rubric="missing.txt")
    (tmp_path / "empty.md").write_text(" \n")
    with pytest.raises(ConfigError, match="is empty"):
        make_config(judge_rubric=str(tmp_path / "empty.md"))
    rubric = tmp_path / "rubric.md"
    rubric.write_text("Prefer answers that show their work.\n")
    config = make_config(rewards={"judge": 1.0, "correct": 1.0}, judge_model="embedded", judge_rubric=str(rubric))
    assert config.judge.judge_rubric == "Prefer answers that show their work."  # the text travels, not the path
    assert config.judging


def test_a_judge_config_error_stops_the_cli_with_one_line_before_any_work(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc = cli_main(["--local", "--rewards", "judge=1.0", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "--rewards names 'judge' but --judge-model is not set" in err, err
    rc = cli_main(["--local", "--rewards", "judge=1.0", "--judge-model", str(tmp_path / "nowhere"), "--run-dir", str(run_dir)])
    err = capsys.readouterr().err.strip()
    # the judge's model is named by its own flag, not the base model's
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith(f"error: --judge-model {str(tmp_path / 'nowhere')!r}: no such"), err
    assert not run_dir.exists()


@pytest.mark.parametrize("option", ["--judge-model", "--model"])
@pytest.mark.parametrize(
    ("kept", "problem"), [(["config.json"], "has no weights"), (["config.json", "model.safetensors"], "tokenizer cannot be loaded")]
)
def test_a_model_folder_without_its_weights_or_tokenizer_is_one_line_before_start(tmp_path, tiny_model_dir, capsys, option, kept, problem):
    """The judge's folder is checked as the base model's: one line naming its flag, before any work
    (not a tokenizer library's 40 lines at the first judge call)."""
    folder = tmp_path / "half-a-model"
    folder.mkdir()
    for name in kept:
        shutil.copy(tiny_model_dir / name, folder / name)
    models = {"--model": str(tiny_model_dir), "--judge-model": str(tiny_model_dir), option: str(folder)}
    run_dir = tmp_path / "run"
    argv = ["--local", "--rewards", "judge=1.0", *[a for flag, m in models.items() for a in (flag, m)], "--run-dir", str(run_dir)]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {option} {str(folder)!r}: ") and problem in err, err
    assert not run_dir.exists()


def test_what_the_judge_is_told_must_leave_room_for_a_completion_before_start(tmp_path, tiny_model_dir, capsys):
    """A rubric (inline or a file) that, with the judge's instructions and the longest question, leaves
    no room in --judge-context-tokens for a whole completion is refused before start, with the numbers."""
    from grpo_flyte.launch.preflight import check_judge_fits

    run_dir = tmp_path / "run"
    models = ["--model", str(tiny_model_dir), "--judge-model", str(tiny_model_dir), "--rewards", "judge=1.0"]
    inline = "Prefer correct answers that show their work. " * 2300  # 104 KB
    assert len(inline.encode()) > 100_000
    assert cli_main(["--local", *models, "--judge-rubric", inline, "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    pattern = (
        r"error: --judge-rubric of (\d+) tokens, with the judge's instructions and the longest question \((\d+) tokens\), leaves "
        r"(-?\d+) of --judge-context-tokens=(\d+) for a completion; expected room for a whole one \(--max-new-tokens=(\d+)\): "
        r"a shorter rubric, or --judge-context-tokens (\d+) or more"
    )
    found = re.fullmatch(pattern, err)
    assert found and len(err.splitlines()) == 1, err
    rubric_tokens, _, room, budget, completion, needed = map(int, found.groups())
    assert rubric_tokens > 10_000 and room < 0 and (budget, completion) == (4096, 64) and needed == budget - room + completion
    assert not run_dir.exists()
    # a rubric file, and the context it needs: the number the message suggests is enough, one less is not
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Prefer correct answers that show their work. " * 300)
    argv = ["--local", *models, "--judge-rubric", str(rubric), "--judge-context-tokens", "1024", "--run-dir", str(run_dir)]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    found = re.fullmatch(pattern, err)
    assert found and int(found.group(4)) == 1024, err
    needed = int(found.group(6))
    for context, fits in [(needed, True), (needed - 1, False)]:
        _, config, _ = parse_args([*models, "--judge-rubric", str(rubric), "--judge-context-tokens", str(context)])
        if fits:
            check_judge_fits(config, tiny_model_dir, train_eval_split(config, None))
        else:
            with pytest.raises(ConfigError, match=f"leaves 63 of --judge-context-tokens={context} for a completion"):
                check_judge_fits(config, tiny_model_dir, train_eval_split(config, None))
    assert not run_dir.exists()


def test_a_rubric_value_naming_a_file_is_that_file_whatever_its_extension(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rubric.rst").write_text("Prefer answers that show their work.\n")
    (tmp_path / "RUBRIC").write_text("Prefer short answers.\n")
    judge = ["--rewards", "judge=1.0", "--judge-model", "embedded"]
    for value, text in [("rubric.rst", "Prefer answers that show their work."), ("RUBRIC", "Prefer short answers."),
                        ("Prefer kind answers.", "Prefer kind answers.")]:  # fmt: skip
        assert parse_args([*judge, "--judge-rubric", value])[1].judge.judge_rubric == text, value
    # a value shaped like a file's name that names none is a typo: one line, not the rubric
    assert cli_main(["--local", *judge, "--judge-rubric", "rubrics/judge.rst", "--run-dir", "run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: --judge-rubric='rubrics/judge.rst': rubric file 'rubrics/judge.rst' cannot be read (No such file or directory); "
        "expected rubric text or a readable UTF-8 file"
    ), err
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- real runs (tiny model)


def test_the_task_is_callable_from_your_own_code(tiny_model_dir):
    """judge_group outside a run is a plain call. The tiny random model, left alone, writes noise;
    the transformers backend holds it to the scores' regex, so its first reply parses."""
    verdict = asyncio.run(
        judge_module.judge_group(
            JudgeConfig(judge_model="tiny"),
            make_config(backend="hf").engine,
            RewardConfig(on_reward_error="fail"),
            Dir(path=str(tiny_model_dir)),
            _group(["27", "26", "28"]),
        )
    )
    assert (verdict.calls, verdict.retries, verdict.invalid, verdict.failed) == (1, 0, 0, [False] * 3)
    assert len(verdict.scores) == 3 and all(0.0 <= s <= 1.0 for s in verdict.scores)


def test_a_local_run_with_the_judge_makes_one_call_per_group_per_iteration(tmp_path, tiny_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="grpo_flyte")
    run_dir = tmp_path / "run"
    args = ["--local", "--model", str(tiny_model_dir), *TINY, "--iterations", "2", "--run-dir", str(run_dir)]
    judge = ["--rewards", "judge=1.0,format=0.5", "--judge-model", str(tiny_model_dir), "--backend", "hf"]
    assert cli_main([*args, *judge]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows[1:]:
        assert row["judge_calls"] == 2  # 2 groups of 3: one call each, not one per completion
        assert row["judge_split_groups"] == 0
        # the tiny random model writes noise left alone; held to the scores' regex, every reply parses the first time
        assert row["judge_invalid"] == row["judge_retries"] == 0
        assert row["reward_errors"] == 0 and 0.0 <= row["reward/judge"] <= 1.0
        assert row["judge_s"] > 0 and row["generate_s"] > 0
    assert "judge_calls" not in rows[0]  # the held-out evaluation is not judged
    report = (run_dir / "report.html").read_text()
    assert "The judge's scores for this group" in report
    table = report.split('<table class="judge">', 1)[1].split("</table>", 1)[0]
    assert table.count("<tr>") == 4 and "(best)" in table  # a header and the group's 3 completions
    assert "<code><" not in table  # model text is escaped
    # the progress line: the judge's calls and its seconds as a stage beside generate, score and train
    assert re.search(r"judge calls 2  loss.*\| generate [\d.]+s  score [\d.]+s  judge [\d.]+s  train", caplog.text)


def test_a_judge_that_cannot_reply_fails_the_run_naming_it_with_on_reward_error_fail(tmp_path, tiny_model_dir, caplog, monkeypatch):
    # an engine that does not constrain the reply: the tiny random model then never writes the JSON
    monkeypatch.setattr(HFGenerator, "_matchers", lambda self, regexes: None)
    run_dir = tmp_path / "run"
    args = ["--local", "--model", str(tiny_model_dir), *TINY, "--iterations", "1", "--run-dir", str(run_dir), "--backend", "hf"]
    assert cli_main([*args, "--rewards", "judge=1.0", "--judge-model", str(tiny_model_dir)]) == 1
    assert "reward 'judge': the judge's reply to 3 completions is not" in caplog.text


def test_train_rl_from_python_judges_each_group_once_and_needs_the_judge_models_folder(tmp_path, tiny_model_dir, caplog):
    """The Python API: train_rl takes the judge's model as a Dir; without one, a judge run stops at
    once with one error, not retried."""
    import flyte

    from grpo_flyte.driver import train_rl

    config = make_config(
        iterations=1, prompts_per_iter=2, group_size=2, max_new_tokens=4, eval_size=0, min_informative_groups=0,
        rewards={"judge": 1.0, "correct": 1.0}, judge_model="tiny", on_reward_error="zero",
    )  # fmt: skip
    model = Dir(path=str(tiny_model_dir))
    run = flyte.with_runcontext(mode="local", raw_data_path=str(tmp_path / "raw")).run(
        train_rl, config=config, base_model=model, judge_model=model
    )
    [row] = run.outputs()[0].history
    assert (row.train.num_groups, row.train.judge_calls, row.train.judge_retries, row.train.judge_invalid) == (2, 2, 0, 0)
    assert 0.0 <= row.train.reward_means["judge"] <= 1.0 and "correct" in row.train.reward_means
    caplog.clear()
    with pytest.raises(Exception, match="rewards name 'judge' but train_rl got no judge_model folder"):
        flyte.with_runcontext(mode="local", raw_data_path=str(tmp_path / "raw2")).run(train_rl, config=config, base_model=model)
    assert "retrying" not in caplog.text  # bad input: the driver is not retried


def test_a_local_run_with_the_judge_splits_the_gpu_between_the_two_vllm_engines(tmp_path, tiny_model_dir, monkeypatch):
    """A local run holds the generate and judge engines and the trainer in one process: vLLM starts
    the second engine only if its gpu_memory_utilization share of the GPU is still free, so the two
    shares must add up to the engines' part of the GPU, not each be it (0.85 + 0.85 failed the
    judge's engine), and that part is half of vllm_memory_fraction (the trainer keeps the rest:
    tests/unit/loop/test_batches.py). The shares are read where the engines' keys are made (the hf
    backend here ignores them)."""
    import flyte

    from grpo_flyte.driver import train_rl

    shares: dict[str, set[float]] = {"generate": set(), "judge": set()}
    engine_key, judge_engine_key = cache.engine_key, cache.judge_engine_key

    def generate_key(*args, memory_fraction, **kwargs):
        shares["generate"].add(memory_fraction)
        return engine_key(*args, memory_fraction=memory_fraction, **kwargs)

    def judge_key(*args):
        shares["judge"].add(args[-1])
        return judge_engine_key(*args)

    monkeypatch.setattr(cache, "engine_key", generate_key)
    monkeypatch.setattr(cache, "judge_engine_key", judge_key)
    config = make_config(
        iterations=1, prompts_per_iter=2, group_size=2, max_new_tokens=4, eval_size=2, min_informative_groups=0,
        rewards={"judge": 1.0}, judge_model="tiny", on_reward_error="zero", vllm_memory_fraction=0.8,
    )  # fmt: skip
    model = Dir(path=str(tiny_model_dir))
    flyte.with_runcontext(mode="local", raw_data_path=str(tmp_path / "raw")).run(
        train_rl, config=config, base_model=model, judge_model=model
    )
    assert shares == {"generate": {0.2}, "judge": {0.2}}  # the evaluation's generate calls too


# --------------------------------------------------------------------------- reward models (reward_model_group)


@pytest.fixture(scope="module")
def reward_models(tmp_path_factory, embedded_dir):
    """The tiny Llama as reward models: one output; two labels; one output and a 72-token context."""
    from tests.support.tiny_model import build_tiny_reward_model

    root = tmp_path_factory.mktemp("reward-models")
    return {
        "one": build_tiny_reward_model(root / "one", embedded_dir),
        "two": build_tiny_reward_model(root / "two", embedded_dir, num_labels=2),
        "short": build_tiny_reward_model(root / "short", embedded_dir, max_positions=72),
    }


def test_a_rewards_entry_naming_a_model_is_a_reward_model():
    from grpo_flyte.reward_fns import is_reward_model, reward_model_ref

    assert [is_reward_model(n) for n in ("org/rm", "./rm", "/models/rm@right", "~/rm", "correct", "judge", "mod:fn")] == [
        True, True, True, True, False, False, False,
    ]  # fmt: skip
    assert reward_model_ref("org/rm@right") == ("org/rm", "right") and reward_model_ref("./a@b/rm") == ("./a@b/rm", None)
    config = make_config(rewards={"correct": 1.0, "./rm@1": 0.5, "org/rm": 0.25})
    assert config.scoring.model_rewards == ["./rm@1", "org/rm"] and config.scoring.function_rewards == {"correct": 1.0}
    with pytest.raises(ConfigError, match=r"4 reward models \(a/1, a/2, a/3, a/4\); expected at most 3"):
        make_config(rewards={f"a/{i}": 1.0 for i in range(1, 5)})


def test_a_reward_model_reads_the_prompt_the_policy_was_given():
    """The chat format's system prompt and question with the instruction; the plain format's text;
    a TRL row's own prompt, text or messages (the run's prompt not added)."""
    from grpo_flyte.config.generation import PromptConfig
    from grpo_flyte.types import Message

    group = _rm_group(["#### 27"])
    reply = {"role": "assistant", "content": "#### 27"}
    chat = PromptConfig(system_prompt="Be brief.", answer_instruction="End with '#### <n>'.")
    assert judge_module.conversations(group, chat) == [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 13 + 14? End with '#### <n>'."}, reply]
    ]
    plain = PromptConfig(prompt_format="plain", answer_instruction="End with '#### <n>'.")
    assert judge_module.conversations(group, plain)[0][0] == {
        "role": "user",
        "content": "Question: What is 13 + 14?\nEnd with '#### <n>'.\nAnswer:",
    }
    for prompt, head in [("Add 13 and 14.", [{"role": "user", "content": "Add 13 and 14."}]),
                         ([Message(role="user", content="Add them.")], [{"role": "user", "content": "Add them."}])]:  # fmt: skip
        trl = group.model_copy(update={"example": Example(question="q", answer="27", prompt=prompt)})
        assert judge_module.conversations(trl, chat) == [[*head, reply]]


def _rm_group(texts: list[str], episodes: bool = False) -> RolloutGroup:
    from grpo_flyte.types import Episode, EpisodeTurn

    def episode(text: str) -> Episode:
        return Episode(turns=[EpisodeTurn(role="model", text="<calc>13+14</calc>", num_tokens=4), EpisodeTurn(role="tool", text="27", num_tokens=1),
                              EpisodeTurn(role="model", text=text, num_tokens=2)])  # fmt: skip

    rollouts = [
        Rollout(completion_ids=[1], sampling_logprobs=[0.0], finish_reason="stop", text=t, episode=episode(t) if episodes else None)
        for t in texts
    ]
    return RolloutGroup(index=0, example=Example(question="What is 13 + 14?", answer="27"), adapter_version=0, prompt_ids=[1], rollouts=rollouts, generate_s=0.0)  # fmt: skip


@pytest.mark.parametrize("episodes", [False, True])
def test_the_reward_model_task_scores_each_completion_on_its_conversation(reward_models, episodes):
    """reward_model_group outside a run: each completion's score is the model's on the prompt the
    policy was given (system prompt, question with the instruction) and the completion, or the
    episode's turns, each computed alone here."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from grpo_flyte.config.generation import PromptConfig

    folder, prompt = reward_models["one"], PromptConfig()
    group = _rm_group(["#### 27", "It is 26.\n#### 26", "no idea"], episodes)
    result = asyncio.run(judge_module.reward_model_group(str(folder), prompt, RewardConfig(), Dir(path=str(folder)), group))
    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModelForSequenceClassification.from_pretrained(folder).eval()
    head = [
        {"role": "system", "content": prompt.system_prompt},
        {"role": "user", "content": f"What is 13 + 14? {prompt.answer_instruction}"},
    ]
    expected = []
    for r in group.rollouts:
        turns = r.episode.messages() if episodes else [{"role": "assistant", "content": r.text}]
        ids = tokenizer(tokenizer.apply_chat_template([*head, *turns], tokenize=False), return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            expected.append(model(**ids).logits[0, 0].item())
    assert result.reward == str(folder) and result.failed == [False] * 3
    assert result.scores == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("on_error", ["fail", "zero"])
def test_a_reward_models_score_that_is_not_finite_is_handled_as_a_reward_functions(reward_models, monkeypatch, on_error):
    from grpo_flyte.models import reward_model
    from grpo_flyte.scoring.compose import with_reward_model
    from grpo_flyte.types import RewardParts, ScoredGroup

    monkeypatch.setattr(reward_model.RewardModel, "score", lambda self, conversations, label=None: [0.5, math.nan, -math.inf])
    folder = reward_models["one"]
    group = _rm_group(["#### 27", "#### 26", "no idea"])
    call = judge_module.reward_model_group(
        f"{folder}", make_config().prompt, RewardConfig(on_reward_error=on_error), Dir(path=str(folder)), group
    )
    if on_error == "fail":
        with pytest.raises(
            Exception,
            match=rf"reward {re.escape(repr(str(folder)))} returned nan; expected a finite number on completion 2 of 3, which starts '#### 26'",
        ):
            asyncio.run(call)
        return
    result = asyncio.run(call)
    assert (result.scores, result.failed) == ([0.5, 0.0, 0.0], [False, True, True])
    scored = ScoredGroup(group=group, rewards=[RewardParts(reward=1.0, correct=True, format=True, scores={"correct": 1.0})] * 3)
    parts = with_reward_model(scored, result, 2.0).rewards
    assert [p.reward for p in parts] == [2.0, 1.0, 1.0]
    assert [p.errors for p in parts] == [[], [str(folder)], [str(folder)]] and parts[0].scores == {"correct": 1.0, str(folder): 0.5}


def _refused(capsys, argv: list[str]) -> str:
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_a_reward_model_that_cannot_score_is_refused_before_start_in_one_line(
    tmp_path, tiny_model_dir, reward_models, jsonl_dataset, capsys, monkeypatch
):
    """A wrong folder, a causal language model, a two-label model without its label, a context too
    short for the longest prompt and a completion, and a Hub id with no network: each one line
    naming the reward, before the run folder is made. A dataset of 6 rows: the context check
    tokenizes every prompt that could reach the 72-token context, here every one of the built-in
    dataset's 19k (about 12 s a pass on this test's 2-core machine)."""
    run_dir = tmp_path / "run"
    args = ["--local", "--model", str(tiny_model_dir), "--dataset", str(jsonl_dataset), *TINY, "--run-dir", str(run_dir)]
    missing = tmp_path / "nowhere"
    err = _refused(capsys, [*args, "--rewards", f"correct=1.0,{missing}=0.5"])
    assert err == f"error: --rewards {str(missing)!r}: no such folder; expected a reward model's folder or a Hub id 'org/name'", err
    err = _refused(capsys, [*args, "--rewards", f"{tiny_model_dir}=1.0"])
    assert err.startswith(
        f"error: --rewards {str(tiny_model_dir)!r}: its architecture (LlamaForCausalLM) is not a sequence-classification model"
    ), err
    two = reward_models["two"]
    err = _refused(capsys, [*args, "--rewards", f"{two}=1.0"])
    assert err == (
        f"error: --rewards {str(two)!r}: the model has 2 labels (0=wrong, 1=right); expected one picked for the reward: "
        "'<model>@<label>' by name or index"
    ), err
    err = _refused(capsys, [*args, "--rewards", f"{two}@maybe=1.0"])
    assert "'@maybe' names none of the model's 2 labels" in err
    short = reward_models["short"]
    err = _refused(capsys, [*args, "--rewards", f"{short}=1.0"])
    assert re.fullmatch(
        rf"error: --rewards {re.escape(repr(str(short)))}: its context is 72 tokens; expected room for the longest prompt as it reads it "
        r"\((\d+) tokens: '.*'\) and a whole completion \(--max-new-tokens=8\): (\d+) tokens",
        err,
    ), err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = _refused(capsys, [*args, "--rewards", "grpo-flyte-tests/no-such-reward-model@right=1.0"])
    assert err.startswith(
        "error: --rewards 'grpo-flyte-tests/no-such-reward-model@right': could not be fetched from the Hugging Face Hub ("
    ), err
    assert not run_dir.exists()
    # the same folders, fitting: a label picked, a shorter completion
    assert cli_main([*args, "--rewards", f"{two}@right=1.0,{short}=1.0", "--max-new-tokens", "2", "--iterations", "1"]) == 0


def test_train_rl_from_python_needs_each_reward_models_folder(tmp_path, tiny_model_dir, reward_models, caplog):
    import flyte

    from grpo_flyte.driver import train_rl

    name = str(reward_models["two"]) + "@right"
    config = make_config(
        iterations=1, prompts_per_iter=2, group_size=2, max_new_tokens=4, eval_size=0, min_informative_groups=0,
        rewards={name: 1.0, "correct": 1.0},
    )  # fmt: skip
    model = Dir(path=str(tiny_model_dir))
    run = flyte.with_runcontext(mode="local", raw_data_path=str(tmp_path / "raw")).run(
        train_rl, config=config, base_model=model, reward_models={str(reward_models["two"]): Dir(path=str(reward_models["two"]))}
    )
    [row] = run.outputs()[0].history
    assert 0.0 < row.train.reward_means[name] < 1.0 and row.train.reward_model_s > 0
    caplog.clear()
    with pytest.raises(
        Exception, match=f"rewards name the reward model {str(reward_models['two'])!r} but train_rl's reward_models has no folder"
    ):
        flyte.with_runcontext(mode="local", raw_data_path=str(tmp_path / "raw2")).run(train_rl, config=config, base_model=model)
    assert "retrying" not in caplog.text  # bad input: the driver is not retried


def test_a_local_run_with_a_reward_model_records_its_mean_and_resumes_after_a_kill(tmp_path, tiny_model_dir, reward_models):
    """The CLI with a reward model folder among the rewards: killed (SIGKILL) in iteration 2's
    generation, resumed with --resume, it ends with the reward's mean in every iteration's row and
    the reward model's stage seconds."""
    from tests.support import SUPPORT, warm_python

    folder = str(reward_models["one"])
    run_dir = tmp_path / "run"
    args = ["--local", "--model", str(tiny_model_dir), *TINY, "--iterations", "2", "--run-dir", str(run_dir),
            "--rewards", f"correct=1.0,{folder}=0.5"]  # fmt: skip
    # engine batches: the held-out evaluation (1), iteration 1's two groups (2, 3): the kill lands in iteration 2's first
    killed = warm_python.run([SUPPORT / "kill_drill.py", "generate", "4", *args], timeout=600, cli=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    done = [json.loads(line)["iteration"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert done == [0, 1]
    assert cli_main([*args, "--resume"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert math.isfinite(row[f"reward/{folder}"]) and row["reward_model_s"] > 0 and row["reward_errors"] == 0
        # each completion's reward: correct (0 or 1) + 0.5 x the reward model's score
        assert row["mean_reward"] == pytest.approx(row["reward/correct"] + 0.5 * row[f"reward/{folder}"])
    assert f"reward/{folder}" not in rows[0] and "reward_model_s" not in rows[0]  # the held-out evaluation is not scored by it
    assert folder in (run_dir / "report.html").read_text()
