"""Your own agent, trained as it is: a short agent loop written against the `openai` client, with a
calculator tool.

    python -m grpo_flyte --local --agent examples.agent_openai:rollout --dataset calculator \\
        --max-turns 3 --max-episode-tokens 384 --rewards correct=1.0,format=0.2

`rollout(client, example)` is called once per episode. `client` is an `openai.AsyncOpenAI` whose
`chat.completions.create` calls the run's policy answers (the current adapter, the run's sampling
settings; any `model` name), in process. Every completion is recorded token for token and trained
on: the loss is on exactly what the policy sampled, the tool results and the prompt masked out.
The function returns the episode's reward (the `env` reward), or None, as here, to let the run's
rewards score the final conversation (`correct` reads the last assistant message's '#### <integer>'
line). Past a budget (max_turns requests, max_episode_tokens) a request raises
`openai.BadRequestError`; the episode then ends at that budget.

The module must be importable where the episodes run: from the working directory in a local run,
under the code bundle's root (the checkout's src/ or the working directory) on a cluster.
"""

from __future__ import annotations

import json

import openai

from grpo_flyte.multiturn import evaluate, shown_number

SYSTEM = (
    "You solve arithmetic problems. Use the calculate tool for any product or sum you are not sure of. "
    "End your reply with the final answer as '#### <integer>'."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "The value of an arithmetic expression, e.g. '374 * 829'.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "numbers, + - * / and parentheses"}},
                "required": ["expression"],
            },
        },
    }
]

# One worked exchange before the question (as the built-in calculator's prompt has): a small model
# calls the tool in many more of its first replies with it, which leaves RL room to act.
DEMO = [
    {"role": "user", "content": "What is 12 * 34?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "calculate", "arguments": '{"expression": "12*34"}'}}],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "408"},
    {"role": "assistant", "content": "#### 408"},
]


def calculate(expression: str) -> str:
    """The tool: the expression's value, or an error the model reads."""
    try:
        return shown_number(evaluate(expression))
    except ValueError as exc:
        return f"error: {exc}"


async def rollout(client: openai.AsyncOpenAI, example) -> float | None:
    """One episode: ask, run each tool call the model makes and answer it, until a reply without
    one (at most three requests)."""
    messages: list = [{"role": "system", "content": SYSTEM}, *DEMO, {"role": "user", "content": example.question}]
    for _ in range(3):
        try:
            response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        except openai.BadRequestError:  # a budget ran out: the conversation so far is scored
            break
        message = response.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = calculate(str(json.loads(call.function.arguments)["expression"]))
            except (ValueError, KeyError, TypeError):
                result = "error: expected arguments {'expression': '...'}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
