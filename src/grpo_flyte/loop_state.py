"""The loop's state between iterations: what `flyte.Checkpoint` holds after every iteration, and how
a retried driver (or a resumed run) gets it back.
"""

from __future__ import annotations

from pathlib import Path

import flyte
from pydantic import BaseModel

from grpo_flyte.storage import located_path, portable_path, save_checkpoint
from grpo_flyte.types import AdapterRef, BestCompletion, EvalAnswer, MetricsRow


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
    return checkpoint, _with_adapter_path(state, located_path(state.adapter.dir.path))


def _with_adapter_path(state: LoopState, path: str) -> LoopState:
    adapter = state.adapter.model_copy(update={"dir": state.adapter.dir.model_copy(update={"path": path})})
    return state.model_copy(update={"adapter": adapter})


def checkpoint_payload(state: LoopState) -> bytes:
    """The state as saved: a local adapter path relative to the run's raw data folder, so that a
    moved or copied run folder resumes (`restore_state` joins it to the new folder)."""
    return _with_adapter_path(state, portable_path(state.adapter.dir.path)).model_dump_json().encode()
