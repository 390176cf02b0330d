"""The reward sandbox's worker: its replies travel on a channel of their own, so nothing user code
writes (a print, a subprocess's output, a C library's printf on fd 1) can corrupt them, and a worker
that dies or desynchronizes is one reward error, never a hang."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpo_flyte.errors import RewardError, RewardTimeout
from grpo_flyte.runtime import child_processes
from grpo_flyte.runtime.sandbox import Worker, WorkerPool, WorkerRaised

NOISY = """
import os, subprocess, sys

def subprocess_echo(x):
    subprocess.run(["echo", "hello from a subprocess"], check=True)
    return x + 1

def fd_write(x):
    os.write(1, b"\\x07\\x00written straight to fd 1 " * 100)  # what a C library's printf does
    return x + 2

def megabytes(x):
    print("y" * (3 << 20))
    sys.stdout.flush()
    return x + 3

def reads_stdin(x):
    # a subprocess that reads its standard input must not eat the requests
    out = subprocess.run(["cat"], capture_output=True, check=True).stdout
    return len(out) + x

def forges_a_reply(x):
    os.write(int(sys.argv[2]), b"not a frame at all, 8 bytes of length would be huge")
    return x

def open_descriptors():
    code = "import os; print(sorted(int(f) for f in os.listdir('/proc/self/fd')))"
    return eval(subprocess.check_output([sys.executable, "-c", code], close_fds=False))

def dies(x):
    os._exit(3)

class Unshowable(Exception):
    def __str__(self):
        raise RuntimeError("no")

def raises_unshowable(x):
    raise Unshowable()
"""


@pytest.fixture
def noisy(tmp_path, monkeypatch):
    (tmp_path / "noisy_rewards.py").write_text(textwrap.dedent(NOISY))
    monkeypatch.syspath_prepend(str(tmp_path))
    worker = Worker()
    yield worker
    worker.stop()


def test_output_on_fd_1_from_subprocesses_and_c_code_goes_to_stderr_not_into_replies(noisy, capfd):
    assert noisy.call("noisy_rewards:subprocess_echo", (1,), 30, "reward 'echo'") == 2
    assert noisy.call("noisy_rewards:fd_write", (1,), 30, "reward 'fd'") == 3
    assert noisy.call("noisy_rewards:megabytes", (1,), 30, "reward 'big'") == 4
    assert noisy.call("noisy_rewards:reads_stdin", (1,), 30, "reward 'stdin'") == 1  # cat read nothing
    out, err = capfd.readouterr()
    # the user's output is on the parent's stderr (the console, or the task's log on a cluster)
    assert "hello from a subprocess" in err and "written straight to fd 1" in err and "y" * 1000 in err
    assert "hello from a subprocess" not in out


def test_a_desynchronized_reply_is_one_error_and_the_worker_is_replaced(noisy):
    with pytest.raises(RewardError, match=r"^reward 'forger' broke its worker's replies \(the reply did not start with the frame marker"):
        noisy.call("noisy_rewards:forges_a_reply", (1,), 30, "reward 'forger'")
    assert noisy.call("noisy_rewards:subprocess_echo", (5,), 30, "reward 'echo'") == 6


def test_a_worker_that_dies_is_one_error_naming_the_reward_and_its_exit_code(noisy):
    with pytest.raises(RewardError, match=r"^reward 'dying' ended its worker process \(exit code 3\)$"):
        noisy.call("noisy_rewards:dies", (1,), 30, "reward 'dying'")
    assert noisy.call("noisy_rewards:fd_write", (1,), 30, "reward 'fd'") == 3


def test_an_exception_whose_message_cannot_be_shown_is_still_reported(noisy):
    with pytest.raises(WorkerRaised, match="its message could not be shown: RuntimeError") as info:
        noisy.call("noisy_rewards:raises_unshowable", (1,), 30, "reward 'x'")
    assert info.value.kind == "Unshowable"


def test_a_call_past_its_limit_is_stopped_and_the_next_call_starts_a_new_worker(tmp_path, monkeypatch):
    (tmp_path / "slow_reward.py").write_text("import time\n\ndef slow(x):\n    time.sleep(x)\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    worker = Worker()
    try:
        with pytest.raises(RewardTimeout, match=r"^reward 'slow' took longer than 0.5 s"):
            worker.call("slow_reward:slow", (60,), 0.5, "reward 'slow'")
        assert worker.proc is None
        assert worker.call("slow_reward:slow", (0,), 30, "reward 'slow'") == 0
    finally:
        worker.stop()


def test_the_worker_holds_no_pipe_a_subprocess_could_inherit(noisy):
    # a subprocess of user code that keeps every inheritable descriptor (os.system, fork) still
    # sees only stdin (empty), stdout (our stderr) and stderr
    assert noisy.call("noisy_rewards:open_descriptors", (), 30, "a subprocess") == [0, 1, 2, 3]  # 3: the listing's own


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_worker_has_a_session_of_its_own_and_a_stopped_one_ends_what_its_reward_started(tmp_path, monkeypatch):
    """A terminal's Ctrl-C (sent to the run's process group) never reaches a worker, which would
    print its traceback: the run ends it. A reward past its limit leaves none of its processes."""
    (tmp_path / "spawner.py").write_text(
        "import os, pathlib, subprocess, time\n\n"
        "def session():\n    return os.getpid(), os.getsid(0)\n\n"
        "def spawn(path):\n    pathlib.Path(path).write_text(str(subprocess.Popen(['sleep', '300']).pid))\n    time.sleep(300)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    worker = Worker()
    try:
        pid, session = worker.call("spawner:session", (), 30, "reward 'session'")
        assert session == pid != os.getsid(0)
        with pytest.raises(RewardTimeout):
            worker.call("spawner:spawn", (str(tmp_path / "pid"),), 5, "reward 'spawner'")
        grandchild = int((tmp_path / "pid").read_text())
        for _ in range(100):  # the kill is sent; the process takes a moment to go
            if not _alive(grandchild):
                break
            time.sleep(0.05)
        assert not _alive(grandchild)
    finally:
        worker.stop()


def test_stop_all_kills_every_started_worker_and_refuses_new_ones(noisy, monkeypatch):
    """What a run does as it stops on Ctrl-C or SIGTERM (`stopping.exit_now`)."""
    monkeypatch.setattr(child_processes, "_stopped", False)  # restored afterwards: the test process goes on
    assert noisy.call("noisy_rewards:fd_write", (1,), 30, "reward 'fd'") == 3
    proc = noisy.proc
    child_processes.stop_all()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    with pytest.raises(child_processes.Stopping, match="the run is stopping"):
        noisy.call("noisy_rewards:fd_write", (1,), 30, "reward 'fd'")


def test_a_pool_starts_workers_side_by_side_and_calls_then_start_none(tmp_path, monkeypatch):
    """`WorkerPool.start` has the workers running before the calls that need them: three calls
    at once then find three ready workers, and no call starts a process of its own."""
    (tmp_path / "slow_add.py").write_text("import time\n\ndef add(x):\n    time.sleep(0.5)\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    launched = []
    real_launch = Worker._launch

    def launch(worker: Worker) -> bool:
        started = real_launch(worker)
        launched.append(started)
        return started

    monkeypatch.setattr(Worker, "_launch", launch)
    pool = WorkerPool(4)
    try:
        assert pool.start(3) == 3
        assert sum(launched) == 3
        assert sum(w.proc is not None and w.proc.poll() is None for w in pool.idle.queue) == 3
        with ThreadPoolExecutor(3) as calls:
            results = list(calls.map(lambda x: pool.call("slow_add:add", (x,), 30, "slow_add"), range(3)))
        assert results == [1, 2, 3]
        assert sum(launched) == 3  # the calls started nothing
        assert pool.start(3) == 0  # already running
    finally:
        pool.stop()


def test_a_launched_workers_ready_frame_is_never_taken_for_a_reply(noisy):
    """A worker launched (by `WorkerPool.start`) whose start-up was not awaited, say because the
    start was interrupted: its first call still reads the ready frame first, then its reply."""
    with noisy.lock:
        assert noisy._launch()
    assert noisy.call("noisy_rewards:fd_write", (1,), 30, "fd_write") == 3


def test_a_pool_resized_down_stops_idle_workers_now_and_busy_ones_as_their_calls_end(tmp_path, monkeypatch):
    """`WorkerPool.resize`: a run's --reward-workers. Shrinking stops the idle workers at once and
    a busy one when its call ends (its reply still arrives); growing adds workers."""
    (tmp_path / "slow_add.py").write_text("import time\n\ndef add(x):\n    time.sleep(1.0)\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pool = WorkerPool(3)
    try:
        assert pool.start(3) == 3
        processes = [w.proc for w in pool.idle.queue]
        with ThreadPoolExecutor(2) as calls:
            busy = [calls.submit(pool.call, "slow_add:add", (x,), 30, "slow_add") for x in (1, 2)]
            deadline = time.monotonic() + 30
            while pool.idle.qsize() > 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            pool.resize(1)  # one idle (stopped now), two busy: one of them goes when its call ends
            assert pool.idle.qsize() == 0 and pool.held == 2
            assert [f.result() for f in busy] == [2, 3]
        assert pool.idle.qsize() == 1 and pool.held == 1 and pool.size == 1
        assert sum(p.poll() is None for p in processes) == 1  # the two others were stopped, not left running
        assert pool.call("slow_add:add", (5,), 30, "slow_add") == 6
        pool.resize(4)
        assert pool.idle.qsize() == 4 and pool.held == 4
    finally:
        pool.stop()
