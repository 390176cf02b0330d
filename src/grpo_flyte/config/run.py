"""This module defines the one config object that describes a GRPO run, `RunConfig` (the loop's own
settings and one part per concern), and the flat index of every option.

`RunConfig` is composed of one part per concern (base model, engine, data, prompt, sampling,
scoring, LoRA, training, evaluation, the guard) plus the loop's own settings. Each task takes only the parts
it uses, so changing an unrelated field changes none of its inputs (nor its Flyte cache key).

Every leaf field has a name unique across the parts, and that name is its flag and its key in a
flat config file: `RunConfig(group_size=4)`, `--group-size 4` and `group_size: 4` in YAML all set
`config.sampling.group_size`. A nested file (`sampling: {group_size: 4}`) works too. The fields'
descriptions are the single home of the help text: `--help` and the table in docs/configuration.md come from them.

The parts are in `config.generation` and `config.training`, their shared names and limits in
`config.constants`. Beside them: TRL's names (`config.trl_names`), the defaults that depend on other
options (`config.defaults`), config files (`config.files`), the error text and `make_config`
(`config.errors`), and the table of options (`config.table`).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic.fields import FieldInfo

from grpo_flyte.config.constants import LIST_PRICES, MAX_STALENESS, TRACKERS, GGUFQuant
from grpo_flyte.config.defaults import env_defaults, staleness_defaults
from grpo_flyte.config.episode import EpisodeConfig
from grpo_flyte.config.generation import DataConfig, EngineConfig, JudgeConfig, ModelConfig, PromptConfig, RewardConfig, SamplingConfig
from grpo_flyte.config.part import Part
from grpo_flyte.config.training import EvalConfig, GuardConfig, LoraConfig, TrainConfig
from grpo_flyte.config.trl_names import from_trl_names
from grpo_flyte.errors import flag, given
from grpo_flyte.reward_fns import JUDGE_REWARD


class RunConfig(Part):
    """Everything that determines what a run computes."""

    iterations: int = Field(
        10,
        ge=1,
        le=100_000,
        description="GRPO iterations: generate, score and train (updates_per_iter x num_iterations optimizer steps) each.",
    )
    prompts_per_iter: int = Field(8, ge=1, le=4096, description="Prompts sampled per iteration; one generate task each.")
    min_informative_groups: int = Field(
        4,
        ge=0,
        le=4096,
        description=(
            "Top the batch up with fresh prompts until it has this many groups whose rewards differ (0: off); see --max-topup-rounds."
        ),
    )
    max_topup_rounds: int = Field(2, ge=0, le=100, description="Extra generate rounds at most per iteration for the top-up.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed for prompt sampling, generation and adapter init.")
    export_merged: bool = Field(
        False,
        description=(
            "After the last iteration, merge the adapter export_adapter names (the best one by default) into the base "
            "and save a full model folder (a local run: <run-dir>/merged) that transformers and vLLM load without PEFT, "
            "kept only if its greedy held-out answers agree with the adapter's (its export.json: docs/exporting.md)."
        ),
    )
    export_gguf: GGUFQuant | None = Field(
        None,
        description=(
            "After the last iteration, also write the merged adapter (export_adapter's) as one GGUF file in this tensor "
            "type (llama.cpp, Ollama; a local run: <run-dir>/gguf-<type>/model-<type>.gguf), kept only if transformers' "
            "GGUF loader reading it answers the held-out questions as the adapter does (its export.json: docs/exporting.md). "
            "LLaMA and Qwen2 models with a byte-level BPE tokenizer."
        ),
    )
    push_to_hub: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][\w.-]*/[\w.-]+$",
        description=(
            "After the last iteration, upload the adapter export_adapter names (the best one by default; the merged "
            "model with export_merged) to this Hugging Face repo, 'user/name' (created private if missing), with a model "
            "card naming the base, data, rewards and its held-out figures; only a form whose held-out check against the adapter "
            "passed, the check's figures in the card. Needs HF_TOKEN (on a cluster: the hf_token secret)."
        ),
    )
    wandb_project: str | None = Field(
        None,
        description=(
            "Also log each iteration's metrics to this Weights & Biases project (needs the wandb extra; WANDB_MODE=offline "
            "works); implies report_to wandb."
        ),
    )
    report_to: tuple[str, ...] = Field(
        (),
        description=(
            "Experiment trackers that get every metrics row (TRL's name): a comma-separated list of wandb, trackio, mlflow, "
            "tensorboard, or none. Each needs its extra (pip install 'grpo-flyte[mlflow]'); docs/metrics.md#trackers."
        ),
    )
    tracking_project: str = Field(
        "grpo_flyte",
        min_length=1,
        description=(
            "The trackio project and the MLflow experiment (MLFLOW_EXPERIMENT_NAME wins) the run logs to; also the W&B "
            "project under report_to wandb when neither wandb_project nor WANDB_PROJECT is set."
        ),
    )
    log_completions: bool = Field(
        False,
        description=(
            "Keep a sample of each iteration's completions with their question, reward and advantage (TRL's name): "
            "<run-dir>/completions/iter-NNNN.jsonl, the report, and a table in W&B, trackio and MLflow."
        ),
    )
    num_completions_to_log: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description=(
            "How many completions log_completions keeps per iteration: the first groups' completions, in prompt order "
            "(TRL: num_completions_to_print). Default: all of them."
        ),
    )
    log_unique_prompts: bool = Field(
        False, description="log_completions keeps one completion per prompt (each group's first), not the whole group (TRL's name)."
    )
    adapters_to_keep: int = Field(
        3,
        ge=1,
        le=1000,
        description="Adapter versions kept on disk in a local run (the newest ones); older are pruned. At least max_staleness + 1.",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        le=MAX_STALENESS,
        description=(
            "Generate ahead while the trainer trains (TRL's name): iteration i's prompts are generated by the adapter "
            "max_staleness versions older than the one it trains, so generation and training overlap. 0: the synchronous loop."
        ),
    )
    sweep_prune: bool = Field(
        False,
        description=(
            "A local sweep stops the configs that fall behind: at each held-out evaluation after training, a config whose "
            "held-out metric (--select-by) is below the leading config's by more than the paired 99% interval over the same "
            "questions (the guard's test) stops there, keeping its best adapter and folder; the others go on, faster. "
            "A sweep of one config never prunes, nor does a config's last evaluation. See docs/configuration.md#sweeps."
        ),
    )
    prices: dict[str, float] = Field(
        default_factory=lambda: dict(LIST_PRICES),
        description=(
            "Dollars per hour of one accelerator, by type (the GPU name of the GRPO_FLYTE_*_GPU settings), e.g. "
            "L4=0.70,H100=4.00: a cluster run's accelerator-hours per pool in dollars, in metrics.jsonl and the report. "
            "Out of the box: AWS on-demand list prices, not all verified (docs/cluster.md#what-a-run-costs); give your "
            "provider's or Union's rates; a type not given keeps its list price."
        ),
    )
    base: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    prompt: PromptConfig = Field(default_factory=PromptConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    scoring: RewardConfig = Field(default_factory=RewardConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    evaluation: EvalConfig = Field(default_factory=EvalConfig)
    episode: EpisodeConfig = Field(default_factory=EpisodeConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)

    @model_validator(mode="before")
    @classmethod
    def _nest_flat_fields(cls, data: Any) -> Any:
        """Move flat leaf names (`group_size=4`) into their part; a flat name wins over a nested one."""
        if not isinstance(data, dict):
            return data
        out = from_trl_names(data)
        for name, (part, _) in leaf_index().items():
            if part is not None and name in out:
                nested = out.get(part, {})
                nested = nested.model_dump() if isinstance(nested, BaseModel) else dict(nested or {})
                nested[name] = out.pop(name)
                out[part] = nested
        return staleness_defaults(env_defaults(out))

    @field_validator("report_to", mode="before")
    @classmethod
    def _known_trackers(cls, value: Any) -> Any:
        """A comma-separated string or a list of tracker names; 'none' alone is no tracker."""
        if isinstance(value, str):
            value = value.split(",")
        if not isinstance(value, (list, tuple)):
            return value  # pydantic's own type error
        names = [str(name).strip() for name in value if str(name).strip()]
        if names == ["none"]:
            return ()
        for name in names:
            if name not in TRACKERS:
                why = " (TRL's 'all', every installed tracker, would change with the environment: name them)" if name == "all" else ""
                raise ValueError(f"{name!r}{why}; expected a comma-separated list of {', '.join(TRACKERS)}, or none")
        return tuple(dict.fromkeys(names))

    @field_validator("prices")
    @classmethod
    def _priced(cls, prices: dict[str, float]) -> dict[str, float]:
        if not prices:
            raise ValueError("no prices; expected at least one TYPE=DOLLARS_PER_HOUR, e.g. L4=0.80 (leave it out for the list prices)")
        for name, dollars in prices.items():
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise ValueError(
                    f"accelerator type {name!r}; expected a GPU name as GRPO_FLYTE_*_GPU gives it without the count, e.g. L4=0.80"
                )
            if not (math.isfinite(dollars) and dollars >= 0):
                raise ValueError(f"price {dollars} of {name!r}; expected dollars per hour, a finite number >= 0")
        return prices

    @model_validator(mode="after")
    def _room_for_stale_adapters(self) -> RunConfig:
        """A pipelined run reads adapters up to max_staleness versions old: the run folder and the
        generate replicas must keep them."""
        k = self.max_staleness
        if self.adapters_to_keep < k + 1:
            raise ValueError(
                f"{given('adapters_to_keep', self.adapters_to_keep)} with {given('max_staleness', k)}: expected at least {k + 1}"
            )
        if self.engine.adapter_cache_size < k + 2:
            raise ValueError(
                f"{given('adapter_cache_size', self.engine.adapter_cache_size)} with {given('max_staleness', k)}: expected at least {k + 2}"
            )
        return self

    @model_validator(mode="after")
    def _a_share_for_every_process(self) -> RunConfig:
        """Every train process forwards a share of each optimizer step's rollouts: more processes
        than rollouts per step would leave some with nothing to do."""
        if self.train.train_processes > self.rollouts_per_step:
            raise ValueError(
                f"{given('train_processes', self.train.train_processes)} with {self.rollouts_per_step_given()}: "
                f"expected at most {self.rollouts_per_step}"
            )
        return self

    @model_validator(mode="after")
    def _entropy_mask_without_dropout(self) -> RunConfig:
        """The entropy threshold is taken in a pass before each optimizer step: with dropout, the
        step's own forward would draw other masks, so the tokens kept would not be those counted."""
        if self.train.top_entropy_quantile < 1.0 and self.lora.lora_dropout > 0.0:
            raise ValueError(
                f"{given('top_entropy_quantile', self.train.top_entropy_quantile)} with {given('lora_dropout', self.lora.lora_dropout)}: "
                "the entropy threshold is measured before each optimizer step, and dropout would draw other masks in the step; "
                "expected --lora-dropout 0"
            )
        return self

    @model_validator(mode="after")
    def _patience_needs_evaluations(self) -> RunConfig:
        if self.guard.early_stop_patience and not self.evaluation.eval_size:
            raise ValueError(
                f"{given('early_stop_patience', self.guard.early_stop_patience)} with {given('eval_size', 0)}: "
                "patience counts held-out evaluations; expected --eval-size above 0, or --early-stop-patience 0"
            )
        return self

    @model_validator(mode="after")
    def _exports_need_a_held_out_set(self) -> RunConfig:
        asked = [name for name in ("export_merged", "export_gguf", "push_to_hub") if getattr(self, name)]
        if asked and not self.evaluation.eval_size:
            raise ValueError(
                f"{given(asked[0], getattr(self, asked[0]))} with {given('eval_size', 0)}: an export is checked on the held-out "
                f"set before it is kept or pushed; expected --eval-size above 0"
            )
        return self

    @model_validator(mode="after")
    def _judge_has_a_model(self) -> RunConfig:
        if JUDGE_REWARD in self.scoring.rewards and self.judge.judge_model is None:
            raise ValueError(
                f"{flag('rewards')} names '{JUDGE_REWARD}' but {flag('judge_model')} is not set; expected {flag('judge_model')} "
                "embedded, a local model directory or a Hugging Face repo id"
            )
        return self

    @property
    def judging(self) -> bool:
        """Whether the LLM judge scores this run's completions."""
        return JUDGE_REWARD in self.scoring.rewards

    def flat(self) -> dict[str, Any]:
        """Every leaf field by its flat name: the report's config card, W&B, comparisons on resume."""
        return {name: getattr(getattr(self, part) if part else self, name) for name, (part, _) in leaf_index().items()}

    @property
    def trackers(self) -> tuple[str, ...]:
        """The trackers this run logs to: report_to, and wandb with wandb_project."""
        return tuple(dict.fromkeys((*self.report_to, *(("wandb",) if self.wandb_project else ()))))

    @property
    def rollouts_per_iter(self) -> int:
        return self.prompts_per_iter * self.sampling.group_size

    @property
    def rollouts_per_step(self) -> int:
        """The rollouts each optimizer step trains on (the train processes share them)."""
        return self.rollouts_per_iter // self.train.updates_per_iter

    def rollouts_per_step_given(self) -> str:
        """`rollouts_per_step` in an error, with the options it comes from."""
        return (
            f"{self.rollouts_per_step} rollouts per optimizer step ({given('prompts_per_iter', self.prompts_per_iter)} x "
            f"{given('group_size', self.sampling.group_size)} / {given('updates_per_iter', self.train.updates_per_iter)})"
        )


PARTS: dict[str, type[Part]] = {
    name: field.annotation
    for name, field in RunConfig.model_fields.items()
    if isinstance(field.annotation, type) and issubclass(field.annotation, Part)
}


@functools.cache
def leaf_index() -> dict[str, tuple[str | None, FieldInfo]]:
    """flat name -> (the part holding it, or None for a loop field; its FieldInfo), parts in order."""
    index: dict[str, tuple[str | None, FieldInfo]] = {
        name: (None, field) for name, field in RunConfig.model_fields.items() if name not in PARTS
    }
    for part, model in PARTS.items():
        for name, field in model.model_fields.items():
            assert name not in index, f"config field {name!r} is defined twice"
            index[name] = (part, field)
    return index


def leaf_fields() -> Iterator[tuple[str, FieldInfo]]:
    """(flat name, FieldInfo) of every option: the CLI's flags and the table in docs/configuration.md."""
    for name, (_, field) in leaf_index().items():
        yield name, field


def eval_due(config: RunConfig, iterations_done: int) -> bool:
    """Whether the held-out evaluation runs after this many iterations (0: before training)."""
    every, size = config.evaluation.eval_every, config.evaluation.eval_size
    if size == 0:
        return False
    if iterations_done in (0, config.iterations):
        return True
    return every > 0 and iterations_done % every == 0
