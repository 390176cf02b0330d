"""`python SCRIPT ARGS...` (or `python -m MODULE ...`, `python -c CODE ...`) in a fresh process, without paying for
torch, transformers and peft's imports each time: about 6 CPU seconds a process, which the drills
and benchmark runs of the tests would otherwise pay dozens of times.

    done = warm_python.run([script, *args], env=..., timeout=300)  # as subprocess.run(capture_output=True, text=True)

A server process (`python tests/support/warm_python.py`, started at the first call and kept for the test
session) has imported those libraries, and nothing else: never grpo_flyte, which each command
imports from its own sys.path, as a fresh interpreter does. For each command it forks a child while
it has a single thread; the child takes the command's argv, working directory, environment
(PYTHONPATH included, as its sys.path), stdin (empty), stdout and stderr, runs the script as
__main__ and ends as an interpreter ends (threads joined, atexit handlers run); its exit status
comes back as subprocess reports it (a signal's as -N). One command runs at a time.

Those libraries read some settings once, when imported (HF_*, TRANSFORMERS_*, TORCH_*, OMP_*, HOME ...),
so a command runs on a server that imported them under the settings the command would import them
under: its environment's, or with `cli=True` (a command that runs grpo_flyte's CLI, which quiets them
before importing them) its environment as the CLI leaves it. A server per such set of settings, a
few at most; past that, or where no server can start (no fork, or a library started a thread), a
command runs as a plain subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Settings those libraries read when imported (HOME and XDG_*: their default cache folders): a command runs
# on a server that imported them under its own.
IMPORT_TIME_PREFIXES = (
    "HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "OMP_", "MKL_", "CUDA", "TOKENIZERS", "BNB_", "PYTHON", "HOME", "XDG_",
)  # fmt: skip
MAX_SERVERS = 4
POLL_S = 0.02

_servers: dict[tuple, _Server] = {}  # the settings -> their server
_lock = threading.Lock()


def run(argv: list[str], *, cwd: str | Path | None = None, env: dict[str, str] | None = None, timeout: float = 300, cli: bool = False):
    """`python *argv` as `subprocess.run(..., capture_output=True, text=True, timeout=timeout)` runs
    it: a CompletedProcess, or subprocess.TimeoutExpired (the process killed). `cli`: the command
    runs grpo_flyte's CLI (`cli.main`) before it imports those libraries."""
    argv, env = [str(a) for a in argv], dict(os.environ if env is None else env)
    imports = _cli_settings(env) if cli else env
    key = tuple(sorted((k, v) for k, v in imports.items() if k.upper().startswith(IMPORT_TIME_PREFIXES) and k != "PYTHONPATH"))
    with _lock:
        if key not in _servers and len(_servers) < MAX_SERVERS and hasattr(os, "fork"):
            _servers[key] = _Server.start(imports)
        server = _servers.get(key)
        if server is not None and server.proc is not None:
            return server.run(argv, cwd, env, timeout)
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def close() -> None:
    """End the servers (the next call starts one again)."""
    with _lock:
        for server in _servers.values():
            server.close()
        _servers.clear()


def _cli_settings(env: dict[str, str]) -> dict[str, str]:
    """`env` as grpo_flyte's CLI leaves it before it imports those libraries (`quiet_libraries`)."""
    from grpo_flyte.launch.cli import quiet_libraries

    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        quiet_libraries()
        return dict(os.environ)
    finally:
        os.environ.clear()
        os.environ.update(saved)


class _Server:
    def __init__(self, proc: subprocess.Popen | None, folder: Path) -> None:
        self.proc, self.folder = proc, folder

    @classmethod
    def start(cls, env: dict[str, str]) -> _Server:
        folder = Path(tempfile.mkdtemp(prefix="warm-python-"))
        with (folder / "server.log").open("w") as log:
            proc = subprocess.Popen(
                [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env
            )
        server = cls(proc, folder)
        if proc.stdout.readline().strip() != "ready":  # it could not start safely: plain subprocesses then
            server.close()
        return server

    def run(self, argv: list[str], cwd: str | Path | None, env: dict[str, str], timeout: float):
        out, err = self.folder / "stdout", self.folder / "stderr"
        request = {"argv": argv, "cwd": str(cwd or os.getcwd()), "env": env, "out": str(out), "err": str(err), "timeout": timeout}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the warm python ended (exit {self.proc.wait()}): {(self.folder / 'server.log').read_text()[-3000:]}")
        status = json.loads(answer)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        command = [sys.executable, *argv]
        if status["timed_out"]:
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
        return subprocess.CompletedProcess(command, status["returncode"], stdout, stderr)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()  # the server ends at the end of its input
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        shutil.rmtree(self.folder, ignore_errors=True)


# --------------------------------------------------------------------------- the server


def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()


def _fork_and_wait() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def _serve() -> None:
    import peft  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch
    import torch.distributed.elastic.multiprocessing  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    # numpy's OpenBLAS starts a pool of threads when imported (one per core past the first, unless OMP_NUM_THREADS=1)
    # and ends it whenever the process forks (its pthread_atfork handler), starting it again at its next use. A
    # first fork ends such pools now: a thread still there after it would be lost in a child, unsafe to fork.
    _fork_and_wait()
    if _threads() != 1 or threading.active_count() != 1:
        print(f"{_threads()} threads after the imports: forking would not be safe", file=sys.stderr, flush=True)
        return
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in sys.path[1:] if p not in own]  # the interpreter's own entries (stdlib, site-packages)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request, base)  # never returns
        started, status, timed_out = time.monotonic(), None, False
        while status is None:
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(raw)
            elif time.monotonic() - started > request["timeout"]:
                os.kill(pid, signal.SIGKILL)
                status, timed_out = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), True
            else:
                time.sleep(POLL_S)
        print(json.dumps({"returncode": status, "timed_out": timed_out}), flush=True)


def _child(request: dict, base: list[str]) -> None:
    """Become `python *argv`: its fds, directory, environment and sys.path; run it as __main__; end
    as the interpreter does (the SystemExit unwinds out of the server's loop to the top)."""
    import runpy
    import types

    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # found again from the command's TMPDIR, as a fresh interpreter does
    argv = request["argv"]
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    if argv[0] == "-m":  # sys.path[0] as the interpreter sets it: the working directory, '' or the script's folder
        sys.argv, first = [argv[1], *argv[2:]], os.getcwd()
    elif argv[0] == "-c":
        sys.argv, first = ["-c", *argv[2:]], ""
    else:
        sys.argv, first = list(argv), str(Path(argv[0]).resolve().parent)
    sys.path[:] = [first, *extra, *base]
    code: int | str | None = 0
    try:
        if argv[0] == "-m":
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    except Exception as error:  # noqa: BLE001 (as the interpreter: the traceback from the script's frame on, exit status 1)
        tb = error.__traceback__
        while tb is not None and any(tb.tb_frame.f_globals is own for own in (globals(), vars(runpy))):  # the server's and runpy's
            tb = tb.tb_next
        sys.excepthook(type(error), error.with_traceback(tb), tb)
        code = 1
    raise SystemExit(code)


if __name__ == "__main__":
    _serve()
