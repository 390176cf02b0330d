"""How the default recipe was chosen: a sweep of one setting at a time around a center, each cell over seeds.

Every cell is `learning_curve.py`'s run (the embedded SmolLM2-135M-Instruct, the arithmetic task,
20 iterations of 8 prompts x 8 completions, 200 held-out questions before training and every 5
iterations) with the center's settings and one change. A cell's figure is over its seeds, never
one run: the mean paired accuracy gain with its t-interval over the seeds, the worst seed's gain,
the lowest held-out accuracy any seed saw during its run, and how many seeds pass the gate
(`learning_curve.gate_failures` at +10 points).

    python benchmarks/recipe_sweep.py                         # every cell, seeds 0 1 2, each cell one sweep over its seeds
    python benchmarks/recipe_sweep.py --cells center lr=2e-4  # some cells
    python benchmarks/recipe_sweep.py --run-dir runs/sweep    # reuses the runs a folder already holds
    python benchmarks/recipe_sweep.py --run-dir runs/sweep --report   # the table of what it holds, running nothing
    python benchmarks/recipe_sweep.py --quick                 # the plumbing: 2 cells, 1 seed, tiny runs of the tests' tiny model

Each cell runs as one sweep over its seeds (`learning_curve.run_seeds`: every seed at once in one
process, on one engine and one loaded base), in <run-dir>/<cell>/, a run folder per seed (`seed=N`);
a cell's sweep stopped halfway is resumed, a finished one is read.

The center is RunConfig's default recipe, written out here so that the table keeps its meaning
when a default changes. Every cell run: writes benchmarks/recipe_sweep.json (every run's curve)
and prints the table that docs/measurements.md holds. With --cells or --report, only --out FILE is
written (some cells are not the committed table).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import _common
from learning_curve import EVAL_EVERY, EVAL_SIZE, ITERATIONS, combine, quick_flags, run_seeds

# The default recipe (RunConfig's defaults), the sweep's center: flag -> value. The sweep began at
# learning rate 5e-4 (the old default); that center collapsed on one seed in three and 2e-4 did not,
# so the center moved there (docs/measurements.md, "How the default recipe was chosen").
CENTER = {
    "--rewards": "correct=1.0", "--temperature": "0.5", "--learning-rate": "2e-4", "--lr-scheduler-type": "constant",
    "--warmup-ratio": "0", "--loss-type": "grpo", "--scale-rewards": "group", "--max-new-tokens": "64", "--beta": "0",
}  # fmt: skip
# Each cell: the flags whose values differ from the center's, in the order they were run.
CELLS: dict[str, dict[str, str]] = {
    "center": {},
    "lr=5e-4": {"--learning-rate": "5e-4"},
    "cosine, warmup 0.1": {"--lr-scheduler-type": "cosine", "--warmup-ratio": "0.1"},
    "lr=1e-4": {"--learning-rate": "1e-4"},
    "temperature=0.7": {"--temperature": "0.7"},
    "+correct_format=0.2": {"--rewards": "correct=1.0,correct_format=0.2"},
    "+format=0.2": {"--rewards": "correct=1.0,format=0.2"},
    "loss dr_grpo": {"--loss-type": "dr_grpo", "--scale-rewards": "none"},
    "loss dapo": {"--loss-type": "dapo"},
    "max_new_tokens=32": {"--max-new-tokens": "32"},
    "temperature=0.3": {"--temperature": "0.3"},
    "beta=0.04": {"--beta": "0.04"},
    "lr=1e-3": {"--learning-rate": "1e-3"},
    "max_new_tokens=128": {"--max-new-tokens": "128"},
    # TRL's objectives (issue 51): each with the center's settings otherwise
    "GSPO (sequence-level ratio)": {"--importance-sampling-level": "sequence"},
    "loss cispo": {"--loss-type": "cispo", "--epsilon-high": "5.0"},
    "loss sapo": {"--loss-type": "sapo"},
    "num_iterations=2": {"--num-iterations": "2"},
    "scale_rewards batch": {"--scale-rewards": "batch"},
    "loss bnpo": {"--loss-type": "bnpo"},
    "loss luspo, sequence": {"--loss-type": "luspo", "--importance-sampling-level": "sequence"},
    "loss vespo": {"--loss-type": "vespo"},
    # Off-policy (mu = 2: the second pass's ratios differ from 1), where the objectives can part from grpo's;
    # compare with "num_iterations=2" (grpo at mu = 2), not with the center.
    "GSPO, num_iterations=2": {"--importance-sampling-level": "sequence", "--num-iterations": "2"},
    "loss cispo, num_iterations=2": {"--loss-type": "cispo", "--epsilon-high": "5.0", "--num-iterations": "2"},
    "loss sapo, num_iterations=2": {"--loss-type": "sapo", "--num-iterations": "2"},
    "old recipe (lr=5e-4, format=0.2, temperature=0.7)": {
        "--learning-rate": "5e-4",
        "--rewards": "correct=1.0,format=0.2",
        "--temperature": "0.7",
    },
}
SEEDS = (0, 1, 2)
GATE_GAIN = 0.10


def cell_flags(cell: str) -> list[str]:
    """The driver flags of a cell: the center's, with the cell's values in their place (each flag once:
    a dict flag given twice would merge, not replace)."""
    return [part for name, value in {**CENTER, **CELLS[cell]}.items() for part in (name, value)]


def folder_name(cell: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "=.-" else "_" for ch in cell)


def table(cells: dict[str, dict]) -> str:
    lines = [
        "| cell | seeds | paired accuracy gain (mean +- t-interval) | worst seed | lowest held-out accuracy seen | final accuracy | seeds passing the gate |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cell, c in cells.items():
        gain, low, final = c["accuracy_gain"], c["lowest_eval_accuracy"], c["final_accuracy"]
        n = len(c["seeds"])
        starts = {r["curve"][0]["eval_accuracy"] for r in c["seeds"].values()}
        start = f" (start {min(starts):.1%})" if len(starts) == 1 else ""
        ci = f" +- {gain['ci95']:.1%}" if gain["ci95"] is not None else ""
        passing = n - len(c["gate"]["failures"])
        lines.append(
            f"| {cell} | {n} | {gain['mean']:+.1%}{ci} | {gain['min']:+.1%} | {low['min']:.1%}{start} | {final['mean']:.1%} | {passing}/{n} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__, "recipe_sweep.json")
    p.add_argument("--cells", nargs="+", default=None, choices=list(CELLS), metavar="CELL", help="default: every cell")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    p.add_argument("--run-dir", type=Path, default=None, help="default: a new temporary folder; a cell's sweep already there is reused")
    p.add_argument(
        "--report",
        action="store_true",
        help="with --run-dir: the table of the runs it holds (each cell over its finished seeds); runs nothing",
    )
    args = p.parse_args(argv)
    if args.report and args.run_dir is None:
        p.error("--report needs --run-dir (the folder of a sweep's runs)")
    cells = args.cells or list(CELLS)
    iterations, eval_every, eval_size, extra = ITERATIONS, EVAL_EVERY, EVAL_SIZE, []
    if args.quick:
        cells, args.seeds = cells[:2], args.seeds[:1]
        iterations, eval_every, eval_size, extra = 2, 1, 4, quick_flags([])
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="grpo_flyte-sweep-"))
    settings = argparse.Namespace(iterations=iterations, eval_every=eval_every, eval_size=eval_size, seeds=args.seeds)
    print(f"sweep: {len(cells)} cells x {len(args.seeds)} seeds, each cell one sweep over its seeds; runs in {run_dir}")
    _common.flush()
    started = time.perf_counter()
    results = {}
    for cell in cells:
        folder = run_dir / folder_name(cell)
        if args.report:  # the seeds whose summary a finished sweep wrote
            per_seed = {
                seed: json.loads((folder / f"seed={seed}" / "learning_curve.json").read_text())
                for seed in args.seeds
                if (folder / f"seed={seed}" / "learning_curve.json").is_file()
            }
        else:
            print(f"\n== {cell}: {' '.join(cell_flags(cell))}", flush=True)
            per_seed, code = run_seeds(folder, settings, [*cell_flags(cell), *extra])
            if code != 0:
                print(f"{cell}: the sweep exited {code}; see {folder}", file=sys.stderr)
                return code
        if per_seed:
            results[cell] = {"flags": cell_flags(cell), **combine(per_seed, GATE_GAIN)}
    print("\n" + table(results))
    print(f"\n{(time.perf_counter() - started) / 60:.1f} min; runs in {run_dir}")
    # Some cells, or a report of what a folder holds, are not the committed table: only --out gets them.
    partial = args.report or args.cells is not None
    _common.write_result(
        args.out if partial else _common.out_file(args),
        {
            "benchmark": "recipe_sweep",
            "machine": _common.machine(),
            "iterations": iterations,
            "eval_every": eval_every,
            "eval_size": eval_size,
            "center": CENTER,
            "gate_gain": GATE_GAIN,
            "cells": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
