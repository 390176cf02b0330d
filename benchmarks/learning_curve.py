"""Does GRPO improve the model? Held-out accuracy and mean reward before and after a fixed budget.

Runs the real loop (`python -m grpo_flyte.driver --local`) on the embedded SmolLM2-135M-Instruct
and the default arithmetic task with every hyper-parameter at its default, evaluating greedily on
the held-out split before training, every --eval-every iterations and at the end. Prints the curve,
the before/after figures with 95% intervals, the paired gain (the same questions before and after),
and the seconds per iteration; writes them to <run-dir>/learning_curve.json.

    python benchmarks/learning_curve.py                       # the figures in docs/measurements.md
    python benchmarks/learning_curve.py --iterations 5        # a quicker look
    python benchmarks/learning_curve.py --loss-type dapo      # any other flag goes to the driver
    python benchmarks/learning_curve.py --max-staleness 1     # generation ahead of training
    python benchmarks/learning_curve.py --seeds 0 1 2         # one run per seed, and the spread over them
    python benchmarks/learning_curve.py --quick               # seconds: 2 tiny iterations (the plumbing)

With the default hyper-parameters one run's end point depends on its seed far more than its
95% interval (over the held-out questions) says: some seeds collapse onto the format reward for
a while (every answer '#### <number>', none right) and some do not. `--seeds` runs the same
command once per seed and adds the mean and spread of the final figures over the seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from grpo_flyte.cli import main as cli_main
from grpo_flyte.config import EvalConfig, flatten
from grpo_flyte.metrics import mean_ci95
from grpo_flyte.run_folder import EVAL_DIR, METRICS_FILE

# The budget the README reports: 20 iterations and 5 evaluations took 25 minutes on a 2-core CPU.
ITERATIONS = 20
EVAL_EVERY = 5
QUICK = ["--prompts-per-iter", "2", "--group-size", "2", "--max-new-tokens", "8", "--min-informative-groups", "0"]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(run_dir: Path, wall_s: float) -> dict:
    rows = read_jsonl(run_dir / METRICS_FILE)
    evals = [r for r in rows if "eval_reward" in r]
    first, last = evals[0], evals[-1]
    before = read_jsonl(run_dir / EVAL_DIR / f"iter-{first['iteration']:04d}.jsonl")
    after = read_jsonl(run_dir / EVAL_DIR / f"iter-{last['iteration']:04d}.jsonl")
    if [a["question"] for a in before] != [a["question"] for a in after]:
        raise RuntimeError("the first and last evaluations asked different questions")
    gain, gain_ci = mean_ci95([a["reward"] - b["reward"] for a, b in zip(after, before, strict=False)])
    acc_gain, acc_gain_ci = mean_ci95([float(a["correct"]) - float(b["correct"]) for a, b in zip(after, before, strict=False)])
    trained = [r for r in rows if "iteration_s" in r]
    return {
        "eval_questions": len(before),
        "iterations": len(trained),
        "curve": [
            {k: r[k] for k in ("iteration", "eval_reward", "eval_reward_ci95", "eval_accuracy", "eval_accuracy_ci95", "eval_format_rate")}
            for r in evals
        ],
        "reward_gain": gain,
        "reward_gain_ci95": gain_ci,
        "accuracy_gain": acc_gain,
        "accuracy_gain_ci95": acc_gain_ci,
        "seconds_per_iteration": statistics.fmean(r["iteration_s"] for r in trained),
        "is_ess_mean": statistics.fmean(r.get("is_ess", 1.0) for r in trained),
        "staleness_mean": statistics.fmean(r.get("staleness_mean", 0.0) for r in trained),
        "generate_s_mean": statistics.fmean(r["generate_s"] for r in trained),
        "train_s_mean": statistics.fmean(r["train_s"] for r in trained),
        "eval_s_mean": statistics.fmean(r["eval_s"] for r in evals),
        "wall_s": wall_s,
        "config": flatten(json.loads((run_dir / "config.json").read_text())),  # saved in parts; flat here
    }


def combine(results: dict[int, dict]) -> dict:
    """Per-seed results and, over the seeds, the mean and standard deviation of the final held-out
    reward and accuracy and of `is_ess_mean`."""

    def spread(values: list[float]) -> dict[str, float]:
        return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0}

    finals = [r["curve"][-1] for r in results.values()]
    return {
        "seeds": {str(seed): r for seed, r in results.items()},
        "final_reward": spread([f["eval_reward"] for f in finals]),
        "final_accuracy": spread([f["eval_accuracy"] for f in finals]),
        "is_ess_mean": spread([r["is_ess_mean"] for r in results.values()]),
    }


def report_seeds(combined: dict) -> str:
    lines = ["seed  final reward      accuracy  is_ess"]
    for seed, r in combined["seeds"].items():
        last = r["curve"][-1]
        lines.append(
            f"{seed:>4}  {last['eval_reward']:.3f} +- {last['eval_reward_ci95']:.3f}  {last['eval_accuracy']:7.1%}  {r['is_ess_mean']:.3f}"
        )
    reward, accuracy = combined["final_reward"], combined["final_accuracy"]
    lines.append(
        f"over {len(combined['seeds'])} seeds: reward {reward['mean']:.3f} (sd {reward['sd']:.3f}), "
        f"accuracy {accuracy['mean']:.1%} (sd {accuracy['sd']:.1%}), is_ess {combined['is_ess_mean']['mean']:.3f}"
    )
    return "\n".join(lines)


def report(result: dict) -> str:
    n = result["eval_questions"]
    lines = [f"held-out evaluation: {n} questions, greedy; +- is a 95% interval (1.96 standard errors)", ""]
    lines.append("iteration  mean reward        accuracy           format")
    for p in result["curve"]:
        lines.append(
            f"{p['iteration']:>9}  {p['eval_reward']:.3f} +- {p['eval_reward_ci95']:.3f}    "
            f"{p['eval_accuracy']:6.1%} +- {p['eval_accuracy_ci95']:5.1%}   {p['eval_format_rate']:6.1%}"
        )
    first, last = result["curve"][0], result["curve"][-1]
    lines += [
        "",
        f"before (iteration {first['iteration']}): reward {first['eval_reward']:.3f}, accuracy {first['eval_accuracy']:.1%}",
        f"after (iteration {last['iteration']}):  reward {last['eval_reward']:.3f}, accuracy {last['eval_accuracy']:.1%}",
        (
            f"paired gain on the same {n} questions: reward {result['reward_gain']:+.3f} +- {result['reward_gain_ci95']:.3f}, "
            f"accuracy {result['accuracy_gain']:+.1%} +- {result['accuracy_gain_ci95']:.1%}"
        ),
        timing_line(result),
    ]
    return "\n".join(lines)


def timing_line(result: dict) -> str:
    return (
        f"{result['iterations']} iterations, {result['seconds_per_iteration']:.1f} s per iteration "
        f"(generate {result['generate_s_mean']:.1f} s, train {result['train_s_mean']:.1f} s), "
        f"{result['eval_s_mean']:.1f} s per evaluation, {result['wall_s'] / 60:.1f} min in all"
    )


def main(argv: list[str] | None = None) -> int:
    # No abbreviations: every flag this parser does not know goes to the driver whole (--seed is not --seeds).
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--iterations", type=int, default=ITERATIONS)
    parser.add_argument("--eval-every", type=int, default=EVAL_EVERY)
    parser.add_argument("--eval-size", type=int, default=EvalConfig.model_fields["eval_size"].default)
    parser.add_argument("--run-dir", type=Path, default=None, help="default: a new temporary folder")
    parser.add_argument("--quick", action="store_true", help="2 iterations of tiny batches: the plumbing, not the learning")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON of results here")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="one run per seed (each in <run-dir>/seed-N), and their spread")
    args, driver_flags = parser.parse_known_args(argv)
    if args.quick:
        args.iterations, args.eval_every, args.eval_size = 2, 1, 4
        driver_flags = [*QUICK, *driver_flags]
    if args.seeds and any(f == "--seed" or f.startswith("--seed=") for f in driver_flags):
        parser.error("--seeds runs one seed per run: leave out --seed")
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="grpo_flyte-learning-"))
    results = {}
    for seed in args.seeds or [None]:
        folder = run_dir if seed is None else run_dir / f"seed-{seed}"
        started = time.perf_counter()
        code = cli_main([
            "--local", "--run-dir", str(folder), "--iterations", str(args.iterations),
            "--eval-every", str(args.eval_every), "--eval-size", str(args.eval_size), *driver_flags,
            *([] if seed is None else ["--seed", str(seed)]),
        ])  # fmt: skip
        if code != 0:
            return code
        results[seed] = summarize(folder, time.perf_counter() - started)
        (folder / "learning_curve.json").write_text(json.dumps(results[seed], indent=2) + "\n")
        print(report(results[seed]))
    result = results[None] if args.seeds is None else combine(results)
    for path in ([run_dir / "learning_curve.json"] if args.seeds else []) + ([args.out] if args.out else []):
        path.write_text(json.dumps(result, indent=2) + "\n")
    if args.seeds:
        print("\n" + report_seeds(result))
    print(f"\nrun files: {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
