"""This module keeps a process's loaded models: `ClosingLRU`, one value per key, built on first use
and closed when it is dropped.

Hand-written rather than `functools.lru_cache`: that evicts after building the new entry, and a
model held by a GPU must be freed before the next one loads. Each holder is used only on the torch
thread, which serializes every use; what it holds is a cache (any value built from the same key
computes the same results).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, TypeVar

logger = logging.getLogger(__name__)

K = TypeVar("K")
V = TypeVar("V")


class ClosingLRU(Generic[K, V]):
    """Values by key, the most recently used last. Before a new value is built, the least recently
    used are closed until the new key `fits` (by default: fewer than `capacity` are held), so two
    never sit past the bound at once. Keys have a `model_path`, which the log line names."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K, build: Callable[[], V]) -> V:
        if key in self.held:
            self.held.move_to_end(key)
            return self.held[key]
        while self.held and not self.fits(key):
            old_key, old = self.held.popitem(last=False)
            logger.info("freeing %s, least recently used, for %s", self.describe(old_key), _path(key))
            old.close()  # type: ignore[attr-defined]
        self.held[key] = value = build()
        return value

    def drop(self, key: K) -> None:
        """Close and forget `key`'s value, if one is held (one that broke: the next `get` builds a new
        one). A close that fails is logged: the value is forgotten either way."""
        value = self.held.pop(key, None)
        if value is None:
            return
        logger.info("dropping %s", self.describe(key))
        try:
            value.close()  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 -- a broken value may fail to close in any way; it is gone regardless
            logger.warning("closing %s failed (%s: %s)", self.describe(key), type(exc).__name__, exc)

    def fits(self, key: K) -> bool:
        return len(self.held) < self.capacity

    def describe(self, key: K) -> str:
        return _path(key)

    def clear(self) -> None:
        while self.held:
            _, value = self.held.popitem(last=False)
            value.close()  # type: ignore[attr-defined]


def _path(key: Any) -> str:
    return str(getattr(key, "model_path", key))
