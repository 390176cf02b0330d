"""Stand-ins for the driver's tasks with fixed durations and no model: the real `train_rl` loop
(scheduling, checkpoint, metrics, report) around generate and train steps that only take time.

`benchmarks/pipeline_overlap.py` times the loop with them; `tests/unit/loop/test_pipeline.py` checks with
them which adapter version generated every group the trainer trained.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import flyte
from flyte.io import Dir

from grpo_flyte import driver
from grpo_flyte.config.run import RunConfig
from grpo_flyte.loop import batches
from grpo_flyte.types import AdapterRef, RewardParts, Rollout, RolloutGroup, RunResult, ScoredGroup, StepStats, TrainStepResult


class StandIns:
    """generate sleeps `generate_s` per group (groups run concurrently, as on a pool), train_step
    sleeps `train_s`; `trained` records, per train step, (its adapter version, the versions that
    generated its groups)."""

    def __init__(self, folder: Path, generate_s: float, train_s: float):
        self.folder, self.generate_s, self.train_s = folder, generate_s, train_s
        self.trained: list[tuple[int, list[int]]] = []
        folder.mkdir(parents=True, exist_ok=True)

    def _adapter(self, version: int) -> AdapterRef:
        path = self.folder / f"v{version:04d}"
        path.mkdir(exist_ok=True)
        (path / "adapter_config.json").write_text("{}")
        return AdapterRef(version=version, dir=Dir(path=str(path)))

    async def init_adapter(self, model, lora, seed, base_model) -> AdapterRef:
        return self._adapter(0)

    async def generate(self, *, sampling, adapter: AdapterRef, example, index: int, seed: int, **_parts) -> RolloutGroup:
        await asyncio.sleep(self.generate_s)
        rollouts = [
            Rollout(completion_ids=[5, 6], sampling_logprobs=[-1.0, -1.0], finish_reason="stop", text=str((seed + row) % 3))
            for row in range(sampling.group_size)
        ]
        return RolloutGroup(
            index=index, example=example, adapter_version=adapter.version, prompt_ids=[1, 2], rollouts=rollouts, generate_s=self.generate_s
        )

    async def score_group(self, scoring, sampling, group: RolloutGroup) -> ScoredGroup:
        rewards = [RewardParts(reward=float(r.text == "0"), correct=r.text == "0", format=True) for r in group.rollouts]
        return ScoredGroup(group=group, rewards=rewards)

    async def train_step(
        self, model, lora, train, sampling, base_model, adapter: AdapterRef, scored, payload, total_iterations=0, reward_weights=None
    ):
        await asyncio.sleep(self.train_s)
        self.trained.append((adapter.version, [sg.group.adapter_version for sg in scored]))
        rollouts = sum(len(sg.rewards) for sg in scored)
        stats = StepStats(loss=0.0, num_updates=1, num_tokens=2 * rollouts)
        return TrainStepResult(
            adapter=self._adapter(adapter.version + 1), num_rollouts=rollouts, num_contributing=rollouts, stats=stats, train_s=self.train_s
        )


@contextlib.contextmanager
def standing_in(stand_ins: StandIns) -> Iterator[None]:
    """The driver calls the stand-ins instead of its tasks while the block runs."""
    # where each task is called from: the driver starts the run, an iteration's batch does the rest
    homes = {"init_adapter": driver, "generate": batches, "score_group": batches, "train_step": batches}
    saved = {name: getattr(home, name) for name, home in homes.items()}
    for name, home in homes.items():
        setattr(home, name, getattr(stand_ins, name))
    try:
        yield
    finally:
        for name, task in saved.items():
            setattr(homes[name], name, task)


def run_loop(config: RunConfig, stand_ins: StandIns, raw_data: Path) -> RunResult:
    """`train_rl` in Flyte local mode with the stand-ins; returns its result."""
    with standing_in(stand_ins):
        run = flyte.with_runcontext(mode="local", raw_data_path=str(raw_data)).run(
            driver.train_rl, config=config, base_model=Dir(path=str(stand_ins.folder))
        )
        return run.outputs()[0]
