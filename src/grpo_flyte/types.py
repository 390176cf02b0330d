"""This module defines the values that cross task boundaries: what `generate`, `score_group` and
`train_step` take and return, the driver's per-iteration metrics row (its parts:
`grpo_flyte.records`) and its result.

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

from grpo_flyte.records import EvalMetrics, GuardRecord, MemoryMetrics, StageCost, TrainMetrics

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
    (a model turn hit max_new_tokens), 'episode_tokens'; an agent's (grpo_flyte.engine.agents)
    also 'agent_error' (it raised or ran past its time) or 'no_calls' (it never called the model).
    `reward`: the environment's own reward (None: scored by the configured rewards only).
    """

    turns: list[EpisodeTurn]
    tool_calls: int = 0
    tool_errors: int = 0
    tool_malformed: int = 0  # --tools: calls that could not be read (not JSON, no name, ...)
    end: Literal["done", "turns", "turn_tokens", "episode_tokens", "agent_error", "no_calls"] = "done"
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


class Branch(TaskValue):
    """One more training sequence of an agent's episode (a call that did not continue the rollout's
    sequence: grpo_flyte.engine.chat_client.chains), trained with the episode's advantage: its own
    prompt ids, then its tokens as a Rollout's (the model's marked in `model_mask`)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    sampling_logprobs: list[float]
    model_mask: list[bool]


class Rollout(TaskValue):
    """One completion, or one multi-turn episode: every token after the prompt, in order.

    `sampling_logprobs` has one entry per token of `completion_ids`: log softmax(logits /
    temperature) of each sampled token. In an episode, `model_mask` marks the model's tokens (True)
    and the environment's (False: in the context, out of the loss; their log-prob entries are 0
    and never read); None means every token is the model's. `text` is the completion, or the
    episode's transcript to read (`grpo_flyte.engine.episodes.transcript`); rewards read `answer_text`.
    An agent's episode (grpo_flyte.engine.agents) has its own `prompt_ids` (None: the group's) and
    its other training sequences as `branches`.
    """

    completion_ids: list[int]
    sampling_logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    text: str
    model_mask: list[bool] | None = None
    episode: Episode | None = None
    prompt_ids: list[int] | None = None
    branches: list[Branch] = []

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


class MemoryPeak(TaskValue):
    """The peak memory of a task's process while it ran (grpo_flyte.runtime.memory), in GB (10^9
    bytes): `rss_gb` the resident memory of the process and the processes below it, polled;
    `gpu_gb` and `gpu_allocated_gb` torch's peak reserved and allocated GPU memory in the process
    (None: no GPU in use there)."""

    rss_gb: float
    gpu_gb: float | None = None
    gpu_allocated_gb: float | None = None


class RolloutGroup(TaskValue):
    """All completions of one prompt; `index` is the prompt's position within its iteration;
    `memory`: the generate task's process while it ran (None from a caller that did not measure).

    `stowed`: the folder that holds `prompt_ids` and `rollouts` (both empty here) when the group is
    too large to cross a task boundary inline (a long episode's group); a task that reads them
    calls `runtime.storage.fetch_group` first (see `runtime.storage.stow_groups`).
    """

    index: int
    example: Example
    adapter_version: int
    prompt_ids: list[int]
    rollouts: list[Rollout]
    generate_s: float
    stowed: Dir | None = None
    memory: MemoryPeak | None = None


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
    memory: MemoryPeak | None = None  # the score_group task's process (its reward workers included) while it ran

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
    memory: MemoryPeak | None = None  # the train task's process (rank 0's with several) while it ran


class MetricsRow(TaskValue):
    """One row of the run's history: iteration 0 is the evaluation before training (no `train`);
    an iteration without a held-out evaluation has no `eval`; `guard`: what the run's guard made of
    it; `memory`: the peak memory of its stretch of the run; `cost`: where its wall clock went (each
    None in a history written before it was measured)."""

    iteration: int
    adapter_version: int
    train: TrainMetrics | None = None
    eval: EvalMetrics | None = None
    guard: GuardRecord | None = None
    memory: MemoryMetrics | None = None
    cost: StageCost | None = None

    def flat(self) -> dict[str, Any]:
        """The row as flat keys (`reward/<name>`, `eval_reward/<name>`, `ended/<reason>`): metrics.jsonl,
        the report, W&B. Multi-turn metrics appear in multi-turn runs only."""
        row: dict[str, Any] = {"iteration": self.iteration, "adapter_version": self.adapter_version}
        nested = {"reward_means": "reward/", "eval_reward_means": "eval_reward/", "episode_ends": "ended/"}
        for part in (self.train, self.eval, self.guard, self.memory, self.cost):
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
            ("memory", MemoryMetrics, "peak_rss_gb"),
            ("cost", StageCost, "wall_s"),
        ):
            fields = {key: values[key] for key in model.model_fields if key in values}
            if (marker is None and fields) or (marker is not None and marker in values):
                parts[name] = model(**fields)
        return cls(iteration=flat["iteration"], adapter_version=flat["adapter_version"], **parts)


class ExportCheck(TaskValue):
    """What `export.json` holds: an exported form compared with its adapter on the run's held-out
    set (grpo_flyte.loop.verification computes it).

    `agreement`: the share of identical completions; `difference`, `difference_ci95`: the paired
    difference of `metric` (export minus adapter) and its 95% half-width (None with one question);
    `failure`: why the export failed (None: it passed)."""

    form: str
    path: str
    loaded_with: str
    adapter: str
    adapter_iteration: int | None
    questions: int
    metric: Literal["eval_accuracy", "eval_reward"]
    agreement: float
    max_disagreement: float
    export_accuracy: float
    adapter_accuracy: float
    export_reward: float
    adapter_reward: float
    difference: float
    difference_ci95: float | None
    failure: str | None = None

    @property
    def passed(self) -> bool:
        return self.failure is None


class RunResult(TaskValue):
    """What `train_rl` returns: the final adapter, every metrics row, the final report (a folder
    holding report.html), the best adapter by the held-out evaluations (None when nothing was
    evaluated) and, with `export_merged`, the merged model folder (of the adapter
    `export_adapter` names) holding its `export.json`, only when it passed its check.

    `export_check`: the check of the form the run shipped (grpo_flyte.loop.shipping): the merged
    model's with `export_merged`, else, with `push_to_hub`, the pushed adapter's; its `failure`
    says why nothing was kept or pushed. None: nothing was exported.

    `gguf`, with `export_gguf`: the folder holding the GGUF file (`model-<quant>.gguf`) and its
    export.json, only when it passed its check; `gguf_check`: that check (None: not asked for, or
    the merged model it is written from failed its own)."""

    adapter: AdapterRef
    history: list[MetricsRow]
    report: Dir
    merged: Dir | None = None
    best: AdapterRef | None = None
    export_check: ExportCheck | None = None
    gguf: Dir | None = None
    gguf_check: ExportCheck | None = None
