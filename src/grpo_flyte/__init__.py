"""grpo_flyte: GRPO + LoRA reinforcement learning for LLMs as ordinary Flyte 2 tasks.

Importing the package is cheap: tasks live in `grpo_flyte.rollout`, `.reward`, `.trainer` and
`.driver`, and import torch, transformers, peft and vLLM only when they run. The values they
exchange are in `grpo_flyte.types`, the run's config in `grpo_flyte.config`, and every error a
user can cause derives from `grpo_flyte.errors.GrpoFlyteError`. `python -m grpo_flyte` is the CLI.
`MultiTurnEnv` and `Reply` are what a multi-turn environment is written with (grpo_flyte.multiturn).
"""

from grpo_flyte.config import RunConfig
from grpo_flyte.multiturn import MultiTurnEnv, Reply

__all__ = ["MultiTurnEnv", "Reply", "RunConfig", "__version__"]
__version__ = "0.1.0"
