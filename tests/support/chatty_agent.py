"""Agents for the tests (`--agent chatty_agent:chatty`): openai-client loops that a random tiny model
can play (its turns end within a token or two on these stop strings)."""

from __future__ import annotations

import asyncio
import time

import openai

STOP = list(" etaoinsr")[:4]  # OpenAI takes at most 4 stop strings


async def chatty(client, example):
    """Three requests in one conversation, each reply answered by a user message: one sequence."""
    messages = [{"role": "user", "content": example.question}]
    text = ""
    for turn in range(3):
        try:
            response = await client.chat.completions.create(model="anything", messages=messages, stop=STOP)
        except openai.BadRequestError:
            break
        text = response.choices[0].message.content
        messages += [response.choices[0].message, {"role": "user", "content": f"turn {turn + 1}: go on"}]
    return len(text) % 3 / 2  # rewards that differ within a group


async def branching(client, example):
    """Two completions from the same history (two requests), then one continuing the first: two
    sequences, the first holding two calls."""
    messages = [{"role": "user", "content": example.question}]
    first, _second = await asyncio.gather(*(client.chat.completions.create(model="m", messages=messages, stop=STOP) for _ in range(2)))
    more = [*messages, first.choices[0].message, {"role": "user", "content": "and then?"}]
    await client.chat.completions.create(model="m", messages=more, stop=STOP)
    return None


async def raising(client, example):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": example.question}], stop=STOP)
    raise RuntimeError("the agent is broken")


async def silent(client, example):
    return 0.5


async def blocking(client, example):
    """Blocks its thread past --tool-timeout-s (a synchronous tool): the episode ends, the run goes on."""
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": example.question}], stop=STOP)
    time.sleep(3)
    return 1.0


def not_async(client, example):
    return 1.0


async def one_argument(client):
    return 1.0
