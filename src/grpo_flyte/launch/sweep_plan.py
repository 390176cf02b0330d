"""What a local sweep is about to do, said before it starts: how many configs run at once, the memory
they take together and the time, from per-config figures; a grid that cannot fit refused in one line.

A local sweep runs every config at once in this process (launch.sweep_folder): one copy of each base
model for generation and one for training, shared by the configs; every torch computation on one
thread (runtime.torch_thread), so one train step at a time. What grows with the configs is what
each keeps between steps and what its rows hold while they decode together:

    shared     = sum over bases of 2 x params x 4 bytes      (a generator and a trainer copy, float32
                                                               at most; bfloat16 halves it)
    train step = max over configs of the micro-batch token budget x vocab x 4 bytes x 3
                                                              (logits, their log-softmax, its gradient:
                                                               the largest step's, kept mapped after it)
    per config = rows x context x layers x 2 x kv_heads x head_dim x 4 bytes
                 + 16 bytes x LoRA parameters                 (the KV cache of its rows when every
                                                               config's rows decode in one batch; the
                                                               adapter, its gradient, AdamW's two moments)

with rows = prompts_per_iter x group_size, context = max_prompt_tokens + max_new_tokens (or the episode's) and LoRA parameters = lora_rank x (d_in + d_out) summed over the
targeted linear layers (estimated as lora_rank x 4 x hidden x layers per target module). These are
upper bounds: the engine may decode the rows in several batches. The check refuses a grid whose
bound is over the machine's memory rather than run it in waves: configs in one process compare at
the same iterations (loop.lockstep) and a pruned sweep decides at each evaluation over all of them;
waves would compare the first wave's configs with nobody. Split such a grid into several sweeps.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from grpo_flyte.config.episode import context_length
from grpo_flyte.config.grid import SweepMember
from grpo_flyte.errors import UserError
from grpo_flyte.runtime.device import best_device

GIB = 1024**3
# Layers a LoRA target module name stands for per transformer block, when the folder does not say (an upper-bound guess).
_LORA_SIDES = 4


@dataclasses.dataclass(frozen=True)
class ModelFigures:
    """What a base model's config.json says of its size."""

    params: int
    vocab: int
    layers: int
    hidden: int
    kv_bytes_per_token: int  # 2 (K and V) x layers x kv_heads x head_dim x 4 bytes


def model_figures(model_dir: Path) -> ModelFigures:
    """A model folder's sizes from its config.json; its parameter count from its weight files (their
    bytes over 4 for float32 weights, else over 2) or, without them, from the config (embeddings +
    12 x hidden^2 per layer)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, layers, vocab = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    heads = int(cfg.get("num_attention_heads", 1))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    stored = 4 if (cfg.get("torch_dtype") or cfg.get("dtype")) == "float32" else 2
    params = weights // stored if weights else vocab * hidden + 12 * hidden * hidden * layers
    return ModelFigures(params=params, vocab=vocab, layers=layers, hidden=hidden, kv_bytes_per_token=2 * layers * kv_heads * head_dim * 4)


@dataclasses.dataclass(frozen=True)
class SweepPlan:
    """A local sweep's configs at once and the memory they take (bytes), by the module's formulas."""

    configs: int
    shared: int
    train_step: int
    per_config: int  # the largest config's

    @property
    def total(self) -> int:
        return self.shared + self.train_step + self.configs * self.per_config

    def fitting(self, memory: int) -> int:
        """How many configs of this plan fit in `memory` bytes."""
        return max(0, (memory - self.shared - self.train_step) // max(1, self.per_config))


def plan_sweep(members: Sequence[SweepMember], model_dirs: Mapping[str, Path]) -> SweepPlan:
    """The plan of running `members` at once (`model_dirs`: each member's base model folder, by name)."""
    figures = {name: model_figures(path) for name, path in model_dirs.items()}
    bases = {str(path): figures[name] for name, path in model_dirs.items()}
    shared = sum(2 * f.params * 4 for f in bases.values())
    train_step = per_config = 0
    for m in members:
        f, c = figures[m.name], m.config
        train_step = max(train_step, c.train.token_budget(best_device()) * f.vocab * 4 * 3)
        rows = c.prompts_per_iter * c.sampling.group_size
        kv = rows * context_length(c.prompt, c.sampling, c.episode) * f.kv_bytes_per_token
        lora = c.lora.lora_rank * _LORA_SIDES * f.hidden * f.layers * len(c.lora.lora_target_modules)
        per_config = max(per_config, kv + 16 * lora)
    return SweepPlan(configs=len(members), shared=shared, train_step=train_step, per_config=per_config)


def machine_memory() -> int:
    """This machine's memory in bytes (physical pages x page size)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan_line(plan: SweepPlan, memory: int, seconds_per_iteration: float | None = None, iterations: int = 0) -> str:
    """The line a sweep starts with: configs at once, memory (and time, from the configs' kept
    iterations on a resume); raises UserError when the memory is over `memory`."""
    need = (
        f"{plan.configs} configs at once take about {plan.total / GIB:.1f} GiB at most "
        f"({plan.shared / GIB:.1f} GiB of base models, {plan.train_step / GIB:.1f} GiB for a train step, "
        f"{plan.configs} x {plan.per_config / GIB:.2f} GiB per config: docs/configuration.md#sweeps)"
    )
    if plan.total > memory:
        raise UserError(
            f"the sweep's {need}, more than this machine's {memory / GIB:.1f} GiB: about {plan.fitting(memory)} configs fit; "
            "sweep fewer values, or split the grid into sweeps of that many"
        )
    when = (
        f"; about {seconds_per_iteration * iterations / 60:.0f} min more at {seconds_per_iteration:.0f} s per iteration so far"
        if seconds_per_iteration is not None
        else "; the time per iteration is known after the first (each config's bar then shows its ETA)"
    )
    return f"{need}; this machine has {memory / GIB:.1f} GiB{when}"
