"""This module holds the exceptions a user can cause. Every one derives from `GrpoFlyteError`, so the
CLI catches one type.

A library error names the config field it is about (`field`), not a command-line flag: the CLI maps
the field to its flag when it prints the message, and a user of the Python API reads the field name.
A check of several options together names each by its flag and value (`given`).
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Callable, Iterator
from typing import Any


class GrpoFlyteError(Exception):
    """Bad input from the user: a one-line message saying what was given and what was expected.

    `field` is the config field the message is about (None when it is about no single field);
    `str(exc)` reads `"<field> <detail>"`.
    """

    def __init__(self, detail: str, *, field: str | None = None):
        self.field = field
        self.detail = detail
        super().__init__(f"{field} {detail}" if field else detail)


class ConfigError(GrpoFlyteError, ValueError):
    """A bad option value or config file."""


class UserError(GrpoFlyteError):
    """Bad command-line input: printed as one line, exit status 2."""


class DatasetError(GrpoFlyteError, ValueError):
    """A dataset that cannot be used; the message names the file and line."""

    def __init__(self, detail: str, *, field: str | None = "dataset"):
        super().__init__(detail, field=field)


class ModelError(GrpoFlyteError, ValueError):
    """A base model that cannot be used."""


class RewardSpecError(GrpoFlyteError, ValueError):
    """A `rewards` entry that names no built-in reward and no importable module:function."""


class RewardError(GrpoFlyteError, RuntimeError):
    """A reward function raised or returned something other than one finite number per completion."""


class RewardTimeout(RewardError):
    """A reward call ran past its time limit."""


class DeviceError(GrpoFlyteError, RuntimeError):
    """A task given a GPU that cannot use it (no CUDA, or an NVIDIA driver too old for torch's CUDA)."""


class AdapterError(GrpoFlyteError, ValueError):
    """An adapter directory that cannot be used; the message names it."""


class EnvironmentSpecError(GrpoFlyteError, ValueError):
    """An `env` that names no built-in multi-turn environment and no importable class with a `step` method."""

    def __init__(self, detail: str, *, field: str | None = "env"):
        super().__init__(detail, field=field)


class ToolSpecError(GrpoFlyteError, ValueError):
    """A `tools` entry that names no importable function with a docstring and type hints for its schema,
    or a chat template whose tool calls cannot be read."""

    def __init__(self, detail: str, *, field: str | None = "tools"):
        super().__init__(detail, field=field)


class EpisodeError(GrpoFlyteError, RuntimeError):
    """A multi-turn environment that broke its contract (a step returned no Reply); the message shows
    the episode."""


_USER_ATTRIBUTE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def is_user_attribute(name: str) -> bool:
    """Whether `name` has the shape 'module:attribute' (a custom reward or multi-turn environment)."""
    return _USER_ATTRIBUTE.fullmatch(name) is not None


def import_user_attribute(name: str, error: Callable[[str], GrpoFlyteError]) -> Any:
    """The attribute `name` ('module:attribute', user code) names, or None when the module lacks it.

    A module that does not import is `error(message)`, naming the module and why: user code fails
    to import in many ways, and each is the user's to fix where the task runs.
    """
    module_name, attr = name.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 -- any import-time failure of user code is reported alike
        raise error(
            f"{name!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); "
            "expected a module importable here (on PYTHONPATH, or in the task image on a cluster)"
        ) from None
    return getattr(module, attr, None)


NOT_RETRIED = "NonRecoverableError"  # the code Flyte gives a failure it must not retry


def not_retried(exc: BaseException) -> Exception:
    """`exc` as a failure Flyte does not retry (`flyte.errors.NonRecoverableError`), message kept.

    Bad input fails the same way on every attempt: a task raises this for a GrpoFlyteError so
    that its retries, and the driver's, are kept for what can pass the next time (a preempted
    pod, a flaky read). A parent task sees the child's failure with `code == NOT_RETRIED`.
    """
    import flyte.errors

    return flyte.errors.NonRecoverableError(str(exc))


# Errors that a retry meets again: the same code on the same inputs raises them the same way (a
# programming error, a value an engine refuses). Retries are for what can pass the next time: a
# lost pod, a flaky read or a kill for memory (OSError, RuntimeError and Flyte's own errors).
DETERMINISTIC = (ArithmeticError, AssertionError, AttributeError, ImportError, LookupError, NameError, NotImplementedError,
                 TypeError, ValueError)  # fmt: skip


def is_not_retried(exc: BaseException) -> bool:
    """Whether `exc` (as a parent task sees a child's failure) was marked `not_retried`."""
    return isinstance(exc, GrpoFlyteError) or getattr(exc, "code", None) == NOT_RETRIED


@contextlib.contextmanager
def input_errors_not_retried(task: str) -> Iterator[None]:
    """Inside task `task`: a failure that comes from the run's input (a GrpoFlyteError, or a child
    task's failure marked so) leaves the block `not_retried`, its message kept; a deterministic one
    (`DETERMINISTIC`: a programming error, an engine that refuses its settings) too, as one line
    '<task>: <type>: <message>'; anything else as it is, for the task's retries."""
    try:
        yield
    except Exception as exc:
        if is_not_retried(exc):
            raise not_retried(exc) from exc
        if isinstance(exc, DETERMINISTIC):
            import flyte.errors

            detail = " ".join(str(exc).split()) or "(no message)"
            raise flyte.errors.NonRecoverableError(f"{task}: {type(exc).__name__}: {detail}") from exc
        raise


def _recorded(failure: Any) -> str:
    """The error a failed worker process recorded (torch elastic's `ProcessFailure.message`: a dict
    holding 'Kind: detail' when the process ran under torch's `record`, else a note), '' if none."""
    message = failure.message.get("message") if isinstance(failure.message, dict) else None
    return str(message or "")


def _user_error(recorded: str) -> Exception | None:
    """The not-retried error `recorded` ('Kind: detail') names, raised again here; None for any other."""
    kind, _, detail = recorded.partition(": ")
    if kind == NOT_RETRIED:
        import flyte.errors

        return flyte.errors.NonRecoverableError(detail)
    kinds = [GrpoFlyteError]
    while kinds:
        cls = kinds.pop()
        if cls.__name__ == kind:
            return cls(detail)
        kinds.extend(cls.__subclasses__())
    return None


def failed_workers(failures: dict[int, Any], processes: int) -> Exception:
    """What a data-parallel step raises when its processes failed (torch elastic's
    `ChildFailedError.failures`, rank -> ProcessFailure): a process's input error as that error,
    which is not retried, as in a one-process step (every process reads the same inputs); else a
    RuntimeError with the first recorded error, or the exit code, which may pass the next attempt
    (a process killed for memory, say)."""
    recorded = {rank: _recorded(failure) for rank, failure in sorted(failures.items())}
    for message in recorded.values():
        error = _user_error(message)
        if error is not None:
            return error
    rank = next((r for r, message in recorded.items() if message), min(recorded))
    detail = recorded[rank] or f"exit code {failures[rank].exitcode}"
    return RuntimeError(f"train process {rank} of {processes} failed: {detail}")


def quoted(value: Any, limit: int = 200) -> str:
    """`repr(value)` for an error message, cut to `limit` characters; never raises, so that the path
    reporting a bad value cannot itself fail on it (an int of 5,000 digits has no repr, a user
    object's __repr__ may raise)."""
    if isinstance(value, int) and value.bit_length() * 0.30103 > limit:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001 -- whatever a user's __repr__ raises
        return f"a {type(value).__name__} whose repr raises {type(exc).__name__}"
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


SHOWN_VALUE_CHARS = 200  # a value echoed in an error message is cut to this many characters


def shown(value: Any) -> str:
    """repr(value) for an error message, cut to SHOWN_VALUE_CHARS."""
    return quoted(value, SHOWN_VALUE_CHARS)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def given(name: str, value: Any) -> str:
    """An option as an error about several options names it: its flag and its value, as an error
    about one option does (`--max-staleness=2`)."""
    return f"{flag(name)}={shown(value)}"
