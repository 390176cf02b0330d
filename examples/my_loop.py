"""Build your own loop from grpo_flyte's tasks: a small curriculum, easy questions first.

`train_rl` is one way to drive the tasks; this workflow is another. It calls `init_adapter`,
fans out `generate` (one task per prompt), scores each group with `score_group` and takes the
GRPO step with `train_step`, exactly the tasks `train_rl` uses, with its own choice of prompts.
Every call is an ordinary Flyte task call, so on a cluster the generate calls spread over the warm
pool and each step shows in the UI. The workflow runs in grpo_flyte's image with its GRPO_FLYTE_*
settings, like grpo_flyte's own environments (see examples/my_workflow.py).

    flyte run examples/my_loop.py curriculum --base_model <dir>    # on your cluster
    python examples/my_loop.py                                     # in local mode, on this machine
"""

from __future__ import annotations

import asyncio

import flyte
from flyte.io import Dir

from grpo_flyte.config import RunConfig
from grpo_flyte.envs import image, reward_env, rollout_env, settings, train_env
from grpo_flyte.reward import score_group
from grpo_flyte.rollout import generate
from grpo_flyte.trainer import init_adapter, train_step
from grpo_flyte.types import AdapterRef, Example

env = flyte.TaskEnvironment(
    name="my-team-curriculum", image=image, env_vars=settings.as_env_vars(), depends_on=[rollout_env, reward_env, train_env]
)

# Stage 1: one-digit sums; stage 2: two-digit sums.
STAGES = [
    [Example(question=f"What is {a} + {b}?", answer=str(a + b)) for a, b in [(2, 3), (4, 4), (1, 7), (6, 2)]],
    [Example(question=f"What is {a} + {b}?", answer=str(a + b)) for a, b in [(12, 31), (25, 44), (38, 17), (56, 29)]],
]


@env.task
async def curriculum(base_model: Dir, config: RunConfig | None = None) -> AdapterRef:
    """One GRPO step per stage, each on that stage's prompts; returns the final adapter."""
    config = config or RunConfig(prompts_per_iter=4, group_size=4)
    # Each task takes the parts of the config it uses.
    adapter = await init_adapter(config.base, config.lora, config.seed, base_model)
    sampling = (config.base, config.engine, config.prompt, config.sampling, config.episode)
    for stage, prompts in enumerate(STAGES):
        with flyte.group(f"stage-{stage + 1}"):
            groups = await asyncio.gather(
                *(generate(*sampling, base_model, adapter, ex, i, seed=1000 * stage + i) for i, ex in enumerate(prompts))
            )
            scored = await asyncio.gather(*(score_group(config.scoring, config.sampling, g) for g in groups))
            result = await train_step(config.base, config.lora, config.train, config.sampling, base_model, adapter, list(scored))
            accuracy = sum(p.correct for sg in scored for p in sg.rewards) / sum(len(sg.rewards) for sg in scored)
            print(f"stage {stage + 1}: accuracy {accuracy:.0%}, loss {result.stats.loss:+.4f} -> adapter v{result.adapter.version}")
            adapter = result.adapter
    return adapter


if __name__ == "__main__":
    from grpo_flyte.models import embedded_model_dir

    run = flyte.with_runcontext(mode="local").run(curriculum, base_model=Dir(path=str(embedded_model_dir())))
    print(run.outputs()[0])
