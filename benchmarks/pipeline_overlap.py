"""Generation ahead of training (--max-staleness 1) against the synchronous loop (0), on the real driver.

Part 1, the schedule: `train_rl` in Flyte local mode with stand-in generate and train tasks of fixed
durations (`_stand_ins.py`: no model, only time), once synchronously and once with K=1, alternately
per round. With generation and training each taking T, the synchronous loop takes about 2T per
iteration and the pipelined one about T after the first. Reports `speedup` (synchronous seconds /
pipelined seconds, the median over rounds) and `max_trained_staleness` (the most versions between
the adapter that generated a trained group and the one it trained). Target: speedup >= 1.6 at K=1,
staleness <= 1.

Part 2, for real: the embedded SmolLM2-135M-Instruct, the default config, K=0 and K=1 one after the
other, reporting each run's wall seconds (`wall_ratio`: K=0 / K=1), the mean `iteration_s` (the
wait for the batch and the train step: with K=1 generation runs outside it), and the held-out
reward (with its 95% interval) after the last iteration. On this 2-core CPU generation
and training share the cores, so little speed-up is expected here: the overlap pays where they run
on separate GPUs.

    python benchmarks/pipeline_overlap.py              # part 1: 6 iterations of 2 s + 2 s, 2 rounds; part 2: 4 iterations
    python benchmarks/pipeline_overlap.py --quick      # seconds: short stand-ins, a tiny real run of the tests' tiny model
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import _common
from _stand_ins import StandIns, run_loop

from grpo_flyte.config.run import RunConfig
from grpo_flyte.launch.cli import main as cli_main

TARGET = 1.6


def schedule_part(stage_s: float, iterations: int, rounds: int, root: Path) -> dict:
    counter = iter(range(1000))

    def side(k: int):
        def run() -> dict:
            folder = root / f"k{k}-{next(counter)}"
            stand_ins = StandIns(folder / "adapters", generate_s=stage_s, train_s=stage_s)
            config = RunConfig(
                iterations=iterations, max_staleness=k, eval_size=0, prompts_per_iter=4, group_size=2, min_informative_groups=0
            )
            started = time.perf_counter()
            run_loop(config, stand_ins, folder / "raw")
            s = time.perf_counter() - started
            staleness = max(version - g for version, generated_by in stand_ins.trained for g in generated_by)
            return {"s": s, "max_trained_staleness": staleness, "note": f"max staleness {staleness}"}

        return run

    runs = _common.alternate({"synchronous": side(0), "max_staleness=1": side(1)}, rounds)
    speedups = _common.paired_ratios(runs["synchronous"], runs["max_staleness=1"])
    return {
        "generate_s": stage_s,
        "train_s": stage_s,
        "iterations": iterations,
        "rounds": runs,
        "speedup": statistics.median(speedups),
        "max_trained_staleness": max(r["max_trained_staleness"] for r in runs["max_staleness=1"]),
    }


def real_part(iterations: int, flags: list[str], root: Path) -> dict:
    out = {}
    for k in (0, 1):
        run_dir = root / f"real-k{k}"
        started = time.perf_counter()
        code = cli_main(["--local", "--iterations", str(iterations), "--max-staleness", str(k), "--run-dir", str(run_dir), *flags])
        wall = time.perf_counter() - started
        if code != 0:
            raise SystemExit(f"the K={k} run failed (exit {code}); see {run_dir / 'run.log'}")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        trained = [r for r in rows if r["iteration"] > 0]
        last = rows[-1]
        out[f"max_staleness={k}"] = {
            "s_per_iteration": statistics.fmean(r["iteration_s"] for r in trained),
            "wall_s": wall,
            "batch_wait_s_mean": statistics.fmean(r["batch_wait_s"] for r in trained),
            "staleness_max": max(r["staleness_max"] for r in trained),
            "is_ess_mean": statistics.fmean(r["is_ess"] for r in trained),
            "eval_reward": last.get("eval_reward"),
            "eval_reward_ci95": last.get("eval_reward_ci95"),
            "eval_accuracy": last.get("eval_accuracy"),
        }
        print(f"  K={k}: {out[f'max_staleness={k}']}")
    sync, ahead = out["max_staleness=0"], out["max_staleness=1"]
    # The whole run's wall clock is the fair figure: with K=1 the first batch generates during the
    # evaluation before training, and each next one during a train step, outside `iteration_s`.
    out["wall_ratio"] = sync["wall_s"] / ahead["wall_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__, "pipeline_overlap.json")
    p.add_argument("--rounds", type=int, default=2, help="rounds of (synchronous, K=1) with stand-in tasks")
    p.add_argument("--iterations", type=int, default=4, help="iterations of each real run (part 2)")
    args = p.parse_args(argv)
    _common.quiet_logs()
    root = Path(tempfile.mkdtemp(prefix="grpo_flyte-pipeline-"))
    stage_s, iterations, rounds = (0.3, 4, 1) if args.quick else (2.0, 6, args.rounds)
    result = {"benchmark": "pipeline_overlap", "machine": _common.machine()}
    print(f"part 1: stand-in tasks, generate {stage_s:g} s and train {stage_s:g} s, {iterations} iterations, {rounds} rounds")
    result["stand_ins"] = schedule_part(stage_s, iterations, rounds, root)
    speedup, staleness = result["stand_ins"]["speedup"], result["stand_ins"]["max_trained_staleness"]
    print(f"  speedup {speedup:.2f}x ({_common.verdict(speedup, TARGET, higher_is_better=True)}), max trained staleness {staleness}")
    real_iterations = 2 if args.quick else args.iterations
    print(f"part 2: {_common.QUICK_MODEL if args.quick else 'the embedded model'}, {real_iterations} iterations with K=0, then with K=1")
    tiny = ["--prompts-per-iter", "2", "--group-size", "2", "--max-new-tokens", "8", "--eval-size", "4", "--min-informative-groups", "0"]
    quick = [*tiny, "--model", str(_common.quick_model())] if args.quick else []
    result["embedded"] = real_part(real_iterations, quick, root)  # the key of the full run's figures
    print(f"  wall seconds, K=0 / K=1: {result['embedded']['wall_ratio']:.2f}x")
    _common.write_result(_common.out_file(args), result)
    return 0 if speedup >= TARGET and staleness <= 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
