"""--sweep-prune through the command line: a config whose learning rate is absurdly high stops at the
first evaluation after training, the other finishes, the report shows both, and a SIGKILL after the
decision with --resume keeps it (the stopped config is not run again)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from grpo_flyte.launch.cli import main as cli_main
from tests.support import warm_python
from tests.unit.launch.test_run_folder import DRILL

# The base model answers 'What is 90 + 11?' with '90 + 11 = 101': about half its characters digits.
# One AdamW step at learning rate 1.0 wrecks it (' back back back ...': none). A continuous reward, so
# that groups differ and the step happens.
DIGITS_REWARD = "def digits(completions, **kwargs):\n    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]\n"
SETTINGS = ["--iterations", "2", "--eval-every", "1", "--eval-size", "6", "--prompts-per-iter", "2", "--group-size", "3",
            "--max-new-tokens", "12", "--min-informative-groups", "0", "--rewards", "prune_digits:digits=1.0",
            "--select-by", "eval_reward", "--sweep-prune", "--sweep", "learning_rate=2e-4,1.0"]  # fmt: skip
KEPT, STOPPED = "learning_rate=2e-4", "learning_rate=1.0"


@pytest.mark.slow
def test_a_pruned_sweep_stops_the_absurd_learning_rate_and_a_kill_and_resume_keep_the_decision(tmp_path, embedded_dir, monkeypatch):
    (tmp_path / "prune_digits.py").write_text(DIGITS_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    sweep_dir = tmp_path / "sweep"
    args = ["--local", "--model", str(embedded_dir), *SETTINGS, "--run-dir", str(sweep_dir)]
    # metrics.jsonl is written per recorded row: each config's rows 0 and 1 (the decision comes
    # before row 1 is recorded), then the kept config's row 2, the 5th: killed before it is in place
    env = {"PYTHONPATH": f"{tmp_path}:{Path(__file__).resolve().parents[3] / 'src'}"}
    killed = warm_python.run([DRILL, "metrics.jsonl", "5", *args], env={**__import__("os").environ, **env}, timeout=900, cli=True)
    assert killed.returncode == -signal.SIGKILL, (killed.stdout + killed.stderr)[-3000:]
    decisions = json.loads((sweep_dir / "pruned.json").read_text())
    assert list(decisions) == [STOPPED] and decisions[STOPPED]["iteration"] == 1
    assert "below the leader learning_rate=2e-4's" in decisions[STOPPED]["reason"]

    assert cli_main(["--local", "--resume", "--run-dir", str(sweep_dir)]) == 0
    assert json.loads((sweep_dir / "pruned.json").read_text()) == decisions  # kept, not decided again
    outcomes = {line["name"]: line for line in map(json.loads, (sweep_dir / "sweep.jsonl").read_text().splitlines())}
    assert (outcomes[STOPPED]["status"], outcomes[STOPPED]["iterations_done"]) == ("pruned", 1)
    assert outcomes[STOPPED]["stopped"].startswith("iteration 1: ")
    assert (outcomes[KEPT]["status"], outcomes[KEPT]["iterations_done"]) == ("complete", 2)
    # the stopped config kept its folder and best adapter; its checkpoint says why it stopped
    assert (sweep_dir / STOPPED / "best" / "adapter_model.safetensors").is_file()
    rows = [json.loads(line) for line in (sweep_dir / STOPPED / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1] and rows[-1]["guard_signal"] == "sweep_prune"
    report = (sweep_dir / "report.html").read_text()
    assert "stopped by --sweep-prune: learning_rate=1.0" in report and "iteration 1: held-out reward" in report


def test_pruning_configs_that_answer_other_questions_is_refused_in_one_line():
    from grpo_flyte.config.grid import expand_sweep
    from grpo_flyte.errors import UserError
    from grpo_flyte.launch.sweep_folder import check_prunable

    check_prunable(expand_sweep({"sweep_prune": True}, {"learning_rate": [1e-4, 2e-4]}))  # the same questions: fine
    check_prunable(expand_sweep({}, {"eval_size": [10, 20]}))  # no pruning: anything goes
    with pytest.raises(UserError, match=r"^--sweep-prune compares .* the sweep changes eval_size; expected") as refused:
        check_prunable(expand_sweep({"sweep_prune": True}, {"eval_size": [10, 20]}))
    assert "\n" not in str(refused.value)
