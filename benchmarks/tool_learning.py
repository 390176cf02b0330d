"""Does GRPO teach the embedded model to use a tool? The calculator environment, before and after.

Runs the real loop (`python -m grpo_flyte.driver --local --env calculator`) on the embedded
SmolLM2-135M-Instruct and the calculator's 3-digit products, evaluating greedily on held-out
products before training, every --eval-every iterations and at the end. Prints, with 95% intervals,
the share of held-out episodes that call the calculator and the held-out accuracy, their paired
gains (the same questions before and after), the same share over the training episodes of each
iteration, and the seconds per iteration; writes them to benchmarks/tool_learning.json.

    python benchmarks/tool_learning.py                  # the figures in docs/measurements.md
    python benchmarks/tool_learning.py --iterations 3   # a quicker look
    python benchmarks/tool_learning.py --quick          # seconds: the plumbing only, on the tests' tiny model (CI)
    python benchmarks/tool_learning.py --function-tools # the calculator as a Python function (--tools)
    python benchmarks/tool_learning.py --agent          # examples/agent_openai.py's agent loop (--agent)

`--function-tools` runs the same questions and held-out split with the calculator of
examples/tools_calculator.py as a `--tools` function (the embedded model's template has no tools:
the fallback `<tool_call>` format) instead of the `<calc>` environment; it writes
benchmarks/tool_learning_functions.json. `--agent` trains examples/agent_openai.py's own agent loop
(an `openai` client, a `calculate` tool through the chat template's `tools=`) on the same questions,
with the same turn budget and 384 tokens an episode (its tool schema and worked example are longer
than the fallback's); it writes benchmarks/tool_learning_agent.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from learning_curve import model_flags, read_jsonl, summarize, timing_line

from grpo_flyte.launch.cli import main as cli_main
from grpo_flyte.launch.run_folder import EVAL_DIR, METRICS_FILE
from grpo_flyte.loop.metrics import mean_ci95

ROOT = Path(__file__).resolve().parents[1]
# The budget: fits the 30 minutes on this 2-core CPU with room to spare (see the JSON).
ITERATIONS = 6
EVAL_EVERY = 2
EVAL_SIZE = 100
SETTINGS = ["--env", "calculator", "--max-new-tokens", "48", "--max-turns", "3", "--max-episode-tokens", "160",
            "--prompts-per-iter", "8", "--group-size", "6", "--min-informative-groups", "0"]  # fmt: skip
# The same budgets with the calculator as a Python function (a call is ~33 tokens in the fallback format).
FUNCTION_TOOLS = ["--tools", "examples.tools_calculator:calculator", "--dataset", "calculator_tools", "--rewards", "correct=1.0,format=0.2",
                  "--max-new-tokens", "48", "--max-turns", "3", "--max-episode-tokens", "160",
                  "--prompts-per-iter", "8", "--group-size", "6", "--min-informative-groups", "0"]  # fmt: skip
# examples/agent_openai.py as its docstring runs it, at this benchmark's batch and turn budgets.
AGENT = ["--agent", "examples.agent_openai:rollout", "--dataset", "calculator", "--rewards", "correct=1.0,format=0.2",
         "--max-new-tokens", "48", "--max-turns", "3", "--max-episode-tokens", "384",
         "--prompts-per-iter", "8", "--group-size", "6", "--min-informative-groups", "0"]  # fmt: skip
QUICK = ["--max-new-tokens", "6", "--prompts-per-iter", "2", "--group-size", "2"]
QUICK_FUNCTION_TOOLS = [
    "--max-new-tokens",
    "40",
    "--max-turns",
    "2",
    "--max-episode-tokens",
    "96",
    "--prompts-per-iter",
    "2",
    "--group-size",
    "2",
]


def tool_summary(run_dir: Path) -> dict:
    """Held-out tool use before and after (paired on the same questions) and per training iteration."""
    rows = read_jsonl(run_dir / METRICS_FILE)
    evals = [r for r in rows if "eval_reward" in r]
    first, last = evals[0]["iteration"], evals[-1]["iteration"]
    before = read_jsonl(run_dir / EVAL_DIR / f"iter-{first:04d}.jsonl")
    after = read_jsonl(run_dir / EVAL_DIR / f"iter-{last:04d}.jsonl")
    gain, gain_ci = mean_ci95([float(a["tool_calls"] > 0) - float(b["tool_calls"] > 0) for a, b in zip(after, before, strict=True)])
    return {
        "eval_tool_curve": [
            {
                "iteration": r["iteration"],
                "eval_tool_call_rate": r["eval_tool_call_rate"],
                "eval_tool_call_rate_ci95": r["eval_tool_call_rate_ci95"],
            }
            for r in evals
        ],
        "tool_use_gain": gain,
        "tool_use_gain_ci95": gain_ci,
        "train_tool_call_rate": [r["tool_call_rate"] for r in rows if "tool_call_rate" in r],
        "train_accuracy": [r["accuracy"] for r in rows if "accuracy" in r],
    }


def report(result: dict) -> str:
    n = result["eval_questions"]
    lines = [f"held-out: {n} 3-digit products, greedy episodes; +- is a 95% interval (1.96 standard errors)", ""]
    lines.append("iteration  calls the calculator   accuracy")
    for acc, tool in zip(result["curve"], result["eval_tool_curve"], strict=True):
        lines.append(
            f"{acc['iteration']:>9}  {tool['eval_tool_call_rate']:6.1%} +- {tool['eval_tool_call_rate_ci95']:5.1%}     "
            f"{acc['eval_accuracy']:6.1%} +- {acc['eval_accuracy_ci95']:5.1%}"
        )
    lines += [
        "",
        f"paired gains on the same {n} questions: calls the calculator {result['tool_use_gain']:+.1%} +- "
        f"{result['tool_use_gain_ci95']:.1%}, accuracy {result['accuracy_gain']:+.1%} +- {result['accuracy_gain_ci95']:.1%}",
        "training episodes that call the calculator, per iteration: " + " ".join(f"{x:.0%}" for x in result["train_tool_call_rate"]),
        timing_line(result),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # the rest goes to the driver whole
    parser.add_argument("--iterations", type=int, default=ITERATIONS)
    parser.add_argument("--eval-every", type=int, default=EVAL_EVERY)
    parser.add_argument("--eval-size", type=int, default=EVAL_SIZE)
    parser.add_argument("--quick", action="store_true", help="2 iterations of tiny batches: the plumbing, not the learning")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--function-tools", action="store_true", help="the calculator as a --tools Python function, not --env calculator")
    mode.add_argument("--agent", action="store_true", help="examples/agent_openai.py's agent loop (--agent), not --env calculator")
    parser.add_argument("--run-dir", type=Path, default=None, help="default: a new temporary folder")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/tool_learning.json (--quick: only with --out)")
    args, driver_flags = parser.parse_known_args(argv)
    if args.quick:
        args.iterations, args.eval_every, args.eval_size = 2, 1, 4
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="grpo_flyte-tools-"))
    settings = FUNCTION_TOOLS if args.function_tools else AGENT if args.agent else SETTINGS
    if (args.function_tools or args.agent) and str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # examples.* (the run's processes inherit the path)
    quick = [*(QUICK_FUNCTION_TOOLS if args.function_tools or args.agent else QUICK), *model_flags(driver_flags)] if args.quick else []
    started = time.perf_counter()
    code = cli_main([
        "--local", "--run-dir", str(run_dir), "--iterations", str(args.iterations), "--eval-every", str(args.eval_every),
        "--eval-size", str(args.eval_size), *settings, *quick, *driver_flags,
    ])  # fmt: skip
    if code != 0:
        return code
    result = {**summarize(run_dir, time.perf_counter() - started), **tool_summary(run_dir)}
    name = "tool_learning_functions.json" if args.function_tools else "tool_learning_agent.json" if args.agent else "tool_learning.json"
    out = args.out or (None if args.quick else Path(__file__).with_name(name))
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")
    print(report(result))
    print(f"\nrun files: {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
