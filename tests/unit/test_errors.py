"""grpo_flyte.errors: what a data-parallel step raises when its processes failed."""

from __future__ import annotations

from types import SimpleNamespace

import flyte.errors
import pytest

from grpo_flyte.errors import AdapterError, failed_workers, is_not_retried


def _failure(recorded: str | None, exitcode: int = 1) -> SimpleNamespace:
    """A torch elastic ProcessFailure: its message is the recorded error (a dict, from the error
    file a process writes under torch's `record`) or, with none recorded, a note."""
    message = {"message": recorded, "extraInfo": {"timestamp": "0"}} if recorded else "To enable traceback see: https://..."
    return SimpleNamespace(message=message, exitcode=exitcode)


@pytest.mark.parametrize(
    ("recorded", "kind"),
    [
        ("NonRecoverableError: adapter '/a/v0003' cannot be loaded (oops)", flyte.errors.NonRecoverableError),  # a task's process
        ("AdapterError: adapter '/a/v0003' cannot be loaded (oops)", AdapterError),  # a local --train-processes process
    ],
)
def test_a_processs_input_error_comes_back_as_that_error_not_retried(recorded, kind):
    error = failed_workers({0: _failure(None, -15), 1: _failure(recorded)}, 2)
    assert type(error) is kind and str(error) == "adapter '/a/v0003' cannot be loaded (oops)" and is_not_retried(error)


def test_any_other_failure_is_retried_and_names_the_first_recorded_error_or_the_exit_code():
    error = failed_workers({0: _failure(None, -15), 1: _failure("OutOfMemoryError: CUDA out of memory")}, 2)
    assert type(error) is RuntimeError and str(error) == "train process 1 of 2 failed: OutOfMemoryError: CUDA out of memory"
    assert not is_not_retried(error)
    assert str(failed_workers({1: _failure(None, -9), 0: _failure(None, -15)}, 2)) == "train process 0 of 2 failed: exit code -15"


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (
            AttributeError("'LoopState' object has no attribute 'iteration'"),
            "train_rl: AttributeError: 'LoopState' object has no attribute 'iteration'",
        ),
        (ValueError("max_model_len 4096\nis too long"), "train_rl: ValueError: max_model_len 4096 is too long"),
        (AdapterError("adapter '/a' cannot be loaded (oops)"), "adapter '/a' cannot be loaded (oops)"),
    ],
)
def test_a_deterministic_error_in_a_task_is_not_retried_and_names_the_task(error, line):
    from grpo_flyte.errors import input_errors_not_retried

    with pytest.raises(flyte.errors.NonRecoverableError) as raised, input_errors_not_retried("train_rl"):
        raise error
    assert str(raised.value) == line and raised.value.code == "NonRecoverableError"


@pytest.mark.parametrize(
    "error", [ConnectionError("the pod went away"), RuntimeError("CUDA error: an illegal memory access"), OSError("disk")]
)
def test_an_infrastructure_error_in_a_task_is_left_to_its_retries(error):
    from grpo_flyte.errors import input_errors_not_retried

    with pytest.raises(type(error)) as raised, input_errors_not_retried("generate"):
        raise error
    assert raised.value is error
