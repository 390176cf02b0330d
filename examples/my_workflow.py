"""Use grpo_flyte's tasks inside your own Flyte workflow.

Your environment declares `depends_on=[driver_env]` so the GRPO environments (and their images) are
deployed with it; your task then awaits `train_rl` like any other task and gets a `RunResult` back:
the final adapter, the metrics history, the report and (with `export_merged`) the merged model.
Your task runs in grpo_flyte's image (`envs.image`: the default image lacks the package's
dependencies) and carries the GRPO_FLYTE_* settings (`envs.settings.as_env_vars()`), because its
pod imports grpo_flyte again to submit `train_rl` and must see the hardware you configured.

    flyte run examples/my_workflow.py finetune_and_report       # on your cluster
    python examples/my_workflow.py                             # in local mode, on this machine
"""

import flyte
from flyte.io import Dir

from grpo_flyte.config import RunConfig
from grpo_flyte.driver import train_rl
from grpo_flyte.envs import driver_env, image, settings
from grpo_flyte.types import AdapterRef

env = flyte.TaskEnvironment(name="my-team-finetune", image=image, env_vars=settings.as_env_vars(), depends_on=[driver_env])


@env.task
async def finetune_and_report(base_model: Dir, iterations: int = 2) -> AdapterRef:
    config = RunConfig(iterations=iterations, prompts_per_iter=2, group_size=4, max_new_tokens=64)
    result = await train_rl(config=config, base_model=base_model)
    last = result.history[-1].flat()
    print(f"trained adapter v{result.adapter.version} at {result.adapter.dir.path}; held-out accuracy {last['eval_accuracy']:.1%}")
    return result.adapter


if __name__ == "__main__":
    from grpo_flyte.models import embedded_model_dir

    run = flyte.with_runcontext(mode="local").run(finetune_and_report, base_model=Dir(path=str(embedded_model_dir())))
    print(run.outputs()[0])
