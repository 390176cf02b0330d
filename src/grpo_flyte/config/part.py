"""This module defines the base of every config part: frozen, closed to unknown keys, and hashed by
its content.

A part is a value: an unknown key is an error rather than ignored, a made part never changes, and
equal parts hash equally (their dict fields compared regardless of order).
"""

from __future__ import annotations

import json

from pydantic import ConfigDict

from grpo_flyte.types import TaskValue


class Part(TaskValue):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def __hash__(self) -> int:
        # Frozen, so hashable; some fields are dicts, compared regardless of order, so hash the
        # canonical JSON form with sorted keys (equal configs hash equally).
        return hash(json.dumps(self.model_dump(mode="json"), sort_keys=True))
