"""grpo_flyte.runtime.torch_thread: every torch computation of a process runs on one thread."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpo_flyte.engine import cache
from grpo_flyte.engine.hf_generator import HFGenerator
from grpo_flyte.launch.cli import main as cli_main
from grpo_flyte.learning import merge, policy
from grpo_flyte.runtime.torch_thread import (
    THREAD_NAME,
    is_torch_thread,
    on_torch_thread,
    run_on_torch_thread,
)


def _where() -> str:
    return threading.current_thread().name


def test_calls_from_different_threads_all_run_on_the_one_torch_thread():
    with ThreadPoolExecutor(4) as pool:
        names = list(pool.map(lambda _: on_torch_thread(_where), range(8)))
    assert len(set(names)) == 1
    (name,) = set(names)
    assert name.startswith(THREAD_NAME) and name != _where()
    assert not is_torch_thread()


def test_a_call_from_the_torch_thread_runs_in_place_instead_of_deadlocking():
    def outer() -> tuple[str, str]:
        return _where(), on_torch_thread(_where)

    outside, inside = on_torch_thread(outer)
    assert outside == inside and inside.startswith(THREAD_NAME)


def test_exceptions_and_context_variables_cross_over():
    var = contextvars.ContextVar("var", default="unset")
    var.set("caller's value")
    assert on_torch_thread(var.get) == "caller's value"

    def fail(value: int) -> None:
        raise ValueError(f"bad value {value}")

    with pytest.raises(ValueError, match="bad value 7"):
        on_torch_thread(fail, 7)
    assert on_torch_thread(lambda a, b=0: a + b, 2, b=3) == 5  # the thread survives a failure


def test_async_form_keeps_the_event_loop_running():
    release = threading.Event()

    def blocked() -> str:
        assert release.wait(10)
        return _where()

    async def main() -> str:
        work = asyncio.ensure_future(run_on_torch_thread(blocked))
        await asyncio.sleep(0.01)  # the loop runs while the torch thread is busy...
        assert not work.done()
        release.set()  # ...and is what lets it finish
        return await work

    assert asyncio.run(main()).startswith(THREAD_NAME)


def test_a_local_run_drives_torch_from_the_torch_thread_only(tmp_path, tiny_model_dir, monkeypatch):
    """Engine build, sampling, held-out greedy decoding, the training step, saving and the merge:
    all on one thread, whichever thread Flyte, asyncio or the replica's batcher called from."""
    seen: dict[str, set[str]] = {}

    def spy(owner, name: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            seen.setdefault(name, set()).add(_where())
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    cache._engines.clear()  # so this run builds its engine
    for owner, name in [
        (cache, "get_engine"),
        (cache, "HFGenerator"),  # where EngineKey.build reads it
        (HFGenerator, "generate_many"),
        (policy, "peft_model"),
        (policy, "load_adapter_state"),  # grpo_step runs beside it (not here: the tiny model earns no advantage)
        (policy, "save_adapter"),
        (merge, "merge_into_base"),
    ]:
        spy(owner, name)
    argv = ["--local", "--model", str(tiny_model_dir), "--iterations", "1", "--max-new-tokens", "4"]
    argv += ["--prompts-per-iter", "2", "--group-size", "2", "--eval-size", "2", "--min-informative-groups", "0"]
    assert cli_main([*argv, "--backend", "hf", "--export-merged", "--export-adapter", "final", "--run-dir", str(tmp_path / "run")]) == 0
    cache._engines.clear()

    assert set(seen) == {
        "get_engine",
        "HFGenerator",
        "generate_many",
        "peft_model",
        "load_adapter_state",
        "save_adapter",
        "merge_into_base",
    }
    threads = set().union(*seen.values())
    assert len(threads) == 1 and next(iter(threads)).startswith(THREAD_NAME), seen
