"""Your own agent (`--agent module:function`): the in-process OpenAI client, the calls recorded token
for token and turned into training sequences (linear, branching), the budgets, agents that fail,
and runs through the CLI to the end, killed and resumed."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from pathlib import Path

import openai
import pytest

from grpo_flyte.config.errors import make_config
from grpo_flyte.engine.agents import agent_rollout, load_agent, run_agent
from grpo_flyte.engine.chat_client import ChatServer, Limits, chains, openai_client
from grpo_flyte.errors import EnvironmentSpecError
from grpo_flyte.launch.cli import main as cli_main
from grpo_flyte.learning.update import build_sequences
from grpo_flyte.types import Example, RewardParts, Rollout, RolloutGroup, ScoredGroup
from tests.support import SUPPORT, warm_python

SRC = Path(__file__).resolve().parents[3] / "src"


@pytest.fixture(scope="module")
def tokenizer(embedded_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_dir))


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


LIMITS = Limits(4, 64, 512, 2048)
QUESTION = Example(question="2+3?", answer="5")


def scripted_server(tokenizer, texts: list[str], limits=LIMITS, seen: list | None = None) -> ChatServer:
    """A server whose model writes the given texts in turn, each token's log-prob -(position+1)/10."""
    script = iter(texts)

    async def sample(context, max_new_tokens, n, number, stop):
        if seen is not None:
            seen.append((list(context), max_new_tokens, n, number, stop))
        out = []
        for _ in range(n):
            ids = _ids(tokenizer, next(script))
            finish = "length" if len(ids) > max_new_tokens else "stop"
            ids = ids[:max_new_tokens]
            out.append(
                Rollout(completion_ids=ids, sampling_logprobs=[-(i + 1) / 10 for i in range(len(ids))], finish_reason=finish, text="")
            )
        return out

    return ChatServer(tokenizer, sample, limits)


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]  # fmt: skip
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'


def _run(coroutine):
    return asyncio.run(coroutine)


# --------------------------------------------------------------------------- the client


def test_a_create_without_tools_is_a_chat_completion_of_the_sampled_text(tokenizer):
    server = scripted_server(tokenizer, ["Five.<|im_end|>"])

    async def ask():
        return await openai_client(server.complete).chat.completions.create(
            model="gpt-anything", messages=[{"role": "user", "content": "2+3?"}]
        )

    response = _run(ask())
    [choice] = response.choices
    assert choice.message.content == "Five." and choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert response.model == "gpt-anything" and response.object == "chat.completion"
    [call] = server.calls
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "2+3?"}], tokenize=False, add_generation_prompt=True)
    assert call.prompt_ids == _ids(tokenizer, prompt)  # the template's rendering, tokenized once
    assert response.usage.prompt_tokens == len(call.prompt_ids) and response.usage.completion_tokens == len(
        _ids(tokenizer, "Five.<|im_end|>")
    )


def test_a_create_with_tools_renders_them_and_returns_the_models_call(tokenizer):
    seen = []
    server = scripted_server(tokenizer, [CALL, "It is 5.<|im_end|>"], seen=seen)

    async def agent():
        client = openai_client(server.complete)
        messages = [{"role": "user", "content": "2+3?"}]
        first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="auto")
        message = first.choices[0].message
        messages += [message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "5"}]
        second = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        return first, second

    first, second = _run(agent())
    [call] = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content == ""
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    # the embedded model's template renders no tools: their schemas are in its system message
    shown = tokenizer.decode(seen[0][0])
    assert '"name": "add"' in shown and "<tool_call>" in shown
    assert second.choices[0].message.content == "It is 5." and second.choices[0].finish_reason == "stop"
    # the second request continues the first: the model's own ids, then the tool message's tokens
    one, two = server.calls
    assert two.prompt_ids[: len(one.ids)] == one.ids
    assert tokenizer.decode(two.prompt_ids[len(one.ids) :]) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert [len(c) for c in chains(server.calls)] == [2]


def test_n_completions_of_one_request_are_branches_and_n_past_the_limit_or_streaming_is_refused(tokenizer):
    server = scripted_server(tokenizer, ["a<|im_end|>", "b<|im_end|>"])
    client_messages = [{"role": "user", "content": "hi"}]

    async def ask(**kw):
        return await openai_client(server.complete).chat.completions.create(model="m", messages=client_messages, **kw)

    response = _run(ask(n=2))
    assert [c.message.content for c in response.choices] == ["a", "b"] and [c.index for c in response.choices] == [0, 1]
    assert len(chains(server.calls)) == 2
    with pytest.raises(openai.BadRequestError, match="n=17"):
        _run(ask(n=17))
    with pytest.raises(openai.BadRequestError, match="stream"):
        _run(ask(stream=True))


def test_the_budgets_cut_a_completion_and_refuse_a_request_past_them(tokenizer):
    """max_new_tokens per completion (finish 'length'), max_turns requests, max_episode_tokens."""
    long = "one two three four five six seven eight<|im_end|>"
    server = scripted_server(tokenizer, [long, "ok<|im_end|>"], limits=Limits(2, 4, 512, 2048))

    async def agent():
        client = openai_client(server.complete)
        messages = [{"role": "user", "content": "count"}]
        first = await client.chat.completions.create(model="m", messages=messages)
        messages += [first.choices[0].message, {"role": "user", "content": "more"}]
        await client.chat.completions.create(model="m", messages=messages, max_tokens=2)
        await client.chat.completions.create(model="m", messages=messages)

    with pytest.raises(openai.BadRequestError, match="max_turns"):
        _run(agent())
    first, second = server.calls
    assert len(first.completion.completion_ids) == 4 and first.cut == "turn_tokens"
    assert len(second.completion.completion_ids) <= 2 and server.end == "turns"

    seen = []
    tight = scripted_server(tokenizer, [long], limits=Limits(4, 64, 6, 2048), seen=seen)

    async def twice():
        client = openai_client(tight.complete)
        messages = [{"role": "user", "content": "count"}]
        first = await client.chat.completions.create(model="m", messages=messages)
        await client.chat.completions.create(
            model="m", messages=[*messages, first.choices[0].message, {"role": "user", "content": "go on"}]
        )

    with pytest.raises(openai.BadRequestError, match="max_episode_tokens"):
        _run(twice())
    assert seen[0][1] == 6 and tight.end == "episode_tokens"


# --------------------------------------------------------------------------- episodes as sequences


def _episode(tokenizer, agent, texts, example=QUESTION, timeout_s=5.0):
    server = scripted_server(tokenizer, texts)

    async def play():
        return await run_agent(agent, example, server, timeout_s)

    reward, error = _run(play())
    return agent_rollout(server.calls, reward, error, server.end), server


async def _linear(client, example):
    messages = [{"role": "user", "content": example.question}]
    for turn in range(3):
        response = await client.chat.completions.create(model="m", messages=messages)
        messages += [response.choices[0].message, {"role": "user", "content": f"turn {turn}"}]
    return 0.25


def test_a_linear_conversation_is_one_sequence_of_the_sampled_ids_with_the_agents_messages_masked(tokenizer):
    rollout, server = _episode(tokenizer, _linear, ["a<|im_end|>", "b<|im_end|>", "c<|im_end|>"])
    assert rollout.episode.reward == 0.25 and rollout.episode.end == "done" and not rollout.branches
    calls = server.calls
    assert rollout.prompt_ids == calls[0].prompt_ids
    assert rollout.prompt_ids + rollout.completion_ids == calls[-1].ids  # the last call's whole context and completion
    # the model's tokens are exactly each call's sampled ids, with their log-probs; the rest masked
    sampled = [t for c in calls for t in c.completion.completion_ids]
    assert [t for t, own in zip(rollout.completion_ids, rollout.model_mask, strict=True) if own] == sampled
    assert [lp for lp, own in zip(rollout.sampling_logprobs, rollout.model_mask, strict=True) if own] == [
        lp for c in calls for lp in c.completion.sampling_logprobs
    ]
    assert [t.role for t in rollout.episode.turns] == ["model", "user", "model", "user", "model"]
    assert rollout.episode.final_text == "c"
    group = RolloutGroup(
        index=0, example=Example(question="q", answer=""), adapter_version=0, prompt_ids=[9, 9], rollouts=[rollout], generate_s=0
    )
    [sequence], total = build_sequences(
        [ScoredGroup(group=group, rewards=[RewardParts(reward=1.0, correct=True, format=True)])], make_config().train
    )
    assert total == 1 and sequence.prompt_ids == calls[0].prompt_ids and sequence.completion_ids == rollout.completion_ids


async def _branching(client, example):
    messages = [{"role": "user", "content": example.question}]
    first = await client.chat.completions.create(model="m", messages=messages)
    await client.chat.completions.create(model="m", messages=messages)  # a second completion of one history
    more = [*messages, first.choices[0].message, {"role": "user", "content": "and then?"}]
    await client.chat.completions.create(model="m", messages=more)
    return None


def test_calls_that_branch_are_separate_sequences_trained_with_the_episodes_advantage(tokenizer):
    rollout, server = _episode(tokenizer, _branching, ["a<|im_end|>", "b<|im_end|>", "c<|im_end|>"])
    _first, second, third = server.calls
    assert rollout.prompt_ids + rollout.completion_ids == third.ids  # the last call's sequence holds the first call
    [branch] = rollout.branches
    assert branch.prompt_ids == second.prompt_ids and branch.completion_ids == second.completion.completion_ids
    assert branch.model_mask == [True] * len(branch.completion_ids)
    other = rollout.model_copy(update={"branches": [], "completion_ids": [], "sampling_logprobs": [], "model_mask": []})
    group = RolloutGroup(
        index=0, example=Example(question="q", answer=""), adapter_version=0, prompt_ids=[9], rollouts=[rollout, other], generate_s=0
    )
    parts = [RewardParts(reward=r, correct=False, format=False) for r in (1.0, 0.0)]
    sequences, total = build_sequences([ScoredGroup(group=group, rewards=parts)], make_config().train)
    assert total == 2 and len(sequences) == 2  # the empty episode trains nothing
    assert sequences[0].advantage == sequences[1].advantage > 0
    assert sequences[1].prompt_ids == second.prompt_ids and sequences[1].sampling_logprobs == second.completion.sampling_logprobs


# --------------------------------------------------------------------------- agents that fail


async def _raises(client, example):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    raise RuntimeError("the agent is broken")


async def _silent(client, example):
    return 1.0


async def _blocks(client, example):
    time.sleep(2)
    return 1.0


async def _awaits_forever(client, example):
    await asyncio.sleep(60)


async def _returns_text(client, example):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    return "good"


def test_an_agent_that_raises_ends_its_episode_keeping_what_it_sampled(tokenizer):
    rollout, _ = _episode(tokenizer, _raises, ["a<|im_end|>"])
    assert rollout.episode.end == "agent_error" and rollout.episode.reward is None and rollout.num_model_tokens == 2


def test_an_agent_that_never_calls_the_client_gives_no_training_sequence(tokenizer):
    rollout, _ = _episode(tokenizer, _silent, [])
    assert rollout.episode.end == "no_calls" and rollout.completion_ids == [] and rollout.episode.reward == 1.0


@pytest.mark.parametrize("agent", [_blocks, _awaits_forever])
def test_an_agent_past_its_time_between_requests_ends_its_episode_on_time(tokenizer, agent):
    started = time.monotonic()
    rollout, _ = _episode(tokenizer, agent, [], timeout_s=0.3)
    assert rollout.episode.end == "agent_error" and time.monotonic() - started < 1.8


def test_an_agent_returning_something_other_than_a_number_is_an_agent_error(tokenizer):
    server = scripted_server(tokenizer, ["a<|im_end|>"])
    reward, error = _run(run_agent(_returns_text, Example(question="q", answer=""), server, 5.0))
    assert reward is None and error == "returned str 'good'; expected a finite number or None"


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("nowhere:rollout", "'nowhere:rollout': cannot import module 'nowhere'"),
        ("chatty_agent:absent", "'chatty_agent:absent': module 'chatty_agent' has no attribute 'absent'"),
        ("chatty_agent:not_async", "'chatty_agent:not_async': not_async is not an async function"),
        ("chatty_agent:one_argument", "'chatty_agent:one_argument': one_argument(client) cannot be called with (client, example)"),
    ],
)
def test_a_bad_agent_stops_the_run_before_it_starts_in_one_line(tmp_path, tiny_model_dir, capsys, monkeypatch, name, problem):
    monkeypatch.syspath_prepend(str(SUPPORT))
    with pytest.raises(EnvironmentSpecError, match="agent"):
        load_agent(name)
    run_dir = tmp_path / "run"
    assert cli_main(["--local", "--model", str(tiny_model_dir), "--agent", name, "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --agent {problem}") and err.count("\n") == 1
    assert not run_dir.exists()


def test_an_agent_with_an_environment_or_a_bad_shape_is_refused():
    with pytest.raises(ValueError, match="--env='guess' with --agent='m:f': expected one of them"):
        make_config(env="guess", agent="m:f")
    with pytest.raises(ValueError, match="expected 'none' or 'module:function'"):
        make_config(agent="rollout")


# --------------------------------------------------------------------------- through the real engine


def test_an_agents_episodes_train_on_exactly_the_sampled_tokens(tiny_model_dir, tmp_path, monkeypatch):
    """Agent episodes through the transformers engine and the batcher, linear and branching: the
    trained ids are the sampled ids, and the trainer's log-probs of them are the sampler's."""
    import torch

    from grpo_flyte.engine.agents import play_agent_episodes
    from grpo_flyte.engine.cache import EngineKey
    from grpo_flyte.engine.interface import sampling_request
    from grpo_flyte.learning import policy
    from grpo_flyte.learning import update as policy_update

    monkeypatch.syspath_prepend(str(SUPPORT))
    for agent in ("chatty_agent:chatty", "chatty_agent:branching"):
        config = make_config(model=str(tiny_model_dir), dtype="float32", lora_rank=4, agent=agent, max_turns=3,
                             max_episode_tokens=64, max_new_tokens=6, temperature=0.8, group_size=3)  # fmt: skip
        peft = policy.peft_model(config.base, config.lora, str(tiny_model_dir))
        policy.reset_lora(peft, seed=0)
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.5)
        policy.save_adapter(peft, None, 0, tmp_path / "adapter")
        key = EngineKey("hf", str(tiny_model_dir), "float32", 2, 0, 0)
        example = Example(question="hello there", answer="")
        request = sampling_request(config.sampling, [1, 2], seed=3)
        played = asyncio.run(
            play_agent_episodes(key, str(tmp_path / "adapter"), agent, example, [1, 2], request, config.episode, config.prompt, 1024)
        )
        assert all(r.episode.end in ("done", "turn_tokens") for r in played)
        if agent.endswith("branching"):
            assert all(len(r.branches) == 1 for r in played)
        else:
            assert all(r.num_model_tokens < len(r.completion_ids) and not r.branches for r in played)
        group = RolloutGroup(index=0, example=example, adapter_version=0, prompt_ids=[1, 2], rollouts=played, generate_s=0.0)
        parts = [RewardParts(reward=float(i), correct=False, format=False) for i in range(len(played))]
        sequences, _ = build_sequences([ScoredGroup(group=group, rewards=parts)], config.train)
        assert len(sequences) == sum(1 + len(r.branches) for r in played)
        policy.load_adapter_state(peft, str(tmp_path / "adapter"), config.train)
        with torch.no_grad():
            logprobs, _, _ = policy_update._completion_logprobs(peft, sequences, config.sampling)
        sampled = torch.tensor([x for s in sequences for x in s.sampling_logprobs])
        assert logprobs.shape == sampled.shape and logprobs.numel() == sum(
            r.num_model_tokens + sum(sum(b.model_mask) for b in r.branches) for r in played
        )
        assert torch.allclose(logprobs, sampled, atol=1e-4)


# --------------------------------------------------------------------------- runs through the CLI

TINY = ["--max-new-tokens", "8", "--prompts-per-iter", "2", "--group-size", "3", "--eval-size", "2", "--min-informative-groups", "0"]
DRILL = SUPPORT / "kill_drill.py"


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_an_agent_run_goes_to_the_end_and_resumes_after_a_kill(tmp_path, tiny_model_dir, monkeypatch):
    """`--agent chatty_agent:chatty` with its reward as 'env': three requests an episode, trained on,
    the metrics, and a resume after a SIGKILL in iteration 1's generation."""
    monkeypatch.syspath_prepend(str(SUPPORT))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]))
    run_dir = tmp_path / "run"
    args = ["--local", "--model", str(tiny_model_dir), *TINY, "--agent", "chatty_agent:chatty", "--rewards", "env=1.0",
            "--max-turns", "3", "--max-episode-tokens", "80", "--iterations", "2", "--run-dir", str(run_dir)]  # fmt: skip
    # engine batches: the held-out evaluation's first ... the kill lands in iteration 1's episodes
    killed = warm_python.run([DRILL, "generate", "8", *args], timeout=600, cli=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert cli_main([*args, "--resume"]) == 0
    rows = _rows(run_dir)
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["num_rollouts"] == 6 and row["turns_mean"] <= 3 and row["num_tokens"] > 0
        assert sum(v for k, v in row.items() if k.startswith("ended/")) == 6
        assert row["env_tokens_mean"] > 0 and row["completion_len_max"] <= 80
    assert {"eval_turns_mean", "eval_reward"} <= rows[0].keys()
    assert json.loads((run_dir / "config.json").read_text())["episode"]["agent"] == "chatty_agent:chatty"
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file() and (run_dir / "report.html").is_file()


@pytest.mark.parametrize(("agent", "end"), [("raising", "agent_error"), ("silent", "no_calls"), ("blocking", "agent_error")])
def test_agents_that_fail_or_never_call_end_their_episodes_counted_and_the_run_goes_on(
    tmp_path, tiny_model_dir, monkeypatch, caplog, agent, end
):
    monkeypatch.syspath_prepend(str(SUPPORT))
    run_dir = tmp_path / "run"
    args = ["--local", "--model", str(tiny_model_dir), *TINY, "--agent", f"chatty_agent:{agent}", "--tool-timeout-s", "0.5",
            "--iterations", "1", "--run-dir", str(run_dir)]  # fmt: skip
    with caplog.at_level(logging.WARNING):
        assert cli_main(args) == 0
    row = _rows(run_dir)[-1]
    assert row[f"ended/{end}"] == 6 and row["num_rollouts"] == 6
    if end == "no_calls":
        assert row["num_tokens"] == 0
    else:  # one line for every episode that failed alike, no traceback
        assert caplog.text.count(f"agent 'chatty_agent:{agent}' failed an episode") == 1 and "Traceback" not in caplog.text


_BUNDLE = """
import json, sys
from pathlib import Path
import flyte
from flyte.io import Dir
from grpo_flyte.config.run import RunConfig
from grpo_flyte.driver import train_rl
from grpo_flyte.engine.agents import load_agent
from grpo_flyte.launch import submit

load_agent("pod_agent:chatty")  # as the submission's checks before start do (launch.preflight.check_inputs)
submit.check_submission(RunConfig(iterations=1, agent="pod_agent:chatty"))  # under the bundle root: it ships
flyte.init(root_dir=submit.BUNDLE_ROOT)
run = flyte.with_runcontext(mode="remote", dry_run=True).run(
    train_rl, config=RunConfig(iterations=1, agent="pod_agent:chatty"), base_model=Dir(path="s3://bucket/model"))
print(json.dumps([str(Path(f).relative_to(submit.BUNDLE_ROOT)) for f in run.code_bundle.files]))
"""
_IN_THE_POD = """
from grpo_flyte.engine.agents import load_agent
import pod_agent
print(load_agent("pod_agent:chatty").__name__, pod_agent.__file__)
"""


def test_an_agents_module_travels_with_the_code_bundle_and_imports_in_the_task(tmp_path):
    """A checkout with the agent's module under src/: the submission's bundle holds it, and in the
    pod's view (only the bundle's files on the path) the generate task's load_agent finds it."""
    import shutil
    import subprocess
    import sys

    checkout = tmp_path / "checkout"
    shutil.copytree(SRC, checkout / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(SRC.parent / "pyproject.toml", checkout / "pyproject.toml")  # a source checkout: its src/ is the bundle
    shutil.copy(SUPPORT / "chatty_agent.py", checkout / "src" / "pod_agent.py")
    env = {**os.environ, "PYTHONPATH": str(checkout / "src")}
    bundled = subprocess.run(
        [sys.executable, "-c", _BUNDLE], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False
    )
    assert bundled.returncode == 0, bundled.stderr[-3000:]
    files = json.loads(bundled.stdout.strip().splitlines()[-1])
    assert "pod_agent.py" in files and "grpo_flyte/engine/agents.py" in files
    pod = tmp_path / "pod"
    for name in files:
        (pod / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(checkout / "src" / name, pod / name)
    env = {**os.environ, "PYTHONPATH": str(pod)}
    found = subprocess.run(
        [sys.executable, "-c", _IN_THE_POD], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False
    )
    assert found.returncode == 0, found.stderr[-3000:]
    assert found.stdout.split() == ["chatty", str(pod / "pod_agent.py")]


@pytest.mark.parametrize(
    ("template", "written", "content"),
    [
        ("llama3_1", '{"name": "add", "parameters": {"a": 2, "b": 3}}<|eot_id|>', ""),
        ("mistral", 'Adding.[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}]</s>', "Adding."),
    ],
)
def test_an_agents_tool_calls_are_read_in_the_templates_own_format(tokenizer, template, written, content):
    """Llama 3.x's whole-turn JSON and Mistral's [TOOL_CALLS] come back as OpenAI tool_calls, read
    by the parsers --tools uses; a turn without a call is the message's content, its special
    tokens left out."""
    import copy

    from grpo_flyte.engine.chat_client import TemplateFormat, tool_format_of
    from tests.unit.tools.test_formats import MISTRAL, TRL_TEMPLATES

    templated = copy.copy(tokenizer)
    templated.chat_template = MISTRAL if template == "mistral" else (TRL_TEMPLATES / f"{template}.jinja").read_text()
    tool_format = tool_format_of(templated, {})
    assert tool_format == TemplateFormat("mistral" if template == "mistral" else "llama")
    server = scripted_server(templated, [written, "It is 5.<|eot_id|>"])
    server.tool_format = tool_format

    async def agent():
        client = openai_client(server.complete)
        first = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+3?"}], tools=TOOLS)
        second = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+3?"}], tools=TOOLS)
        return first.choices[0], second.choices[0]

    first, second = _run(agent())
    [call] = first.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
    assert first.finish_reason == "tool_calls" and first.message.content == content
    assert second.message.tool_calls is None and second.message.content == "It is 5."
    assert tool_format_of(tokenizer, {}) is not tool_format  # the embedded template renders no tools: Hermes' fallback


def test_an_agent_with_tools_is_refused_naming_both():
    from grpo_flyte.config.run import RunConfig

    with pytest.raises(ValueError, match=r"tools='tests.support.tool_fns:add' with --agent='chatty_agent:rollout': expected one of them"):
        RunConfig(tools=["tests.support.tool_fns:add"], agent="chatty_agent:rollout")
