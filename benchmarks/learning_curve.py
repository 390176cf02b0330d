"""Does GRPO improve the model? Held-out accuracy before, during and after a fixed budget, over seeds.

Runs the real loop (`python -m grpo_flyte.driver --local`) on the embedded SmolLM2-135M-Instruct
and the default arithmetic task with every hyper-parameter at its default, evaluating greedily on
200 held-out questions before training, every --eval-every iterations and at the end. Prints the
curve, the before/after figures with 95% intervals, the paired gain (the same questions before and
after), the lowest held-out accuracy seen during the run and the seconds per iteration; writes them
to <run-dir>/learning_curve.json.

    python benchmarks/learning_curve.py                       # one run, seed 0
    python benchmarks/learning_curve.py --seeds 0 1 2 3 4     # one sweep over the seeds, and the spread over them
    python benchmarks/learning_curve.py --seeds 0 1 2 3 4 --gate 0.10   # the gate in docs/measurements.md
    python benchmarks/learning_curve.py --seeds 0 1 2 3 4 --run-dir runs/gate   # resumes (or reuses) the sweep in runs/gate
    python benchmarks/learning_curve.py --loss-type dapo      # any other flag goes to the driver
    python benchmarks/learning_curve.py --quick               # seconds: 2 tiny iterations of the tests' tiny model (the plumbing)

One run's end point depends on its seed more than its 95% interval over the held-out questions
says, so a learning claim is a figure over seeds. `--seeds` runs them as one sweep
(`python -m grpo_flyte.driver --local --sweep seed=0,1,...`: every seed at once in one process, their
`generate` calls in one engine's batches, their train steps on one loaded base; the sweep folder
holds a run folder per seed, `seed=N`, and the sweep's comparison report) and adds, over the seeds,
the mean paired accuracy gain with a t-interval (the seed is the sampling unit), the worst seed's
gain and the lowest held-out accuracy any seed saw during its run. A `--run-dir` that holds the
sweep of these seeds is resumed where it stopped (Ctrl-C, a kill), or read if it finished.

`--gate GAIN` checks what "learns on every seed" means here, per seed: a paired accuracy gain of at
least GAIN whose 95% interval lies above 0; no evaluation below the starting accuracy by more than
3 points; training accuracy never at or below 2% for 3 iterations in a row. It exits 1 when a seed
fails (the JSON says which and why).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import _common

from grpo_flyte.config.files import flatten
from grpo_flyte.launch.cli import main as cli_main
from grpo_flyte.launch.run_folder import EVAL_DIR, METRICS_FILE
from grpo_flyte.launch.sweep_folder import OUTCOMES_FILE, SWEEP_FILE, is_sweep_dir
from grpo_flyte.loop.metrics import mean_ci95

ITERATIONS = 20
EVAL_EVERY = 5
EVAL_SIZE = 200
QUICK = ["--prompts-per-iter", "2", "--group-size", "2", "--max-new-tokens", "8", "--min-informative-groups", "0"]
# The gate's fixed parts: how far below its start an evaluation may fall, and the training-accuracy
# floor that may not last FLOOR_RUN iterations in a row (a collapse: nothing right to learn from).
MAX_DIP = 0.03
TRAIN_FLOOR = 0.02
FLOOR_RUN = 3
# Student's t at 0.975 for 1..10 degrees of freedom (intervals over a handful of seeds); 1.96 beyond.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def model_flags(driver_flags: list[str]) -> list[str]:
    """A --quick run's model flag: the tests' tiny random model (`_common.quick_model`), unless
    `driver_flags` name a model."""
    named = any(f == "--model" or f.startswith("--model=") for f in driver_flags)
    return [] if named else ["--model", str(_common.quick_model())]


def quick_flags(driver_flags: list[str]) -> list[str]:
    """The driver flags of a --quick run: QUICK's tiny batches and `model_flags`."""
    return [*QUICK, *model_flags(driver_flags)]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def longest_run(flags: list[bool]) -> int:
    """The most consecutive True values."""
    longest = current = 0
    for flag in flags:
        current = current + 1 if flag else 0
        longest = max(longest, current)
    return longest


def summarize(run_dir: Path, wall_s: float) -> dict:
    rows = read_jsonl(run_dir / METRICS_FILE)
    evals = [r for r in rows if "eval_reward" in r]
    first, last = evals[0], evals[-1]
    before = read_jsonl(run_dir / EVAL_DIR / f"iter-{first['iteration']:04d}.jsonl")
    after = read_jsonl(run_dir / EVAL_DIR / f"iter-{last['iteration']:04d}.jsonl")
    if [a["question"] for a in before] != [a["question"] for a in after]:
        raise RuntimeError("the first and last evaluations asked different questions")
    gain, gain_ci = mean_ci95([a["reward"] - b["reward"] for a, b in zip(after, before, strict=True)])
    acc_gain, acc_gain_ci = mean_ci95([float(a["correct"]) - float(b["correct"]) for a, b in zip(after, before, strict=True)])
    trained = [r for r in rows if "iteration_s" in r]
    lowest = min(evals, key=lambda r: r["eval_accuracy"])
    return {
        "eval_questions": len(before),
        "iterations": len(trained),
        "curve": [
            {k: r[k] for k in ("iteration", "eval_reward", "eval_reward_ci95", "eval_accuracy", "eval_accuracy_ci95", "eval_format_rate")}
            for r in evals
        ],
        "train_accuracy": [r["accuracy"] for r in trained],
        "train_format_rate": [r["format_rate"] for r in trained],
        "reward_gain": gain,
        "reward_gain_ci95": gain_ci,
        "accuracy_gain": acc_gain,
        "accuracy_gain_ci95": acc_gain_ci,
        "lowest_eval_accuracy": lowest["eval_accuracy"],
        "lowest_eval_iteration": lowest["iteration"],
        "train_floor_run": longest_run([r["accuracy"] <= TRAIN_FLOOR for r in trained]),
        "seconds_per_iteration": statistics.fmean(r["iteration_s"] for r in trained),
        "is_ess_mean": statistics.fmean(r.get("is_ess", 1.0) for r in trained),
        "staleness_mean": statistics.fmean(r.get("staleness_mean", 0.0) for r in trained),
        "generate_s_mean": statistics.fmean(r["generate_s"] for r in trained),
        "train_s_mean": statistics.fmean(r["train_s"] for r in trained),
        "eval_s_mean": statistics.fmean(r["eval_s"] for r in evals),
        "wall_s": wall_s,
        "config": flatten(json.loads((run_dir / "config.json").read_text())),  # saved in parts; flat here
    }


def over_seeds(values: list[float]) -> dict[str, float | None]:
    """The mean over seeds, the sd, and the half-width of the mean's 95% t-interval (None for one seed)."""
    n = len(values)
    sd = statistics.stdev(values) if n > 1 else 0.0
    t = _T975[n - 2] if 2 <= n <= len(_T975) + 1 else 1.96
    return {"mean": statistics.fmean(values), "sd": sd, "ci95": t * sd / math.sqrt(n) if n > 1 else None, "min": min(values)}


def gate_failures(result: dict, min_gain: float) -> list[str]:
    """Why one seed's run fails the gate (empty: it passes)."""
    failures = []
    gain, ci = result["accuracy_gain"], result["accuracy_gain_ci95"] or 0.0
    if gain < min_gain:
        failures.append(f"accuracy gain {gain:+.1%} < {min_gain:+.0%}")
    if gain - ci <= 0:
        failures.append(f"accuracy gain's interval {gain:+.1%} +- {ci:.1%} reaches 0")
    start = result["curve"][0]["eval_accuracy"]
    if result["lowest_eval_accuracy"] < start - MAX_DIP - 1e-9:
        failures.append(
            f"held-out accuracy {result['lowest_eval_accuracy']:.1%} at iteration {result['lowest_eval_iteration']}, "
            f"more than {MAX_DIP:.0%} below its start {start:.1%}"
        )
    if result["train_floor_run"] >= FLOOR_RUN:
        failures.append(f"training accuracy <= {TRAIN_FLOOR:.0%} for {result['train_floor_run']} iterations in a row")
    return failures


def combine(results: dict[int, dict], min_gain: float | None = None) -> dict:
    """Per-seed results and, over the seeds, the spread of the paired accuracy gain, the final held-out
    reward and accuracy, the lowest accuracy seen and `is_ess_mean`; with `min_gain`, the gate."""
    finals = [r["curve"][-1] for r in results.values()]
    combined = {
        "seeds": {str(seed): r for seed, r in results.items()},
        "accuracy_gain": over_seeds([r["accuracy_gain"] for r in results.values()]),
        "final_reward": over_seeds([f["eval_reward"] for f in finals]),
        "final_accuracy": over_seeds([f["eval_accuracy"] for f in finals]),
        "lowest_eval_accuracy": over_seeds([r["lowest_eval_accuracy"] for r in results.values()]),
        "is_ess_mean": over_seeds([r["is_ess_mean"] for r in results.values()]),
    }
    if min_gain is not None:
        failures = {str(seed): gate_failures(r, min_gain) for seed, r in results.items()}
        combined["gate"] = {
            "min_gain": min_gain,
            "max_dip": MAX_DIP,
            "train_floor": TRAIN_FLOOR,
            "floor_run": FLOOR_RUN,
            "failures": {seed: f for seed, f in failures.items() if f},
            "passed": not any(failures.values()),
        }
    return combined


def report_seeds(combined: dict) -> str:
    lines = ["seed  accuracy start -> end   paired gain       lowest seen  final reward      is_ess"]
    for seed, r in combined["seeds"].items():
        first, last = r["curve"][0], r["curve"][-1]
        lines.append(
            f"{seed:>4}  {first['eval_accuracy']:6.1%} -> {last['eval_accuracy']:6.1%}  "
            f"{r['accuracy_gain']:+6.1%} +- {r['accuracy_gain_ci95'] or 0:5.1%}  "
            f"{r['lowest_eval_accuracy']:6.1%} (it {r['lowest_eval_iteration']:>2})  "
            f"{last['eval_reward']:.3f} +- {last['eval_reward_ci95'] or 0:.3f}  {r['is_ess_mean']:.3f}"
        )
    gain, low = combined["accuracy_gain"], combined["lowest_eval_accuracy"]
    ci = f" +- {gain['ci95']:.1%}" if gain["ci95"] is not None else ""
    lines.append(
        f"over {len(combined['seeds'])} seeds: paired accuracy gain {gain['mean']:+.1%}{ci} (t-interval over seeds, sd "
        f"{gain['sd']:.1%}), worst seed {gain['min']:+.1%}; lowest held-out accuracy seen {low['min']:.1%}; "
        f"final reward {combined['final_reward']['mean']:.3f} (sd {combined['final_reward']['sd']:.3f})"
    )
    gate = combined.get("gate")
    if gate:
        if gate["passed"]:
            lines.append(f"gate (every seed: gain >= {gate['min_gain']:+.0%} above 0, no dip, no collapse): PASSED")
        else:
            lines.append(f"gate (every seed: gain >= {gate['min_gain']:+.0%} above 0, no dip, no collapse): FAILED")
            lines += [f"  seed {seed}: {'; '.join(why)}" for seed, why in gate["failures"].items()]
    return "\n".join(lines)


def report(result: dict) -> str:
    n = result["eval_questions"]
    lines = [f"held-out evaluation: {n} questions, greedy; +- is a 95% interval (1.96 standard errors)", ""]
    lines.append("iteration  mean reward        accuracy           format")
    for p in result["curve"]:
        lines.append(
            f"{p['iteration']:>9}  {p['eval_reward']:.3f} +- {p['eval_reward_ci95'] or 0:.3f}    "
            f"{p['eval_accuracy']:6.1%} +- {p['eval_accuracy_ci95'] or 0:5.1%}   {p['eval_format_rate']:6.1%}"
        )
    first, last = result["curve"][0], result["curve"][-1]
    lines += [
        "",
        f"before (iteration {first['iteration']}): reward {first['eval_reward']:.3f}, accuracy {first['eval_accuracy']:.1%}",
        f"after (iteration {last['iteration']}):  reward {last['eval_reward']:.3f}, accuracy {last['eval_accuracy']:.1%}",
        (
            f"paired gain on the same {n} questions: reward {result['reward_gain']:+.3f} +- {result['reward_gain_ci95'] or 0:.3f}, "
            f"accuracy {result['accuracy_gain']:+.1%} +- {result['accuracy_gain_ci95'] or 0:.1%}"
        ),
        f"lowest held-out accuracy seen: {result['lowest_eval_accuracy']:.1%} (iteration {result['lowest_eval_iteration']})",
        timing_line(result),
    ]
    return "\n".join(lines)


def timing_line(result: dict) -> str:
    return (
        f"{result['iterations']} iterations, {result['seconds_per_iteration']:.1f} s per iteration "
        f"(generate {result['generate_s_mean']:.1f} s, train {result['train_s_mean']:.1f} s), "
        f"{result['eval_s_mean']:.1f} s per evaluation, {result['wall_s'] / 60:.1f} min in all"
    )


def driver_args(folder: Path, args: argparse.Namespace, driver_flags: list[str], seed: int | None) -> list[str]:
    return [
        "--local", "--run-dir", str(folder), "--iterations", str(args.iterations),
        "--eval-every", str(args.eval_every), "--eval-size", str(args.eval_size), *driver_flags,
        *([] if seed is None else ["--seed", str(seed)]),
    ]  # fmt: skip


def run_parallel(
    jobs: list[tuple[str, Path, list[str]]],
    parallel: int,
    done: Callable[[str, Path, float], None] | None = None,
    extra_env: dict[str, dict[str, str]] | None = None,
) -> dict[str, float]:
    """Each (label, folder, driver args) as a process of its own, `parallel` at a time, each with
    the cores split between them (torch's threads: two processes at a core's worth each beat two
    fighting over both); its console output goes to <folder>/console.log. `done(label, folder,
    wall seconds)` is called as each run ends; `extra_env`: more environment variables for some
    labels' processes. Returns each label's wall seconds; a run that fails stops the rest. The
    cores are this process's torch threads (OMP_NUM_THREADS where set: a test worker's share of
    the CPUs), else all of them."""
    own = os.environ.get("OMP_NUM_THREADS", "")
    threads = str(max(1, (int(own) if own.isdigit() else os.cpu_count() or 1) // parallel))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    pending, running, walls = list(jobs), {}, {}
    try:
        while pending or running:
            while pending and len(running) < parallel:
                label, folder, argv = pending.pop(0)
                folder.mkdir(parents=True, exist_ok=True)
                log = (folder / "console.log").open("w")
                proc = subprocess.Popen(
                    [sys.executable, "-m", "grpo_flyte.driver", *argv],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**env, **(extra_env or {}).get(label, {})},
                )
                running[label] = (proc, log, time.perf_counter(), folder)
                print(f"{label}: started ({folder / 'console.log'})", flush=True)
            time.sleep(0.2)
            for label, (proc, log, started, folder) in list(running.items()):
                if proc.poll() is None:
                    continue
                log.close()
                del running[label]
                if proc.returncode != 0:
                    raise RuntimeError(f"{label} exited {proc.returncode}; see {folder / 'console.log'}")
                walls[label] = time.perf_counter() - started
                print(f"{label}: done in {walls[label] / 60:.1f} min", flush=True)
                if done is not None:
                    done(label, folder, walls[label])
    finally:
        for proc, log, _, _ in running.values():
            proc.terminate()
            proc.wait()
            log.close()
    return walls


def saved_configs(sweep_dir: Path) -> list[dict]:
    """A sweep folder's configs (`sweep.json`): each one's name, what it changes and its whole config."""
    return json.loads((sweep_dir / SWEEP_FILE).read_text())["configs"]


def run_seeds(run_dir: Path, args: argparse.Namespace, driver_flags: list[str]) -> tuple[dict[int, dict], int]:
    """The seeds as one sweep (`--sweep seed=...`: every seed at once in this process, on one engine
    and one loaded base), in `run_dir`: each seed's summary from its config's run folder, and the
    sweep's exit status. A sweep folder from an earlier call (stopped, or finished) is resumed."""
    outcomes = read_jsonl(run_dir / OUTCOMES_FILE) if (run_dir / OUTCOMES_FILE).is_file() else []
    finished = bool(outcomes) and all(line["status"] == "complete" for line in outcomes)
    started = time.perf_counter()
    if finished:
        print(f"reused the finished sweep in {run_dir}")
        code = 0
    elif is_sweep_dir(run_dir):
        code = cli_main(["--local", "--resume", "--run-dir", str(run_dir)])
    else:
        code = cli_main([*driver_args(run_dir, args, driver_flags, None), "--sweep", f"seed={','.join(map(str, args.seeds))}"])
    wall = time.perf_counter() - started  # every seed's: they ran at once
    if code != 0:
        return {}, code
    configs = {m["overrides"]["seed"]: run_dir / m["name"] for m in saved_configs(run_dir)}
    results = {}
    for seed in args.seeds:
        summary = configs[seed] / "learning_curve.json"
        if summary.is_file():  # summarized by an earlier call
            results[seed] = json.loads(summary.read_text())
        else:
            results[seed] = summarize(configs[seed], wall)
            summary.write_text(json.dumps(results[seed], indent=2) + "\n")
        print(f"\nseed {seed}\n" + report(results[seed]))
    return results, 0


def main(argv: list[str] | None = None) -> int:
    # No abbreviations: every flag this parser does not know goes to the driver whole (--seed is not --seeds).
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--iterations", type=int, default=ITERATIONS)
    parser.add_argument("--eval-every", type=int, default=EVAL_EVERY)
    parser.add_argument("--eval-size", type=int, default=EVAL_SIZE)
    parser.add_argument("--run-dir", type=Path, default=None, help="default: a new temporary folder")
    parser.add_argument(
        "--quick", action="store_true", help="2 iterations of tiny batches of the tests' tiny model: the plumbing, not the learning"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON of results here")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=None, help="one sweep over the seeds (<run-dir>/seed=N each), and their spread"
    )
    parser.add_argument("--jobs", type=int, default=None, help=argparse.SUPPRESS)  # refused below, with why
    parser.add_argument(
        "--gate", type=float, default=None, metavar="GAIN", help="with --seeds: check the gate (see above); exit 1 if a seed fails"
    )
    args, driver_flags = parser.parse_known_args(argv)
    if args.quick:
        args.iterations, args.eval_every, args.eval_size = 2, 1, 4
        driver_flags = [*quick_flags(driver_flags), *driver_flags]
    if args.seeds and any(f == "--seed" or f.startswith("--seed=") for f in driver_flags):
        parser.error("--seeds runs one seed per run: leave out --seed")
    if args.seeds and len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {' '.join(map(str, args.seeds))}: a seed given twice")
    if args.jobs is not None:
        parser.error(f"--jobs {args.jobs}: the seeds run as one sweep now, every seed at once in one process; leave out --jobs")
    if args.gate is not None and not args.seeds:
        parser.error("--gate needs --seeds")
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="grpo_flyte-learning-"))
    if (
        args.seeds
        and is_sweep_dir(run_dir)
        and (saved := [m["overrides"] for m in saved_configs(run_dir)]) != [{"seed": seed} for seed in args.seeds]
    ):
        parser.error(f"--run-dir {run_dir} holds the sweep {saved}, not --seeds {' '.join(map(str, args.seeds))}: pick another folder")
    if args.seeds:
        results, code = run_seeds(run_dir, args, driver_flags)
        if code != 0:
            return code
        result = combine(results, args.gate)
        (run_dir / "learning_curve.json").write_text(json.dumps(result, indent=2) + "\n")
    else:
        started = time.perf_counter()
        code = cli_main(driver_args(run_dir, args, driver_flags, None))
        if code != 0:
            return code
        result = summarize(run_dir, time.perf_counter() - started)
        (run_dir / "learning_curve.json").write_text(json.dumps(result, indent=2) + "\n")
        print(report(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.seeds:
        print("\n" + report_seeds(result))
    print(f"\nrun files: {run_dir}")
    return 1 if result.get("gate", {}).get("passed") is False else 0


if __name__ == "__main__":
    sys.exit(main())
