"""--tools episodes: the prompt shows the tools, each turn's calls are run and answered, every
failure is an answer counted in the metrics, and the trained sequence is the sampled ids plus the
template-rendered tool messages' ids, text for text what the chat template renders."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest

from grpo_flyte.config.generation import PromptConfig
from grpo_flyte.engine.episodes import Budgets, run_episode
from grpo_flyte.engine.prompts import tokenize_prompt
from grpo_flyte.engine.tool_episodes import ToolEnv, ToolSplicer, tool_kit, tool_prompt_config
from grpo_flyte.types import Example, Message, Rollout

FNS = "tests.support.tool_fns"
SPECS = (f"{FNS}:add", f"{FNS}:broken", f"{FNS}:sleepy")
TEMPLATES = Path(pytest.importorskip("trl").__file__).parent / "chat_templates"
EXAMPLE = Example(
    question="What is 2 + 3?",
    answer="5",
    prompt=[Message(role="system", content="Use tools."), Message(role="user", content="What is 2 + 3?")],
)


@pytest.fixture(scope="module")
def smollm2(embedded_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_dir))


def with_template(tokenizer, name: str):
    twin = copy.copy(tokenizer)
    twin.chat_template = (TEMPLATES / name).read_text()
    return twin


def play(tokenizer, turns: list[str], max_rounds=None, max_turns=4, timeout_s=30.0):
    """An episode whose model turns are `turns` (the k-th sampled turn, log-prob -0.5 a token):
    (the rollout, the prompt's ids, each model turn's ids, the prompt config with the tools)."""
    prompt = tool_prompt_config(tokenizer, PromptConfig(), SPECS)
    kit = tool_kit(tokenizer, SPECS, PromptConfig())
    prompt_ids = tokenize_prompt(tokenizer, EXAMPLE, prompt)
    sampled: list[list[int]] = []

    async def sample_turn(context: list[int], max_new_tokens: int, turn: int) -> Rollout:
        text = turns[len(sampled)]
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        sampled.append(ids)
        return Rollout(completion_ids=ids, sampling_logprobs=[-0.5] * len(ids), finish_reason="stop", text=text)

    env = ToolEnv(kit, timeout_s, max_rounds, max_turns)
    budgets = Budgets(max_turns, 64, 2048, 300.0)
    rollout = asyncio.run(run_episode(env, prompt_ids, sample_turn, ToolSplicer(tokenizer, prompt.template_kwargs), budgets))
    return rollout, prompt_ids, sampled, prompt


def assert_spliced(rollout: Rollout, sampled: list[list[int]]) -> list[list[int]]:
    """The sequence is the sampled turns in order with the replies between them, the sampled ids in
    the loss with their log-probs and the replies out of it; returns the replies' ids."""
    ids, mask, logprobs, replies, at = rollout.completion_ids, rollout.model_mask, rollout.sampling_logprobs, [], 0
    for k, turn in enumerate(sampled):
        assert ids[at : at + len(turn)] == turn and all(mask[at : at + len(turn)]) and set(logprobs[at : at + len(turn)]) == {-0.5}
        at += len(turn)
        if k < len(sampled) - 1:
            end = at + mask[at:].index(True)
            assert logprobs[at:end] == [0.0] * (end - at)
            replies.append(ids[at:end])
            at = end
    assert at == len(ids)
    return replies


def test_the_fallback_episode_is_the_templates_text_token_for_token(smollm2):
    """The embedded SmolLM2's template has no tools: the fallback shows them in the system message;
    the call ends at </tool_call> (a stop string), the answer is a `tool` message."""
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    rollout, prompt_ids, sampled, prompt = play(smollm2, [call, "#### 5<|im_end|>"])
    assert_spliced(rollout, sampled)
    conversation = [m.model_dump() for m in EXAMPLE.prompt] + [{"role": "assistant", "content": call}, {"role": "tool", "content": "5"}]
    rendered = smollm2.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, **prompt.template_kwargs)
    assert smollm2.decode(prompt_ids + rollout.completion_ids) == rendered + "#### 5<|im_end|>"
    assert "<tools>" in smollm2.decode(prompt_ids)
    episode = rollout.episode
    assert (episode.end, episode.tool_calls, episode.tool_errors, episode.tool_malformed) == ("done", 1, 0, 0)
    assert [t.role for t in episode.turns] == ["model", "tool", "model"] and episode.turns[1].text == "5"


def test_a_turns_calls_and_failures_are_answered_together_in_qwen3s_format(smollm2):
    """Qwen3's template: tools= in its system message, each call's answer a <tool_response> in one
    user block; a tool that raises, an unknown tool and a malformed call are answers and counted."""
    tokenizer = with_template(smollm2, "qwen3.jinja")
    turn = (
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "broken", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>\n<tool_call>\n{bad}\n</tool_call><|im_end|>'
    )
    rollout, prompt_ids, sampled, prompt = play(tokenizer, [turn, "#### 5<|im_end|>"])
    [reply] = assert_spliced(rollout, sampled)
    answers = [
        "5",
        "error: KeyError: 'no entry 1'",
        "error: unknown tool 'nope'; the tools are: add, broken, sleepy",
        "error: malformed tool call: not JSON (Expecting property name enclosed in double quotes at character 1)",
    ]
    conversation = [m.model_dump() for m in EXAMPLE.prompt] + [{"role": "assistant", "content": turn.removesuffix("<|im_end|>")}]
    conversation += [{"role": "tool", "content": a} for a in answers]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, **prompt.template_kwargs)
    assert tokenizer.decode(prompt_ids + rollout.completion_ids) == rendered + "#### 5<|im_end|>"
    assert tokenizer.decode(reply).startswith(
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>"
    )  # the model's <|im_end|> not repeated
    assert '"name": "add"' in tokenizer.decode(prompt_ids)  # the schemas, rendered by the template
    episode = rollout.episode
    assert (episode.tool_calls, episode.tool_errors, episode.tool_malformed) == (3, 2, 1)
    assert episode.turns[1].text == "\n".join(answers)


def test_a_template_that_writes_results_as_json_gets_them_escaped(smollm2):
    """Llama 3.1 writes a tool message's content with tojson: the answer's ids are its JSON text.
    (SmolLM2's vocabulary has no <|eot_id|> token: the turns end without it, the template adds it.)"""
    tokenizer = with_template(smollm2, "llama3_1.jinja")
    turn = '{"name": "broken", "parameters": {"x": 7}}'
    rollout, prompt_ids, sampled, prompt = play(tokenizer, [turn, "#### 5"])
    assert_spliced(rollout, sampled)
    conversation = [m.model_dump() for m in EXAMPLE.prompt] + [{"role": "assistant", "content": turn}]
    conversation.append({"role": "tool", "content": "error: KeyError: 'no entry 7'"})
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, **prompt.template_kwargs)
    assert tokenizer.decode(prompt_ids + rollout.completion_ids) == rendered + "#### 5"
    assert "\"error: KeyError: 'no entry 7'\"" in rendered and rollout.episode.tool_errors == 1


def test_after_max_tool_calling_iterations_a_turns_calls_end_the_episode_unrun(smollm2):
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
    rollout, _, sampled, _ = play(smollm2, [call, call, "never sampled"], max_rounds=1, max_turns=2)
    assert len(sampled) == 2 and rollout.episode.end == "done" and rollout.finish_reason == "stop"
    assert (rollout.episode.tool_calls, [t.role for t in rollout.episode.turns]) == (1, ["model", "tool", "model"])
    # no limit: the turn budget ends it, the last turn's calls not run (nothing would read them)
    rollout, _, sampled, _ = play(smollm2, [call, call, "never sampled"], max_rounds=None, max_turns=2)
    assert rollout.episode.end == "turns" and rollout.episode.tool_calls == 1


def test_a_tool_past_its_timeout_is_an_error_answer_and_the_episode_goes_on(smollm2):
    call = '<tool_call>{"name": "sleepy", "arguments": {"seconds": 60}}</tool_call>'
    rollout, *_ = play(smollm2, [call, "#### 5<|im_end|>"], timeout_s=1.0)
    assert rollout.episode.turns[1].text == "error: the tool took longer than 1 s and was stopped"
    assert (rollout.episode.end, rollout.episode.tool_errors) == ("done", 1)
