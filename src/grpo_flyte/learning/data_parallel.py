"""This module runs a train step over several processes (data-parallel): each forwards its share
of every minibatch, the LoRA gradients are all-reduced, and rank 0 writes the adapter.

Locally `launch_ranks` starts the processes (`--train-processes`, gloo on a CPU); on a cluster the
Elastic plugin starts one per GPU and each runs `distributed_step` (trainer.train_step_distributed).
Either way a process is given the same `RankJob` and runs `train_rank`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from flyte.io import Dir

from grpo_flyte.config.generation import ModelConfig, SamplingConfig
from grpo_flyte.config.training import LoraConfig, TrainConfig
from grpo_flyte.errors import GrpoFlyteError, failed_workers
from grpo_flyte.learning import grpo, policy
from grpo_flyte.learning import update as policy_update
from grpo_flyte.runtime.device import best_device
from grpo_flyte.runtime.storage import from_payload, node_cache
from grpo_flyte.types import AdapterRef, ScoredGroup, StepStats, TrainStepResult

# The processes of a data-parallel step (one pod, one per GPU) share one download of each folder.
_node_dirs = node_cache("train-step")


@dataclasses.dataclass(frozen=True)
class RankJob:
    """What every process of a data-parallel train step is given: the same inputs (each takes its
    own share of the work, `grpo.rank_share`)."""

    model_path: str
    adapter_path: str
    model: ModelConfig
    lora: LoraConfig
    train: TrainConfig
    sampling: SamplingConfig
    sequences: list[grpo.TrainSequence]
    steps: tuple[int, int]
    version: int


def train_rank(job: RankJob, out: str) -> StepStats | None:
    """One process of a data-parallel train step, started by torch.distributed's launcher (its
    RANK, WORLD_SIZE, LOCAL_RANK and rendezvous variables set): load the base, restore the adapter
    and optimizer state from their folder (a fresh process has nothing warm), take the step with the
    gradients all-reduced, and rank 0 alone writes the new adapter into `out`. Rank 0 returns the
    step's statistics, the others None."""
    import os

    import torch
    import torch.distributed as dist

    world_size = int(os.environ["WORLD_SIZE"])
    cuda = best_device() == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:  # the processes share the cores: one OpenMP team each would oversubscribe them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        rank = dist.get_rank()
        peft = policy.peft_model(job.model, job.lora, job.model_path)
        restored = time.perf_counter()
        optimizer = policy.load_adapter_state(peft, job.adapter_path, job.train)
        restore_s = time.perf_counter() - restored
        control = policy.entropy_control(job.adapter_path, job.train)
        stats = policy_update.grpo_step(
            peft, optimizer, job.sequences, job.train, job.sampling, job.steps, rank=rank, world_size=world_size, control=control
        )
        if rank == 0:
            policy.save_adapter(peft, optimizer, job.version, Path(out), policy.control_after(stats, job.train))
            policy.record_base(Path(out), job.model.model)
        dist.barrier()  # the adapter is whole before any process reports the step done
    finally:
        dist.destroy_process_group()
    return stats.model_copy(update={"restore_s": restore_s}) if rank == 0 else None


def _rank_main() -> None:
    """A train process of `launch_ranks`: `python -c ... JOB_FILE OUT STATS_FILE`. Its error is
    recorded for the launcher (torch elastic's `record`: the step fails with it, not with an exit
    code only); rank 0 writes the step's statistics to STATS_FILE."""
    import pickle
    import sys

    from torch.distributed.elastic.multiprocessing.errors import record

    job_file, out, stats_file = sys.argv[1:4]
    try:
        stats = record(train_rank)(pickle.loads(Path(job_file).read_bytes()), out)
    except GrpoFlyteError:
        sys.exit(1)  # recorded: the step raises it, and the run says it in one line (a bug's traceback is shown)
    if stats is not None:
        Path(stats_file).write_text(stats.model_dump_json())


# How often the launcher looks at its train processes.
RANK_POLL_S = 0.1


def launch_ranks(job: RankJob, out: Path, processes: int) -> StepStats:
    """The train step in `processes` local processes (gloo on a CPU): each started as torchrun
    starts one, by torch elastic's `start_processes`, with a session of its own (a terminal's
    Ctrl-C reaches the run, which ends them: `runtime.child_processes`), meeting at a TCP store this
    process hosts on a free port; rank 0's statistics.

    Not torch's `elastic_launch`: its agent adds restarts and rendezvous across nodes, which one
    node with no restarts does not use, and it stops its processes only on a signal in the main
    thread, while this runs on the torch thread (a Ctrl-C left them running the step)."""
    import os
    import pickle
    import sys
    import tempfile

    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    from grpo_flyte.runtime import child_processes

    with tempfile.TemporaryDirectory(prefix="grpo_flyte-train-") as tmp:
        job_file, stats_file = Path(tmp) / "job.pkl", Path(tmp) / "stats.json"
        job_file.write_bytes(pickle.dumps(job))
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # port 0: a free one
        common = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",  # the processes join this store, none hosts one
            "WORLD_SIZE": str(processes),
            "LOCAL_WORLD_SIZE": str(processes),
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        }
        envs = {rank: {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(processes)}
        # Its warnings (no signal handlers off the main thread: `runtime.child_processes` ends the processes;
        # the others ended once one failed) and its error line (the step raises the failure) say
        # nothing the run does not.
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
        command = ("-c", "from grpo_flyte.learning.data_parallel import _rank_main; _rank_main()", str(job_file), str(out), str(stats_file))
        with child_processes.starting() as started:
            ranks = start_processes(
                "grpo-flyte-train", sys.executable, dict.fromkeys(range(processes), command), envs, DefaultLogsSpecs(log_dir=tmp)
            )
            for pid in ranks.pids().values():
                started(pid)
        try:
            result = ranks.wait(period=RANK_POLL_S)  # once one fails, it ends the others
        finally:
            ranks.close()
            for pid in ranks.pids().values():
                child_processes.ended(pid)
        if result.is_failed():
            raise failed_workers(result.failures, processes)  # e.g. a damaged adapter: the AdapterError
        return StepStats.model_validate_json(stats_file.read_text())


async def distributed_step(
    model: ModelConfig,
    lora: LoraConfig,
    train: TrainConfig,
    sampling: SamplingConfig,
    base_model: Dir,
    adapter: AdapterRef,
    scored: list[ScoredGroup],
    scored_payload: list[Dir],
    total_iterations: int,
    reward_weights: dict[str, float] | None = None,
) -> TrainStepResult | None:
    """One process of the cluster's data-parallel train step (train_step_distributed): rank 0
    uploads the new adapter and answers for all."""
    import tempfile

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        result = await rank_step(
            model, lora, train, sampling, base_model, adapter, scored, scored_payload, total_iterations, Path(out), reward_weights
        )
        if result is None:  # not rank 0: only its answer is the task's
            return None
        new_dir = await Dir.from_local(out)
    return result.model_copy(
        update={"adapter": AdapterRef(version=adapter.version + 1, dir=new_dir), "train_s": time.perf_counter() - started}
    )


async def rank_step(
    model: ModelConfig,
    lora: LoraConfig,
    train: TrainConfig,
    sampling: SamplingConfig,
    base_model: Dir,
    adapter: AdapterRef,
    scored: list[ScoredGroup],
    scored_payload: list[Dir],
    total_iterations: int,
    out: Path,
    reward_weights: dict[str, float] | None = None,
) -> TrainStepResult | None:
    """Everything one process of a data-parallel train step does but the upload: read the inputs,
    take the step (`train_rank`); rank 0 writes the adapter into `out` and returns the result
    (its adapter names `out`), the others None."""
    started = time.perf_counter()
    model_path = await _node_dirs.get(base_model)
    fetched = time.perf_counter()
    adapter_path = await _node_dirs.get(adapter.dir)
    download_s = time.perf_counter() - fetched
    scored = await from_payload(scored, scored_payload, ScoredGroup, _node_dirs)
    sequences, num_rollouts = policy_update.build_sequences(scored, train, reward_weights)
    version = adapter.version + 1
    steps = (adapter.version * train.steps_per_iteration, total_iterations * train.steps_per_iteration)
    stats = train_rank(RankJob(model_path, adapter_path, model, lora, train, sampling, sequences, steps, version), str(out))
    if stats is None:
        return None
    return TrainStepResult(
        adapter=AdapterRef(version=version, dir=Dir(path=str(out))),
        num_rollouts=num_rollouts,
        num_contributing=policy_update.num_contributing(sequences),
        # reading the adapter folder back is part of restoring it (the base's download is not)
        stats=stats.model_copy(update={"restore_s": stats.restore_s + download_s}),
        train_s=time.perf_counter() - started,
    )
