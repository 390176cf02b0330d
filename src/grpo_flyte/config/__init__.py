"""This package holds the one config object that describes a run (`RunConfig`, composed of one part
per concern) and what surrounds it: defaults that depend on other options, config files, TRL's
names, the validation errors as a user reads them, the options table, and a sweep's grid of configs.

`RunConfig` and its parts are re-exported here, so `from grpo_flyte.config import RunConfig`
keeps working; everything else is imported from its module.
"""

from grpo_flyte.config.episode import EpisodeConfig
from grpo_flyte.config.generation import DataConfig, EngineConfig, JudgeConfig, ModelConfig, PromptConfig, RewardConfig, SamplingConfig
from grpo_flyte.config.run import RunConfig
from grpo_flyte.config.training import EvalConfig, GuardConfig, LoraConfig, TrainConfig

__all__ = [
    "DataConfig",
    "EngineConfig",
    "EpisodeConfig",
    "EvalConfig",
    "GuardConfig",
    "JudgeConfig",
    "LoraConfig",
    "ModelConfig",
    "PromptConfig",
    "RewardConfig",
    "RunConfig",
    "SamplingConfig",
    "TrainConfig",
]
