"""Tool-call formats: each template family's calls parsed (well-formed, several, malformed), the
format read off real chat templates, and the fallback for a template without tools."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from grpo_flyte.errors import ToolSpecError
from grpo_flyte.tools import formats
from grpo_flyte.tools.formats import ParsedCall, ParsedTurn, detect_format, parse_turn

trl = pytest.importorskip("trl")  # TRL ships the Qwen3 and Llama 3.1 templates verbatim (a dev dependency)
TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"

# Mistral's v3 template, the parts that matter here: tools before the first message, calls as a
# JSON list after [TOOL_CALLS] with 9-character ids, results as JSON objects.
MISTRAL = (
    "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'user' %}[INST] {{ message['content'] }}[/INST]"
    "{% elif message['role'] == 'assistant' %}{% if message.tool_calls %}[TOOL_CALLS]["
    "{% for tc in message.tool_calls %}{{ {'name': tc.function.name, 'arguments': tc.function.arguments, 'id': tc.id} | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}"
    "{% elif message['role'] == 'tool' %}[TOOL_RESULTS]{{ {'content': message.content, 'call_id': message.tool_call_id} | tojson }}"
    "[/TOOL_RESULTS]{% endif %}{% endfor %}"
)
# SmolLM3's shape (ChatML; the tools and the <tool_call> convention in the system message).
SMOLLM3 = (
    "{% if tools %}<|im_start|>system\n## Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    'Call a function with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ 'user' if m['role'] == 'tool' else m['role'] }}\n"
    "{% if m['role'] == 'tool' %}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% elif m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>\n{{ tc.function | tojson }}\n</tool_call>{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A template that renders tools and calls in a format no parser here reads.
ODD = "{% for t in tools %}{{ t.function.name }}{% endfor %}{% for m in messages %}{% for tc in m.tool_calls or [] %}CALL {{ tc.function.name }}{% endfor %}{{ m['content'] }}{% endfor %}"
# transformers' response template of Qwen3 (as TRL sets it), for a tokenizer that ships one.
QWEN3_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


@pytest.fixture(scope="module")
def smollm2(embedded_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_dir))


def with_template(tokenizer, template: str):
    twin = copy.copy(tokenizer)
    twin.chat_template = template
    return twin


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (None, "fallback"),  # the embedded SmolLM2's template renders no tools
        ((TRL_TEMPLATES / "qwen3.jinja").read_text(), "hermes"),
        ((TRL_TEMPLATES / "qwen2_5.jinja").read_text(), "hermes"),
        ((TRL_TEMPLATES / "llama3_1.jinja").read_text(), "llama"),
        ((TRL_TEMPLATES / "llama3_2.jinja").read_text(), "llama"),
        (MISTRAL, "mistral"),
        (SMOLLM3, "hermes"),
    ],
)
def test_the_format_is_read_off_the_template(smollm2, template, expected):
    tokenizer = smollm2 if template is None else with_template(smollm2, template)
    assert detect_format(tokenizer) == expected


def test_a_tokenizer_with_a_response_template_is_parsed_by_transformers(smollm2):
    tokenizer = with_template(smollm2, (TRL_TEMPLATES / "qwen3.jinja").read_text())
    tokenizer.response_template = QWEN3_RESPONSE_TEMPLATE
    assert detect_format(tokenizer) == "template"
    schema = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": "7"}}\n</tool_call><|im_end|>'
    assert parse_turn("template", text, tokenizer, [schema]) == ParsedTurn([ParsedCall("add", {"a": 7})])  # typed by its schema
    broken = parse_turn("template", "<tool_call>{oops}</tool_call><|im_end|>", tokenizer, [schema])
    assert broken.calls == [] and len(broken.malformed) == 1 and broken.malformed[0].startswith("unreadable (ValueError")


def test_a_template_whose_calls_no_parser_reads_is_refused(smollm2):
    with pytest.raises(ToolSpecError, match="none of the formats grpo_flyte reads"):
        detect_format(with_template(smollm2, ODD))


def test_hermes_calls_several_a_turn_each_malformed_one_with_its_reason():
    text = (
        'I will compute.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "shout", "arguments": "{\\"text\\": \\"hi\\"}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "add", "arguments": 5}</tool_call><tool_call>{"name": "x"'
    )
    parsed = parse_turn("hermes", text)
    assert parsed.calls == [ParsedCall("add", {"a": 1, "b": 2}), ParsedCall("shout", {"text": "hi"})]
    assert parsed.malformed == [
        "not JSON (Expecting property name enclosed in double quotes at character 1)",
        "expected a JSON object with 'name' and 'arguments', got list",
        "the call has no 'name'",
        "the arguments of 'add' are int; expected a JSON object",
        "a <tool_call> without its </tool_call>",
    ]
    assert parse_turn("hermes", "#### 42<|im_end|>") == ParsedTurn()
    assert parse_turn("fallback", '<tool_call>{"name": "add"}</tool_call>').calls == [ParsedCall("add", {})]


def test_llama_calls_are_the_whole_turn_as_json_with_parameters():
    call = ParsedCall("add", {"a": 1, "b": 2})
    assert parse_turn("llama", '{"name": "add", "parameters": {"a": 1, "b": 2}}<|eot_id|>').calls == [call]
    assert parse_turn("llama", '<|python_tag|>{"name": "add", "arguments": {"a": 1, "b": 2}}<|eom_id|>').calls == [call]
    assert parse_turn("llama", "The answer is 3.<|eot_id|>") == ParsedTurn()
    assert parse_turn("llama", '{"name": "add", "parameters": {"a": 1,<|eot_id|>').malformed[0].startswith("not JSON")


def test_mistral_calls_as_a_json_list_or_name_and_args():
    v3 = (
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "a1b2c3d4e"}, {"name": "shout", "arguments": {"text": "x"}}]</s>'
    )
    assert parse_turn("mistral", v3).calls == [ParsedCall("add", {"a": 1, "b": 2}), ParsedCall("shout", {"text": "x"})]
    v11 = '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]shout[ARGS]{"text": oops}</s>'
    parsed = parse_turn("mistral", v11)
    assert parsed.calls == [ParsedCall("add", {"a": 1, "b": 2})] and parsed.malformed[0].startswith("the arguments of 'shout' are not JSON")
    assert parse_turn("mistral", "Three.</s>") == ParsedTurn()
    assert parse_turn("mistral", "[TOOL_CALLS]what</s>").malformed == ["expected a JSON list or name[ARGS]{...} after [TOOL_CALLS]"]


def test_the_fallback_shows_the_tools_in_the_system_message_and_changes_nothing_else(smollm2):
    schema = {"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {"type": "object", "properties": {}}}}
    kwargs = formats.tool_template_kwargs(smollm2, "fallback", [schema])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"}]
    text = smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert text == (
        "<|im_start|>system\nBe brief.\n\nYou can call these functions. Their signatures, as JSON, are within <tools></tools>:\n"
        '<tools>\n{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {"type": "object", "properties": {}}}}\n'
        '</tools>\nTo call one, write <tool_call>{"name": <function name>, "arguments": <its arguments as a JSON object>}</tool_call>; '
        "its result comes back in the next message.<|im_end|>\n<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    no_tools = smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=kwargs["chat_template"])
    assert no_tools == smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    alone = smollm2.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=True, **kwargs)
    assert alone.startswith("<|im_start|>system\nYou can call these functions.") and "SmolLM" not in alone
    assert formats.tool_template_kwargs(smollm2, "hermes", [schema]) == {"tools": [schema]}
