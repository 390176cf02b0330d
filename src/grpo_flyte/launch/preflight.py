"""Checks before start: everything a run's config asks of its data, rewards, environment, packages
and models (the base, the judge and the reward models), checked on the submitting machine before any task starts (a
user's error is never a failed, retried task). Used by local and cluster runs alike.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

from grpo_flyte.config.constants import ARITHMETIC_DATASET, GSM8K_DATASET
from grpo_flyte.config.episode import context_length
from grpo_flyte.config.generation import PromptConfig
from grpo_flyte.config.run import RunConfig
from grpo_flyte.data import is_file_dataset, load_rows, train_eval_split
from grpo_flyte.errors import ConfigError, GrpoFlyteError, UserError, flag, given
from grpo_flyte.multiturn import BUILTIN_DATASETS, NO_ENV, load_environment
from grpo_flyte.reporting.tracking import PACKAGES, missing_package
from grpo_flyte.reward_fns import resolve_reward, reward_model_ref
from grpo_flyte.tools.functions import load_tools
from grpo_flyte.types import Example

logger = logging.getLogger("grpo_flyte")


def check_inputs(config: RunConfig, local: bool) -> tuple[list[Example] | None, tuple[list[Example], list[Example]] | None]:
    """Check the dataset and the rewards before any work starts; returns a file dataset's rows and
    the (training, held-out) split when it was made here.

    Every row must have a usable answer (when the 'correct' reward is weighted) and --eval-size must
    fit. The rows of a file or a local dataset folder travel to the driver as an input; 'gsm8k' and
    Hub ids are loaded where the driver runs (here too, in a local run, to check them first). Custom
    rewards must import, and each tracker its package (`check_trackers`).
    """
    examples = split = None
    data = config.data
    if data.dataset not in (ARITHMETIC_DATASET, GSM8K_DATASET, *BUILTIN_DATASETS) and (
        is_file_dataset(data.dataset) or Path(data.dataset).exists() or local
    ):
        examples = load_rows(config)
    if examples is not None or local:
        split = train_eval_split(config, examples)
    for name in config.scoring.function_rewards:  # the judge and the reward models are models, checked with the base model
        resolve_reward(name)
    if config.guard.select_by == "eval_accuracy" and split is not None:
        unanswered = sum(not ex.answer.strip() for ex in split[1])
        if unanswered:
            raise UserError(
                f"--select-by eval_accuracy: {unanswered} of the {len(split[1])} held-out questions have no gold answer, so "
                "their accuracy is not measured; expected --select-by eval_reward (or auto), or answers in --answer-column"
            )
    if config.episode.tools:
        load_tools(config.episode.tools)  # each imports and has a schema
        check_tool_prompts(config, split)
    elif config.episode.env != NO_ENV:
        load_environment(config.episode.env)
    if config.episode.agent != NO_ENV:
        from grpo_flyte.engine.agents import load_agent

        load_agent(config.episode.agent)
    check_trackers(config, local)
    if config.lora.load_in_4bit and local:
        check_bitsandbytes()
    return examples, split


def check_tool_prompts(config: RunConfig, split: tuple[list[Example], list[Example]] | None) -> None:
    """--tools shows the tools through the chat template: every prompt must be chat messages."""
    from grpo_flyte.engine.prompts import is_chat

    plain = [ex for part in split or () for ex in part if not is_chat(ex, config.prompt)]
    if plain or (split is None and config.prompt.prompt_format == "plain"):
        raise ConfigError(
            f"{config.prompt.prompt_format!r} with --tools: the chat template shows the model its tools, and "
            f"{len(plain) or 'the'} prompts are plain text; expected --prompt-format chat (or rows whose prompt is chat messages)",
            field="prompt_format",
        )


# Where a cluster driver's trackers send their runs (read where you submit, given to the driver):
# a pod's own files are lost with it.
CLUSTER_TRACKING_ENV = {"mlflow": ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"), "trackio": ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL")}


def check_trackers(config: RunConfig, local: bool) -> None:
    """Every tracker the run logs to (`RunConfig.trackers`) must import here; on a cluster, each must
    log somewhere that outlives the driver's pod: W&B (its link needs flyteplugins-wandb), MLflow to
    a tracking server, trackio to a Space or a server; TensorBoard's files are local, so refused."""
    for name in config.trackers:
        if not _installed(PACKAGES[name][0]):
            where = f"--wandb-project {config.wandb_project!r}" if name == "wandb" and name not in config.report_to else "--report-to"
            raise UserError(f"{where} {missing_package(name)}")
    if local:
        return
    if "wandb" in config.trackers and not _installed("flyteplugins.wandb"):
        where = f"--wandb-project {config.wandb_project!r}" if config.wandb_project else "--report-to wandb"
        raise UserError(
            f"{where} on a cluster needs flyteplugins-wandb (the run's W&B link in the Flyte UI): pip install 'grpo-flyte[wandb]'"
        )
    if "tensorboard" in config.report_to:
        raise UserError(
            "--report-to tensorboard writes event files under the local run folder, which a cluster driver does not have "
            "(its pod's files are lost); expected a local run, or --report-to wandb, mlflow (a tracking server) or trackio (a Space)"
        )
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if "mlflow" in config.report_to and not uri.startswith(("http://", "https://", "databricks")):
        raise UserError(
            f"--report-to mlflow on a cluster needs MLFLOW_TRACKING_URI set here to a tracking server (http(s)://... or "
            f"databricks), given to the driver; got {uri or 'none'}: a store in the driver's pod is lost with it"
        )
    if "trackio" in config.report_to and not (os.environ.get("TRACKIO_SPACE_ID") or os.environ.get("TRACKIO_SERVER_URL")):
        raise UserError(
            "--report-to trackio on a cluster needs TRACKIO_SPACE_ID (a Hugging Face Space; the driver's HF token writes to it) "
            "or TRACKIO_SERVER_URL set here, given to the driver: a local trackio database in the driver's pod is lost with it"
        )


def tracking_env(config: RunConfig) -> dict[str, str]:
    """The tracker settings (CLUSTER_TRACKING_ENV) a cluster driver gets from where you submit."""
    names = [name for tracker in config.report_to for name in CLUSTER_TRACKING_ENV.get(tracker, ())]
    return {name: os.environ[name] for name in names if os.environ.get(name)}


def check_bitsandbytes() -> None:
    """--load-in-4bit loads the train pool's base with bitsandbytes: it must import here (a local
    run trains here; the cluster's image installs it)."""
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:  # noqa: BLE001 -- missing, or installed but broken (a wrong CUDA build): either way unusable
        raise UserError(
            f"--load-in-4bit needs bitsandbytes, which does not import here ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}): "
            "pip install 'grpo-flyte[local]'"
        ) from None


def _installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it (a missing parent package too)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def check_model_fits(config: RunConfig, model_dir: Path, split: tuple[list[Example], list[Example]] | None, weights: bool = True) -> None:
    """What the config asks of the model, checked before any task starts: a usable folder (its
    weights, where `weights` says it holds them: a Hub repo's check files do not, `model_to_check`;
    a tokenizer that loads), the LoRA target layers, a context (`context_length`: the prompt and a completion,
    or a whole episode) within the model's window (`context_window`, as vLLM reads it; the
    transformers engine would run past it) and, when the rows are known here, every prompt's
    length in the model's tokens; with export_gguf, a local model's architecture and tokenizer the
    GGUF writer takes (`gguf_writer.check_model`). Errors name a Hub model by its id."""
    from grpo_flyte.models.folders import check_model_folder, context_problem, is_repo_id, lora_target_problem

    tokenizer = check_model_folder(model_dir, field="model", weights=weights)
    shown = config.base.model if is_repo_id(config.base.model) else None
    problem = lora_target_problem(model_dir, tuple(config.lora.lora_target_modules), shown)
    if problem:
        raise ConfigError(problem, field="lora_target_modules")
    tokens = context_length(config.prompt, config.sampling, config.episode)
    problem = context_problem(model_dir, tokens)
    if problem:
        what = "max_episode_tokens" if config.episode.multi_turn else "max_new_tokens"
        parts = f"{given('max_prompt_tokens', config.prompt.max_prompt_tokens)} + {given(what, tokens - config.prompt.max_prompt_tokens)}"
        raise ConfigError(f"{parts}: {problem}", field=None)
    prompt = config.prompt
    if config.episode.tools:  # the template's tool-call format is one we read; prompts are measured with the tools shown
        from grpo_flyte.engine.tool_episodes import tool_prompt_config

        prompt = tool_prompt_config(tokenizer, config.prompt, config.episode.tools)
    if split is not None:
        check_prompt_lengths(config, tokenizer, [*split[0], *split[1]], prompt)
    if config.export_gguf and weights:  # a local model: what the GGUF writer refuses, refused before the run
        from grpo_flyte.models.gguf_writer import check_model

        try:
            check_model(model_dir)
        except UserError as exc:
            raise ConfigError(f"{given('export_gguf', config.export_gguf)}: {exc}", field=None) from None


def check_judge_fits(config: RunConfig, judge_dir: Path, split: tuple[list[Example], list[Example]] | None, weights: bool = True) -> None:
    """What the config asks of the judge model, checked as the base model is: a usable folder, and
    a judge prompt (its instructions, the rubric and the longest training question; no question
    when the rows are not known here) that leaves room in judge_context_tokens for one whole
    completion (a group then fits in as many judge calls as it needs)."""
    from grpo_flyte.models.folders import check_model_folder
    from grpo_flyte.scoring.judging import completion_room, fixed_tokens, token_count

    tokenizer = check_model_folder(judge_dir, field="judge_model", weights=weights)
    questions = [e.question for e in split[0]] if split is not None else []  # the held-out evaluation is not judged
    lengths = [len(ids) for ids in tokenizer(questions, add_special_tokens=False)["input_ids"]] if questions else [0]
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    judging = config.judge
    fixed = fixed_tokens(tokenizer, judging.judge_rubric, questions[longest] if questions else "")
    room = completion_room(fixed, judging.judge_context_tokens)
    name = "max_episode_tokens" if config.episode.multi_turn else "max_new_tokens"
    completion = getattr(config.episode if config.episode.multi_turn else config.sampling, name)
    if room < completion:
        raise ConfigError(
            f"of {token_count(tokenizer, judging.judge_rubric)} tokens, with the judge's instructions and the longest question "
            f"({lengths[longest]} tokens), leaves {room} of {given('judge_context_tokens', judging.judge_context_tokens)} for a "
            f"completion; expected room for a whole one ({given(name, completion)}): a shorter rubric, or "
            f"{flag('judge_context_tokens')} {judging.judge_context_tokens - room + completion} or more",
            field="judge_rubric",
        )


def reward_model_dirs(config: RunConfig, fetch: bool = True) -> dict[str, Path]:
    """The folder of each reward model the rewards name (by the model: a Hub id or a folder, without
    '@label'): a local folder, or a Hub id fetched into the Hugging Face cache (`fetch`; without
    it, a Hub id is left out: a cluster's pod fetches it). A missing folder or a Hub id that cannot
    be fetched (no network, no such repo) is one line naming the reward."""
    from grpo_flyte.errors import ModelError
    from grpo_flyte.models.folders import is_repo_id, resolve_local_model

    dirs: dict[str, Path] = {}
    for name in config.scoring.model_rewards:
        model, _ = reward_model_ref(name)
        if model in dirs:
            continue
        if Path(model).expanduser().is_dir() or (fetch and is_repo_id(model)):
            try:
                dirs[model] = resolve_local_model(model, field="rewards")
            except ModelError as exc:
                raise ModelError(f"{name!r}: {exc.detail.removeprefix(repr(model) + ': ')}", field="rewards") from None
        elif not is_repo_id(model):
            raise ModelError(f"{name!r}: no such folder; expected a reward model's folder or a Hub id 'org/name'", field="rewards")
    return dirs


def model_to_check(model: str, field: str) -> tuple[Path, bool] | None:
    """The folder the checks before a cluster run read for `model` (the base, the judge's or a
    reward model: `field`), and whether it holds the weights: a local folder or the embedded model,
    whole; a Hub repo, its config and tokenizer files alone (`folders.hub_check_files`: no
    weights, which the cluster fetches). None when the Hub cannot be read from here (no network,
    a gated or private repo without HF_TOKEN here, no such repo): said in one line, and the checks
    are left to the cluster, whose prefetch reads the Hub with the cluster's token."""
    from grpo_flyte.models.folders import hub_check_files, is_repo_id, resolve_local_model

    if not is_repo_id(model):
        return resolve_local_model(model, field=field), True
    try:
        return hub_check_files(model, field=field), False
    except GrpoFlyteError:
        raise
    except Exception as exc:  # noqa: BLE001 -- no network, no access, no such repo alike: one line, then on
        cause = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        logger.warning(
            "%s %r: the Hugging Face Hub cannot be read from here (%s); its checks are left to the cluster, which fetches it",
            flag(field),
            model,
            cause,
        )
        return None


# A token covers at least one byte of the text it was cut from; the slack covers tokens added
# outside the text (as engine.prompts' bound does).
_TOKEN_SLACK = 4


def check_reward_model_fits(
    config: RunConfig, name: str, model_dir: Path, split: tuple[list[Example], list[Example]] | None, weights: bool = True
) -> None:
    """What reward `name` asks of its model folder, before any task starts: a sequence-classification
    model with one output or a label picked, its weights and tokenizer, and, when the rows are
    known here, a context that holds the longest training prompt as the reward model reads it with
    a whole completion (max_new_tokens; multi-turn: max_episode_tokens) after it (the held-out
    evaluation is not scored by it). A prompt is tokenized only when its size in bytes could
    reach the context (no token is shorter than a byte). One line naming the reward, or none."""
    from grpo_flyte.engine.prompts import prompt_messages
    from grpo_flyte.models.folders import check_model_folder
    from grpo_flyte.models.reward_model import model_context, reward_model_problem, token_ids

    _, label = reward_model_ref(name)
    problem = reward_model_problem(model_dir, label)
    if problem:
        raise ConfigError(f"{name!r}: {problem}", field="rewards")
    tokenizer = check_model_folder(model_dir, field="rewards", weights=weights)
    context = model_context(model_dir, tokenizer)
    if context is None or split is None or not split[0]:
        return
    multi = config.episode.multi_turn
    what = "max_episode_tokens" if multi else "max_new_tokens"
    completion = config.episode.max_episode_tokens if multi else config.sampling.max_new_tokens

    def conversation(example: Example, text: str) -> list[dict[str, str]]:
        return [*prompt_messages(example, config.prompt), {"role": "assistant", "content": text}]

    frame = len(token_ids(tokenizer, conversation(Example(question="", answer=""), "")))
    longest, question = 0, ""
    for example in split[0]:
        size = sum(len(m["content"].encode()) for m in prompt_messages(example, config.prompt))
        if frame + size + _TOKEN_SLACK + completion <= context:  # fits whatever its tokens
            continue
        length = len(token_ids(tokenizer, conversation(example, "")))
        if length > longest:
            longest, question = length, example.question
    if longest + completion > context:
        raise ConfigError(
            f"{name!r}: its context is {context} tokens; expected room for the longest prompt as it reads it ({longest} tokens: "
            f"{question[:60]!r}) and a whole completion ({given(what, completion)}): {longest + completion} tokens",
            field="rewards",
        )


def check_prompt_lengths(config: RunConfig, tokenizer, rows: list[Example], prompt: PromptConfig | None = None) -> None:
    """Every prompt within max_prompt_tokens, rendered with `prompt` (default: the config's)."""
    from grpo_flyte.engine.prompts import overlong_prompts

    limit = config.prompt.max_prompt_tokens
    over = overlong_prompts(tokenizer, rows, prompt or config.prompt)
    if not over:
        return
    longest = max(over, key=over.__getitem__)
    what = f"{len(over)} of {len(rows)} prompts are longer than {limit} tokens (the longest, {over[longest]} tokens: {rows[longest].question[:60]!r})"
    if config.prompt.overlong_prompts == "truncate":
        logger.warning("%s; each keeps its last %d tokens (--overlong-prompts truncate)", what, limit)
        return
    raise ConfigError(f"{limit}: {what}; expected at most {limit}: raise it, or add --overlong-prompts truncate", field="max_prompt_tokens")
