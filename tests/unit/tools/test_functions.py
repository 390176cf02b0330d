"""Tools as Python functions: each one's schema from its signature and docstring, and the errors
for a `--tools` value that cannot be a tool, each one line naming the value."""

from __future__ import annotations

import pytest

from grpo_flyte.config.run import RunConfig
from grpo_flyte.errors import ToolSpecError
from grpo_flyte.tools.functions import load_tool, load_tools, tool_names

FNS = "tests.support.tool_fns"


def test_a_schema_comes_from_the_type_hints_and_the_docstring():
    tool = load_tool(f"{FNS}:add")
    assert (tool.spec, tool.name) == (f"{FNS}:add", "add")
    assert tool.schema == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first."},
                    "b": {"type": "integer", "description": "The second."},
                },
                "required": ["a", "b"],
            },
        },
    }


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("tests.support.no_such_module:add", "cannot import module 'tests.support.no_such_module'"),
        (f"{FNS}:missing", "has no attribute 'missing'"),
        (f"{FNS}:NOT_A_FUNCTION", "is int, not a function"),
        (f"{FNS}:undocumented", "no JSON schema from its signature and docstring (DocstringParsingException"),
        (f"{FNS}:untyped", "missing a type hint"),
        ("no_colon", "expected 'module:function'"),
    ],
)
def test_a_value_that_is_no_tool_is_one_line_naming_it(spec, expected):
    with pytest.raises(ToolSpecError) as raised:
        load_tool(spec)
    message = str(raised.value)
    assert repr(spec) in message and expected in message and "\n" not in message
    assert raised.value.field == "tools"


def test_two_tools_with_one_name_are_refused():
    with pytest.raises(ToolSpecError, match="both called 'add'"):
        load_tools((f"{FNS}:add", "tests.support.tool_fns_twin:add"))


def test_the_option_takes_a_comma_separated_list_a_list_or_a_config_file_key(tmp_path):
    assert tool_names(" a:b, c.d:e ,,a:b") == ("a:b", "c.d:e")
    assert RunConfig(tools=["a:b"]).episode.tools == ("a:b",)
    assert RunConfig.model_validate({"episode": {"tools": "x:y,z:w"}}).episode.multi_turn
    with pytest.raises(ValueError, match=r"'x\.y': expected 'module:function'"):
        RunConfig(tools="x.y")
    with pytest.raises(ValueError, match="with env='calculator': expected one of them"):
        RunConfig(tools="a:b", env="calculator")


def test_the_checks_before_start_import_every_tool_and_want_chat_prompts():
    from grpo_flyte.errors import ConfigError
    from grpo_flyte.launch.preflight import check_inputs

    with pytest.raises(ToolSpecError, match=r"'tests\.support\.tool_fns:missing': module 'tests\.support\.tool_fns' has no attribute"):
        check_inputs(RunConfig(tools=f"{FNS}:add,{FNS}:missing", dataset="calculator_tools", eval_size=4), local=True)
    with pytest.raises(ConfigError, match="'plain' with --tools") as raised:
        check_inputs(RunConfig(tools=f"{FNS}:add", prompt_format="plain", eval_size=4), local=True)
    assert raised.value.field == "prompt_format"
    check_inputs(RunConfig(tools=f"{FNS}:add", dataset="calculator_tools", prompt_format="plain", eval_size=4), local=True)  # chat rows
