"""This module serves an agent's `openai.AsyncOpenAI` client in process: `POST /chat/completions`
answered by the run's generate engine, with no HTTP server (an `httpx` transport of our own).

A request's messages (and `tools=`) are rendered with the model's chat template and sampled with
the run's sampling settings, and every completion is recorded as the engine produced it: the
prompt ids it was given, the ids it sampled and their sampling log-probs (`Call`). The trainer
trains on those ids, never on a re-tokenization of the text the agent saw
(`grpo_flyte.engine.agents` turns an episode's calls into training sequences).

A request that continues an earlier call's conversation (its messages are that call's messages,
then the assistant message it returned, then more) is given that call's ids and sampled ids
followed by the template's tokens of the new messages: the model reads its own tokens back, as in
a multi-turn environment (`grpo_flyte.engine.episodes.Splicer`), and the two calls are one
training sequence. Any other request is rendered whole.

What is honoured of a request: `messages`, `tools`, `tool_choice` ('none': no tools rendered nor
parsed; others: rendered and parsed, not enforced), `n`, `max_tokens` / `max_completion_tokens`
(lowered to the run's budgets), `stop`. The run's sampling settings replace `temperature`, `top_p`
and the like: the trainer's log-probs are those of the run's sampling distribution. `stream` is
refused. The `model` name is echoed back: whatever it is, the policy being trained answers.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from grpo_flyte.errors import ToolSpecError
from grpo_flyte.tools import formats
from grpo_flyte.types import Rollout

# sample(context ids, max new tokens, n, the call's number, extra stop strings) -> n rollouts
Sample = Callable[[list[int], int, int, int, tuple[str, ...]], Awaitable[list[Rollout]]]
MAX_N = 16  # completions one request may ask for


class ToolFormat(Protocol):
    """How tools reach the model and its calls come back: the prompt text of `messages` with
    `tools` (None: no tools), and a completion's text as (content, tool calls as OpenAI's
    `{"id", "type": "function", "function": {"name", "arguments"}}` dicts). The tools helper's
    per-template formats (`--tools`) plug in here; `HermesFormat` is the default."""

    def render(self, tokenizer, messages: list[dict], tools: list[dict] | None, template_kwargs: dict) -> str: ...

    def parse(self, text: str) -> tuple[str, list[dict]]: ...


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesFormat:
    """Tool calls as Qwen and Hermes templates write them: `<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>`. A template that renders no tools (its source never names them) gets
    their JSON schemas in its system message, with that format's instructions."""

    def render(self, tokenizer, messages: list[dict], tools: list[dict] | None, template_kwargs: dict) -> str:
        template = getattr(tokenizer, "chat_template", None) or ""
        if tools and "tools" not in template:
            messages = _with_tool_system(_calls_as_text(messages), tools)
            tools = None
        elif "tool_calls" not in template:
            messages = _calls_as_text(messages)
        kwargs = {**template_kwargs, **({"tools": tools} if tools else {})}
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)

    def parse(self, text: str) -> tuple[str, list[dict]]:
        calls = []
        for i, body in enumerate(_TOOL_CALL.findall(text)):
            try:
                call = json.loads(body)
                name, arguments = call["name"], call.get("arguments", {})
            except (ValueError, KeyError, TypeError):
                continue  # not a call: it stays in the content
            if not isinstance(name, str):
                continue
            arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
            calls.append({"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}})
        content = text[: text.index("<tool_call>")].strip() if calls else text
        return content, calls


def _calls_as_text(messages: list[dict]) -> list[dict]:
    """Assistant tool calls written into the content, for templates that drop `tool_calls`."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            written = "".join(
                f"<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': _arguments(c)})}\n</tool_call>"
                for c in m["tool_calls"]
            )
            m = {"role": m["role"], "content": (m.get("content") or "") + written}
        out.append(m)
    return out


def _arguments(call: dict) -> Any:
    try:
        return json.loads(call["function"].get("arguments") or "{}")
    except ValueError:
        return call["function"].get("arguments")


def _with_tool_system(messages: list[dict], tools: list[dict]) -> list[dict]:
    listed = "\n".join(json.dumps(t) for t in tools)
    text = (
        "You may call one or more functions. Their signatures are within <tools></tools>:\n<tools>\n"
        f"{listed}\n</tools>\nFor each call, write a JSON object with the function's name and arguments within "
        '<tool_call></tool_call> tags: <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


HERMES = HermesFormat()

# A chat template's special tokens as they appear in a turn decoded with them (<|eot_id|>, [TOOL_CALLS], </s>).
_SPECIAL = re.compile(r"<\|[^|>\s]+\|>|\[/?[A-Z_]+\]|</?s>")


def _without_special_tokens(text: str) -> str:
    return _SPECIAL.sub("", text)


# Where a format's calls begin in a turn's text (what comes before is the message's content).
_CALLS_BEGIN = {"llama": ("<|python_tag|>", "{"), "mistral": ("[TOOL_CALLS]",)}


@dataclass(frozen=True)
class TemplateFormat(HermesFormat):
    """Tool calls in the format of the model's chat template that is not Hermes' (Llama 3.x's
    whole-turn JSON, Mistral's `[TOOL_CALLS]`), read by `grpo_flyte.tools.formats` (what `--tools`
    reads). Their markers are special tokens, so the turn is read with its special tokens kept; the
    prompt is rendered as Hermes' is (such templates take `tools=` and `tool_calls` themselves)."""

    name: str
    keeps_special_tokens: bool = True

    def parse(self, text: str) -> tuple[str, list[dict]]:
        turn = formats.parse_turn(self.name, text)
        calls = [
            {"id": f"call_{i}", "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for i, c in enumerate(turn.calls)
        ]
        content = _without_special_tokens(text)
        if calls:
            starts = [text.index(mark) for mark in _CALLS_BEGIN[self.name] if mark in text]
            content = _without_special_tokens(text[: min(starts)]).strip() if starts else ""
        return content, calls


def tool_format_of(tokenizer, template_kwargs: dict) -> ToolFormat:
    """The ToolFormat of a tokenizer's chat template (`grpo_flyte.tools.formats.detect_format`):
    Hermes' for a Hermes template, for a template that renders no tools (the fallback) and for a
    tokenizer's own response template (whose calls are Hermes-shaped in the models that ship one)."""
    try:
        name = formats.detect_format(tokenizer, template_kwargs)
    except ToolSpecError:  # a template whose calls no parser reads: an agent's tools= get Hermes' convention
        return HERMES
    return TemplateFormat(name) if name in _CALLS_BEGIN else HERMES


# --------------------------------------------------------------------------- the recorded calls


@dataclass
class Call:
    """One completion the engine produced: the ids it was given and what it sampled."""

    number: int  # the request's number within the episode (n > 1: its completions share it)
    prompt_ids: list[int]
    completion: Rollout
    messages: list[dict]  # the request's messages, normalized
    tools: list[dict] | None
    reply: dict  # the assistant message returned for it, normalized
    content: str  # the text the model wrote (special tokens left out)
    cut: str | None = None  # cut at a token budget: 'turn_tokens' or 'episode_tokens'

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion.completion_ids


@dataclass(frozen=True)
class Limits:
    max_calls: int  # requests per episode (max_turns)
    max_call_tokens: int  # new tokens per completion (max_new_tokens)
    max_episode_tokens: int  # tokens the episode's training sequences hold after their prompts
    context_tokens: int  # the engine's window: a prompt and its completion


class BadRequest(Exception):
    """A request the server refuses (HTTP 400): `code` as OpenAI's error codes, `end` the episode's
    end it marks (a budget), or None."""

    def __init__(self, message: str, code: str = "invalid_request_error", end: str | None = None):
        super().__init__(message)
        self.code, self.end = code, end


def normalized(message: Any) -> dict:
    """A chat message as a plain dict: role, text content ('' for none; text parts joined), and
    `tool_calls` / `tool_call_id` / `name` when present (an SDK object is dumped first)."""
    if hasattr(message, "model_dump"):
        message = message.model_dump(exclude_none=True)
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadRequest(f"a message must be an object with a role; got {str(message)[:80]!r}")
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    out: dict[str, Any] = {"role": message["role"], "content": content if isinstance(content, str) else ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": c.get("id", ""),
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": c["function"].get("arguments", "")},
            }
            for c in message["tool_calls"]
        ]
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def _same_reply(given: dict, returned: dict) -> bool:
    """Whether the agent passed back the assistant message a call returned (call ids aside)."""

    def shape(m: dict) -> tuple:
        calls = tuple((c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", ()))
        return m["role"], m["content"].strip(), calls

    return shape(given) == shape(returned)


def chains(calls: list[Call]) -> list[list[Call]]:
    """The calls as training sequences, in order: a call whose prompt ids start with the whole ids
    (prompt and completion) of the last call of a sequence continues that sequence; any other call
    (the first, or one that branches: a second completion from one history, an edited history)
    starts one. A sequence's ids are its first prompt, then every call's new prompt tokens and
    completion; a token is in one sequence's completion at most."""
    found: list[list[Call]] = []
    for call in calls:
        end = _continued(call.prompt_ids, found)
        if end is None:
            found.append([call])
        else:
            next(chain for chain in found if chain[-1] is end).append(call)
    return found


def _continued(prompt_ids: list[int], found: list[list[Call]]) -> Call | None:
    """The last call of the sequence `prompt_ids` continues (the longest one it extends), or None."""
    ends = [chain[-1] for chain in found if len(chain[-1].ids) <= len(prompt_ids) and prompt_ids[: len(chain[-1].ids)] == chain[-1].ids]
    return max(ends, key=lambda c: len(c.ids), default=None)


# --------------------------------------------------------------------------- the server


@dataclass
class ChatServer:
    """One episode's `/chat/completions`: renders, samples through `sample`, records every call,
    and keeps the episode's budgets (`end` names the one a refused request ran out of)."""

    tokenizer: Any
    sample: Sample
    limits: Limits
    template_kwargs: dict = field(default_factory=dict)
    tool_format: ToolFormat = HERMES
    calls: list[Call] = field(default_factory=list)
    requests: int = 0
    end: str | None = None

    def used_tokens(self) -> int:
        """The tokens after the prompts of the training sequences the recorded calls make (`chains`)."""
        return sum(len(chain[-1].ids) - len(chain[0].prompt_ids) for chain in chains(self.calls))

    async def complete(self, body: dict) -> dict:
        """The ChatCompletion (as JSON) for a request body; BadRequest for one refused."""
        if body.get("stream"):
            raise BadRequest("stream=true is not supported: the run's engine answers whole completions")
        n = body.get("n") or 1
        if not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise BadRequest(f"n={n!r}; expected a whole number from 1 to {MAX_N}")
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise BadRequest("messages must be a non-empty list")
        messages = [normalized(m) for m in raw]
        tools = body.get("tools") or None
        if body.get("tool_choice") == "none":
            tools = None
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(s for s in stop if isinstance(s, str) and s)
        if self.requests >= self.limits.max_calls:
            self.end = "turns"
            raise BadRequest(f"the episode's {self.limits.max_calls} completions (max_turns) are used", "max_turns_exceeded", "turns")
        prompt_ids = self.prompt_ids(messages, tools)
        want = min(
            body.get("max_completion_tokens") or body.get("max_tokens") or self.limits.max_call_tokens,
            self.limits.max_call_tokens,
            self.limits.max_episode_tokens - self.used_tokens() - self._new_prompt_tokens(prompt_ids),
            self.limits.context_tokens - len(prompt_ids),
        )
        if want < 1:
            self.end = "episode_tokens"
            raise BadRequest("the episode's token budget (max_episode_tokens) is used", "context_length_exceeded", "episode_tokens")
        number = self.requests
        self.requests += 1
        rollouts = await self.sample(prompt_ids, want, n, number, stop)
        choices, completion_tokens = [], 0
        for i, rollout in enumerate(rollouts):
            keep = getattr(self.tool_format, "keeps_special_tokens", False) and bool(tools)
            text = self.tokenizer.decode(rollout.completion_ids, skip_special_tokens=not keep)
            shown = _before_stop(text, stop)
            content, tool_calls = self.tool_format.parse(shown) if tools else (shown, [])
            reply: dict[str, Any] = {"role": "assistant", "content": content}
            if tool_calls:
                reply["tool_calls"] = tool_calls
            cut = None
            if rollout.finish_reason == "length":
                cut = "turn_tokens" if want == self.limits.max_call_tokens else "episode_tokens"
            self.calls.append(Call(number, prompt_ids, rollout, messages, tools, reply, text, cut))
            completion_tokens += len(rollout.completion_ids)
            finish = "length" if cut else "tool_calls" if tool_calls else "stop"
            choices.append({"index": i, "message": reply, "finish_reason": finish, "logprobs": None})
        return {
            "id": f"chatcmpl-{number}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": str(body.get("model", "policy")),
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
            },
        }

    def _new_prompt_tokens(self, prompt_ids: list[int]) -> int:
        """The prompt tokens a call would add to the sequence it continues (0: it starts one)."""
        end = _continued(prompt_ids, chains(self.calls))
        return len(prompt_ids) - len(end.ids) if end else 0

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The ids the engine is given: an earlier call's ids and the new messages' template tokens
        when the request continues that call's conversation, else the messages rendered whole."""
        for call in reversed(self.calls):
            k = len(call.messages)
            if call.tools == tools and len(messages) > k + 1 and messages[:k] == call.messages and _same_reply(messages[k], call.reply):
                spliced = self._after(messages, k, tools, call.completion.completion_ids)
                if spliced is not None:
                    return call.ids + spliced
        try:
            text = self.tool_format.render(self.tokenizer, messages, tools, self.template_kwargs)
        except Exception as exc:  # noqa: BLE001 -- templates reject messages in their own ways
            raise BadRequest(f"the model's chat template cannot render these messages ({type(exc).__name__}: {exc})") from None
        return self._ids(text)

    _MARK = "\x00model-turn\x00"

    def _after(self, messages: list[dict], k: int, tools: list[dict] | None, sampled: list[int]) -> list[int] | None:
        """The template's tokens after assistant message `k`, to the next assistant turn's opening
        (None when the template does not render the message's text where it stands); the model's
        own end-of-turn token, when it wrote one, is not repeated."""
        marked = [*messages[:k], {"role": "assistant", "content": self._MARK}, *messages[k + 1 :]]
        try:
            text = self.tool_format.render(self.tokenizer, marked, tools, self.template_kwargs)
        except Exception:  # noqa: BLE001 -- rendered whole instead, where the error is reported
            return None
        if text.count(self._MARK) != 1:
            return None
        after = text.split(self._MARK, 1)[1]
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        if sampled and sampled[-1] in special:
            closing = self.tokenizer.decode(sampled[-1:])
            if after.startswith(closing):
                after = after[len(closing) :]
        return self._ids(after)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _before_stop(text: str, stop: tuple[str, ...]) -> str:
    """OpenAI's content ends before a stop string (the engine's tokens keep it)."""
    cut = min((text.index(s) for s in stop if s in text), default=len(text))
    return text[:cut]


# --------------------------------------------------------------------------- the transport


def transport(complete: Callable[[dict], Awaitable[dict]]):
    """An `httpx.AsyncBaseTransport` answering `POST .../chat/completions` with `complete(body)`:
    200 and the completion, 400 and OpenAI's error object for a BadRequest, 404 for other paths."""
    import httpx

    class ChatTransport(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.method != "POST" or not request.url.path.endswith("/chat/completions"):
                return _error(404, f"{request.method} {request.url.path}: only POST /chat/completions is served", "not_found")
            try:
                body = json.loads(await request.aread() or b"{}")
                if not isinstance(body, dict):
                    raise BadRequest("the request body must be a JSON object")
                return httpx.Response(200, json=await complete(body))
            except BadRequest as exc:
                return _error(400, str(exc), exc.code)
            except ValueError as exc:
                return _error(400, f"the request body is not JSON ({exc})", "invalid_request_error")

    def _error(status: int, message: str, code: str) -> httpx.Response:
        return httpx.Response(status, json={"error": {"message": message, "type": "invalid_request_error", "code": code, "param": None}})

    return ChatTransport()


def openai_client(complete: Callable[[dict], Awaitable[dict]]):
    """An `openai.AsyncOpenAI` whose requests `complete` answers in this process (no retries: a
    refused request is the agent's to handle)."""
    import httpx
    import openai

    http = httpx.AsyncClient(transport=transport(complete), base_url="http://grpo-flyte.local/v1")
    return openai.AsyncOpenAI(api_key="grpo-flyte", base_url="http://grpo-flyte.local/v1", http_client=http, max_retries=0)
