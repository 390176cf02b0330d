"""A local run's progress bars: what they show, what feeds them, and that a pipe gets none."""

from __future__ import annotations

import io
import logging
import os
import pty
import re
import select
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

from grpo_flyte.config.run import RunConfig, eval_due
from grpo_flyte.launch.cli import main as cli_main
from grpo_flyte.records import EvalMetrics
from grpo_flyte.reporting import progress
from grpo_flyte.reporting.progress import RunProgress
from grpo_flyte.types import MetricsRow

TINY = ["--max-new-tokens", "8", "--prompts-per-iter", "2", "--group-size", "3", "--eval-size", "2", "--min-informative-groups", "0"]


def _held_out(seconds: float) -> EvalMetrics:
    return EvalMetrics(eval_reward=0.2, eval_reward_ci95=0.1, eval_accuracy=0.2, eval_accuracy_ci95=0.1, eval_format_rate=0.5,
                       eval_reward_means={}, eval_reward_errors=0, eval_size=100, eval_s=seconds)  # fmt: skip


def _screen(bars: RunProgress) -> str:
    """The bars as a terminal shows them now."""
    console = Console(file=io.StringIO(), record=True, force_terminal=True, width=120)
    console.print(bars.bars.get_renderable())
    return console.export_text()


def test_the_bars_show_iterations_and_each_evaluation_with_an_eta():
    now = [1000.0]
    etas = []

    def eta(history, done):
        etas.append((len(history), done))
        return 64.0

    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    bars = RunProgress(3, 0, eta=eta, console=console, now=lambda: now[0])
    assert not bars.bars.disable  # a terminal draws them
    assert re.search(r"iterations .* 0/3 .* ETA --", _screen(bars))  # nothing timed yet

    bars.evaluating(0, 0, 100)  # before training: no earlier evaluation to time it by
    assert re.search(r"held-out eval before training .* 0/100 .* ETA --", _screen(bars))
    bars.evaluating(0, 64, 100)
    assert "64/100" in _screen(bars)
    bars.evaluating(0, 100, 100)
    assert "held-out eval" not in _screen(bars)  # gone: its log line says how it went

    history = [
        MetricsRow(iteration=0, adapter_version=0, eval=_held_out(12.0)),
        MetricsRow(iteration=2, adapter_version=2, eval=_held_out(10.0)),
    ]
    bars.recorded(SimpleNamespace(iterations_done=2, history=history), history[-1], None)
    assert etas == [(2, 2)]
    now[0] += 4  # the ETA counts down between iterations
    shown = _screen(bars)
    assert re.search(r"iterations .* 2/3 .* ETA 1m00s", shown), shown

    bars.evaluating(2, 0, 100)  # timed by the latest evaluation (10 s), not the first (it loaded the model)
    now[0] += 3
    shown = _screen(bars)
    assert re.search(r"held-out eval after iteration 2 .* 0/100 .* ETA 0m07s", shown), shown
    assert re.search(r"iterations .* 2/3 .* ETA 0m57s", shown), shown


def test_without_a_terminal_nothing_is_drawn_and_logs_go_where_they_went():
    out = io.StringIO()
    bars = RunProgress(3, 1, eta=lambda history, done: 10.0, console=Console(file=out, width=120))
    assert bars.bars.disable
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger("grpo_flyte.test_progress").addHandler(handler)
    try:
        with bars.shown():
            bars.evaluating(1, 0, 4)
            bars.evaluating(1, 4, 4)
            logging.getLogger("grpo_flyte.test_progress").warning("a line")
            assert handler.stream is stream
    finally:
        logging.getLogger("grpo_flyte.test_progress").removeHandler(handler)
    assert out.getvalue() == "" and stream.getvalue() == "a line\n"


def test_on_a_terminal_log_lines_print_whole_above_the_bars():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=40)
    bars = RunProgress(3, 0, eta=lambda history, done: None, console=console)
    handler = logging.StreamHandler(sys.__stderr__)
    log = logging.getLogger("grpo_flyte.test_progress")
    log.addHandler(handler)
    try:
        with bars.shown():
            assert handler.stream is not sys.__stderr__  # moved above the bars
            log.warning("iter 1/3  " + "x" * 60)  # longer than the terminal: the terminal wraps it, not rich
    finally:
        log.removeHandler(handler)
    assert handler.stream is sys.__stderr__
    assert "iter 1/3  " + "x" * 60 + "\n" in out.getvalue()


def test_a_local_run_feeds_the_bars_every_iteration_and_evaluation(tmp_path, tiny_model_dir, monkeypatch, capsys):
    seen = {}

    class Spy(RunProgress):
        def __init__(self, iterations, done, **kwargs):
            super().__init__(iterations, done, **kwargs)
            seen.update(start=(iterations, done), recorded=[], evaluating=[], etas=[])
            seen["bars"] = self

        def recorded(self, state, row, answers):
            super().recorded(state, row, answers)
            seen["recorded"].append(state.iterations_done)
            seen["etas"].append(self.bars.tasks[0].fields["eta_s"])

        def evaluating(self, iteration, answered, total):
            seen["evaluating"].append((iteration, answered, total))
            super().evaluating(iteration, answered, total)

    monkeypatch.setattr(progress, "RunProgress", Spy)
    run_dir = tmp_path / "run"
    assert (
        cli_main(["--local", "--model", str(tiny_model_dir), *TINY, "--eval-every", "2", "--iterations", "3", "--run-dir", str(run_dir)])
        == 0
    )
    assert seen["start"] == (3, 0)
    assert seen["recorded"] == [0, 1, 2, 3]  # iteration 0: the evaluation before training
    assert seen["etas"][0] is None and all(eta is not None and eta >= 0 for eta in seen["etas"][1:])
    config = RunConfig(iterations=3, eval_every=2, eval_size=2)
    due = [i for i in range(4) if eval_due(config, i)]
    assert due == [0, 2, 3]
    # each evaluation: 0 of 2 answered as it starts, then 2 of 2 (one chunk)
    assert seen["evaluating"] == [(i, n, 2) for i in due for n in (0, 2)]
    run_bar = seen["bars"].bars.tasks[0]
    assert (run_bar.completed, run_bar.total, len(seen["bars"].bars.tasks)) == (3, 3, 1)
    err = capsys.readouterr().err
    assert "━" not in err  # not a terminal: no bar drawn


def _read_until(fd: int, out: bytearray, done, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not done(out):
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                return
            if not chunk:
                return
            out += chunk


def test_a_terminal_run_shows_the_bars_under_whole_log_lines_and_sigterm_still_prints_the_resume_command(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "grpo_flyte.driver", "--local", "--model", str(tiny_model_dir), *TINY, "--iterations", "30",
            "--run-dir", str(run_dir)]  # fmt: skip
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "100"}
    pid, fd = pty.fork()
    if pid == 0:  # the child: its stdout and stderr are the terminal
        os.execve(sys.executable, argv, env)
    out = bytearray()
    try:
        _read_until(fd, out, lambda o: b"iter 2/30" in o, 240)
        assert b"iter 2/30" in out, out.decode(errors="replace")[-2000:]
        os.kill(pid, signal.SIGTERM)
        _read_until(fd, out, lambda o: False, 120)
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode(errors="replace"))  # colours and cursor moves
    lines = [part.split("\r")[-1] for part in text.split("\r\n")]  # what each printed line ends as
    assert os.waitstatus_to_exitcode(status) == 143, text[-2000:]
    assert re.search(r"iterations +━.* \d+/30 .*ETA \d+m\d\ds", text), text[-2000:]
    assert any(re.fullmatch(r"\d\d:\d\d:\d\d iter 1/30  reward .* \| ETA \d+m\d\ds", line) for line in lines), lines
    hint = [line for line in lines if "stopped by SIGTERM" in line]
    assert len(hint) == 1 and hint[0].endswith(f"--local --resume --run-dir {run_dir}")
    # the bars are gone before it (flyte may still log the cancelled tasks after it)
    assert max(i for i, line in enumerate(lines) if "━" in line) < lines.index(hint[0])
    assert Path(run_dir / "metrics.jsonl").is_file()


def test_the_progress_line_says_what_the_guard_did():
    from grpo_flyte.records import GuardRecord

    metrics = EvalMetrics(
        eval_reward=0.07, eval_reward_ci95=0.035, eval_accuracy=0.07, eval_accuracy_ci95=0.035, eval_format_rate=0.1,
        eval_reward_means={}, eval_reward_errors=0, eval_size=200, eval_s=40.0,
    )  # fmt: skip
    record = GuardRecord(
        select_by="eval_accuracy", best_iteration=5, vs_best=-0.285, vs_best_ci99=0.086, guard_event="rollback",
        guard_signal="held_out", guard_reason="held-out accuracy 7.0% is 28.5 pp +- 8.6 pp below the best; rolled back",
    )  # fmt: skip
    line = progress.progress_line(MetricsRow(iteration=0, adapter_version=0, eval=metrics, guard=record), 20)
    first, event = line.splitlines()
    assert first.endswith("(n=200, 40.0s)  | best: iteration 5, this vs the best before: -28.5 pp +- 8.6 pp (99%)")
    assert event == "  ROLLBACK (held_out): held-out accuracy 7.0% is 28.5 pp +- 8.6 pp below the best; rolled back"
    new_best = record.model_copy(update={"guard_event": "new_best", "vs_best": 0.1, "guard_signal": None, "guard_reason": None})
    assert "| new best: iteration 5, this vs the best before: +10.0 pp" in progress.progress_line(
        MetricsRow(iteration=0, adapter_version=0, eval=metrics, guard=new_best), 20
    )


def test_the_held_out_line_gives_the_accuracy_interval_inside_0_to_1():
    # 1 of 4 correct: a normal interval would say 25.0% +- 42.4%; the line shows Wilson's bounds
    held_out = _held_out(1.0).model_copy(
        update={"eval_accuracy": 0.25, "eval_accuracy_lo": 0.0456, "eval_accuracy_hi": 0.6994, "eval_size": 4}
    )
    line = progress.progress_line(MetricsRow(iteration=0, adapter_version=0, eval=held_out), total=3)
    assert "acc 25.0% [4.6%, 69.9%]  format 50.0%" in line
    # a row from before the bounds existed (an old run folder's metrics.jsonl) reads as before
    assert "acc 20.0%  format 50.0%" in progress.progress_line(MetricsRow(iteration=0, adapter_version=0, eval=_held_out(1.0)), total=3)
