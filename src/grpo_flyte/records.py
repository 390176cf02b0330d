"""This module defines the parts of the driver's metrics row (`grpo_flyte.types.MetricsRow`): what
an iteration's training, its held-out evaluation, the guard, the memory and the stage costs measured.

It sits at the bottom, below `grpo_flyte.types`; it imports pydantic alone.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class TrainMetrics(BaseModel):
    """What one training iteration measured. `reward_means`: each weighted reward's mean unweighted
    score; `reward_errors`: (completion, reward) scores that failed and counted as 0."""

    mean_reward: float
    accuracy: float
    format_rate: float
    reward_means: dict[str, float]
    reward_errors: int
    loss: float
    num_rollouts: int
    num_groups: int
    topup_groups: int
    num_contributing: int
    frac_zero_std_groups: float
    num_updates: int
    num_tokens: int
    kl: float | None  # None: not measured this iteration (beta 0, see kl_monitor_every)
    clip_fraction: float
    is_ratio_mean: float
    is_ratio_max: float
    is_ess: float = 1.0  # effective sample size of the importance weights (a fraction; see learning.losses.effective_sample_size)
    is_clipped_fraction: float = 0.0  # tokens whose importance weight the cap truncated or masked
    entropy: float
    entropy_coef: float | None = None  # with an entropy bonus: its coefficient after the iteration (see use_adaptive_entropy)
    off_policy_masked_fraction: float | None = None  # with off_policy_mask_threshold: tokens it left out of the policy loss
    vespo_phi_mean: float | None = None  # loss_type 'vespo' only: the mean gamma weight
    grad_norm: float
    lr: float = 0.0  # the learning rate of the iteration's last optimizer step
    train_world_size: int = 1  # processes the train step ran in
    train_restore_s: float = 0.0  # seconds of train_s spent reading the adapter and optimizer state back
    completion_len_mean: float
    completion_len_max: int
    truncated_fraction: float
    generate_s: float
    score_s: float  # the scoring tail after the last group was generated
    train_s: float
    iteration_s: float
    generate_tokens_per_s: float
    score_tokens_per_s: float
    train_tokens_per_s: float
    # How stale the trained groups were (versions between the adapter that generated a group and the
    # one it trained), the groups dropped as staler than max_staleness, and the seconds the trainer
    # waited for its batch (a pipelined run: what generation ahead did not hide).
    staleness_mean: float = 0.0
    staleness_max: int = 0
    stale_dropped: int = 0
    batch_wait_s: float = 0.0
    # With the 'judge' reward (None otherwise): the judge's stage seconds (wall clock while a judge
    # call was in flight), its prompts, retries, unparsable replies, groups split to fit its context.
    judge_s: float | None = None
    judge_calls: int | None = None
    judge_retries: int | None = None
    judge_invalid: int | None = None
    judge_split_groups: int | None = None
    # With a reward model among the rewards (None otherwise): its stage seconds (wall clock while a
    # reward model call was in flight).
    reward_model_s: float | None = None
    # The score pool's busy seconds: wall clock while a score_group call was in flight (None in rows
    # written before it was measured).
    score_busy_s: float | None = None
    # Multi-turn runs only (None otherwise): means per episode, tool_call_rate the share of episodes
    # with a tool call, episode_ends how many episodes ended each way (see Episode.end).
    turns_mean: float | None = None
    tool_calls_mean: float | None = None
    tool_call_rate: float | None = None
    tool_errors: int | None = None
    tool_calls: int | None = None  # the batch's tool calls (tool_calls_mean x episodes)
    tool_malformed: int | None = None  # --tools: calls that could not be read
    model_tokens_mean: float | None = None
    env_tokens_mean: float | None = None
    episode_ends: dict[str, int] = Field(default_factory=dict)


class EvalMetrics(BaseModel):
    """One held-out evaluation (greedy answers; with num_generations_eval, means over each question's
    sampled completions); `*_ci95` are 95% normal interval half-widths over the questions, None when a
    single held-out question gives no interval (shown with `plus_minus`). The accuracy, a
    proportion, has its own 95% interval, inside [0, 1]: `eval_accuracy_lo` to `eval_accuracy_hi`
    (Wilson's, loop.metrics.wilson_interval; None in rows written before it existed)."""

    eval_reward: float
    eval_reward_ci95: float | None
    eval_accuracy: float
    eval_accuracy_ci95: float | None
    eval_format_rate: float
    eval_reward_means: dict[str, float]
    eval_reward_errors: int
    eval_size: int
    eval_s: float
    eval_accuracy_lo: float | None = None
    eval_accuracy_hi: float | None = None
    eval_tool_call_rate: float | None = None  # multi-turn: share of held-out episodes with a tool call
    eval_tool_call_rate_ci95: float | None = None
    eval_turns_mean: float | None = None
    eval_tool_errors: int | None = None  # multi-turn: environment steps that raised or ran out of time


# The pools a run's time is spent on: the Flyte task environments (envs.py) and the driver itself.
POOLS = ("generate", "score", "judge", "reward_model", "train", "driver")


class StageCost(BaseModel):
    """Where one row's wall clock went (grpo_flyte.loop.metrics.stage_cost).

    `wall_s`: the seconds since the previous row was recorded (the first row: since the driver
    started). `wait_<stage>_s`: what the loop waited on, a partition of `wall_s`: generation, the
    scoring after it (with the judge and reward models, which score beside it), the train step, the
    held-out evaluation, and `driver_s`, the rest: the driver's own work (start-up, checkpoints,
    reports, the guard, a sweep's configs meeting). `busy_<pool>_s`: the seconds each pool had a
    call in flight (pools overlap: generation ahead of training, scoring beside generation; the
    evaluation's seconds count as the generate pool's). On a cluster `accelerator_hours` is the
    busy seconds times each pool's GPUs, over all pools, and `dollars` that at --prices (None
    locally)."""

    wall_s: float
    driver_s: float
    wait_generate_s: float = 0.0
    wait_score_s: float = 0.0
    wait_train_s: float = 0.0
    wait_eval_s: float = 0.0
    busy_generate_s: float = 0.0
    busy_score_s: float = 0.0
    busy_judge_s: float = 0.0
    busy_reward_model_s: float = 0.0
    busy_train_s: float = 0.0
    busy_driver_s: float = 0.0
    accelerator_hours: float | None = None
    dollars: float | None = None


GuardEvent = Literal["new_best", "collapse", "rollback", "stop", "early_stop"]


class MemoryMetrics(BaseModel):
    """The peak memory of one row's stretch of the run, in GB (10^9 bytes; see
    grpo_flyte.runtime.memory for what is polled and what is exact).

    `peak_rss_gb`: the resident memory of the driver's process and every process below it, from the
    previous row to this one. In a local run every task runs in that process, so this is the whole
    run's (the generator, the trainer, the reward workers); on a cluster it is the driver's pod.
    The others are what the tasks of the row's iteration reported for their own processes, the
    largest over its calls: `generate_peak_*` over the generate calls, `score_peak_rss_gb` over the
    score_group calls (their reward workers included), `train_peak_*` the train step's; `*_gpu_gb`
    is torch's peak reserved GPU memory there, `*_gpu_allocated_gb` its peak allocated (None
    without a GPU). Iteration 0's row (the evaluation before training) has `peak_rss_gb` only.
    """

    peak_rss_gb: float
    generate_peak_rss_gb: float | None = None
    generate_peak_gpu_gb: float | None = None
    generate_peak_gpu_allocated_gb: float | None = None
    score_peak_rss_gb: float | None = None
    train_peak_rss_gb: float | None = None
    train_peak_gpu_gb: float | None = None
    train_peak_gpu_allocated_gb: float | None = None


class GuardRecord(BaseModel):
    """What the run's guard (grpo_flyte.loop.guard) made of one iteration.

    On a row with a held-out evaluation: `select_by` (the metric that picks the best adapter),
    `best_iteration` (the best evaluation's iteration, this one included) and, from the second
    evaluation on, `vs_best` (this evaluation minus the best one before it, paired over the same
    questions) with `vs_best_ci99`, the half-width of its 99% interval (the guard's collapse test). `guard_event` is what happened, if
    anything: a new best, a collapse ('collapse': warned or at the last iteration; 'rollback';
    'stop'), or 'early_stop'; `guard_signal` names what showed the collapse ('held_out' or a
    signal between evaluations) and `guard_reason` says it in words. A rollback row has the
    learning-rate scale from then on (`lr_scale`) and the rollbacks so far (`rollbacks`).
    """

    select_by: str | None = None
    best_iteration: int | None = None
    vs_best: float | None = None
    vs_best_ci99: float | None = None
    guard_event: GuardEvent | None = None
    guard_signal: str | None = None
    guard_reason: str | None = None
    lr_scale: float | None = None
    rollbacks: int | None = None
