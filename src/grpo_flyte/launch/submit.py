"""Submitting to a Flyte cluster: the checks only a cluster run needs, the base model and a file
dataset as remote inputs, the code bundle (or, for an installed wheel, a version naming the code),
the W&B run's link, and `--resume-run` (a rerun with recovery).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import pkgutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpo_flyte
from grpo_flyte.config.constants import EMBEDDED_MODEL
from grpo_flyte.config.run import RunConfig
from grpo_flyte.errors import ModelError, UserError, is_user_attribute
from grpo_flyte.launch.preflight import (
    check_inputs,
    check_judge_fits,
    check_model_fits,
    check_reward_model_fits,
    model_to_check,
    reward_model_dirs,
    tracking_env,
)
from grpo_flyte.reporting.tracking import wandb_project_of
from grpo_flyte.reward_fns import reward_model_ref
from grpo_flyte.runtime.storage import FLYTE_INLINE_LIMIT_BYTES, payload_key, payload_text, write_payload
from grpo_flyte.types import Example

if TYPE_CHECKING:
    from grpo_flyte.config.grid import SweepMember

logger = logging.getLogger("grpo_flyte")

# The folder whose modules travel in a checkout's code bundle (flyte.init's root_dir): src/, so the
# package resolves as grpo_flyte.* on the cluster.
PACKAGE_DIR = Path(grpo_flyte.__file__).resolve().parent
BUNDLE_ROOT = PACKAGE_DIR.parent


def resolve_remote_model(model: str, field: str = "model"):
    """A model (the base, the judge's or a reward model: `field`) as a Dir in remote storage:
    prefetched from the Hub or uploaded from here."""
    import flyte
    import flyte.prefetch
    from flyte.io import Dir

    from grpo_flyte.envs import settings
    from grpo_flyte.models.folders import resolve_local_model

    if model == EMBEDDED_MODEL or Path(model).expanduser().is_dir():
        return Dir.from_local_sync(str(resolve_local_model(model, field)))
    if model.count("/") != 1:
        raise ModelError(
            f"{model!r}: expected 'embedded', a local model directory or a Hugging Face repo id like 'Qwen/Qwen3-0.6B'", field=field
        )
    logger.info("prefetching %s into the cluster's storage (cached after the first time)", model)
    prefetch = flyte.prefetch.hf_model(repo=model, hf_token_key=settings.hf_token_secret)
    prefetch.wait()
    return prefetch.outputs()[0]


def check_submission(config: RunConfig) -> None:
    """What only a cluster run needs, checked before anything is submitted: the W&B key as a
    Flyte secret, a LoRA rank vLLM serves, and custom rewards and environments the pods can import."""
    from grpo_flyte.engine.vllm_generator import VLLM_LORA_RANKS
    from grpo_flyte.envs import from_source_checkout, settings, train_problem, train_world_size

    if train_problem is not None:
        raise UserError(train_problem)
    if config.train.train_processes > 1:
        raise UserError(
            f"--train-processes {config.train.train_processes} is for local runs; on a cluster the train GPUs set the "
            f"processes: GRPO_FLYTE_TRAIN_GPU={settings.train_gpu.rpartition(':')[0] or 'L4'}:{config.train.train_processes}"
        )
    if train_world_size(settings) > config.rollouts_per_step:
        raise UserError(
            f"{train_world_size(settings)} train processes (GRPO_FLYTE_TRAIN_GPU={settings.train_gpu} x GRPO_FLYTE_TRAIN_NODES="
            f"{settings.train_nodes}) with {config.rollouts_per_step_given()}: expected at most {config.rollouts_per_step} processes"
        )

    if "wandb" in config.trackers and not settings.wandb_secret:
        where = f"--wandb-project {config.wandb_project!r}" if config.wandb_project else "--report-to wandb"
        raise UserError(
            f"{where} on a cluster needs your W&B API key as a Flyte secret: create it "
            "(flyte create secret wandb-api-key) and name it in GRPO_FLYTE_WANDB_SECRET=wandb-api-key"
        )
    if config.engine.backend != "hf" and config.lora.lora_rank > max(VLLM_LORA_RANKS):
        raise UserError(
            f"--lora-rank {config.lora.lora_rank}: vLLM, which generates on a cluster's GPUs, serves LoRA ranks up to "
            f"{max(VLLM_LORA_RANKS)}; expected at most {max(VLLM_LORA_RANKS)} (or --backend hf)"
        )
    names = [name for name in config.scoring.rewards if is_user_attribute(name)]
    names += [name for name in (config.episode.env, config.episode.agent, *config.episode.tools) if is_user_attribute(name)]
    for name in names:
        problem = _not_shipped(name.split(":")[0], BUNDLE_ROOT if from_source_checkout() else None)
        if problem:
            raise UserError(f"{name!r}: {problem}")


# The most bytes one metrics row (types.MetricsRow) takes as a Flyte literal, every field filled,
# not counting its per-reward entries; and each reward name's entries (a mean in training and in
# the held-out evaluation). tests/unit/launch/test_submit.py fills every field to check the bound.
HISTORY_ROW_BYTES = 3072
HISTORY_ROW_BYTES_PER_REWARD = 160


def check_history_inline(config: RunConfig) -> None:
    """A sweep's config returns its whole metrics history (`RunResult.history`) to the sweep task
    through the remote controller, which refuses a value past Flyte's inline limit: refuse, before
    submitting, a sweep whose history could pass it (a run of tens of thousands of iterations)."""
    row = HISTORY_ROW_BYTES + HISTORY_ROW_BYTES_PER_REWARD * len(config.scoring.rewards)
    most = FLYTE_INLINE_LIMIT_BYTES // row - 1  # iteration 0's row is the evaluation before training
    if config.iterations > most:
        raise UserError(
            f"--iterations {config.iterations} in a cluster sweep: each config returns its metrics history inline, "
            f"up to {row} bytes an iteration, and Flyte's inline limit is {FLYTE_INLINE_LIMIT_BYTES // 2**20} MiB; "
            f"expected at most {most} iterations (or run the configs as separate runs)"
        )


def _not_shipped(module: str, bundle_root: Path | None) -> str | None:
    """Why `module` would not import in a pod (None when it would): only files under the bundle
    root travel with a run (none for an installed wheel), and the task image holds grpo_flyte's
    own dependencies, not the modules of this machine."""
    spec = importlib.util.find_spec(module)  # it imported in check_inputs, so it is found
    origin = Path(spec.origin).resolve() if spec and spec.origin else None
    if origin is not None and bundle_root is not None and origin.is_relative_to(bundle_root):
        return None
    where = f"{str(origin)!r}" if origin else "this machine"
    if bundle_root is None:
        return (
            f"module {module!r} is at {where}, which a run submitted from an installed grpo_flyte does not ship (the code is "
            "the image's); submit from a source checkout with the module under its src/, or add it to the task image"
        )
    return (
        f"module {module!r} is at {where}, outside the code bundle (only modules under {str(bundle_root)!r} travel with a "
        f"run): move it there, e.g. {str(bundle_root / (module.replace('.', '/') + '.py'))!r}"
    )


def code_version() -> str:
    """What names the code of a run submitted from an installed wheel (no bundle to hash): the
    package version and a hash of its modules, so that changed code gets a new version."""
    package = PACKAGE_DIR
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return f"{importlib.metadata.version('grpo-flyte')}-{digest.hexdigest()[:12]}"


def import_whole_package() -> None:
    """Import every module of grpo_flyte in this process. A checkout's code bundle holds the modules
    the submitting process loaded (flyte's `loaded_modules`), and the tasks import some of theirs
    only when they run on a pod (the engine's decode loop, the trainer's data-parallel step): those
    would be missing from the bundle. Importing them loads no torch (tests/repo/test_layers.py)."""
    for info in pkgutil.walk_packages(grpo_flyte.__path__, "grpo_flyte."):
        importlib.import_module(info.name)


def run_context_options(custom_context: dict[str, str] | None = None, env_vars: dict[str, str] | None = None) -> dict[str, Any]:
    """`flyte.with_runcontext` options of a submission: a checkout's code travels in the code
    bundle; an installed wheel is in the image already (envs._with_package), and bundling
    site-packages would ship every loaded library, so it names its code with `code_version`.
    `env_vars`: the run's tasks' environment (the trackers' settings, `preflight.tracking_env`)."""
    from grpo_flyte.envs import from_source_checkout

    shared = {"custom_context": custom_context, **({"env_vars": env_vars} if env_vars else {})}
    if from_source_checkout():
        import_whole_package()
        return {"copy_style": "loaded_modules", **shared}
    return {"copy_style": "none", "version": code_version(), **shared}


def require_cluster() -> None:
    """Stop unless a Flyte cluster is configured: without an endpoint, flyte.run would quietly run
    the whole loop on this machine instead of submitting it."""
    import flyte.config

    if not flyte.config.auto().platform.endpoint:
        raise UserError(
            "no Flyte cluster is configured (no admin endpoint in ./.flyte/config.yaml, ~/.flyte/config.yaml, "
            "~/.union/config.yaml, $FLYTECTL_CONFIG or $UCTL_CONFIG); create one with "
            "'flyte create config --endpoint <your-cluster> --project <p> --domain <d>', or add --local to run on this machine"
        )


def examples_inputs(examples: list[Example] | None, staging: Path, upload: Callable[[str, str], Any]) -> dict[str, Any]:
    """A file dataset's rows as driver inputs: inline, or, past Flyte's inline limit, a folder
    written under `staging` and given to `upload(local folder, content hash)`. Outside a task
    `Dir.from_local_sync` uploads when the run is submitted: `staging` must outlive that."""
    text = payload_text(examples) if examples else None
    if text is None:
        return {"examples": examples}
    folder = staging / "examples"
    folder.mkdir()
    write_payload(folder, text)
    return {"examples": [], "examples_file": [upload(str(folder), payload_key(text))]}


def _connect(custom_context: dict[str, str] | None = None, env_vars: dict[str, str] | None = None):
    """flyte.init for this package's code; returns the run context to submit with."""
    import flyte

    require_cluster()
    flyte.init_from_config(root_dir=BUNDLE_ROOT)
    return flyte.with_runcontext(**run_context_options(custom_context, env_vars))


def wandb_submission(project: str | None, sweep: bool = False) -> tuple[dict[str, str], tuple[Any, ...]]:
    """For W&B on a cluster (--wandb-project, or --report-to wandb): the run context naming a new W&B run, and the W&B link
    (flyteplugins-wandb) for the driver task's page in the Flyte UI; ({}, ()) without W&B. A `sweep`'s id names the W&B
    group its configs' runs go to (each config's own run: `sweep.train_sweep`), and its link opens the group.

    The run is chosen here, before submitting, because the link is made when the task is
    submitted; the driver then logs to the run the context names. The link needs the W&B entity
    (user or team), from WANDB_ENTITY; wandb itself picks the key's default entity without it,
    which the link cannot know."""
    from grpo_flyte.reporting.tracking import WandbGroupLink, WandbRun, new_run_id

    if not project:
        return {}, ()
    run_id = new_run_id()
    chosen = WandbRun(project=project, id=run_id, entity=os.environ.get("WANDB_ENTITY") or None, group=run_id if sweep else None)
    what = "group" if sweep else "run"
    if chosen.entity is None:
        logger.warning(
            "W&B: set WANDB_ENTITY (your W&B user or team) for the Flyte UI's W&B link to open %s %s; without it, it opens wandb.ai",
            what,
            chosen.id,
        )
    where = "the sweep task (a run per config, each linked from its driver task)" if sweep else "the driver task"
    logger.info("W&B %s %s in project %s, linked from %s in the Flyte UI", what, chosen.id, project, where)
    return chosen.context(), (WandbGroupLink() if sweep else WandbRun.link(),)


def check_models_here(configs: list[tuple[RunConfig, tuple[list[Example], list[Example]] | None]]) -> None:
    """The checks a local run makes of its base model, judge and reward models, made before
    submitting for each (config, split): a Hub model's from its config and tokenizer files alone
    (`preflight.model_to_check`; skipped, in one line, when the Hub cannot be read from here)."""
    folders: dict[tuple[str, str], tuple[Path, bool] | None] = {}

    def folder(model: str, field: str) -> tuple[Path, bool] | None:
        if (model, field) not in folders:  # a sweep's configs share their models: fetched, or said unreachable, once
            folders[model, field] = model_to_check(model, field)
        return folders[model, field]

    for config, split in configs:
        if found := folder(config.base.model, "model"):
            check_model_fits(config, found[0], split, weights=found[1])
        if config.judging and (found := folder(config.judge.judge_model, "judge_model")):
            check_judge_fits(config, found[0], split, weights=found[1])
        reward_model_dirs(config, fetch=False)  # a reward naming neither a folder nor a Hub id: its own line
        for name in config.scoring.model_rewards:
            if found := folder(reward_model_ref(name)[0], "rewards"):
                check_reward_model_fits(config, name, found[0], split, weights=found[1])


def run_remote(config: RunConfig, sweep: list[SweepMember] | None = None) -> int:
    """Submit `train_rl` for `config`, or with a `sweep` (`sweep_grid.expand_sweep`), `train_sweep`
    for its configs (which share the data and the judge: the grid refuses keys that change them,
    but the dataset, whose rows each config must then check; each base model is uploaded or
    prefetched once, a folder for every config of it)."""
    from flyte.io import Dir

    from grpo_flyte.driver import train_rl
    from grpo_flyte.sweep import train_sweep

    configs = [m.config for m in sweep] if sweep else [config]
    checked = [check_inputs(c, local=False) for c in configs]
    if sweep and len({repr(examples) for examples, _ in checked}) > 1:
        raise UserError("--sweep dataset=...: a cluster sweep sends one dataset to its configs; expected one sweep per dataset")
    examples = checked[0][0]
    for c in configs:
        check_submission(c)
        if sweep:
            check_history_inline(c)
    check_models_here([(c, c_split) for c, (_, c_split) in zip(configs, checked, strict=True)])
    wandb = "wandb" in config.trackers
    context, links = wandb_submission(wandb_project_of(config.wandb_project, config.tracking_project) if wandb else None, bool(sweep))
    runner = _connect(context, {name: value for c in configs for name, value in tracking_env(c).items()})
    base_models = {model: resolve_remote_model(model) for model in dict.fromkeys(c.base.model for c in configs)}
    judging = configs[0].judging
    inputs_judge = {"judge_model": resolve_remote_model(configs[0].judge.judge_model, field="judge_model")} if judging else {}
    # every config's reward models, one folder each (a sweep's configs share them as they share the judge)
    named = dict.fromkeys(reward_model_ref(name)[0] for c in configs for name in c.scoring.model_rewards)
    if named:
        inputs_judge["reward_models"] = {model: resolve_remote_model(model, field="rewards") for model in named}
    # the link is shown on the submitted task only: the driver's pod runs train_rl as declared
    task = train_sweep if sweep else train_rl
    task = task.override(links=links) if links else task
    what = {"members": sweep, "base_models": base_models} if sweep else {"config": config, "base_model": base_models[config.base.model]}
    with tempfile.TemporaryDirectory() as staging:  # uploaded by runner.run, so kept until it returns
        inputs = examples_inputs(examples, Path(staging), lambda folder, key: Dir.from_local_sync(folder, dir_cache_key=key))
        run = runner.run(task, **what, **inputs, **inputs_judge)
    print(run.url)
    return 0


def resume_remote(run_name: str) -> int:
    """Rerun a cluster run with recovery. The driver starts again from the same inputs; every task
    it submits gets the action name it had in the first run (names hash the inputs, and payload
    folders carry a content hash), so each finished generate, score and train step is reused and
    the loop is back where it stopped after a replay of its decisions."""
    runner = _connect()
    try:
        run = runner.rerun(run_name, recover=True)
    except NotImplementedError as exc:
        raise UserError(f"--resume-run {run_name!r}: this cluster cannot recover runs ({exc}); start a new run") from None
    except Exception as exc:  # noqa: BLE001 (a run not found, no access, ...: one line naming the run)
        raise UserError(f"--resume-run {run_name!r}: {type(exc).__name__}: {exc}") from None
    print(run.url)
    return 0
