"""This module holds the names, defaults and limits the config shares with the code it configures.

The built-in model and datasets, the default prompts, and the bounds on train processes, staleness
and a sweep's base models: the config parts take their defaults and bounds from here, and the
command line, the data, the engines, the trainer and a sweep's grid use the same values.
"""

from __future__ import annotations

from typing import Literal

PROG = "python -m grpo_flyte.driver"  # the command line, as messages name it
EMBEDDED_MODEL = "embedded"
ARITHMETIC_DATASET = "arithmetic"
GSM8K_DATASET = "gsm8k"
DATASET_FILE_TYPES = (".jsonl", ".parquet", ".csv")
# Data files that look supported but are not (a .json array, tab-separated text, ...).
UNSUPPORTED_FILE_TYPES = (".json", ".tsv", ".txt", ".xlsx", ".arrow", ".gz", ".zip")
REWARD_TIMEOUT_S = 10.0  # the default of reward_timeout_s
# Local data-parallel train processes at most (--train-processes).
MAX_TRAIN_PROCESSES = 64
# A pipelined run's generate replica has up to MAX_STALENESS + 2 adapter versions in use (rollout._adapter_dirs).
MAX_STALENESS = 6
# The base models (model and dtype) a sweep may train at once: each is held on every replica that
# serves it (a generate engine, a loaded base on the train side, a downloaded folder), so a
# replica holds this many at most, the least recently used evicted past it.
MAX_BASES = 3
# The reward models (--rewards entries naming a model) a run, or a sweep's configs together, may
# name: a reward-model replica holds each loaded (models.reward_model's cache), never evicting one a
# run still scores with.
MAX_REWARD_MODELS = 3
# The share of a generate replica's GPU its vLLM engines may reserve together (their
# vllm_memory_fraction summed): a sweep over base models holds one engine per base.
VLLM_MEMORY_BUDGET = 0.9
# A local run is one process on one GPU, the trainer beside the vLLM engines: the engines together
# reserve this share of vllm_memory_fraction, and the rest of the GPU is the trainer's
# (loop.batches.local_vllm_share).
LOCAL_VLLM_SHARE = 0.5
# The experiment trackers --report-to names (TRL's report_to), each an optional extra of its own.
TRACKERS = ("wandb", "trackio", "mlflow", "tensorboard")
# The GGUF tensor types --export-gguf and the export command's --quant take (models.gguf_writer's QUANT_TYPES).
GGUFQuant = Literal["f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0"]
# Dollars per hour of one accelerator by type (the GPU name of GRPO_FLYTE_*_GPU): the defaults of
# --prices. AWS EC2 on-demand Linux, us-east-1, an instance's price over its GPUs (L4 g6.xlarge,
# A100 p4d.24xlarge after AWS's June 2025 cut, H100 p5.48xlarge, H200 p5en.48xlarge), as public
# records of AWS's price list give them, none read from AWS's own page: each one's source, date and
# whether it is verified are in docs/cluster.md#what-a-run-costs.
LIST_PRICES = {"L4": 0.8048, "A100": 2.7447, "H100": 6.88, "H200": 7.912}
SYSTEM_PROMPT = (
    "You are a careful assistant that solves arithmetic problems. Think briefly, then end your "
    "reply with the final answer on its own line as '#### <integer>'."
)
# Appended to the question in the user turn: a small model follows an instruction there more
# often than one in the system prompt
# (docs/measurements.md#before-issue-36-the-old-recipe-one-seed-at-a-time-kept-as-a-record).
ANSWER_INSTRUCTION = "End your reply with '#### <integer>'."
