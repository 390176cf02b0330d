"""One GRPO iteration two ways: through grpo_flyte's Flyte local mode, and as plain function calls.

Both start from a fresh adapter (version 0) and run iteration 0 of a run: the same prompts, the
same sampling seeds, the same batch order, the same trainer. `flyte_iteration` is exactly what
`python -m grpo_flyte.driver --local --iterations 1` does (`train_rl` in a local run: tasks,
checkpoint, metrics, report, adapter export); `bare_iteration` calls the generator, the reward and
the trainer directly, the way a one-file script would, and writes only the two adapter versions.
Both share the process's warm engine and training model (module-level caches), so neither pays
for loading a model once warmed up.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from grpo_flyte.config.run import RunConfig
from grpo_flyte.data import sample_prompts, topup_prompts, train_eval_split
from grpo_flyte.engine import interface
from grpo_flyte.engine.batching import batch_order
from grpo_flyte.engine.cache import EngineKey, get_engine
from grpo_flyte.engine.prompts import tokenize_prompt
from grpo_flyte.engine.sampling import sub_seed as rollout_seed
from grpo_flyte.learning import policy
from grpo_flyte.learning import update as policy_update
from grpo_flyte.loop.metrics import informative_group
from grpo_flyte.reward import score
from grpo_flyte.runtime.device import resolve_dtype
from grpo_flyte.types import RolloutGroup, ScoredGroup, StepStats


def flyte_iteration(config: RunConfig, model_dir: Path, run_dir: Path) -> dict[str, Any]:
    """`train_rl` for one iteration in Flyte local mode; returns its metrics row and final adapter dir.

    The metrics row comes from the task's typed result (the CLI would write it to metrics.jsonl)."""
    import flyte
    from flyte.io import Dir

    from grpo_flyte.driver import train_rl

    assert config.iterations == 1 and config.evaluation.eval_size == 0, "one iteration, no held-out evaluation"
    runner = flyte.with_runcontext(mode="local", name=f"bench-{uuid.uuid4().hex[:10]}", raw_data_path=str(run_dir / "flyte"))
    run = runner.run(train_rl, config=config, base_model=Dir(path=str(model_dir)))
    result = run.outputs()[0]
    (row,) = [r.flat() for r in result.history]
    return {"row": row, "adapter_dir": result.adapter.dir.path}


def bare_iteration(config: RunConfig, model_dir: Path, out_dir: Path) -> dict[str, Any]:
    """init_adapter + iteration 0 (generate, score, top-up, train) as direct calls, no Flyte."""
    model_path = str(model_dir)
    iteration = 0
    dataset, _ = train_eval_split(config)
    model = policy.peft_model(config.base, config.lora, model_path)
    policy.reset_lora(model, config.seed)
    v0 = out_dir / "v0000"
    policy.save_adapter(model, None, 0, v0)

    key = EngineKey("hf", model_path, resolve_dtype(config.base.dtype), config.engine.adapter_cache_size, 0, 0)
    engine = get_engine(key)
    scored: list[ScoredGroup] = []
    prompts = sample_prompts(
        dataset, seed=config.seed, iteration=iteration, num=config.prompts_per_iter, shuffle=config.data.shuffle_dataset
    )
    for round_ in range(config.max_topup_rounds + 1):
        first = len(scored)
        requests = [
            interface.sampling_request(
                config.sampling, tokenize_prompt(engine.tokenizer, ex, config.prompt), rollout_seed(config.seed, iteration, first + i)
            )
            for i, ex in enumerate(prompts)
        ]
        # One batch per round, in the order grpo_flyte's batcher gives a batch.
        order = sorted(range(len(requests)), key=lambda k: batch_order(requests[k]))
        results = dict(zip(order, engine.generate_many([requests[k] for k in order], str(v0)), strict=True))
        for i, ex in enumerate(prompts):
            group = RolloutGroup(
                index=first + i, example=ex, adapter_version=0, prompt_ids=requests[i].prompt_ids, rollouts=results[i], generate_s=0.0
            )
            scored.append(score(config.scoring, config.sampling, group))
        missing = config.min_informative_groups - sum(informative_group(sg, config.train.truncated) for sg in scored)
        if missing <= 0 or round_ == config.max_topup_rounds:
            break
        prompts = topup_prompts(dataset, seed=config.seed, iteration=iteration, round_=round_, num=missing)

    sequences, num_rollouts = policy_update.build_sequences(scored, config.train)
    optimizer = policy.load_adapter_state(model, str(v0), config.train)
    stats = policy_update.grpo_step(model, optimizer, sequences, config.train, config.sampling) if sequences else StepStats()
    v1 = out_dir / "v0001"
    policy.save_adapter(model, optimizer, 1, v1)
    return {"scored": scored, "stats": stats, "num_rollouts": num_rollouts, "adapter_dir": str(v1)}


def same_adapter(a: str | Path, b: str | Path) -> bool:
    """Whether two adapter dirs hold bit-identical LoRA weights."""
    import torch
    from safetensors.torch import load_file

    wa = load_file(str(Path(a) / "adapter_model.safetensors"))
    wb = load_file(str(Path(b) / "adapter_model.safetensors"))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
