"""When the CLI takes SIGINT back after starting with it ignored (grpo_flyte.launch.stopping)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from grpo_flyte.launch.stopping import ctrl_c_wanted


@pytest.mark.parametrize(
    ("stdin_is_terminal", "has_terminal", "wanted"),
    [
        (True, True, True),  # typed at a terminal: the user's Ctrl-C is for it
        (False, False, True),  # no terminal (a tool's `cmd &`): only a deliberate kill -INT reaches it
        (False, True, False),  # a script's background job at a terminal: the Ctrl-C is the script's
    ],
)
def test_ctrl_c_wanted(stdin_is_terminal, has_terminal, wanted):
    assert ctrl_c_wanted(stdin_is_terminal, has_terminal) is wanted


def test_a_process_started_with_sigint_ignored_and_no_terminal_handles_it_again():
    """In a fresh session (no controlling terminal), SIGINT ignored as `cmd &` leaves it:
    `ctrl_c_stops` installs Python's KeyboardInterrupt handler."""
    code = (
        "import signal; from grpo_flyte.launch.stopping import ctrl_c_stops; "
        "assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN; ctrl_c_stops(); "
        "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        start_new_session=True,
        check=False,
    )
    assert done.stdout.strip() == "True", done.stderr
