"""A run folder and a checkpoint written by an older grpo_flyte still resume: the package's layout
may change, what it wrote to disk may not.

`tests/data/run_before_rooms/` is a 1-iteration local run of the tests' tiny model, written by
commit 7bddd04 (the flat package, before its modules moved into rooms) with
`--max-new-tokens 8 --prompts-per-iter 2 --group-size 3 --eval-size 2 --min-informative-groups 0`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from grpo_flyte.launch.cli import main as cli_main
from grpo_flyte.loop.state import LoopState

STORED = Path(__file__).resolve().parents[2] / "data" / "run_before_rooms"
TINY = ["--max-new-tokens", "8", "--prompts-per-iter", "2", "--group-size", "3", "--eval-size", "2", "--min-informative-groups", "0"]


def _stored_copy(tmp_path: Path, model: Path) -> Path:
    """The stored folder, its base model pointed at this session's tiny model: the same weights
    (seed 0, the embedded tokenizer), built anew at another path."""
    run_dir = Path(shutil.copytree(STORED, tmp_path / "run"))
    config = json.loads((run_dir / "config.json").read_text())
    config["base"]["model"] = str(model)
    (run_dir / "config.json").write_text(json.dumps(config, indent=2))
    return run_dir


def test_a_run_folder_written_before_the_move_resumes_to_the_end(tmp_path, tiny_model_dir):
    run_dir = _stored_copy(tmp_path, tiny_model_dir)
    before = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in before] == [0, 1]
    assert cli_main(["--local", "--resume", "--run-dir", str(run_dir), "--iterations", "2"]) == 0
    after = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in after] == [0, 1, 2]
    assert after[:2] == before  # the finished iterations are kept as they were, not redone
    state = LoopState.model_validate_json((run_dir / "flyte" / "checkpoint").read_bytes())
    assert state.iterations_done == 2 and state.adapter.version == 2
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()


def test_a_checkpoint_written_before_the_move_loads_whole():
    """A cluster driver's checkpoint is the loop state's JSON (what flyte.Checkpoint holds); the
    stored one parses into today's LoopState and writes back the same JSON: no field was renamed
    or dropped by the move, and each field added since (LoopState.completions, the objective's
    metrics in each row's train part) has its default."""
    payload = (STORED / "flyte" / "checkpoint").read_bytes()
    state = LoopState.model_validate_json(payload)
    assert state.iterations_done == 1 and [row.iteration for row in state.history] == [0, 1]
    stored, written = json.loads(payload), json.loads(state.model_dump_json())
    added = _added_fields(LoopState, stored, written)
    assert all(value == default for _, value, default in added), added
    assert written == stored  # once the fields added since are taken out


def _added_fields(model, stored, written, path: str = "") -> list[tuple[str, object, object]]:
    """The fields `written` (a dump of `model`) has and `stored` has not, at any depth, removed
    from `written`: (path, value, the field's default)."""
    import typing

    from pydantic import BaseModel

    def model_in(annotation):
        """The pydantic model a field holds, itself or inside list[...] / X | None."""
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return annotation
        return next((m for m in map(model_in, typing.get_args(annotation)) if m is not None), None)

    added = []
    for name in list(written):
        if name not in stored:
            default = model.model_fields[name].get_default(call_default_factory=True)
            added.append((f"{path}{name}", written.pop(name), default.model_dump() if isinstance(default, BaseModel) else default))
            continue
        inner = model_in(model.model_fields[name].annotation)
        if inner is None:
            continue
        if isinstance(written[name], dict) and isinstance(stored[name], dict):
            added += _added_fields(inner, stored[name], written[name], f"{path}{name}.")
        elif isinstance(written[name], list) and isinstance(stored[name], list):
            for i, (old, new) in enumerate(zip(stored[name], written[name], strict=True)):
                if isinstance(old, dict) and isinstance(new, dict):
                    added += _added_fields(inner, old, new, f"{path}{name}[{i}].")
    return added
