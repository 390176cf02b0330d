"""A second module with a tool named `add` (two tools may not share a name)."""


def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b
