"""Run the GRPO loop in Flyte local mode from Python instead of the CLI.

    python examples/local_run.py

Like `python -m grpo_flyte --local --iterations 2`, spelled out: the base model is a
`flyte.io.Dir`, the config one `RunConfig`, and the result a `RunResult` (final and best adapters,
metrics history, report). The CLI also writes a run folder; here the outputs stay in Flyte's raw data.
"""

from pathlib import Path

import flyte
from flyte.io import Dir

from grpo_flyte.config import RunConfig
from grpo_flyte.driver import train_rl
from grpo_flyte.models import embedded_model_dir

if __name__ == "__main__":
    raw = Path("runs/example").resolve()
    config = RunConfig(iterations=2, prompts_per_iter=2, group_size=4, max_new_tokens=64)
    run = flyte.with_runcontext(mode="local", raw_data_path=str(raw)).run(
        train_rl, config=config, base_model=Dir(path=str(embedded_model_dir()))
    )
    result = run.outputs()[0]
    for row in result.history:
        print(row.flat())
    print(f"final adapter v{result.adapter.version}: {result.adapter.dir.path}")
    if result.best is not None:  # the best by the held-out evaluations (grpo_flyte.loop.guard)
        print(f"best adapter v{result.best.version}: {result.best.dir.path}")
    print(f"report: {Path(result.report.path) / 'report.html'}")
