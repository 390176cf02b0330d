"""This module reads a model's tool calls in its chat template's format, and gives a template
without tool support a format of its own (the fallback).

Formats (`detect_format` picks one for a tokenizer, once per engine):

    template   the tokenizer's own `response_template` (transformers' response parsing,
               `tokenizer.parse_response`): used whenever the model ships one
    hermes     <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number a turn
               (Qwen2.5/Qwen3, Hermes, SmolLM3)
    llama      the whole turn one JSON object {"name": ..., "parameters": {...}}, after an
               optional <|python_tag|> (Llama 3.1-3.3)
    mistral    [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (v3-v7 tokenizers), or
               [TOOL_CALLS]name[ARGS]{...} repeated (v11 and later)
    fallback   hermes, for a template that renders no tools (the embedded SmolLM2's): the tools'
               schemas and the calling convention are added to the system message by
               FALLBACK_PREFIX, a few lines of Jinja put before the model's own template; tool
               results are `tool` messages rendered by the model's template as any role is

The format of a template that renders tools is read off the template itself: an assistant
message with a sentinel tool call is rendered, and the text shows which of the formats it is.
A malformed call (not JSON, no name, arguments that are not an object, an unclosed tag) is
reported with its reason; the others in the turn still run.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from grpo_flyte.errors import ToolSpecError


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn's tool calls in order, and a reason for each malformed one."""

    calls: list[ParsedCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)

    @property
    def any(self) -> bool:
        return bool(self.calls or self.malformed)


def _call(obj: Any, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | str:
    """A call from its decoded JSON object, or the reason it is malformed."""
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):  # OpenAI's {"type": "function", "function": {...}}
        obj = obj["function"]
    if not isinstance(obj, dict):
        return f"expected a JSON object with 'name' and 'arguments', got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return "the call has no 'name'"
    arguments = next((obj[k] for k in arguments_keys if k in obj), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return f"the arguments of {name!r} are not JSON"
    if not isinstance(arguments, dict):
        return f"the arguments of {name!r} are {type(arguments).__name__}; expected a JSON object"
    return ParsedCall(name, arguments)


def _json_call(text: str, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | str:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON ({exc.msg} at character {exc.pos})"
    return _call(obj, arguments_keys)


def _collect(found: list[ParsedCall | str]) -> ParsedTurn:
    return ParsedTurn(calls=[c for c in found if isinstance(c, ParsedCall)], malformed=[c for c in found if isinstance(c, str)])


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    found: list[ParsedCall | str] = [_json_call(body.strip()) for body in _HERMES.findall(text)]
    rest = _HERMES.sub("", text)
    if "<tool_call>" in rest:
        found.append("a <tool_call> without its </tool_call>")
    return _collect(found)


_LLAMA_END = re.compile(r"(?:<\|eot_id\|>|<\|eom_id\|>|<\|end_of_text\|>)\s*$")


def parse_llama(text: str) -> ParsedTurn:
    body = _LLAMA_END.sub("", text).strip()
    body = body.removeprefix("<|python_tag|>").strip()
    if not (body.startswith("{") and '"name"' in body):
        return ParsedTurn()
    return _collect([_json_call(body, ("parameters", "arguments"))])


_MISTRAL_END = re.compile(r"(?:</s>)?\s*$")


def parse_mistral(text: str) -> ParsedTurn:
    if "[TOOL_CALLS]" not in text:
        return ParsedTurn()
    found: list[ParsedCall | str] = []
    for segment in text.split("[TOOL_CALLS]")[1:]:
        segment = _MISTRAL_END.sub("", segment).strip()
        if segment.startswith("["):
            try:
                calls = json.loads(segment)
            except json.JSONDecodeError as exc:
                found.append(f"not JSON ({exc.msg} at character {exc.pos})")
                continue
            if not isinstance(calls, list):
                found.append("expected a JSON list of calls after [TOOL_CALLS]")
                continue
            found += [_call(c) for c in calls]
        elif "[ARGS]" in segment:
            name, _, arguments = segment.partition("[ARGS]")
            name = name.split("[CALL_ID]")[0].strip()
            found.append(_json_args(name, arguments))
        else:
            found.append("expected a JSON list or name[ARGS]{...} after [TOOL_CALLS]")
    return _collect(found)


def _json_args(name: str, arguments: str) -> ParsedCall | str:
    try:
        args = json.loads(arguments.strip())
    except json.JSONDecodeError as exc:
        return f"the arguments of {name!r} are not JSON ({exc.msg} at character {exc.pos})"
    return _call({"name": name, "arguments": args})


def parse_with_template(tokenizer, text: str, schemas: list[dict]) -> ParsedTurn:
    """The tokenizer's own response template, through transformers' `parse_response`; a turn it
    cannot parse is one malformed call."""
    try:
        message = tokenizer.parse_response(text, prefix="", tools=schemas)
    except Exception as exc:  # noqa: BLE001 -- the parser raises its own kinds for bad model output
        return ParsedTurn(malformed=[f"unreadable ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"])
    return _collect([_call(c) for c in message.get("tool_calls") or []])


PARSERS = {"hermes": parse_hermes, "llama": parse_llama, "mistral": parse_mistral, "fallback": parse_hermes}
FORMATS = ("template", *PARSERS)
# Each format's strings that end a model turn besides its end-of-turn token: only the fallback,
# whose model was never taught to end its turn after a call.
STOP = {"fallback": ("</tool_call>",)}


def parse_turn(tool_format: str, text: str, tokenizer=None, schemas: list[dict] | None = None) -> ParsedTurn:
    """The tool calls in a model turn's text (decoded with its special tokens) in `tool_format`."""
    if tool_format == "template":
        return parse_with_template(tokenizer, text, schemas or [])
    return PARSERS[tool_format](text)


# --------------------------------------------------------------------------- which format a template uses

_SENTINEL = "grpoflytetoolprobe"
_SENTINEL_SCHEMA = {
    "type": "function",
    "function": {
        "name": _SENTINEL,
        "description": "A probe.",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer", "description": "x"}}, "required": ["x"]},
    },
}
_SENTINEL_CALL = {"id": "a1b2c3d4e", "type": "function", "function": {"name": _SENTINEL, "arguments": {"x": 7}}}


def renders_tools(tokenizer, template_kwargs: dict | None = None) -> bool:
    """Whether the chat template shows the model the tools it is given (`tools=`)."""
    messages = [{"role": "user", "content": "hi"}]
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=[_SENTINEL_SCHEMA], tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
        )
    except Exception:  # noqa: BLE001 -- a template that cannot take tools does not render them
        return False
    return _SENTINEL in text


def detect_format(tokenizer, template_kwargs: dict | None = None) -> str:
    """The tool-call format of the tokenizer's chat template (the module docstring's table);
    ToolSpecError when the template renders tools in a format none of them reads."""
    template = getattr(tokenizer, "response_template", None)
    if isinstance(template, dict) and "tool_calls" in (template.get("fields") or {}):
        return "template"
    if not renders_tools(tokenizer, template_kwargs):
        return "fallback"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [_SENTINEL_CALL]}]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[_SENTINEL_SCHEMA], tokenize=False, **(template_kwargs or {}))
    except Exception:  # noqa: BLE001 -- then the template's source is all there is to read
        text = ""
    source = text or str(getattr(tokenizer, "chat_template", "") or "")
    if "<tool_call>" in source:
        return "hermes"
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if re.search(r'\{"name":\s*"' + _SENTINEL + r'",\s*"parameters"', text) or (not text and "<|python_tag|>" in source):
        return "llama"
    raise ToolSpecError(
        "the model's chat template renders tools, but its tool calls are in none of the formats grpo_flyte reads "
        "(<tool_call> JSON, Llama 3 JSON, Mistral [TOOL_CALLS]); expected a tokenizer with a response_template "
        "(transformers' response parsing) or one of those"
    )


# The fallback: the tools in the system message, and the calling convention the parser reads.
# Rendered by the model's own template after these lines (they only change `messages`).
FALLBACK_PREFIX = """{%- if tools -%}
{%- set tool_text -%}
You can call these functions. Their signatures, as JSON, are within <tools></tools>:
<tools>
{%- for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}{{ '\n' }}</tools>
To call one, write <tool_call>{"name": <function name>, "arguments": <its arguments as a JSON object>}</tool_call>; its result comes back in the next message.
{%- endset -%}
{%- if messages and messages[0]['role'] == 'system' -%}
{%- set messages = [{'role': 'system', 'content': messages[0]['content'] + '\\n\\n' + tool_text}] + messages[1:] -%}
{%- else -%}
{%- set messages = [{'role': 'system', 'content': tool_text}] + messages -%}
{%- endif -%}
{%- endif -%}
"""


def tool_template_kwargs(tokenizer, tool_format: str, schemas: list[dict]) -> dict[str, Any]:
    """The chat template arguments that show the model its tools: `tools`, and for the fallback
    format the model's template behind FALLBACK_PREFIX."""
    kwargs: dict[str, Any] = {"tools": schemas}
    if tool_format == "fallback":
        kwargs["chat_template"] = FALLBACK_PREFIX + tokenizer.chat_template
    return kwargs
