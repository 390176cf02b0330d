"""A pruned sweep against the full sweep of the same grid: the winner of each and the compute each took.

A learning-rate x seed grid of the default recipe on the embedded SmolLM2-135M-Instruct and the
arithmetic task (learning rates 1e-4, 2e-4, 5e-4 and 5e-3, a clearly bad one, x seeds 0 and 1: 8
configs), 20 iterations with a held-out evaluation of 100 questions every 5, run twice on this
machine, one `python -m grpo_flyte --local --sweep ...` process each:

- (a) full: every config trains to the end;
- (b) pruned: the same with `--sweep-prune` (grpo_flyte/loop/pruning.py): at each evaluation, a
  config below the leader by more than the paired 99% interval stops.

Reports each side's wall and CPU seconds (its process and children), each config's best held-out
accuracy, where --sweep-prune stopped which config and why, and each side's winner (the best
held-out accuracy): the pruned sweep passes when its winner is the full sweep's, or within the full
winner's paired interval (the winners' best evaluations, paired over the same questions, 95%).

    python benchmarks/sweep_prune.py            # 8 configs x 20 iterations, twice: hours on 2 cores
    python benchmarks/sweep_prune.py --small    # 6 configs x 6 small iterations, twice: about an hour on the 2-core machine
    python benchmarks/sweep_prune.py --quick    # 2 configs (2e-4 and an absurd 1.0) x 2 tiny iterations of the tests' tiny
                                                # random model: the plumbing

`--small` is the setting measured on the project's 2-core machine (docs/measurements.md), where the
full grid would take hours: it trains about 50 times the tokens of `--small`, whose full sweep took
2094 CPU-seconds and 80 minutes there on 2026-11-28 (float32, one thread, a loaded machine). It keeps
what the question needs, a learning-rate x seed grid with clearly worse learning rates and
evaluations after training has begun at which pruning can act, and shrinks the rest: the default
learning rate 2e-4, a bad 5e-3 (25x) and a broken 5e-2 (250x) x seeds 0 and 1; 6 iterations of 4
prompts x 4 completions of at most 32 new tokens (the default recipe's 8 x 8 x 64, an eighth of its
tokens), a top-up to 2 informative groups (the default's half of the prompts); a held-out
evaluation of 50 questions before training and every 2 iterations (0, 2, 4, 6).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common

FULL = {"iterations": 20, "eval_every": 5, "eval_size": 100}
SMALL = {"iterations": 6, "eval_every": 2, "eval_size": 50, "prompts_per_iter": 4, "group_size": 4, "max_new_tokens": 32,
         "min_informative_groups": 2}  # fmt: skip
QUICK = {"iterations": 2, "eval_every": 1, "eval_size": 4, "prompts_per_iter": 2, "group_size": 2, "max_new_tokens": 8,
         "min_informative_groups": 0}  # fmt: skip
LEARNING_RATES = ("1e-4", "2e-4", "5e-4", "5e-3")
SMALL_LEARNING_RATES = ("2e-4", "5e-3", "5e-2")  # the default, a bad one (25x) and a broken one (250x)
SEEDS = ("0", "1")


def _cpu_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(args: list[str], log: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one sweep's process, its children included (reward workers)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    started, cpu = time.perf_counter(), _cpu_children()
    with log.open("w") as out:
        done = subprocess.run([sys.executable, "-m", "grpo_flyte", *args], stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        raise SystemExit(f"a sweep failed (exit {done.returncode}); its log: {log}")
    return time.perf_counter() - started, _cpu_children() - cpu


def _side(sweep_dir: Path, seconds: float, cpu_s: float) -> dict:
    """One side's figures from its sweep folder: each config's line of sweep.jsonl, the decisions, the winner."""
    lines = [json.loads(line) for line in (sweep_dir / "sweep.jsonl").read_text().splitlines()]
    ranked = [line for line in lines if line["best"] is not None]
    winner = max(ranked, key=lambda line: line["best"]) if ranked else None
    pruned = json.loads((sweep_dir / "pruned.json").read_text()) if (sweep_dir / "pruned.json").is_file() else {}
    return {
        "wall_s": seconds,
        "cpu_s": cpu_s,
        "configs": {
            line["name"]: {k: line[k] for k in ("status", "best", "best_iteration", "iterations_done", "stopped")} for line in lines
        },
        "pruned": pruned,
        "iterations_trained": sum(line["iterations_done"] for line in lines),
        "winner": winner["name"] if winner else None,
        "winner_best": winner["best"] if winner else None,
    }


def _answers(run_dir: Path, iteration: int) -> list[float]:
    """Each held-out question's correctness at an evaluation (the run folder's eval/ file)."""
    path = next((run_dir / "eval").glob(f"*{iteration:04d}*"), None)
    if path is None:
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.suffix == ".jsonl" else json.loads(path.read_text())
    return [float(r["correct"]) for r in rows]


def _within(full_dir: Path, full: dict, pruned: dict) -> tuple[bool, float | None, float | None]:
    """Whether the pruned winner is the full winner or within its 95% paired interval (the full
    sweep's runs of both configs at their best evaluations, over the same questions)."""
    from grpo_flyte.loop.metrics import mean_ci95

    if pruned["winner"] == full["winner"]:
        return True, 0.0, None
    a = _answers(full_dir / full["winner"], full["configs"][full["winner"]]["best_iteration"])
    b = _answers(full_dir / pruned["winner"], full["configs"][pruned["winner"]]["best_iteration"])
    if not a or len(a) != len(b):
        return False, None, None
    diff, half = mean_ci95([x - y for x, y in zip(a, b, strict=True)])
    return half is not None and diff <= half, diff, half


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__, "sweep_prune.json")
    p.add_argument("--small", action="store_true", help="6 configs x 6 small iterations (the setting measured on 2 cores; see above)")
    args = p.parse_args(argv)
    sizes = QUICK if args.quick else SMALL if args.small else FULL
    rates = SMALL_LEARNING_RATES if args.small else LEARNING_RATES
    grid = (
        ["--sweep", "learning_rate=2e-4,1.0"]
        if args.quick
        else ["--sweep", "learning_rate=" + ",".join(rates), "--sweep", "seed=" + ",".join(SEEDS)]
    )
    root = Path(tempfile.mkdtemp(prefix="grpo_flyte-prune-bench-"))
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in sizes.items()]
    if args.quick:
        flags += ["--model", str(_common.quick_model())]
    print(f"work in {root}")
    sides = {}
    for side, extra in (("full", []), ("pruned", ["--sweep-prune"])):
        seconds, cpu_s = _run(["--local", *flags, *grid, *extra, "--run-dir", str(root / side)], root / f"{side}.log")
        sides[side] = _side(root / side, seconds, cpu_s)
        print(f"  {side:7} {seconds:8.1f} s wall {cpu_s:8.1f} s CPU, {sides[side]['iterations_trained']} iterations trained, "
              f"winner {sides[side]['winner']} ({sides[side]['winner_best']}), {len(sides[side]['pruned'])} pruned")  # fmt: skip
    same, diff, half = _within(root / "full", sides["full"], sides["pruned"])
    cpu_ratio = sides["pruned"]["cpu_s"] / sides["full"]["cpu_s"]
    result = {
        "machine": _common.machine(),
        "quick": args.quick,
        "small": args.small,
        "sizes": sizes,
        "grid": grid,
        **sides,
        "cpu_ratio": cpu_ratio,
        "winner_within_interval": same,
        "winner_gap": diff,
        "winner_gap_ci95": half,
    }
    _common.write_result(_common.out_file(args), result)
    print(
        f"pruned / full CPU seconds: {cpu_ratio:.2f}; the pruned sweep's winner {'is' if same else 'is NOT'} the full sweep's or within its interval"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
