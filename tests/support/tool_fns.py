"""Tools for the tests (`--tools tool_fns:add`, or `tests.support.tool_fns:add` from the root):
one of each outcome a tool call can have."""

import os
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: What to upper-case.
    """
    return text.upper()


def chatty(n: int) -> None:
    """Print a count and return nothing.

    Args:
        n: The count.
    """
    print(f"counted {n}")


def record(key: str) -> dict:
    """Return a record.

    Args:
        key: The key.
    """
    return {"key": key, "values": [1, 2]}


def opaque() -> object:
    """Return an object that JSON cannot hold."""
    return {1, 2}


def broken(x: int) -> str:
    """Raise.

    Args:
        x: Anything.
    """
    raise KeyError(f"no entry {x}")


def sleepy(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


def vanishing() -> str:
    """End the worker's process."""
    os._exit(3)


def undocumented(a: int) -> int:
    return a


def untyped(a):
    """No type hint.

    Args:
        a: Anything.
    """
    return a


NOT_A_FUNCTION = 42
