"""This module defines the config parts that train on rollouts and watch the training: the LoRA
adapter, the GRPO objective and its optimizer, the held-out evaluation and the guard.

Each part is one concern of `RunConfig` (grpo_flyte.config.run); a task takes only the parts it
uses. The parts a rollout is made from are in grpo_flyte.config.generation.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from grpo_flyte.config.constants import MAX_TRAIN_PROCESSES
from grpo_flyte.config.part import Part
from grpo_flyte.errors import flag


class LoraConfig(Part):
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

    disable_dropout: bool = Field(
        False,
        description=(
            "Switch off every dropout layer of the trained model (the base's and LoRA's), so that the train step's "
            "log-probs are those of the policy that generated (TRL's name). Needs --lora-dropout 0."
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
    def _no_dropout_means_none(self) -> LoraConfig:
        if self.disable_dropout and self.lora_dropout:
            raise ValueError(f"{flag('disable_dropout')} with {flag('lora_dropout')} {self.lora_dropout}: expected --lora-dropout 0")
        return self

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


class TrainConfig(Part):
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
            "in the backward pass), holding a fraction of a fitting sequence's memory a token "
            "(docs/measurements.md#long-observations-issue-40-2026-11-26)."
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
            "Recompute activations in the backward pass instead of keeping them: less memory for long sequences, for a "
            "second forward pass. Always on for a sequence longer than micro_batch_tokens."
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


class EvalConfig(Part):
    """The held-out evaluation."""

    eval_every: int = Field(10, ge=0, le=100_000, description="Held-out evaluation every N iterations (0: only before and after training).")
    eval_size: int = Field(
        100,
        ge=0,
        le=100_000,
        description="Held-out questions per evaluation, answered greedily unless --num-generations-eval is set (0: no evaluation).",
    )
    num_generations_eval: int | None = Field(
        None,
        ge=1,
        le=512,
        description=(
            "Held-out completions per question (TRL's name). Unset: one greedy answer per question. N: N completions "
            "sampled at the run's sampling settings (--temperature, --top-p, --top-k, ...), seeded per question (the same "
            "seeds at every evaluation); a question's reward and correctness are the means over its N completions, "
            "eval_reward and eval_accuracy the means of those over the questions, as is the guard's paired comparison."
        ),
    )


class GuardConfig(Part):
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
