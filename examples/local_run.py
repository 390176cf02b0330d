"""Run the GRPO loop in Flyte local mode from Python instead of the CLI.

    python examples/local_run.py

Same as `python -m grpo_flyte.driver --local --num-iterations 2 --run-dir runs/example`, spelled out:
the base model is a `flyte.io.Dir`, the config one `RunConfig`, and the result the final adapter.
"""

from pathlib import Path

import flyte
from flyte.io import Dir

from grpo_flyte.config import RunConfig
from grpo_flyte.driver import train_rl
from grpo_flyte.models import embedded_model_dir

if __name__ == "__main__":
    run_dir = Path("runs/example").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    config = RunConfig(num_iterations=2, prompts_per_iter=2, group_size=4, max_new_tokens=64)
    run = flyte.with_runcontext(mode="local", raw_data_path=str(run_dir / "flyte")).run(
        train_rl, config=config, base_model=Dir(path=str(embedded_model_dir())), run_dir=str(run_dir)
    )
    adapter = run.outputs()[0]
    print(f"final adapter v{adapter.version}: {adapter.dir.path}")
    print(f"report: {run_dir / 'report.html'}")
