"""This module defines the train tasks `init_adapter`, `train_step`, `merge_adapter` and `write_gguf`
(the merged model as one GGUF file, `grpo_flyte.models.gguf_writer`): PEFT LoRA on a frozen base,
one GRPO iteration per call.

The base model loads once per warm train replica (cached); everything that defines the result,
the adapter weights and the AdamW state, comes in through the task's inputs and goes out in the
new adapter directory. Token ids come from `generate`; nothing is re-tokenized. The work is done by
plain functions: the policy and its adapter folder (`grpo_flyte.learning.policy`), the GRPO step
(`grpo_flyte.learning.update`), several processes (`grpo_flyte.learning.data_parallel`) and the merge
(`grpo_flyte.learning.merge`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from flyte.io import Dir

from grpo_flyte.config.constants import MAX_BASES
from grpo_flyte.config.generation import ModelConfig, SamplingConfig
from grpo_flyte.config.training import LoraConfig, TrainConfig
from grpo_flyte.envs import train_dist_env, train_env
from grpo_flyte.errors import input_errors_not_retried
from grpo_flyte.learning import data_parallel, merge, policy
from grpo_flyte.learning import update as policy_update
from grpo_flyte.runtime import memory
from grpo_flyte.runtime.storage import from_payload, is_remote, publish_dir, replica_cache
from grpo_flyte.types import AdapterRef, ScoredGroup, StepStats, TrainStepResult

_warm = policy.WarmOptimizer()
_model_dirs = replica_cache("train-models", capacity=MAX_BASES)  # one per base a sweep trains (policy.peft_model)
_payload_dirs = replica_cache("train-payloads", capacity=1)
_adapter_dirs = replica_cache("train-adapters", capacity=2)
_export_dirs = replica_cache("train-exports", capacity=1)  # the merged model write_gguf reads


@train_env.task(retries=2)
async def init_adapter(model: ModelConfig, lora: LoraConfig, seed: int, base_model: Dir) -> AdapterRef:
    """Version 0: a freshly initialized LoRA adapter (equal to the base model) and no optimizer state."""
    model_path = await _model_dirs.get(base_model)

    def build(out: Path) -> None:
        peft = policy.peft_model(model, lora, model_path)
        _warm.clear()
        policy.reset_lora(peft, seed)
        policy.save_adapter(peft, None, 0, out)
        policy.record_base(out, model.model)

    with input_errors_not_retried("init_adapter"):  # e.g. a GPU pod whose CUDA is unusable
        folder, _ = await publish_dir(build, "v0000")
    return AdapterRef(version=0, dir=folder)


@train_env.task(retries=2)
async def train_step(
    model: ModelConfig,
    lora: LoraConfig,
    train: TrainConfig,
    sampling: SamplingConfig,
    base_model: Dir,
    adapter: AdapterRef,
    scored: list[ScoredGroup],
    scored_payload: list[Dir] = [],  # noqa: B006 (Flyte copies inputs; an optional list would hide the content hash)
    total_iterations: int = 0,
    reward_weights: dict[str, float] = {},  # noqa: B006 (as scored_payload)
) -> TrainStepResult:
    """One iteration of GRPO (`num_iterations` x `updates_per_iter` optimizer steps) on the scored
    groups; returns the next adapter. A batch too large to pass inline comes as `scored_payload`
    (`runtime.storage.as_payload`); `reward_weights`: the run's rewards (for normalize_then_sum)."""
    started = time.perf_counter()
    model_path = await _model_dirs.get(base_model)
    adapter_path = await _adapter_dirs.get(adapter.dir)
    scored = await from_payload(scored, scored_payload, ScoredGroup, _payload_dirs)
    sequences, num_rollouts = policy_update.build_sequences(scored, train, reward_weights)
    version = adapter.version + 1

    steps = (adapter.version * train.steps_per_iteration, total_iterations * train.steps_per_iteration)
    job = data_parallel.RankJob(model_path, adapter_path, model, lora, train, sampling, sequences, steps, version)

    def build(out: Path) -> tuple[Any, Any, StepStats, tuple]:
        if train.train_processes > 1:
            _warm.clear()  # the processes hold the new weights, not this one's model
            return None, None, data_parallel.launch_ranks(job, out, train.train_processes), ()
        peft = policy.peft_model(model, lora, model_path)
        optimizer = _warm.take(peft, adapter.dir.path, adapter_path, train)
        restore_s = 0.0
        if optimizer is None:
            restored = time.perf_counter()
            optimizer = policy.load_adapter_state(peft, adapter_path, train)
            restore_s = time.perf_counter() - restored
        control = policy.entropy_control(adapter_path, train)  # from the folder: warm state is only a cache
        stats = policy_update.grpo_step(peft, optimizer, sequences, train, sampling, steps, control=control)
        policy.save_adapter(peft, optimizer, version, out, policy.control_after(stats, train))
        policy.record_base(out, model.model)
        return peft, optimizer, stats.model_copy(update={"restore_s": restore_s}), policy.files_of(str(out))

    with input_errors_not_retried("train_step"), memory.span(gpu=True) as measured:  # e.g. a damaged adapter stays damaged
        new_dir, (peft, optimizer, stats, files) = await publish_dir(build, f"v{version:04d}")
    if peft is not None:
        _warm.keep(peft, new_dir.path, optimizer, None if is_remote(new_dir.path) else files)
    return TrainStepResult(
        adapter=AdapterRef(version=version, dir=new_dir),
        num_rollouts=num_rollouts,
        num_contributing=policy_update.num_contributing(sequences),
        stats=stats,
        train_s=time.perf_counter() - started,
        memory=measured.peak,
    )


if train_dist_env is not None:

    @train_dist_env.task(retries=2)
    def train_step_distributed(
        model: ModelConfig,
        lora: LoraConfig,
        train: TrainConfig,
        sampling: SamplingConfig,
        base_model: Dir,
        adapter: AdapterRef,
        scored: list[ScoredGroup],
        scored_payload: list[Dir] = [],  # noqa: B006 (as train_step)
        total_iterations: int = 0,
        reward_weights: dict[str, float] = {},  # noqa: B006 (as train_step)
    ) -> TrainStepResult | None:
        """train_step over the train GPUs: the Elastic plugin runs this in one process per GPU (a
        sync function, as the plugin calls it), each with torch.distributed's variables set. A
        process's error is recorded for the launcher (torch elastic's `record`), so that the task
        fails with it, not with exit codes only (envs.train_dist_env's plugin)."""
        import asyncio

        from torch.distributed.elastic.multiprocessing.errors import record

        def step() -> TrainStepResult | None:
            with input_errors_not_retried("train_step_distributed"), memory.span(gpu=True) as measured:
                result = asyncio.run(
                    data_parallel.distributed_step(
                        model, lora, train, sampling, base_model, adapter, scored, scored_payload, total_iterations, reward_weights
                    )
                )
            return None if result is None else result.model_copy(update={"memory": measured.peak})  # rank 0's process

        return record(step)()

    DISTRIBUTED_STEP = train_step_distributed
else:
    DISTRIBUTED_STEP = None


@train_env.task(retries=2)
async def merge_adapter(base_model: Dir, adapter: AdapterRef) -> Dir:
    """The adapter merged into the base: a full model folder for serving (no PEFT needed)."""
    model_path = await _model_dirs.get(base_model)
    adapter_path = await _adapter_dirs.get(adapter.dir)

    def build(out: Path) -> None:
        # the run's last step is done: its model and optimizer would only share the GPU with the merge
        _warm.clear()
        policy.release_models()
        merge.merge_into_base(model_path, adapter_path, out)

    merged, _ = await publish_dir(build, f"merged-v{adapter.version:04d}")
    return merged


@train_env.task(retries=2)
async def write_gguf(merged: Dir, quant: str) -> Dir:
    """The merged model folder `merged` written as one GGUF file in `quant`
    (`models.gguf_writer.write_gguf`), alone in a folder: the GGUF form as the engine loads it."""
    from grpo_flyte.models import gguf_writer

    merged_path = Path(await _export_dirs.get(merged))
    name = gguf_writer.gguf_name(quant)
    folder, _ = await publish_dir(
        lambda out: gguf_writer.write_gguf(merged_path, out / name, quant), f"gguf-{quant}-{Path(merged.path).name}", folder="exports"
    )
    return folder
