"""Time-to-accuracy race: grpo_flyte --local against TRL's GRPOTrainer, the same wall-clock budget each.

Both sides train the embedded SmolLM2-135M-Instruct on the arithmetic task with the same reward
(grpo_flyte's default: the answer alone, `correct=1.0`) and, where both have them, the same
settings (grpo_flyte's defaults): 8 prompts x 8 completions a step, the default learning rate
(constant, no warm-up), LoRA r=16 alpha=32 on q/k/v/o, the default temperature, top-p 1, 64 new
tokens, no KL term, the per-sequence GRPO loss (TRL's loss_type='grpo'), epsilon 0.2, gradient clip
1.0. One side runs after the other on the same machine, once per seed (`--seeds`: the end point of
one run moves with its seed, so the race reports each seed and the mean and worst over them):
- grpo_flyte: `python -m grpo_flyte.driver --local` in a subprocess, killed when the budget is
  spent; its adapter is the newest version in the run folder (the last iteration finished in time).
- TRL: GRPOTrainer in this process with TRL's fastest settings on this CPU (vs_trl.py's: bfloat16
  weights where bfloat16 is fast, no gradient checkpointing); it stops at the first step that ends
  past the budget, and its adapter is the one saved after the last step that ended within it.
Each side's clock starts before it loads anything (process start, model load and adapter init
count), and each side makes at least one step whatever the budget.

Then one evaluator (grpo_flyte's transformers engine, greedy, the chat prompt both sides trained
on) answers the same held-out questions with the untrained adapter and with each side's final one.

Settings that could not be matched, and why:
- grpo_flyte tops a batch up with fresh prompts until 4 groups are informative (at most 2 rounds)
  and scores a truncated completion at the group's minimum reward: these are part of its method
  and TRL has neither (TRL trains on every group as sampled).
- TRL shuffles its dataset with its own sampler; grpo_flyte samples prompts by (seed, iteration).
  Both draw from the same training split; neither sees the held-out questions.
- grpo_flyte corrects each token by the generator/trainer importance weight; TRL does so only with
  vLLM generation, which this CPU comparison does not use.

    python benchmarks/race_trl.py                  # 10 minutes a side, seeds 0 1 2, 200 held-out questions
    python benchmarks/race_trl.py --budget-min 5 --seeds 0   # a shorter race
    python benchmarks/race_trl.py --quick          # one tiny step a side of the tests' tiny model, 4 questions, one seed
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback
from vs_trl import TRL_FAST_BF16, TRL_FAST_FP32, trl_args, trl_reward, trl_rows

from grpo_flyte.config.run import RunConfig
from grpo_flyte.data import train_eval_split
from grpo_flyte.loop.metrics import mean_ci95
from grpo_flyte.models.folders import resolve_local_model
from grpo_flyte.runtime.device import fast_bfloat16, resolve_dtype
from grpo_flyte.runtime.torch_thread import on_torch_thread

POLL_S = 0.5
EVAL_SIZE = 200
SEEDS = (0, 1, 2)


def race_config(quick: bool, seed: int) -> RunConfig:
    """The shared settings (grpo_flyte's defaults are the race's; --quick: tiny ones, on the tests' tiny model)."""
    sizes = {"prompts_per_iter": 2, "group_size": 2, "max_new_tokens": 8, "min_informative_groups": 0} if quick else {}
    if quick:
        sizes["model"] = str(_common.quick_model())
    return RunConfig(iterations=1, eval_size=4 if quick else EVAL_SIZE, seed=seed, beta=0.0, lr_scheduler_type="constant", **sizes)


def grpo_flyte_side(config: RunConfig, budget_s: float, work: Path) -> dict[str, Any]:
    """`python -m grpo_flyte.driver --local` until the budget is spent; returns steps and adapter."""
    run_dir = work / "grpo_flyte-run"
    command = [
        sys.executable, "-m", "grpo_flyte.driver", "--local", "--model", config.base.model, "--run-dir", str(run_dir), "--iterations", "100000",
        "--eval-size", "0", "--seed", str(config.seed), "--prompts-per-iter", str(config.prompts_per_iter),
        "--group-size", str(config.sampling.group_size), "--max-new-tokens", str(config.sampling.max_new_tokens),
        "--learning-rate", str(config.train.learning_rate), "--beta", "0", "--lr-scheduler-type", "constant",
        "--min-informative-groups", str(config.min_informative_groups),
    ]  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    log = work / "grpo_flyte.log"
    started = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None:
                done = _rows(metrics)
                if time.perf_counter() - started >= budget_s and done:
                    break
                time.sleep(POLL_S)
        finally:
            elapsed = time.perf_counter() - started
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    rows = _rows(metrics)
    if not rows:
        raise SystemExit(f"grpo_flyte finished no iteration (exit {proc.returncode}); its output: {log}\n{log.read_text()[-3000:]}")
    version = rows[-1]["adapter_version"]
    adapter = run_dir / "flyte" / "adapters" / f"v{version:04d}"
    return {
        "steps": len(rows),
        "seconds": elapsed,
        "adapter": str(adapter),
        "seconds_per_step": statistics.median(r["iteration_s"] for r in rows),
    }


def _rows(metrics: Path) -> list[dict[str, Any]]:
    if not metrics.exists():
        return []
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return [r for r in rows if r.get("iteration", 0) > 0]


class Budget(TrainerCallback):
    """Save the adapter after every step that ends within the budget; stop at the first that does not."""

    def __init__(self, started: float, budget_s: float, out: Path):
        self.started, self.budget_s, self.out = started, budget_s, out
        self.steps = 0
        self.step_seconds: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_started = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        now = time.perf_counter()
        self.step_seconds.append(now - self._step_started)
        if now - self.started < self.budget_s or self.steps == 0:
            model.save_pretrained(str(self.out))
            self.steps += 1
            self.ended = now
        if now - self.started >= self.budget_s:
            control.should_training_stop = True


def trl_side(config: RunConfig, budget_s: float, work: Path) -> dict[str, Any]:
    from datasets import Dataset
    from trl import GRPOTrainer

    started = time.perf_counter()
    dataset, _ = train_eval_split(config)
    args, lora = trl_args(
        config,
        work / "trl-out",
        TRL_FAST_BF16 if fast_bfloat16() else TRL_FAST_FP32,
        loss_type="grpo",
        scale_rewards="group",
        epsilon=config.train.epsilon,
        epsilon_high=config.train.epsilon_high,
        max_grad_norm=config.train.max_grad_norm,
        weight_decay=config.train.weight_decay,
        lr_scheduler_type="constant",
        max_steps=1_000_000,  # the budget stops it
    )
    budget = Budget(started, budget_s, work / "trl-adapter")
    trainer = GRPOTrainer(
        model=str(resolve_local_model(config.base.model)),
        reward_funcs=trl_reward,
        args=args,
        train_dataset=Dataset.from_list(trl_rows(dataset)),
        peft_config=lora,
        callbacks=[budget],
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return {
        "steps": budget.steps,
        "seconds": budget.ended - started,
        "adapter": str(work / "trl-adapter"),
        "seconds_per_step": statistics.median(budget.step_seconds),
    }


def evaluate(config: RunConfig, adapters: dict[str, str]) -> dict[str, list[tuple[float, bool]]]:
    """(reward, correct) per held-out question for each adapter, greedily, by one evaluator."""
    from grpo_flyte.engine.hf_generator import HFGenerator
    from grpo_flyte.engine.interface import sampling_request
    from grpo_flyte.engine.prompts import tokenize_prompt
    from grpo_flyte.scoring.compose import Group, score_completions

    _, held_out = train_eval_split(config)
    engine = HFGenerator(str(resolve_local_model(config.base.model)), resolve_dtype(config.base.dtype), max_adapters=1)
    requests = [
        sampling_request(config.sampling, tokenize_prompt(engine.tokenizer, ex, config.prompt), seed=0, greedy=True) for ex in held_out
    ]
    results = {}
    for name, adapter in adapters.items():
        answers = engine.generate_many(requests, adapter)
        results[name] = []
        for ex, [rollout] in zip(held_out, answers, strict=True):
            group = Group(
                question=ex.question,
                answer=ex.answer,
                max_new_tokens=config.sampling.max_new_tokens,
                num_tokens=[len(rollout.completion_ids)],
            )
            [parts] = score_completions([rollout.text], group, config.scoring.rewards)
            results[name].append((parts.reward, parts.correct))
        print(f"  evaluated {name}: accuracy {statistics.mean(c for _, c in results[name]):.1%}")
        _common.flush()
    engine.close()
    return results


def untrained_adapter(config: RunConfig, out: Path) -> str:
    """The adapter both sides start from in effect (LoRA B = 0: the base model's answers)."""
    from grpo_flyte.learning import policy

    model = policy.peft_model(config.base, config.lora, str(resolve_local_model(config.base.model)))
    policy.reset_lora(model, config.seed)
    policy.save_adapter(model, None, 0, out)
    return str(out)


def summary(before: list[tuple[float, bool]], after: list[tuple[float, bool]], side: dict[str, Any]) -> dict[str, Any]:
    reward_before, reward_before_ci = mean_ci95([r for r, _ in before])
    acc_before, acc_before_ci = mean_ci95([float(c) for _, c in before])
    reward_after, reward_after_ci = mean_ci95([r for r, _ in after])
    acc_after, acc_after_ci = mean_ci95([float(c) for _, c in after])
    return {
        "steps": side["steps"],
        "seconds": side["seconds"],
        "seconds_per_step": side["seconds_per_step"],
        "accuracy_before": acc_before,
        "accuracy_before_ci95": acc_before_ci,
        "accuracy_after": acc_after,
        "accuracy_after_ci95": acc_after_ci,
        "reward_before": reward_before,
        "reward_before_ci95": reward_before_ci,
        "reward_after": reward_after,
        "reward_after_ci95": reward_after_ci,
    }


def race_seed(quick: bool, seed: int, budget_s: float, before: list[tuple[float, bool]] | None) -> tuple[dict[str, Any], list]:
    """One seed's race: both sides, then one evaluator on the untrained adapter (unless `before` is
    given: it is the same for every seed) and both trained ones."""
    config = race_config(quick, seed)
    work = Path(tempfile.mkdtemp(prefix="grpo_flyte-race-"))
    try:
        print(f"seed {seed}: grpo_flyte ...")
        _common.flush()
        ours = grpo_flyte_side(config, budget_s, work)
        print(f"  {ours['steps']} steps in {ours['seconds']:.0f} s")
        print(f"seed {seed}: TRL ...")
        _common.flush()
        theirs = on_torch_thread(trl_side, config, budget_s, work)
        print(f"  {theirs['steps']} steps in {theirs['seconds']:.0f} s")
        adapters = {"grpo_flyte": ours["adapter"], "trl": theirs["adapter"]}
        if before is None:
            adapters["untrained"] = untrained_adapter(config, work / "v0000")
        scores = on_torch_thread(evaluate, config, adapters)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    before = scores.get("untrained", before)
    result = {side: summary(before, scores[side], run) for side, run in (("grpo_flyte", ours), ("trl", theirs))}
    diff, diff_ci = mean_ci95([float(a[1]) - float(b[1]) for a, b in zip(scores["grpo_flyte"], scores["trl"], strict=True)])
    result.update(paired_accuracy_diff=diff, paired_accuracy_diff_ci95=diff_ci)
    verdict = "grpo_flyte ahead" if diff > 0 else "TRL ahead" if diff < 0 else "a tie"
    interval = "no interval" if diff_ci is None or math.isnan(diff_ci) else f"+- {diff_ci:.3f}"
    print(
        f"seed {seed}: held-out accuracy after {budget_s / 60:.1f} min: grpo_flyte {result['grpo_flyte']['accuracy_after']:.1%} "
        f"({result['grpo_flyte']['steps']} steps), TRL {result['trl']['accuracy_after']:.1%} ({result['trl']['steps']} steps), "
        f"before {result['trl']['accuracy_before']:.1%}; paired difference {diff:+.3f} {interval} ({verdict})"
    )
    return result, before


def over_seeds(per_seed: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Each side's held-out accuracy after the race, and the paired difference: mean and worst seed."""

    def spread(values: list[float]) -> dict[str, float]:
        return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}

    return {
        "grpo_flyte_accuracy_after": spread([r["grpo_flyte"]["accuracy_after"] for r in per_seed.values()]),
        "trl_accuracy_after": spread([r["trl"]["accuracy_after"] for r in per_seed.values()]),
        "paired_accuracy_diff": spread([r["paired_accuracy_diff"] for r in per_seed.values()]),
        "grpo_flyte_steps": spread([r["grpo_flyte"]["steps"] for r in per_seed.values()]),
        "trl_steps": spread([r["trl"]["steps"] for r in per_seed.values()]),
    }


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__, "race_trl.json")
    p.add_argument("--budget-min", type=float, default=10.0, help="wall-clock minutes per side (default 10)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="one race per seed (default 0 1 2)")
    args = p.parse_args(argv)
    _common.quiet_logs()
    try:
        import trl
    except ImportError:
        print("TRL is not installed: pip install 'grpo-flyte[bench]'")
        return 1
    budget_s = 0.0 if args.quick else args.budget_min * 60  # quick: the one step each side makes whatever the budget
    seeds = args.seeds[:1] if args.quick else args.seeds
    config = race_config(args.quick, seeds[0])
    print(
        f"race: {budget_s / 60:.1f} min a side, seeds {' '.join(map(str, seeds))}; {config.prompts_per_iter} prompts x "
        f"{config.sampling.group_size} completions a step, {config.sampling.max_new_tokens} new tokens; "
        f"{config.evaluation.eval_size} held-out questions; TRL {trl.__version__}"
    )
    machine = _common.machine()
    per_seed, before = {}, None
    for seed in seeds:
        per_seed[seed], before = race_seed(args.quick, seed, budget_s, before)
    spread = over_seeds(per_seed)
    ours, theirs, diff = spread["grpo_flyte_accuracy_after"], spread["trl_accuracy_after"], spread["paired_accuracy_diff"]
    print(
        f"\nover {len(seeds)} seeds, held-out accuracy after {budget_s / 60:.1f} min: grpo_flyte mean {ours['mean']:.1%} "
        f"(worst seed {ours['min']:.1%}), TRL mean {theirs['mean']:.1%} (best seed {theirs['max']:.1%}); paired difference "
        f"mean {diff['mean']:+.3f}, worst seed {diff['min']:+.3f}"
    )
    _common.write_result(
        _common.out_file(args),
        {
            "benchmark": "race_trl",
            "machine": machine,
            "trl_version": trl.__version__,
            "budget_s": budget_s,
            "config": config.flat(),
            "seeds": {str(seed): r for seed, r in per_seed.items()},
            **spread,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
