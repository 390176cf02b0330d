"""tests/support/warm_python.py: a command run by the warm python ends as the same command in a fresh
interpreter does (the drills and benchmark runs of the tests rely on it), command by command."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support import warm_python

PROBE = """\
import json, os, sys, threading, time
mode = sys.argv[1]
if mode == "cli":  # what grpo_flyte's CLI does first, then the libraries' settings read at their import
    from grpo_flyte.launch.cli import quiet_libraries
    quiet_libraries()
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging
    print(json.dumps([are_progress_bars_disabled(), logging.get_verbosity()]))
    sys.exit(0)
if mode == "offline":
    from huggingface_hub import constants
    print(constants.HF_HUB_OFFLINE)
    sys.exit(0)
import beside_probe
print(json.dumps({"argv": sys.argv, "name": __name__, "cwd": os.getcwd(), "path0": sys.path[0], "setting": os.environ.get("PROBE_SETTING"),
                  "beside": beside_probe.WHERE, "stdin": sys.stdin.read()}))
print("to stderr", file=sys.stderr)
if mode == "exit":
    sys.exit(3)
if mode == "message":
    sys.exit("a message for stderr")
if mode == "raise":
    def inner():
        raise ValueError("a bug")
    inner()
if mode == "kill":
    os.kill(os.getpid(), 9)
if mode == "thread":  # the interpreter waits for a non-daemon thread before it ends
    threading.Thread(target=lambda: (time.sleep(0.5), print("the thread's line", flush=True))).start()
if mode == "sleep":
    time.sleep(60)
"""


@pytest.fixture
def probe(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "probe.py").write_text(PROBE)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "beside_probe.py").write_text("WHERE = 'lib'\n")
    return tmp_path


def _env(probe, **more: str) -> dict[str, str]:
    pythonpath = os.pathsep.join([str(probe / "lib"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PROBE_SETTING": "x", "PYTHONPATH": pythonpath, **more}


def _both(probe, mode: str, env: dict | None = None, **kwargs):
    """(fresh, warm): the probe as a plain subprocess, then by the warm python."""
    env = _env(probe, **(env or {}))
    argv = [str(probe / "scripts" / "probe.py"), mode]
    fresh = subprocess.run(
        [sys.executable, *argv], cwd=probe, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, check=False
    )
    return fresh, warm_python.run(argv, cwd=probe, env=env, timeout=120, **kwargs)


@pytest.mark.parametrize("mode", ["exit", "message", "raise", "kill", "thread"])
def test_a_command_ends_with_the_status_and_output_of_a_fresh_interpreter(probe, mode):
    fresh, warm = _both(probe, mode)
    assert fresh.returncode == {"exit": 3, "message": 1, "raise": 1, "kill": -9, "thread": 0}[mode], fresh.stderr
    assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    if mode == "raise":  # the traceback starts at the script, as the interpreter prints it
        assert fresh.stderr.count('File "') == 2 and "ValueError: a bug" in fresh.stderr


def test_the_settings_the_cli_gives_the_libraries_before_importing_them_hold(probe):
    fresh, warm = _both(probe, "cli", cli=True)
    assert fresh.stdout == "[true, 40]\n", fresh.stderr  # no progress bars, transformers' errors only
    assert (warm.returncode, warm.stdout) == (0, fresh.stdout)


def test_a_command_that_changes_an_import_time_setting_sees_its_own(probe):
    fresh, warm = _both(probe, "offline", env={"HF_HUB_OFFLINE": "0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1"})
    assert (warm.returncode, warm.stdout) == (0, fresh.stdout) and fresh.stdout.strip() in ("True", "False")


def test_a_command_past_its_timeout_is_killed(probe):
    with pytest.raises(subprocess.TimeoutExpired):
        warm_python.run([probe / "scripts" / "probe.py", "sleep"], cwd=probe, env=_env(probe), timeout=3)
    # the server ran the next command: it had killed the sleeping one (it runs one at a time)
    assert warm_python.run([probe / "scripts" / "probe.py", "exit"], cwd=probe, env=_env(probe)).returncode == 3


def test_commands_run_in_a_child_of_the_warm_server_even_where_numpy_started_threads():
    """The point of it: a command forked from the server, not a fresh interpreter that imports everything again.
    Also without OMP_NUM_THREADS on a machine of 2 cores or more (CI), where numpy's OpenBLAS starts its pool of
    threads at import: the pool ends at a fork, so the server may fork."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    done = warm_python.run(["-c", "import os; print(os.getppid())"], env=env)
    assert done.returncode == 0 and int(done.stdout) != os.getpid(), done.stderr


def test_each_command_makes_its_temporary_files_where_its_own_tmpdir_says(tmp_path):
    """tempfile reads TMPDIR once, and the server's imports (torch's) read it: each command after the first
    made its folders where the first one's TMPDIR said (the benchmarks' runs in tests/repo/test_benchmarks.py)."""
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        env = {**os.environ, "TMPDIR": str(tmp_path / name)}
        done = warm_python.run(["-c", "import tempfile; print(tempfile.mkdtemp())"], env=env)
        assert done.returncode == 0 and done.stdout.strip().startswith(f"{tmp_path / name}/"), done.stdout + done.stderr
