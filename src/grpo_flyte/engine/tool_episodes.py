"""This module plays `--tools` episodes: plain Python functions called through the model's chat
template, TRL's `tools=` and `max_tool_calling_iterations`.

The prompt is rendered by the chat template with `tools=` (each function's JSON schema,
`grpo_flyte.tools.functions`). Each model turn is read in the template's tool-call format
(`grpo_flyte.tools.formats`); a turn without a call ends the episode (scored by the configured
rewards), and each call runs in the sandbox within --tool-timeout-s (`grpo_flyte.tools.execution`)
and is answered by a `tool` message, all of a turn's answers rendered together by the template. An
unknown tool, a tool that raises or runs out of time, and a malformed call are answered as errors
('error: ...'), so the model can try again, and counted (tool_errors, tool_malformed).

The episode loop is `grpo_flyte.engine.episodes`' (budgets, the sampled ids with their log-probs,
the replies' ids masked from the loss); this module gives it the environment (`ToolEnv`) and the
splicing of several tool messages (`ToolSplicer`).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from grpo_flyte.config.episode import EpisodeConfig
from grpo_flyte.config.generation import PromptConfig
from grpo_flyte.engine import cache, episodes
from grpo_flyte.engine.cache import EngineKey
from grpo_flyte.engine.interface import SamplingRequest
from grpo_flyte.engine.prompts import is_chat
from grpo_flyte.errors import EpisodeError
from grpo_flyte.multiturn import MultiTurnEnv, Reply, ToolReply, ToolResult
from grpo_flyte.runtime.sandbox import WORKER_START_S
from grpo_flyte.runtime.torch_thread import run_on_torch_thread
from grpo_flyte.tools import execution, formats
from grpo_flyte.tools.functions import Tool, load_tools
from grpo_flyte.types import Example, Rollout

# Calls run in one turn at most; a turn's further calls are answered with an error, not run.
MAX_CALLS_PER_TURN = 8


class ToolKit:
    """A run's tools on one tokenizer: the tools, their schemas, the template's tool-call format and
    the chat template arguments that show the model its tools."""

    def __init__(self, tokenizer, specs: tuple[str, ...], template_kwargs: dict[str, Any]):
        self.specs = specs
        self.tools: dict[str, Tool] = {tool.name: tool for tool in load_tools(specs)}
        self.schemas = [tool.schema for tool in self.tools.values()]
        self.format = formats.detect_format(tokenizer, template_kwargs)
        self.template_kwargs = {**template_kwargs, **formats.tool_template_kwargs(tokenizer, self.format, self.schemas)}
        self.tokenizer = tokenizer


@functools.lru_cache(maxsize=8)
def _kit(tokenizer, specs: tuple[str, ...], template_kwargs_json: str) -> ToolKit:
    return ToolKit(tokenizer, specs, json.loads(template_kwargs_json))


def tool_kit(tokenizer, specs: tuple[str, ...], prompt: PromptConfig) -> ToolKit:
    """The tools `specs` name on `tokenizer` (built once per tokenizer, tools and template arguments)."""
    return _kit(tokenizer, specs, json.dumps(prompt.template_kwargs, sort_keys=True))


def tool_prompt_config(tokenizer, prompt: PromptConfig, specs: tuple[str, ...]) -> PromptConfig:
    """`prompt` with the tools among its chat template arguments: the prompts and the tool messages
    are rendered with them (`tools=`, and for the fallback format its template)."""
    kit = tool_kit(tokenizer, specs, prompt)
    return prompt.model_copy(update={"chat_template_kwargs": kit.template_kwargs})


async def tool_prompt(key: EngineKey, prompt: PromptConfig, episode: EpisodeConfig) -> PromptConfig:
    """`tool_prompt_config` with the engine's tokenizer (the engine is built if needed)."""
    engine = await run_on_torch_thread(cache.get_engine, key)
    return tool_prompt_config(engine.tokenizer, prompt, episode.tools)


class ToolEnv(MultiTurnEnv):
    """One episode's tools: each model turn's calls run and answered (the module docstring).

    After `max_rounds` turns with calls (TRL's max_tool_calling_iterations; None: no limit) a turn's
    calls are not run and the episode ends there, as in TRL. On the episode's last allowed turn
    (`max_turns`) the calls are not run either: no model turn would read their answers.
    """

    keep_special_tokens = True

    def __init__(self, kit: ToolKit, timeout_s: float, max_rounds: int | None, max_turns: int):
        self.kit, self.timeout_s, self.max_rounds, self.max_turns = kit, timeout_s, max_rounds, max_turns
        self.stop = formats.STOP.get(kit.format, ())
        self.rounds = self.turns = 0

    def step(self, text: str) -> Reply:
        self.turns += 1
        parsed = formats.parse_turn(self.kit.format, text, self.kit.tokenizer, self.kit.schemas)
        if not parsed.any or (self.max_rounds is not None and self.rounds >= self.max_rounds):
            return Reply(done=True)
        if self.turns >= self.max_turns:
            return ToolReply(role="tool")  # the episode ends on its turn budget; nothing would read the answers
        self.rounds += 1
        results: list[ToolResult] = []
        errors = 0
        for i, call in enumerate(parsed.calls):
            answer = (
                self._answer(call)
                if i < MAX_CALLS_PER_TURN
                else execution.Answer(f"error: more than {MAX_CALLS_PER_TURN} calls in one turn; this one was not run", error=True)
            )
            errors += answer.error
            results.append(ToolResult(call.name, answer.text))
        results += [ToolResult("", f"error: malformed tool call: {reason}") for reason in parsed.malformed]
        return ToolReply(role="tool", results=tuple(results), calls=len(parsed.calls), errors=errors, malformed=len(parsed.malformed))

    def _answer(self, call: formats.ParsedCall) -> execution.Answer:
        tool = self.kit.tools.get(call.name)
        if tool is None:
            known = ", ".join(self.kit.tools)
            return execution.Answer(f"error: unknown tool {call.name[:80]!r}; the tools are: {known}", error=True)
        return execution.call_tool(self.kit.specs, tool.spec, call.arguments, self.timeout_s)


class ToolSplicer(episodes.Splicer):
    """`Splicer` for a turn's tool messages: the text around them is the template's own, read off
    the template rendered around placeholders (one per message, with its tool's name); each
    answer's ids are its text's (escaped as JSON where the template writes tool results as JSON
    strings, as Llama 3.1's does)."""

    _PLACE = "grpoflytetoolresult{}x"

    def __init__(self, tokenizer, template_kwargs: dict | None = None):
        super().__init__(tokenizer, True, template_kwargs)
        self._tool_frames: dict[tuple[str, ...], list[str]] = {}
        self._json_escaped: bool | None = None

    def _render(self, names: tuple[str, ...], contents: list[str]) -> str:
        messages = [
            {"role": "user", "content": "?"},
            {"role": "assistant", "content": self._MODEL},
            *[
                {"role": "tool", "name": n, "content": c, "tool_call_id": f"call{i:05d}"}
                for i, (n, c) in enumerate(zip(names, contents, strict=True))
            ],
        ]
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **self.extra)
        except Exception as exc:  # noqa: BLE001 -- templates reject messages in their own ways
            raise EpisodeError(f"the model's chat template cannot render tool messages ({type(exc).__name__}: {exc})") from None

    def tool_frame(self, names: tuple[str, ...]) -> list[str]:
        """The template's text between the model's turn and each tool answer, and after the last."""
        if names not in self._tool_frames:
            places = [self._PLACE.format(i) for i in range(len(names))]
            text = self._render(names, places)
            if self._MODEL not in text or not all(p in text for p in places):
                raise EpisodeError("the model's chat template drops the content of tool messages")
            rest = text[text.index(self._MODEL) + len(self._MODEL) :]
            pieces = []
            for place in places:
                piece, rest = rest.split(place, 1)
                pieces.append(piece)
            self._tool_frames[names] = [*pieces, rest]
        return self._tool_frames[names]

    def escape(self, content: str) -> str:
        if self._json_escaped is None:
            probe = 'a"b\\nc'
            self._json_escaped = probe not in self._render(("probe",), [probe])
        return json.dumps(content)[1:-1] if self._json_escaped else content

    def reply_ids(self, reply: Reply, turn_ids: list[int]) -> list[int]:
        if not isinstance(reply, ToolReply) or not reply.results:
            return super().reply_ids(reply, turn_ids)
        pieces = list(self.tool_frame(tuple(r.name for r in reply.results)))
        if turn_ids and turn_ids[-1] in self.special:  # the model's own end-of-turn token is not repeated
            closing = self.tokenizer.decode(turn_ids[-1:])
            pieces[0] = pieces[0].removeprefix(closing)
        ids: list[int] = []
        for piece, result in zip(pieces, reply.results, strict=False):
            ids += self._ids(piece) + self._ids(self.escape(result.content), literal=True)
        return ids + self._ids(pieces[-1])


async def play_tool_episodes(
    key: EngineKey,
    adapter_path: str,
    example: Example,
    prompt_ids: list[int],
    request: SamplingRequest,
    episode: EpisodeConfig,
    prompt: PromptConfig,
) -> list[Rollout]:
    """`request.group_size` episodes with the tools of `episode` from one prompt (rendered with
    `tool_prompt`, whose chat template arguments `prompt` must carry), played concurrently."""
    if not is_chat(example, prompt):
        raise EpisodeError(
            f"--tools needs chat prompts (the chat template renders the tools); the row {example.question[:80]!r} is plain text"
        )
    engine = await run_on_torch_thread(cache.get_engine, key)
    kit = _kit_of(engine.tokenizer, episode, prompt)
    rounds = episode.max_tool_calling_iterations
    max_turns = rounds + 1 if rounds is not None else episode.max_turns
    # The sandbox stops each call at tool_timeout_s; the step's own limit only backs it up (a
    # worker's start and a turn's calls one after another).
    step_limit = WORKER_START_S + MAX_CALLS_PER_TURN * episode.tool_timeout_s + 30
    budgets = episodes.Budgets(max_turns, request.max_new_tokens, episode.max_episode_tokens, step_limit)
    splicer = ToolSplicer(engine.tokenizer, prompt.template_kwargs)

    def new_env() -> ToolEnv:
        return ToolEnv(kit, episode.tool_timeout_s, rounds, max_turns)

    return await episodes.play_group(key, adapter_path, new_env, prompt_ids, request, splicer, budgets, formats.STOP.get(kit.format, ()))


def _kit_of(tokenizer, episode: EpisodeConfig, prompt: PromptConfig) -> ToolKit:
    """The kit whose template arguments `prompt` carries (`tool_prompt` made it from the run's own)."""
    own = {k: v for k, v in prompt.template_kwargs.items() if k not in ("tools", "chat_template")}
    return _kit(tokenizer, episode.tools, json.dumps(own, sort_keys=True))
