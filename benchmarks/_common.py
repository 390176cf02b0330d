"""Helpers shared by the speed benchmarks: alternating sides, medians, the machine, the JSON file.

The machine these run on is shared and noisy, so no benchmark trusts one timing: the sides it
compares run alternately (A B, B A, A B, ...) in one process and every figure is a median.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any, Self


def parser(doc: str | None, default_out: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small smoke check (seconds, not minutes)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"where the JSON of results goes (default: benchmarks/{default_out}; --quick: only with --out)",
    )
    p.set_defaults(default_out=Path(__file__).parent / default_out)
    return p


QUICK_MODEL = "a 2-layer, 32-wide random Llama with the embedded model's tokenizer (--quick)"


def quick_model() -> Path:
    """The model of a --quick run: the tests' tiny random Llama (tests/support/tiny_model.py: 2
    layers, 32 wide, seed 0, the embedded SmolLM2's tokenizer and chat template). A quick run checks
    the plumbing (the same functions, tasks and files as the full run), which this model runs in a
    fraction of the embedded model's time; its figures mean nothing. Built once into grpo_flyte's
    cache (beside the embedded model's copy, under a key of both) and reused, so that a quick run's
    saved config names the same model every time (a resumed quick sweep finds it)."""
    import hashlib

    root = Path(__file__).resolve().parents[1]  # the checkout, where the tests' helpers live
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from grpo_flyte.models.embedded import embedded_model_dir
    from grpo_flyte.runtime.files import build_dir_atomic
    from tests.support import tiny_model

    embedded = embedded_model_dir()
    key = hashlib.sha256(f"{embedded.name}:{Path(tiny_model.__file__).read_text()}".encode()).hexdigest()[:12]
    target = embedded.parent / f"quick-tiny-llama-{key}"
    if not (target / "config.json").is_file():
        try:
            build_dir_atomic(target, lambda staging: tiny_model.build_tiny_model(staging, embedded), replace=False)
        except OSError:
            if not (target / "config.json").is_file():  # else a concurrent quick run built it first
                raise
    return target


def out_file(args: argparse.Namespace) -> Path | None:
    """Where the results go: --out, else the committed figures' file, except in a quick run (its
    figures are no measurement: they never replace the committed ones)."""
    return args.out or (None if args.quick else args.default_out)


def quiet_logs() -> None:
    """The benchmarks print their own summary; library progress lines would bury it."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", force=True)
    for name in ("grpo_flyte", "flyte", "transformers", "peft", "trl", "accelerate", "datasets"):
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def alternate(
    sides: dict[str, Callable[[], dict[str, Any]]], rounds: int, log: Callable[[str], None] = print
) -> dict[str, list[dict[str, Any]]]:
    """Run each side once per round, the order rotated every round; each call returns a dict with
    at least "s" (its seconds). Returns every side's results in the order they ran."""
    names = list(sides)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            out = sides[name]()
            results[name].append(out)
            log(f"  round {r + 1}/{rounds}  {name:<24} {out['s']:8.2f} s" + (f"  ({out['note']})" if out.get("note") else ""))
    return results


def median_s(runs: list[dict[str, Any]], key: str = "s") -> float:
    return statistics.median(r[key] for r in runs)


def paired_ratios(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str = "s") -> list[float]:
    """a/b round by round: the two runs of one round saw the most similar machine load."""
    return [x[key] / y[key] for x, y in zip(a, b, strict=True)]


def machine() -> dict[str, Any]:
    import torch

    return {
        "date": date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def write_result(path: Path | None, result: dict[str, Any]) -> None:
    result["load_average_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    if path is None:
        print("\nresults not written (--out FILE writes them)")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nresults: {path}")


def verdict(ratio: float, target: float, higher_is_better: bool = False) -> str:
    met = ratio >= target if higher_is_better else ratio <= target
    return f"target {'>=' if higher_is_better else '<='} {target:g}x: {'met' if met else 'MISSED'}"


class Stopwatch:
    def __enter__(self) -> Self:
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.s = time.perf_counter() - self.started


def flush() -> None:
    sys.stdout.flush()


def arithmetic_reward(completion: str, answer: str) -> float:
    """The default reward (RunConfig's `rewards`) of one completion, as the score_group task gives it."""
    from grpo_flyte.reward_fns import DEFAULT_REWARDS
    from grpo_flyte.scoring.compose import Group, score_completions

    parts = score_completions([completion], Group(question="", answer=answer, max_new_tokens=1, num_tokens=[0]), weights=DEFAULT_REWARDS)
    return parts[0].reward


def every_rollout_sequences(engine, config, dataset, adapter_dir, iteration: int) -> list:
    """An iteration's rollouts of a default run as training sequences, every one of them in the loss
    (a group whose rewards are all equal gets advantages +1, -1, +1, ... instead of 0): the most a
    train step on this batch can hold, for the benchmarks that time or weigh the step."""
    from grpo_flyte.data import sample_prompts
    from grpo_flyte.engine.interface import sampling_request
    from grpo_flyte.engine.prompts import tokenize_prompt
    from grpo_flyte.engine.sampling import sub_seed
    from grpo_flyte.learning import grpo

    prompts = sample_prompts(dataset, seed=config.seed, iteration=iteration, num=config.prompts_per_iter)
    requests = [
        sampling_request(config.sampling, tokenize_prompt(engine.tokenizer, ex, config.prompt), sub_seed(config.seed, iteration, i))
        for i, ex in enumerate(prompts)
    ]
    sequences = []
    for ex, request, group in zip(prompts, requests, engine.generate_many(requests, str(adapter_dir)), strict=True):
        advantages = grpo.group_advantages([arithmetic_reward(r.text, ex.answer) for r in group], config.train.advantage_eps, True)
        for k, (r, adv) in enumerate(zip(group, advantages, strict=True)):
            adv = adv or (1.0 if k % 2 == 0 else -1.0)
            sequences.append(grpo.TrainSequence(request.prompt_ids, r.completion_ids, adv, r.sampling_logprobs))
    return sequences
