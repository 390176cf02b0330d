"""This module defines the values that cross task boundaries: what `generate`, `score_group` and
`train_step` take and return, the driver's per-iteration metrics row and its result.

It sits at the bottom with `grpo_flyte.errors`: the task modules import these types from here and
never from each other. Importing it is cheap (pydantic and `flyte.io`).
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any, Literal

from flyte.io import Dir
from pydantic import BaseModel, ConfigDict, model_validator

# The report's file name: in a local run folder, and inside `RunResult.report`.
REPORT_FILE = "report.html"
# Beside PEFT's files in an adapter folder: the AdamW state that produced it and its version. They
# stay with the run (a resume reads them); a shared adapter leaves them out.
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "grpo_state.json"


class TaskValue(BaseModel):
    """A value that crosses a task boundary (and the config parts, config.part.Part).

    Flyte asks a type's JSON schema on every task call it is an input or output of, twice (the
    task's interface and the input's literal type), and pydantic builds it anew each time: most of
    what Flyte's local mode spent converting a `generate` call's inputs
    (docs/measurements.md#iteration-overhead-issue-41-2026-11-26). A class's schema never changes,
    so it is built once per class and arguments; each caller gets its own copy.
    """

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            schema = _json_schema(cls, args, tuple(sorted(kwargs.items())))
        except TypeError:  # an argument that cannot be a cache key
            return super().model_json_schema(*args, **kwargs)
        return copy.deepcopy(schema)


@functools.cache
def _json_schema(cls: type[BaseModel], args: tuple, kwargs: tuple) -> dict[str, Any]:
    return BaseModel.model_json_schema.__func__(cls, *args, **dict(kwargs))


class Message(TaskValue):
    """One chat message of a conversational prompt (TRL's format)."""

    model_config = ConfigDict(frozen=True)

    role: str
    content: str


class Example(TaskValue):
    """One dataset row: the question (or TRL's `prompt`), its gold answer and its other columns.

    `question` is the text shown in metrics and reports. `prompt` is set for rows in TRL's format:
    text the model sees as it is, or chat messages that the chat template renders; without it the
    question is wrapped in the run's prompt format. `answer` is the gold answer ('' when the data
    have none: then only custom rewards can score). `columns` holds every other column of the row,
    for reward functions.
    """

    model_config = ConfigDict(frozen=True)

    question: str
    answer: str
    prompt: str | list[Message] | None = None
    columns: dict[str, Any] = {}

    def __hash__(self) -> int:  # frozen, but its list and dict fields are not hashable themselves
        return hash(json.dumps(self.model_dump(mode="json"), sort_keys=True))


class AdapterRef(TaskValue):
    """A LoRA adapter version: PEFT files plus the optimizer state that produced it."""

    version: int
    dir: Dir


class EpisodeTurn(TaskValue):
    """One turn of a multi-turn episode: the model's ('model') or the environment's (its role)."""

    role: str
    text: str
    num_tokens: int


class Episode(TaskValue):
    """How a multi-turn episode went (see grpo_flyte.multiturn).

    `end`: 'done' (the environment ended it), or the budget that ran out: 'turns', 'turn_tokens'
    (a model turn hit max_new_tokens), 'episode_tokens'. `reward`: the environment's own reward
    (None: scored by the configured rewards only).
    """

    turns: list[EpisodeTurn]
    tool_calls: int = 0
    tool_errors: int = 0
    end: Literal["done", "turns", "turn_tokens", "episode_tokens"] = "done"
    reward: float | None = None

    @property
    def model_turns(self) -> int:
        return sum(t.role == "model" for t in self.turns)

    @property
    def final_text(self) -> str:
        """The model's last turn: what the answer rewards read."""
        return next((t.text for t in reversed(self.turns) if t.role == "model"), "")

    def messages(self) -> list[dict[str, str]]:
        """The episode as chat messages (TRL's multi-turn `completions`)."""
        return [{"role": "assistant" if t.role == "model" else t.role, "content": t.text} for t in self.turns]


class Rollout(TaskValue):
    """One completion, or one multi-turn episode: every token after the prompt, in order.

    `sampling_logprobs` has one entry per token of `completion_ids`: log softmax(logits /
    temperature) of each sampled token. In an episode, `model_mask` marks the model's tokens (True)
    and the environment's (False: in the context, out of the loss; their log-prob entries are 0
    and never read); None means every token is the model's. `text` is the completion, or the
    episode's transcript to read (`grpo_flyte.engine.episodes.transcript`); rewards read `answer_text`.
    """

    completion_ids: list[int]
    sampling_logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    text: str
    model_mask: list[bool] | None = None
    episode: Episode | None = None

    @model_validator(mode="after")
    def _aligned(self) -> Rollout:
        n = len(self.completion_ids)
        if len(self.sampling_logprobs) != n or (self.model_mask is not None and len(self.model_mask) != n):
            raise ValueError(
                f"{n} completion tokens but {len(self.sampling_logprobs)} log-probs"
                + (f" and {len(self.model_mask)} mask entries" if self.model_mask is not None else "")
            )
        return self

    @property
    def num_model_tokens(self) -> int:
        return len(self.completion_ids) if self.model_mask is None else sum(self.model_mask)

    @property
    def answer_text(self) -> str:
        """What the answer rewards read: the completion, or an episode's last model turn."""
        return self.text if self.episode is None else self.episode.final_text


class RolloutGroup(TaskValue):
    """All completions of one prompt; `index` is the prompt's position within its iteration."""

    index: int
    example: Example
    adapter_version: int
    prompt_ids: list[int]
    rollouts: list[Rollout]
    generate_s: float


class RewardParts(TaskValue):
    """The reward of one completion, with each named reward's unweighted score.

    `correct` and `format` are always measured (for the accuracy and format-rate metrics), whether
    or not they are weighted rewards. `errors` names the rewards that failed and scored 0
    (on_reward_error='zero').
    """

    reward: float
    correct: bool
    format: bool
    scores: dict[str, float] = {}
    errors: list[str] = []


class JudgeVerdict(TaskValue):
    """The LLM judge's scores of one group (grpo_flyte.judge): one score in [0, 1] per completion,
    relative to the others it was judged with.

    `calls`: judge prompts sent (one per group; one per chunk of a group too long for the judge's
    context), retries not counted; `retries`: second attempts after an unparsable reply; `invalid`:
    chunks whose reply was still unparsable, their completions flagged in `failed` and scored by the
    run's on_reward_error; `chunks` > 1 when the group was split.
    """

    scores: list[float]
    failed: list[bool]
    calls: int
    retries: int = 0
    invalid: int = 0
    chunks: int = 1
    judge_s: float = 0.0


class RewardModelScores(TaskValue):
    """A reward model's scores of one group (grpo_flyte.judge.reward_model_group): one per
    completion, finite; a completion whose score was not (NaN or infinite, with
    on_reward_error='zero') scores 0 and is flagged in `failed`. `seconds`: the task's time."""

    reward: str
    scores: list[float]
    failed: list[bool]
    seconds: float = 0.0


class ScoredGroup(TaskValue):
    group: RolloutGroup
    rewards: list[RewardParts]
    score_s: float = 0.0
    judge: JudgeVerdict | None = None  # with the 'judge' reward: what the judge said of this group

    @property
    def reward_values(self) -> list[float]:
        return [p.reward for p in self.rewards]

    @property
    def truncated(self) -> list[bool]:
        """Which completions were cut off at the length limit."""
        return [r.finish_reason == "length" for r in self.group.rollouts]


class StepStats(TaskValue):
    """What one iteration's optimizer steps measured (means over updates or tokens)."""

    loss: float = 0.0  # mean over the optimizer steps
    grad_norm: float = 0.0  # mean pre-clip gradient norm over the optimizer steps
    num_updates: int = 0
    num_tokens: int = 0  # completion tokens in the loss
    kl: float | None = None  # mean per-token k3 KL to the reference (adapter disabled); None: not measured
    clip_fraction: float = 0.0  # tokens clipped, in the loss type's sense (losses.TokenLoss), over all updates
    entropy: float = 0.0  # mean per-token entropy of the trainer's policy
    entropy_coef: float = 0.0  # the entropy bonus's coefficient after the step (adaptive control: the next step's)
    entropy_last: float | None = None  # adaptive control: the last step's mean entropy over the bonus's tokens (None: none yet)
    off_policy_masked_fraction: float = 0.0  # tokens off_policy_mask_threshold left out of the policy loss
    vespo_phi_mean: float | None = None  # loss_type 'vespo': mean gamma weight phi(w) per token; None otherwise
    is_ratio_mean: float = 1.0  # exp(old - samp) per token (per rollout at sequence level), before truncation
    is_ratio_max: float = 1.0
    is_ess: float = 1.0  # effective sample size of the importance weights, as a fraction of the tokens
    is_clipped_fraction: float = 0.0  # tokens whose weight the cap truncated or masked
    lr: float = 0.0  # the learning rate of the last optimizer step (see lr_scheduler_type)
    world_size: int = 1  # processes the step ran in (data-parallel: --train-processes, or the train GPUs)
    restore_s: float = 0.0  # seconds reading the adapter and optimizer state back (0: a warm replica kept them)


class TrainStepResult(TaskValue):
    adapter: AdapterRef
    num_rollouts: int
    num_contributing: int  # rollouts with a nonzero advantage
    stats: StepStats
    train_s: float


class TrainMetrics(TaskValue):
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
    model_tokens_mean: float | None = None
    env_tokens_mean: float | None = None
    episode_ends: dict[str, int] = {}


class EvalMetrics(TaskValue):
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


class StageCost(TaskValue):
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


class MetricsRow(TaskValue):
    """One row of the run's history: iteration 0 is the evaluation before training (no `train`);
    an iteration without a held-out evaluation has no `eval`; `guard`: what the run's guard made of it;
    `cost`: where its wall clock went (None in rows written before it was measured)."""

    iteration: int
    adapter_version: int
    train: TrainMetrics | None = None
    eval: EvalMetrics | None = None
    guard: GuardRecord | None = None
    cost: StageCost | None = None

    def flat(self) -> dict[str, Any]:
        """The row as flat keys (`reward/<name>`, `eval_reward/<name>`, `ended/<reason>`): metrics.jsonl,
        the report, W&B. Multi-turn metrics appear in multi-turn runs only."""
        row: dict[str, Any] = {"iteration": self.iteration, "adapter_version": self.adapter_version}
        nested = {"reward_means": "reward/", "eval_reward_means": "eval_reward/", "episode_ends": "ended/"}
        for part in (self.train, self.eval, self.guard, self.cost):
            if part is None:
                continue
            for key, value in part.model_dump().items():
                if key in nested:
                    row.update({f"{nested[key]}{name}": v for name, v in value.items()})
                elif value is not None or key == "kl":
                    row[key] = value
        return row

    @classmethod
    def from_flat(cls, flat: dict[str, Any]) -> MetricsRow:
        """A row as `flat` wrote it (a line of metrics.jsonl) back as a MetricsRow."""
        nested = {"reward/": "reward_means", "eval_reward/": "eval_reward_means", "ended/": "episode_ends"}
        values: dict[str, Any] = {name: {} for name in nested.values()}
        for key, value in flat.items():
            prefix = next((p for p in nested if key.startswith(p)), None)
            if prefix is None:
                values[key] = value
            else:
                values.setdefault(nested[prefix], {})[key[len(prefix) :]] = value
        parts = {}
        for name, model, marker in (
            ("train", TrainMetrics, "mean_reward"),
            ("eval", EvalMetrics, "eval_reward"),
            ("guard", GuardRecord, None),
            ("cost", StageCost, "wall_s"),
        ):
            fields = {key: values[key] for key in model.model_fields if key in values}
            if (marker is None and fields) or (marker is not None and marker in values):
                parts[name] = model(**fields)
        return cls(iteration=flat["iteration"], adapter_version=flat["adapter_version"], **parts)


class RunResult(TaskValue):
    """What `train_rl` returns: the final adapter, every metrics row, the final report (a folder
    holding report.html), the best adapter by the held-out evaluations (None when nothing was
    evaluated) and, with `export_merged`, the merged model folder (of the adapter
    `export_adapter` names)."""

    adapter: AdapterRef
    history: list[MetricsRow]
    report: Dir
    merged: Dir | None = None
    best: AdapterRef | None = None
