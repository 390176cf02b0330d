"""This package provides the base models: the embedded SmolLM2-135M-Instruct, model folders and Hub
ids, loading a base (in 16 bits or NF4), and the attention kernels a loaded model runs with; and
the sequence-classification reward models a run's rewards may name.

`embedded_model_dir` is re-exported here (`from grpo_flyte.models import embedded_model_dir`, as
the README and examples use it); everything else is imported from its module.
"""

from grpo_flyte.models.embedded import embedded_model_dir

__all__ = ["embedded_model_dir"]
