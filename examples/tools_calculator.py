"""The calculator as a plain Python function that the model calls through its chat template (--tools).

    python examples/tools_calculator.py                    # a short local run on the embedded model
    python examples/tools_calculator.py --iterations 6     # more (any flag of python -m grpo_flyte)

or, from the repository's root, the same run as a command:

    python -m grpo_flyte --local --tools examples.tools_calculator:calculator --dataset calculator_tools \\
        --rewards correct=1.0,format=0.2 --max-new-tokens 48 --max-turns 3 --max-episode-tokens 192

A tool is a function with type hints and a docstring whose `Args:` section describes each
argument: transformers turns them into the JSON schema the chat template shows the model. The
model's calls are read in its template's format (the embedded SmolLM2's template has no tools, so
the fallback: the schemas in the system message and `<tool_call>{"name": ..., "arguments": ...}
</tool_call>`), each call runs in a sandbox process within --tool-timeout-s, and its return value
comes back as a `tool` message. A raised exception is the model's error message ('error:
ValueError: ...'), counted in tool_errors. The dataset 'calculator_tools' holds the `--env
calculator` questions (3-digit products) with one worked exchange in that format, each asked in one
of four phrasings in turn ('What is a * b?', 'Multiply a by b.', ...); the rewards read the final
'#### <integer>' line. docs/rewards-and-environments.md#tools-python-functions has the rest.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpo_flyte.multiturn import evaluate, shown_number


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression: numbers, + - * / // % ** and parentheses, for example "374*829".
    """
    return shown_number(evaluate(expression))


SETTINGS = [
    "--tools", "examples.tools_calculator:calculator", "--dataset", "calculator_tools", "--rewards", "correct=1.0,format=0.2",
    "--max-new-tokens", "48", "--max-turns", "3", "--max-episode-tokens", "192", "--min-informative-groups", "0",
]  # fmt: skip

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples.tools_calculator` imports from the root
    from grpo_flyte.__main__ import main

    sys.exit(
        main(
            ["--local", "--iterations", "2", "--prompts-per-iter", "4", "--group-size", "4", "--eval-size", "20", *SETTINGS, *sys.argv[1:]]
        )
    )
