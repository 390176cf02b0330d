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
from grpo_flyte.config.trl_names import IS_CAP_MAX
from grpo_flyte.errors import flag, given

# The micro-batch token budget when micro_batch_tokens is unset. A CPU computes a micro-batch of 512
# tokens as fast a token as one of 4096 (its matrices are large enough either way), and the train
# step's activations grow with the micro-batch: about 2 MB a token on the embedded model in float32,
# so 4096 tokens held 7 GB (docs/measurements.md#where-a-local-runs-memory-goes-issue-55-2026-11-27).
# A GPU needs the larger batches to be busy.
CPU_MICRO_BATCH_TOKENS = 512
GPU_MICRO_BATCH_TOKENS = 4096


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
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"] = Field(
        "grpo",
        description=(
            "The loss (TRL's loss_type; formulas in learning/losses.py): 'grpo' (clipped surrogate; mean over each "
            "completion's tokens, then over completions), 'dr_grpo' (token sum / (completions x max_new_tokens); pair it "
            "with --scale-rewards none as in the Dr. GRPO paper), 'dapo' (mean over the optimizer step's completion "
            "tokens), 'bnpo' (the same here: TRL's differs only in normalizing each device's micro-batch alone), "
            "'cispo' (MiniMax-M1: the ratio capped at epsilon_high, a weight without gradient on A x logp; token mean), "
            "'sapo' (a sigmoid gate instead of the clip, see sapo_temperature_*; per-completion mean), 'luspo' (GSPO "
            "with each completion's loss scaled by its length; needs --importance-sampling-level sequence), 'vespo' "
            "(a gamma weight of the sequence ratio, see vespo_*; token mean)."
        ),
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description=(
            "Advantages: 'group' divides each group's centred rewards by the group's std (GRPO); 'batch' by the std of "
            "every reward of the iteration (PPO Lite); 'none' only centres them (Dr. GRPO). TRL: scale_rewards (true: "
            "'group', false: 'none'), verl: norm_adv_by_std_in_grpo."
        ),
    )
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize",
        description=(
            "Several rewards: 'sum_then_normalize' turns the weighted sum into advantages (scale_rewards); "
            "'normalize_then_sum' (GDPO) normalizes each reward's scores within the group, takes their weighted sum, "
            "then normalizes that over the iteration's completions (scale_rewards is then unused). With --truncated "
            "min_reward a truncated completion gets its group's lowest weighted sum (at most 0) before the batch step."
        ),
    )
    epsilon: float = Field(0.2, gt=0.0, lt=1.0, description="PPO clip range below 1: the ratio is clipped at 1 - epsilon.")

    epsilon_high: float = Field(
        0.2,
        gt=0.0,
        le=10.0,
        description=(
            "PPO clip range above 1: the ratio is clipped at 1 + epsilon_high (DAPO: 0.28); unset, it is --epsilon's "
            "value, as in TRL. With loss_type 'cispo' it is the cap of the ratio itself, epsilon_max (ScaleRL recommends 5.0)."
        ),
    )
    delta: float | None = Field(
        None,
        gt=1.0,
        le=100.0,
        description=(
            "Two-sided clipping (INTELLECT-2): the unclipped ratio is also capped at delta, so a negative advantage "
            "cannot push a large ratio on; above 1 + epsilon_high. None: off."
        ),
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token",
        description=(
            "The policy ratio of the surrogate: 'token' (one per token) or 'sequence' (GSPO: exp of the completion's "
            "mean log-ratio, on all its tokens)."
        ),
    )
    sapo_temperature_pos: float = Field(
        1.0, gt=0.0, le=100.0, description="loss_type 'sapo': the gate's temperature for a positive advantage."
    )
    sapo_temperature_neg: float = Field(
        1.05, gt=0.0, le=100.0, description="loss_type 'sapo': the gate's temperature for a zero or negative advantage."
    )
    vespo_k_pos: float = Field(
        2.0, ge=0.0, le=100.0, description="loss_type 'vespo': the power k of phi(w) for A >= 0 (down-weights sequence ratios below 1)."
    )
    vespo_lambda_pos: float = Field(
        3.0, ge=0.0, le=100.0, description="loss_type 'vespo': the decay lambda of phi(w) for A >= 0 (down-weights ratios above 1)."
    )
    vespo_k_neg: float = Field(3.0, ge=0.0, le=100.0, description="loss_type 'vespo': the power k of phi(w) for A < 0.")
    vespo_lambda_neg: float = Field(2.0, ge=0.0, le=100.0, description="loss_type 'vespo': the decay lambda of phi(w) for A < 0.")
    updates_per_iter: int = Field(
        1,
        ge=1,
        le=1024,
        description="Optimizer steps per iteration, each on one minibatch of the iteration's rollouts (clipping acts when > 1).",
    )
    num_iterations: int = Field(
        1,
        ge=1,
        le=64,
        description=(
            "Passes over each iteration's rollouts (TRL's num_iterations, mu in the GRPO paper): each pass takes "
            "updates_per_iter optimizer steps, every ratio against the policy at the start of the iteration."
        ),
    )
    beta: float = Field(0.0, ge=0.0, le=100.0, description="KL penalty weight against the base model (the adapter disabled).")
    use_bias_correction_kl: bool = Field(
        True,
        description=(
            "With beta > 0, multiply each token's KL by its policy ratio (DeepSeek-V3.2, TRL's default): the unbiased "
            "reverse-KL gradient; it changes the gradient even where the ratio is 1."
        ),
    )
    top_entropy_quantile: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description=(
            "Keep in the policy loss only this share of tokens, those of highest entropy (Beyond the 80/20 Rule: 0.2), "
            "the threshold taken over each optimizer step's tokens; 1.0 keeps all. Below 1 each step forwards its "
            "rollouts once more without gradients to find the threshold."
        ),
    )
    entropy_coef: float = Field(
        0.0,
        ge=0.0,
        le=10.0,
        description=(
            "Entropy bonus: the loss minus entropy_coef x the mean per-token entropy (the tokens top_entropy_quantile "
            "keeps), the same meaning for every loss type. With use_adaptive_entropy the starting coefficient."
        ),
    )
    use_adaptive_entropy: bool = Field(
        False,
        description=(
            "Skywork-OR1's control: after each optimizer step entropy_coef moves by entropy_coef_delta, up when the "
            "step's mean entropy was at most entropy_target, else down; the bonus applies only while the last entropy "
            "was at most the target. The coefficient is saved with the adapter."
        ),
    )
    entropy_coef_min: float = Field(0.0, ge=0.0, le=10.0, description="use_adaptive_entropy: the coefficient's lower bound.")
    entropy_coef_max: float = Field(1.0, ge=0.0, le=10.0, description="use_adaptive_entropy: the coefficient's upper bound.")
    entropy_coef_delta: float = Field(
        0.005, ge=0.0, le=10.0, description="use_adaptive_entropy: the coefficient's step per optimizer step."
    )
    entropy_target: float = Field(
        0.2,
        ge=0.0,
        le=100.0,
        description=(
            "use_adaptive_entropy: the mean per-token entropy (nats, over the tokens the bonus acts on) at or below "
            "which the bonus applies and grows; set it near the entropy an early iteration reports."
        ),
    )
    off_policy_mask_threshold: float | None = Field(
        None,
        ge=0.0,
        le=100.0,
        description=(
            "DeepSeek-V3.2's off-policy sequence mask: a completion with a negative advantage whose mean per-token "
            "log(p_sampling / p_now) exceeds this leaves the policy loss (e.g. 0.5). None: off."
        ),
    )
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
    is_cap: float = Field(2.0, ge=1.0, le=IS_CAP_MAX, description="Upper bound of the importance weight.")
    is_clip_min: float | None = Field(
        None,
        ge=0.0,
        le=1000.0,
        description=(
            "Lower bound of the importance weight (TRL's vllm_importance_sampling_clip_min): below it the weight is "
            "raised to it ('truncate') or set to 0 ('mask'). None: no lower bound."
        ),
    )
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
    micro_batch_tokens: int | None = Field(
        None,
        ge=64,
        le=1_048_576,
        description=(
            "Padded tokens per forward/backward micro-batch; sequences are grouped by length. Unset: 4096 on a GPU, 512 on "
            "a CPU (a CPU step is no faster with larger ones, and its activations take about 2 MB a token in float32 on "
            "the embedded model: docs/measurements.md#where-a-local-runs-memory-goes-issue-55-2026-11-27). Every "
            "optimizer step accumulates the gradients of its micro-batches (gradient accumulation): lower it to fit memory. A sequence "
            "is never split: one longer than this trains alone with gradient checkpointing (its activations recomputed "
            "in the backward pass), holding a fraction of a fitting sequence's memory a token "
            "(docs/measurements.md#long-observations-issue-40-2026-11-26)."
        ),
    )
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description=(
            "Learning-rate schedule over the run's optimizer steps (iterations x updates_per_iter x num_iterations), after the "
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

    @property
    def steps_per_iteration(self) -> int:
        """Optimizer steps one iteration takes: updates_per_iter per pass, num_iterations passes."""
        return self.updates_per_iter * self.num_iterations

    def token_budget(self, device: str) -> int:
        """The micro-batches' padded tokens on `device` (a torch device type, "cuda" or "cpu"):
        micro_batch_tokens, or when unset GPU_MICRO_BATCH_TOKENS on a GPU, CPU_MICRO_BATCH_TOKENS elsewhere."""
        if self.micro_batch_tokens is not None:
            return self.micro_batch_tokens
        return GPU_MICRO_BATCH_TOKENS if device == "cuda" else CPU_MICRO_BATCH_TOKENS

    @property
    def entropy_bonus(self) -> bool:
        """Whether the loss has an entropy term (adaptive control keeps it even at coefficient 0)."""
        return self.entropy_coef != 0.0 or self.use_adaptive_entropy

    @model_validator(mode="before")
    @classmethod
    def _epsilon_high_follows_epsilon(cls, data: Any) -> Any:
        # TRL: epsilon_high unset (or None) is epsilon, so that --epsilon alone clips both sides alike
        if isinstance(data, dict) and data.get("epsilon_high") is None:
            data = {**data, "epsilon_high": data.get("epsilon", cls.model_fields["epsilon"].default)}
        return data

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _trl_scale_rewards(cls, value: Any) -> Any:
        # TRL also takes booleans (True: 'group', False: 'none')
        if isinstance(value, bool):
            return "group" if value else "none"
        return value

    @model_validator(mode="after")
    def _objective_combinations(self) -> TrainConfig:
        """The combinations TRL warns about are refused: each is not the method its loss type names."""
        kind, level = self.loss_type, self.importance_sampling_level
        if kind == "luspo" and level != "sequence":
            raise ValueError(
                f"{given('loss_type', kind)} scales GSPO's sequence ratio by the completion's length; expected "
                f"{flag('importance_sampling_level')} sequence"
            )
        if level == "sequence" and kind in ("bnpo", "dr_grpo", "dapo", "cispo", "vespo"):
            reason = (
                "computes its own sequence weight from the token ratios"
                if kind == "vespo"
                else "sums tokens, weighting each completion's sequence ratio by its length (not GSPO's objective)"
            )
            raise ValueError(
                f"{given('importance_sampling_level', level)} with {given('loss_type', kind)}: {kind} {reason}; "
                f"expected loss_type grpo, sapo or luspo, or importance_sampling_level token"
            )
        if kind == "vespo" and self.is_correction and self.is_mode.startswith("sequence"):
            raise ValueError(
                f"{given('loss_type', kind)} with {given('is_mode', self.is_mode)}: vespo folds per-token importance "
                "weights into its sequence weight; expected is_mode token_truncate or token_mask"
            )
        if self.is_clip_min is not None and self.is_clip_min >= self.is_cap:
            raise ValueError(f"{given('is_clip_min', self.is_clip_min)} with {given('is_cap', self.is_cap)}: expected is_clip_min < is_cap")
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(f"{given('entropy_coef_min', self.entropy_coef_min)} above {given('entropy_coef_max', self.entropy_coef_max)}")
        return self

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
    export_adapter: Literal["best", "final"] | None = Field(
        None,
        description=(
            "The adapter push_to_hub, export_merged and the export command take: 'best' (the best held-out evaluation's; "
            "the final one when nothing was evaluated) or 'final' (the last iteration's). Unset: 'best', unless no trained "
            "adapter beat the start (the best evaluation is iteration 0's, the untrained adapter): then nothing is merged or "
            "pushed until you choose one. A local run writes both, best/ and adapter/."
        ),
    )
