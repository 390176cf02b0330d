"""Adapter swap on a warm replica: seconds from a new adapter directory to the first completion with it.

HF backend (transformers + PEFT) on CPU, the embedded SmolLM2-135M-Instruct in bfloat16. The
replica is warm: its engine is built and has already served an adapter, and its adapter cache is
full (--adapter-cache-size, 4), so each new adapter also evicts the oldest, as in a long run. Each
trial gets an adapter directory it has never seen, saved by the trainer (`save_adapter`, as
init_adapter writes them), and measures:

- load only: attaching the new adapter to the warm engine (PEFT load_adapter + set_adapter +
  eviction), the first thing a generate call does with a new adapter;
- first token (task path): the `generate` task's body, as a warm replica runs it (the adapter
  dir resolved, the 50 ms batching window, load, a 1-token group of 2), called in-process;
- first completion: load + a 16-token completion of one prompt, through the engine;
and the same with an adapter already loaded (cache hit), so the load's share shows.

vLLM (LoRARequest on a GPU) is not measured: this machine has no GPU.

    python benchmarks/adapter_swap.py            # 10 trials, ~1 minute
    python benchmarks/adapter_swap.py --quick    # the plumbing: the tests' tiny model, 1 trial, 4-token completions
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common
from flyte.io import Dir

from grpo_flyte import rollout
from grpo_flyte.config.run import RunConfig
from grpo_flyte.data import arithmetic_split
from grpo_flyte.engine.cache import EngineKey, get_engine
from grpo_flyte.engine.interface import SamplingRequest
from grpo_flyte.engine.prompts import tokenize_prompt
from grpo_flyte.learning import policy
from grpo_flyte.models.embedded import embedded_model_dir
from grpo_flyte.runtime.device import resolve_dtype
from grpo_flyte.runtime.torch_thread import on_torch_thread
from grpo_flyte.types import AdapterRef

TARGET_S = 1.0
SHORT_COMPLETION_TOKENS = 16


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__, "adapter_swap.json")
    p.add_argument("--trials", type=int, default=10)
    args = p.parse_args(argv)
    _common.quiet_logs()
    trials = 1 if args.quick else args.trials
    completion_tokens = 4 if args.quick else SHORT_COMPLETION_TOKENS
    # group_size 2 (the smallest group) and 1 new token: the task path's "first completion".
    config = RunConfig(group_size=2, max_new_tokens=1, backend="hf")
    model_dir = _common.quick_model() if args.quick else embedded_model_dir()
    model_path = str(model_dir)
    example = arithmetic_split("train")[0]
    root = Path(tempfile.mkdtemp(prefix="grpo_flyte-swap-"))
    try:
        # Adapter dirs as init_adapter writes them (fresh seeded LoRA weights; the generator reads
        # only the weights, never the trainer's AdamW state).
        # Every torch call goes through the thread the generate task uses (grpo_flyte.runtime.torch_thread):
        # torch driven from two threads is slower on both.
        def make_adapter(k: int) -> str:
            train_model = policy.peft_model(config.base, config.lora, model_path)
            policy.reset_lora(train_model, seed=k)
            out = root / f"v{k:04d}"
            policy.save_adapter(train_model, None, k, out)
            return str(out)

        dirs = [on_torch_thread(make_adapter, k) for k in range(config.engine.adapter_cache_size + 3 * trials + 1)]
        adapter_bytes = sum(f.stat().st_size for f in Path(dirs[0]).iterdir())

        engine = on_torch_thread(
            get_engine,
            EngineKey("hf", model_path, resolve_dtype(config.base.dtype), config.engine.adapter_cache_size, 0, 0),
        )
        prompt_ids = tokenize_prompt(engine.tokenizer, example, config.prompt)
        short = SamplingRequest(
            prompt_ids=prompt_ids, group_size=1, temperature=config.sampling.temperature, top_p=config.sampling.top_p,
            max_new_tokens=completion_tokens, seed=0,
        )  # fmt: skip
        fresh = iter(dirs)
        # Warm: engine built, a first adapter served, the adapter cache filled.
        for _ in range(config.engine.adapter_cache_size):
            on_torch_thread(engine.generate_many, [short], next(fresh))
        cached = dirs[config.engine.adapter_cache_size - 1]  # the most recently used: stays loaded

        def load_only() -> dict:
            path = next(fresh)
            started = time.perf_counter()
            on_torch_thread(engine._activate, path)  # the step generate_many starts with
            return {"s": time.perf_counter() - started}

        def first_token_task(path: str | None = None) -> dict:
            path = path or next(fresh)
            adapter = AdapterRef(version=0, dir=Dir(path=path))
            started = time.perf_counter()
            parts = (config.base, config.engine, config.prompt, config.sampling, config.episode)
            group = asyncio.run(rollout.generate(*parts, Dir(path=model_path), adapter, example, 0, 0))
            assert len(group.rollouts) == 2 and all(len(r.completion_ids) == 1 for r in group.rollouts)
            return {"s": time.perf_counter() - started}

        def first_completion(path: str | None = None) -> dict:
            path = path or next(fresh)
            started = time.perf_counter()
            (rollouts,) = on_torch_thread(engine.generate_many, [short], path)
            return {"s": time.perf_counter() - started, "tokens": len(rollouts[0].completion_ids)}

        first_completion(cached), first_token_task(cached)  # the task path's own first call
        runs = _common.alternate(
            {
                "load only": load_only,
                "first token (task path)": first_token_task,
                "first token, cached adapter": lambda: first_token_task(cached),
                "first completion": first_completion,
                "first completion, cached": lambda: first_completion(cached),
            },
            trials,
            log=lambda line: None,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = {name: statistics.median(r["s"] for r in rs) for name, rs in runs.items()}
    worst = {name: max(r["s"] for r in rs) for name, rs in runs.items()}
    headline = med["first token (task path)"]
    print(f"adapter: {adapter_bytes / 1e6:.1f} MB on disk; {trials} trials, median (max)")
    for name in runs:
        print(f"  {name:<30} {med[name]:.3f} s  ({worst[name]:.3f})")
    print(
        f"\nnew adapter dir -> first completion on a warm HF replica: {headline:.3f} s "
        f"({'met' if headline < TARGET_S else 'MISSED'}: target < {TARGET_S:g} s); load only {med['load only']:.3f} s; "
        f"a {completion_tokens}-token completion with a new adapter {med['first completion']:.3f} s "
        f"vs {med['first completion, cached']:.3f} s cached"
    )
    print("  vLLM (GPU) not measured: no GPU on this machine")
    _common.write_result(
        _common.out_file(args),
        {
            "benchmark": "adapter_swap",
            "machine": _common.machine(),
            "backend": "hf",
            "trials": trials,
            "adapter_bytes": adapter_bytes,
            "runs": runs,
            "median_s": med,
            "max_s": worst,
            "headline_s": headline,
            "target_s": TARGET_S,
            "vllm": "not measured (no GPU)",
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
