"""grpo_flyte runs GRPO + LoRA reinforcement learning for LLMs as ordinary Flyte 2 tasks.

Importing the package is cheap: tasks live in `grpo_flyte.rollout`, `.reward`, `.trainer` and
`.driver`, and import torch, transformers, peft and vLLM only when they run. The values they
exchange are in `grpo_flyte.types`, the run's config in `grpo_flyte.config`, and every error a
user can cause derives from `grpo_flyte.errors.GrpoFlyteError`. `python -m grpo_flyte` is the CLI.
`MultiTurnEnv` and `Reply` are what a multi-turn environment is written with (grpo_flyte.multiturn).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo_flyte.config.run import RunConfig
    from grpo_flyte.multiturn import MultiTurnEnv, Reply

__all__ = ["MultiTurnEnv", "Reply", "RunConfig", "__version__"]
__version__ = "0.1.0"

# Where each name of the package lives: imported on first use, so that importing a module of the
# package (a reward worker imports grpo_flyte.reward_fns) does not import the config and Flyte.
_HOMES = {"RunConfig": "grpo_flyte.config.run", "MultiTurnEnv": "grpo_flyte.multiturn", "Reply": "grpo_flyte.multiturn"}


def __getattr__(name: str):
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'grpo_flyte' has no attribute {name!r}")
