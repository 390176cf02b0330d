"""Does the run's guard keep the best adapter and recover from a collapse? Fault injection, each case with and without it.

Every case is learning_curve.py's run (the embedded SmolLM2-135M-Instruct, the arithmetic task, 20
iterations of 8 prompts x 8 completions, 200 held-out questions before training and every 5
iterations) with the default recipe and one fault:
- `lr x10`: the learning rate ten times the default;
- `gameable reward`: `--rewards format=1.0` alone, which pays for a well-formed '#### <answer>'
  final line, right or wrong;
- `sign flip`: the 'correct' reward for the first half of the iterations, its negative after
  (`_gameable_rewards:flipped`; this folder goes on the runs' PYTHONPATH for the reward workers);
- `healthy, seed N` (0, 1, 2): no fault.

Without the guard is `--on-collapse warn --export-adapter final`: the guard only records what it
sees (so the first collapse signal is known) and the run exports its last adapter, as runs did
before the guard. With it: the defaults (`--on-collapse rollback`, `--export-adapter best`) and
`--early-stop-patience 2`. The healthy runs run with the guard only: where it does nothing the run
is the one without it, and doing nothing is what they check.

Per case and side: the best held-out accuracy seen, that of the adapter the run exports, the first
collapse signal, the minutes spent after it, the rollbacks and an early stop. Targets: in every
faulty case the guarded run exports an adapter within 1 point of the best seen; no rollback and no
early stop in a healthy run. Writes benchmarks/guardian.json and prints the table of
docs/measurements.md ("The guard").

    python benchmarks/guardian.py --jobs 2                    # every case, two runs at a time (hours on a CPU)
    python benchmarks/guardian.py --cases "sign flip" --jobs 2
    python benchmarks/guardian.py --run-dir runs/guardian     # reuses the runs a folder already holds
    python benchmarks/guardian.py --quick                     # the plumbing: the sign flip's two sides, tiny (the tests' model), at once
    python benchmarks/guardian.py --replay runs/sweep/*/seed-*   # the guard's assessments on recorded runs

`--replay` runs the guard's own functions (as `--on-collapse warn`: nothing acted on) over run
folders already recorded (metrics.jsonl and eval/iter-NNNN.jsonl), whatever their settings, and
prints each run's best evaluation and every collapse the guard sees: how its thresholds were
checked against the recipe sweep's runs (docs/measurements.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import _common
from flyte.io import Dir
from learning_curve import EVAL_EVERY, EVAL_SIZE, ITERATIONS, driver_args, quick_flags, read_jsonl, run_parallel

from grpo_flyte.config.run import RunConfig
from grpo_flyte.config.training import GuardConfig
from grpo_flyte.launch.run_folder import EVAL_DIR, METRICS_FILE
from grpo_flyte.loop.answers import EvalAnswer
from grpo_flyte.loop.guard import GuardState, assess, question_values
from grpo_flyte.types import AdapterRef, MetricsRow

HERE = Path(__file__).resolve().parent
DEFAULT_LR = RunConfig().train.learning_rate
FAULTS: dict[str, list[str]] = {
    "lr x10": ["--learning-rate", f"{10 * DEFAULT_LR:g}"],
    "gameable reward": ["--rewards", "format=1.0"],
    "sign flip": ["--rewards", "_gameable_rewards:flipped=1.0"],
}
HEALTHY_SEEDS = (0, 1, 2)
FAULT_SEED = 0
SIDES = {
    "without": ["--on-collapse", "warn", "--export-adapter", "final"],
    "with": ["--on-collapse", "rollback", "--export-adapter", "best", "--early-stop-patience", "2"],
}
COLLAPSES = ("collapse", "rollback", "stop")
WITHIN = 0.01  # the target: the exported adapter within 1 point of the best held-out accuracy seen


def cases(quick: bool) -> dict[str, tuple[list[str], int, tuple[str, ...]]]:
    """case -> (its driver flags, its seed, the sides it runs)."""
    if quick:
        return {"sign flip": (FAULTS["sign flip"], FAULT_SEED, tuple(SIDES))}
    out = {name: (flags, FAULT_SEED, tuple(SIDES)) for name, flags in FAULTS.items()}
    out.update({f"healthy, seed {seed}": ([], seed, ("with",)) for seed in HEALTHY_SEEDS})
    return out


def folder_name(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "=.-" else "_" for ch in label)


def summarize(run_dir: Path, wall_s: float | None) -> dict:
    """One run as the table shows it (from its metrics.jsonl: what its guard recorded)."""
    rows = read_jsonl(run_dir / METRICS_FILE)
    evals = [r for r in rows if "eval_accuracy" in r]
    best_seen = max(evals, key=lambda r: r["eval_accuracy"])  # the first to reach it
    config = json.loads((run_dir / "config.json").read_text())
    if config["guard"]["export_adapter"] == "best":
        exported = next(r for r in evals if r["iteration"] == evals[-1]["best_iteration"])
    else:
        exported = rows[-1]
    collapses = [r for r in rows if r.get("guard_event") in COLLAPSES]
    first = collapses[0] if collapses else None
    after = [r for r in rows if first is not None and r["iteration"] > first["iteration"]]
    stop = next((r for r in rows if r.get("guard_event") in ("stop", "early_stop")), None)
    return {
        "iterations": rows[-1]["iteration"],
        "best_seen": best_seen["eval_accuracy"],
        "best_seen_iteration": best_seen["iteration"],
        "exported": exported.get("eval_accuracy"),  # None: the final adapter was not evaluated
        "exported_iteration": exported["iteration"],
        "first_collapse_iteration": first["iteration"] if first else None,
        "first_collapse_signal": first.get("guard_signal") if first else None,
        "minutes_after_first_collapse": sum(r.get("iteration_s", 0.0) + r.get("eval_s", 0.0) for r in after) / 60,
        "rollbacks": sum(r.get("guard_event") == "rollback" for r in rows),
        "stop": {"iteration": stop["iteration"], "event": stop["guard_event"], "reason": stop["guard_reason"]} if stop else None,
        "curve": [{"iteration": r["iteration"], "eval_accuracy": r["eval_accuracy"], "event": r.get("guard_event")} for r in evals],
        "wall_s": wall_s,
    }


def targets(results: dict[str, dict[str, dict]]) -> dict:
    """The issue's targets, case by case."""
    exported_ok = {
        case: sides["with"]["exported"] is not None and sides["with"]["exported"] >= sides["with"]["best_seen"] - WITHIN - 1e-9
        for case, sides in results.items()
        if not case.startswith("healthy")
    }
    quiet = {
        case: sides["with"]["rollbacks"] == 0 and sides["with"]["stop"] is None
        for case, sides in results.items()
        if case.startswith("healthy")
    }
    return {
        "exported_within_1_point": exported_ok,
        "healthy_without_rollback_or_stop": quiet,
        "met": all(exported_ok.values()) and all(quiet.values()),
    }


def table(results: dict[str, dict[str, dict]]) -> str:
    lines = [
        "| case | guard | best held-out accuracy seen | exported adapter's | first collapse signal | minutes after it | rollbacks | stopped |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case, sides in results.items():
        for side, r in sides.items():
            exported = (
                f"{r['exported']:.1%} (it {r['exported_iteration']})"
                if r["exported"] is not None
                else f"not evaluated (it {r['exported_iteration']})"
            )
            first = (
                f"it {r['first_collapse_iteration']} ({r['first_collapse_signal']})"
                if r["first_collapse_iteration"] is not None
                else "none"
            )
            after = f"{r['minutes_after_first_collapse']:.1f}" if r["first_collapse_iteration"] is not None else "-"
            stopped = f"{r['stop']['event'].replace('_', ' ')} at it {r['stop']['iteration']}" if r["stop"] else "no"
            lines.append(
                f"| {case} | {side} | {r['best_seen']:.1%} (it {r['best_seen_iteration']}) | {exported} | {first} | {after} | {r['rollbacks']} | {stopped} |"
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------- replaying recorded runs


def replay(run_dir: Path) -> dict:
    """The guard's verdicts (`--on-collapse warn`) on a recorded run: its best evaluation and every
    collapse, whatever the run recorded itself."""
    rows = [MetricsRow.from_flat(r).model_copy(update={"guard": None}) for r in read_jsonl(run_dir / METRICS_FILE)]
    answers = {
        row.iteration: [
            EvalAnswer(**{k: v for k, v in a.items() if k != "iteration"})
            for a in read_jsonl(run_dir / EVAL_DIR / f"iter-{row.iteration:04d}.jsonl")
        ]
        for row in rows
        if row.eval is not None
    }
    first = next(iter(answers.values()), [])
    state = GuardState(metric="eval_accuracy" if first and all(a.answer.strip() for a in first) else "eval_reward")
    config, history, events = GuardConfig(on_collapse="warn"), [], []
    for row in rows:
        values = question_values(answers[row.iteration], state.metric) if row.iteration in answers else None
        adapter = AdapterRef(version=row.adapter_version, dir=Dir(path=f"v{row.adapter_version:04d}"))
        state, record = assess(config, state, [*history, row], values, adapter, last=False)
        history.append(row.model_copy(update={"guard": record}))
        if record is not None and record.guard_event == "collapse":
            events.append({"iteration": row.iteration, "signal": record.guard_signal, "reason": record.guard_reason})
    best = state.best
    return {
        "metric": state.metric,
        "best_iteration": best.iteration if best else None,
        "best": best.value if best else None,
        "collapses": events,
    }


def main_replay(folders: list[Path], out: Path | None) -> int:
    results = {}
    for folder in folders:
        if not (folder / METRICS_FILE).is_file():
            print(f"{folder}: no {METRICS_FILE}, skipped")
            continue
        r = results[str(folder)] = replay(folder)
        best = f"best iteration {r['best_iteration']} ({r['metric']} {r['best']:.3f})" if r["best"] is not None else "not evaluated"
        print(f"{folder}: {best}; {len(r['collapses'])} collapses")
        for event in r["collapses"]:
            print(f"    iteration {event['iteration']} ({event['signal']}): {event['reason']}")
    if out:
        out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _common.parser(__doc__, "guardian.json")
    parser.add_argument("--cases", nargs="+", default=None, help="some cases only (default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, each a process with its share of the cores")
    parser.add_argument("--run-dir", type=Path, default=None, help="default: a new temporary folder; runs already there are reused")
    parser.add_argument("--replay", type=Path, nargs="+", default=None, metavar="RUN_DIR", help="replay the guard over recorded runs")
    args = parser.parse_args(argv)
    if args.replay:
        return main_replay(args.replay, args.out)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: expected at least 1")
    chosen = cases(args.quick)
    if args.cases:
        unknown = [c for c in args.cases if c not in chosen]
        if unknown:
            parser.error(f"unknown cases {unknown}; expected some of {list(chosen)}")
        chosen = {c: chosen[c] for c in args.cases}
    shape = argparse.Namespace(iterations=ITERATIONS, eval_every=EVAL_EVERY, eval_size=EVAL_SIZE)
    extra = []
    if args.quick:  # the two sides at once, 3 tiny iterations each
        shape = argparse.Namespace(iterations=3, eval_every=1, eval_size=4)
        extra, args.jobs = quick_flags([]), max(args.jobs, 2)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="grpo_flyte-guardian-"))
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    jobs, env, folders = [], {}, {}
    for case, (flags, seed, sides) in chosen.items():
        for side in sides:
            label = f"{case} | {side}"
            folder = folders[label] = run_dir / folder_name(case) / side
            if (
                (folder / "config.json").is_file()
                and (folder / "report.html").is_file()
                and "complete" in (folder / "report.html").read_text()
            ):
                print(f"{label}: reusing {folder}")
                continue
            jobs.append((label, folder, driver_args(folder, shape, [*extra, *flags, *SIDES[side]], seed)))
            env[label] = {"PYTHONPATH": pythonpath, "GUARDIAN_RUN_DIR": str(folder), "GUARDIAN_FLIP_AT": str(shape.iterations // 2)}
    started = time.perf_counter()
    walls = run_parallel(jobs, args.jobs, extra_env=env) if jobs else {}
    results: dict[str, dict[str, dict]] = {}
    for label, folder in folders.items():
        case, side = label.split(" | ")
        results.setdefault(case, {})[side] = summarize(folder, walls.get(label))
    summary = {
        "benchmark": "guardian: fault injection with and without the guard",
        "quick": args.quick,
        "iterations": shape.iterations,
        "eval_every": shape.eval_every,
        "eval_size": shape.eval_size,
        "sides": SIDES,
        "faults": {case: chosen[case][0] for case in chosen},
        "cases": results,
        "targets": targets(results),
        "wall_s": time.perf_counter() - started,
        "run_dir": str(run_dir),
    }
    print("\n" + table(results))
    t = summary["targets"]
    print(f"\ntargets: exported within 1 point of the best seen {t['exported_within_1_point']}; healthy runs untouched "
          f"{t['healthy_without_rollback_or_stop']}: {'MET' if t['met'] else 'NOT MET'}")  # fmt: skip
    out = _common.out_file(args)
    if out is not None:
        out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"run files: {run_dir}")
    return 0 if t["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
