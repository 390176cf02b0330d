"""This module holds the loop's state between iterations: what `flyte.Checkpoint` holds after every
iteration, and how a retried driver (or a resumed run) gets it back.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import flyte
from pydantic import BaseModel

from grpo_flyte.loop.answers import BestCompletion, CompletionSample, EvalAnswer
from grpo_flyte.loop.guard import GuardState
from grpo_flyte.runtime.storage import located_path, portable_path, save_checkpoint
from grpo_flyte.types import AdapterRef, MetricsRow


class LoopState(BaseModel):
    """Everything needed to continue a run: saved to flyte.Checkpoint after every iteration."""

    iterations_done: int
    adapter: AdapterRef
    history: list[MetricsRow]
    best_completion: BestCompletion | None = None
    # The experiment-tracking run this loop logs to (kept so that a resumed run continues it).
    tracking_id: str = ""
    # A few answers of the latest held-out evaluation, for the report.
    held_out_sample: list[EvalAnswer] = []
    # --log-completions: the latest iteration's sample, for the run folder, the trackers and the report.
    completions: list[CompletionSample] = []
    # A pipelined run (max_staleness K): the adapters before `adapter` that batches in flight use
    # (the K newest), and the batches in flight: iteration (0-based) -> the adapter version
    # generating it. A resumed run regenerates exactly those, with those versions.
    recent_adapters: list[AdapterRef] = []
    in_flight: dict[int, int] = {}
    # The guard: the best adapter so far, rollbacks, the learning-rate scale, patience, a stop.
    guard: GuardState = GuardState()


async def restore_state(resume_from: str | None) -> tuple[flyte.Checkpoint | None, LoopState | None]:
    """The checkpoint to save to, and the state saved by an earlier attempt or run, if any."""
    ctx = flyte.ctx()
    checkpoint = ctx.checkpoint if ctx else None
    if checkpoint is not None and resume_from:
        checkpoint = flyte.Checkpoint(checkpoint.remote_destination, resume_from)
    previous = await checkpoint.load() if checkpoint is not None else None
    if previous is None:
        return checkpoint, None
    payload = Path(previous).read_bytes()
    state = LoopState.model_validate_json(payload)
    # Re-save at once so that every later attempt sees it, even if this one dies before its first
    # iteration (the previous-checkpoint path always points at attempt 1: flyteorg/flyte#2894).
    await save_checkpoint(checkpoint, payload)
    return checkpoint, _with_adapter_paths(state, located_path)


def _with_adapter_paths(state: LoopState, convert: Callable[[str], str]) -> LoopState:
    def moved(adapter: AdapterRef) -> AdapterRef:
        return adapter.model_copy(update={"dir": adapter.dir.model_copy(update={"path": convert(adapter.dir.path)})})

    guard = state.guard
    if guard.best is not None:
        guard = guard.model_copy(update={"best": guard.best.model_copy(update={"adapter": moved(guard.best.adapter)})})
    return state.model_copy(
        update={"adapter": moved(state.adapter), "recent_adapters": [moved(a) for a in state.recent_adapters], "guard": guard}
    )


def checkpoint_payload(state: LoopState) -> bytes:
    """The state as saved: local adapter paths relative to the run's raw data folder, so that a
    moved or copied run folder resumes (`restore_state` joins it to the new folder)."""
    return _with_adapter_paths(state, portable_path).model_dump_json().encode()
