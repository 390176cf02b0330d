"""A --tools run through the CLI on the embedded SmolLM2 (its template has no tools: the fallback
format), the calculator of examples/tools_calculator.py as the tool: to the end, with the tool
metrics in metrics.jsonl, after a SIGKILL in its generation and a --resume."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from grpo_flyte.launch.cli import main as cli_main
from tests.support import SUPPORT, warm_python

ROOT = Path(__file__).resolve().parents[2]
DRILL = SUPPORT / "kill_drill.py"


def test_a_tools_run_goes_to_the_end_after_a_kill_and_a_resume(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # examples.tools_calculator, as from the checkout's root
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run_dir = tmp_path / "run"
    args = ["--local", "--tools", "examples.tools_calculator:calculator", "--dataset", "calculator_tools",
            "--rewards", "correct=1.0,format=0.2", "--max-new-tokens", "40", "--max-turns", "2", "--max-episode-tokens", "96",
            "--prompts-per-iter", "2", "--group-size", "2", "--eval-size", "2", "--min-informative-groups", "0",
            "--iterations", "1", "--run-dir", str(run_dir)]  # fmt: skip
    # engine batches: the held-out episodes' turns first, then iteration 1's: the kill lands past the first evaluation,
    # in the run's only iteration, which the resume redoes before the final evaluation (a second iteration cost ~30 CPU s)
    killed = warm_python.run([DRILL, "generate", "5", *args], timeout=900, cli=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert cli_main([*args, "--resume"]) == 0

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    for row in rows[1:]:
        assert row["num_rollouts"] == 4 and row["tool_malformed"] >= 0 and row["tool_errors"] >= 0
        assert row["tool_calls"] == round(row["tool_calls_mean"] * 4)
    assert sum(r["tool_calls"] for r in rows[1:]) > 0  # the worked exchange in the prompt: the model calls the calculator
    assert rows[0]["eval_tool_call_rate"] > 0
    [answer, *_] = [json.loads(line) for line in (run_dir / "eval" / "iter-0001.jsonl").read_text().splitlines()]
    assert answer["turns"][0]["text"].startswith("<tool_call>") and answer["turns"][1]["role"] == "tool"
    assert json.loads((run_dir / "config.json").read_text())["episode"]["tools"] == ["examples.tools_calculator:calculator"]
